// paged_attention.cu's @FOLD@ for slotserve_paged_attention (the whole kernel, MERGE or
// not): fold_split() and the splits folded so far (split_fold.cuh). The folded P.V sums are
// D / 2 floats a thread in scratch: element (n, c) at fold_acc[(4n + c) * 128], this
// block's part of scratch by [element][thread] (a warp's accesses coalesce; each thread
// reads back only what it wrote). Without MERGE scratch is one unread float.

  float m_fold[2] = {neg_inf(), neg_inf()}, l_fold[2] = {0.0f, 0.0f};
  float* const fold_acc = scratch + (size_t)blockIdx.x * (D / 2) * 128 + tid;
  // fold the split just summed into m_fold, l_fold, fold_acc, and start the next at zero.
  // Every folded sum is read back before any is written: one memory round trip a fold,
  // where a read, fold and write per element had cost one each (a fifth of the long
  // prompt's attention time, Nsight Compute's stall samples).
  auto fold_split = [&]() {
    if (!active) return;
    SplitFold f[2];
#pragma unroll
    for (int e = 0; e < 2; ++e) f[e] = split_fold(m_fold[e], m_run[e]);
    float prev[OT][4];
#pragma unroll
    for (int n = 0; n < OT; ++n)
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        const bool read = !f[c >> 1].skip && !f[c >> 1].take && o_real(n);
        prev[n][c] = read ? fold_acc[(4 * n + c) * 128] : 0.0f;
      }
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      m_fold[e] = split_fold_max(f[e], m_fold[e]);
      l_fold[e] = split_fold_sum(f[e], l_fold[e], l_run[e]);
      m_run[e] = neg_inf();
      l_run[e] = 0.0f;
    }
#pragma unroll
    for (int n = 0; n < OT; ++n)
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        const SplitFold& fe = f[c >> 1];
        if (!fe.skip && o_real(n))
          fold_acc[(4 * n + c) * 128] = fe.take ? o[n][c] : split_fold_sum(fe, prev[n][c], o[n][c]);
        o[n][c] = 0.0f;
      }
  };
