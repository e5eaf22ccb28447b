// slotserve_paged_attention and slotserve_rope_attention: causal attention of each query
// row over its own slot's K/V in the paged pool (slotserve.model.kv). The body of an
// mx.fast.cuda_kernel; the header is common.cuh and cp_async.cuh.
//
// One block (128 threads) per (row, kv head) takes the GQA group's G query heads; q
// [R, Hq*D], pools [blocks*128, D], tables [S, nbmax, Hkv], row_table / row_pos [R] (a row
// whose row_table is -1 is padding: zeros), params [scale * log2 e], sinks [HQ] (attention
// sinks in log2 units, read where SINKS: attention_whole_out.cu, attention_combine.cu; else
// one unread element). Online softmax over key
// blocks of 128 at fixed absolute positions, so a position's output never depends on how
// it was batched.
//
// Long rows are split (slotserve_paged_attention_split): a block per (row, kv head, split)
// takes the key blocks of one split of SPLIT_BLOCKS blocks at fixed absolute positions and
// writes its running max, sum and P.V sums; attention_combine.cu then combines a row's
// splits in split order. A row whose keys fit one split gets the bits of the whole kernel
// (the combine multiplies its one split by exp2(0) = 1), and a longer row is split in every
// launch it is in (decode or prefill), so a position's bits never depend on its batch.
//
// The kernels differ only where the wrapper (slotserve/kernels/cuda/sources.py)
// substitutes, once when the source is read:
//   line @BLOCK@  the block's row r, kv head h and split (-1: all of the row's keys):
//                 attention_whole_block.cu or attention_split_block.cu
//   line @PAD@    a padding row: zeros (attention_whole_pad.cu), or nothing for a split
//   line @OUT@    the result: the output row (attention_whole_out.cu) or the split's
//                 partial sums (attention_split_out.cu)
//   line @Q@      the query: paged_attention_query.cu (read q) or rope_attention_query.cu
//                 (rotate the row's fused QKV, write the new K/V into the pool)
//   line @PATCH@  run on each staged key block: nothing, or rope_attention_patch.cu (patch
//                 the staged copy of the new position from registers)
// Template: T (pool dtype), G, D (head dim), WINDOW (sliding window, 0: none), STAGED (each
// key block's K/V copied to shared memory first; rope_attention always is), SPLIT_BLOCKS,
// SINKS (gpt-oss's attention sinks).

  const int HKV = tables_shape[2];
  const int nbmax = tables_shape[1];
  const int HQ = HKV * G;
@BLOCK@
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  __shared__ float qs[G][D];
  __shared__ float ps[G][128];
  __shared__ float part[G][4];
  constexpr int DPL = (D + 31) / 32;  // output dimensions per lane in P.V
  __shared__ float pvs[4][G][DPL * 32];  // each warp's P.V partial
  const size_t base = ((size_t)r * HQ + (size_t)h * G) * D;
  const int tb = row_table[r];
  if (tb < 0) {
@PAD@
    return;
  }
  const float scale = params[0];
  const int pos = row_pos[r];
  const int lo = (WINDOW > 0 && pos - WINDOW + 1 > 0) ? pos - WINDOW + 1 : 0;
  const int* table = tables + (size_t)tb * nbmax * HKV;
  // STAGED: each key block's K and V copied to shared memory with all its loads in flight
  // at once (cp.async), one memory round trip a block; else read in place, ~6 dependent
  // round trips a block (a one-row launch has one warp per scheduler to hide them)
  constexpr int KW = D / 8 + 1;  // 16-byte words per staged K row (padded: no bank conflicts)
  extern __shared__ uint4 staged[];  // [128][KW] K rows, then [128][D / 8] V rows
  auto stage = [&](int jb) {  // key block jb's copies, issued (waited for where it is used)
    const size_t blk = (size_t)table[jb * HKV + h] * 128;
    const int n = min(128, pos + 1 - jb * 128);  // keys of this block up to pos
    const uint4* kg = reinterpret_cast<const uint4*>(kpool + blk * D);
    const uint4* vg = reinterpret_cast<const uint4*>(vpool + blk * D);
    if (tid < n) {
#pragma unroll
      for (int c = 0; c < D / 8; ++c) cp_async16(&staged[tid * KW + c], kg + tid * (D / 8) + c);
    }
    for (int e = tid; e < n * (D / 8); e += 128) cp_async16(&staged[128 * KW + e], vg + e);
    cp_async_commit();
  };
  // the first key block's copies fly while the query is read (and rotated)
  // the key blocks this block takes: all of the row's, or those of its split
  const int jb_first = split < 0 ? lo / 128 : max(lo / 128, split * SPLIT_BLOCKS);
  const int jb_last = split < 0 ? pos / 128 : min(pos / 128, split * SPLIT_BLOCKS + SPLIT_BLOCKS - 1);
  if (STAGED) stage(jb_first);
@Q@
  __syncthreads();
  float run_max[G], run_sum[G], acc[G];
#pragma unroll
  for (int gg = 0; gg < G; ++gg) { run_max[gg] = neg_inf(); run_sum[gg] = 0.0f; acc[gg] = 0.0f; }
  for (int jb = jb_first; jb <= jb_last; ++jb) {
    const size_t blk = (size_t)table[jb * HKV + h] * 128;
    const int key = jb * 128 + tid;
    const bool valid = key >= lo && key <= pos;
    const int n = min(128, pos + 1 - jb * 128);  // keys of this block up to pos
    if (STAGED) {
      if (jb > jb_first) stage(jb);  // (the previous block's readers are done: see the end)
      cp_async_wait<0>();
@PATCH@
      __syncthreads();
    }
    float s[G];
#pragma unroll
    for (int gg = 0; gg < G; ++gg) s[gg] = 0.0f;
    if (valid) {  // the key row in pieces of 8 loads issued together (latency, not order)
      const uint4* krow = STAGED ? staged + tid * KW
                                 : reinterpret_cast<const uint4*>(kpool + (blk + tid) * D);
      constexpr int PIECE = D / 8 < 8 ? D / 8 : 8;
#pragma unroll
      for (int c0 = 0; c0 < D / 8; c0 += PIECE) {
        uint4 kv[PIECE];
#pragma unroll
        for (int u = 0; u < PIECE; ++u) kv[u] = krow[c0 + u];
#pragma unroll
        for (int u = 0; u < PIECE; ++u) {
          const int c = c0 + u;
          const uint32_t kw[4] = {kv[u].x, kv[u].y, kv[u].z, kv[u].w};
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const float k0 = bf_lo(kw[e]), k1 = bf_hi(kw[e]);
#pragma unroll
            for (int gg = 0; gg < G; ++gg) {
              s[gg] = __fmaf_rn(qs[gg][c * 8 + 2 * e], k0, s[gg]);
              s[gg] = __fmaf_rn(qs[gg][c * 8 + 2 * e + 1], k1, s[gg]);
            }
          }
        }
      }
    }
    // block max and the new running max, per query head
    float m_new[G], alpha[G];
#pragma unroll
    for (int gg = 0; gg < G; ++gg) {
      s[gg] = valid ? s[gg] * scale : neg_inf();
      float m = s[gg];
      for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
      if (lane == 0) part[gg][warp] = m;
    }
    __syncthreads();
#pragma unroll
    for (int gg = 0; gg < G; ++gg) {
      const float m = fmaxf(fmaxf(part[gg][0], part[gg][1]), fmaxf(part[gg][2], part[gg][3]));
      m_new[gg] = fmaxf(run_max[gg], m);
      alpha[gg] = run_max[gg] == neg_inf() ? 0.0f : exp2f(run_max[gg] - m_new[gg]);
      const float p = valid ? exp2f(s[gg] - m_new[gg]) : 0.0f;
      ps[gg][tid] = p;
    }
    __syncthreads();
    // block sum of p (fixed tree), then the running sum
#pragma unroll
    for (int gg = 0; gg < G; ++gg) {
      float p = ps[gg][tid];
      for (int o = 16; o > 0; o >>= 1) p += __shfl_xor_sync(0xffffffffu, p, o);
      if (lane == 0) part[gg][warp] = p;
    }
    __syncthreads();
#pragma unroll
    for (int gg = 0; gg < G; ++gg) {
      const float bsum = (part[gg][0] + part[gg][1]) + (part[gg][2] + part[gg][3]);
      run_sum[gg] = __fmaf_rn(run_sum[gg], alpha[gg], bsum);
      run_max[gg] = m_new[gg];
    }
    // P.V: warp w takes keys 32w .. 32w+31 of the block (lane l: dimensions l, l+32, ..),
    // 8 keys' loads in flight at a time; then thread d sums the warps' partials in warp
    // order and rescales its running sum: a fixed order, whatever the batch
    {
      const int j1 = min(n, warp * 32 + 32);
      const T* vb = STAGED ? reinterpret_cast<const T*>(staged + 128 * KW) : vpool + blk * D;
      float pv[G][DPL];
#pragma unroll
      for (int gg = 0; gg < G; ++gg)
#pragma unroll
        for (int i = 0; i < DPL; ++i) pv[gg][i] = 0.0f;
      int j = warp * 32;
      for (; j + 8 <= j1; j += 8) {
        float v[8][DPL];
#pragma unroll
        for (int u = 0; u < 8; ++u)
#pragma unroll
          for (int i = 0; i < DPL; ++i)
            v[u][i] = lane + 32 * i < D
                ? static_cast<float>(vb[(size_t)(j + u) * D + lane + 32 * i]) : 0.0f;
#pragma unroll
        for (int u = 0; u < 8; ++u)
#pragma unroll
          for (int gg = 0; gg < G; ++gg)
#pragma unroll
            for (int i = 0; i < DPL; ++i) pv[gg][i] = __fmaf_rn(ps[gg][j + u], v[u][i], pv[gg][i]);
      }
      for (; j < j1; ++j) {
#pragma unroll
        for (int i = 0; i < DPL; ++i) {
          const float v = lane + 32 * i < D
              ? static_cast<float>(vb[(size_t)j * D + lane + 32 * i]) : 0.0f;
#pragma unroll
          for (int gg = 0; gg < G; ++gg) pv[gg][i] = __fmaf_rn(ps[gg][j], v, pv[gg][i]);
        }
      }
#pragma unroll
      for (int gg = 0; gg < G; ++gg)
#pragma unroll
        for (int i = 0; i < DPL; ++i) pvs[warp][gg][lane + 32 * i] = pv[gg][i];
    }
    __syncthreads();
    if (tid < D) {
#pragma unroll
      for (int gg = 0; gg < G; ++gg) {
        const float sum = ((pvs[0][gg][tid] + pvs[1][gg][tid]) + pvs[2][gg][tid]) + pvs[3][gg][tid];
        acc[gg] = __fmaf_rn(acc[gg], alpha[gg], sum);
      }
    }
    __syncthreads();
  }
@OUT@
