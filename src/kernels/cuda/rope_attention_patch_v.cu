// Run on each staged key block's V of slotserve_rope_attention (substituted at
// paged_attention.cu's @PATCH_V@ line): the new position's value, as rope_attention_patch_k.cu
// patches its key.

    if (jb == pos_max / 128) {
      __syncthreads();
      if (tid < D && writes) reinterpret_cast<T*>(vs)[(pos_max % 128) * KW * 8 + tid] = newv;
    }
