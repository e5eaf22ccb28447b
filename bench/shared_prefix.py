"""TTFT of a new chat whose long system prompt another conversation already holds.

Three chats with the same system prompt (an agent's instructions) and different first user
messages, one after another on an engine with two slots: the first prefills the whole
prompt; the next ones start from the first one's full KV pages (shared, see
docs/architecture.md, "Shared prefix pages"). The same prompts cold (retained KV dropped
before each) for comparison. Any checkpoint; default the bundled SmolLM2:

    .venv/bin/python bench/shared_prefix.py --system-tokens 2000
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


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None)
    p.add_argument("--system-tokens", type=int, default=2000)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    print(json.dumps(anyio.run(measure, args.model, args.system_tokens, args.rounds)))


if __name__ == "__main__":
    main()
