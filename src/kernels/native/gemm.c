/* y = x W^T on the CPU for slotserve's Linear layers.
 *
 * x: [R, K] float32 activations; W: [N, K] weights stored as float32, float16 or
 * bfloat16 (every one widens to float32 exactly); y: [R, N] float32.
 *
 * Why our own kernel: OpenBLAS's sgemm streams f32 weights at ~15 GB/s for the
 * 1-8 rows of a decode step and takes other kernels (other rounding) for 1-4
 * rows than for more. Here every output element is computed the same way
 * whatever R is and wherever its row sits: 16 lane-wise FMA accumulators over k
 * in order, then one fixed add tree over the lanes. So a row's result never
 * depends on its batch (batch invariance by construction), and weights can stay
 * in 16 bits (half the bytes of f32) because they are widened in registers.
 *
 * K must be a multiple of 16 (the Python side pads). Work is split over threads
 * by blocks of NB weight rows (OpenMP, static schedule).
 */
#include "vec.h"

enum { W_F32 = 0, W_F16 = 1, W_BF16 = 2 };

/* Register tile: RT rows of x against NB weight rows, NB * RT accumulators of PARTS
 * registers each, plus NB weight vectors (x vectors come straight from memory as FMA
 * operands). Sized per instruction set: AVX-512 has 32 registers (24 + 4 + 1),
 * AVX2 16 (12 + 4), 128-bit NEON 32 (16 + 8 + 4). The tile changes only which
 * outputs are computed together, never the order of an output's operations. */
#if PARTS == 1
enum { NB = 4, RT = 6 };
#elif PARTS == 2
enum { NB = 2, RT = 3 };
#else
enum { NB = 2, RT = 2 };
#endif

static inline __attribute__((always_inline)) vfloat widen(const void *w, int wtype, int64_t i) {
  if (wtype == W_F16) {
    const uint16_t *p = (const uint16_t *)w + i;
    vfloat out;
#if defined(__AVX512F__)
    out.p[0] = (vnat)_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p));
#elif defined(__F16C__) && PARTS == 2
    out.p[0] = (vnat)_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
    out.p[1] = (vnat)_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p + 8)));
#else
    float tmp[LANES];
    for (int l = 0; l < LANES; l++) {
      _Float16 h;
      memcpy(&h, p + l, sizeof h);
      tmp[l] = (float)h;
    }
    out = vload(tmp);
#endif
    return out;
  }
  if (wtype == W_BF16) {
    const uint16_t *p = (const uint16_t *)w + i;
    float tmp[LANES];
    for (int l = 0; l < LANES; l++) {
      uint32_t bits = (uint32_t)p[l] << 16;
      memcpy(tmp + l, &bits, sizeof bits);
    }
    return vload(tmp);
  }
  return vload((const float *)w + i);
}

/* Full tile: nr (<= RT) rows of x against the NB weight rows w[0..NB-1]. Each weight
 * vector is loaded once per k step and used by every row of the tile. */
static inline __attribute__((always_inline)) void tile_rows(
    const float *restrict x, int64_t K, const float *const w[NB], float *y, int64_t N,
    const char *pf, int64_t pf_step, const int nr) {
  vfloat acc[RT][NB];
  for (int r = 0; r < nr; r++)
    for (int i = 0; i < NB; i++) acc[r][i] = vzero();
  for (int64_t k = 0; k < K; k += LANES) {
    if (pf) { /* spread the next block's weight fetches over this block's arithmetic */
      for (int64_t off = 0; off < pf_step; off += 64) __builtin_prefetch(pf + off, 0, 2);
      pf += pf_step;
    }
    vfloat a[NB];
    for (int i = 0; i < NB; i++) a[i] = vload(w[i] + k);
#pragma GCC unroll 8
    for (int r = 0; r < nr; r++) {
      vfloat xv = vload(x + r * K + k);
      for (int i = 0; i < NB; i++) acc[r][i] = vfma(a[i], xv, acc[r][i]);
    }
  }
  for (int r = 0; r < nr; r++)
    for (int i = 0; i < NB; i++) y[r * N + i] = hsum(acc[r][i]);
}

/* nr (1..RT) fixed at compile time in each case, so the accumulators stay in registers. */
static void tile(const float *x, int64_t K, const float *const w[NB], float *y, int64_t N,
                 const char *pf, int64_t pf_step, int nr) {
#define TILE_CASE(n) \
  case n: tile_rows(x, K, w, y, N, pf, pf_step, (n) < RT ? (n) : RT); break;
  switch (nr) {  /* nr <= RT: the cases above RT never run */
    TILE_CASE(1) TILE_CASE(2) TILE_CASE(3) TILE_CASE(4) TILE_CASE(5)
    default: tile_rows(x, K, w, y, N, pf, pf_step, RT); break;
  }
#undef TILE_CASE
}

/* Edge tiles (fewer than NB weight rows): the same per-element arithmetic, one pair at a time. */
static void tile_edge(const float *x, int64_t K, const float *const w[NB], int nw, int nr,
                      float *y, int64_t N) {
  for (int r = 0; r < nr; r++) {
    for (int i = 0; i < nw; i++) {
      vfloat acc = vzero();
      for (int64_t k = 0; k < K; k += LANES) {
        acc = vfma(vload(w[i] + k), vload(x + r * K + k), acc);
      }
      y[r * N + i] = hsum(acc);
    }
  }
}

int slot_gemm(const float *x, int64_t R, int64_t K, const void *w, int wtype, int64_t N,
              float *y) {
  if (K % LANES != 0 || (wtype != W_F32 && wtype != W_F16 && wtype != W_BF16)) return -1;
  int64_t blocks = (N + NB - 1) / NB;
  int64_t wsize = wtype == W_F32 ? 4 : 2;
  int failed = 0;
#pragma omp parallel reduction(| : failed)
  {
    float *scratch = NULL;
    if (wtype != W_F32 && posix_memalign((void **)&scratch, 64, sizeof(float) * NB * K) != 0) {
      failed = 1;
    }
#pragma omp for schedule(static)
    for (int64_t b = 0; b < blocks; b++) {
      if (failed) continue;
      int64_t n0 = b * NB;
      int nw = (int)(N - n0 < NB ? N - n0 : NB);
      const float *rows[NB] = {0};
      for (int i = 0; i < nw; i++) {
        if (wtype == W_F32) {
          rows[i] = (const float *)w + (n0 + i) * K;
        } else {
          float *dst = scratch + (int64_t)i * K;
          for (int64_t k = 0; k < K; k += LANES) vstore(dst + k, widen(w, wtype, (n0 + i) * K + k));
          rows[i] = dst;
        }
      }
      for (int i = nw; i < NB; i++) rows[i] = rows[0];
      /* the block after next streams in while this one computes (see tile_rows) */
      const char *pf = NULL;
      if (b + 2 < blocks && N - n0 - 2 * NB >= NB) {
        pf = (const char *)w + (n0 + 2 * NB) * K * wsize;
      }
      if (nw < NB) {
        tile_edge(x, K, rows, nw, (int)R, y + n0, N);
        continue;
      }
      for (int64_t r0 = 0; r0 < R; r0 += RT) {
        int nr = (int)(R - r0 < RT ? R - r0 : RT);
        tile(x + r0 * K, K, rows, y + r0 * N + n0, N, r0 == 0 ? pf : NULL, NB * wsize * LANES,
             nr);
      }
    }
    free(scratch);
  }
  return failed ? -2 : 0;
}
