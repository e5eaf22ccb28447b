// paged_attention.cu's @BLOCK@ for the whole kernels: one block per (tile part, kv head),
// all of the rows' keys.

  const int sub = blockIdx.x % SUB, h = (blockIdx.x / SUB) % HKV, tile = blockIdx.x / (SUB * HKV);
  const int split = -1;
