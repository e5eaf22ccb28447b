// paged_attention.cu's @OUT@ for the whole kernels: the output rows, bf16 (each thread its
// two mma rows' column pairs). With SINKS (gpt-oss) each query head's sink logit (sinks
// [HQ], log2 units) is one more term of the softmax that weights no value, folded in after
// the last key block: the running max and sum rescaled to max(run_max, sink), exactly as
// attention_combine.cu does for one split. NARROW: a warp writes its own columns.

  if (active) {
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      if (m_row[e] < 0) continue;
      float sum = l_run[e], f = 1.0f;
      if (SINKS) {
        const float sink = sinks[h * G + m_head[e]];
        const float m = fmaxf(m_run[e], sink);
        f = m_run[e] == m ? 1.0f : exp2f(m_run[e] - m);
        sum = __fmaf_rn(sum, f, -0.0f) + exp2f(sink - m);
      }
      __nv_bfloat16* dst = reinterpret_cast<__nv_bfloat16*>(out)
          + ((size_t)m_row[e] * HQ + h * G + m_head[e]) * D + 2 * t4;
#pragma unroll
      for (int n = 0; n < D / 8; ++n) {
        if (NARROW && (n >> 1) % 4 != warp) continue;  // another warp's columns
        float a0 = o[n][2 * e], a1 = o[n][2 * e + 1];
        if (SINKS) {
          a0 = __fmaf_rn(a0, f, -0.0f);
          a1 = __fmaf_rn(a1, f, -0.0f);
        }
        *reinterpret_cast<__nv_bfloat162*>(dst + 8 * n) = __floats2bfloat162_rn(a0 / sum, a1 / sum);
      }
    }
  }
