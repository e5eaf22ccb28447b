// paged_attention.cu's query for slotserve_paged_attention (substituted at its @Q@ line):
// the block's G query heads read from q into shared memory as float.

  for (int i = tid; i < G * D; i += 128) qs[i / D][i % D] = static_cast<float>(q[base + i]);
