// paged_attention.cu's @OUT@ for slotserve_paged_attention_split: the split's P.V sums,
// running max and running sum per query head, as floats into partials[r, h, split, gg, :].

  {
    float* dst = partials + (((size_t)r * HKV + h) * S + split) * G * (D + 2);
    if (tid < D) {
#pragma unroll
      for (int gg = 0; gg < G; ++gg) dst[(size_t)gg * (D + 2) + tid] = acc[gg];
    }
    if (tid == 0) {
#pragma unroll
      for (int gg = 0; gg < G; ++gg) {
        dst[(size_t)gg * (D + 2) + D] = run_max[gg];
        dst[(size_t)gg * (D + 2) + D + 1] = run_sum[gg];
      }
    }
  }
