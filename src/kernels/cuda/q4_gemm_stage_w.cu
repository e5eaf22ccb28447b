// q4_gemm.cu's and q4_wgmma.cu's chunk copy of the weights (substituted at their @STAGE_W@
// line, inside `if (ch < chunks)`, with s = ch % STAGES): chunk ch (128 of K) of the
// block's 16 column tiles' packed codes and scales (36 uint4 a tile: 32 of codes, 4 of
// scales) into stage s, by the block's 256 threads with cp.async. A text fragment, not a
// function: both kernels keep the machine code they were measured with (a function moved
// it).

      uint4* wd = wstage(s);
      for (int e = threadIdx.x; e < WS; e += 256) {
        const int tl = e / 36, q = e % 36;
        const size_t piece = (size_t)(tile0 + tl) * chunks + ch;
        cp_async16(wd + e, q < 32 ? wv + piece * 32 + q : sv + piece * 4 + (q - 32));
      }
