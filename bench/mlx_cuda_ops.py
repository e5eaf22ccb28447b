"""Which of MLX's CUDA ops on slotserve's MLX-ops path launch, at the shapes of gpt-oss's
GPU test (tests/test_gpu_families.py, SLOTSERVE_CUDA_KERNELS=0: an 88-token prefill, width
128, 4 heads of 32 over 2 kv heads, experts 512x128 / 128x256 in MXFP4 plus the GPU's spare
zero expert, projections MLX 4-bit group 64), each op alone in its own process (a failed
launch can leave MLX's CUDA graph half built), in bfloat16 and in float32.

Why: that test died in its first forward with `cuGraphAddKernelNode(...) failed: invalid
argument`. Read from MLX 0.32's CUDA sources, the cause is gather_mm (attention's
block_matmul) in float32: its gemm_sm70 kernel takes a 256-row tile for 176 rows, which
asks 4 * (256 + 128) * 64 = 96 KiB of dynamic shared memory, and gather_gemm.cu never opts
in past the 48 KiB default (qmm_sm80 does; qmm_naive does not either, which matters for
float32 at group 128). bfloat16 needs exactly 48 KiB and launches. The test's projections
have float32 scales (quantized from float32 weights), and MLX's affine matmul returns the
promotion of x's and the scales' dtypes, so the activations turned float32; slotserve's
Linear now keeps kept-quantized scales in the compute dtype. This script checks both halves
on the device: float32 rows should FAIL from gather_mm at 65+ rows, every bfloat16 row
should be ok.

    python3 bench/mlx_cuda_ops.py        # or: bash bench/gpu.sh mlx_ops

One more case is tiny-gemma4's (tests/test_gpu_gemma4.py): its per-layer projection, 256 x
64 in 4-bit group 64, is one quantization group a row, the only shape MLX 0.32's CUDA
quantized_matmul sends to qmm_sm90 (supports_qmm_sm90: group_size >= K); that model's logits
came out NaN, first in that projection's rows, so slotserve's Linear now holds such matrices
dense. The case FAILS where MLX's rows there are NaN/inf or off the dequantized product.

Prints one line per op: `ok`, or `FAILS` with MLX's message (exit status 0 either way; it
reports, the test decides). Needs only MLX; seconds with MLX's kernel cache restored, up
to about two minutes where its NVRTC compiles the kernels first.
"""

from __future__ import annotations

import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import mlx.core as mx

R, H, HEADS, KV, D, INTER, EXPERTS, TOP_K = 88, 128, 4, 2, 32, 256, 4, 2
BLOCK, POOL_BLOCKS = 128, 6  # one 128-key block per kv head per slot, a few slots' worth


def _gather_mm_scores(dtype: mx.Dtype, rows: int) -> mx.array:
    """attention's Q.K^T: [S * kv, rows, D] against pool blocks [B, BLOCK, D] transposed."""
    q = mx.random.normal((KV, rows, D)).astype(dtype)
    keys = mx.random.normal((POOL_BLOCKS, BLOCK, D)).astype(mx.bfloat16)
    idx = mx.arange(KV, dtype=mx.int32).reshape(1, 1, KV)
    return mx.gather_mm(q, keys.swapaxes(-1, -2), idx, idx)


def _gather_mm_values(dtype: mx.Dtype, rows: int) -> mx.array:
    """attention's P.V: [S, nb, kv, rows, BLOCK] probabilities against value blocks."""
    p = mx.random.uniform(shape=(1, 1, KV, rows, BLOCK)).astype(dtype)
    values = mx.random.normal((POOL_BLOCKS, BLOCK, D)).astype(mx.bfloat16)
    return mx.gather_mm(p, values, None, mx.arange(KV, dtype=mx.int32).reshape(1, 1, KV))


def _quantized_matmul(dtype: mx.Dtype, group: int, out: int = (HEADS + 2 * KV) * D) -> mx.array:
    """a Linear kept 4-bit: x bfloat16, scales and biases in `dtype` (the QKV projection)."""
    w = mx.random.normal((out, H))
    q, scales, biases = mx.quantize(w, group_size=group, bits=4)
    x = mx.random.normal((R, H)).astype(mx.bfloat16)
    return mx.quantized_matmul(x, q, scales.astype(dtype), biases.astype(dtype),
                               transpose=True, group_size=group, bits=4)


def _gather_qmm_mxfp4(dtype: mx.Dtype, out: int, inner: int) -> mx.array:
    """an expert projection: each (row, expert) pair against its MXFP4 expert (+ spare)."""
    w = mx.random.normal((EXPERTS + 1, out, inner))
    q, scales = mx.quantize(w, group_size=32, bits=4, mode="mxfp4")
    lead = (R, 1, 1, inner) if inner == H else (R, TOP_K, 1, inner)
    x = mx.random.normal(lead).astype(dtype)
    experts = mx.random.randint(0, EXPERTS, (R, TOP_K)).astype(mx.uint32)
    return mx.gather_qmm(x, q, scales, None, rhs_indices=experts, transpose=True,
                         group_size=32, bits=4, mode="mxfp4")


def _one_group_rows(rows: int) -> mx.array:
    """MLX's quantized_matmul of a matrix whose rows are one 4-bit group (tiny-gemma4's per-layer
    projection, 256 x 64, bf16 scales): raises where a row is NaN/inf or off the product of the
    dequantized codes by more than bf16 rounding."""
    w = mx.random.normal((256, 64), key=mx.random.key(0)) * 0.125
    q, scales, biases = mx.quantize(w, group_size=64, bits=4)
    scales, biases = scales.astype(mx.bfloat16), biases.astype(mx.bfloat16)
    x = mx.random.normal((rows, 64), key=mx.random.key(1)).astype(mx.bfloat16)
    y = mx.quantized_matmul(x, q, scales, biases, transpose=True, group_size=64, bits=4)
    want = x.astype(mx.float32) @ mx.dequantize(q, scales, biases, group_size=64,
                                                bits=4).astype(mx.float32).T
    bad = int(mx.sum(~mx.isfinite(y)).item())
    err = float(mx.abs(y.astype(mx.float32) - want).max().item())
    if bad or err > 0.05 * float(mx.abs(want).max().item()):
        raise ValueError(f"{bad} NaN/inf of {y.size}, max |error| {err:.3g}")
    return y


def _router_top_k() -> mx.array:
    probs = mx.softmax(mx.random.normal((R, EXPERTS)), axis=-1)
    return mx.argpartition(probs, kth=EXPERTS - TOP_K, axis=-1)[:, EXPERTS - TOP_K:]


F32, BF16 = mx.float32, mx.bfloat16
CASES = {
    "gather_mm scores bf16 x176 (the test, fixed)": lambda: _gather_mm_scores(BF16, 2 * R),
    "gather_mm scores f32 x176 (the test, before)": lambda: _gather_mm_scores(F32, 2 * R),
    "gather_mm scores f32 x64": lambda: _gather_mm_scores(F32, 64),
    "gather_mm scores f32 x65": lambda: _gather_mm_scores(F32, 65),
    "gather_mm values bf16 x176": lambda: _gather_mm_values(BF16, 2 * R),
    "gather_mm values f32 x176": lambda: _gather_mm_values(F32, 2 * R),
    "quantized_matmul 4-bit g64, bf16 scales": lambda: _quantized_matmul(BF16, 64),
    "quantized_matmul 4-bit g64, f32 scales": lambda: _quantized_matmul(F32, 64),
    "quantized_matmul 4-bit g128, f32 scales": lambda: _quantized_matmul(F32, 128),
    "gather_qmm mxfp4 gate_up bf16": lambda: _gather_qmm_mxfp4(BF16, 2 * INTER, H),
    "gather_qmm mxfp4 gate_up f32": lambda: _gather_qmm_mxfp4(F32, 2 * INTER, H),
    "gather_qmm mxfp4 down bf16": lambda: _gather_qmm_mxfp4(BF16, H, INTER),
    "gather_qmm mxfp4 down f32": lambda: _gather_qmm_mxfp4(F32, H, INTER),
    "router top-k (argpartition)": _router_top_k,
    "quantized_matmul 256x64 g64, one group a row, x256 (tiny-gemma4)":
        lambda: _one_group_rows(256),
    "quantized_matmul 256x64 g64, one group a row, x150 (tiny-gemma4)":
        lambda: _one_group_rows(150),
}


def run_one(name: str) -> str:
    """One case in this process: `ok` or `FAILS <MLX's message>`."""
    try:
        mx.set_default_device(mx.gpu)
        mx.eval(CASES[name]())
        mx.synchronize()
    except Exception as exc:  # noqa: BLE001 - the point is to report what MLX raised
        return f"FAILS {type(exc).__name__}: {str(exc)[:160]}"
    return "ok"


def in_subprocess(name: str) -> str:
    try:
        done = subprocess.run([sys.executable, __file__, name], capture_output=True,
                              text=True, timeout=50)
    except subprocess.TimeoutExpired:
        return "FAILS (no answer in 50 s)"
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines:
        return f"FAILS (exit {done.returncode}) {done.stderr.strip()[-160:]}"
    return lines[-1]


def main() -> int:
    if len(sys.argv) == 2:
        print(run_one(sys.argv[1]), flush=True)
        return 0
    if not mx.is_available(mx.gpu):
        print("no GPU in this MLX: nothing to check")
        return 0
    print(f"mlx {mx.__version__}, {mx.device_info().get('device_name', 'gpu')}", flush=True)
    with ThreadPoolExecutor(max_workers=4) as pool:  # 4 contexts, few compile races
        results = dict(zip(CASES, pool.map(in_subprocess, CASES), strict=True))
    width = max(map(len, CASES))
    for name, result in results.items():
        print(f"{name:<{width}}  {result}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
