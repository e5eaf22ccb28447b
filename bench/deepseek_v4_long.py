"""DeepSeek-V4 long context on the GPU: 4 slots, each with a long prompt, served at once
under a KV budget well below 4 x what an uncompressed cache of those prompts would take.

    slotserve synth deepseek-v4-flash-10l DIR --format mlx4
    python bench/deepseek_v4_long.py --model DIR [--lengths 16384,65536,131072] [--out FILE]

Per prompt length: `--slots` (4) requests of that many random tokens, `--new-tokens` (32)
each, submitted together; every one must finish (`length`), none refused, all running at
once. Reports each request's TTFT, the decode tokens/s per request (after its first token)
and summed over the slots, the step's wall time, and the budget beside the two sizes it is
compared with: the compressed need (what the pages and per-slot floors of these prompts
take) and the uncompressed one (every layer's K=V head at every position, the cache a V4
without compression keeps; a K and V cache is twice that).

The budget defaults to a quarter of the uncompressed size of the longest run (`--kv-budget`
in GB overrides); the prefix cache keeps a state snapshot every `--snapshot-pages` pages (64:
every 8k tokens; each snapshot costs a slot's state, a few MB). Prints one JSON line per
length and writes them all to --out.
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
from slotserve.kernels.attention import BLOCK

GB = 2**30


def uncompressed_bytes_per_token(model: str) -> int:
    """Every layer's one K=V head of head_dim values at every position (bf16)."""
    cfg = json.loads((Path(model) / "config.json").read_text())
    return int(cfg["num_hidden_layers"]) * int(cfg["head_dim"]) * 2


async def run_length(engine: Engine, slots: int, length: int, new: int) -> dict[str, Any]:
    vocab = engine.tokenizer.vocab_size
    rng = random.Random(length)
    busy_max = 0
    started = time.perf_counter()

    async def one(i: int) -> dict[str, Any]:
        prompt = [rng.randrange(1000, vocab - 1000) for _ in range(length)]
        request = engine.make_request(prompt, max_tokens=new, temperature=0.0,
                                      ignore_eos=True)
        t0, first, last, produced, finish = time.perf_counter(), None, None, 0, None
        async for delta in engine.generate(request):
            now = time.perf_counter()
            if delta.token_ids and first is None:
                first = now
            produced += len(delta.token_ids)
            last = now
            finish = delta.finish_reason or finish
        ttft = (first - t0) if first is not None else -1.0
        decode = (produced - 1) / (last - first) if first and last and last > first else 0.0
        return {"ttft_s": round(ttft, 2), "decode_tok_s": round(decode, 2),
                "tokens": produced, "finish": finish}

    tasks = [asyncio.create_task(one(i)) for i in range(slots)]
    while not all(t.done() for t in tasks):
        busy_max = max(busy_max, sum(1 for s in engine.slot_states() if s.get("busy")))
        await asyncio.sleep(0.05)
    results = [t.result() if t.exception() is None else repr(t.exception()) for t in tasks]
    ok = [r for r in results if isinstance(r, dict)]
    return {"prompt_tokens": length, "slots": slots, "busy_slots_max": busy_max,
            "wall_s": round(time.perf_counter() - started, 1),
            "all_finished": len(ok) == slots and all(r["finish"] == "length" for r in ok),
            "decode_tok_s_total": round(sum(r["decode_tok_s"] for r in ok), 2),
            "results": results, "kv": engine.kv_summary()}


async def main(args: argparse.Namespace) -> list[dict[str, Any]]:
    lengths = [int(x) for x in args.lengths.split(",")]
    per_token = uncompressed_bytes_per_token(args.model)
    budget = int(args.kv_budget * GB) if args.kv_budget else \
        args.slots * max(lengths) * per_token // 4
    engine = Engine.load(args.model, device=args.device, max_slots=args.slots,
                         max_queue=4 * args.slots, prefill_budget=args.prefill_budget,
                         kv_budget_bytes=budget, state_snapshot_pages=args.snapshot_pages)
    out: list[dict[str, Any]] = []
    async with engine:
        adm = engine.admission
        assert adm is not None
        longest = max(lengths) + args.new_tokens
        pages = -(-longest // BLOCK)
        head = {"kv_budget_gb": round(adm.kv_budget / GB, 3),
                "page_bytes": adm.page_bytes, "floor_pages_per_slot": adm.floor_pages,
                "compressed_need_gb": round(args.slots * (pages + adm.floor_pages)
                                            * adm.page_bytes / GB, 3),
                "uncompressed_gb": round(args.slots * longest * per_token / GB, 3),
                "compressed_bytes_per_token": adm.page_bytes / BLOCK,
                "uncompressed_bytes_per_token": per_token}
        print(json.dumps({"engine": head}), flush=True)
        out.append({"engine": head})
        for n in lengths:
            engine.drop_retained()
            part = await run_length(engine, args.slots, n, args.new_tokens)
            print(json.dumps({"long": part}), flush=True)
            out.append({"long": part})
    return out


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True)
    p.add_argument("--lengths", default="16384,65536,131072")
    p.add_argument("--slots", type=int, default=4)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--prefill-budget", type=int, default=1024)
    p.add_argument("--kv-budget", type=float, default=None, help="GB (default: see above)")
    p.add_argument("--snapshot-pages", type=int, default=64)
    p.add_argument("--device", default="gpu")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    report = asyncio.run(main(args))
    if args.out is not None:
        args.out.write_text(json.dumps(report, indent=1))
