// slotserve_sample_draw: one sampled token per row, truncation and draw in one launch. The
// body of an mx.fast.cuda_kernel; the header is common.cuh and sample_draw.cuh.
//
// One block (SAMPLE_THREADS = 1024) per row. z [n, V] float32 processed logits, row_max [n],
// knobs [n, 3] (log2 e / temperature, top_p, min_p), iknobs [n, 2] (top_k, 1 where the row
// ranks: top_k < V or top_p < 1), draws [n, 2] uint64 (seed, position + 1) -> tokens [n]
// int32.
//
// e = exp2((z - max) * scale) in (0, 1], the top token exactly 1. Every mass is a sum of
// q = floor(e * 2^40) in 64-bit integers, exact in any order, so a row's token is a
// function of its own logits and knobs alone, whatever the batch and however the sums are
// cut. The rules are runtime.sampling's (ranks by descending e, ties to the lower id):
//   top_k  keeps ranks 0 .. k-1; M_k is their mass (the whole row's without top_k)
//   top_p  keeps ranks r with B_r < ceil(top_p * M_k), B_r the mass of ranks before r
//   min_p  keeps e >= min_p
// then the draw: the first token (in id order) whose running kept mass exceeds
// floor(u * kept mass), u = the row's counter-based uniform (uniform_for(seed, position)).
// The ranks are found without sorting: rank_select (sample_draw.cuh) finds the z where the
// ranks' running count reaches k, or their running mass reaches p, by a radix select over
// z's bits; e is monotone in z, so the r-th largest e is e of the r-th largest z, and ties
// are resolved by id over the row itself. (A sort of each ranked row, MLX's, took 45-52 us
// a step at one row of the 8B's 128,256 and ~430 us at 64 rows, H100.)
//
// Each thread owns a contiguous range of C = ceil(V / 1024) ids; a block-wide scan of the
// threads' sums finds the one thread whose range holds a crossing, which then walks its
// range alone.

  const int V = z_shape[1];
  const int row = blockIdx.x, tid = threadIdx.x;
  const int C = (V + SAMPLE_THREADS - 1) / SAMPLE_THREADS;
  const int lo = min(V, tid * C), hi = min(V, lo + C);
  __shared__ unsigned long long scan_warps[SAMPLE_THREADS / 32 + 1];
  __shared__ unsigned long long found_at[2];  // [0]: the rank or token index found ([1] unused)
  const float* zr = z + (size_t)row * V;
  const float m = row_max[row];
  const float scale = knobs[row * 3], top_p = knobs[row * 3 + 1], min_p = knobs[row * 3 + 2];
  const int top_k = iknobs[row * 2];
  const bool ranked = iknobs[row * 2 + 1] != 0;
  auto e_of = [&](float zv) { return exp2f((zv - m) * scale); };

  // the threshold: ranks kept are those with e > thr, and the first keep_ties ids of e == thr
  float thr = 0.0f;
  unsigned long long keep_ties = ~0ull;
  if (ranked) {
    __shared__ RankScratch scratch;
    const int kk = min(top_k, V);
    int c = kk;
    float zc = 0.0f;  // z of rank c - 1
    unsigned long long total_k = 0;  // the mass of ranks 0 .. kk - 1 (0: the whole row's)
    if (kk < V) {
      const RankSelect k = rank_select(zr, V, e_of, false, kk, 0, 0.0f, &scratch);
      zc = k.z;
      total_k = k.mass_above + (unsigned long long)(kk - (int)k.count_above) * mass_of(e_of(k.z));
    }
    if (top_p < 1.0f) {
      // the first rank whose running mass reaches p = ceil(top_p * total_k): in the run of
      // equal z at p's select, each of mass q, the ceil((p - mass before the run) / q)-th
      const RankSelect r = rank_select(zr, V, e_of, true, 0, total_k, top_p, &scratch);
      const unsigned long long q = mass_of(e_of(r.z));  // > 0: the run holds the target
      const unsigned long long into = q ? (r.target - r.mass_above + q - 1) / q : 1;
      c = min(kk, (int)(r.count_above + into));
      zc = r.z;
    }
    thr = e_of(zc);
    unsigned long long above = 0;
    for (int i = lo; i < hi; ++i) above += e_of(zr[i]) > thr;
    unsigned long long n_above;
    block_exclusive_scan(above, &n_above, scan_warps);
    keep_ties = (unsigned long long)c - n_above;
  }

  // ties at thr before this thread's ids (their ranks), then the kept mass
  unsigned long long ties = 0;
  if (ranked)
    for (int i = lo; i < hi; ++i) ties += e_of(zr[i]) == thr;
  unsigned long long n_ties;
  const unsigned long long ties_before = block_exclusive_scan(ties, &n_ties, scan_warps);
  auto kept_mass = [&](float e, unsigned long long& tie_rank) -> unsigned long long {
    bool keep = e >= min_p && e >= thr;
    if (keep && ranked && e == thr) keep = tie_rank++ < keep_ties;
    return keep ? mass_of(e) : 0ull;
  };
  unsigned long long kept = 0, tie_rank = ties_before;
  for (int i = lo; i < hi; ++i) kept += kept_mass(e_of(zr[i]), tie_rank);
  unsigned long long mass;
  const unsigned long long before = block_exclusive_scan(kept, &mass, scan_warps);
  const float u = draw_uniform(draws[row * 2], draws[row * 2 + 1]);
  // u < 1 - 2^-24 and mass >= 2^40 (the top token is always kept): target < mass
  const unsigned long long target = (unsigned long long)floor((double)u * (double)mass);
  if (tid == 0) found_at[0] = V - 1;  // (never kept: the walk below always finds one)
  __syncthreads();
  if (before <= target && target < before + kept) {  // one thread: the token is in its range
    unsigned long long run = before;
    tie_rank = ties_before;
    for (int i = lo; i < hi; ++i) {
      run += kept_mass(e_of(zr[i]), tie_rank);
      if (run > target) { found_at[0] = i; break; }
    }
  }
  __syncthreads();
  if (tid == 0) tokens[row] = (int)found_at[0];
