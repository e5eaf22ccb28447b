// paged_attention.cu's @OUT@ for the whole kernels: the output row, bf16. With SINKS
// (gpt-oss) each query head's sink logit (sinks [HQ], log2 units) is one more term of the
// softmax that weights no value, folded in after the last key block: the running max and
// sum rescaled to max(run_max, sink), exactly as attention_combine.cu does for one split.

  if (tid < D) {
#pragma unroll
    for (int gg = 0; gg < G; ++gg) {
      float a = acc[gg], sum = run_sum[gg];
      if (SINKS) {
        const float sink = sinks[h * G + gg];
        const float m = fmaxf(run_max[gg], sink);
        const float f = run_max[gg] == m ? 1.0f : exp2f(run_max[gg] - m);
        a = __fmaf_rn(a, f, -0.0f);
        sum = __fmaf_rn(sum, f, -0.0f) + exp2f(sink - m);
      }
      out[base + (size_t)gg * D + tid] = __float2bfloat16(a / sum);
    }
  }
