"""Host cost of a decode step on the GPU, plain forward vs compiled, under MLX's settings.

MLX reads its CUDA launch settings (MLX_USE_CUDA_GRAPHS, MLX_MAX_OPS_PER_BUFFER,
MLX_MAX_MB_PER_BUFFER) once per process, so bench/gpu.sh (stage `host`) runs this once per
setting. Each run loads the model without the start-up probe and times decode steps
straight through it (gpu_bench.runner_timing: graph build, MLX's launch of the graph,
whole step, pipelined step) at each row count, plain and through runtime.compiled, and
the host cost per op of tiny op chains (gpu_bench.eval_us_per_op).

    python bench/host_cost.py MODEL --rows 1,64 --out host.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

SETTINGS = ("MLX_USE_CUDA_GRAPHS", "MLX_MAX_OPS_PER_BUFFER", "MLX_MAX_MB_PER_BUFFER")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model")
    p.add_argument("--rows", default="1,64")
    p.add_argument("--ctx", type=int, default=128)
    p.add_argument("--out", default=None)
    p.add_argument("--device", default="gpu", choices=["cpu", "gpu"])
    args = p.parse_args(argv)
    sys.path.insert(0, str(Path(__file__).parent))
    from gpu_bench import emit, eval_us_per_op, runner_timing

    from slotserve.model.loader import load
    from slotserve.runtime.compiled import CompiledDecode

    t0 = time.perf_counter()
    lm = load(args.model, device=args.device, with_tokenizer=False, probe_rows=None)
    report: dict[str, object] = {
        "settings": {k: os.environ.get(k) for k in SETTINGS},
        "load_s": round(time.perf_counter() - t0, 1), "runner": []}
    emit({"settings": report["settings"]})
    compiled = CompiledDecode(lm.model)
    for n in (int(x) for x in args.rows.split(",")):
        for c in (None, compiled):
            r = runner_timing(lm.model, n, args.ctx, compiled=c)
            report["runner"].append(r)  # type: ignore[attr-defined]
            emit({"runner": r})
    report["eval_us_per_op"] = eval_us_per_op()
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
