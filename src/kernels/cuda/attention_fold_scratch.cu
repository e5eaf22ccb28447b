// paged_attention.cu's @FOLD@ for slotserve_paged_attention (whole, MERGE or not): a MERGE
// block's folded P.V sums, D / 2 floats a thread, at scratch[block][(4n + c) * 128 + tid]
// (each thread reads back only what it wrote; [element][thread]: a warp's accesses
// coalesce). Without MERGE scratch is one unread float.

  float* const fold_acc = scratch + (size_t)blockIdx.x * (D / 2) * 128 + tid;
