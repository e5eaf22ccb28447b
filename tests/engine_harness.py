"""Run an Engine on a background event loop so plain (sync) tests can share one."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

import anyio

from slotserve.actors.messages import Delta
from slotserve.engine import Engine

T = TypeVar("T")

# distinct prompts of very different lengths, shared by the engine tests on tiny models
PROMPTS = [
    "Count from one to twenty, please, slowly and carefully.",
    "Hello there",
    "Write a long sentence about rivers, mountains, oceans and skies.",
    "x",
    "The quick brown fox jumps over the lazy dog again and again.",
    "What is the answer?",
    "List the planets of the solar system in order from the sun outwards.",
    "Why?",
]


def alternating_options(i: int) -> dict[str, Any]:
    """Request i's options: seeded sampling for odd i, greedy for even i; 24 tokens, no EOS."""
    if i % 2:
        return {"temperature": 0.8, "seed": i, "max_tokens": 24, "ignore_eos": True}
    return {"temperature": 0.0, "max_tokens": 24, "ignore_eos": True}


class EngineHarness:
    def __init__(self, model: Any = None, **config: Any) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.engine = Engine.load(model, **config)
        self.call(self.engine.__aenter__)

    def call(self, fn: Callable[[], Awaitable[T]], timeout: float = 600) -> T:
        async def wrapper() -> T:
            return await fn()

        return asyncio.run_coroutine_threadsafe(wrapper(), self.loop).result(timeout)

    def close(self) -> None:
        self.call(lambda: self.engine.__aexit__(None, None, None))
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)


async def signal_first(stream: AsyncIterator[Delta], event: anyio.Event) -> AsyncIterator[Delta]:
    """The stream as it is, setting `event` once its first token is out (prefill done)."""
    async for delta in stream:
        if delta.token_ids:
            event.set()
        yield delta


def wait_until(pred: Callable[[], object], timeout: float, step: float = 0.02) -> bool:
    """Poll `pred` until it holds or `timeout` seconds pass; its last answer."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(step)
    return bool(pred())


Options = Callable[[int], dict[str, Any]]


def alone(h: EngineHarness, ids: Callable[[int], list[int]], n: int,
          options: Options = alternating_options) -> list[Any]:
    """Completions of prompts ids(0..n-1), each alone and cold (nothing retained before
    it), with options(i): what the batch-invariance tests compare against."""
    out = []
    for i in range(n):
        h.engine.drop_retained()
        out.append(h.call(lambda i=i: h.engine.complete(ids(i), **options(i))))
    return out


def together(h: EngineHarness, ids: Callable[[int], list[int]], n: int,
             delay: Callable[[int], float], requests: int | None = None,
             options: Options = alternating_options) -> dict[int, Any]:
    """Completions of `requests` (default n) requests submitted at once from a cold cache,
    request i being prompt i % n with options(i % n), started delay(i) seconds
    in: they share steps, queue for slots and join running batches."""
    engine = h.engine

    async def run() -> dict[int, Any]:
        out: dict[int, Any] = {}

        async def one(i: int) -> None:
            await anyio.sleep(delay(i))
            out[i] = await engine.complete(ids(i % n), **options(i % n))

        async with anyio.create_task_group() as tg:
            for i in range(n if requests is None else requests):
                tg.start_soon(one, i)
        return out

    engine.drop_retained()
    return h.call(run)


def preempted_like_alone(h: EngineHarness, run: Callable[[int], Awaitable[Any]],
                         alone: list[Any]) -> list[Any]:
    """Runs run(i) for each request, 10 ms apart (request 0 oldest), under a budget the
    caller made too small for all of them: some request must be preempted, and each still
    finishes at its length with the tokens it got alone. Returns the completions."""
    async def staggered() -> list[Any]:
        out: list[Any] = [None] * len(alone)

        async def one(i: int) -> None:
            out[i] = await run(i)

        async with anyio.create_task_group() as tg:
            for i in range(len(alone)):
                tg.start_soon(one, i)
                await anyio.sleep(0.01)  # arrival order: 0 oldest
        return out

    both = h.call(staggered)
    assert sum(h.engine.admission.preemptions.values()) > 0
    for i, (a, b) in enumerate(zip(alone, both, strict=True)):
        assert b.finish_reason == "length", (i, b.error)
        assert b.token_ids == a.token_ids, f"request {i} changed under preemption"
    return both
