// slotserve_attention_combine: the output rows of slotserve_paged_attention_split, each
// row's splits combined in split order. The body of an mx.fast.cuda_kernel; the header is
// common.cuh.
//
// One block (128 threads) per (row, query head); part [R, HKV, S, G, D + 2] (P.V sums,
// running max, running sum per split and query head), row_table / row_pos [R] -> out
// [R, HQ * D] bf16. Thread d < D: the row's max over its splits, then the sums rescaled to
// it and added split after split (a fixed order whatever the batch); one split is rescaled
// by exp2(0) = 1 and gives the whole kernel's bits. SINKS: the head's sink logit (sinks
// [HQ], log2 units) joins the max and adds its term to the sum once, after the splits, as
// attention_whole_out.cu does. A block per (row, kv head), its G heads one after another,
// was 20.7 µs a layer for one 16k-context row under Nsight Compute (8 blocks of dependent
// loads); a block a query head runs G of them side by side.
// Template: G, D, SPLIT_BLOCKS, SINKS.

  const int HKV = part_shape[1], S = part_shape[2];
  const int HQ = HKV * G;
  const int r = blockIdx.x / HQ, hq = blockIdx.x % HQ, tid = threadIdx.x;
  const int h = hq / G, gg = hq % G;  // its kv head, and which of that head's query heads
  const size_t base = ((size_t)r * HQ + hq) * D;
  if (row_table[r] < 0) {
    for (int i = tid; i < D; i += 128) out[base + i] = __float2bfloat16(0.0f);
    return;
  }
  const int splits = row_pos[r] / (128 * SPLIT_BLOCKS) + 1;  // the splits holding its keys
  const float* src = part + ((size_t)r * HKV + h) * S * G * (D + 2);
  // Each pass takes 16 splits' loads at once, then their arithmetic in split order: a
  // loop of one dependent L2 load per split left a 16k-context row (16 splits x 2 passes)
  // waiting ~32 round trips; the order of every max and fma is the loop's.
  constexpr int CHUNK = 16;
  const size_t stride = (size_t)G * (D + 2);  // from one split to the next
  if (tid >= D) return;
  const float* g0 = src + (size_t)gg * (D + 2);
  float m = neg_inf();
  for (int s0 = 0; s0 < splits; s0 += CHUNK) {
    float pm[CHUNK];
#pragma unroll
    for (int u = 0; u < CHUNK; ++u)
      pm[u] = s0 + u < splits ? g0[(s0 + u) * stride + D] : neg_inf();
#pragma unroll
    for (int u = 0; u < CHUNK; ++u) m = fmaxf(m, pm[u]);
  }
  const float sink = SINKS ? sinks[hq] : neg_inf();
  if (SINKS) m = fmaxf(m, sink);
  float sum = -0.0f, acc = -0.0f;  // (x + -0 is x, signed zeros included)
  for (int s0 = 0; s0 < splits; s0 += CHUNK) {
    const int n = min(CHUNK, splits - s0);
    float pm[CHUNK], psum[CHUNK], pval[CHUNK];
#pragma unroll
    for (int u = 0; u < CHUNK; ++u) {
      if (u < n) {
        const float* p = g0 + (s0 + u) * stride;
        pm[u] = p[D];
        psum[u] = p[D + 1];
        pval[u] = p[tid];
      }
    }
#pragma unroll
    for (int u = 0; u < CHUNK; ++u) {
      if (u < n) {
        const float f = pm[u] == m ? 1.0f : pm[u] == neg_inf() ? 0.0f : exp2f(pm[u] - m);
        sum = __fmaf_rn(psum[u], f, sum);
        acc = __fmaf_rn(pval[u], f, acc);
      }
    }
  }
  if (SINKS) sum = sum + exp2f(sink - m);
  out[base + tid] = __float2bfloat16(acc / sum);
