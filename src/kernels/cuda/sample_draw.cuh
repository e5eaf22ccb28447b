// Helpers of sample_draw.cu: integer masses, the row's counter-based uniform, a block scan.

constexpr int SAMPLE_THREADS = 1024;  // threads of a sample_draw block (launch.SAMPLE_THREADS)

// q = floor(e * 2^40) of an unnormalised probability e in [0, 1]: exact, so masses are
// sums of integers and do not depend on their order
__device__ __forceinline__ unsigned long long mass_of(float e) {
  return __float2ull_rz(e * 1099511627776.0f);
}

__device__ __forceinline__ unsigned long long mix64(unsigned long long z) {
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

// runtime.sampling.uniform_for(seed, position) (pos1 = position + 1): 24 bits, exact
__device__ __forceinline__ float draw_uniform(unsigned long long seed, unsigned long long pos1) {
  const unsigned long long h = mix64(mix64(seed) + pos1 * 0x9E3779B97F4A7C15ull);
  return (float)(h >> 40) * (1.0f / 16777216.0f);
}

// Every thread of the block calls it: v's exclusive prefix over the threads in index
// order, and the sum of all (*total). warps: SAMPLE_THREADS / 32 + 1 shared slots.
__device__ unsigned long long block_exclusive_scan(unsigned long long v,
                                                   unsigned long long* total,
                                                   unsigned long long* warps) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  constexpr int NW = SAMPLE_THREADS / 32;
  unsigned long long incl = v;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const unsigned long long t = __shfl_up_sync(0xffffffffu, incl, o);
    if (lane >= o) incl += t;
  }
  __syncthreads();  // the last scan's readers are done with warps[]
  if (lane == 31) warps[warp] = incl;
  __syncthreads();
  if (warp == 0) {
    const unsigned long long w = lane < NW ? warps[lane] : 0ull;
    unsigned long long wi = w;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const unsigned long long t = __shfl_up_sync(0xffffffffu, wi, o);
      if (lane >= o) wi += t;
    }
    __syncwarp();
    if (lane < NW) warps[lane] = wi - w;
    if (lane == 31) warps[NW] = wi;
  }
  __syncthreads();
  *total = warps[NW];
  return warps[warp] + incl - v;
}
