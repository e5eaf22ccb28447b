// slotserve_q4_matmul: y = x W^T for MLX affine 4-bit weights (group 64), bf16 in and out.
// The body of an mx.fast.cuda_kernel: MLX writes the signature from the input and output
// names (x, wp, sp, res, nw -> y) and the template arguments; the header is common.cuh,
// cp_async.cuh, norm_row.cuh and q4_matmul.cuh.
//
// Weights and scales are repacked once at load (q4_pack) so that every warp load is one
// contiguous 512-byte (weights) or 64-byte (scales) piece holding exactly the mma
// fragments its threads need. Thread (g = lane/4, t = lane%4) of an mma takes k =
// 16t..16t+15 of each 64-wide group: for step s, mma k-slots (2t, 2t+1) hold k
// 16t+4s+{0,1} and slots (2t+8, 2t+9) hold 16t+4s+{2,3}, for x and w alike (a fixed
// permutation of k inside the group, the same for every row).
//   wp [N/8, K/128, 32 lanes, 4]: lane's words 2t, 2t+1 of row 8*tile+g, groups 2c, 2c+1
//   sp [N/8, K/128, 4 (t), 4]: (scale, bias) bf16 pairs of columns 8*tile+2t+{0,1},
//                              groups 2c, 2c+1
// x [M, K] bf16 -> y [M, N] bf16 (SWIGLU: [M, N/2]); a block covers 8*NT columns and
// 16*MT rows with 32*KSPLIT threads.
//
// Template (the launch shape, chosen in slotserve/kernels/cuda/launch.py):
//   MT, NT    row tiles of 16 and column tiles of 8 per block
//   KSPLIT    warps splitting K, a function of K alone (the summation order)
//   STAGES    cp.async ring depth per warp
//   SWIGLU    column tiles come in (gate, up) pairs: y = silu(gate) * up
//   RESID     y = product + res (res [M, N])
//   NORM      x is RMS-normalized with nw and EPS in the prologue (the rows go in
//             shared memory after the rings: the launch's size grows with M x K)

  const int M = x_shape[0];
  const int K = x_shape[1];
  const int N = wp_shape[0] * 8;
  const int chunks = K / 128;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int g = lane >> 2, t = lane & 3;
  // the row blocks of a column block are neighbours in launch order, so they run together
  // and the second reads the weights from L2, not HBM
  const int row_blocks = (M + 16 * MT - 1) / (16 * MT);
  const int tile0 = (blockIdx.x / row_blocks) * NT;
  const int m_base = (blockIdx.x % row_blocks) * 16 * MT;
  const int per_warp = chunks / KSPLIT;
  const int c0 = warp * per_warp;
  const int mt_live = min(MT, (M - m_base + 15) / 16);

  float acc[MT][NT][4];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
      for (int c = 0; c < 4; ++c) acc[mt][nt][c] = 0.0f;

  const uint4* wv = reinterpret_cast<const uint4*>(wp);
  const uint4* sv = reinterpret_cast<const uint4*>(sp);

  // each warp streams its chunks through its own ring of STAGES shared-memory slots with
  // cp.async (STAGES - 1 chunks in flight, no registers held for them); the rings share
  // their memory with the K-split reduction at the end
  // STAGES (a template argument) slots per warp; the memory is dynamic shared memory sized
  // by the wrapper (over 48 KB when a deep ring or 8 column tiles ask for it)
  extern __shared__ uint4 smem[];
  auto ring = reinterpret_cast<uint4 (*)[STAGES][NT][36]>(smem);
  auto red = reinterpret_cast<float (*)[NT * 4][32]>(smem);
  auto issue = [&](int i) {  // chunk c0 + i into its slot
    if (i < per_warp) {
      const int ch = c0 + i, slot = i % STAGES;
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) {
        const size_t piece = (size_t)(tile0 + nt) * chunks + ch;
        cp_async16(&ring[warp][slot][nt][lane], wv + piece * 32 + lane);
        if (lane < 4) cp_async16(&ring[warp][slot][nt][32 + lane], sv + piece * 4 + lane);
      }
    }
    cp_async_commit();
  };
#pragma unroll
  for (int i = 0; i < STAGES - 1; ++i) issue(i);
  // NORM (launches of one row tile): x is the raw residual stream; its rows are normalized
  // (norm_row, as rms_rows does) into shared memory after the rings, while the rings fill
  const __nv_bfloat16* xin = x;
  if (NORM) {
    constexpr int RING = KSPLIT * STAGES * NT * 36, RED = KSPLIT * NT * 32;  // in uint4
    __nv_bfloat16* xn = reinterpret_cast<__nv_bfloat16*>(smem + (RING > RED ? RING : RED));
    for (int m = 0; m < M; ++m)
      norm_row(x + (size_t)m * K, nw, K, __int_as_float(EPS), xn + (size_t)m * K);
    xin = xn;
  }
#pragma unroll 1
  for (int i = 0; i < per_warp; ++i) {
    const int ch = c0 + i, slot = i % STAGES;
    issue(i + STAGES - 1);  // into the slot read in iteration i - 1
    cp_async_wait<STAGES - 1>();  // this thread's copies of chunk i have landed
    __syncwarp();  // ... and every lane's (the scales come from lanes 0-3)
    // word j of this lane's weights / scales of column tile nt, read where it is used so
    // no registers hold a whole chunk
    auto wword = [&](int nt, int j) -> uint32_t {
      return reinterpret_cast<const uint32_t*>(&ring[warp][slot][nt][lane])[j];
    };
#pragma unroll
    for (int par = 0; par < 2; ++par) {
      const int gi = 2 * ch + par;
      // row tile by row tile: x once per row tile, each column tile dequantized where it
      // is multiplied (the same rounding each time, so recomputing it changes no bits)
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        if (mt >= mt_live) break;
        uint32_t xa[4][4];
        fetch_x<MT == 1, NORM>(xin, M, K, m_base + mt * 16 + g, gi, t, xa);  // (see fetch_x)
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) {
          uint32_t bw[8];
          dequant8<MT == 1>(wword(nt, 2 * par), wword(nt, 2 * par + 1),
                            col_scale(&ring[warp][slot][nt][32], g, par), bw);
          group_mma(acc[mt][nt], xa, bw);
        }
      }
    }
    __syncwarp();  // every lane is done with the slot before it is refilled
  }

  // the K-split partials, summed in warp order, one row tile at a time
  __syncthreads();  // every warp is done with its ring
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
    if (mt >= mt_live) break;  // uniform across the block
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
      for (int c = 0; c < 4; ++c) red[warp][nt * 4 + c][lane] = acc[mt][nt][c];
    __syncthreads();
    auto reduced = [&](int idx, int ln) {  // the K-split partials of one element, in warp order
      float v = red[0][idx][ln];
#pragma unroll
      for (int k = 1; k < KSPLIT; ++k) v += red[k][idx][ln];
      return v;
    };
    // element c of a fragment's lane ln: row offset g or g + 8, column 2t or 2t + 1
    auto frag_row = [&](int c, int ln) { return m_base + mt * 16 + (ln >> 2) + (c >= 2 ? 8 : 0); };
    auto frag_col = [&](int c, int ln) { return 2 * (ln & 3) + (c & 1); };
    if (SWIGLU) {  // column tiles come in (gate, up) pairs: y [M, N/2] = silu(gate) * up
      for (int e = threadIdx.x; e < NT * 2 * 32; e += 32 * KSPLIT) {
        const int idx = e >> 5, ln = e & 31;
        const int pr = idx >> 2, c = idx & 3;
        // rounded to bf16 first, as the product of a plain gate_up matmul and swiglu
        const float gt = __bfloat162float(__float2bfloat16(reduced(8 * pr + c, ln)));
        const float up = __bfloat162float(__float2bfloat16(reduced(8 * pr + 4 + c, ln)));
        const float out = gt / (1.0f + expf(-gt)) * up;
        const int row = frag_row(c, ln), col = (tile0 / 2 + pr) * 8 + frag_col(c, ln);
        if (row < M) y[(size_t)row * (N / 2) + col] = __float2bfloat16(out);
      }
    } else {
      for (int e = threadIdx.x; e < NT * 4 * 32; e += 32 * KSPLIT) {
        const int idx = e >> 5, ln = e & 31;
        const int nt = idx >> 2, c = idx & 3;
        const int row = frag_row(c, ln), col = (tile0 + nt) * 8 + frag_col(c, ln);
        if (row >= M) continue;
        const size_t at = (size_t)row * N + col;
        const __nv_bfloat16 v = __float2bfloat16(reduced(idx, ln));
        // the residual added to the rounded product, as a plain matmul and an add round it
        y[at] = RESID ? __float2bfloat16(__bfloat162float(v) + __bfloat162float(res[at])) : v;
      }
    }
    __syncthreads();
  }
