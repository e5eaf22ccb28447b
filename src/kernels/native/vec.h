/* Vector types and the few primitives every slotserve CPU kernel shares.
 *
 * GCC/Clang vector extensions: 16 float lanes, compiled to AVX-512 where the CPU
 * has it (-march=native) and to narrower vectors elsewhere. Every reduction goes
 * through hsum's one fixed add tree, so a result never depends on how work was split.
 */
#pragma once
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX512F__) || defined(__F16C__)
#include <immintrin.h>
#endif

typedef float v16f __attribute__((vector_size(64)));
typedef float v16f_u __attribute__((vector_size(64), aligned(4)));
typedef float v8f __attribute__((vector_size(32)));
typedef float v4f __attribute__((vector_size(16)));
typedef _Float16 v16h_u __attribute__((vector_size(32), aligned(2)));
typedef uint16_t v16s_u __attribute__((vector_size(32), aligned(2)));
typedef uint32_t v16i __attribute__((vector_size(64)));
typedef int32_t v16si __attribute__((vector_size(64)));

enum { LANES = 16 };

static inline v16f load_f(const float *p) { return *(const v16f_u *)p; }
static inline void store_f(float *p, v16f v) { *(v16f_u *)p = v; }

#if defined(__AVX512F__)
#define FMA(a, b, c) ((v16f)_mm512_fmadd_ps((__m512)(a), (__m512)(b), (__m512)(c)))
#else
#define FMA(a, b, c) ((c) + (a) * (b))
#endif

/* The one add tree every output goes through: lanes (i, i+8), (i, i+4), (i, i+2), (i, i+1). */
static inline float hsum(v16f v) {
  v8f a = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
          __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
  v4f b = __builtin_shufflevector(a, a, 0, 1, 2, 3) + __builtin_shufflevector(a, a, 4, 5, 6, 7);
  float c0 = b[0] + b[2], c1 = b[1] + b[3];
  return c0 + c1;
}


/* Lanes of a where mask is set, else lanes of b. */
static inline v16f vselect(v16si mask, v16f a, v16f b) {
  v16si ai, bi;
  memcpy(&ai, &a, sizeof ai);
  memcpy(&bi, &b, sizeof bi);
  v16si r = (ai & mask) | (bi & ~mask);
  v16f out;
  memcpy(&out, &r, sizeof out);
  return out;
}

/* 2^x for x in [-64, 0] (inputs below -64 give exactly 0): x = n + 0.5 + f with
 * |f| <= 0.5, 2^f from its Taylor series to degree 7 (relative error < 1e-8). */
static inline v16f exp2_neg(v16f x) {
  const v16si keep = x > -64.0f;
  x = vselect(keep, x, (v16f){0} - 64.0f);
  v16si n = __builtin_convertvector(x + 64.0f, v16si) - 64; /* floor, as x >= -64 */
  v16f f = x - __builtin_convertvector(n, v16f) - 0.5f;
  const float l = 0.6931471805599453f;
  v16f t = f * l;
  v16f p = (v16f){0} + 1.0f / 5040.0f;
  p = FMA(p, t, (v16f){0} + 1.0f / 720.0f);
  p = FMA(p, t, (v16f){0} + 1.0f / 120.0f);
  p = FMA(p, t, (v16f){0} + 1.0f / 24.0f);
  p = FMA(p, t, (v16f){0} + 1.0f / 6.0f);
  p = FMA(p, t, (v16f){0} + 0.5f);
  p = FMA(p, t, (v16f){0} + 1.0f);
  p = FMA(p, t, (v16f){0} + 1.0f);
  v16si bits = (n + 127) << 23;
  v16f scale2;
  memcpy(&scale2, &bits, sizeof scale2);
  return vselect(keep, p * scale2 * 1.4142135623730951f, (v16f){0});
}

