// paged_attention.cu's @BLOCK@ for slotserve_paged_attention_split: one block per (tile
// part, kv head, split) of partials [R, HKV, S, G, D + 2]; a split past the rows' last key
// block has nothing to do (attention_combine.cu reads only each row's own splits).

  const int S = Splits::of(nbmax - 1) + 1;  // (launch.attention_splits)
  const int split = blockIdx.x % S, sub = (blockIdx.x / S) % SUB;
  const int h = (blockIdx.x / (S * SUB)) % HKV, tile = blockIdx.x / (S * SUB * HKV);
