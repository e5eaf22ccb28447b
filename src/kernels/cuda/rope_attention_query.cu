// paged_attention.cu's query for slotserve_rope_attention and _split (substituted at its
// @Q@ line): the query made from the row's fused QKV projection qkv [R, (HQ + 2 HKV) * D]
// with the cos_t/sin_t rows of its position, and the new K/V of the block's kv head written
// into the pool row write_rows [n <= R, HKV] gives. Only launched with one row a slot and a
// tile (a decode step), so the block of each (row, kv head) holding the new position (the
// whole kernel's, or the split's whose key blocks hold it) owns its new K/V, and no block
// reads another's: a split before it never reads that position's key block.

  // q rotated and rounded as rope_write stores it (mma rows past the G heads: zeros);
  // thread d < D: dimension d of this kv head's new key (rotated) and value, written into
  // the pool row write_rows gives (rows past write_rows: padding, no write) and kept to
  // patch the staged copy of position pos
  const int W = (HQ + 2 * HKV) * D;
  const int p0 = row_pos[first];
  const T* qr = qkv + (size_t)first * W;
  const T* ct = cos_t + (size_t)p0 * D;
  const T* st = sin_t + (size_t)p0 * D;
  for (int i = tid; i < QROWS * (D / 2); i += 128) {
    const int mr = i / (D / 2), d = i % (D / 2);
    float o1 = 0.0f, o2 = 0.0f;
    if (mr < G) {
      const T* src = qr + (size_t)(h * G + mr) * D;
      rope_rotate(static_cast<float>(src[d]), static_cast<float>(src[d + D / 2]), ct + d,
                  st + d, D / 2, o1, o2);
    }
    qs[mr][d] = static_cast<T>(o1);
    qs[mr][d + D / 2] = static_cast<T>(o2);
  }
  const bool writes =
      first < write_rows_shape[0] && (split < 0 || split == Splits::of(p0 / 128));
  T newk = static_cast<T>(0.0f), newv = static_cast<T>(0.0f);
  if (tid < D) {
    const int d = tid % (D / 2);
    const T* ksrc = qr + (size_t)(HQ + h) * D;
    float o1, o2;
    rope_rotate(static_cast<float>(ksrc[d]), static_cast<float>(ksrc[d + D / 2]), ct + d,
                st + d, D / 2, o1, o2);
    newk = static_cast<T>(tid < D / 2 ? o1 : o2);
    newv = qr[(size_t)(HQ + HKV + h) * D + tid];
    if (writes) {
      const size_t dst = (size_t)write_rows[(size_t)first * HKV + h] * D + tid;
      const_cast<T*>(kpool)[dst] = newk;
      const_cast<T*>(vpool)[dst] = newv;
    }
  }
