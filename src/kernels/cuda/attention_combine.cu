// slotserve_attention_combine: the output rows of slotserve_paged_attention_split, each
// row's splits folded in split order (split_fold.cuh, as a MERGE whole kernel folds them as
// its walk passes them: the same bits). The body of an mx.fast.cuda_kernel; the header is
// common.cuh, split_fold.cuh, attention_out.cuh and attention_splits.cuh.
//
// One block (128 threads) per (row, query head); part [R, HKV, S, G, D + 2] (P.V sums,
// running max, running sum per split and query head), row_table / row_pos [R] -> out
// [R, HQ * D] bf16. Thread d < D folds dimension d of the row's splits, then SINKS: the
// head's sink logit (sinks [HQ], log2 units) as attention_whole_out.cu adds it. A block
// per (row, kv head), its G heads one after another, was 20.7 µs a layer for one
// 16k-context row under Nsight Compute (8 blocks of dependent loads); a block a query head
// runs G of them side by side.
// Template: G, D, SPLIT_BLOCKS, HEAD_SPLITS, SINKS.

  const int HKV = part_shape[1], S = part_shape[2];
  const int HQ = HKV * G;
  const int r = blockIdx.x / HQ, hq = blockIdx.x % HQ, tid = threadIdx.x;
  const int h = hq / G, gg = hq % G;  // its kv head, and which of that head's query heads
  const size_t base = ((size_t)r * HQ + hq) * D;
  if (row_table[r] < 0) {
    for (int i = tid; i < D; i += 128) out[base + i] = __float2bfloat16(0.0f);
    return;
  }
  // the splits holding its keys (attention_splits.cuh)
  const int splits = KeySplits<SPLIT_BLOCKS, HEAD_SPLITS>::of(row_pos[r] / 128) + 1;
  const float* src = part + ((size_t)r * HKV + h) * S * G * (D + 2);
  constexpr int CHUNK = 16;
  const size_t stride = (size_t)G * (D + 2);  // from one split to the next
  if (tid >= D) return;
  const float* g0 = src + (size_t)gg * (D + 2);
  // Each pass takes 16 splits' loads at once, then their folds in split order: a loop of
  // one dependent L2 load per split left a 16k-context row waiting a round trip a split
  float m = neg_inf(), l = 0.0f, a = 0.0f;
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
        const SplitFold f = split_fold(m, pm[u]);
        m = split_fold_max(f, m);
        l = split_fold_sum(f, l, psum[u]);
        a = split_fold_sum(f, a, pval[u]);
      }
    }
  }
  float f, sum;
  attention_out_scale(m, l, SINKS, SINKS ? sinks[hq] : 0.0f, f, sum);
  out[base + tid] = __float2bfloat16(attention_out_value(a, SINKS, f, sum));
