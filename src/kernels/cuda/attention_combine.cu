// slotserve_attention_combine: the output rows of slotserve_paged_attention_split, each
// row's splits combined in split order. The body of an mx.fast.cuda_kernel; the header is
// common.cuh.
//
// One block (128 threads) per (row, kv head); part [R, HKV, S, G, D + 2] (P.V sums, running
// max, running sum per split and query head), row_table / row_pos [R] -> out [R, HQ * D]
// bf16. Thread d < D: the row's max over its splits, then the sums rescaled to it and added
// split after split (a fixed order whatever the batch); one split is rescaled by
// exp2(0) = 1 and gives the whole kernel's bits. SINKS: the head's sink logit (sinks [HQ],
// log2 units) joins the max and adds its term to the sum once, after the splits, as
// attention_whole_out.cu does.
// Template: G, D, SPLIT_BLOCKS, SINKS.

  const int HKV = part_shape[1], S = part_shape[2];
  const int HQ = HKV * G;
  const int r = blockIdx.x / HKV, h = blockIdx.x % HKV, tid = threadIdx.x;
  const size_t base = ((size_t)r * HQ + (size_t)h * G) * D;
  if (row_table[r] < 0) {
    for (int i = tid; i < G * D; i += 128) out[base + i] = __float2bfloat16(0.0f);
    return;
  }
  const int splits = row_pos[r] / (128 * SPLIT_BLOCKS) + 1;  // the splits holding its keys
  const float* src = part + ((size_t)r * HKV + h) * S * G * (D + 2);
  if (tid < D) {
#pragma unroll
    for (int gg = 0; gg < G; ++gg) {
      float m = neg_inf();
      for (int s = 0; s < splits; ++s) m = fmaxf(m, src[((size_t)s * G + gg) * (D + 2) + D]);
      const float sink = SINKS ? sinks[h * G + gg] : neg_inf();
      if (SINKS) m = fmaxf(m, sink);
      float sum = -0.0f, acc = -0.0f;  // (x + -0 is x, signed zeros included)
      for (int s = 0; s < splits; ++s) {
        const float* p = src + ((size_t)s * G + gg) * (D + 2);
        const float f = p[D] == m ? 1.0f : p[D] == neg_inf() ? 0.0f : exp2f(p[D] - m);
        sum = __fmaf_rn(p[D + 1], f, sum);
        acc = __fmaf_rn(p[tid], f, acc);
      }
      if (SINKS) sum = sum + exp2f(sink - m);
      out[base + (size_t)gg * D + tid] = __float2bfloat16(acc / sum);
    }
  }
