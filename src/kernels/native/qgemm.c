/* y = x W^T on the CPU with W kept 4- or 8-bit quantized and x quantized to int8.
 *
 * Why: the f16 kernel (gemm.c) streams 2 bytes per weight and one FMA instruction does
 * 8 (AVX2) or 16 (AVX-512) multiply-adds. Kept at 4 bits (plus a float16 scale and bias
 * per 32) a weight costs 0.625 bytes, and one byte dot product instruction (maddubs,
 * VNNI dpbusd, NEON sdot) does 32 or 64. The scheme is llama.cpp's Q8 x Q4/Q8 dot
 * product; the code and the layout are our own.
 *
 * Numbers, exactly (every ISA path below computes these operations, nothing else):
 *   activations, per row r and block b of 32 (slot_quantize_rows):
 *     d[r,b]   = max_i |x_i| / 127                       (f32 division)
 *     xq_i     = round_half_even(x_i / d[r,b])  in -127..127; all 0 when d == 0
 *     xs[r,b]  = sum_i xq_i                               (int32, exact)
 *     dxs[r,b] = d[r,b] * (float)xs[r,b]                  (f32 multiply)
 *   weights, per output row n and block b: codes c_i, scale s, bias t such that
 *     4-bit: w_i = s * c_i + t            with c_i = q_i in 0..15 (MLX's code), t = MLX bias
 *     8-bit: w_i = s * c_i + t            with c_i = q_i - 128 in -128..127,
 *                                              t = f32(MLX bias + 128 * s), rounded once at load
 *   per output y[r,n], blocks in order b = 0, 1, ..., K/32 - 1, starting from acc = +0:
 *     isum = sum_i c_i * xq_i                             (int32, exact, any order)
 *     acc  = fma(s * d[r,b], (float)isum, acc)            (the product s*d rounded first)
 *     acc  = fma(t, dxs[r,b], acc)
 *   y[r,n] = acc.
 * The integer sums are exact (|isum| < 2^24, so the float conversion is too), so every
 * ISA may split them however suits its instructions; the float operations are the same
 * per output whatever the ISA, the row count, the tile a row lands in or the thread.
 * Hence results are batch-invariant and identical across builds (AVX2, AVX-512, NEON,
 * scalar) by construction. Vectors run over 16 (or 8, 4) output rows n, one lane each,
 * so there is no horizontal add at all.
 *
 * Weight layout (built once at load by cpu_qgemm.py): panels of 16 output rows (N padded
 * with zero rows), each panel K/32 blocks, each block:
 *   codes: 4-bit: 4 chunks of 64 bytes; chunk c, byte 4j+t = c[j][4c+t] | c[j][16+4c+t] << 4
 *          8-bit: 8 chunks of 64 bytes; chunk g, byte 4j+t = (int8) c[j][4g+t]
 *          (j = row in the panel), so a 32-bit lane j holds 4 consecutive k of row j and
 *          a dot product against 4 broadcast activation bytes lands in lane j; AND / shift
 *          of one 64-byte load unpacks two groups of 4 for all 16 rows.
 *   then 16 scales s and 16 biases t, float32 or float16 (f16 only when exact).
 * A block is 64-byte aligned (its size is 320, 384, 576 or 640 bytes).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AVX512F__) && defined(__AVX512BW__)
#define QG_AVX512 1
#include <immintrin.h>
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define QG_AVX2 1
#include <immintrin.h>
#elif defined(__aarch64__) && defined(__ARM_NEON)
#define QG_NEON 1
#include <arm_neon.h>
#endif

enum { QB = 32, PANEL = 16 };

typedef struct {
  const int8_t *q;    /* [R, K] */
  const float *d;     /* [R, K/32] */
  const float *dxs;   /* [R, K/32] */
  const int32_t *xs;  /* [R, K/32] */
  int64_t K, nb;
} qrows;

static inline int64_t block_bytes(int bits, int f16) {
  return (bits == 4 ? 256 : 512) + 2 * PANEL * (f16 ? 2 : 4);
}

/* Block i (32 floats at x + 32 i) to int8. Plain C so the compiler vectorizes it for
 * every target with the same IEEE operations: |x| is compared as integer bits (exact and
 * order-free, where a float max reduction would not vectorize without fast-math), the
 * division is correctly rounded everywhere and rintf rounds half to even in the default
 * mode. Never a reciprocal estimate. */
static inline void quantize_block(const float *x, int64_t i, int8_t *xq, float *d, float *dxs,
                                  int32_t *xs) {
  const float *src = x + i * QB;
  int8_t *dst = xq + i * QB;
  uint32_t m = 0;
  for (int t = 0; t < QB; t++) {
    uint32_t u;
    memcpy(&u, src + t, sizeof u);
    u &= 0x7fffffffu;
    m = u > m ? u : m;
  }
  float amax;
  memcpy(&amax, &m, sizeof amax);
  const float dd = amax / 127.0f;
  int32_t sum = 0;
  if (dd == 0.0f) { /* also when amax is so small that amax/127 underflows */
    memset(dst, 0, QB);
  } else {
    /* |x/d| <= 127 * (1 + 2^-23) rounds to at most 127: no clamp needed */
    for (int t = 0; t < QB; t++) {
      const int32_t q = (int32_t)rintf(src[t] / dd);
      dst[t] = (int8_t)q;
      sum += q;
    }
  }
  d[i] = dd;
  xs[i] = sum;
  dxs[i] = dd * (float)sum;
}

/* x [R, K] -> xq [R, K], and per block of 32: d, dxs, xs [R, K/32] (top of file). */
int slot_quantize_rows(const float *x, int64_t R, int64_t K, int8_t *xq, float *d, float *dxs,
                       int32_t *xs) {
  if (K % QB != 0 || R < 0) return -1;
  const int64_t blocks = R * (K / QB);
#pragma omp parallel for schedule(static) if (blocks >= 4096)
  for (int64_t i = 0; i < blocks; i++) quantize_block(x, i, xq, d, dxs, xs);
  return 0;
}

/* ------------------------------------------------------------------------------------ */
#if defined(QG_AVX512)
/* 16 output rows per zmm lane set. 8 weight registers per block stay live while up to
 * RT activation rows pass over them; 32 registers hold them plus RT accumulators. */
#define QG_RT 8

static inline __m512i bcast4(const int8_t *p) {
  int32_t v;
  memcpy(&v, p, sizeof v);
  return _mm512_set1_epi32(v);
}

static inline __m512 load16(const uint8_t *p, const int f16) {
  return f16 ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p))
             : _mm512_loadu_ps((const float *)p);
}

static inline __attribute__((always_inline)) void panel4(const qrows *x, int64_t r0, const int nr,
                                                         const uint8_t *panel, const int f16,
                                                         float out[][PANEL]) {
  const int64_t bs = block_bytes(4, f16), ss = PANEL * (f16 ? 2 : 4);
  const __m512i m4 = _mm512_set1_epi8(0x0F);
  __m512 acc[QG_RT];
  for (int r = 0; r < nr; r++) acc[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < x->nb; b++) {
    const uint8_t *blk = panel + b * bs;
    __m512i lo[4], hi[4];
    for (int c = 0; c < 4; c++) {
      const __m512i raw = _mm512_load_si512((const void *)(blk + 64 * c));
      lo[c] = _mm512_and_si512(raw, m4);
      hi[c] = _mm512_and_si512(_mm512_srli_epi16(raw, 4), m4);
    }
    const __m512 ws = load16(blk + 256, f16), wt = load16(blk + 256 + ss, f16);
    for (int r = 0; r < nr; r++) {
      const int8_t *xb = x->q + (r0 + r) * x->K + b * QB;
#if defined(__AVX512VNNI__)
      /* two chains, so one row alone is not bound by dpbusd latency */
      __m512i s0 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), lo[0], bcast4(xb));
      __m512i s1 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), hi[0], bcast4(xb + 16));
      for (int c = 1; c < 4; c++) {
        s0 = _mm512_dpbusd_epi32(s0, lo[c], bcast4(xb + 4 * c));
        s1 = _mm512_dpbusd_epi32(s1, hi[c], bcast4(xb + 16 + 4 * c));
      }
      const __m512i isum = _mm512_add_epi32(s0, s1);
#else
      /* 8 pair sums of at most 2*15*127 each stay below 2^15: add them as int16 and
       * widen once per block */
      __m512i s = _mm512_add_epi16(_mm512_maddubs_epi16(lo[0], bcast4(xb)),
                                   _mm512_maddubs_epi16(hi[0], bcast4(xb + 16)));
      for (int c = 1; c < 4; c++) {
        s = _mm512_add_epi16(s, _mm512_maddubs_epi16(lo[c], bcast4(xb + 4 * c)));
        s = _mm512_add_epi16(s, _mm512_maddubs_epi16(hi[c], bcast4(xb + 16 + 4 * c)));
      }
      const __m512i isum = _mm512_madd_epi16(s, _mm512_set1_epi16(1));
#endif
      const int64_t i = (r0 + r) * x->nb + b;
      acc[r] = _mm512_fmadd_ps(_mm512_mul_ps(ws, _mm512_set1_ps(x->d[i])),
                               _mm512_cvtepi32_ps(isum), acc[r]);
      acc[r] = _mm512_fmadd_ps(wt, _mm512_set1_ps(x->dxs[i]), acc[r]);
    }
  }
  for (int r = 0; r < nr; r++) _mm512_storeu_ps(out[r], acc[r]);
}

static inline __attribute__((always_inline)) void panel8(const qrows *x, int64_t r0, const int nr,
                                                         const uint8_t *panel, const int f16,
                                                         float out[][PANEL]) {
  const int64_t bs = block_bytes(8, f16), ss = PANEL * (f16 ? 2 : 4);
  __m512 acc[QG_RT];
  for (int r = 0; r < nr; r++) acc[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < x->nb; b++) {
    const uint8_t *blk = panel + b * bs;
    const __m512 ws = load16(blk + 512, f16), wt = load16(blk + 512 + ss, f16);
#if defined(__AVX512VNNI__)
    /* dpbusd wants unsigned bytes: c + 128 = c ^ 0x80; the 128 * xs it adds is taken
     * off in the accumulator's starting value */
    __m512i wu[8];
    for (int g = 0; g < 8; g++) {
      wu[g] = _mm512_xor_si512(_mm512_load_si512((const void *)(blk + 64 * g)),
                               _mm512_set1_epi8((char)0x80));
    }
    for (int r = 0; r < nr; r++) {
      const int8_t *xb = x->q + (r0 + r) * x->K + b * QB;
      const int64_t i = (r0 + r) * x->nb + b;
      __m512i s0 = _mm512_set1_epi32(-128 * x->xs[i]), s1 = _mm512_setzero_si512();
      for (int g = 0; g < 8; g += 2) {
        s0 = _mm512_dpbusd_epi32(s0, wu[g], bcast4(xb + 4 * g));
        s1 = _mm512_dpbusd_epi32(s1, wu[g + 1], bcast4(xb + 4 * g + 4));
      }
      const __m512i isum = _mm512_add_epi32(s0, s1);
#else
    /* maddubs multiplies unsigned by signed: |c| (128 fits as unsigned) times x with c's
     * sign; one pair sum (<= 2*128*127) fits int16, two would not */
    __m512i wa[8];
    __mmask64 neg[8];
    for (int g = 0; g < 8; g++) {
      const __m512i raw = _mm512_load_si512((const void *)(blk + 64 * g));
      wa[g] = _mm512_abs_epi8(raw);
      neg[g] = _mm512_movepi8_mask(raw);
    }
    for (int r = 0; r < nr; r++) {
      const int8_t *xb = x->q + (r0 + r) * x->K + b * QB;
      const int64_t i = (r0 + r) * x->nb + b;
      __m512i isum = _mm512_setzero_si512();
      for (int g = 0; g < 8; g++) {
        const __m512i xv = bcast4(xb + 4 * g);
        const __m512i xsgn = _mm512_mask_sub_epi8(xv, neg[g], _mm512_setzero_si512(), xv);
        isum = _mm512_add_epi32(
            isum, _mm512_madd_epi16(_mm512_maddubs_epi16(wa[g], xsgn), _mm512_set1_epi16(1)));
      }
#endif
      acc[r] = _mm512_fmadd_ps(_mm512_mul_ps(ws, _mm512_set1_ps(x->d[i])),
                               _mm512_cvtepi32_ps(isum), acc[r]);
      acc[r] = _mm512_fmadd_ps(wt, _mm512_set1_ps(x->dxs[i]), acc[r]);
    }
  }
  for (int r = 0; r < nr; r++) _mm512_storeu_ps(out[r], acc[r]);
}

/* ------------------------------------------------------------------------------------ */
#elif defined(QG_AVX2)
/* 8 output rows per ymm: a panel is done as two halves. 16 registers hold RT accumulators,
 * RT block sums and the two unpacked weight vectors of the current chunk (6 rows, with
 * some accumulators in memory, measured the same at 32 rows and slower at 8). */
#define QG_RT 4

/* An empty asm that "changes" v, so each sum is complete before the next chunk: GCC
 * otherwise hoists every product of a block ahead of the adds and spills half of them
 * (2x slower). */
#define QG_KEEP(v) __asm__("" : "+x"(v))

#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define QG_DPBUSD256(a, w, x) _mm256_dpbusd_epi32(a, w, x)
#elif defined(__AVXVNNI__)
#define QG_DPBUSD256(a, w, x) _mm256_dpbusd_avx_epi32(a, w, x)
#endif

static inline __m256i bcast4(const int8_t *p) {
  int32_t v;
  memcpy(&v, p, sizeof v);
  return _mm256_set1_epi32(v);
}

static inline __m256 load8(const uint8_t *p, const int f16) {
  return f16 ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p))
             : _mm256_loadu_ps((const float *)p);
}

static inline __attribute__((always_inline)) void half4(const qrows *x, int64_t r0, const int nr,
                                                        const uint8_t *panel, const int f16,
                                                        const int h, float out[][PANEL]) {
  const int64_t bs = block_bytes(4, f16), ss = PANEL * (f16 ? 2 : 4);
  const __m256i m4 = _mm256_set1_epi8(0x0F);
  __m256 acc[QG_RT];
  for (int r = 0; r < nr; r++) acc[r] = _mm256_setzero_ps();
  for (int64_t b = 0; b < x->nb; b++) {
    const uint8_t *blk = panel + b * bs;
    __m256i s[QG_RT];
    for (int c = 0; c < 4; c++) {
      const __m256i raw = _mm256_load_si256((const __m256i *)(blk + 64 * c + 32 * h));
      const __m256i lo = _mm256_and_si256(raw, m4);
      const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), m4);
      for (int r = 0; r < nr; r++) {
        const int8_t *xb = x->q + (r0 + r) * x->K + b * QB;
#if defined(QG_DPBUSD256)
        const __m256i z = c ? s[r] : _mm256_setzero_si256();
        s[r] = QG_DPBUSD256(QG_DPBUSD256(z, lo, bcast4(xb + 4 * c)), hi,
                            bcast4(xb + 16 + 4 * c));
#else
        /* 8 pair sums of at most 2*15*127 each stay below 2^15 (see panel4 above) */
        const __m256i p = _mm256_add_epi16(_mm256_maddubs_epi16(lo, bcast4(xb + 4 * c)),
                                           _mm256_maddubs_epi16(hi, bcast4(xb + 16 + 4 * c)));
        s[r] = c ? _mm256_add_epi16(s[r], p) : p;
#endif
        QG_KEEP(s[r]);
      }
    }
    const __m256 ws = load8(blk + 256 + h * ss / 2, f16);
    const __m256 wt = load8(blk + 256 + ss + h * ss / 2, f16);
    for (int r = 0; r < nr; r++) {
#if defined(QG_DPBUSD256)
      const __m256i isum = s[r];
#else
      const __m256i isum = _mm256_madd_epi16(s[r], _mm256_set1_epi16(1));
#endif
      const int64_t i = (r0 + r) * x->nb + b;
      acc[r] = _mm256_fmadd_ps(_mm256_mul_ps(ws, _mm256_set1_ps(x->d[i])),
                               _mm256_cvtepi32_ps(isum), acc[r]);
      acc[r] = _mm256_fmadd_ps(wt, _mm256_set1_ps(x->dxs[i]), acc[r]);
    }
  }
  for (int r = 0; r < nr; r++) _mm256_storeu_ps(out[r] + 8 * h, acc[r]);
}

static inline __attribute__((always_inline)) void half8(const qrows *x, int64_t r0, const int nr,
                                                        const uint8_t *panel, const int f16,
                                                        const int h, float out[][PANEL]) {
  const int64_t bs = block_bytes(8, f16), ss = PANEL * (f16 ? 2 : 4);
  __m256 acc[QG_RT];
  for (int r = 0; r < nr; r++) acc[r] = _mm256_setzero_ps();
  for (int64_t b = 0; b < x->nb; b++) {
    const uint8_t *blk = panel + b * bs;
    __m256i s[QG_RT];
    for (int r = 0; r < nr; r++) {
#if defined(QG_DPBUSD256)
      /* unsigned c + 128 in dpbusd; the 128 * xs is taken off up front */
      s[r] = _mm256_set1_epi32(-128 * x->xs[(r0 + r) * x->nb + b]);
#else
      s[r] = _mm256_setzero_si256();
#endif
    }
    for (int g = 0; g < 8; g++) {
      const __m256i raw = _mm256_load_si256((const __m256i *)(blk + 64 * g + 32 * h));
#if defined(QG_DPBUSD256)
      const __m256i wu = _mm256_xor_si256(raw, _mm256_set1_epi8((char)0x80));
#else
      const __m256i wa = _mm256_abs_epi8(raw);
#endif
      for (int r = 0; r < nr; r++) {
        const __m256i xv = bcast4(x->q + (r0 + r) * x->K + b * QB + 4 * g);
#if defined(QG_DPBUSD256)
        s[r] = QG_DPBUSD256(s[r], wu, xv);
#else
        /* |c| (128 fits as unsigned) times x with c's sign; one pair sum fits int16 */
        const __m256i p = _mm256_maddubs_epi16(wa, _mm256_sign_epi8(xv, raw));
        s[r] = _mm256_add_epi32(s[r], _mm256_madd_epi16(p, _mm256_set1_epi16(1)));
#endif
        QG_KEEP(s[r]);
      }
    }
    const __m256 ws = load8(blk + 512 + h * ss / 2, f16);
    const __m256 wt = load8(blk + 512 + ss + h * ss / 2, f16);
    for (int r = 0; r < nr; r++) {
      const int64_t i = (r0 + r) * x->nb + b;
      acc[r] = _mm256_fmadd_ps(_mm256_mul_ps(ws, _mm256_set1_ps(x->d[i])),
                               _mm256_cvtepi32_ps(s[r]), acc[r]);
      acc[r] = _mm256_fmadd_ps(wt, _mm256_set1_ps(x->dxs[i]), acc[r]);
    }
  }
  for (int r = 0; r < nr; r++) _mm256_storeu_ps(out[r] + 8 * h, acc[r]);
}

static inline __attribute__((always_inline)) void panel4(const qrows *x, int64_t r0, const int nr,
                                                         const uint8_t *panel, const int f16,
                                                         float out[][PANEL]) {
  half4(x, r0, nr, panel, f16, 0, out);
  half4(x, r0, nr, panel, f16, 1, out);
}

static inline __attribute__((always_inline)) void panel8(const qrows *x, int64_t r0, const int nr,
                                                         const uint8_t *panel, const int f16,
                                                         float out[][PANEL]) {
  half8(x, r0, nr, panel, f16, 0, out);
  half8(x, r0, nr, panel, f16, 1, out);
}

/* ------------------------------------------------------------------------------------ */
#elif defined(QG_NEON)
/* 4 output rows per q register: a panel is done as four quarters, each block's 8 weight
 * vectors kept in registers while RT activation rows pass over them (32 registers). */
#define QG_RT 8

static inline float32x4_t load4(const uint8_t *p, const int f16) {
  return f16 ? vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16((const uint16_t *)p)))
             : vld1q_f32((const float *)p);
}

#if defined(__ARM_FEATURE_DOTPROD)
#define QG_SDOT(acc, w, xv, lane) vdotq_laneq_s32(acc, w, xv, lane)
#else
/* lane j += sum over t of w[4j+t] * xv[4*lane+t], from widening multiplies (inlined, so
 * the switch on the constant lane folds away) */
static inline __attribute__((always_inline)) int32x4_t sdot_emul(int32x4_t acc, int8x16_t w, int8x16_t xv, const int lane) {
  int8x16_t xl;
  switch (lane) {
    case 0: xl = vreinterpretq_s8_s32(vdupq_laneq_s32(vreinterpretq_s32_s8(xv), 0)); break;
    case 1: xl = vreinterpretq_s8_s32(vdupq_laneq_s32(vreinterpretq_s32_s8(xv), 1)); break;
    case 2: xl = vreinterpretq_s8_s32(vdupq_laneq_s32(vreinterpretq_s32_s8(xv), 2)); break;
    default: xl = vreinterpretq_s8_s32(vdupq_laneq_s32(vreinterpretq_s32_s8(xv), 3)); break;
  }
  const int32x4_t pl = vpaddlq_s16(vmull_s8(vget_low_s8(w), vget_low_s8(xl)));
  const int32x4_t ph = vpaddlq_s16(vmull_high_s8(w, xl));
  return vaddq_s32(acc, vpaddq_s32(pl, ph));
}
#define QG_SDOT(acc, w, xv, lane) sdot_emul(acc, w, xv, lane)
#endif

static inline __attribute__((always_inline)) void quarter(const qrows *x, int64_t r0,
                                                          const int nr, const uint8_t *panel,
                                                          const int bits, const int f16,
                                                          const int qt, float out[][PANEL]) {
  const int64_t bs = block_bytes(bits, f16), ss = PANEL * (f16 ? 2 : 4);
  const int64_t cb = bits == 4 ? 256 : 512;
  float32x4_t acc[QG_RT];
  for (int r = 0; r < nr; r++) acc[r] = vdupq_n_f32(0.0f);
  for (int64_t b = 0; b < x->nb; b++) {
    const uint8_t *blk = panel + b * bs;
    int8x16_t w[8];
    if (bits == 4) {
      /* w[c] = group c (k 4c..4c+3), w[4+c] = group 4+c (k 16+4c..) */
      for (int c = 0; c < 4; c++) {
        const uint8x16_t raw = vld1q_u8(blk + 64 * c + 16 * qt);
        w[c] = vreinterpretq_s8_u8(vandq_u8(raw, vdupq_n_u8(0x0F)));
        w[4 + c] = vreinterpretq_s8_u8(vshrq_n_u8(raw, 4));
      }
    } else {
      for (int g = 0; g < 8; g++) w[g] = vld1q_s8((const int8_t *)blk + 64 * g + 16 * qt);
    }
    const float32x4_t ws = load4(blk + cb + qt * ss / 4, f16);
    const float32x4_t wt = load4(blk + cb + ss + qt * ss / 4, f16);
    for (int r = 0; r < nr; r++) {
      const int8_t *xb = x->q + (r0 + r) * x->K + b * QB;
      const int8x16_t xl = vld1q_s8(xb), xh = vld1q_s8(xb + 16);
      /* the two layouts put groups in the same registers (w[g] = k 4g..4g+3) */
      int32x4_t s0 = QG_SDOT(vdupq_n_s32(0), w[0], xl, 0);
      int32x4_t s1 = QG_SDOT(vdupq_n_s32(0), w[4], xh, 0);
      s0 = QG_SDOT(s0, w[1], xl, 1);
      s1 = QG_SDOT(s1, w[5], xh, 1);
      s0 = QG_SDOT(s0, w[2], xl, 2);
      s1 = QG_SDOT(s1, w[6], xh, 2);
      s0 = QG_SDOT(s0, w[3], xl, 3);
      s1 = QG_SDOT(s1, w[7], xh, 3);
      const int32x4_t isum = vaddq_s32(s0, s1);
      const int64_t i = (r0 + r) * x->nb + b;
      acc[r] = vfmaq_f32(acc[r], vmulq_n_f32(ws, x->d[i]), vcvtq_f32_s32(isum));
      acc[r] = vfmaq_n_f32(acc[r], wt, x->dxs[i]);
    }
  }
  for (int r = 0; r < nr; r++) vst1q_f32(out[r] + 4 * qt, acc[r]);
}

static inline __attribute__((always_inline)) void panel4(const qrows *x, int64_t r0, const int nr,
                                                         const uint8_t *panel, const int f16,
                                                         float out[][PANEL]) {
  for (int qt = 0; qt < 4; qt++) quarter(x, r0, nr, panel, 4, f16, qt, out);
}

static inline __attribute__((always_inline)) void panel8(const qrows *x, int64_t r0, const int nr,
                                                         const uint8_t *panel, const int f16,
                                                         float out[][PANEL]) {
  for (int qt = 0; qt < 4; qt++) quarter(x, r0, nr, panel, 8, f16, qt, out);
}

/* ------------------------------------------------------------------------------------ */
#else
/* Portable C: the reference the vector paths must match bit for bit. */
#define QG_RT 4

static inline float load1(const uint8_t *p, int j, const int f16) {
  if (f16) {
    _Float16 h;
    memcpy(&h, p + 2 * j, sizeof h);
    return (float)h;
  }
  float f;
  memcpy(&f, p + 4 * j, sizeof f);
  return f;
}

static inline int code(const uint8_t *blk, int bits, int j, int k) {
  if (bits == 4) {
    const uint8_t byte = blk[64 * ((k % 16) / 4) + 4 * j + k % 4];
    return k < 16 ? byte & 0x0F : byte >> 4;
  }
  return (int8_t)blk[64 * (k / 4) + 4 * j + k % 4];
}

static void panel_any(const qrows *x, int64_t r0, int nr, const uint8_t *panel, int bits,
                      int f16, float out[][PANEL]) {
  const int64_t bs = block_bytes(bits, f16), ss = PANEL * (f16 ? 2 : 4);
  const int64_t cb = bits == 4 ? 256 : 512;
  for (int r = 0; r < nr; r++) {
    for (int j = 0; j < PANEL; j++) {
      float acc = 0.0f;
      for (int64_t b = 0; b < x->nb; b++) {
        const uint8_t *blk = panel + b * bs;
        const int8_t *xb = x->q + (r0 + r) * x->K + b * QB;
        int32_t isum = 0;
        for (int k = 0; k < QB; k++) isum += code(blk, bits, j, k) * xb[k];
        const int64_t i = (r0 + r) * x->nb + b;
        const float sd = load1(blk + cb, j, f16) * x->d[i];
        acc = fmaf(sd, (float)isum, acc);
        acc = fmaf(load1(blk + cb + ss, j, f16), x->dxs[i], acc);
      }
      out[r][j] = acc;
    }
  }
}

#define panel4(x, r0, nr, panel, f16, out) panel_any(x, r0, nr, panel, 4, f16, out)
#define panel8(x, r0, nr, panel, f16, out) panel_any(x, r0, nr, panel, 8, f16, out)
#endif

/* ------------------------------------------------------------------------------------ */
/* One instance per (bits, scale type, rows in the tile): with nr a compile-time constant
 * the accumulators stay in registers. */
static inline __attribute__((always_inline)) void by_rows(const qrows *x, int64_t r0, int nr,
                                                          const uint8_t *p, const int bits,
                                                          const int f16, float out[][PANEL]) {
#define QG_ROWS(n)                                  \
  if (bits == 4) panel4(x, r0, n, p, f16, out);     \
  else panel8(x, r0, n, p, f16, out);               \
  break;
  switch (nr) {
    case 1: QG_ROWS(1)
    case 2: QG_ROWS(2)
    case 3: QG_ROWS(3)
#if QG_RT > 4
    case 4: QG_ROWS(4)
    case 5: QG_ROWS(5)
#endif
#if QG_RT > 6
    case 6: QG_ROWS(6)
    case 7: QG_ROWS(7)
#endif
    default: QG_ROWS(QG_RT)
  }
#undef QG_ROWS
}

static void tile4_f32(const qrows *x, int64_t r0, int nr, const uint8_t *p, float out[][PANEL]) {
  by_rows(x, r0, nr, p, 4, 0, out);
}
static void tile4_f16(const qrows *x, int64_t r0, int nr, const uint8_t *p, float out[][PANEL]) {
  by_rows(x, r0, nr, p, 4, 1, out);
}
static void tile8_f32(const qrows *x, int64_t r0, int nr, const uint8_t *p, float out[][PANEL]) {
  by_rows(x, r0, nr, p, 8, 0, out);
}
static void tile8_f16(const qrows *x, int64_t r0, int nr, const uint8_t *p, float out[][PANEL]) {
  by_rows(x, r0, nr, p, 8, 1, out);
}

typedef void (*tile_fn)(const qrows *, int64_t, int, const uint8_t *, float[][PANEL]);

static int bad_args(int64_t R, int64_t K, const uint8_t *w, int bits, int f16, int64_t N) {
  return K % QB != 0 || K <= 0 || R < 0 || N < 0 || (bits != 4 && bits != 8) ||
         (f16 != 0 && f16 != 1) || ((uintptr_t)w & 63) != 0;
}

/* Big enough to be worth waking the second thread (~2 us on this 2-core machine). */
static int parallel_worth(int64_t R, int64_t K, int64_t N) {
  return N > PANEL && R * N * K >= (1 << 17);
}

/* The panels of this thread (inside a parallel region) or all of them (outside one).
 * Split by panels, static schedule: a thread reads its panels' weights once, for all R
 * rows, as one sequential stream. No software prefetch: the hardware prefetchers follow
 * that stream, and explicit prefetches cost 20-30 % of the DRAM bandwidth of a one-row
 * (decode) call on Zen 4. */
static void gemm_panels(const qrows *x, int64_t R, const uint8_t *w, int bits, int f16,
                        int64_t N, float *y) {
  const tile_fn tile = bits == 4 ? (f16 ? tile4_f16 : tile4_f32) : (f16 ? tile8_f16 : tile8_f32);
  const int64_t panels = (N + PANEL - 1) / PANEL, pstride = x->nb * block_bytes(bits, f16);
#pragma omp for schedule(static)
  for (int64_t p = 0; p < panels; p++) {
    const int nw = N - p * PANEL < PANEL ? (int)(N - p * PANEL) : PANEL;
    float out[QG_RT][PANEL] __attribute__((aligned(64)));
    for (int64_t r0 = 0; r0 < R; r0 += QG_RT) {
      const int nr = R - r0 < QG_RT ? (int)(R - r0) : QG_RT;
      tile(x, r0, nr, w + p * pstride, out);
      for (int r = 0; r < nr; r++) memcpy(y + (r0 + r) * N + p * PANEL, out[r], sizeof(float) * nw);
    }
  }
}

/* y [R, N] = dequant(W) applied to rows already quantized by slot_quantize_rows (so
 * several matrices can share them); w: the panels described at the top. */
int slot_qgemm(const int8_t *xq, const float *d, const float *dxs, const int32_t *xs, int64_t R,
               int64_t K, const uint8_t *w, int bits, int f16, int64_t N, float *y) {
  if (bad_args(R, K, w, bits, f16, N)) return -1;
  const qrows x = {xq, d, dxs, xs, K, K / QB};
#pragma omp parallel if (parallel_worth(R, K, N))
  gemm_panels(&x, R, w, bits, f16, N, y);
  return 0;
}

/* y [R, N] = dequant(W) x for float rows x [R, K]: quantization and matmul in one call
 * and one parallel region (a decode step's matmul is ~5 us; each Python-to-C call and
 * thread wake-up saved is a visible part of that). */
int slot_qgemm_f32(const float *xf, int64_t R, int64_t K, const uint8_t *w, int bits, int f16,
                   int64_t N, float *y) {
  if (bad_args(R, K, w, bits, f16, N)) return -1;
  const int64_t nb = K / QB, blocks = R * nb;
  void *buf = NULL;
  if (posix_memalign(&buf, 64, (size_t)(R * K + 12 * blocks) + 64) != 0) return -2;
  int8_t *xq = buf;
  float *d = (float *)(xq + R * K), *dxs = d + blocks;
  int32_t *xs = (int32_t *)(dxs + blocks);
  const qrows x = {xq, d, dxs, xs, K, nb};
#pragma omp parallel if (parallel_worth(R, K, N))
  {
#pragma omp for schedule(static)
    for (int64_t i = 0; i < blocks; i++) quantize_block(xf, i, xq, d, dxs, xs);
    gemm_panels(&x, R, w, bits, f16, N, y);
  }
  free(buf);
  return 0;
}
