// paged_attention.cu's @FOLD@ for the kernels that never fold (the split kernels,
// rope_attention): nothing to keep (MERGE is false: fold_split is never called).

  auto fold_split = []() {};
