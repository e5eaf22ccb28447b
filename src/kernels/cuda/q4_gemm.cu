// slotserve_q4_gemm: q4_matmul's product for prefill row counts, the same bits, in
// 128 x 128 block tiles. The body of an mx.fast.cuda_kernel (inputs x, wp, sp, res -> y;
// the header is common.cuh, cp_async.cuh, mma.cuh and q4_matmul.cuh, whose comments give
// the packed layouts and the fragment helpers).
//
// q4_matmul's tiles are 16-32 rows by 32 columns: at a 1,024-row prefill chunk every
// block re-reads x from L2 for 32 columns and every weight is dequantized once per 32
// rows. Here a block stages a 128-row x tile and a 128-column weight tile per 128-wide
// chunk of K in shared memory (a cp.async ring of STAGES chunks), and its 8 warps (2 along
// the rows x 4 along the columns, 64 x 32 each) multiply from there: x is read once per
// 128 columns, each weight dequantized once per 64 rows.
//
// The bits: q4_matmul gives warp w of a block the chunks [w * per_warp, (w + 1) *
// per_warp) (per_warp = chunks / KSPLIT), chains each group's mma steps into its
// accumulator (group_mma), and adds the KSPLIT partials in warp order. This block walks
// the chunks in order with one accumulator that restarts at zero at each of those
// boundaries, and keeps the running sum of the finished partials (p0, then p0 + p1, ...)
// in shared memory: every element gets the same operations in the same order, so the
// same bits.
//
// N is a multiple of 128 (launch.py sends other widths to q4_matmul). Template: KSPLIT
// (k_split of K's chunks: the summation order), STAGES, RESID (y = product + res).

  constexpr int BM = 128, TILES = 16;  // rows, and 8-column tiles, of a block
  constexpr int XROW = 136;  // a staged x row in bf16: 128 + 8 of padding (no bank conflicts)
  // the shapes through an opaque move: MLX passes them as grid constants, and with them
  // visible as such nvcc builds this loop in 196 registers, slower than the 248 it takes
  // when they are plain values (the CuPy harness's pointer form ran 142-160 TFLOPS at 1,024
  // rows where MLX's form ran 115-135; counts of the per-group float32 rule before
  // 2026-12-07: the bf16(s*q+b) rule takes 162)
  int M, K, N;
  asm volatile("mov.b32 %0, %1;" : "=r"(M) : "r"((int)x_shape[0]));
  asm volatile("mov.b32 %0, %1;" : "=r"(K) : "r"((int)x_shape[1]));
  asm volatile("mov.b32 %0, %1;" : "=r"(N) : "r"((int)wp_shape[0] * 8));
  const int chunks = K / 128;
  const int per_range = chunks / KSPLIT;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int g = lane >> 2, t = lane & 3;
  const int wm = warp >> 2, wn = warp & 3;  // this warp's 64 rows and 4 column tiles
  // the row blocks of a column block are neighbours in launch order: they run together and
  // read the weights from L2
  const int row_blocks = (M + BM - 1) / BM;
  const int m0 = (blockIdx.x % row_blocks) * BM;
  const int tile0 = (blockIdx.x / row_blocks) * TILES;

  extern __shared__ uint4 smem[];
  constexpr int XS = BM * XROW / 8, WS = TILES * 36;  // a stage's x and weights, in uint4
  auto xstage = [&](int s) { return reinterpret_cast<__nv_bfloat16*>(smem + s * (XS + WS)); };
  auto wstage = [&](int s) { return smem + s * (XS + WS) + XS; };
  // the finished K ranges' running sums: element e of this thread at [e][threadIdx.x]
  float* totals = reinterpret_cast<float*>(smem + STAGES * (XS + WS));

  const uint4* xv = reinterpret_cast<const uint4*>(x);
  const uint4* wv = reinterpret_cast<const uint4*>(wp);
  const uint4* sv = reinterpret_cast<const uint4*>(sp);
  auto issue = [&](int ch) {  // chunk ch's x and weight tiles into stage ch % STAGES
    if (ch < chunks) {
      const int s = ch % STAGES;
      __nv_bfloat16* xd = xstage(s);
      for (int e = threadIdx.x; e < BM * 16; e += 256) {  // 16 uint4 per row
        const int r = e >> 4, q = e & 15;
        uint4* dst = reinterpret_cast<uint4*>(xd + r * XROW) + q;
        if (m0 + r < M) {
          cp_async16(dst, xv + ((size_t)(m0 + r) * K + ch * 128) / 8 + q);
        } else {
          *dst = make_uint4(0, 0, 0, 0);  // rows past M multiply as zeros
        }
      }
@STAGE_W@
    }
    cp_async_commit();
  };

  // f(mt, nt, c) for each element of this thread's accumulators, in order
  auto each_element = [](auto&& f) {
#pragma unroll
    for (int mt = 0; mt < 4; ++mt)
#pragma unroll
      for (int nt = 0; nt < 4; ++nt)
#pragma unroll
        for (int c = 0; c < 4; ++c) f(mt, nt, c);
  };
  // an element's running sum of the finished K ranges, in shared memory
  auto total = [&](int mt, int nt, int c) -> float& {
    return totals[((mt * 4 + nt) * 4 + c) * 256 + threadIdx.x];
  };
  float acc[4][4][4];
  each_element([&](int mt, int nt, int c) { acc[mt][nt][c] = 0.0f; });

#pragma unroll
  for (int i = 0; i < STAGES - 1; ++i) issue(i);
#pragma unroll 1
  for (int ch = 0; ch < chunks; ++ch) {
    cp_async_wait<STAGES - 2>();  // chunk ch has landed (this thread's copies)
    __syncthreads();  // ... every thread's; and every warp is done with chunk ch - 1's stage
    issue(ch + STAGES - 1);  // into chunk ch - 1's stage
    const int s = ch % STAGES;
    const __nv_bfloat16* xt = xstage(s) + (wm * 64) * XROW;
    const uint4* wt = wstage(s) + (wn * 4) * 36;
#pragma unroll
    for (int par = 0; par < 2; ++par) {
      // the warp's 4 column tiles of this group, dequantized once for its 64 rows
      uint32_t bw[4][8];
#pragma unroll
      for (int nt = 0; nt < 4; ++nt) {
        const uint4 w = wt[nt * 36 + lane];
        dequant8<false>(par ? w.z : w.x, par ? w.w : w.y, col_scale(wt + nt * 36 + 32, g, par),
                        bw[nt]);
      }
#pragma unroll
      for (int mt = 0; mt < 4; ++mt) {
        // rows g and g + 8 of the row tile, k = 64 par + 16t .. + 15 (as fetch_x)
        const uint4* p0 = reinterpret_cast<const uint4*>(xt + (mt * 16 + g) * XROW + par * 64 + 16 * t);
        const uint4* p1 = reinterpret_cast<const uint4*>(xt + (mt * 16 + g + 8) * XROW + par * 64 + 16 * t);
@XA@
#pragma unroll
        for (int nt = 0; nt < 4; ++nt) group_mma(acc[mt][nt], xa, bw[nt]);
      }
    }
    if ((ch + 1) % per_range == 0) {  // the end of a K range: fold its partial into the sum
      const bool first = ch + 1 == per_range;
      each_element([&](int mt, int nt, int c) {
        total(mt, nt, c) = first ? acc[mt][nt][c] : total(mt, nt, c) + acc[mt][nt][c];
        acc[mt][nt][c] = 0.0f;
      });
    }
  }

  each_element([&](int mt, int nt, int c) {
    const int row = m0 + wm * 64 + mt * 16 + g + (c >= 2 ? 8 : 0);
    const int col = (tile0 + wn * 4 + nt) * 8 + 2 * t + (c & 1);
    if (row >= M) return;
    const size_t at = (size_t)row * N + col;
    const __nv_bfloat16 v = __float2bfloat16(total(mt, nt, c));
    y[at] = RESID ? __float2bfloat16(__bfloat162float(v) + __bfloat162float(res[at])) : v;
  });
