// paged_attention.cu's @FOLD@ for kernels without MERGE (the split kernels, rope_attention):
// no folded P.V sums are kept (the code reading them is compiled out).

  float* const fold_acc = nullptr;
