/* The host sampler's passes over the vocabulary (runtime/sampling.py's host path), each
 * computing what its MLX ops compute, bit for bit, rows side by side (OpenMP):
 *
 * slot_sampler_exp2  each row's probabilities 2^((z - max) * scale): the max is exact, the
 *     difference and product are single float ops, and MLX's CPU power is glibc's powf. This
 *     calls exp2f, about half powf's time: glibc (2.28 on) computes powf(2, y) through the
 *     same exp2 as exp2f, and every float y in [-160, 0] (the exponents here are <= 0) gave
 *     the same bits on glibc 2.36, checked one by one; the sampler's probe
 *     (runtime.sampling.native_draw_agrees) checks it on this machine before the host path
 *     takes these. MLX takes ~9 ms for 32 rows of a 49,152-token vocabulary on one thread
 *     (max, then power).
 * slot_top_values  the k largest values of each row, descending: the ranked prefix the top_k /
 *     top_p cutoffs read. MLX's topk is a selection per row (~10 ms for those 32 rows, with
 *     its sort); this is a radix select on the values' order-preserving integer keys (three
 *     passes of a 4,096-, 4,096- and 256-bin histogram find the k-th largest key exactly),
 *     then a sort of only the keys above it: the same values whatever the algorithm.
 * slot_sampler_draw  the truncation mask and the inverse-CDF draw: running sums in index
 *     order (MLX's CPU cumsum is sequential) up to the first that passes the draw's target,
 *     which is where both of MLX's counts end.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* float -> uint32 with the same order (NaNs above +inf, -0.0 just below +0.0) */
static inline uint32_t order_key(float f) {
  uint32_t b;
  memcpy(&b, &f, sizeof b);
  return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}

static inline float key_value(uint32_t key) {
  const uint32_t b = (key & 0x80000000u) ? (key & 0x7fffffffu) : ~key;
  float f;
  memcpy(&f, &b, sizeof f);
  return f;
}

static int descending(const void *a, const void *b) {
  const uint32_t x = *(const uint32_t *)a, y = *(const uint32_t *)b;
  return (x < y) - (x > y);
}

/* The k-th largest key of row x [v] (1 <= k <= v); *ties: how many keys equal to it
 * are among the k largest. */
static uint32_t kth_key(const float *x, int64_t v, int64_t k, int64_t *ties) {
  static const int shifts[3] = {20, 8, 0}, widths[3] = {12, 12, 8};
  int64_t counts[4096];
  uint32_t prefix = 0, mask = 0;
  int64_t need = k; /* of the keys matching prefix under mask, the rank sought */
  for (int pass = 0; pass < 3; pass++) {
    const int shift = shifts[pass], bins = 1 << widths[pass];
    memset(counts, 0, sizeof(int64_t) * (size_t)bins);
    for (int64_t i = 0; i < v; i++) {
      const uint32_t key = order_key(x[i]);
      if ((key & mask) == prefix) counts[(key >> shift) & (uint32_t)(bins - 1)]++;
    }
    int b = bins - 1;
    while (counts[b] < need) need -= counts[b--];
    prefix |= (uint32_t)b << shift;
    mask |= (uint32_t)(bins - 1) << shift;
  }
  *ties = need;
  return prefix;
}

/* out[r, :k] = the k largest of x[r, :v], descending (1 <= k <= v). */
int slot_top_values(const float *x, int64_t n, int64_t v, int64_t k, float *out) {
  if (k < 1 || k > v) return -1;
  int failed = 0;
#pragma omp parallel for schedule(static) if (n > 1 && n * v > 65536)
  for (int64_t r = 0; r < n; r++) {
    const float *row = x + r * v;
    float *o = out + r * k;
    int64_t ties;
    const uint32_t kth = kth_key(row, v, k, &ties);
    uint32_t *keys = malloc(sizeof(uint32_t) * (size_t)k); /* those above the k-th: < k */
    if (keys == NULL) {
#pragma omp atomic write
      failed = 1;
      continue;
    }
    int64_t above = 0;
    for (int64_t i = 0; i < v; i++) {
      const uint32_t key = order_key(row[i]);
      if (key > kth) keys[above++] = key;
    }
    qsort(keys, (size_t)above, sizeof(uint32_t), descending);
    for (int64_t i = 0; i < above; i++) o[i] = key_value(keys[i]);
    const float tie = key_value(kth);
    for (int64_t i = above; i < above + ties; i++) o[i] = tie;
    free(keys);
  }
  return failed ? -2 : 0;
}

/* e[r, i] = 2^((z[r, i] - m_r) * scale[r]) (exp2f: powf(2, .)'s bits, above), m_r the row's
 * largest z. */
int slot_sampler_exp2(const float *z, int64_t n, int64_t v, const float *scale, float *e) {
#pragma omp parallel for schedule(static) if (n > 1 && n * v > 65536)
  for (int64_t r = 0; r < n; r++) {
    const float *row = z + r * v;
    float *out = e + r * v;
    float m = -INFINITY;
    for (int64_t i = 0; i < v; i++) m = row[i] > m ? row[i] : m;
    const float s = scale[r];
    for (int64_t i = 0; i < v; i++) out[i] = exp2f((row[i] - m) * s);
  }
  return 0;
}

/* Row r's entry x under the truncation (lo NULL: none): x where kept, else x * 0 (as
 * MLX's e * keep gives it). Kept: x >= low, and where the row's cut has excess ties
 * (excess), of the entries equal to tie only the first `need` by id; *rank counts those
 * seen so far (every one, kept or not, as the mask's cumsum does). */
static inline float kept_entry(float x, int trunc, float low, int excess, float tie,
                               int64_t need, int64_t *rank) {
  if (!trunc) return x;
  int keep = x >= low;
  if (excess && x == tie) {
    ++*rank;
    keep = keep && *rank <= need;
  }
  return x * (float)keep;
}

/* tokens[r]: runtime.sampling's draw of row r of e [n, v] under its truncation, the keep
 * mask of _truncation_mask applied entry by entry instead of materialised: kept are
 * e >= lo[r], and where the row is cut (c[r] < v) and more than c[r] entries are >=
 * tied[r], only the first c[r] - #(e > tied[r]) of those equal to tied[r], by id (lo, tied,
 * c NULL: no truncation). Then the inverse-CDF draw of _cdf_draw: running sums c_i of the
 * kept entries in index order (MLX's CPU cumsum is sequential), mass the last; the token is
 * min(first, last), first counting c_i <= u[r] * mass and last c_i < mass. The sums never
 * decrease (every kept entry is >= 0 where mass is finite) and end at mass > target, so
 * both counts are the first id whose sum passes the target: the scan stops there. A NaN
 * mass compares false everywhere (token 0); a target at or past the mass (never, for
 * u < 1 and the top entry kept) takes both counts in full. */
int slot_sampler_draw(const float *e, int64_t n, int64_t v, const float *lo, const float *tied,
                      const int64_t *c, const float *u, int32_t *tokens) {
#pragma omp parallel for schedule(static) if (n > 1 && n * v > 65536)
  for (int64_t r = 0; r < n; r++) {
    const float *row = e + r * v;
    const int trunc = lo != NULL;
    const float low = trunc ? lo[r] : 0.0f, tie = trunc ? tied[r] : -1.0f;
    int excess = 0;
    int64_t need = v, rank = 0;
    if (trunc && c[r] < v) {
      int64_t gt = 0, ge = 0;
      for (int64_t i = 0; i < v; i++) {
        gt += row[i] > tie;
        ge += row[i] >= tie;
      }
      excess = ge > c[r];
      need = c[r] - gt;
    }
    float mass = 0.0f;
    for (int64_t i = 0; i < v; i++) mass += kept_entry(row[i], trunc, low, excess, tie, need, &rank);
    const float target = u[r] * mass;
    int64_t token = -1;
    if (mass != mass) {
      token = 0;
    } else {
      float run = 0.0f;
      rank = 0;
      for (int64_t i = 0; i < v; i++) {
        run += kept_entry(row[i], trunc, low, excess, tie, need, &rank);
        if (run > target) {
          token = i;
          break;
        }
      }
    }
    if (token < 0) {
      float run = 0.0f;
      int64_t first = 0, last = 0;
      rank = 0;
      for (int64_t i = 0; i < v; i++) {
        run += kept_entry(row[i], trunc, low, excess, tie, need, &rank);
        first += run <= target;
        last += run < mass;
      }
      token = first < last ? first : last;
    }
    tokens[r] = (int32_t)token;
  }
  return 0;
}
