// q4_gemm.cu's and q4_wgmma.cu's A fragments (substituted at their @XA@ line): from p0,
// p1 (a thread's rows g and g + 8 of a 16-row tile, k = 64 par + 16t .. + 15, as fetch_x),
// xa[st] = the mma A fragment of the group's k16 step st. A text fragment, not a function,
// as q4_gemm_stage_w.cu.

      const uint4 r00 = p0[0], r01 = p0[1], r10 = p1[0], r11 = p1[1];
      const uint32_t A0[8] = {r00.x, r00.y, r00.z, r00.w, r01.x, r01.y, r01.z, r01.w};
      const uint32_t A1[8] = {r10.x, r10.y, r10.z, r10.w, r11.x, r11.y, r11.z, r11.w};
      uint32_t xa[4][4];
#pragma unroll
      for (int st = 0; st < 4; ++st) {
        xa[st][0] = A0[2 * st]; xa[st][1] = A1[2 * st];
        xa[st][2] = A0[2 * st + 1]; xa[st][3] = A1[2 * st + 1];
      }
