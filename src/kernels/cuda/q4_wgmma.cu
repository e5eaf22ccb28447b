// slotserve_q4_wgmma: q4_gemm.cu's product, the same bits, with each 64-wide group's
// multiply on Hopper's warpgroup multiply (wgmma.mma_async), which q4_gemm's mma.sync
// tiles could not feed: Nsight Compute found q4_gemm latency-bound at one block of 8 warps
// an SM (0.8 warps eligible a cycle, the ALU pipe busiest with dequantizing). A whole
// kernel for sm_90a, compiled by slotserve.kernels.cuda.sm90a (MLX's cuda_kernel compiles
// for sm_90, where wgmma does not exist) after common.cuh, cp_async.cuh, mma.cuh and
// q4_matmul.cuh, with KSPLIT and RESID (q4_gemm.cu's template values) and KERNEL_NAME
// defined (sources.q4_wgmma).
//
// The bits: bench/wgmma_probe.py found wgmma's k16 steps give mma.sync's float32 bits
// (H100, every element of 1-, 4- and 16-step products); the rest is q4_gemm's order.
//
// As in q4_gemm.cu, a block of 256 threads takes 128 rows x 128 columns, a 128-wide chunk
// of K at a time. Unlike it, only the packed weights are staged in shared memory (a
// cp.async ring of four chunks, 9 KB each); a warp's 16 rows of x go from global memory
// (L2) straight into the registers of its A fragments, loaded a chunk before their
// multiply. Staging x too (32 KB a chunk) left room for a ring of two only, whose copy was
// waited for in the step that issued it: on an H100 at 1,024 rows gate+up took 1.02 ms
// that way, 0.79 ms this way. Each thread dequantizes two uint4 of codes (dequant8:
// bf16(scale * q + bias)), once for the block, into wgmma's layout for B (K-major, no swizzle: core matrices of 8 columns x 8 k,
// 128 bytes; a k16 step's two k halves 128 bytes apart, its 16 column groups 256 apart, its
// 4 KB after the step before), and each of the two warpgroups multiplies its 64 rows by all
// 128 columns: a warp's 16 rows of x are the A fragments mma.sync takes (from registers),
// and the chunk's eight k16 steps chain into the accumulators as group_mma's do, while the
// block dequantizes the next chunk into the other buffer.
//
// The pipelining: a chunk's multiply is waited for only after the next chunk's is issued
// (wgmma.wait_group 1), so the tensor pipe has work queued while the block dequantizes and
// loads, instead of idling from each chunk's last k16 step until the next chunk's first.
// The order of the sums is untouched: one warpgroup's wgmmas on the same accumulators run
// in the order issued, so acc chains chunk 0's steps, then chunk 1's, ...; where a K range
// ends, wait_group 0 lets acc be read and folded as before. What that costs: wgmma reads
// its A fragments from registers while it runs, so chunk ch's fragments are kept until
// chunk ch + 1's wait retires it (two register sets, by chunk parity), and a D buffer is
// overwritten (the dequant of chunk ch + 1) only after every warpgroup's wait has retired
// chunk ch - 1, the buffer's reader (the wait comes before the barrier that precedes it).

// d (64 floats: n8 tile j at d[4j..4j+3], mma.sync's C layout) += a (this warp's 16 rows of
// one k16 step, mma.sync's A fragment) times the 128 x 16 B at desc
__device__ __forceinline__ void wgmma_m64n128k16(float* d, const uint32_t* a, uint64_t desc) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, "
      "{%64, %65, %66, %67}, %68, p, 1, 1, 0;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]),
        "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
        "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]),
        "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
        "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]),
        "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
        "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]),
        "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
        "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]),
        "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
        "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]),
        "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
        "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]),
        "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
        "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]),
        "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "r"(1));
}

extern "C" __global__ void __launch_bounds__(256, 1)
KERNEL_NAME(const __nv_bfloat16* x, const uint32_t* wp, const uint32_t* sp,
                   const __nv_bfloat16* res, __nv_bfloat16* y, int M, int K, int N) {
  constexpr int BM = 128, TILES = 16, STAGES = 4;
  const int chunks = K / 128;
  const int per_range = chunks / KSPLIT;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int g = lane >> 2, t = lane & 3;
  const int row_blocks = (M + BM - 1) / BM;
  const int m0 = (blockIdx.x % row_blocks) * BM;
  const int tile0 = (blockIdx.x / row_blocks) * TILES;

  extern __shared__ uint4 smem[];
  constexpr int WS = TILES * 36, DS = 2048;  // in uint4
  auto wstage = [&](int s) { return smem + s * WS; };
  // chunk ch's codes as bf16 in wgmma's B layout, two buffers (32 KB each, 128-byte aligned)
  auto dstage = [&](int ch) { return smem + STAGES * WS + (ch & 1) * DS; };
  float* totals = reinterpret_cast<float*>(smem + STAGES * WS + 2 * DS);

  const uint4* wv = reinterpret_cast<const uint4*>(wp);
  const uint4* sv = reinterpret_cast<const uint4*>(sp);
  auto issue = [&](int ch) {
    if (ch < chunks) {
      const int s = ch % STAGES;
@STAGE_W@
    }
    cp_async_commit();
  };
  // the codes this thread copied of chunk ch, dequantized (dequant8, with the scales of
  // their column, which other threads copied): lane q = 4 g' + t' of tile tl holds column
  // 8 tl + g' at k-slots 2t', 2t' + 1 (word 2s of dequant8's step s) and 2t' + 8, 2t' + 9
  // (word 2s + 1); then made visible to wgmma's reads (the async proxy)
  auto dequant = [&](int ch) {
    if (ch < chunks) {
      const uint4* wd = wstage(ch % STAGES);
      uint32_t* dd = reinterpret_cast<uint32_t*>(dstage(ch));
      // the 512 uint4 of codes, two a thread (the scales' 64 are read, not dequantized)
#pragma unroll
      for (int e = threadIdx.x; e < TILES * 32; e += 256) {
        const int tl = e >> 5, q = e & 31;
        const uint4 w = wd[tl * 36 + q];
#pragma unroll
        for (int par = 0; par < 2; ++par) {
          uint32_t b[8];
          dequant8<false>(par ? w.z : w.x, par ? w.w : w.y, col_scale(wd + tl * 36 + 32, q >> 2, par),
                          b);
#pragma unroll
          for (int s = 0; s < 4; ++s)
#pragma unroll
            for (int h = 0; h < 2; ++h)
              dd[(4 * par + s) * 1024 + tl * 64 + h * 32 + q] = b[2 * s + h];
        }
      }
    }
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
  };
  // this warp's rows g and g + 8 of x (rows past M read row M - 1: their products are
  // never written), k from 0
  const int r0 = min(m0 + warp * 16 + g, M - 1), r1 = min(m0 + warp * 16 + g + 8, M - 1);
  const __nv_bfloat16* x0 = x + (size_t)r0 * K + 16 * t;
  const __nv_bfloat16* x1 = x + (size_t)r1 * K + 16 * t;
  // chunk ch's A fragments into xs, straight from global memory (L2): loaded a chunk before
  // the multiply that reads them, so their latency hides behind the dequant
  auto load_x = [&](int ch, uint32_t (&xs)[2][4][4]) {
    if (ch < chunks) {
#pragma unroll
      for (int par = 0; par < 2; ++par) {
        // rows g and g + 8, k = 64 par + 16t .. + 15 of the chunk (as fetch_x)
        const uint4* p0 = reinterpret_cast<const uint4*>(x0 + ch * 128 + par * 64);
        const uint4* p1 = reinterpret_cast<const uint4*>(x1 + ch * 128 + par * 64);
@XA@
#pragma unroll
        for (int st = 0; st < 4; ++st)
#pragma unroll
          for (int i = 0; i < 4; ++i) xs[par][st][i] = xa[st][i];
      }
    }
  };
  auto total = [&](int j, int c) -> float& { return totals[(j * 4 + c) * 256 + threadIdx.x]; };
  float acc[TILES][4];
#pragma unroll
  for (int j = 0; j < TILES; ++j) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.0f;
  unsigned dbase;  // dstage(0)'s shared address
  asm("{ .reg .u64 p; cvta.to.shared.u64 p, %1; cvt.u32.u64 %0, p; }" : "=r"(dbase)
      : "l"(dstage(0)));

  // the registers wgmma read (xg, xp) and wrote (acc) stay where they were until it is done
  // with them: empty asm that reads and writes them, after the wait that retires it
  auto keep_x = [&](uint32_t (&xs)[2][4][4]) {
#pragma unroll
    for (int i = 0; i < 32; ++i) asm volatile("" : "+r"((&xs[0][0][0])[i]) :: "memory");
  };
  auto keep_acc = [&]() {
#pragma unroll
    for (int i = 0; i < 64; ++i) asm volatile("" : "+f"((&acc[0][0])[i]) :: "memory");
  };
  // chunk ch, its A fragments in xg (loaded during chunk ch - 1's step) while chunk ch - 1's
  // multiply, which read xp, may still run (xg and xp: two named register sets, swapped by
  // the caller a chunk apart, never indexed at run time, which would put them in local
  // memory)
  auto step = [&](int ch, uint32_t (&xg)[2][4][4], uint32_t (&xp)[2][4][4]) {
    // chunk ch is dequantized (every thread's work); stage (ch + STAGES - 1) % STAGES, chunk
    // ch - 1's, is done with: its codes were dequantized in chunk ch - 2's step
    __syncthreads();
    issue(ch + STAGES - 1);
    asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
    // the chunk's 8 k16 steps chained into acc, group after group (group_mma's order),
    // queued behind chunk ch - 1's if it still runs (same accumulators: in issue order)
#pragma unroll
    for (int st8 = 0; st8 < 8; ++st8) {
      const unsigned at = dbase + (ch & 1) * DS * 16 + st8 * 4096;
      const uint64_t desc = (uint64_t)((at & 0x3FFFFu) >> 4) | ((uint64_t)(128 >> 4) << 16)
                            | ((uint64_t)(256 >> 4) << 32);
      wgmma_m64n128k16(&acc[0][0], xg[st8 >> 2][st8 & 3], desc);
    }
    asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
    // chunk ch - 1's multiply done (this warpgroup's), chunk ch's left running: xp and
    // dstage(ch - 1) are free once every thread has passed here (the barrier below)
    asm volatile("wgmma.wait_group.sync.aligned 1;\n" ::: "memory");
    keep_x(xp);
    keep_acc();
    load_x(ch + 1, xp);
    // the next chunk dequantized under the multiply, into the buffer chunk ch - 1 read
    cp_async_wait<STAGES - 2>();
    __syncthreads();  // chunk ch + 1's codes and scales have landed, every thread's
    dequant(ch + 1);
    if ((ch + 1) % per_range == 0) {
      // a K range ends: chunk ch's multiply done before acc is read
      asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
      keep_x(xg);
      keep_acc();
      const bool first = ch + 1 == per_range;
#pragma unroll
      for (int j = 0; j < TILES; ++j)
#pragma unroll
        for (int c = 0; c < 4; ++c) {
          total(j, c) = first ? acc[j][c] : total(j, c) + acc[j][c];
          acc[j][c] = 0.0f;
        }
    }
  };

#pragma unroll
  for (int i = 0; i < STAGES - 1; ++i) issue(i);
  // chunk ch's A fragments: xA for even ch, xB for odd (zeros: the first wait's xp)
  uint32_t xA[2][4][4], xB[2][4][4];
#pragma unroll
  for (int i = 0; i < 32; ++i) (&xA[0][0][0])[i] = (&xB[0][0][0])[i] = 0u;
  load_x(0, xA);
  cp_async_wait<STAGES - 2>();
  __syncthreads();
  dequant(0);
#pragma unroll 1
  for (int ch = 0; ch + 1 < chunks; ch += 2) {
    step(ch, xA, xB);
    step(ch + 1, xB, xA);
  }
  if (chunks & 1) step(chunks - 1, xA, xB);
  // no multiply outlives the loop (the last chunk ends a K range: only a guard)
  asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
  keep_acc();

  // each element rounded to bf16 (then + res, rounded again), two neighbours a store
#pragma unroll
  for (int j = 0; j < TILES; ++j)
#pragma unroll
    for (int c = 0; c < 4; c += 2) {
      const int row = m0 + warp * 16 + g + (c >= 2 ? 8 : 0);
      if (row >= M) continue;
      const size_t at = (size_t)row * N + (tile0 + j) * 8 + 2 * t;
      __nv_bfloat162 v = __floats2bfloat162_rn(total(j, c), total(j, c + 1));
      if (RESID) {
        const __nv_bfloat162 r = *reinterpret_cast<const __nv_bfloat162*>(res + at);
        v = __floats2bfloat162_rn(__low2float(v) + __low2float(r), __high2float(v) + __high2float(r));
      }
      *reinterpret_cast<__nv_bfloat162*>(y + at) = v;
    }
}
