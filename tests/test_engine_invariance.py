"""The project's standing rules, checked through the real engine on the real SmolLM2.

(a) batch invariance, (b) prefix-reuse invariance, (c) determinism, (d) isolation,
(e) cancellation frees the slot and its KV budget. Every rule runs twice: plain, and
with the runner speculating the next decode step (the GPU default, runtime.runner).
"""

from __future__ import annotations

import random
import time
from typing import Any

import anyio
import pytest
from engine_harness import EngineHarness

from slotserve.engine import Completion, Engine

QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about rain.",
    "Name three colors.",
    "What is 12 times 7?",
    "Tell me a fun fact about octopuses.",
    "Translate 'good morning' into Spanish.",
    "Give me a synonym for happy.",
    "What does a CPU do?",
]
# alternate greedy and seeded sampling so both paths are checked
OPTIONS: list[dict[str, Any]] = [
    {"temperature": 0.0} if i % 2 == 0 else {"temperature": 0.9, "top_p": 0.95, "seed": 100 + i}
    for i in range(len(QUESTIONS))
]
MAX_TOKENS = 20


SOLO_BY_MODE: dict[bool, list[Completion]] = {}


@pytest.fixture(scope="module", params=[False, True], ids=["plain", "speculating"])
def harness(request: pytest.FixtureRequest) -> Any:
    h = EngineHarness(max_slots=8, max_queue=32, speculate=request.param)
    yield h
    h.close()


def chat(h: EngineHarness, i: int, **extra: Any) -> Completion:
    msgs = [{"role": "user", "content": QUESTIONS[i]}]
    return h.call(lambda: h.engine.chat_complete(msgs, max_tokens=MAX_TOKENS,
                                                 **OPTIONS[i], **extra))


@pytest.fixture(scope="module")
def solo(harness: EngineHarness) -> list[Completion]:
    """Each request alone, cold (no retained KV), one after another."""
    out = []
    for i in range(len(QUESTIONS)):
        harness.engine.drop_retained()
        out.append(chat(harness, i))
    SOLO_BY_MODE[harness.engine.batcher.runner.speculate] = out  # type: ignore[union-attr]
    return out


def test_speculation_changes_nothing(harness: EngineHarness, solo: list[Completion]) -> None:
    """Speculating runs take logits from the queued step and give the same tokens."""
    runner = harness.engine.batcher.runner  # type: ignore[union-attr]
    if not runner.speculate:
        assert runner.spec_rows == 0
        return
    assert runner.spec_rows > 0
    plain = SOLO_BY_MODE.get(False)
    if plain is not None:
        assert [c.token_ids for c in solo] == [c.token_ids for c in plain]


def test_solo_answers_are_sane(solo: list[Completion]) -> None:
    assert "Paris" in solo[0].text
    for c in solo:
        assert c.finish_reason in ("stop", "length") and c.error is None
        assert c.usage.completion_tokens == len(c.token_ids) or c.finish_reason == "stop"


def test_batch_invariance_staggered(harness: EngineHarness, solo: list[Completion]) -> None:
    """8 requests arriving at staggered times, some into slots just freed, match solo runs."""
    engine = harness.engine
    rng = random.Random(3)

    async def run_all() -> dict[int, Completion]:
        results: dict[int, Completion] = {}

        async def one(i: int, delay: float, max_tokens: int = MAX_TOKENS) -> None:
            await anyio.sleep(delay)
            msgs = [{"role": "user", "content": QUESTIONS[i]}]
            results[i] = await engine.chat_complete(msgs, max_tokens=max_tokens, **OPTIONS[i])

        async with anyio.create_task_group() as tg:
            # a short request finishes early so later arrivals land in its freed slot
            tg.start_soon(one, 3, 0.0, 3)
            for i in range(len(QUESTIONS)):
                if i != 3:
                    tg.start_soon(one, i, rng.uniform(0.0, 1.5))
        results.pop(3)
        # request 3 again, now certainly into a reused slot, beside nothing or stragglers
        results[3] = await engine.chat_complete(
            [{"role": "user", "content": QUESTIONS[3]}], max_tokens=MAX_TOKENS, **OPTIONS[3])
        return results

    engine.drop_retained()
    batched = harness.call(run_all)
    for i, c in batched.items():
        assert c.token_ids == solo[i].token_ids, f"request {i} differs in a batch"
        assert c.text == solo[i].text


def test_determinism(harness: EngineHarness) -> None:
    a = chat(harness, 1)
    b = chat(harness, 1)
    assert a.token_ids == b.token_ids and a.text == b.text


def test_prefix_reuse_invariance(harness: EngineHarness) -> None:
    engine = harness.engine
    first = [{"role": "user", "content": "My name is Ada. Remember it."}]
    engine.drop_retained()
    turn1 = harness.call(lambda: engine.chat_complete(first, max_tokens=16, temperature=0))
    second = first + [{"role": "assistant", "content": turn1.text},
                      {"role": "user", "content": "What is my name?"}]
    warm = harness.call(lambda: engine.chat_complete(second, max_tokens=16, temperature=0))
    assert warm.usage.reused_tokens > 20, "turn 2 should reuse turn 1's KV"
    engine.drop_retained()
    cold = harness.call(lambda: engine.chat_complete(second, max_tokens=16, temperature=0))
    assert cold.usage.reused_tokens == 0
    assert warm.token_ids == cold.token_ids and warm.text == cold.text
    # seeded sampling too: a seeded turn 2 that continues a seeded turn 1
    opts = {"temperature": 1.0, "seed": 7}
    engine.drop_retained()
    turn1_s = harness.call(lambda: engine.chat_complete(first, max_tokens=16, **opts))
    second_s = first + [{"role": "assistant", "content": turn1_s.text},
                        {"role": "user", "content": "What is my name?"}]
    warm_s = harness.call(lambda: engine.chat_complete(second_s, max_tokens=16, **opts))
    assert warm_s.usage.reused_tokens > 20
    engine.drop_retained()
    cold_s = harness.call(lambda: engine.chat_complete(second_s, max_tokens=16, **opts))
    assert cold_s.usage.reused_tokens == 0
    assert warm_s.token_ids == cold_s.token_ids


def test_isolation_peer_cancel_error_finish(harness: EngineHarness,
                                            solo: list[Completion]) -> None:
    """Request 0 is unchanged while peers are cancelled, crash, or finish early."""
    engine = harness.engine

    async def scenario() -> Completion:
        result: dict[str, Completion] = {}

        async def victim() -> None:
            msgs = [{"role": "user", "content": QUESTIONS[0]}]
            result["c"] = await engine.chat_complete(msgs, max_tokens=MAX_TOKENS, **OPTIONS[0])

        async def cancelled_peer() -> None:
            with anyio.move_on_after(0.6):
                async for _ in engine.chat([{"role": "user", "content": QUESTIONS[4]}],
                                           max_tokens=200):
                    pass

        async def crashing_peer() -> None:
            req = engine.make_request(engine.render_chat(
                [{"role": "user", "content": QUESTIONS[5]}]), max_tokens=50)
            session = engine.submit(req)
            session.detok.add = _boom  # type: ignore[method-assign]
            async with session.client:
                async for d in session.client:
                    if d.finish_reason:
                        result["crash"] = Completion("", d.finish_reason, d.usage, error=d.error)

        async def short_peer() -> None:
            await engine.chat_complete([{"role": "user", "content": QUESTIONS[6]}],
                                       max_tokens=2)

        async with anyio.create_task_group() as tg:
            tg.start_soon(victim)
            tg.start_soon(cancelled_peer)
            tg.start_soon(crashing_peer)
            tg.start_soon(short_peer)
        assert result["crash"].finish_reason == "error"
        return result["c"]

    engine.drop_retained()
    c = harness.call(scenario)
    assert c.token_ids == solo[0].token_ids
    _wait_idle(engine)


def _boom(token: int) -> str:
    raise RuntimeError("injected detokenizer failure")


def test_slow_client_parks_its_slot_and_keeps_its_tokens(harness: EngineHarness,
                                                         solo: list[Completion]) -> None:
    """A client that reads slowly fills its stream and its session's mailbox; its slot then
    parks (skips ticks) until the client catches up. Its tokens and its peer's are the same
    as alone."""
    engine = harness.engine
    long_msgs = [{"role": "user", "content": QUESTIONS[7] + " Explain in detail."}]
    opts = {"max_tokens": 48, "temperature": 0.0, "ignore_eos": True}
    engine.drop_retained()
    alone = harness.call(lambda: engine.chat_complete(long_msgs, **opts))

    async def scenario() -> tuple[list[int], Completion, bool]:
        state: dict[str, Any] = {"parked": False, "ids": []}

        async def slow() -> None:
            async for d in engine.chat(long_msgs, **opts):
                state["ids"] += d.token_ids
                if not state["parked"]:  # stop reading until the slot parks (any CPU speed)
                    with anyio.move_on_after(120):
                        while not any(s.waiting_for_client for s in engine.slots):
                            await anyio.sleep(0.01)
                    state["parked"] = any(s.waiting_for_client for s in engine.slots)

        async def peer() -> None:
            msgs = [{"role": "user", "content": QUESTIONS[2]}]
            state["peer"] = await engine.chat_complete(msgs, max_tokens=MAX_TOKENS,
                                                       **OPTIONS[2])

        async with anyio.create_task_group() as tg:
            tg.start_soon(slow)
            tg.start_soon(peer)
        return state["ids"], state["peer"], state["parked"]

    engine.drop_retained()
    ids, peer, parked = harness.call(scenario)
    assert parked, "the slow client's slot never parked"
    assert ids == alone.token_ids
    assert peer.token_ids == solo[2].token_ids
    _wait_idle(engine)


class _ExplodingStops(frozenset[int]):
    """Stop-token set whose membership test fails: crashes the slot on its first token."""

    def __contains__(self, item: object) -> bool:
        raise RuntimeError("injected slot failure")


def test_slot_crash_on_step_result_fails_only_its_request(harness: EngineHarness,
                                                          solo: list[Completion]) -> None:
    """A slot that crashes while taking a step result (a StepDone in its mailbox) fails its
    own request with an error; its peer is unchanged; the slot is freed."""
    engine = harness.engine

    async def scenario() -> tuple[Completion, Completion]:
        result: dict[str, Completion] = {}

        async def victim() -> None:
            msgs = [{"role": "user", "content": QUESTIONS[0]}]
            result["c"] = await engine.chat_complete(msgs, max_tokens=MAX_TOKENS, **OPTIONS[0])

        async def crashing() -> None:
            req = engine.make_request(engine.render_chat(
                [{"role": "user", "content": QUESTIONS[3]}]), max_tokens=20)
            req.stop_ids = _ExplodingStops()
            async with engine.submit(req).client as client:
                async for d in client:
                    if d.finish_reason:
                        result["crash"] = Completion("", d.finish_reason, d.usage, error=d.error)

        async with anyio.create_task_group() as tg:
            tg.start_soon(victim)
            tg.start_soon(crashing)
        return result["c"], result["crash"]

    engine.drop_retained()
    c, crash = harness.call(scenario)
    assert crash.finish_reason == "error" and "injected slot failure" in (crash.error or "")
    assert c.token_ids == solo[0].token_ids
    _wait_idle(engine)


def _wait_idle(engine: Engine, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not any(s.busy for s in engine.slots) and engine.kv_summary()["busy"] == 0:
            return
        time.sleep(0.02)
    raise AssertionError(f"slots still busy: {engine.slot_states()}")


def test_cancel_mid_stream_frees_slot_and_budget(harness: EngineHarness) -> None:
    engine = harness.engine

    async def scenario() -> tuple[int, int]:
        seen = 0
        async for d in engine.chat([{"role": "user", "content": QUESTIONS[4]}],
                                   max_tokens=300):
            seen += len(d.token_ids)
            if seen >= 3:
                break  # leaving the loop cancels the request
        busy_before = engine.kv_summary()["busy"]
        assert engine.batcher is not None
        steps = engine.batcher.stats.steps
        while any(s.busy for s in engine.slots):
            await anyio.sleep(0.005)
        # freed once the step in flight (and one more planned) answered, not at max_tokens
        return busy_before, engine.batcher.stats.steps - steps

    _busy_before, steps_after = harness.call(scenario)
    assert steps_after <= 2
    assert engine.kv_summary()["busy"] == 0
    assert engine.kv_summary()["running"] == 0


def test_context_overflow_rejected_at_once(harness: EngineHarness) -> None:
    from slotserve.actors.admission import ContextOverflowError

    engine = harness.engine
    req = engine.make_request([1] * 100, max_tokens=engine.context_length)

    async def submit() -> None:
        engine.submit(req)

    with pytest.raises(ContextOverflowError, match=str(engine.context_length)):
        harness.call(submit)
    assert engine.kv_summary()["running"] == 0
