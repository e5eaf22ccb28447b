// RMS norm of one row by a whole block: the standalone rms_rows kernel and the 4-bit
// matmul's NORM prologue both call norm_row, so the two give the same bits.

// y = bf16((x * r) * w), r = 1 / sqrt(mean(x^2) + eps), for one row of K (K % 8 == 0), by
// the whole block: thread p sums the squares of 8-element pieces p, p + blockDim, .. in
// order, then a fixed tree (shuffles in each warp, the warps in order). Every launch of it
// has 32 * _k_split(K) threads, so the standalone kernel and the matmul's prologue agree
// bit for bit. y may be global or shared memory.
__device__ __forceinline__ void norm_row(const __nv_bfloat16* x, const __nv_bfloat16* w,
                                         int K, float eps, __nv_bfloat16* y) {
  __shared__ float part[32];
  const int tid = threadIdx.x, nthreads = blockDim.x;
  const uint4* xv = reinterpret_cast<const uint4*>(x);
  float s = 0.0f;
  for (int e = tid; e < K / 8; e += nthreads) {
    const uint4 v = xv[e];
    const uint32_t u[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const float a = bf_lo(u[i]), b = bf_hi(u[i]);
      s = __fmaf_rn(a, a, s);
      s = __fmaf_rn(b, b, s);
    }
  }
  for (int o = 16; o > 0; o >>= 1) s = __fadd_rn(s, __shfl_xor_sync(0xffffffffu, s, o));
  if ((tid & 31) == 0) part[tid >> 5] = s;
  __syncthreads();
  float ss = part[0];
  for (int k = 1; k < nthreads / 32; ++k) ss = __fadd_rn(ss, part[k]);
  const float r = rsqrtf(__fadd_rn(__fdiv_rn(ss, static_cast<float>(K)), eps));
  const uint4* wv = reinterpret_cast<const uint4*>(w);
  uint4* yv = reinterpret_cast<uint4*>(y);
  for (int e = tid; e < K / 8; e += nthreads) {
    const uint4 v = xv[e], g = wv[e];
    const uint32_t u[4] = {v.x, v.y, v.z, v.w}, gw[4] = {g.x, g.y, g.z, g.w};
    uint32_t o[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      __nv_bfloat162 h = __floats2bfloat162_rn(__fmul_rn(__fmul_rn(bf_lo(u[i]), r), bf_lo(gw[i])),
                                               __fmul_rn(__fmul_rn(bf_hi(u[i]), r), bf_hi(gw[i])));
      o[i] = *reinterpret_cast<uint32_t*>(&h);
    }
    yv[e] = make_uint4(o[0], o[1], o[2], o[3]);
  }
  __syncthreads();  // y complete for the whole block; part free again
}
