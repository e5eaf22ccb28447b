/* The small per-layer steps between slotserve's native matmuls and attention, so a CPU
 * step stays in native memory from the embedding to the logits, the residual stream
 * and its norms included (each hand-over to MLX costs an eval and a copy, ~0.2 ms on
 * this 2-core machine, 4 per layer; MLX's CPU sigmoid is a scalar loop).
 *
 * All are row-wise and elementwise: a row's result never depends on the other rows.
 */
#include <math.h>

#include "vec.h"

/* out[r, i] = silu(gu[r, i]) * gu[r, I + i]; I a multiple of 16. */
int slot_swiglu(const float *gu, int64_t R, int64_t I, float *out) {
  if (I % LANES != 0) return -1;
  const float log2e = 1.4426950408889634f;
#pragma omp parallel for schedule(static) if (R * I > 32768)
  for (int64_t r = 0; r < R; r++) {
    const float *g = gu + r * 2 * I, *u = g + I;
    float *o = out + r * I;
    for (int64_t i = 0; i < I; i += PART_LANES) {
      vnat x = *(const vnat_u *)(g + i);
      vnati neg = x < 0.0f;
      vnati absbits;
      memcpy(&absbits, &x, sizeof absbits);
      absbits &= 0x7fffffff;
      vnat ax;
      memcpy(&ax, &absbits, sizeof ax);
      vnat e = exp2_neg_part(-ax * log2e); /* exp(-|x|) */
      vnat one = (vnat){0} + 1.0f;
      vnat den = one + e;
      /* sigmoid(x) = 1 / (1 + e) for x >= 0, e / (1 + e) for x < 0 */
      *(vnat_u *)(o + i) = x * (vselect(neg, e, one) / den) * *(const vnat_u *)(u + i);
    }
  }
  return 0;
}

/* Rotate-half RoPE in place on heads [h0, h0 + H) of each row, per the row's position:
 * x[i] <- x[i] cos[i] - x[i + D/2] sin[i];  x[i + D/2] <- x[i + D/2] cos[i + D/2] + x[i] sin[i + D/2]
 * cos/sin: [positions, D] tables; row r's heads start at x + r * stride. */
int slot_rope(float *x, int64_t R, int64_t stride, int64_t H, int64_t D, const float *cos,
              const float *sin, const int32_t *pos) {
  if (D % 2 != 0) return -1;
  const int64_t half = D / 2;
  for (int64_t r = 0; r < R; r++) {
    const float *c = cos + (int64_t)pos[r] * D, *s = sin + (int64_t)pos[r] * D;
    for (int64_t h = 0; h < H; h++) {
      float *v = x + r * stride + h * D;
      for (int64_t i = 0; i < half; i++) {
        const float a = v[i], b = v[i + half];
        const float lo = a * c[i] - b * s[i];
        const float hi = b * c[i + half] + a * s[i + half];
        v[i] = lo;
        v[i + half] = hi;
      }
    }
  }
  return 0;
}

/* Copy each row's K and V heads into the pool: dest row rows[r * H + h] of pool_k/pool_v.
 * Row r's K heads start at src + r * stride + k_off, its V heads at src + r * stride + v_off. */
int slot_kv_write(float *pool_k, float *pool_v, const float *src, int64_t R, int64_t stride,
                  int64_t k_off, int64_t v_off, int64_t H, int64_t D, const int32_t *rows) {
  for (int64_t r = 0; r < R; r++) {
    for (int64_t h = 0; h < H; h++) {
      const int64_t dest = (int64_t)rows[r * H + h] * D;
      memcpy(pool_k + dest, src + r * stride + k_off + h * D, sizeof(float) * D);
      memcpy(pool_v + dest, src + r * stride + v_off + h * D, sizeof(float) * D);
    }
  }
  return 0;
}

/* RMS norm of each row: out[r] = w * (x[r] * (1 / sqrt(mean(x[r]^2) + eps))).
 * The sum of squares runs in 16 lanes over the row in order, then hsum's add tree (the
 * same float operations on every instruction set); H a multiple of 16. */
int slot_rms_norm(const float *x, int64_t R, int64_t H, const float *w, float eps, float *out) {
  if (H % LANES != 0) return -1;
  for (int64_t r = 0; r < R; r++) {
    const float *xr = x + r * H;
    float *o = out + r * H;
    vfloat acc = vzero();
    for (int64_t i = 0; i < H; i += LANES) {
      vfloat v = vload(xr + i);
      acc = vfma(v, v, acc);
    }
    const vfloat inv = vsplat(1.0f / sqrtf(hsum(acc) / (float)H + eps));
    for (int64_t i = 0; i < H; i += LANES) {
      vfloat v = vload(xr + i);
      vfloat y;
      VLOOP y.p[i_] = v.p[i_] * inv.p[i_];
      vfloat wv = vload(w + i);
      VLOOP y.p[i_] = y.p[i_] * wv.p[i_];
      vstore(o + i, y);
    }
  }
  return 0;
}
