// slotserve_paged_attention and slotserve_rope_attention: causal attention of each query
// row over its own slot's K/V in the paged pool (slotserve.model.kv), on the tensor cores.
// The body of an mx.fast.cuda_kernel; the header is common.cuh, cp_async.cuh and mma.cuh.
//
// q [R, Hq*D], pools [blocks*128, D], tables [S, nbmax, Hkv], row_table / row_pos [R] (a row
// whose row_table is -1 is padding: zeros), tiles [NT] (the first row of each tile: up to
// TILE consecutive rows of one slot, ascending, a tile's rows ending where the next tile's
// begin), params [scale * log2 e], sinks [HQ] (attention sinks in log2 units, read where
// SINKS: attention_whole_out.cu, attention_combine.cu; else one unread element).
//
// A block (4 warps) takes up to TP rows of a tile and one kv head: its 64 mma rows are the
// rows' GQA query heads (mma row i: the tile's row i / G, query head i % G; rows past TP * G
// or past the tile: zeros), warp w mma rows 16w .. 16w + 15 (NARROW, where they fit in 16:
// all four warps hold rows 0 .. 15 and share each key block's work). Each key block of 128
// (at fixed absolute positions) is staged in shared memory once for all of them: S = Q K^T on the
// tensor cores (dimension steps of 16 in order), each row's max and sum over the block in a
// fixed order, P rounded to bf16, O = O * alpha + P V (key steps of 16 in order). An mma
// row's sums depend on its own query and the keys alone, and a key block past a row's last
// key (or before its window) leaves its sums as they are (alpha 1 or 0, p 0), so a row has
// the same bits in any tile: alone (a decode step) or among its prompt's rows (prefill).
//
// A row's keys are summed in splits of key blocks at fixed absolute positions (KeySplits),
// folded in split order (split_fold.cuh), in every launch it is in (decode or prefill), so
// its bits never depend on its batch. Where they are summed is the launch's choice
// (launch.attention_merge): slotserve_paged_attention_split takes a block per (tile part,
// kv head, split) and writes each split's running max, sum and P.V sums for
// attention_combine.cu to fold (decode: a long row's keys spread over the SMs); a whole
// kernel with MERGE walks all of its rows' keys and folds each split as its walk leaves it,
// keeping the folded P.V sums in `scratch` (prefill: blocks enough already, and no
// partials to write). A row whose keys fit one split gets its one split's bits either way.
//
// The kernels differ only where the wrapper (slotserve/kernels/cuda/sources.py)
// substitutes, once when the source is read:
//   line @BLOCK@  the block's tile, part `sub` of it, kv head h and split (-1: all of the
//                 rows' keys): attention_whole_block.cu or attention_split_block.cu
//   line @PAD@    a padding tile: zeros (attention_whole_pad.cu), or nothing for a split
//   line @OUT@    the result: the output rows (attention_whole_out.cu) or the split's
//                 partial sums (attention_split_out.cu)
//   line @FOLD@   fold_split() and the splits folded so far: kept in the block's part of
//                 scratch (attention_fold_scratch.cu, slotserve_paged_attention), or none
//                 (attention_fold_none.cu: kernels that never fold)
//   line @LAST@   (in attention_whole_out.cu) the row's max, sum and P.V sums: the last
//                 split folded in where MERGE (attention_last_fold.cu), else its one walk's
//                 (attention_last_run.cu)
//   line @Q@      the query rows into qs: paged_attention_query.cu (read q) or
//                 rope_attention_query.cu (rotate the row's fused QKV, write the new K/V
//                 into the pool; tiles of one row)
//   lines @PATCH_K@, @PATCH_V@  run on each staged key block's K, V: nothing, or
//                 rope_attention_patch_k.cu / _v.cu (patch the staged copy of the new
//                 position from registers)
// Template: T (pool dtype, bf16), G, D (head dim, a multiple of 16), WINDOW (sliding
// window, 0: none), TILE, SPLIT_BLOCKS, HEAD_SPLITS (attention_splits.cuh), SINKS (gpt-oss's
// attention sinks), MERGE.

  const int HKV = tables_shape[2];
  const int nbmax = tables_shape[1];
  const int HQ = HKV * G;
  const int R = row_table_shape[0];
  const int NT = tiles_shape[0];
  constexpr int TP = 64 / G < TILE ? 64 / G : TILE;  // rows a block takes
  constexpr int SUB = (TILE + TP - 1) / TP;  // blocks a tile takes (per kv head and split)
  // NARROW: the block's mma rows fit one warp's 16 (a decode row's query heads), so the
  // four warps hold the same rows and share each key block's work: warp w computes S of
  // keys 32w .. 32w + 31 (into ss, which every warp then reads whole) and the O columns of
  // dimension steps w, w + 4, ..; each element is summed as in the wide form, in the same
  // order, so a row has the same bits either way
  constexpr bool NARROW = TP * G <= 16;  // (launch.attention_narrow)
  constexpr int QROWS = NARROW ? 16 : 64;  // mma rows a block stages the queries of
  using Splits = KeySplits<SPLIT_BLOCKS, HEAD_SPLITS>;  // (attention_splits.cuh)
@BLOCK@
  // a tile of one row (TILE 1: a decode step's launch, whose tiles are 0, 1, ..) is its
  // own row: no tiles[] read in the chain of loads before the first K/V copy
  const int tile_first = TILE == 1 ? tile : tiles[tile];
  const int tile_end = TILE == 1 ? tile + 1
                                 : min(tile + 1 < NT ? tiles[tile + 1] : R, tile_first + TILE);
  const int first = tile_first + sub * TP;
  if (first >= tile_end) return;
  const int nrows = min(TP, tile_end - first);
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int g = lane >> 2, t4 = lane & 3;  // the mma fragment's row and column pair
  const int mwarp = NARROW ? 0 : warp;  // the warp whose 16 mma rows this thread holds
  // the O tiles (8 columns each) a thread holds: all D / 8, or NARROW only its warp's own
  // column pairs (w, w + 4, ..), so a decode block's registers (and blocks an SM) are not
  // spent on other warps' zeros. Tile n is the output's columns 8 o_cols(n) ..; NARROW, a
  // tile past D (the last pair of a warp, where D / 16 is no multiple of 4) stays zero
  constexpr int OT = NARROW ? 2 * ((D / 16 + 3) / 4) : D / 8;
  auto o_cols = [&](int n) { return NARROW ? 2 * (warp + 4 * (n >> 1)) + (n & 1) : n; };
  auto o_real = [&](int n) { return !NARROW || 8 * o_cols(n) < D; };  // a tile within D
  // the first row's position is read beside its table (not after the padding test), so the
  // block's key range waits on one load, not two in a row
  const int pos_first = row_pos[first];
  const int tb = row_table[first];
  if (tb < 0) {
@PAD@
    return;
  }
  const float scale = params[0];
  // the block's key range: from the first row's window start to the last row's position
  int pos_max = 0, lo_min = 0x7fffffff;
  for (int i = 0; i < nrows; ++i) {
    const int p = i == 0 ? pos_first : row_pos[first + i];
    pos_max = max(pos_max, p);
    lo_min = min(lo_min, (WINDOW > 0 && p - WINDOW + 1 > 0) ? p - WINDOW + 1 : 0);
  }
  const int jb_first = split < 0 ? lo_min / 128 : max(lo_min / 128, Splits::first(split));
  const int jb_last = split < 0 ? pos_max / 128 : min(pos_max / 128, Splits::first(split + 1) - 1);
  if (split >= 0 && Splits::first(split) > pos_max / 128) return;  // no row's keys here
  const int* table = tables + (size_t)tb * nbmax * HKV;
  // this thread's two mma rows (g and g + 8 of its warp's 16): launch row, head, key range
  int m_row[2], m_head[2], m_lo[2], m_pos[2];
#pragma unroll
  for (int e = 0; e < 2; ++e) {
    const int i = mwarp * 16 + g + 8 * e, pi = i / G;
    const bool real = i < TP * G && pi < nrows;
    m_row[e] = real ? first + pi : -1;
    m_head[e] = i % G;
    m_pos[e] = real ? row_pos[first + pi] : -1;
    m_lo[e] = (WINDOW > 0 && m_pos[e] - WINDOW + 1 > 0) ? m_pos[e] - WINDOW + 1 : 0;
  }
  const bool active = mwarp * 16 < nrows * G && mwarp * 16 < TP * G;  // real rows
  constexpr int QW = D + 8;  // bf16 a staged query row (padded: no bank conflicts)
  __shared__ __align__(16) __nv_bfloat16 qs[QROWS][QW];
  constexpr int KW = D / 8 + 1;  // 16-byte words a staged K or V row (padded)
  // [128][KW] K rows, then [128][KW] V rows
  extern __shared__ uint4 staged[];
  uint4* const ks = staged;
  uint4* const vs = staged + 128 * KW;
  // NARROW: a key block's S, kept in the staged K block itself (so a block's shared memory
  // is its K and V, and three blocks fit an SM): warp w's keys 32w .. 32w + 31, S [16][SW]
  // floats, over its own K rows 32w .., which only it reads
  constexpr int SW = 36;  // floats a row of a warp's S (padded: 4 banks a row, as 132 was)
  static_assert(!NARROW || 16 * SW * 4 <= 32 * KW * 16, "a warp's S fits in its K rows");
  auto ss_at = [&](int row, int key) {
    return reinterpret_cast<float*>(ks + (key >> 5) * 32 * KW) + row * SW + (key & 31);
  };
  // key block jb (pool block `page`) K or V rows up to pos_max copied in (all in flight at
  // once, cp.async), one commit group; V rows past them zeroed (p is 0 there, and 0 * NaN
  // would not be)
  auto stage = [&](uint4* dst, const T* pool, int jb, int page, bool zero_tail) {
    const size_t blk = (size_t)page * 128;
    const int n = min(128, pos_max + 1 - jb * 128);
    const uint4* src = reinterpret_cast<const uint4*>(pool + blk * D);
    for (int e = tid; e < n * (D / 8); e += 128)
      cp_async16(&dst[(e / (D / 8)) * KW + e % (D / 8)], src + e);
    if (zero_tail)
      for (int e = tid; e < (128 - n) * (D / 8); e += 128)
        dst[(n + e / (D / 8)) * KW + e % (D / 8)] = make_uint4(0u, 0u, 0u, 0u);
    cp_async_commit();
  };
  // the first key block's copies fly while the query is read (and rotated)
  if (jb_first <= jb_last) {
    const int page = table[jb_first * HKV + h];
    stage(ks, kpool, jb_first, page, false);
    stage(vs, vpool, jb_first, page, true);
  }
@Q@
  __syncthreads();
  float m_run[2] = {neg_inf(), neg_inf()}, l_run[2] = {0.0f, 0.0f};
  float o[OT][4];
#pragma unroll
  for (int n = 0; n < OT; ++n) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.0f;
@FOLD@
  // ldmatrix addresses: this lane's row of the warp's query fragment (matrices: rows 0-7
  // and 8-15 of dimensions 0-7, then of 8-15) and of a key-tile pair's K (keys 0-7 of
  // dimensions 0-7 and 8-15, then keys 8-15): one ldmatrix gives an mma step's A fragment,
  // or the B fragments of two key tiles
  const int lm = lane >> 3, lr = lane & 7;
  const __nv_bfloat16* q_lane = &qs[mwarp * 16 + lr + 8 * (lm & 1)][8 * (lm >> 1)];
  const __nv_bfloat16* k_lane =
      reinterpret_cast<const __nv_bfloat16*>(ks) + (8 * (lm >> 1) + lr) * (KW * 8) + 8 * (lm & 1);
  for (int jb = jb_first; jb <= jb_last; ++jb) {
    const bool more = jb < jb_last;
    // the next key block's pool block, read while this one's S is summed (read where it is
    // staged, each stage had waited on it)
    const int next_page = more ? table[(jb + 1) * HKV + h] : 0;
    cp_async_wait<1>();  // this block's K (its V may still be in flight)
@PATCH_K@
    __syncthreads();
    float s[16][4];  // S of keys 8j + 2 t4 .. of the block: rows g (0, 1) and g + 8 (2, 3)
#pragma unroll
    for (int j = 0; j < 16; ++j) s[j][0] = s[j][1] = s[j][2] = s[j][3] = 0.0f;
    if (active) {
#pragma unroll
      for (int ds = 0; ds < D / 16; ++ds) {
        uint32_t a[4];
        ldmatrix_x4(a, q_lane + 16 * ds);
#pragma unroll
        for (int j = 0; j < 16; j += 2) {
          if (NARROW && j / 4 != warp) continue;
          uint32_t b[4];  // key tiles j and j + 1
          ldmatrix_x4(b, k_lane + (8 * j) * (KW * 8) + 16 * ds);
          mma_bf16(s[j], a[0], a[1], a[2], a[3], b[0], b[1]);
          mma_bf16(s[j + 1], a[0], a[1], a[2], a[3], b[2], b[3]);
        }
      }
      if (NARROW) {
        __syncwarp();  // the warp's ldmatrix reads of its K rows are done: S goes over them
#pragma unroll
        for (int j = 0; j < 16; ++j)
          if (j / 4 == warp)
#pragma unroll
            for (int c = 0; c < 4; ++c) *ss_at(g + 8 * (c >> 1), 8 * j + 2 * t4 + (c & 1)) = s[j][c];
      }
    }
    __syncthreads();  // every warp is done with this block's K (NARROW: and wrote its S)
    if (NARROW) {
      if (active)
#pragma unroll
        for (int j = 0; j < 16; ++j)
#pragma unroll
          for (int c = 0; c < 4; ++c) s[j][c] = *ss_at(g + 8 * (c >> 1), 8 * j + 2 * t4 + (c & 1));
      __syncthreads();  // every warp has read S: the next K block may land over it
    }
    if (more) stage(ks, kpool, jb + 1, next_page, false); else cp_async_commit();
    float alpha[2];
    if (active) {
      // mask and scale, each row's max over the block (exact in any order), the new
      // running max; p rounded to bf16 (what P V multiplies) and summed in a fixed order
      const int key0 = jb * 128 + 2 * t4;
      float bmax[2] = {neg_inf(), neg_inf()};
      // a key block inside every one of the warp's rows' ranges (the rows of a long
      // prompt's walk but its last blocks) has no key to mask: the same products, without
      // the per-key tests
      const bool inside = __all_sync(0xffffffffu, jb * 128 >= max(m_lo[0], m_lo[1]) &&
                                                      jb * 128 + 127 <= min(m_pos[0], m_pos[1]));
      if (inside) {
#pragma unroll
        for (int j = 0; j < 16; ++j)
#pragma unroll
          for (int c = 0; c < 4; ++c) {
            s[j][c] *= scale;
            bmax[c >> 1] = fmaxf(bmax[c >> 1], s[j][c]);
          }
      } else {
#pragma unroll
        for (int j = 0; j < 16; ++j)
#pragma unroll
          for (int c = 0; c < 4; ++c) {
            const int e = c >> 1, key = key0 + 8 * j + (c & 1);
            const bool valid = key >= m_lo[e] && key <= m_pos[e];
            s[j][c] = valid ? s[j][c] * scale : neg_inf();
            bmax[e] = fmaxf(bmax[e], s[j][c]);
          }
      }
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        bmax[e] = fmaxf(bmax[e], __shfl_xor_sync(0xffffffffu, bmax[e], 1));
        bmax[e] = fmaxf(bmax[e], __shfl_xor_sync(0xffffffffu, bmax[e], 2));
        const float m_new = fmaxf(m_run[e], bmax[e]);
        alpha[e] = m_run[e] == neg_inf() ? 0.0f : exp2f(m_run[e] - m_new);
        m_run[e] = m_new;
      }
      float bsum[2] = {0.0f, 0.0f};
#pragma unroll
      for (int j = 0; j < 16; ++j)
#pragma unroll
        for (int c = 0; c < 4; ++c) {
          const int e = c >> 1;
          const float p = s[j][c] == neg_inf() ? 0.0f : exp2f(s[j][c] - m_run[e]);
          s[j][c] = __bfloat162float(__float2bfloat16_rn(p));
          bsum[e] += s[j][c];
        }
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        bsum[e] += __shfl_xor_sync(0xffffffffu, bsum[e], 1);
        bsum[e] += __shfl_xor_sync(0xffffffffu, bsum[e], 2);
        l_run[e] = __fmaf_rn(l_run[e], alpha[e], bsum[e]);
      }
#pragma unroll
      for (int n = 0; n < OT; ++n) {
        o[n][0] *= alpha[0];
        o[n][1] *= alpha[0];
        o[n][2] *= alpha[1];
        o[n][3] *= alpha[1];
      }
    }
    cp_async_wait<1>();  // this block's V
@PATCH_V@
    __syncthreads();
    if (active) {
      // O += P V, key steps of 16 in order; V's fragments transposed out of its rows
      const int vkey = ((lane >> 3) & 1) * 8 + (lane & 7), vcol = (lane >> 4) * 8;
      const __nv_bfloat16* vb = reinterpret_cast<const __nv_bfloat16*>(vs);
#pragma unroll
      for (int ks16 = 0; ks16 < 8; ++ks16) {
        const uint32_t a0 = pack_bf16(s[2 * ks16][0], s[2 * ks16][1]);
        const uint32_t a1 = pack_bf16(s[2 * ks16][2], s[2 * ks16][3]);
        const uint32_t a2 = pack_bf16(s[2 * ks16 + 1][0], s[2 * ks16 + 1][1]);
        const uint32_t a3 = pack_bf16(s[2 * ks16 + 1][2], s[2 * ks16 + 1][3]);
#pragma unroll
        for (int q = 0; q < OT / 2; ++q) {
          if (!o_real(2 * q)) continue;
          const int np = o_cols(2 * q) / 2;  // the column pair of O tiles 2q, 2q + 1
          uint32_t b[4];
          ldmatrix_x4_trans(b, vb + (size_t)(16 * ks16 + vkey) * (KW * 8) + 16 * np + vcol);
          mma_bf16(o[2 * q], a0, a1, a2, a3, b[0], b[1]);
          mma_bf16(o[2 * q + 1], a0, a1, a2, a3, b[2], b[3]);
        }
      }
    }
    __syncthreads();  // every warp is done with this block's V
    if (more) stage(vs, vpool, jb + 1, next_page, true); else cp_async_commit();
    if (MERGE && more && Splits::of(jb + 1) != Splits::of(jb)) fold_split();
  }
@OUT@
