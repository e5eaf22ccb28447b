"""TTFT of a new chat whose long system prompt another conversation already holds.

Three chats with the same system prompt (an agent's instructions) and different first user
messages, one after another on an engine with two slots: the first prefills the whole
prompt; the next ones start from the first one's full KV pages (shared, see
docs/architecture.md, "Shared prefix pages"). The same prompts cold (retained KV dropped
before each) for comparison. Any checkpoint; default the bundled SmolLM2:

    .venv/bin/python bench/shared_prefix.py --system-tokens 2000

With --agents N: N agents' two turns under a KV budget of a few conversations, retained KV
counted per holder of a page and by distinct pages, side by side.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

import anyio

from slotserve.engine import Engine

TASKS = ["Rename the helper in utils.py.", "Why does the build fail on Windows?",
         "Add a test for the parser.", "Explain the retry logic in the client."]


async def measure(model: str | None, system_tokens: int, rounds: int) -> dict[str, Any]:
    async with Engine.load(model, max_slots=2, max_queue=8) as engine:
        unit = "You are a careful coding agent; read before you edit and test after. "
        per = len(engine.tokenizer.encode(unit, add_special=False))
        system = unit * max(1, system_tokens // per)

        def chat(task: str) -> list[dict[str, str]]:
            return [{"role": "system", "content": system}, {"role": "user", "content": task}]

        async def ttft(task: str) -> tuple[float, int]:
            t0 = time.perf_counter()
            c = await engine.chat_complete(chat(task), max_tokens=1, temperature=0)
            return time.perf_counter() - t0, c.usage.reused_tokens

        prompt = len(engine.render_chat(chat(TASKS[0])))
        await ttft(TASKS[0])  # warm-up
        cold, warm, reused = [], [], []
        for _ in range(rounds):
            for task in TASKS[1:]:
                engine.drop_retained()
                cold.append((await ttft(task))[0])
            engine.drop_retained()
            await ttft(TASKS[0])  # holds the system prompt
            for task in TASKS[1:]:
                t, r = await ttft(task)
                warm.append(t)
                reused.append(r)
        return {"prompt_tokens": prompt, "reused_tokens": statistics.median(reused),
                "ttft_cold_ms": round(statistics.median(cold) * 1000, 1),
                "ttft_shared_ms": round(statistics.median(warm) * 1000, 1),
                "speedup": round(statistics.median(cold) / statistics.median(warm), 2)}


async def agents(model: str | None, system_tokens: int, n_agents: int, copies: float,
                 per_holder: bool) -> dict[str, Any]:
    """n_agents conversations with one system prompt on two slots, under a KV budget that
    holds `copies` whole conversations: every agent's first turn, then every agent's second
    turn. How much of each second turn's prompt is reused shows what the budget kept.
    per_holder: count retained KV once per holder of a page (the accounting before
    distinct pages), for the side-by-side."""
    async with Engine.load(model, max_slots=2, max_queue=8, max_parked=n_agents) as engine:
        adm = engine.admission
        assert adm is not None
        if per_holder:
            def retained_per_holder(exclude: Any = None) -> int:
                held = sum(s.kv.nbytes for s in adm.slots if not s.busy and s is not exclude)
                return held + sum(p.kv.nbytes for p in adm.parked)
            adm.retained_bytes = retained_per_holder  # type: ignore[method-assign]
        unit = "You are a careful coding agent; read before you edit and test after. "
        per = len(engine.tokenizer.encode(unit, add_special=False))
        system = unit * max(1, system_tokens // per)
        tasks = [f"Task {i}: {TASKS[i % len(TASKS)]}" for i in range(n_agents)]
        first = [[{"role": "system", "content": system}, {"role": "user", "content": t}]
                 for t in tasks]
        conversation = len(engine.render_chat(first[0])) + 64
        adm.kv_budget = int(copies * conversation * adm.bytes_per_token)
        replies = [await engine.chat_complete(m, max_tokens=16, temperature=0) for m in first]
        shares, ttfts = [], []
        for m, r in zip(first, replies, strict=True):
            turn = [*m, {"role": "assistant", "content": r.text},
                    {"role": "user", "content": "Now run the tests."}]
            t0 = time.perf_counter()
            c = await engine.chat_complete(turn, max_tokens=1, temperature=0)
            ttfts.append(time.perf_counter() - t0)
            shares.append(c.usage.reused_tokens / len(engine.render_chat(turn)))
        return {"agents": n_agents, "budget_conversations": copies,
                "accounting": "per holder" if per_holder else "distinct pages",
                "second_turn_reused_share": round(statistics.mean(shares), 3),
                "second_turn_ttft_ms": round(statistics.median(ttfts) * 1000, 1),
                "parked_after": len(adm.parked)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None)
    p.add_argument("--system-tokens", type=int, default=2000)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--agents", type=int, default=0,
                   help="instead: this many agents' two turns under a tight KV budget")
    p.add_argument("--budget-conversations", type=float, default=3.0)
    args = p.parse_args()
    if args.agents:
        for per_holder in (True, False):
            print(json.dumps(anyio.run(agents, args.model, args.system_tokens, args.agents,
                                       args.budget_conversations, per_holder)))
    else:
        print(json.dumps(anyio.run(measure, args.model, args.system_tokens, args.rounds)))


if __name__ == "__main__":
    main()
