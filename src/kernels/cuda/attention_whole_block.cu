// paged_attention.cu's @BLOCK@ for the whole kernels: one block per (row, kv head), all of
// the row's keys.

  const int r = blockIdx.x / HKV, h = blockIdx.x % HKV;
  const int split = -1;
