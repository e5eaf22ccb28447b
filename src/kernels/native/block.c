/* One llama-style decoder block (llama, Qwen3) on host rows, in one call from Python.
 *
 * The block's kernels (RMS norm, the QKV / output / gate+up / down matmuls, RoPE, the K/V
 * write, attention, SwiGLU, the residual adds) are the same functions Python calls one by
 * one; this only chains them. Why: a ctypes call costs ~4 us on this 2-core machine and
 * a SmolLM2 decode step made ~300 of them (30 layers x ~10), a fifth of its 6.4 ms. The
 * results are the same bits as the separate calls (the same kernels in the same order).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* A weight as the matmul kernels take it: kind 0 = slot_gemm (float weights, wtype
 * 0/1/2 = f32/f16/bf16, k a multiple of 16), kind 1 = slot_qgemm_f32 (cpu_qgemm's
 * panels, bits 4/8, f16 scales or not). */
typedef struct {
  int64_t kind, n, k, wtype, bits, f16;
  const void *w;
} slot_matrix;

int slot_gemm(const float *x, int64_t R, int64_t K, const void *w, int wtype, int64_t N,
              float *y);
int slot_qgemm_f32(const float *xf, int64_t R, int64_t K, const uint8_t *w, int bits, int f16,
                   int64_t N, float *y);
int slot_rms_norm(const float *x, int64_t R, int64_t H, const float *w, float eps, float *out);
int slot_rope(float *x, int64_t R, int64_t stride, int64_t H, int64_t D, const float *cos,
              const float *sin, const int32_t *pos);
int slot_kv_write(float *pool_k, float *pool_v, const float *src, int64_t R, int64_t stride,
                  int64_t k_off, int64_t v_off, int64_t H, int64_t D, const int32_t *rows);
int slot_attention(const float *q, int64_t q_stride, int64_t R, int64_t Hq, int64_t Hkv,
                   int64_t D, float scale, int64_t window, const float *sinks,
                   const float *kpool, const float *vpool, const int32_t *tables, int64_t nbmax,
                   const int32_t *row_table, const int32_t *row_pos, float *out);
int slot_swiglu(const float *gu, int64_t R, int64_t I, float *out);

static int matmul(const slot_matrix *m, const float *x, int64_t R, float *y) {
  if (m->kind == 0) return slot_gemm(x, R, m->k, m->w, (int)m->wtype, m->n, y);
  return slot_qgemm_f32(x, R, m->k, (const uint8_t *)m->w, (int)m->bits, (int)m->f16, m->n, y);
}

static float *buffer(int64_t floats) {
  float *p = NULL;
  return posix_memalign((void **)&p, 64, sizeof(float) * (floats > 0 ? floats : 1)) == 0 ? p
                                                                                         : NULL;
}

/* x [R, H] (the residual stream) is updated in place:
 *   h = x + o(attention(rope(qkv(norm(x)))));  x = h + down(swiglu(gate_up(norm(h))))
 * with, when q_norm is given (Qwen3), each q and k head RMS-normalized before RoPE.
 * write_rows: n_write rows x kv_heads pool rows for the real rows' K/V (padding rows
 * write nothing); the attention arguments are slot_attention's. */
int slot_llama_block(float *x, int64_t R, int64_t H, const float *in_norm,
                     const float *post_norm, float eps, const float *q_norm,
                     const float *k_norm, const slot_matrix *qkv,
                     const slot_matrix *o, const slot_matrix *gate_up, const slot_matrix *down,
                     int64_t heads, int64_t kv_heads, int64_t head_dim, const float *cos,
                     const float *sin, float *kpool, float *vpool, const int32_t *write_rows,
                     int64_t n_write, const int32_t *tables, int64_t nbmax,
                     const int32_t *row_table, const int32_t *row_pos, float scale,
                     int64_t window) {
  const int64_t qkv_n = qkv->n, inter = gate_up->n / 2;
  float *hn = buffer(R * H), *y = buffer(R * qkv_n), *att = buffer(R * heads * head_dim),
        *res = buffer(R * H), *gu = buffer(R * gate_up->n), *act = buffer(R * inter);
  int rc = (hn && y && att && res && gu && act) ? 0 : -2;
  if (rc == 0) rc = slot_rms_norm(x, R, H, in_norm, eps, hn);
  if (rc == 0) rc = matmul(qkv, hn, R, y);
  /* Qwen3's per-head RMS norms of q and k (q_norm NULL: none), in place, before RoPE */
  for (int64_t r = 0; q_norm != NULL && rc == 0 && r < R; r++) {
    float *q = y + r * qkv_n, *k = q + heads * head_dim;
    rc = slot_rms_norm(q, heads, head_dim, q_norm, eps, q);
    if (rc == 0) rc = slot_rms_norm(k, kv_heads, head_dim, k_norm, eps, k);
  }
  /* q and k heads are adjacent in the row: one RoPE pass over heads + kv_heads */
  if (rc == 0) rc = slot_rope(y, R, qkv_n, heads + kv_heads, head_dim, cos, sin, row_pos);
  if (rc == 0)
    rc = slot_kv_write(kpool, vpool, y, n_write, qkv_n, heads * head_dim,
                       (heads + kv_heads) * head_dim, kv_heads, head_dim, write_rows);
  if (rc == 0)
    rc = slot_attention(y, qkv_n, R, heads, kv_heads, head_dim, scale, window, NULL, kpool,
                        vpool, tables, nbmax, row_table, row_pos, att);
  if (rc == 0) rc = matmul(o, att, R, res);
  if (rc == 0) {
    for (int64_t i = 0; i < R * H; i++) x[i] = res[i] + x[i];
    rc = slot_rms_norm(x, R, H, post_norm, eps, hn);
  }
  if (rc == 0) rc = matmul(gate_up, hn, R, gu);
  if (rc == 0) rc = slot_swiglu(gu, R, inter, act);
  if (rc == 0) rc = matmul(down, act, R, res);
  if (rc == 0)
    for (int64_t i = 0; i < R * H; i++) x[i] = res[i] + x[i];
  free(hn);
  free(y);
  free(att);
  free(res);
  free(gu);
  free(act);
  return rc;
}
