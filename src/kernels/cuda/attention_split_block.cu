// paged_attention.cu's @BLOCK@ for slotserve_paged_attention_split: one block per (row,
// kv head, split) of partials [R, HKV, S, G, D + 2]; a split past the row's last key block has
// nothing to do (attention_combine.cu reads only the row's own splits).

  const int S = (nbmax + SPLIT_BLOCKS - 1) / SPLIT_BLOCKS;  // (launch.attention_splits)
  const int r = blockIdx.x / (HKV * S), h = (blockIdx.x / S) % HKV, split = blockIdx.x % S;
  if (split * SPLIT_BLOCKS > row_pos[r] / 128) return;
