"""Event-loop CPU time per decode step: the host work (actors, sessions, the client loop)
that the fused step must not wait for.

Runs N concurrent greedy streams through the real engine on the CPU and divides the main
thread's CPU time (`time.thread_time`, the thread running the event loop) by the number of
steps; three rounds after a warm-up. Model: any checkpoint, e.g. a random tiny one:

    slotserve synth tiny-llama /tmp/tiny --format mlx4
    .venv/bin/python bench/event_loop_cost.py /tmp/tiny 64
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

import anyio

from slotserve.engine import Engine
from slotserve.tools.bench import run_streams


async def measure(model: str, n: int, new_tokens: int, rounds: int) -> dict[str, Any]:
    async with Engine.load(model, device="cpu", max_slots=n, max_queue=4 * n) as engine:
        assert engine.batcher is not None
        await run_streams(engine, n, 16, 8)  # warm-up
        out = []
        for _ in range(rounds):
            steps0 = len(engine.batcher.stats.recent)
            cpu0 = time.thread_time()
            r = await run_streams(engine, n, 16, new_tokens)
            cpu = time.thread_time() - cpu0
            steps = len(engine.batcher.stats.recent) - steps0
            out.append({"event_loop_ms_per_step": round(cpu / steps * 1000, 3), "steps": steps,
                        "step_ms": r["step_ms"], "model_ms": r["model_ms"]})
        return {"streams": n, "rounds": out}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model")
    p.add_argument("streams", type=int, nargs="?", default=64)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=3)
    a = p.parse_args()
    print(json.dumps(anyio.run(measure, a.model, a.streams, a.new_tokens, a.rounds)))


if __name__ == "__main__":
    main()
