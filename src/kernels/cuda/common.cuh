// Helpers every slotserve CUDA kernel may use (prepended to each kernel's header by
// slotserve/kernels/cuda/sources.py; comments are stripped once when it is read).

#include <cuda_bf16.h>

__device__ __forceinline__ float neg_inf() { return __int_as_float(0xff800000u); }
__device__ __forceinline__ float bf_lo(uint32_t u) { return __uint_as_float(u << 16); }
__device__ __forceinline__ float bf_hi(uint32_t u) { return __uint_as_float(u & 0xFFFF0000u); }

// rotate-half RoPE of the pair (x1, x2) = (x[d], x[d + half]) with table entries c[0],
// c[half], s[0], s[half] (explicit roundings: every kernel that rotates gives the same bits)
template <typename C>
__device__ __forceinline__ void rope_rotate(float x1, float x2, const C* c, const C* s,
                                            int half, float& o1, float& o2) {
  o1 = __fmaf_rn(x1, static_cast<float>(c[0]), -__fmul_rn(x2, static_cast<float>(s[0])));
  o2 = __fmaf_rn(x2, static_cast<float>(c[half]), __fmul_rn(x1, static_cast<float>(s[half])));
}
