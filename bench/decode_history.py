"""One long prompt's decode speed fresh and after sampled batches, in one engine.

    python bench/decode_history.py --model DIR [--device gpu] [--streams 128]
        [--context 16384] [--out FILE]

On the H200 one 16k-context row decoded at 5.0 ms a step on a fresh engine (128 slots)
and at 7.8 ms after `slotserve bench --sampling --streams 128` on the same engine (three
batches of 128 streams, greedy, top_p and top_k), while a greedy 128-stream batch before
it left it at 5.2 ms. This script puts the cases in one process so the machine is the
same for all of them: the long case fresh, then after the sampled batches, then again
after dropping the decode traces, then after the sampled batches once more and dropping
MLX's buffer cache alone, each with the engine's state
beside it (decode traces held, pool pages, MLX's active and cached memory) and the
runner's time a step split into building/queueing the step and waiting for its tokens.

What it found (2026-12-04): the slow case was MLX's cache of freed device buffers, grown
to its limit and emptying itself on allocations (cache 0.0 GB after the sampled batches,
the device waiting 0.03 ms a step: the host building steps was the bottleneck); dropping
the traces changed nothing, mx.clear_cache() brought the fresh speed back. The engine
now bounds that cache on a GPU (engine.gpu_cache_limit): 4.97 / 5.02 / 5.08 / 5.10 ms.

Prints one JSON line per case and writes them all to --out.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import anyio
import mlx.core as mx

from slotserve.engine import Engine
from slotserve.runtime.runner import ModelRunner
from slotserve.runtime.sampling import SampleDraft
from slotserve.tools import bench

WAITS: list[float] = []  # seconds each step's result() waited for the device


def _timed_result(result: Any) -> Any:
    def timed(self: SampleDraft, **kw: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return result(self, **kw)
        finally:
            WAITS.append(time.perf_counter() - t0)
    return timed


def _state(engine: Engine) -> dict[str, Any]:
    assert engine.batcher is not None
    runner: ModelRunner = engine.batcher.runner
    pool = engine.slots[0].kv.pool
    return {"traces": len(runner.compiled._traces) if runner.compiled is not None else None,
            "pool_pages": pool.pages, "pool_free": pool.free_count,
            "active_gb": round(mx.get_active_memory() / 2**30, 2),
            "cache_gb": round(mx.get_cache_memory() / 2**30, 2)}


async def _long(engine: Engine, label: str, context: int, new_tokens: int) -> dict[str, Any]:
    WAITS.clear()
    row = (await bench.long_table(engine, [(1, context)], new_tokens))[0]
    steady = sorted(WAITS[-new_tokens // 2:])  # the decode steps at the full context
    wait_ms = round(1000 * steady[len(steady) // 2], 2) if steady else None
    out = {"case": label, "step_ms": row["step_ms"], "model_ms": row["model_ms"],
           "wait_ms": wait_ms, "decode_tok_s": row["decode_tok_s"], **_state(engine)}
    print(json.dumps(out), flush=True)  # noqa: T201 - progress for the user
    return out


async def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    engine = Engine.load(args.model, device=args.device, max_slots=args.streams,
                         max_queue=4 * args.streams, prefill_budget=args.prefill_budget)
    rows = []
    async with engine:
        # warm-up: two prefill chunks and the sampler (as slotserve bench --sampling --long)
        await bench.run_streams(engine, 1, 2 * args.prefill_budget, 4, exact=True)
        rows.append(await _long(engine, "fresh", args.context, args.new_tokens))
        await bench.sampling_table(engine, [args.streams], args.prompt_tokens,
                                   args.new_tokens, exact=True)
        rows.append(await _long(engine, f"after sampled {args.streams}-stream batches",
                                args.context, args.new_tokens))
        assert engine.batcher is not None
        runner = engine.batcher.runner

        def drop_traces() -> None:
            if runner.compiled is not None:
                runner.compiled.clear()
        await engine.mlx.run(drop_traces)
        rows.append(await _long(engine, "then the decode traces dropped", args.context,
                                args.new_tokens))
        await bench.sampling_table(engine, [args.streams], args.prompt_tokens,
                                   args.new_tokens, exact=True)
        await engine.mlx.run(mx.clear_cache)
        rows.append(await _long(engine, "sampled batches again, then MLX's buffer cache dropped",
                                args.context, args.new_tokens))
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--device", default="gpu")
    p.add_argument("--streams", type=int, default=128)
    p.add_argument("--context", type=int, default=16384)
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--prefill-budget", type=int, default=1024)
    p.add_argument("--out", default="decode_history.json")
    args = p.parse_args()
    SampleDraft.result = _timed_result(SampleDraft.result)  # type: ignore[method-assign]
    rows = anyio.run(run, args)
    Path(args.out).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
