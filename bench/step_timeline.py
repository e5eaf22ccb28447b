"""Where the time of many long prompts served together goes, step by step.

`slotserve bench --long` reports 8 x 16k prompts end to end; this runs one such case
through the real engine and records every step the Batcher runs: its decode rows, its
prefill rows and how many prompts they come from, the longest context among them, the
model's time (runner.step) and the whole tick. The summary puts each kind of step
(prefill only, prefill beside decode rows, decode only) against its rows and seconds, and
the time until the last first token, so a long case's extra time over its prompts
prefilled one at a time shows where it lands. Works on any device; on a GPU, e.g.:

    python3 bench/step_timeline.py --model /tmp/slotserve-synth/llama3-8b-mlx4 \
        --streams 8 --prompt-tokens 16384 --new-tokens 128 --out /tmp/timeline.json

and on the CPU with the bundled SmolLM2 (no --model): `--device cpu --streams 4
--prompt-tokens 512 --prefill-budget 128`.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import anyio

from slotserve.engine import Engine
from slotserve.tools.bench import run_streams


def record_steps(engine: Engine) -> list[dict[str, Any]]:
    """Wrap the Batcher's step so each one appends its record to the list returned."""
    batcher = engine.batcher
    assert batcher is not None
    steps: list[dict[str, Any]] = []
    inner: Callable[[Any], Awaitable[None]] = batcher._step  # noqa: SLF001 - a bench probe
    t_start = time.perf_counter()

    async def timed(planned: Any) -> None:
        work = [w for _, w in planned]
        done = batcher.stats.steps
        t0 = time.perf_counter()
        await inner(planned)
        tick = time.perf_counter() - t0
        prompts = [w for w in work if len(w.tokens) > 1 or not w.sample]
        steps.append({
            "t_s": round(t0 - t_start, 4),
            "decode_rows": sum(1 for w in work if len(w.tokens) == 1 and w.sample),
            "prefill_rows": sum(len(w.tokens) for w in prompts),
            "prompts": len(prompts),
            "max_context": max((w.start + len(w.tokens) for w in work), default=0),
            "model_s": round(batcher.stats.recent[-1][1], 5)
            if batcher.stats.steps > done else None,
            "tick_s": round(tick, 5),
        })

    batcher._step = timed  # type: ignore[method-assign]  # noqa: SLF001
    return steps


def summary(steps: list[dict[str, Any]]) -> dict[str, Any]:
    """Steps, rows and seconds per kind of step, and when the last prompt's prefill ended."""
    kinds: dict[str, dict[str, float]] = {}
    for s in steps:
        kind = ("prefill" if not s["decode_rows"] else "prefill+decode") if s["prefill_rows"] \
            else "decode"
        k = kinds.setdefault(kind, {"steps": 0, "prefill_rows": 0, "decode_rows": 0,
                                    "model_s": 0.0, "tick_s": 0.0})
        k["steps"] += 1
        k["prefill_rows"] += s["prefill_rows"]
        k["decode_rows"] += s["decode_rows"]
        k["model_s"] += s["model_s"] or 0.0
        k["tick_s"] += s["tick_s"]
    for k in kinds.values():
        k["model_s"] = round(k["model_s"], 3)
        k["tick_s"] = round(k["tick_s"], 3)
    last_prefill = max((s["t_s"] + s["tick_s"] for s in steps if s["prefill_rows"]), default=0.0)
    return {"kinds": kinds, "prefill_done_s": round(last_prefill, 3),
            "steps_s": round(sum(s["tick_s"] for s in steps), 3)}


async def run(args: argparse.Namespace) -> dict[str, Any]:
    extra: dict[str, Any] = {"prefill_budget": args.prefill_budget} if args.prefill_budget \
        else {}
    async with Engine.load(args.model, device=args.device, max_slots=args.streams,
                           max_queue=4 * args.streams, **extra) as engine:
        budget = engine.config.prefill_budget or 256
        # warm-up: two prefill chunks and a few decode steps (the shapes the case meets)
        await run_streams(engine, 1, min(2 * budget, args.prompt_tokens), 4, exact=True)
        engine.drop_retained()
        steps = record_steps(engine)
        case = await run_streams(engine, args.streams, args.prompt_tokens, args.new_tokens,
                                 offset=1000, exact=True)
        return {"case": case, "summary": summary(steps), "steps": steps}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="a checkpoint (default: the bundled model)")
    p.add_argument("--device", default="auto")
    p.add_argument("--streams", type=int, default=8)
    p.add_argument("--prompt-tokens", type=int, default=16384)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--prefill-budget", type=int, default=None)
    p.add_argument("--out", type=Path, default=None, help="the whole record as JSON")
    args = p.parse_args()
    result = anyio.run(run, args)
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))
    print(json.dumps({"case": result["case"], "summary": result["summary"]}))  # noqa: T201


if __name__ == "__main__":
    main()
