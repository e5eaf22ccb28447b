// paged_attention.cu's @OUT@ for the whole kernels: the output row, bf16.

  if (tid < D) {
#pragma unroll
    for (int gg = 0; gg < G; ++gg)
      out[base + (size_t)gg * D + tid] = __float2bfloat16(acc[gg] / run_sum[gg]);
  }
