// paged_attention.cu's @OUT@ for the whole kernels: the output rows, bf16 (each thread its
// two mma rows' column pairs), from the row's max, sum and P.V sums (@LAST@: MERGE folds
// the last split in first). With SINKS (gpt-oss) each query head's sink logit (sinks [HQ],
// log2 units) is one more term of the softmax that weights no value, folded in after the
// last key block (attention_out.cuh). NARROW: a warp writes its own columns.

  if (active) {
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      if (m_row[e] < 0) continue;
@LAST@
      float f, sum;
      attention_out_scale(m, l, SINKS, SINKS ? sinks[h * G + m_head[e]] : 0.0f, f, sum);
      __nv_bfloat16* dst = reinterpret_cast<__nv_bfloat16*>(out)
          + ((size_t)m_row[e] * HQ + h * G + m_head[e]) * D + 2 * t4;
#pragma unroll
      for (int n = 0; n < OT; ++n) {
        if (!o_real(n)) continue;  // a tile past D
        *reinterpret_cast<__nv_bfloat162*>(dst + 8 * o_cols(n)) = __floats2bfloat162_rn(
            attention_out_value(value(n, 2 * e), SINKS, f, sum),
            attention_out_value(value(n, 2 * e + 1), SINKS, f, sum));
      }
    }
  }
