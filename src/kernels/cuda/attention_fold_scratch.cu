// paged_attention.cu's @FOLD@ for slotserve_paged_attention (the whole kernel, MERGE or
// not): fold_split() and the splits folded so far (split_fold.cuh). The folded P.V sums are
// D / 2 floats a thread in scratch: element (n, c) at fold_acc[(4n + c) * 128], this
// block's part of scratch by [element][thread] (a warp's accesses coalesce; each thread
// reads back only what it wrote). Without MERGE scratch is one unread float.

  float m_fold[2] = {neg_inf(), neg_inf()}, l_fold[2] = {0.0f, 0.0f};
  float* const fold_acc = scratch + (size_t)blockIdx.x * (D / 2) * 128 + tid;
  // fold the split just summed into m_fold, l_fold, fold_acc, and start the next at zero
  auto fold_split = [&]() {
    if (!active) return;
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const SplitFold f = split_fold(m_fold[e], m_run[e]);
      m_fold[e] = split_fold_max(f, m_fold[e]);
      l_fold[e] = split_fold_sum(f, l_fold[e], l_run[e]);
      m_run[e] = neg_inf();
      l_run[e] = 0.0f;
#pragma unroll
      for (int n = 0; n < D / 8; ++n) {
        if (!f.skip && !(NARROW && (n >> 1) % 4 != warp))
#pragma unroll
          for (int c = 2 * e; c < 2 * e + 2; ++c) {
            float& a = fold_acc[(4 * n + c) * 128];
            a = f.take ? o[n][c] : split_fold_sum(f, a, o[n][c]);
          }
        o[n][2 * e] = o[n][2 * e + 1] = 0.0f;
      }
    }
  };
