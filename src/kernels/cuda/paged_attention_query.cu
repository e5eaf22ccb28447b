// paged_attention.cu's query for slotserve_paged_attention (substituted at its @Q@ line):
// the block's mma rows read from q into qs (rows past its query heads: zeros).

  for (int i = tid; i < QROWS * (D / 2); i += 128) {
    const int mr = i / (D / 2), c = i % (D / 2), pi = mr / G;
    uint32_t v = 0u;
    if (mr < TP * G && pi < nrows)
      v = reinterpret_cast<const uint32_t*>(q + ((size_t)(first + pi) * HQ + h * G + mr % G) * D)[c];
    reinterpret_cast<uint32_t*>(&qs[mr][0])[c] = v;
  }
