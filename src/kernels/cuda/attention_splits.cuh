// Where a row's attention splits lie (the attention kernels' header, after common.cuh):
// key blocks of 128 at fixed absolute positions, the first HEAD_SPLITS splits of
// SPLIT_BLOCKS / 2 blocks each (at least 1), the rest of SPLIT_BLOCKS. A row's splits
// depend on its positions alone, so its bits never depend on its batch; short splits at the
// head spread a short context's decode row over more blocks (launch.split_of_block, the
// same rule in Python).

template <int SPLIT_BLOCKS, int HEAD_SPLITS>
struct KeySplits {
  static constexpr int HALF = SPLIT_BLOCKS > 1 ? SPLIT_BLOCKS / 2 : 1;
  static constexpr int HEAD = HEAD_SPLITS * HALF;  // key blocks in the short splits

  // the split holding key block jb
  static __device__ __forceinline__ int of(int jb) {
    return jb < HEAD ? jb / HALF : HEAD_SPLITS + (jb - HEAD) / SPLIT_BLOCKS;
  }

  // split s's first key block
  static __device__ __forceinline__ int first(int s) {
    return s < HEAD_SPLITS ? s * HALF : HEAD + (s - HEAD_SPLITS) * SPLIT_BLOCKS;
  }
};
