/* Causal attention on the CPU, straight out of slotserve's paged KV pool.
 *
 * Each query (a batch row and a query head) attends to the keys of its own slot at
 * positions lo..pos (pos = the row's absolute position; lo = 0, or pos - window + 1 for
 * sliding-window layers), with the same arithmetic whatever else is in the batch,
 * whether the row is a decode token or one token of a prefill chunk, and whatever the
 * slot's capacity:
 *   score_j = hsum(sum over D/16 lane FMAs of q*k_j) * scale   (scale includes log2 e)
 *   p_j     = exp2(score_j - max)     (exp2_neg in vec.h; under 2^-64 -> exact 0)
 *   out     = (sum_j p_j v_j in key order) / (sum_j p_j in 16 lanes, then hsum)
 * so batch invariance holds by construction; the start-up probe re-checks it.
 *
 * Work is split into items of one kv head and a tile of up to TILE_ROWS consecutive rows
 * of one slot at consecutive positions (a prefill chunk; a decode row is a tile of one).
 * An item runs the group's query heads of all its rows together, so each key and value
 * vector is read once for up to TILE_ROWS x group queries instead of once per query (a
 * slot's f32 K/V at 4k tokens is 6 MB a layer, more than L2). With four rows a tile the
 * reads are no longer the bound: tiles of 8 or 16 rows, or a float16 pool, measured the
 * same (2026-12-08); the instructions per key and query are. The tiling only shares
 * loads: every query still runs the operations above, in the same order, so the results
 * are the same bits as one query at a time.
 *
 * Pool layout (slotserve.model.kv): [blocks, BLOCK, D] float32, a block being one
 * (page, kv head). tables[t, j, h] = block holding positions j*BLOCK.. of kv head h
 * for slot table t; row_table[r] = which table row r reads (-1: padding row -> 0).
 * Row r's query heads start at q + r * q_stride (so q may sit inside a fused QKV row).
 */
#include <math.h>

#include "vec.h"

enum { BLOCK = 128, TILE_ROWS = 4, MAX_CHUNKS = 32, KEY_BLOCK = 64 };

static inline const float *pool_row(const float *pool, const int32_t *table, int64_t Hkv,
                                    int64_t h, int64_t j, int64_t D) {
  return pool + ((int64_t)table[(j / BLOCK) * Hkv + h] * BLOCK + j % BLOCK) * D;
}

/* o0 += sum over n consecutive keys of p0[j] * v[j] (rows 16 * nch floats apart), in key
 * order, and with two, o1 likewise from p1 over the same keys. */
static inline __attribute__((always_inline)) void pv_run(const float *p0, const float *p1,
                                                         const float *v, int64_t n, vfloat *o0,
                                                         vfloat *o1, const int nch,
                                                         const int two) {
  vfloat r0[MAX_CHUNKS], r1[MAX_CHUNKS];
  for (int c = 0; c < nch; c++) r0[c] = o0[c];
  if (two)
    for (int c = 0; c < nch; c++) r1[c] = o1[c];
  for (int64_t j = 0; j < n; j++) {
    const float *vj = v + j * nch * LANES;
    if (p0[j] != 0.0f) {
      const vfloat pv = vsplat(p0[j]);
      for (int c = 0; c < nch; c++) r0[c] = vfma(pv, vload(vj + c * LANES), r0[c]);
    }
    if (two && p1[j] != 0.0f) {
      const vfloat pv = vsplat(p1[j]);
      for (int c = 0; c < nch; c++) r1[c] = vfma(pv, vload(vj + c * LANES), r1[c]);
    }
  }
  for (int c = 0; c < nch; c++) o0[c] = r0[c];
  if (two)
    for (int c = 0; c < nch; c++) o1[c] = r1[c];
}

int slot_attention(const float *q, int64_t q_stride, int64_t R, int64_t Hq, int64_t Hkv,
                   int64_t D, float scale,
                   int64_t window, const float *sinks, const float *kpool, const float *vpool,
                   const int32_t *tables, int64_t nbmax, const int32_t *row_table,
                   const int32_t *row_pos, float *out) {
  if (D % LANES != 0 || Hq % Hkv != 0 || D > LANES * MAX_CHUNKS) return -1;
  const int64_t group = Hq / Hkv, chunks = D / LANES;
  /* tiles: runs of rows of one table at consecutive positions, at most TILE_ROWS long */
  int64_t *tile_start = malloc(sizeof(int64_t) * (R + 1));
  if (tile_start == NULL) return -2;
  int64_t tiles = 0;
  for (int64_t r = 0; r < R; r++) {
    int fresh = r == 0 || row_table[r] < 0 || row_table[r] != row_table[r - 1] ||
                row_pos[r] != row_pos[r - 1] + 1 || r - tile_start[tiles - 1] >= TILE_ROWS;
    if (fresh) tile_start[tiles++] = r;
  }
  tile_start[tiles] = R;
  const int64_t nq_max = TILE_ROWS * group, stride = nbmax * BLOCK + LANES;
  const int64_t items = tiles * Hkv;
  int failed = 0;
#pragma omp parallel reduction(| : failed)
  {
    float *scores = NULL, *bestv = NULL, *best = malloc(sizeof(float) * nq_max),
          *denom = malloc(sizeof(float) * nq_max);
    int64_t *lo = malloc(sizeof(int64_t) * nq_max), *pos = malloc(sizeof(int64_t) * nq_max);
    vfloat *qv = NULL, *acc = NULL;
    if (posix_memalign((void **)&scores, 64, sizeof(float) * stride * nq_max) != 0 ||
        posix_memalign((void **)&qv, 64, sizeof(vfloat) * chunks * nq_max) != 0 ||
        posix_memalign((void **)&acc, 64, sizeof(vfloat) * chunks * nq_max) != 0 ||
        posix_memalign((void **)&bestv, 64, sizeof(float) * LANES * nq_max) != 0 ||
        !best || !denom || !lo || !pos) {
      failed = 1;
    }
#pragma omp for schedule(dynamic, 1)
    for (int64_t it = 0; it < items; it++) {
      if (failed) continue;
      const int64_t tile = it / Hkv, h = it % Hkv;
      const int64_t r0 = tile_start[tile], rows = tile_start[tile + 1] - r0;
      const int32_t t = row_table[r0];
      const int64_t nq = rows * group;
      if (t < 0) { /* a padding row (tiles of one) */
        memset(out + (r0 * Hq + h * group) * D, 0, sizeof(float) * group * D);
        continue;
      }
      const int32_t *table = tables + (int64_t)t * nbmax * Hkv;
      int64_t jlo = INT64_MAX, jhi = -1;
      for (int64_t i = 0; i < nq; i++) { /* query i: row r0 + i / group, head h * group + i % group */
        const int64_t r = r0 + i / group, hq = h * group + i % group;
        pos[i] = row_pos[r];
        lo[i] = window > 0 && pos[i] - window + 1 > 0 ? pos[i] - window + 1 : 0;
        jlo = lo[i] < jlo ? lo[i] : jlo;
        jhi = pos[i] > jhi ? pos[i] : jhi;
        best[i] = -__builtin_inff();
        const float *qrow = q + r * q_stride + hq * D;
        for (int64_t c = 0; c < chunks; c++) qv[i * chunks + c] = vload(qrow + c * LANES);
      }
      /* scores, in key order */
      if (rows == 1 && PARTS == 1) {
        /* a decode row (AVX-512): its query heads share one key range; 16 keys at a time
         * (16 rows of a pool block), each query's 16 dot products in 16 independent FMA
         * chains, summed together by hsum16 (hsum's add tree: the same bits as one key at a
         * time) and folded into the query's 16 running maxima. One row at a 4k context,
         * SmolLM2's heads: 0.218 -> 0.182 ms a layer; where a vfloat takes two registers
         * (AVX2) the 16 chains spill, 0.217 -> 0.252, so those builds keep the loop below */
        for (int64_t i = 0; i < nq; i++) vstore(bestv + i * LANES, vsplat(-__builtin_inff()));
        for (int64_t j0 = jlo & ~(int64_t)(LANES - 1); j0 <= jhi; j0 += LANES) {
          const float *kb = pool_row(kpool, table, Hkv, h, j0, D);
          const int64_t a = j0 > jlo ? j0 : jlo, b = j0 + LANES - 1 < jhi ? j0 + LANES - 1 : jhi;
          for (int64_t i = 0; i < nq; i++) {
            vfloat dots[LANES];
            for (int t = 0; t < LANES; t++) {
              vfloat d = vzero();
              for (int64_t c = 0; c < chunks; c++)
                d = vfma(qv[i * chunks + c], vload(kb + t * D + c * LANES), d);
              dots[t] = d;
            }
            v16f sv = hsum16(dots) * scale;
            float *sc = scores + i * stride - jlo;
            if (b - a < LANES - 1) { /* the range's first or last block: its lanes alone */
              float lanes[LANES];
              memcpy(lanes, &sv, sizeof lanes);
              for (int t = 0; t < LANES; t++) {
                if (j0 + t >= a && j0 + t <= b) sc[j0 + t] = lanes[t];
                else lanes[t] = -__builtin_inff();
              }
              memcpy(&sv, lanes, sizeof sv);
            } else {
              memcpy(sc + j0, &sv, sizeof sv);
            }
            vstore(bestv + i * LANES, vmax_keep(as_vfloat(sv), vload(bestv + i * LANES)));
          }
        }
        for (int64_t i = 0; i < nq; i++)
          for (int t = 0; t < LANES; t++) {
            const float m = bestv[i * LANES + t];
            best[i] = m > best[i] ? m : best[i];
          }
      } else {
        /* keys every query of the item attends, in whole aligned blocks of 4 (AVX-512, query
         * count a multiple of 4): 4 queries x 4 keys at a time below; the rest key by key */
        int64_t fast_lo = jhi + 1, fast_hi = jhi;
        if (PARTS == 1 && nq % 4 == 0) {
          int64_t common_lo = jlo, common_hi = jhi;
          for (int64_t i = 0; i < nq; i++) {
            common_lo = lo[i] > common_lo ? lo[i] : common_lo;
            common_hi = pos[i] < common_hi ? pos[i] : common_hi;
          }
          const int64_t a = (common_lo + 3) & ~(int64_t)3, b = ((common_hi + 1) & ~(int64_t)3) - 1;
          if (a < b) {
            fast_lo = a;
            fast_hi = b;
            for (int64_t g = 0; g < nq / 4; g++) vstore(bestv + g * LANES, vsplat(-__builtin_inff()));
          }
        }
        for (int64_t j0 = fast_lo; j0 < fast_hi; j0 += 4) {
          const float *kb = pool_row(kpool, table, Hkv, h, j0, D);
          for (int64_t i0 = 0; i0 < nq; i0 += 4) {
            /* lane 4u + t: query i0 + u, key j0 + t; hsum16 is hsum's tree lane by lane */
            vfloat dots[LANES];
            for (int e = 0; e < LANES; e++) dots[e] = vzero();
            for (int64_t c = 0; c < chunks; c++) {
              vfloat k4[4];
              for (int t = 0; t < 4; t++) k4[t] = vload(kb + t * D + c * LANES);
              for (int u = 0; u < 4; u++)
                for (int t = 0; t < 4; t++)
                  dots[4 * u + t] = vfma(qv[(i0 + u) * chunks + c], k4[t], dots[4 * u + t]);
            }
            const v16f sv = hsum16(dots) * scale;
            for (int u = 0; u < 4; u++)
              memcpy(scores + (i0 + u) * stride + (j0 - lo[i0 + u]), (const float *)&sv + 4 * u,
                     4 * sizeof(float));
            float *bv = bestv + (i0 / 4) * LANES;
            vstore(bv, vmax_keep(as_vfloat(sv), vload(bv)));
          }
        }
        if (fast_lo <= fast_hi)
          for (int64_t i = 0; i < nq; i++)
            for (int t = 0; t < 4; t++) {
              const float m = bestv[(i / 4) * LANES + 4 * (i % 4) + t];
              best[i] = m > best[i] ? m : best[i];
            }
        for (int64_t j = jlo; j <= jhi; j++) {
          if (j == fast_lo) j = fast_hi + 1;
          if (j > jhi) break;
          const float *k = pool_row(kpool, table, Hkv, h, j, D);
          vfloat kv[MAX_CHUNKS];
          for (int64_t c = 0; c < chunks; c++) kv[c] = vload(k + c * LANES);
          /* four queries at a time: four independent chains the core overlaps (one chain of
           * FMAs and an add tree is all latency); a query out of range computes and drops */
          int64_t i = 0;
          for (; i + 4 <= nq; i += 4) {
            vfloat a[4] = {vzero(), vzero(), vzero(), vzero()};
            for (int64_t c = 0; c < chunks; c++)
              for (int u = 0; u < 4; u++) a[u] = vfma(qv[(i + u) * chunks + c], kv[c], a[u]);
            for (int u = 0; u < 4; u++) {
              if (j < lo[i + u] || j > pos[i + u]) continue;
              const float s = hsum(a[u]) * scale;
              scores[(i + u) * stride + (j - lo[i + u])] = s;
              best[i + u] = s > best[i + u] ? s : best[i + u];
            }
          }
          for (; i < nq; i++) {
            if (j < lo[i] || j > pos[i]) continue;
            vfloat a = vzero();
            for (int64_t c = 0; c < chunks; c++) a = vfma(qv[i * chunks + c], kv[c], a);
            const float s = hsum(a) * scale;
            scores[i * stride + (j - lo[i])] = s;
            best[i] = s > best[i] ? s : best[i];
          }
        }
      }
      /* weights and their sum: 16 keys at a time, padding lanes at -inf give 0; a head's
       * attention sink (gpt-oss; log2 units) is one more logit in the max and the sum that
       * weights no value */
      for (int64_t i = 0; i < nq; i++) {
        float *sc = scores + i * stride;
        const int64_t n = pos[i] - lo[i] + 1;
        const float sink = sinks ? sinks[h * group + i % group] : -__builtin_inff();
        best[i] = sink > best[i] ? sink : best[i];
        for (int64_t j = n; j < ((n + LANES - 1) / LANES) * LANES; j++) sc[j] = -__builtin_inff();
        vfloat total = vzero();
        for (int64_t j = 0; j < n; j += LANES) {
          vfloat p = exp2_neg(vadd(vload(sc + j), vsplat(-best[i])));
          vstore(sc + j, p);
          total = vadd(total, p);
        }
        denom[i] = hsum(total) + (sink - best[i] > -64.0f ? exp2f(sink - best[i]) : 0.0f);
        for (int64_t c = 0; c < chunks; c++) acc[i * chunks + c] = vzero();
      }
      /* out = sum_j p_j v_j / denom, keys in order for every query. Keys in blocks of
       * KEY_BLOCK (inside one pool block, so contiguous and L1-resident while every query
       * of the item reads them); each query's accumulators stay in registers over a block */
      for (int64_t j0 = (jlo / KEY_BLOCK) * KEY_BLOCK; j0 <= jhi; j0 += KEY_BLOCK) {
        const float *vb = pool_row(vpool, table, Hkv, h, j0, D);
        for (int64_t i = 0; i < nq;) {
          const int64_t a = j0 > lo[i] ? j0 : lo[i];
          const int64_t b = j0 + KEY_BLOCK - 1 < pos[i] ? j0 + KEY_BLOCK - 1 : pos[i];
          /* a row's query heads share their key range: two at a time, eight independent
           * FMA chains instead of four (one chain is a key's latency long) */
          const int pair = i + 1 < nq && (i + 1) / group == i / group;
          const int64_t next = i + 1 + pair;
          if (a > b) {
            i = next;
            continue;
          }
          const float *v = vb + (a - j0) * D;
          const float *p0 = scores + i * stride + (a - lo[i]);
          const float *p1 = pair ? scores + (i + 1) * stride + (a - lo[i + 1]) : p0;
          vfloat *o0 = acc + i * chunks, *o1 = pair ? acc + (i + 1) * chunks : NULL;
          const int64_t n = b - a + 1;
          switch (chunks * 2 + pair) { /* common head sizes: accumulators in registers */
            case 8: pv_run(p0, p1, v, n, o0, o1, 4, 0); break;
            case 9: pv_run(p0, p1, v, n, o0, o1, 4, 1); break;
            case 16: pv_run(p0, p1, v, n, o0, o1, 8, 0); break;
            case 17: pv_run(p0, p1, v, n, o0, o1, 8, 1); break;
            default: pv_run(p0, p1, v, n, o0, o1, (int)chunks, pair); break;
          }
          i = next;
        }
      }
      for (int64_t i = 0; i < nq; i++) {
        const int64_t r = r0 + i / group, hq = h * group + i % group;
        float *o = out + (r * Hq + hq) * D;
        const vfloat inv = vsplat(denom[i]);
        for (int64_t c = 0; c < chunks; c++) vstore(o + c * LANES, vdiv(acc[i * chunks + c], inv));
      }
    }
    free(scores);
    free(bestv);
    free(qv);
    free(acc);
    free(best);
    free(denom);
    free(lo);
    free(pos);
  }
  free(tile_start);
  return failed ? -2 : 0;
}
