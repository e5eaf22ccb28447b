"""Token-exact agent turns against an in-process engine: prefix reuse and TTFT per turn.

    .venv/bin/python loadtests/agent_turns.py --model DIR [--agents 4] [--turns 4]
        [--history-tokens 11000] [--think-s 2] [--no-settle-passes] [--out FILE]

Each agent opens with its own ~8k-token history (loadtests/agents_gate.history, rendered by
the model's chat template) and takes --turns turns, all agents at once: every follow-up's
prompt is the previous prompt, the exact tokens the model generated for it (--new-tokens,
greedy) and a ~1k-token tool result; the agent waits --think-s seconds between turns (its
tool running). Unlike agents_gate.py, whose follow-ups are re-rendered from the reply's
text (a random-weight model's replies do not survive detokenize + retokenize, so the
cache cannot hold them), this measures what the engine can reuse of an agent's own turns:
the hybrid families' settle passes (slotserve.actors.settle) show up here.

Per follow-up turn (medians over the agents) it prints the share of the prompt reused
(`cached_tokens`), the share of what the cache could hold (the previous prompt and reply)
and TTFT against the cold first turn's, and writes them as JSON to --out.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import agents_gate  # noqa: E402

from slotserve.engine import Engine  # noqa: E402


async def agent(engine: Engine, i: int, args: argparse.Namespace,
                new: list[int]) -> list[dict[str, Any]]:
    prompt = engine.render_chat(agents_gate.history(i, args.history_tokens))
    turns = []
    for turn in range(args.turns):
        t0 = time.perf_counter()
        first, ids, usage = None, [], None
        req = engine.make_request(prompt, max_tokens=args.new_tokens, temperature=0.0,
                                  ignore_eos=True)
        async for d in engine.generate(req):
            if first is None and d.token_ids:
                first = time.perf_counter()
            ids += d.token_ids
            usage = d.usage or usage
        assert usage is not None
        turns.append({"agent": i, "turn": turn, "prompt": len(prompt),
                      "reused": usage.reused_tokens,
                      "seen": len(prompt) - len(new) if turn else 0,
                      "ttft_ms": ((first or time.perf_counter()) - t0) * 1000})
        prompt = prompt + ids + new
        await asyncio.sleep(args.think_s)
    return turns


async def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    async with Engine.load(args.model, max_slots=args.agents,
                           settle_passes=not args.no_settle_passes) as engine:
        new = engine.tokenizer.encode(agents_gate.SOURCE * args.result_repeat)
        out = await asyncio.gather(*(agent(engine, i, args, new) for i in range(args.agents)))
        return [t for turns in out for t in turns]


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    cold = statistics.median(r["ttft_ms"] for r in rows if r["turn"] == 0)
    out: dict[str, Any] = {"cold_ttft_ms": cold, "follow_ups": {}}
    for turn in sorted({r["turn"] for r in rows} - {0}):
        rs = [r for r in rows if r["turn"] == turn]
        ttft = statistics.median(r["ttft_ms"] for r in rs)
        out["follow_ups"][turn] = {
            "prompt": statistics.median(r["prompt"] for r in rs),
            "reuse": statistics.median(r["reused"] / r["prompt"] for r in rs),
            "reuse_of_seen": statistics.median(r["reused"] / r["seen"] for r in rs),
            "ttft_ms": ttft, "ttft_vs_cold": ttft / cold}
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--agents", type=int, default=4)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--history-tokens", type=int, default=11000,
                   help="agents_gate.history's size argument (11000: ~8k tokens)")
    p.add_argument("--result-repeat", type=int, default=16,
                   help="copies of agents_gate.SOURCE per tool result (16: ~1k tokens)")
    p.add_argument("--new-tokens", type=int, default=160)
    p.add_argument("--think-s", type=float, default=2.0)
    p.add_argument("--no-settle-passes", action="store_true")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    rows = asyncio.run(run(args))
    summary = summarize(rows)
    for turn, s in summary["follow_ups"].items():
        print(f"turn {turn}: prompt {s['prompt']:.0f}, reused {s['reuse']:.1%} of it "
              f"({s['reuse_of_seen']:.1%} of the previous prompt and reply), TTFT "
              f"{s['ttft_ms']:.0f} ms = {s['ttft_vs_cold']:.3f}x the cold turn's "
              f"{summary['cold_ttft_ms']:.0f} ms")
    if args.out is not None:
        args.out.write_text(json.dumps({"settings": {k: str(v) for k, v in vars(args).items()},
                                        "summary": summary, "turns": rows}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
