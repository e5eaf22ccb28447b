/* The k largest values of each row, in descending order: the ranked prefix the host
 * sampler's top_k / top_p cutoffs read (runtime/sampling.py). MLX's CPU topk takes ~10 ms
 * for 32 rows of a 49,152-token vocabulary (a selection per row, one thread) and its sort
 * of the prefix another; this is a radix select on the values' order-preserving integer
 * keys (three passes of a 4,096-, 4,096- and 256-bin histogram over the row find the k-th
 * largest key exactly), then a sort of only the keys above it. The values are the
 * row's k largest, so they are the same numbers MLX's topk + sort give, whatever the
 * algorithm; rows run side by side (OpenMP), each on its own.
 */
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
