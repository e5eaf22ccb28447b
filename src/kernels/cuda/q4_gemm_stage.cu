// q4_gemm.cu's and q4_wgmma.cu's chunk copies (substituted at their @STAGE@ line, inside
// `if (ch < chunks)`): chunk ch (128 of K) of the block's 128-row x tile (rows padded to
// XROW; rows past M zeros) and of its 16 column tiles' packed codes and scales (36 uint4 a
// tile: 32 of codes, 4 of scales), into stage ch % STAGES, by the block's 256 threads with
// cp.async. A text fragment, not a function: both kernels keep the machine code they were
// measured with (a function moved it).

      const int s = ch % STAGES;
      __nv_bfloat16* xd = xstage(s);
      for (int e = threadIdx.x; e < BM * 16; e += 256) {  // 16 uint4 per row
        const int r = e >> 4, q = e & 15;
        uint4* dst = reinterpret_cast<uint4*>(xd + r * XROW) + q;
        if (m0 + r < M) {
          cp_async16(dst, xv + ((size_t)(m0 + r) * K + ch * 128) / 8 + q);
        } else {
          *dst = make_uint4(0, 0, 0, 0);  // rows past M multiply as zeros
        }
      }
      uint4* wd = wstage(s);
      for (int e = threadIdx.x; e < WS; e += 256) {
        const int tl = e / 36, q = e % 36;
        const size_t piece = (size_t)(tile0 + tl) * chunks + ch;
        cp_async16(wd + e, q < 32 ? wv + piece * 32 + q : sv + piece * 4 + (q - 32));
      }
