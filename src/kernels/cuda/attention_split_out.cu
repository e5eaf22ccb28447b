// paged_attention.cu's @OUT@ for slotserve_paged_attention_split: the split's P.V sums,
// running max and running sum of each of the block's rows (those whose keys reach the
// split) and query heads, as floats into partials[r, h, split, head, :].

  if (active) {
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      if (m_row[e] < 0 || split > Splits::of(m_pos[e] / 128)) continue;
      float* dst = partials + (((size_t)m_row[e] * HKV + h) * S + split) * G * (D + 2)
          + (size_t)m_head[e] * (D + 2);
#pragma unroll
      for (int n = 0; n < OT; ++n) {
        const int col = 8 * o_cols(n) + 2 * t4;
        if (NARROW && col >= D) continue;  // a tile past D
        dst[col] = o[n][2 * e];
        dst[col + 1] = o[n][2 * e + 1];
      }
      if (t4 == 0 && mwarp == warp) {  // NARROW: warp 0 (every warp has the same sums)
        dst[D] = m_run[e];
        dst[D + 1] = l_run[e];
      }
    }
  }
