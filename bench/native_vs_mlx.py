"""Decode step time of the bundled SmolLM2 with slotserve's native CPU kernels vs MLX ops only.

Side by side in one run (the two paths alternate per N, each in a fresh process, since
SLOTSERVE_NATIVE is read once): N slots each hold a prompt of --prompt tokens, then the
median time of one decode step over all N rows (forward + K/V writes, no sampling).

    .venv/bin/python bench/native_vs_mlx.py --streams 1,8,32
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time


def measure(n: int, prompt: int, steps: int) -> dict[str, float]:
    from slotserve.model import loader  # first: slotserve preloads OpenBLAS before MLX loads
    from slotserve.model.layers import Batch  # isort: skip

    import mlx.core as mx  # isort: skip

    lm = loader.load(None, device="cpu", with_tokenizer=False)
    model = lm.model
    kvs = [model.new_kv() for _ in range(n)]
    t0 = time.perf_counter()
    for kv in kvs:
        mx.eval(model(mx.array([1] * prompt), Batch.build([(kv, 0, prompt)]), [prompt - 1]))
    prefill = (time.perf_counter() - t0) / (n * prompt)
    times = []
    for i in range(steps + 2):
        t0 = time.perf_counter()
        batch = Batch.build([(kv, prompt + i, 1) for kv in kvs])
        out = model(mx.array([5] * n), batch, list(range(n)))
        mx.eval(out, model.kv_pool.keys, model.kv_pool.values)
        times.append(time.perf_counter() - t0)
    step = statistics.median(times[2:])
    return {"step_ms": round(step * 1e3, 2), "decode_tok_s": round(n / step, 1),
            "prefill_tok_s": round(1 / prefill, 1), "linear_floor": lm.invariance.linear_floor}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--streams", default="1,8,32")
    p.add_argument("--prompt", type=int, default=128)
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--one", type=int, default=0, help=argparse.SUPPRESS)  # child process
    args = p.parse_args()
    if args.one:
        print(json.dumps(measure(args.one, args.prompt, args.steps)))  # noqa: T201
        return
    rows = []
    for n in [int(s) for s in args.streams.split(",")]:
        res = {}
        for mode in ("1", "0"):
            env = {**os.environ, "SLOTSERVE_NATIVE": mode}
            out = subprocess.run([sys.executable, __file__, "--one", str(n), "--prompt",
                                  str(args.prompt), "--steps", str(args.steps)],
                                 env=env, capture_output=True, text=True, check=True,
                                 timeout=300)
            res[mode] = json.loads(out.stdout.strip().splitlines()[-1])
        rows.append((n, res["1"], res["0"]))
    print("| N | native step ms | MLX-only step ms | decode tok/s native / MLX | ratio |")  # noqa: T201
    print("|---:|---:|---:|---|---:|")  # noqa: T201
    for n, nat, mlx_only in rows:
        print(f"| {n} | {nat['step_ms']} | {mlx_only['step_ms']} | "  # noqa: T201
              f"{nat['decode_tok_s']} / {mlx_only['decode_tok_s']} | "
              f"{mlx_only['step_ms'] / nat['step_ms']:.2f}x |")


if __name__ == "__main__":
    main()
