"""Do Hopper's warpgroup multiplies (wgmma) give the bits of the warp ones (mma.sync)?

slotserve's 4-bit matmul and attention run `mma.sync.m16n8k16` (bf16 in, f32 sums), and a
row's bits must be the same in every launch: decode steps and prefill chunks alike. The
prefill kernels are latency-bound at 2 warps a scheduler (docs/history.md), and Hopper's
answer to that is `wgmma.mma_async`: a warpgroup's 64 x N x 16 product issued at once,
asynchronously, from shared memory. A prefill kernel may use it only if each k16 step
gives the same f32 result as mma.sync's, bit for bit, so this probe asks the device:

    python3 bench/wgmma_probe.py          # on the GPU machine (bench/gpu.sh wgmma_probe)

It also answers whether such a kernel can run under MLX at all. MLX's cuda_kernel compiles
for sm_90 (its NVRTC call: --gpu-architecture=sm_<major><minor>), and wgmma needs sm_90a,
so the probe compiles its kernel as slotserve's q4_wgmma is (slotserve.kernels.cuda.sm90a:
the NVRTC library MLX has loaded, for sm_90a) and runs the cubin with
mx.fast.precompiled_cuda_kernel. It answered yes on an H100 (2026-12-06): every element of
1-, 4- and 16-step products had mma.sync's bits.

One warpgroup multiplies a random 64 x 16k bf16 A by a 16k x 8 B onto a random f32 C, k16
step by k16 step, both ways: each warp's 16 rows by mma.sync, and the warpgroup's 64 by
wgmma (A from registers in mma.sync's fragment layout, B from shared memory, K-major
without swizzle). It prints, per case, how many of the 512 results have the same bits and
each way's largest error against a float64 reference (a layout mistake shows there, as
errors of the order of the values).
"""

from __future__ import annotations

import json
import sys
from typing import Any

import numpy as np

KERNEL = "slotserve_wgmma_probe"
MAX_STEPS = 16  # k16 steps a case may take (the kernel's shared B stage)

SOURCE = r"""
extern "C" __global__ void slotserve_wgmma_probe(const unsigned short* A, const unsigned short* B,
                                                const float* C, float* Dw, float* Dm, int steps) {
  // A [64][16 steps] bf16, B [8][16 steps] bf16 (a row per output column: K-major), C, D [64][8]
  const int K = 16 * steps;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
  const int r0 = 16 * warp + g, r1 = r0 + 8;
  constexpr int MAX_STEPS = 16;  // (wgmma_probe.MAX_STEPS)
  __shared__ __align__(128) uint4 bs[16 * MAX_STEPS];
  // B's k16 steps as core matrices (8 columns x 16 bytes): step s, k 0-7 at bs[16 s], k 8-15
  // at bs[16 s + 8]
  for (int i = threadIdx.x; i < 16 * steps; i += 128) {
    const int s = i / 16, half = (i % 16) / 8, n = i % 8;
    bs[i] = *reinterpret_cast<const uint4*>(B + n * K + 16 * s + 8 * half);
  }
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
  __syncthreads();
  auto a_word = [&](int row, int k) { return *reinterpret_cast<const unsigned*>(A + row * K + k); };
  float m[4] = {C[r0 * 8 + 2 * t], C[r0 * 8 + 2 * t + 1], C[r1 * 8 + 2 * t], C[r1 * 8 + 2 * t + 1]};
  float w[4] = {m[0], m[1], m[2], m[3]};
  for (int s = 0; s < steps; ++s) {
    const int k = 16 * s + 2 * t;
    const unsigned a0 = a_word(r0, k), a1 = a_word(r1, k), a2 = a_word(r0, k + 8),
                   a3 = a_word(r1, k + 8);
    const unsigned b0 = *reinterpret_cast<const unsigned*>(B + g * K + k);
    const unsigned b1 = *reinterpret_cast<const unsigned*>(B + g * K + k + 8);
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
        "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(m[0]), "+f"(m[1]), "+f"(m[2]), "+f"(m[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
  }
  // A's fragments of every step loaded first: wgmma reads them asynchronously, and a
  // register written between wgmma.fence and the multiply that reads it is not allowed
  unsigned af[MAX_STEPS][4];
#pragma unroll
  for (int s = 0; s < MAX_STEPS; ++s) {
    const int k = 16 * (s < steps ? s : 0) + 2 * t;
    af[s][0] = a_word(r0, k); af[s][1] = a_word(r1, k);
    af[s][2] = a_word(r0, k + 8); af[s][3] = a_word(r1, k + 8);
  }
  unsigned base;
  asm("{ .reg .u64 p; cvta.to.shared.u64 p, %1; cvt.u32.u64 %0, p; }" : "=r"(base) : "l"(bs));
  asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#pragma unroll
  for (int s = 0; s < MAX_STEPS; ++s) {
    if (s >= steps) break;
    // no swizzle, K-major: the two k halves 128 bytes apart (leading offset), 8-column
    // groups 256 apart (stride offset; one group here)
    const unsigned long long desc = (unsigned long long)(((base + 256u * s) & 0x3FFFFu) >> 4)
                                    | ((unsigned long long)(128 >> 4) << 16)
                                    | ((unsigned long long)(256 >> 4) << 32);
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %9, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n8k16.f32.bf16.bf16 "
        "{%0,%1,%2,%3}, {%4,%5,%6,%7}, %8, p, 1, 1, 0;\n}\n"
        : "+f"(w[0]), "+f"(w[1]), "+f"(w[2]), "+f"(w[3])
        : "r"(af[s][0]), "r"(af[s][1]), "r"(af[s][2]), "r"(af[s][3]), "l"(desc), "r"(1));
  }
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
  asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
  Dm[r0 * 8 + 2 * t] = m[0]; Dm[r0 * 8 + 2 * t + 1] = m[1];
  Dm[r1 * 8 + 2 * t] = m[2]; Dm[r1 * 8 + 2 * t + 1] = m[3];
  Dw[r0 * 8 + 2 * t] = w[0]; Dw[r0 * 8 + 2 * t + 1] = w[1];
  Dw[r1 * 8 + 2 * t] = w[2]; Dw[r1 * 8 + 2 * t + 1] = w[3];
}
"""


def _values(rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
    """Random values over a wide range of magnitudes and both signs (sums that cancel and
    sums that round)."""
    return rng.standard_normal(shape) * np.exp2(rng.integers(-8, 9, shape))


def probe_case(cubin: bytes, steps: int, seed: int) -> dict[str, Any]:
    import mlx.core as mx

    rng = np.random.default_rng(seed)
    a = mx.array(_values(rng, (64, 16 * steps)).astype(np.float32)).astype(mx.bfloat16)
    b = mx.array(_values(rng, (8, 16 * steps)).astype(np.float32)).astype(mx.bfloat16)
    c = mx.array(_values(rng, (64, 8)).astype(np.float32))
    dw, dm = mx.fast.precompiled_cuda_kernel(
        name=KERNEL, compiled_source=cubin, inputs=[a, b, c],
        output_shapes=[(64, 8), (64, 8)], output_dtypes=[mx.float32, mx.float32],
        scalars=[steps], grid=(128, 1, 1), threadgroup=(128, 1, 1))
    mx.eval(dw, dm)
    ref = (np.array(a.astype(mx.float32), dtype=np.float64)
           @ np.array(b.astype(mx.float32), dtype=np.float64).T + np.array(c, dtype=np.float64))
    scale = np.abs(ref).max()
    w, m = np.array(dw), np.array(dm)
    return {"steps": steps, "seed": seed,
            "same_bits": int((w.view(np.uint32) == m.view(np.uint32)).sum()), "of": w.size,
            "wgmma_err": float(np.abs(w - ref).max() / scale),
            "mma_err": float(np.abs(m - ref).max() / scale)}


def main() -> int:
    import mlx.core as mx

    mx.set_default_device(mx.gpu)
    from slotserve.kernels.cuda import sm90a

    cubin = sm90a.cubin(SOURCE)
    same = True
    for steps in (1, 4, MAX_STEPS):
        for seed in range(4):
            r = probe_case(cubin, steps, seed)
            print(json.dumps(r), flush=True)
            same = same and r["same_bits"] == r["of"]
    print(json.dumps({"wgmma_gives_mma_sync_bits": same}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
