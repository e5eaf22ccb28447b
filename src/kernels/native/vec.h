/* The vector type and the few primitives every slotserve CPU kernel shares.
 *
 * A `vfloat` is 16 float lanes, whatever the machine: one AVX-512 register, two AVX
 * registers, or four 128-bit (SSE2 / NEON) registers. Each part is a GCC/Clang
 * vector of the machine's own width, so every operation compiles to real vector
 * instructions. (One 64-byte vector type on an AVX2 machine does not: GCC expands
 * its operations piecewise and passes it in memory, which made the AVX2 build 5-20x
 * slower than the AVX-512 one.)
 *
 * Why 16 logical lanes everywhere: every dot product accumulates lane i over
 * k = i, i + 16, i + 32, ... and ends in hsum's one fixed add tree, so the float
 * operations behind an output are the same on every instruction set and for every
 * tile shape. Results therefore do not depend on how work was split (batch
 * invariance by construction) and, where the target has FMA (x86-64-v3 and up,
 * aarch64), are the same bits on AVX2, AVX-512 and NEON.
 */
#pragma once
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX512F__) || defined(__AVX2__) || defined(__F16C__)
#include <immintrin.h>
#endif
#if defined(__ARM_NEON)
#include <arm_neon.h>
#endif

enum { LANES = 16 };

#if defined(__AVX512F__)
#define NATIVE_BYTES 64
#elif defined(__AVX__)
#define NATIVE_BYTES 32
#else
#define NATIVE_BYTES 16
#endif
#define PART_LANES (NATIVE_BYTES / 4)   /* floats in one machine register */
#define PARTS (64 / NATIVE_BYTES)        /* registers in one 16-lane vfloat */

typedef float vnat __attribute__((vector_size(NATIVE_BYTES)));
typedef float vnat_u __attribute__((vector_size(NATIVE_BYTES), aligned(4)));
typedef int32_t vnati __attribute__((vector_size(NATIVE_BYTES)));
typedef struct { vnat p[PARTS]; } vfloat;

#define VLOOP _Pragma("GCC unroll 4") for (int i_ = 0; i_ < PARTS; i_++)

static inline __attribute__((always_inline)) vfloat vzero(void) {
  vfloat r;
  VLOOP r.p[i_] = (vnat){0};
  return r;
}
static inline __attribute__((always_inline)) vfloat vsplat(float x) {
  vfloat r;
  VLOOP r.p[i_] = (vnat){0} + x;
  return r;
}
static inline __attribute__((always_inline)) vfloat vload(const float *p) {
  vfloat r;
  VLOOP r.p[i_] = *(const vnat_u *)(p + i_ * PART_LANES);
  return r;
}
static inline __attribute__((always_inline)) void vstore(float *p, vfloat v) {
  VLOOP *(vnat_u *)(p + i_ * PART_LANES) = v.p[i_];
}
static inline __attribute__((always_inline)) vfloat vadd(vfloat a, vfloat b) {
  VLOOP a.p[i_] += b.p[i_];
  return a;
}
static inline __attribute__((always_inline)) vfloat vdiv(vfloat a, vfloat b) {
  VLOOP a.p[i_] /= b.p[i_];
  return a;
}
/* a * b + c, fused where the target has FMA (-ffp-contract=fast) */
static inline __attribute__((always_inline)) vfloat vfma(vfloat a, vfloat b, vfloat c) {
  VLOOP c.p[i_] = c.p[i_] + a.p[i_] * b.p[i_];
  return c;
}

/* The one add tree every output goes through: lanes (i, i+8), (i, i+4), (i, i+2), (i, i+1). */
typedef float v8f __attribute__((vector_size(32)));
typedef float v4f __attribute__((vector_size(16)));
static inline __attribute__((always_inline)) float hsum(vfloat v) {
#if PARTS == 1
  v8f a = __builtin_shufflevector(v.p[0], v.p[0], 0, 1, 2, 3, 4, 5, 6, 7) +
          __builtin_shufflevector(v.p[0], v.p[0], 8, 9, 10, 11, 12, 13, 14, 15);
  v4f b = __builtin_shufflevector(a, a, 0, 1, 2, 3) + __builtin_shufflevector(a, a, 4, 5, 6, 7);
#elif PARTS == 2
  v8f a = v.p[0] + v.p[1];
  v4f b = __builtin_shufflevector(a, a, 0, 1, 2, 3) + __builtin_shufflevector(a, a, 4, 5, 6, 7);
#else
  v4f b = (v.p[0] + v.p[2]) + (v.p[1] + v.p[3]);
#endif
  float c0 = b[0] + b[2], c1 = b[1] + b[3];
  return c0 + c1;
}

/* hsum of 16 vectors at once: lane k of the result is hsum(v[k]) to the bit, the same
 * add tree, with the 16 vectors' adds sharing 15 vector adds (and 30 shuffles) instead of
 * 16 separate trees of 4 adds and their extracts each. */
typedef float v16f __attribute__((vector_size(64)));
static inline __attribute__((always_inline)) v16f as_v16f(vfloat v) {
  v16f r;
  memcpy(&r, &v, sizeof r);
  return r;
}
static inline __attribute__((always_inline)) v16f hsum16(const vfloat *v) {
  v16f a[8], b[4], c[2];
  for (int p = 0; p < 8; p++) { /* lanes (i, i+8) of vectors 2p, 2p+1: [a_2p | a_2p+1] */
    const v16f x = as_v16f(v[2 * p]), y = as_v16f(v[2 * p + 1]);
    a[p] = __builtin_shufflevector(x, y, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
           __builtin_shufflevector(x, y, 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30,
                                   31);
  }
  for (int q = 0; q < 4; q++) /* (i, i+4) of each: [b_4q | b_4q+1 | b_4q+2 | b_4q+3] */
    b[q] = __builtin_shufflevector(a[2 * q], a[2 * q + 1], 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18,
                                   19, 24, 25, 26, 27) +
           __builtin_shufflevector(a[2 * q], a[2 * q + 1], 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22,
                                   23, 28, 29, 30, 31);
  for (int r = 0; r < 2; r++) /* (i, i+2): c0 = b0 + b2, c1 = b1 + b3 of 8 vectors */
    c[r] = __builtin_shufflevector(b[2 * r], b[2 * r + 1], 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20,
                                   21, 24, 25, 28, 29) +
           __builtin_shufflevector(b[2 * r], b[2 * r + 1], 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22,
                                   23, 26, 27, 30, 31);
  /* (i, i+1): c0 + c1, the 16 vectors' sums in order */
  return __builtin_shufflevector(c[0], c[1], 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26,
                                 28, 30) +
         __builtin_shufflevector(c[0], c[1], 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27,
                                 29, 31);
}

static inline __attribute__((always_inline)) vfloat as_vfloat(v16f v) {
  vfloat r;
  memcpy(&r, &v, sizeof r);
  return r;
}
/* Lane-wise (s > m ? s : m): a NaN s keeps m, as a running `best = s > best ? s : best`. */
static inline __attribute__((always_inline)) vfloat vmax_keep(vfloat s, vfloat m) {
  VLOOP {
    vnati gt = s.p[i_] > m.p[i_];
    vnati si, mi;
    memcpy(&si, &s.p[i_], sizeof si);
    memcpy(&mi, &m.p[i_], sizeof mi);
    vnati r = (si & gt) | (mi & ~gt);
    memcpy(&m.p[i_], &r, sizeof r);
  }
  return m;
}
/* Lanes of a where mask is set, else lanes of b. */
static inline __attribute__((always_inline)) vnat vselect(vnati mask, vnat a, vnat b) {
  vnati ai, bi;
  memcpy(&ai, &a, sizeof ai);
  memcpy(&bi, &b, sizeof bi);
  vnati r = (ai & mask) | (bi & ~mask);
  vnat out;
  memcpy(&out, &r, sizeof out);
  return out;
}

/* 2^x for x in [-64, 0] (inputs below -64 give exactly 0): x = n + 0.5 + f with
 * |f| <= 0.5, 2^f from its Taylor series to degree 7 (relative error < 1e-8).
 * Elementwise, so it runs on one machine-width part at a time. */
static inline __attribute__((always_inline)) vnat exp2_neg_part(vnat x) {
  const vnati keep = x > -64.0f;
  x = vselect(keep, x, (vnat){0} - 64.0f);
  vnati n = __builtin_convertvector(x + 64.0f, vnati) - 64; /* floor, as x >= -64 */
  vnat f = x - __builtin_convertvector(n, vnat) - 0.5f;
  const float l = 0.6931471805599453f;
  vnat t = f * l;
  vnat p = (vnat){0} + 1.0f / 5040.0f;
  p = p * t + 1.0f / 720.0f;
  p = p * t + 1.0f / 120.0f;
  p = p * t + 1.0f / 24.0f;
  p = p * t + 1.0f / 6.0f;
  p = p * t + 0.5f;
  p = p * t + 1.0f;
  p = p * t + 1.0f;
  vnati bits = (n + 127) << 23;
  vnat scale2;
  memcpy(&scale2, &bits, sizeof scale2);
  return vselect(keep, p * scale2 * 1.4142135623730951f, (vnat){0});
}

static inline __attribute__((always_inline)) vfloat exp2_neg(vfloat x) {
  VLOOP x.p[i_] = exp2_neg_part(x.p[i_]);
  return x;
}
