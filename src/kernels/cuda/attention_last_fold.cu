// attention_whole_out.cu's @LAST@ for slotserve_paged_attention: MERGE, the last split
// folded in (split_fold.cuh), as attention_combine.cu folds a split launch's partials;
// without it, the row's one walk.

      const SplitFold last = split_fold(m_fold[e], m_run[e]);
      const float m = MERGE ? split_fold_max(last, m_fold[e]) : m_run[e];
      const float l = MERGE ? split_fold_sum(last, l_fold[e], l_run[e]) : l_run[e];
      // a P.V sum of this thread: the last split folded in (MERGE) or as it is
      auto value = [&](int n, int c) {
        if (!MERGE || last.take) return o[n][c];
        const float a = fold_acc[(4 * n + c) * 128];
        return last.skip ? a : split_fold_sum(last, a, o[n][c]);
      };
