// The 4-bit matmul's device helpers (after common.cuh, cp_async.cuh, mma.cuh and
// norm_row.cuh): dequantization of the packed codes, x fragment loads and one group's
// multiply-accumulate.


// two 4-bit codes as two exact bf16 values: q4_pack stores each word's codes interleaved
// (nibbles c0 c2 c4 c6 c1 c3 c5 c7), so pair j = (c_2j, c_2j+1) sits at bits 4j and 4j+16
// and one shift, an and-or and one bf16x2 subtract dequantize both. LEAN (launches of one
// row tile): the and-or written as one lop3 with 128 in a register (from C the compiler
// makes two lop3s, each taking one of the two constants) and the 128s as a constant; the
// same values, but a launch of two row tiles needs 134-142 registers for it instead of 128,
// half its occupancy.
template <bool LEAN>
__device__ __forceinline__ uint32_t q4_pair(uint32_t w, int j) {
  uint32_t r;
  __nv_bfloat162 h;
  if (LEAN) {
    asm("lop3.b32 %0, %1, 0x000F000F, %2, 0xEA;" : "=r"(r) : "r"(w >> (4 * j)), "r"(0x43004300u));
    constexpr uint32_t C128 = 0x43004300u;  // two bf16 128.0
    h = *reinterpret_cast<__nv_bfloat162*>(&r);
    h = __hsub2(h, *reinterpret_cast<const __nv_bfloat162*>(&C128));
  } else {
    r = ((w >> (4 * j)) & 0x000F000Fu) | 0x43004300u;  // 128 + q in bf16
    h = *reinterpret_cast<__nv_bfloat162*>(&r);
    h = __hsub2(h, __floats2bfloat162_rn(128.0f, 128.0f));
  }
  return *reinterpret_cast<uint32_t*>(&h);
}

// the 16 codes of one 64-wide group this thread holds (two words), dequantized as mma B
// fragments: bq[2s], bq[2s+1] = k-slots (2t, 2t+1) and (2t+8, 2t+9) of step s, each weight
// bf16(scale * q + bias) in one rounding (a bf16x2 fma of the exact code). sb: the (scale,
// bias) bf16 pair of the fragment's column (column g of its tile: all 16 weights share it).
// This rounding is the GPU's 4-bit weight: every kernel dequantizes with it, so they keep
// each other's bits.
template <bool LEAN>
__device__ __forceinline__ void dequant8(uint32_t wlo, uint32_t whi, uint32_t sb, uint32_t* bq) {
  const uint32_t ss = __byte_perm(sb, 0, 0x1010), bb = __byte_perm(sb, 0, 0x3232);
  const __nv_bfloat162 s2 = *reinterpret_cast<const __nv_bfloat162*>(&ss);
  const __nv_bfloat162 b2 = *reinterpret_cast<const __nv_bfloat162*>(&bb);
#pragma unroll
  for (int s = 0; s < 4; ++s) {
    const uint32_t word = s < 2 ? wlo : whi;
#pragma unroll
    for (int h = 0; h < 2; ++h) {  // codes 4(s&1) + 2h, + 1 of the word
      const uint32_t q = q4_pair<LEAN>(word, 2 * (s & 1) + h);
      __nv_bfloat162 w = __hfma2(*reinterpret_cast<const __nv_bfloat162*>(&q), s2, b2);
      bq[2 * s + h] = *reinterpret_cast<uint32_t*>(&w);
    }
  }
}

// the (scale, bias) bf16 pair of group par (of a chunk's two) of column col of a tile,
// from the tile's 4 scale uint4s (q4_pack: pair col / 2, word 2 par + col % 2): the pair
// dequant8 takes for a B fragment's column
__device__ __forceinline__ uint32_t col_scale(const uint4* scales, int col, int par) {
  return reinterpret_cast<const uint32_t*>(scales + (col >> 1))[2 * par + (col & 1)];
}

// one 32-bit load (global, or shared when SHARED), kept apart: merged vector loads put a
// fragment's words in registers the mma cannot take as they are, and the compiler then
// moves them for every mma
template <bool SHARED>
__device__ __forceinline__ uint32_t ld32(const void* p) {
  uint32_t v;
  if (SHARED) {
    const unsigned a = static_cast<unsigned>(__cvta_generic_to_shared(p));
    asm("ld.shared.b32 %0, [%1];" : "=r"(v) : "r"(a));
  } else {
    asm("ld.global.b32 %0, [%1];" : "=r"(v) : "l"(p));
  }
  return v;
}

// rows r0 = row and r1 = row + 8 of x, k = 64*gi + 16t .. +15 (zeros past M), as the A
// fragments of the group's four mma steps: a[s] = (r0 word 2s, r1 word 2s, r0 word 2s+1,
// r1 word 2s+1). SPLIT (launches of one row tile): one load per word, so each fragment is
// loaded into the registers the mma reads (from 16-byte loads the compiler moved 4
// registers for every mma: 22 % of a 1-row launch's instructions under Nsight Compute); else
// two 16-byte loads per row (split loads cost a launch of two row tiles 130 registers
// instead of 128, half its occupancy). The same values either way. SHARED (with SPLIT): x
// is in shared memory.
template <bool SPLIT, bool SHARED>
__device__ __forceinline__ void fetch_x(const __nv_bfloat16* x, int M, int K, int row, int gi,
                                        int t, uint32_t (*a)[4]) {
  if (SPLIT) {
#pragma unroll
    for (int s = 0; s < 4; ++s) a[s][0] = a[s][1] = a[s][2] = a[s][3] = 0u;
    if (row < M) {
      const uint32_t* p = reinterpret_cast<const uint32_t*>(x + (size_t)row * K + gi * 64 + 16 * t);
#pragma unroll
      for (int s = 0; s < 4; ++s) {
        a[s][0] = ld32<SHARED>(p + 2 * s);
        a[s][2] = ld32<SHARED>(p + 2 * s + 1);
      }
    }
    if (row + 8 < M) {
      const uint32_t* p =
          reinterpret_cast<const uint32_t*>(x + (size_t)(row + 8) * K + gi * 64 + 16 * t);
#pragma unroll
      for (int s = 0; s < 4; ++s) {
        a[s][1] = ld32<SHARED>(p + 2 * s);
        a[s][3] = ld32<SHARED>(p + 2 * s + 1);
      }
    }
    return;
  }
  uint4 xr[4];
  xr[0] = xr[1] = xr[2] = xr[3] = make_uint4(0, 0, 0, 0);
  if (row < M) {
    const uint4* p = reinterpret_cast<const uint4*>(x + (size_t)row * K + gi * 64 + 16 * t);
    xr[0] = p[0];
    xr[1] = p[1];
  }
  if (row + 8 < M) {
    const uint4* p = reinterpret_cast<const uint4*>(x + (size_t)(row + 8) * K + gi * 64 + 16 * t);
    xr[2] = p[0];
    xr[3] = p[1];
  }
  const uint32_t A0[8] = {xr[0].x, xr[0].y, xr[0].z, xr[0].w, xr[1].x, xr[1].y, xr[1].z, xr[1].w};
  const uint32_t A1[8] = {xr[2].x, xr[2].y, xr[2].z, xr[2].w, xr[3].x, xr[3].y, xr[3].z, xr[3].w};
#pragma unroll
  for (int s = 0; s < 4; ++s) {
    a[s][0] = A0[2 * s]; a[s][1] = A1[2 * s]; a[s][2] = A0[2 * s + 1]; a[s][3] = A1[2 * s + 1];
  }
}

// one 64-wide group of one 16-row x 8-column tile: the four mma steps on the dequantized
// weights (dequant8), summed straight into acc (columns 2t, 2t+1 of rows g, g+8): a K
// range's product is one float32 chain of k16 steps, group after group
__device__ __forceinline__ void group_mma(float* a, const uint32_t (*x)[4], const uint32_t* bw) {
#pragma unroll
  for (int s = 0; s < 4; ++s) mma_bf16(a, x[s][0], x[s][1], x[s][2], x[s][3], bw[2 * s], bw[2 * s + 1]);
}
