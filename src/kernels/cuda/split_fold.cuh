// Folding a row's attention splits into one result (after common.cuh; the kernels that fold
// only): how attention_combine.cu combines a split launch's partials, and how
// paged_attention.cu's whole kernel folds the splits its walk passes (MERGE). Both take a
// row's splits in split order through these helpers, so a row gets the same bits either way.
//
// A split is (m, l, a): its running max, running sum and P.V sums. The fold keeps the same
// three. A split holding none of the row's keys (m = -inf: before its window) changes
// nothing; the first one holding keys is taken as it is, so a row of one split has that
// split's bits (the whole kernel's); a later one is added rescaled to the larger max:
// run * fa + split * fb, with explicit roundings (no contraction decides a bit).

struct SplitFold {
  bool skip, take;  // the split changes nothing / is taken as it is
  float m, fa, fb;  // the folded max, and the factors on the run and on the split
};

__device__ __forceinline__ SplitFold split_fold(float run_m, float m) {
  SplitFold f{m == neg_inf(), run_m == neg_inf(), m, 1.0f, 1.0f};
  if (!f.skip && !f.take) {
    f.m = fmaxf(run_m, m);
    f.fa = run_m == f.m ? 1.0f : exp2f(run_m - f.m);
    f.fb = m == f.m ? 1.0f : exp2f(m - f.m);
  }
  return f;
}

// the folded max
__device__ __forceinline__ float split_fold_max(const SplitFold& f, float run_m) {
  return f.skip ? run_m : f.m;
}

// a folded sum: the running sum or a P.V sum, with the split's
__device__ __forceinline__ float split_fold_sum(const SplitFold& f, float run, float x) {
  return f.skip ? run : f.take ? x : __fmaf_rn(x, f.fb, __fmul_rn(run, f.fa));
}
