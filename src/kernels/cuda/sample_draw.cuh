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

// z's bits as an unsigned key in z's order (negatives flipped whole, positives' sign set)
__device__ __forceinline__ unsigned order_key(float z) {
  const unsigned u = __float_as_uint(z);
  return u ^ ((u >> 31) ? 0xFFFFFFFFu : 0x80000000u);
}
__device__ __forceinline__ float key_float(unsigned key) {
  return __uint_as_float(key ^ ((key >> 31) ? 0x80000000u : 0xFFFFFFFFu));
}

// Where a row's ranks (its z descending) reach a target: the z of that rank, and the count
// and mass of the ranks of greater z (whose e are >= its e: the ranks before its run of
// equal z). The target is a count (the kk-th rank), or a mass: ceil(frac * base), at least
// 1, base 0 meaning the whole row's mass (summed by the first pass).
struct RankSelect {
  float z;
  unsigned count_above;
  unsigned long long mass_above;
  unsigned long long target;
};

// Scratch of rank_select in shared memory (the caller's, one per block)
struct RankScratch {
  unsigned count[256];
  unsigned long long mass[256];
  unsigned digit;
  unsigned count_above;
  unsigned long long mass_above;
  unsigned long long target;
};

// A radix select over order_key in four 8-bit passes, most significant first: each pass
// histograms (count and mass) the keys that share the digits found so far, then one warp
// finds the digit where the running count or mass, from the top, reaches the target. Each
// bin's sums are integers, so the result is the same whatever order the threads add in.
// A warp's lanes of one bin add theirs first (match_any, then a 32-bit reduce of each
// 20-bit half of the 40-bit masses) and one lane per bin adds to shared memory: logits
// crowd a few bins, where one atomic a lane would queue. Every thread of the block calls it.
template <class E>
__device__ RankSelect rank_select(const float* zr, int V, E e_of, bool by_mass,
                                  unsigned long long target, unsigned long long base,
                                  float frac, RankScratch* s) {
  const int tid = threadIdx.x, lane = tid & 31;
  unsigned prefix = 0, mask = 0;
  if (tid == 0) {
    s->count_above = 0;
    s->mass_above = 0;
    s->target = target;
  }
  for (int shift = 24; shift >= 0; shift -= 8) {
    for (int b = tid; b < 256; b += SAMPLE_THREADS) {
      s->count[b] = 0;
      s->mass[b] = 0;
    }
    __syncthreads();
    for (int i0 = 0; i0 < V; i0 += SAMPLE_THREADS) {
      const int i = i0 + tid;
      const float zv = i < V ? zr[i] : 0.0f;
      const unsigned key = order_key(zv);
      const bool in = i < V && (key & mask) == prefix;
      if (!__any_sync(0xFFFFFFFFu, in)) continue;
      const unsigned bin = in ? (key >> shift) & 255u : 256u;
      const unsigned long long q = in ? mass_of(e_of(zv)) : 0ull;
      const unsigned peers = __match_any_sync(0xFFFFFFFFu, bin);
      const unsigned lo = __reduce_add_sync(peers, (unsigned)(q & 0xFFFFFull));
      const unsigned hi = __reduce_add_sync(peers, (unsigned)(q >> 20));
      if (in && lane == __ffs(peers) - 1) {
        atomicAdd(&s->count[bin], (unsigned)__popc(peers));
        atomicAdd(&s->mass[bin], ((unsigned long long)hi << 20) + lo);
      }
    }
    __syncthreads();
    if (tid < 32) {
      // lane l: bins 255 - 8l down to 248 - 8l; an inclusive scan over the lanes from the top
      unsigned c = 0;
      unsigned long long m = 0;
      for (int j = 0; j < 8; ++j) {
        c += s->count[255 - 8 * lane - j];
        m += s->mass[255 - 8 * lane - j];
      }
      unsigned ci = c;
      unsigned long long mi = m;
      for (int o = 1; o < 32; o <<= 1) {
        const unsigned ct = __shfl_up_sync(0xFFFFFFFFu, ci, o);
        const unsigned long long mt = __shfl_up_sync(0xFFFFFFFFu, mi, o);
        if (lane >= o) {
          ci += ct;
          mi += mt;
        }
      }
      unsigned long long goal = s->target;
      if (by_mass && goal == 0) {  // the first pass: every key is in, lane 31 has the row's mass
        const unsigned long long all = __shfl_sync(0xFFFFFFFFu, mi, 31);
        const unsigned long long p = (unsigned long long)ceil((double)frac * (double)(base ? base : all));
        goal = p > 0 ? p : 1;
      }
      const unsigned above_c = s->count_above;
      const unsigned long long above_m = s->mass_above;
      const bool reached = by_mass ? above_m + mi >= goal : (unsigned long long)(above_c + ci) >= goal;
      const unsigned hit = __ballot_sync(0xFFFFFFFFu, reached);
      const int at = hit ? __ffs(hit) - 1 : 31;  // (the target is never past the row)
      if (lane == at) {
        unsigned rc = above_c + ci - c;  // the bins of the lanes before this one
        unsigned long long rm = above_m + mi - m;
        int j = 0;
        for (; j < 7; ++j) {
          const int b = 255 - 8 * lane - j;
          const bool here = by_mass ? rm + s->mass[b] >= goal : (unsigned long long)(rc + s->count[b]) >= goal;
          if (here) break;
          rc += s->count[b];
          rm += s->mass[b];
        }
        s->digit = 255 - 8 * lane - j;
        s->count_above = rc;
        s->mass_above = rm;
        s->target = goal;
      }
    }
    __syncthreads();
    prefix |= s->digit << shift;
    mask |= 255u << shift;
  }
  RankSelect r{key_float(prefix), s->count_above, s->mass_above, s->target};
  __syncthreads();  // every thread has read s before a later call writes it
  return r;
}
