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

