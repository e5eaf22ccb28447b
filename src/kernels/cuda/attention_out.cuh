// A row's attention output from its running max, sum and P.V sums (after common.cuh): the
// whole kernels' rows (attention_whole_out.cu) and the folded split rows
// (attention_combine.cu) both end here, so a row of one split has the same bits either way.

// a row's output scale from its (m, l), folded or one walk's: the softmax's sum, and the
// factor on its P.V sums. SINKS: the head's sink logit (log2 units) is one more softmax
// term that weights no value: max and sum rescaled to max(m, sink), the sink's term added
// once.
__device__ __forceinline__ void attention_out_scale(float m, float l, bool sinks, float sink,
                                                    float& f, float& sum) {
  f = 1.0f;
  sum = l;
  if (sinks) {
    const float mx = fmaxf(m, sink);
    f = m == mx ? 1.0f : exp2f(m - mx);
    sum = __fmaf_rn(l, f, -0.0f) + exp2f(sink - mx);
  }
}

// one output element: a P.V sum under attention_out_scale's factor and sum
__device__ __forceinline__ float attention_out_value(float a, bool sinks, float f, float sum) {
  return (sinks ? __fmaf_rn(a, f, -0.0f) : a) / sum;
}
