"""slotserve's own CUDA kernels (through `mx.fast.cuda_kernel`), batch-invariant by construction.

MLX 0.32's CUDA 4-bit matmul reads weights at 90-530 GB/s of the H200's ~3 TB/s at
decode row counts and changes kernels at 8 rows, and its attention for a paged pool
is ~15 small kernels per layer. These replace both on the GPU:

* `q4_matmul`: y = x W^T for MLX affine 4-bit weights (group 64), bf16 activations.
  Tensor cores (mma.sync m16n8k16) multiply x by the raw 4-bit codes, exact in bf16;
  each 64-wide group's result is scaled in float32 (y += s * (x . q) + b * sum(x)).
  Row tiles of 16, K split over a fixed number of warps chosen from K alone, partials
  summed in warp order: every output element is computed the same way whatever the
  row count, so one row alone and the same row in a batch of 128 give the same bits.
* `paged_attention`: one thread block per (row, kv head) attends its GQA group of
  query heads over the row's own slot, reading K/V blocks through the slot's block
  table (the pool layout of slotserve.model.kv; small launches stage each key block in
  shared memory first), online softmax in key blocks of 128 at fixed absolute
  positions. Decode rows and prefill rows are the same work, so a position's output
  never depends on how it was batched.
* `rope_write` and `swiglu`: the elementwise glue around them in one launch each, so
  a layer's graph stays short (graph building and launching are host time on every
  step); `rope_write` also puts K/V straight into the pool (no scatter ops).
  `rope_attention` does the rotation and the K/V write inside the attention launch of
  decode steps, and `q4_matmul(norm=...)` the RMS norm inside the matmul's (`rms_rows`, the
  same arithmetic in a launch of its own, serves the larger launches).

The tests compare each against a plain MLX reference and check invariance on the
GPU (tests/test_cuda_kernels.py, marked gpu).
"""

from __future__ import annotations

from functools import cache
from typing import Any

import mlx.core as mx
import numpy as np

from slotserve import settings

GROUP = 64  # quantization group size the matmul kernel handles
BLOCK = 128  # KV pool block (slotserve.kernels.attention.BLOCK)
# the residual add in the 4-bit matmul's epilogue (q4_matmul(residual=...)); read at each
# call, so a benchmark can compare (the same bits either way)
RESIDUAL_EPILOGUE = True
# the RMS norm in the 4-bit matmul's prologue (q4_matmul(norm=...)) for launches of up to
# NORM_ROWS rows; read at each call, so a benchmark can compare (the same bits either way)
NORM_IN_MATMUL = True
NORM_ROWS = 4

# helpers every kernel may use
_COMMON = r"""
#include <cuda_bf16.h>

__device__ __forceinline__ float neg_inf() { return __int_as_float(0xff800000u); }
__device__ __forceinline__ float bf_lo(uint32_t u) { return __uint_as_float(u << 16); }
__device__ __forceinline__ float bf_hi(uint32_t u) { return __uint_as_float(u & 0xFFFF0000u); }

// rotate-half RoPE of the pair (x1, x2) = (x[d], x[d + half]) with table entries c[0],
// c[half], s[0], s[half] (explicit roundings: every kernel that rotates gives the same bits)
template <typename C>
__device__ __forceinline__ void rope_rotate(float x1, float x2, const C* c, const C* s,
                                            int half, float& o1, float& o2) {
  o1 = __fmaf_rn(x1, static_cast<float>(c[0]), -__fmul_rn(x2, static_cast<float>(s[0])));
  o2 = __fmaf_rn(x2, static_cast<float>(c[half]), __fmul_rn(x1, static_cast<float>(s[half])));
}
"""

# copies global -> shared for the kernels that stage their loads (the 4-bit matmul, attention)
_ASYNC = r"""
// 16 bytes global -> shared without passing through registers (sm_80+)
__device__ __forceinline__ void cp_async16(void* smem, const void* gmem) {
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(s), "l"(gmem));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}
"""

# RMS norm of one row by a whole block (the standalone rms_rows kernel and the 4-bit
# matmul's NORM prologue)
_NORM = r"""
// y = bf16((x * r) * w), r = 1 / sqrt(mean(x^2) + eps), for one row of K (K % 8 == 0), by
// the whole block: thread p sums the squares of 8-element pieces p, p + blockDim, .. in
// order, then a fixed tree (shuffles in each warp, the warps in order). Every launch of it
// has 32 * _k_split(K) threads, so the standalone kernel and the matmul's prologue agree
// bit for bit. y may be global or shared memory.
__device__ __forceinline__ void norm_row(const __nv_bfloat16* x, const __nv_bfloat16* w,
                                         int K, float eps, __nv_bfloat16* y) {
  __shared__ float part[32];
  const int tid = threadIdx.x, nthreads = blockDim.x;
  const uint4* xv = reinterpret_cast<const uint4*>(x);
  float s = 0.0f;
  for (int e = tid; e < K / 8; e += nthreads) {
    const uint4 v = xv[e];
    const uint32_t u[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const float a = bf_lo(u[i]), b = bf_hi(u[i]);
      s = __fmaf_rn(a, a, s);
      s = __fmaf_rn(b, b, s);
    }
  }
  for (int o = 16; o > 0; o >>= 1) s = __fadd_rn(s, __shfl_xor_sync(0xffffffffu, s, o));
  if ((tid & 31) == 0) part[tid >> 5] = s;
  __syncthreads();
  float ss = part[0];
  for (int k = 1; k < nthreads / 32; ++k) ss = __fadd_rn(ss, part[k]);
  const float r = rsqrtf(__fadd_rn(__fdiv_rn(ss, static_cast<float>(K)), eps));
  const uint4* wv = reinterpret_cast<const uint4*>(w);
  uint4* yv = reinterpret_cast<uint4*>(y);
  for (int e = tid; e < K / 8; e += nthreads) {
    const uint4 v = xv[e], g = wv[e];
    const uint32_t u[4] = {v.x, v.y, v.z, v.w}, gw[4] = {g.x, g.y, g.z, g.w};
    uint32_t o[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      __nv_bfloat162 h = __floats2bfloat162_rn(__fmul_rn(__fmul_rn(bf_lo(u[i]), r), bf_lo(gw[i])),
                                               __fmul_rn(__fmul_rn(bf_hi(u[i]), r), bf_hi(gw[i])));
      o[i] = *reinterpret_cast<uint32_t*>(&h);
    }
    yv[e] = make_uint4(o[0], o[1], o[2], o[3]);
  }
  __syncthreads();  // y complete for the whole block; part free again
}
"""

_RMS_ROWS_SOURCE = r"""
  const int K = x_shape[1];
  norm_row(x + (size_t)blockIdx.x * K, w, K, __int_as_float(EPS), y + (size_t)blockIdx.x * K);
"""

# the 4-bit matmul's helpers
_Q4_HEADER = _ASYNC + _NORM + r"""

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

__device__ __forceinline__ void mma_bf16(float* c, uint32_t a0, uint32_t a1, uint32_t a2,
                                         uint32_t a3, uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
      "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// the 16 codes of one 64-wide group this thread holds (two words) as mma B fragments:
// bq[2s], bq[2s+1] = k-slots (2t, 2t+1) and (2t+8, 2t+9) of step s
template <bool LEAN>
__device__ __forceinline__ void dequant8(uint32_t wlo, uint32_t whi, uint32_t* bq) {
#pragma unroll
  for (int s = 0; s < 4; ++s) {
    const uint32_t word = s < 2 ? wlo : whi;
    bq[2 * s] = q4_pair<LEAN>(word, 2 * (s & 1));  // codes 4(s&1), +1 of the word
    bq[2 * s + 1] = q4_pair<LEAN>(word, 2 * (s & 1) + 1);  // codes 4(s&1) + 2, + 3
  }
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
// loaded into the registers the mma reads (from 16-byte loads the compiler moved 4 registers
// for every mma: 22 % of a 1-row launch's instructions, ncu run AH2); else two 16-byte loads
// per row (split loads cost a launch of two row tiles 130 registers instead of 128, half its
// occupancy). The same values either way. SHARED (with SPLIT): x is in shared memory.
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

// each row's sum over the whole group: four mma steps against all-ones columns (xs0 = row
// r0's sum, xs1 = row r1's) cost four tensor instructions instead of ~70 ALU ones, and every
// row's sum is still its own dot product
__device__ __forceinline__ void row_sums(const uint32_t (*a)[4], float& xs0, float& xs1) {
  constexpr uint32_t ONES = 0x3F803F80u;  // two bf16 1.0
  float c[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
  for (int s = 0; s < 4; ++s) mma_bf16(c, a[s][0], a[s][1], a[s][2], a[s][3], ONES, ONES);
  xs0 = c[0];
  xs1 = c[2];
}

// one 64-wide group of one 16-row x 8-column tile: the four mma steps on the raw codes,
// then acc += scale * (x . q) + bias * sum(x) for columns 2t, 2t+1 of rows g, g+8.
// sb0 / sb1: (scale, bias) bf16 pairs of columns 2t and 2t+1.
__device__ __forceinline__ void group_mma(float* a, const uint32_t (*x)[4], const uint32_t* bq,
                                          uint32_t sb0, uint32_t sb1, float xs0, float xs1) {
  float tmp[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
  for (int s = 0; s < 4; ++s)
    mma_bf16(tmp, x[s][0], x[s][1], x[s][2], x[s][3], bq[2 * s], bq[2 * s + 1]);
  const float s0 = bf_lo(sb0), b0 = bf_hi(sb0), s1 = bf_lo(sb1), b1 = bf_hi(sb1);
  a[0] = __fmaf_rn(s0, tmp[0], __fmaf_rn(b0, xs0, a[0]));
  a[1] = __fmaf_rn(s1, tmp[1], __fmaf_rn(b1, xs0, a[1]));
  a[2] = __fmaf_rn(s0, tmp[2], __fmaf_rn(b0, xs1, a[2]));
  a[3] = __fmaf_rn(s1, tmp[3], __fmaf_rn(b1, xs1, a[3]));
}
"""

# Weights and scales are repacked once at load (q4_pack) so that every warp load is one
# contiguous 512-byte (weights) or 64-byte (scales) piece holding exactly the mma
# fragments its threads need. Thread (g = lane/4, t = lane%4) of an mma takes k =
# 16t..16t+15 of each 64-wide group: for step s, mma k-slots (2t, 2t+1) hold k
# 16t+4s+{0,1} and slots (2t+8, 2t+9) hold 16t+4s+{2,3}, for x and w alike (a fixed
# permutation of k inside the group, the same for every row).
#   wp [N/8, K/128, 32 lanes, 4]: lane's words 2t, 2t+1 of row 8*tile+g, groups 2c, 2c+1
#   sp [N/8, K/128, 4 (t), 4]: (scale, bias) bf16 pairs of columns 8*tile+2t+{0,1},
#                              groups 2c, 2c+1
# x [M, K] bf16 -> y [M, N] bf16; a block covers 8*NT columns and 16*MT rows.
_Q4_SOURCE = r"""
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
  // by q4_matmul (over 48 KB when a deep ring or 8 column tiles ask for it)
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
    auto sword = [&](int nt, int j) -> uint32_t {
      return reinterpret_cast<const uint32_t*>(&ring[warp][slot][nt][32 + t])[j];
    };
#pragma unroll
    for (int par = 0; par < 2; ++par) {
      const int gi = 2 * ch + par;
      // row tile by row tile: x once per row tile, each column tile dequantized where it
      // is multiplied (exact, so recomputing it per row tile changes no bits)
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        if (mt >= mt_live) break;
        uint32_t xa[4][4];
        float xs0, xs1;
        fetch_x<MT == 1, NORM>(xin, M, K, m_base + mt * 16 + g, gi, t, xa);  // (see fetch_x)
        row_sums(xa, xs0, xs1);
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) {
          uint32_t bq[8];
          dequant8<MT == 1>(wword(nt, 2 * par), wword(nt, 2 * par + 1), bq);
          group_mma(acc[mt][nt], xa, bq, sword(nt, 2 * par), sword(nt, 2 * par + 1), xs0, xs1);
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
"""

_ATTENTION_HEADER = _ASYNC

# the attention's query: read from q, or (rope_attention) made from the row's QKV
# projection, with the new K/V of the block's kv head written and patched in (see there)
_Q_READ = r"""
  for (int i = tid; i < G * D; i += 128) qs[i / D][i % D] = static_cast<float>(q[base + i]);
"""
_Q_ROPE = r"""
  // q rotated and rounded as rope_write stores it; thread d < D: dimension d of this kv
  // head's new key (rotated) and value, written into the pool row write_rows gives (rows
  // past write_rows: padding, no write) and kept to patch the staged copy of position pos
  const int W = (HQ + 2 * HKV) * D;
  const int p0 = row_pos[r];
  const T* qr = qkv + (size_t)r * W;
  const T* ct = cos_t + (size_t)p0 * D;
  const T* st = sin_t + (size_t)p0 * D;
  for (int i = tid; i < G * D / 2; i += 128) {
    const int gg = i / (D / 2), d = i % (D / 2);
    const T* src = qr + (size_t)(h * G + gg) * D;
    float o1, o2;
    rope_rotate(static_cast<float>(src[d]), static_cast<float>(src[d + D / 2]), ct + d, st + d,
                D / 2, o1, o2);
    qs[gg][d] = static_cast<float>(static_cast<T>(o1));
    qs[gg][d + D / 2] = static_cast<float>(static_cast<T>(o2));
  }
  const bool writes = r < write_rows_shape[0];
  T newk = static_cast<T>(0.0f), newv = static_cast<T>(0.0f);
  if (tid < D) {
    const int d = tid % (D / 2);
    const T* ks = qr + (size_t)(HQ + h) * D;
    float o1, o2;
    rope_rotate(static_cast<float>(ks[d]), static_cast<float>(ks[d + D / 2]), ct + d, st + d,
                D / 2, o1, o2);
    newk = static_cast<T>(tid < D / 2 ? o1 : o2);
    newv = qr[(size_t)(HQ + HKV + h) * D + tid];
    if (writes) {
      const size_t dst = (size_t)write_rows[(size_t)r * HKV + h] * D + tid;
      const_cast<T*>(kpool)[dst] = newk;
      const_cast<T*>(vpool)[dst] = newv;
    }
  }
"""
# the staged copy of the new position, patched from registers: the copies read the pool
# through L2 and may not see this block's own writes of it. A thread's wait covers only
# its own copies, and other threads copied that row: all of them wait first.
_PATCH_ROPE = r"""
      if (jb == pos / 128) {  // the same for every thread of the block
        __syncthreads();
        if (tid < D && writes) {
          reinterpret_cast<T*>(staged)[(pos % 128) * KW * 8 + tid] = newk;
          reinterpret_cast<T*>(staged + 128 * KW)[(pos % 128) * D + tid] = newv;
        }
      }
"""

# One block (128 threads) per (row, kv head); q [R, Hq*D], pools [blocks*128, D],
# tables [S, nbmax, Hkv], row_table / row_pos [R], params [scale * log2 e].
_ATTENTION_SOURCE = r"""
  const int HKV = tables_shape[2];
  const int nbmax = tables_shape[1];
  const int HQ = HKV * G;
  const int r = blockIdx.x / HKV, h = blockIdx.x % HKV;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  __shared__ float qs[G][D];
  __shared__ float ps[G][128];
  __shared__ float part[G][4];
  constexpr int DPL = (D + 31) / 32;  // output dimensions per lane in P.V
  __shared__ float pvs[4][G][DPL * 32];  // each warp's P.V partial
  const size_t base = ((size_t)r * HQ + (size_t)h * G) * D;
  const int tb = row_table[r];
  if (tb < 0) {
    for (int i = tid; i < G * D; i += 128) out[base + i] = __float2bfloat16(0.0f);
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
  if (STAGED) stage(lo / 128);
@Q@
  __syncthreads();
  float run_max[G], run_sum[G], acc[G];
#pragma unroll
  for (int gg = 0; gg < G; ++gg) { run_max[gg] = neg_inf(); run_sum[gg] = 0.0f; acc[gg] = 0.0f; }
  for (int jb = lo / 128; jb <= pos / 128; ++jb) {
    const size_t blk = (size_t)table[jb * HKV + h] * 128;
    const int key = jb * 128 + tid;
    const bool valid = key >= lo && key <= pos;
    const int n = min(128, pos + 1 - jb * 128);  // keys of this block up to pos
    if (STAGED) {
      if (jb > lo / 128) stage(jb);  // (the previous block's readers are done: see the end)
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
  if (tid < D) {
#pragma unroll
    for (int gg = 0; gg < G; ++gg)
      out[base + (size_t)gg * D + tid] = __float2bfloat16(acc[gg] / run_sum[gg]);
  }
"""

# qkv [R, (HQ + 2 HKV) * D] -> q [R, HQ*D] rotated (rotate-half RoPE with the cos/sin rows
# of each row's position); k rotated and v go straight into the pool rows that write_rows
# [n <= R, HKV] gives (kpool, vpool [rows, D], written in place, see rope_write); one thread
# per element pair
_ROPE_SOURCE = r"""
  const int R = qkv_shape[0];
  const int W = qkv_shape[1];
  const int heads = W / D;              // HQ + 2 * HKV
  const int HQ = heads - 2 * HKV;
  const int half = D / 2;
  const size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;   // (row, head, d < half)
  if (i >= (size_t)R * heads * half) return;
  const int d = i % half;
  const int hd = (i / half) % heads;
  const int r = i / ((size_t)half * heads);
  const size_t src = (size_t)r * W + (size_t)hd * D;
  const bool writes = r < write_rows_shape[0];  // padding rows (past the real ones) write none
  if (hd >= HQ + HKV) {
    if (!writes) return;
    T* vp = const_cast<T*>(vpool);
    const size_t dst = (size_t)write_rows[(size_t)r * HKV + (hd - HQ - HKV)] * D;
    vp[dst + d] = qkv[src + d];
    vp[dst + d + half] = qkv[src + d + half];
    return;
  }
  const int p = positions[r];
  float r1, r2;
  rope_rotate(static_cast<float>(qkv[src + d]), static_cast<float>(qkv[src + d + half]),
              cos_t + (size_t)p * D + d, sin_t + (size_t)p * D + d, half, r1, r2);
  const T o1 = static_cast<T>(r1);
  const T o2 = static_cast<T>(r2);
  if (hd < HQ) {
    const size_t dst = ((size_t)r * HQ + hd) * D;
    q[dst + d] = o1;
    q[dst + d + half] = o2;
  } else if (writes) {
    T* kp = const_cast<T*>(kpool);
    const size_t dst = (size_t)write_rows[(size_t)r * HKV + (hd - HQ)] * D;
    kp[dst + d] = o1;
    kp[dst + d + half] = o2;
  }
"""

# gate_up [R, 2I] -> silu(gate) * up [R, I]; gate columns then up columns, or with PAIRED
# alternating 8-column tiles of each (paired_rows)
_SWIGLU_SOURCE = r"""
  const int R = gate_up_shape[0];
  const int I = gate_up_shape[1] / 2;
  const size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= (size_t)R * I) return;
  const size_t r = i / I, c = i % I;
  const size_t gc = PAIRED ? c / 8 * 16 + c % 8 : c;
  const size_t uc = PAIRED ? gc + 8 : I + c;
  const float gt = static_cast<float>(gate_up[r * 2 * I + gc]);
  const float up = static_cast<float>(gate_up[r * 2 * I + uc]);
  out[i] = static_cast<T>(gt / (1.0f + expf(-gt)) * up);
"""


def enabled() -> bool:
    """Kernels run on a CUDA GPU unless SLOTSERVE_CUDA_KERNELS=0."""
    return (settings.current().cuda_kernels
            and mx.default_device() == mx.gpu and mx.cuda.is_available())


@cache
def _kernel(name: str, shared_memory: int = 0) -> Any:
    """The kernel object; one per dynamic shared-memory size (MLX fixes it per object, and
    every template instantiation of q4_matmul always asks for the same size)."""
    sources = {
        "q4_matmul": (["x", "wp", "sp", "res", "nw"], ["y"], _Q4_SOURCE, _Q4_HEADER),
        "rms_rows": (["x", "w"], ["y"], _RMS_ROWS_SOURCE, _NORM),
        "paged_attention": (["q", "kpool", "vpool", "tables", "row_table", "row_pos", "params"],
                            ["out"], _attention_source(_Q_READ, ""), _ATTENTION_HEADER),
        "rope_attention": (["qkv", "kpool", "vpool", "tables", "row_table", "row_pos", "params",
                            "cos_t", "sin_t", "write_rows"],
                           ["out"], _attention_source(_Q_ROPE, _PATCH_ROPE), _ATTENTION_HEADER),
        "rope_write": (["qkv", "cos_t", "sin_t", "positions", "write_rows", "kpool", "vpool"],
                       ["q"], _ROPE_SOURCE, ""),
        "swiglu": (["gate_up"], ["out"], _SWIGLU_SOURCE, ""),
    }
    inputs, outputs, body, header = sources[name]
    return mx.fast.cuda_kernel(name=f"slotserve_{name}", input_names=inputs,
                               output_names=outputs, source=_compact(body),
                               header=_compact(_COMMON + header), shared_memory=shared_memory)


def _attention_source(query: str, patch: str) -> str:
    """The attention kernel's body with its query made by `query` and `patch` run on each
    staged key block."""
    return (_ATTENTION_SOURCE.replace("@Q@", query.strip("\n"))
            .replace("@PATCH@\n", patch.lstrip("\n")))


def _compact(source: str) -> str:
    """CUDA source without comments, indentation or blank lines. MLX copies a custom kernel's
    whole source into every op and hashes it at every launch: ~0.2-0.6 us a kB on the H200's
    hosts (bench/gpu_bench.py eval_us_per_op, custom_copy_*), ~200 launches a step."""
    out = []
    for line in source.splitlines():
        code = line.split("//", 1)[0].strip()
        if code:
            out.append(code)
    return "\n".join(out) + "\n"


# ---- 4-bit matmul --------------------------------------------------------------------

def q4_supported(in_dim: int, out_dim: int, bits: int, group_size: int) -> bool:
    return bits == 4 and group_size == GROUP and in_dim % 128 == 0 and out_dim % 16 == 0


def q4_pack(w: mx.array, scales: mx.array, biases: mx.array) -> tuple[mx.array, mx.array]:
    """MLX 4-bit [N, K/8] weights and [N, K/64] scales/biases -> the kernel's layouts."""
    n, words = w.shape
    chunks = words // 16
    wp = (w.reshape(n // 8, 8, chunks, 2, 4, 2).transpose(0, 2, 1, 4, 3, 5)
          .reshape(n // 8, chunks, 32, 4))
    # each word's codes interleaved for q4_pair: code j (bits 4j..) to nibble _NIBBLE_TO[j]
    wp = _interleave(wp.astype(mx.uint32))
    pairs = mx.stack([scales, biases], axis=-1).astype(mx.bfloat16).view(mx.uint32)
    sp = (pairs.reshape(n // 8, 4, 2, chunks, 2).transpose(0, 3, 1, 4, 2)
          .reshape(n // 8, chunks, 4, 4))
    return mx.contiguous(wp), mx.contiguous(sp)


_NIBBLE_TO = (0, 4, 1, 5, 2, 6, 3, 7)  # code j of an MLX word -> nibble in the packed word


def _interleave(words: mx.array) -> mx.array:
    out = mx.zeros_like(words)
    for j, dst in enumerate(_NIBBLE_TO):
        out = out | (((words >> (4 * j)) & 0xF) << (4 * dst))
    return out


def _k_split(chunks: int) -> int:
    """Warps splitting K: a function of K only, so every row count sums the same way.

    8 where K allows. 4 looked faster in the micro-benchmark, but that timed repeated calls
    on one weight matrix small enough to stay in the 50 MB L2; through the model (every
    weight read once from HBM per step) it was slower: 127 vs 187 decode tok/s at N = 1
    (bench/results-gpu/run-d-ksplit4-bench.json vs run-c3-bench.json).
    """
    return next(s for s in (8, 4, 2, 1) if chunks % s == 0)


def _shared_bytes(nt: int, ksplit: int, stages: int) -> int:
    """Dynamic shared memory of a q4_matmul launch: the rings, or the K-split reduction."""
    ring = ksplit * stages * nt * 36 * 16  # 32 weight + 4 scale uint4 a column tile
    reduction = ksplit * nt * 4 * 32 * 4
    return max(ring, reduction)


def _launch(m: int, n: int) -> tuple[int, int, int]:
    """(row tiles MT, column tiles NT, ring stages) of a launch with m rows, n columns.

    From each launch shape's GPU time under Nsight Compute on the H200, caches flushed
    before each kernel as in a step (bench/gpu_profile.py --launches, sweep LAUNCH_SWEEP;
    bench/results-gpu/run-i-launches.json, the Llama-3-8B shapes). Over 32 rows, 2 row
    tiles x 4 column tiles won on every shape at 64 and 128 rows (gate+up at 64 rows 124 us
    vs 153 for the 4 x 2 used before, down 60 vs 86). Up to 32 rows, narrow matrices take
    1 x 4 (down at 32 rows 41.5 vs 51.1) and wide ones 2 x 4; one row takes 2 column
    tiles, 4 from 16384 columns (gate+up 39.7 us vs 47.6), 8 for the lm_head (148 vs 157).
    Launch shape only: every launch computes every element the same way.
    """
    if m <= 16:
        mt, nt, stages = (1, 8, 2) if n >= 65536 else (1, 4, 2) if n >= 16384 else (1, 2, 4)
    elif m <= 32 and n < 16384:
        mt, nt, stages = 1, 4, 4
    else:
        mt, nt, stages = 2, 4, 2
    while n % (8 * nt):  # n is a multiple of 16 (q4_supported)
        nt //= 2
    return mt, nt, stages


def q4_matmul(x: mx.array, wp: mx.array, sp: mx.array, *, gate_up: bool = False,
              residual: mx.array | None = None, norm: tuple[mx.array, float] | None = None,
              nt: int | None = None, ksplit: int | None = None, stages: int | None = None,
              mt: int | None = None) -> mx.array:
    """x [M, K] bf16 times 4-bit weights packed by q4_pack -> [M, N] bf16.

    gate_up: the weights are a [gate; up] pair in paired_rows order; the result is
    silu(gate) * up [M, N/2], the same bits as swiglu() of the plain product (in one launch
    where the launch has one row tile). residual [M, N] bf16: the result is product +
    residual, the same bits as the two ops, in one launch. norm (weight [K], eps): x is
    RMS-normalized first, rms_rows(x, *norm): in the launch's prologue for up to NORM_ROWS
    rows, else by rms_rows' own launch (the same bits).
    mt (row tiles per block), nt (column tiles per block) and stages (ring depth) change
    only the speed, never the bits; ksplit changes the summation order
    and is for the micro-benchmark only (the engine keeps the one derived from K, which is
    what makes rows batch-invariant).
    """
    m, k = x.shape
    n = wp.shape[0] * 8
    ksplit = ksplit or _k_split(k // 128)
    rule = _launch(m, n)
    mt, nt, stages = mt or rule[0], nt or rule[1], stages or rule[2]
    in_launch = norm is not None and NORM_IN_MATMUL and mt == 1 and m <= NORM_ROWS
    if norm is not None and not in_launch:
        x = rms_rows(x, *norm)
    # the swiglu epilogue costs a block of 2 row tiles registers enough to halve its
    # occupancy (nvcc 13, sm_90a: 128 -> 130): single-row-tile launches only; the residual
    # epilogue costs none (128)
    fused = gate_up and mt == 1
    add = residual is not None and RESIDUAL_EPILOGUE
    assert not fused or nt % 2 == 0, "a block holds whole (gate, up) tile pairs"
    x = x.astype(mx.bfloat16)
    # the norm's weight and eps (as int bits) for the launch; x stands in without NORM
    nw, eps_bits = ((norm[0].astype(mx.bfloat16), _float_bits(norm[1])) if in_launch and norm
                    else (x, 0))
    smem = _shared_bytes(nt, ksplit, stages) + (m * k * 2 if in_launch else 0)
    (y,) = _kernel("q4_matmul", smem)(
        inputs=[x, wp, sp, residual if add else x, nw],
        template=[("MT", mt), ("NT", nt), ("KSPLIT", ksplit), ("STAGES", stages),
                  ("SWIGLU", fused), ("RESID", add), ("NORM", in_launch),
                  # the row count in the name of a NORM launch: its shared memory grows with
                  # the rows, and MLX sets a kernel's shared-memory limit once, at its first
                  # launch
                  ("ROWS", m if in_launch else 0), ("EPS", eps_bits)],
        grid=(n // (8 * nt) * -(-m // (16 * mt)) * 32 * ksplit, 1, 1),
        threadgroup=(32 * ksplit, 1, 1),
        output_shapes=[(m, n // 2 if fused else n)],
        output_dtypes=[mx.bfloat16],
    )
    if gate_up and not fused:
        y = swiglu(y, paired=True)
    return y + residual if residual is not None and not add else y


def rms_rows(x: mx.array, w: mx.array, eps: float) -> mx.array:
    """RMS norm of each row of x [M, K] (K % 128 == 0) with weight w [K], bf16: the bits
    q4_matmul(norm=(w, eps)) multiplies (a fixed summation order whatever M)."""
    m, k = x.shape
    threads = 32 * _k_split(k // 128)  # as q4_matmul's launches over K (see norm_row)
    (y,) = _kernel("rms_rows")(
        inputs=[x.astype(mx.bfloat16), w.astype(mx.bfloat16)],
        template=[("EPS", _float_bits(eps))],
        grid=(m * threads, 1, 1),
        threadgroup=(threads, 1, 1),
        output_shapes=[(m, k)],
        output_dtypes=[mx.bfloat16],
    )
    return y


def _float_bits(v: float) -> int:
    """A float32's bits as an int template argument (the kernel takes __int_as_float)."""
    return int(np.array(v, dtype=np.float32).view(np.int32))


def paired_rows(inter: int) -> mx.array:
    """The row order of a fused [gate; up] matrix (2 * inter rows) that puts 8-row tile j of
    gate and of up side by side (tiles 2j, 2j + 1): q4_matmul(gate_up=True) then finds each
    output's gate and up columns in one block."""
    rows = mx.arange(2 * inter, dtype=mx.int32).reshape(2, inter // 8, 8)
    return rows.transpose(1, 0, 2).reshape(-1)


# ---- attention ------------------------------------------------------------------------

def attention_supported(dtype: mx.Dtype, head_dim: int) -> bool:
    return dtype == mx.bfloat16 and head_dim % 8 == 0 and head_dim <= 128


# paged_attention stages K/V in shared memory (~66 kB a block at D = 128, so two blocks an SM)
# in launches of up to this many blocks (rows x kv heads): one wave on the H200's 132 SMs;
# larger launches read in place and keep more blocks resident. The same bits either way.
STAGED_BLOCKS = 256
# rope_attention's one-launch path (RoPE, the K/V write and attention in one kernel): read at
# each call, so a benchmark can compare (the same bits either way)
ROPE_IN_ATTENTION = True


def _staged_bytes(head_dim: int) -> int:
    """Dynamic shared memory of a staged paged_attention launch: padded K rows, then V rows."""
    return 128 * (2 * head_dim // 8 + 1) * 16


@cache
def _attention_params(scale: float) -> mx.array:
    """The kernel's params input (scale in log2 units), made once per scale."""
    return mx.array([scale * 1.4426950408889634], dtype=mx.float32)


def paged_attention(q: mx.array, kpool: mx.array, vpool: mx.array, tables: mx.array,
                    row_table: mx.array, row_pos: mx.array, scale: float,
                    window: int | None = None) -> mx.array:
    """q [R, Hq, D] or [R, Hq * D]; pools [blocks * 128, D]; tables [S, nb, Hkv] -> bf16
    output in q's shape (the 2-D form, as rope_write gives q, adds no reshape to the graph)."""
    r, d = q.shape[0], kpool.shape[-1]
    hq = q.shape[1] if q.ndim == 3 else q.shape[1] // d
    hkv = tables.shape[2]
    staged = r * hkv <= STAGED_BLOCKS
    (out,) = _kernel("paged_attention", _staged_bytes(d) if staged else 0)(
        inputs=[q.reshape(r, hq * d).astype(mx.bfloat16), kpool, vpool, tables, row_table, row_pos,
                _attention_params(scale)],
        template=[("T", kpool.dtype), ("G", hq // hkv), ("D", d), ("WINDOW", window or 0),
                  ("STAGED", staged)],
        grid=(r * hkv * 128, 1, 1),
        threadgroup=(128, 1, 1),
        output_shapes=[(r, hq * d)],
        output_dtypes=[mx.bfloat16],
    )
    return out.reshape(q.shape)


def rope_attention(qkv: mx.array, cos: mx.array, sin: mx.array, write_rows: mx.array,
                   kpool: mx.array, vpool: mx.array, tables: mx.array, row_table: mx.array,
                   row_pos: mx.array, scale: float, heads: int, kv_heads: int, head_dim: int,
                   one_row_per_slot: bool, window: int | None = None) -> mx.array:
    """paged_attention(rope_write(qkv, ...), ...): attention [R, heads * D] of fused QKV rows,
    their K/V written into the pool in place (see rope_write; row_pos are the rows'
    positions).

    One launch where the attention launch is staged and each slot has one row (a decode
    step): each block then owns its kv head's new K/V, so it rotates q and k itself, writes
    K/V and patches its staged copy of them; no block reads another's new keys. Otherwise
    rope_write and paged_attention, two launches. The same bits either way (the same
    rotation, rounded to bf16 as rope_write stores it).
    """
    r = qkv.shape[0]
    if not (ROPE_IN_ATTENTION and one_row_per_slot and r * kv_heads <= STAGED_BLOCKS):
        q = rope_write(qkv, cos, sin, row_pos, write_rows, kpool, vpool, heads, kv_heads,
                       head_dim)
        return paged_attention(q, kpool, vpool, tables, row_table, row_pos, scale, window)
    assert write_rows.shape[0] <= r and write_rows.shape[1] == kv_heads, "pool rows per row"
    (out,) = _kernel("rope_attention", _staged_bytes(head_dim))(
        inputs=[qkv, kpool, vpool, tables, row_table, row_pos, _attention_params(scale), cos,
                sin, write_rows],
        template=[("T", kpool.dtype), ("G", heads // kv_heads), ("D", head_dim),
                  ("WINDOW", window or 0), ("STAGED", True)],
        grid=(r * kv_heads * 128, 1, 1),
        threadgroup=(128, 1, 1),
        output_shapes=[(r, heads * head_dim)],
        output_dtypes=[mx.bfloat16],
    )
    return out


def attention_invariant(group: int, kv_heads: int, head_dim: int) -> bool:
    """Start-up probe for paged_attention (see invariance.row_table_kernel_invariant)."""
    from slotserve.kernels.invariance import row_table_kernel_invariant

    def run(q: mx.array, keys: mx.array, values: mx.array, rows: Any) -> np.ndarray:
        out = paged_attention(q, keys, values, mx.array(rows.tables), mx.array(rows.row_table),
                              mx.array(rows.row_pos), head_dim**-0.5)
        return np.asarray(out.astype(mx.float32))

    return row_table_kernel_invariant(run, group, kv_heads, head_dim, mx.bfloat16)


# ---- elementwise glue -----------------------------------------------------------------

def rope_write(qkv: mx.array, cos: mx.array, sin: mx.array, positions: mx.array,
               write_rows: mx.array, kpool: mx.array, vpool: mx.array, heads: int,
               kv_heads: int, head_dim: int) -> mx.array:
    """Fused QKV rows -> RoPE'd q [R, heads * D]; RoPE'd k and v written into the pool.

    cos/sin: the whole [positions, D] tables; positions: [R] int32; write_rows: [n, kv_heads]
    int32 pool rows of each real row's K/V (Batch.write_rows; rows n.. of qkv are padding
    up to the probe's row floor and write nothing); kpool/vpool: a layer's pool
    arrays [rows, D], written in place: MLX sees them only as inputs, so the writes take
    effect when q is evaluated (the step's attention reads q, so they come first) and
    nothing else may hold a copy of the pool expecting its old contents. Saves the two
    scatters per layer a step otherwise adds (four graph ops and two launches).
    """
    r = qkv.shape[0]
    assert write_rows.shape[0] <= r and write_rows.shape[1] == kv_heads, "pool rows per row"
    pairs = r * (heads + 2 * kv_heads) * (head_dim // 2)
    (q,) = _kernel("rope_write")(
        inputs=[qkv, cos, sin, positions, write_rows, kpool, vpool],
        template=[("T", qkv.dtype), ("D", head_dim), ("HKV", kv_heads)],
        grid=(pairs, 1, 1),
        threadgroup=(256, 1, 1),
        output_shapes=[(r, heads * head_dim)],
        output_dtypes=[qkv.dtype],
    )
    return q


def swiglu(gate_up: mx.array, paired: bool = False) -> mx.array:
    """[R, 2I] (gate then up, or paired: tiles in paired_rows order) -> silu(gate) * up, [R, I]."""
    r, two_i = gate_up.shape
    (out,) = _kernel("swiglu")(
        inputs=[gate_up],
        template=[("T", gate_up.dtype), ("PAIRED", paired)],
        grid=(r * (two_i // 2), 1, 1),
        threadgroup=(256, 1, 1),
        output_shapes=[(r, two_i // 2)],
        output_dtypes=[gate_up.dtype],
    )
    return out
