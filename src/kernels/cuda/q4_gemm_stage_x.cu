// q4_gemm.cu's chunk copy of x (substituted at its @STAGE_X@ line, inside `if (ch <
// chunks)`, with s = ch % STAGES): chunk ch (128 of K) of the block's 128-row x tile into
// stage s (rows padded to XROW; rows past M zeros), by the block's 256 threads with
// cp.async. A text fragment, not a function: the kernel keeps the machine code it was
// measured with (a function moved it).

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
