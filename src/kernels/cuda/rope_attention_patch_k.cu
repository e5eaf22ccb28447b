// Run on each staged key block's K of slotserve_rope_attention (substituted at
// paged_attention.cu's @PATCH_K@ line): the staged copy of the new position's key, patched
// from registers. The copies read the pool through L2 and may not see this block's own
// writes of it. A thread's wait covers only its own copies, and other threads copied that
// row: all of them wait first.

    if (jb == pos_max / 128) {  // the same for every thread of the block
      __syncthreads();
      if (tid < D && writes) reinterpret_cast<T*>(ks)[(pos_max % 128) * KW * 8 + tid] = newk;
    }
