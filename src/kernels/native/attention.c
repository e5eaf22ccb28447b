/* Causal attention on the CPU, straight out of slotserve's paged KV pool.
 *
 * One work item per (batch row, query head): the row's query against the keys of
 * its own slot at positions lo..pos (pos = the row's absolute position; lo = 0, or
 * pos - window + 1 for sliding-window layers). Each item runs the same arithmetic
 * whatever else is in the batch, whether the row is a decode token or one token of
 * a prefill chunk, and whatever the slot's capacity:
 *   score_j = hsum(sum over D/16 lane FMAs of q*k_j) * scale   (scale includes log2 e)
 *   p_j     = exp2(score_j - max)     (exp2_neg in vec.h; under 2^-64 -> exact 0)
 *   out     = (sum_j p_j v_j in key order) / (sum_j p_j in 16 lanes, then hsum)
 * so batch invariance holds by construction; the start-up probe re-checks it.
 *
 * Pool layout (slotserve.model.kv): [blocks, BLOCK, D] float32, a block being one
 * (page, kv head). tables[t, j, h] = block holding positions j*BLOCK.. of kv head h
 * for slot table t; row_table[r] = which table row r reads (-1: padding row -> 0).
 * Row r's query heads start at q + r * q_stride (so q may sit inside a fused QKV row).
 */
#include "vec.h"

enum { BLOCK = 128 };

int slot_attention(const float *q, int64_t q_stride, int64_t R, int64_t Hq, int64_t Hkv,
                   int64_t D, float scale,
                   int64_t window, const float *kpool, const float *vpool,
                   const int32_t *tables, int64_t nbmax, const int32_t *row_table,
                   const int32_t *row_pos, float *out) {
  if (D % LANES != 0 || Hq % Hkv != 0 || D > 512) return -1;
  const int64_t group = Hq / Hkv, chunks = D / LANES, items = R * Hq;
  int failed = 0;
#pragma omp parallel reduction(| : failed)
  {
    float *scores = NULL;
    if (posix_memalign((void **)&scores, 64, sizeof(float) * (nbmax * BLOCK + LANES)) != 0) {
      failed = 1;
    }
#pragma omp for schedule(dynamic, 4)
    for (int64_t it = 0; it < items; it++) {
      if (failed) continue;
      const int64_t r = it / Hq, hq = it % Hq, h = hq / group;
      float *o = out + it * D;
      const int32_t t = row_table[r];
      if (t < 0) {
        memset(o, 0, sizeof(float) * D);
        continue;
      }
      const int64_t pos = row_pos[r];
      const int64_t lo = window > 0 && pos - window + 1 > 0 ? pos - window + 1 : 0;
      const int32_t *table = tables + (int64_t)t * nbmax * Hkv;
      vfloat qv[32];
      const float *qrow = q + r * q_stride + hq * D;
      for (int64_t c = 0; c < chunks; c++) qv[c] = vload(qrow + c * LANES);
      /* scores, in key order */
      float best = -__builtin_inff();
      for (int64_t j = lo; j <= pos; j++) {
        const float *k = kpool + ((int64_t)table[(j / BLOCK) * Hkv + h] * BLOCK + j % BLOCK) * D;
        vfloat acc = vzero();
        for (int64_t c = 0; c < chunks; c++) acc = vfma(qv[c], vload(k + c * LANES), acc);
        float s = hsum(acc) * scale;
        scores[j - lo] = s;
        best = s > best ? s : best;
      }
      /* weights and their sum: 16 keys at a time, padding lanes at -inf give 0 */
      const int64_t n = pos - lo + 1;
      for (int64_t j = n; j < ((n + LANES - 1) / LANES) * LANES; j++) scores[j] = -__builtin_inff();
      vfloat total = vzero();
      for (int64_t j = 0; j < n; j += LANES) {
        vfloat p = exp2_neg(vadd(vload(scores + j), vsplat(-best)));
        vstore(scores + j, p);
        total = vadd(total, p);
      }
      const float denom = hsum(total);
      /* out = sum_j p_j v_j / denom */
      vfloat acc[32];
      for (int64_t c = 0; c < chunks; c++) acc[c] = vzero();
      for (int64_t j = 0; j < n; j++) {
        const float p = scores[j];
        if (p == 0.0f) continue;
        const int64_t key = lo + j;
        const float *v =
            vpool + ((int64_t)table[(key / BLOCK) * Hkv + h] * BLOCK + key % BLOCK) * D;
        const vfloat pv = vsplat(p);
        for (int64_t c = 0; c < chunks; c++) acc[c] = vfma(pv, vload(v + c * LANES), acc[c]);
      }
      const vfloat inv = vsplat(denom);
      for (int64_t c = 0; c < chunks; c++) vstore(o + c * LANES, vdiv(acc[c], inv));
    }
    free(scores);
  }
  return failed ? -2 : 0;
}
