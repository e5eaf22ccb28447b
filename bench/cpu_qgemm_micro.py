"""Microbenchmark: the quantized CPU matmul (cpu_qgemm) against the f16 one (cpu_gemm).

    .venv/bin/python bench/cpu_qgemm_micro.py [--bits 4] [--rows 1 8 32 64] [--arch native ...]

Per shape [R, K] x [N, K]^T: the best of several timed calls, as GFLOP/s (2*R*N*K) and
as weight GB/s (bytes of weights the kernel streams per call). "q" times the whole
call (activation quantization included), "f16" the cpu_gemm.Matrix with float16
weights on the same build.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from functools import partial

import mlx.core as mx
import numpy as np

from slotserve.kernels import cpu_gemm, cpu_qgemm, native
from slotserve.model.weights import QuantizedWeight

SHAPES = [(1536, 576), (576, 1536), (49152, 576)]


def best_time(fn: Callable[[], object], budget_s: float = 0.3, min_runs: int = 5) -> float:
    fn()
    runs, best, start = 0, float("inf"), time.perf_counter()
    while runs < min_runs or time.perf_counter() - start < budget_s:
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
        runs += 1
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--bits", type=int, default=4, choices=[4, 8])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32, 64])
    ap.add_argument("--arch", nargs="+", default=None, help="default: every runnable one")
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    print(f"{'arch':>10} {'N':>6} {'K':>5} {'R':>4} | {'q GFLOP/s':>9} {'q GB/s':>7} "
          f"{'q us':>8} | {'f16 GFLOP/s':>11} {'f16 GB/s':>8} {'f16 us':>8} | {'q/f16':>5}")
    for arch in args.arch or native.runnable_archs():
        lib = native.library(arch)
        if lib is None:
            raise SystemExit(f"no native kernels for {arch}")
        for n, k in SHAPES:
            w = mx.array(rng.standard_normal((n, k)).astype(np.float32) * 0.05)
            qw, scales, biases = mx.quantize(w, group_size=32, bits=args.bits)
            q = QuantizedWeight(qw, scales.astype(mx.float16), biases.astype(mx.float16), 32,
                                args.bits)
            qm = cpu_qgemm.QMatrix(q, lib)
            fm = cpu_gemm.Matrix(q.dequantize(mx.float16), lib)
            for rows in args.rows:
                x = cpu_gemm.aligned_copy(rng.standard_normal((rows, k)).astype(np.float32))
                tq = best_time(partial(qm.host, x))
                tf = best_time(partial(fm.host, x))
                flop = 2.0 * rows * n * k
                print(f"{arch:>10} {n:>6} {k:>5} {rows:>4} | {flop / tq / 1e9:>9.1f} "
                      f"{qm.nbytes / tq / 1e9:>7.1f} {tq * 1e6:>8.1f} | {flop / tf / 1e9:>11.1f} "
                      f"{2 * n * k / tf / 1e9:>8.1f} {tf * 1e6:>8.1f} | {tf / tq:>5.2f}")


if __name__ == "__main__":
    main()
