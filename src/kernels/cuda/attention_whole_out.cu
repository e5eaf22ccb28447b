// paged_attention.cu's @OUT@ for the whole kernels: the output rows, bf16 (each thread its
// two mma rows' column pairs). MERGE: the last split is folded in first, as
// attention_combine.cu folds a split launch's partials. With SINKS (gpt-oss) each query
// head's sink logit (sinks [HQ], log2 units) is one more term of the softmax that weights
// no value, folded in after the last key block (split_fold_out). NARROW: a warp writes its
// own columns.

  if (active) {
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      if (m_row[e] < 0) continue;
      const SplitFold last = split_fold(m_fold[e], m_run[e]);
      const float m = MERGE ? split_fold_max(last, m_fold[e]) : m_run[e];
      const float l = MERGE ? split_fold_sum(last, l_fold[e], l_run[e]) : l_run[e];
      float f, sum;
      split_fold_out(m, l, SINKS, SINKS ? sinks[h * G + m_head[e]] : 0.0f, f, sum);
      // a P.V sum of this thread: the last split folded in (MERGE) or as it is
      auto value = [&](int n, int c) {
        if (!MERGE || last.take) return o[n][c];
        const float a = fold_acc[(4 * n + c) * 128];
        return last.skip ? a : split_fold_sum(last, a, o[n][c]);
      };
      __nv_bfloat16* dst = reinterpret_cast<__nv_bfloat16*>(out)
          + ((size_t)m_row[e] * HQ + h * G + m_head[e]) * D + 2 * t4;
#pragma unroll
      for (int n = 0; n < D / 8; ++n) {
        if (NARROW && (n >> 1) % 4 != warp) continue;  // another warp's columns
        *reinterpret_cast<__nv_bfloat162*>(dst + 8 * n) = __floats2bfloat162_rn(
            split_fold_value(value(n, 2 * e), SINKS, f, sum),
            split_fold_value(value(n, 2 * e + 1), SINKS, f, sum));
      }
    }
  }
