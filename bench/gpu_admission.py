"""The KV-budget targets on the GPU, with the default (device-sized) budget.

    python bench/gpu_admission.py --model DIR [--out FILE]

1. `--concurrent` (64) requests without max_tokens (each may run to the whole context) are
   all admitted and run at the same time: the script waits until every one has generated
   `--tokens` tokens, checks that they all ran concurrently (slots busy at once) and that
   none was refused, then cancels them.
2. `--long` (8) prompts of `--long-tokens` (32,768) random tokens, 16 new tokens each, all
   submitted at once: every one completes, none refused; TTFT per request and the wall time.

Prints one JSON line per part and writes them all to --out.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
from pathlib import Path
from typing import Any

from slotserve.engine import Engine

GB = 2**30


async def _first_tokens(engine: Engine, n: int, tokens: int, timeout: float) -> dict[str, Any]:
    vocab = engine.tokenizer.vocab_size
    rng = random.Random(0)
    counts = [0] * n
    busy_max = 0
    started = time.perf_counter()
    enough = asyncio.Event()

    async def one(i: int) -> str:
        prompt = [rng.randrange(1000, vocab - 1000) for _ in range(128)]
        request = engine.make_request(prompt, temperature=0.0, ignore_eos=True)
        async for delta in engine.generate(request):
            counts[i] += len(delta.token_ids)
            if min(counts) >= tokens:
                enough.set()
            if delta.finish_reason is not None:
                return delta.finish_reason
        return "ended"

    tasks = [asyncio.create_task(one(i)) for i in range(n)]
    deadline = started + timeout
    while not enough.is_set() and time.perf_counter() < deadline:
        busy_max = max(busy_max, sum(1 for s in engine.slot_states() if s.get("busy")))
        await asyncio.sleep(0.05)
    summary = engine.kv_summary()
    for t in tasks:
        t.cancel()
    results = await asyncio.gather(*tasks, return_exceptions=True)
    refused = [repr(r) for r in results if isinstance(r, Exception)
               and not isinstance(r, asyncio.CancelledError)]
    return {"requests": n, "max_tokens": None, "reached": min(counts) >= tokens,
            "tokens_each_min": min(counts), "busy_slots_max": busy_max,
            "refused": refused, "seconds": round(time.perf_counter() - started, 1),
            "kv": summary}


async def _long_prompts(engine: Engine, n: int, length: int) -> dict[str, Any]:
    vocab = engine.tokenizer.vocab_size
    rng = random.Random(1)
    started = time.perf_counter()

    async def one() -> dict[str, Any]:
        prompt = [rng.randrange(1000, vocab - 1000) for _ in range(length)]
        request = engine.make_request(prompt, max_tokens=16, temperature=0.0, ignore_eos=True)
        t0, ttft, finish, produced = time.perf_counter(), None, None, 0
        async for delta in engine.generate(request):
            if delta.token_ids and ttft is None:
                ttft = time.perf_counter() - t0
            produced += len(delta.token_ids)
            finish = delta.finish_reason or finish
        return {"ttft_s": round(ttft or -1, 2), "finish": finish, "tokens": produced}

    results = await asyncio.gather(*(one() for _ in range(n)), return_exceptions=True)
    wall = time.perf_counter() - started
    return {"requests": n, "prompt_tokens": length, "wall_s": round(wall, 1),
            "results": [r if isinstance(r, dict) else repr(r) for r in results],
            "refused": sum(1 for r in results if not isinstance(r, dict)),
            "kv": engine.kv_summary()}


async def main(args: argparse.Namespace) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    engine = Engine.load(args.model, max_slots=args.concurrent, max_queue=4 * args.concurrent,
                         prefill_budget=args.prefill_budget)
    async with engine:
        assert engine.admission is not None
        head = {"kv_budget_gb": round(engine.admission.kv_budget / GB, 1),
                "bytes_per_token": engine.slots[0].kv.bytes_per_position,
                "context": engine.context_length}
        print(json.dumps({"engine": head}), flush=True)
        out.append({"engine": head})
        part = await _first_tokens(engine, args.concurrent, args.tokens, args.timeout)
        print(json.dumps({"concurrent": part}), flush=True)
        out.append({"concurrent": part})
        engine.drop_retained()
        part = await _long_prompts(engine, args.long, args.long_tokens)
        print(json.dumps({"long": part}), flush=True)
        out.append({"long": part})
    return out


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True)
    p.add_argument("--concurrent", type=int, default=64)
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--timeout", type=float, default=120.0)
    p.add_argument("--long", type=int, default=8)
    p.add_argument("--long-tokens", type=int, default=32768)
    p.add_argument("--prefill-budget", type=int, default=1024)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    report = asyncio.run(main(args))
    if args.out is not None:
        args.out.write_text(json.dumps(report, indent=1))
