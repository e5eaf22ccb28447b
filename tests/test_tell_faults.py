"""No message that cannot be told wedges a request, stops the Batcher or stops a shutdown.

A real engine (bundled SmolLM2, two slots): one request, salted POISON, runs beside another;
one tell that concerns it is made to raise as a full mailbox does. Then:

- its client left (stream closed) and its session's Cancel raises: the session still closes
  and the slot cancels the request at once, not at its max_tokens;
- its stop string matched and the Cancel raises: the client gets the stop, the slot stops;
- it was cancelled and the slot's Withdraw to the Batcher raises: the offer is answered by
  the step that takes it, the slot releases its pages once, nothing crashes;
- it was cancelled while its offer stood (the Batcher held in a step) and the Batcher's
  Withdrawn raises: the offer stands again, a step answers it and the slot is freed;
- its client read late and the session's Resume raises: the client hears why, the slot is
  freed;
- every step result the Batcher tells it raises, or every offer and answer its slot tells
  the Batcher: each is taken at once, and the request gives its alone tokens;
- the engine shuts down and one slot's Cancel raises: every request still gets its final
  answer and the shutdown completes.

Each time the other request gives the tokens it gives alone and the KV accounting is back to
idle. (A Withdraw raised while a preempted request steps back: tests/test_running_faults.py.)
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Iterator
from types import UnionType
from typing import Any

import anyio
import pytest
from engine_harness import EngineHarness, wait_until
from structlog.testing import capture_logs

from slotserve.actors.base import MailboxFullError
from slotserve.actors.batcher import Batcher
from slotserve.actors.messages import (
    Cancel,
    Delta,
    GenerationRequest,
    NoWork,
    Ready,
    Resume,
    StepDone,
    Withdraw,
    Withdrawn,
)
from slotserve.actors.session import Session
from slotserve.actors.slot import Slot
from slotserve.engine import Completion, Engine

POISON = "poison"  # the cache_salt of the one request a fault is injected for
OTHER = [{"role": "user", "content": "Write a short sentence about rivers and mountains."}]
MINE = [{"role": "user", "content": "Describe a small village market on a Saturday morning."}]
ALONE_TOKENS = 48
LONG = 400  # the poisoned request's max_tokens: never reached when it is ended as it should
CRASHED = "actor crashed on message"


def poisoned(slot: Slot) -> bool:
    req = slot.request
    return req is not None and req.cache_namespace == ("", POISON)


def to_poisoned(slot: Slot, _msg: Any) -> bool:
    return poisoned(slot)


def raising(kind: type | UnionType, when: Callable[[Any, Any], bool] = to_poisoned,
            actor: type = Slot) -> tuple[Callable[..., None], list[Any]]:
    """`actor`.tell (a Slot's by default), raising as a full mailbox does for a `kind`
    message that `when(actor, message)` holds for; and the list of the messages it refused."""
    tell = actor.tell
    refused: list[Any] = []

    def failing(self: Any, msg: Any) -> None:
        if isinstance(msg, kind) and when(self, msg):
            refused.append(msg)
            raise MailboxFullError(f"{self.name}: mailbox full (injected)")
        tell(self, msg)

    return failing, refused


@pytest.fixture(scope="module")
def harness() -> Iterator[EngineHarness]:
    h = EngineHarness(max_slots=2, max_queue=4)
    yield h
    h.close()


def opts(**extra: Any) -> dict[str, Any]:
    return {"max_tokens": ALONE_TOKENS, "ignore_eos": True, "temperature": 0, **extra}


@pytest.fixture(scope="module")
def alone(harness: EngineHarness) -> dict[str, Completion]:
    engine = harness.engine
    out = {}
    for name, messages in (("other", OTHER), ("mine", MINE)):
        engine.drop_retained()
        out[name] = harness.call(lambda m=messages: engine.chat_complete(m, **opts()))
        assert out[name].finish_reason == "length"
    return out


@pytest.fixture
def finishes(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, int]]:
    """(reason, tokens generated) of every finish of the poisoned request on its slot."""
    seen: list[tuple[str, int]] = []
    finish = Slot._finish

    def recording(self: Slot, reason: str, error: str | None = None) -> None:
        if poisoned(self):
            seen.append((reason, self.generated))
        finish(self, reason, error)

    monkeypatch.setattr(Slot, "_finish", recording)
    return seen


def kv_idle(engine: Engine) -> bool:
    adm = engine.admission
    assert adm is not None
    return (not adm.queue and not adm.promised and not adm.places and adm.preempting is None
            and not adm.growth_waiters
            and all(not s.busy and not s.in_flight and not s.kv.pages for s in adm.slots)
            and adm.cache.held == 0 and adm.committed_pages == 0)


def mine(engine: Engine, **extra: Any) -> GenerationRequest:
    return engine.make_request(engine.render_chat(MINE), cache_salt=POISON,
                               **opts(max_tokens=LONG, **extra))


async def tokens(session: Session, n: int) -> list[Delta]:
    """The first deltas of a session's stream, up to n tokens."""
    out: list[Delta] = []
    while sum(len(d.token_ids) for d in out) < n:
        out.append(await session.client.__anext__())
    return out


def tokens_of(deltas: list[Delta]) -> list[int]:
    return [t for d in deltas for t in d.token_ids]


def beside_other(h: EngineHarness, body: Callable[[Engine], Any]) -> tuple[Completion, Any]:
    """The other request, and `body` (the poisoned request's side) at once, within a bound
    (a wedged request fails the test here instead of hanging it)."""
    engine = h.engine
    engine.drop_retained()

    async def run() -> tuple[Completion, Any]:
        with anyio.fail_after(60):
            other = asyncio.ensure_future(engine.chat_complete(OTHER, **opts()))
            await asyncio.sleep(0)  # (the other is placed first)
            mine = asyncio.ensure_future(body(engine))
            return await other, await mine

    return h.call(run)


def other_alone_and_idle(h: EngineHarness, other: Completion,
                         alone: dict[str, Completion]) -> None:
    assert other.finish_reason == "length" and other.token_ids == alone["other"].token_ids
    assert wait_until(lambda: kv_idle(h.engine), 30), h.engine.kv_summary()
    assert h.engine.failure is None and h.engine.ready


# ---- the session's Cancel --------------------------------------------------------------------


def test_a_client_gone_whose_cancel_raises_still_closes_and_frees_the_slot(
        harness: EngineHarness, alone: dict[str, Completion], finishes: list[tuple[str, int]],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The client reads three tokens and closes its stream; the session's Cancel raises. The
    session closes all the same (the engine forgets it) and the slot cancels the request
    at once, instead of decoding for nobody to its max_tokens."""
    failing, refused = raising(Cancel)
    monkeypatch.setattr(Slot, "tell", failing)

    async def leave(engine: Engine) -> tuple[str, list[Delta]]:
        session = engine.submit(mine(engine))
        got = await tokens(session, 3)
        await session.client.aclose()  # gone (no engine.cancel: its next token finds out)
        while session.request.request_id in engine.sessions:
            await asyncio.sleep(0.01)
        return session.request.request_id, got

    with capture_logs() as logs:
        other, (_, got) = beside_other(harness, leave)
    assert len(refused) == 1 and refused[0].reason == "cancelled"
    assert tokens_of(got) == alone["mine"].token_ids[: len(tokens_of(got))]
    assert [r for r, _ in finishes] == ["cancelled"] and finishes[0][1] < LONG
    assert not [e for e in logs if e["event"] == CRASHED]
    other_alone_and_idle(harness, other, alone)


def test_a_stop_string_whose_cancel_raises_still_stops(
        harness: EngineHarness, alone: dict[str, Completion], finishes: list[tuple[str, int]],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A stop string taken from the alone text matches; the session's Cancel raises. The
    client gets the text up to the stop and finish_reason stop (not an internal error), and
    the slot stops there (not at its max_tokens)."""
    text = alone["mine"].text
    stop = text[24:32]
    cut = text.find(stop)
    assert stop.strip() and 0 < cut <= 24
    failing, refused = raising(Cancel)
    monkeypatch.setattr(Slot, "tell", failing)

    async def stopped(engine: Engine) -> Completion:
        return await engine.collect(engine.generate(mine(engine, stop=[stop])))

    with capture_logs() as logs:
        other, done = beside_other(harness, stopped)
    assert [m.reason for m in refused] == ["stop"]
    assert done.finish_reason == "stop" and done.error is None, done
    assert done.text == text[:cut]
    assert done.token_ids == alone["mine"].token_ids[: len(done.token_ids)]
    assert [r for r, _ in finishes] == ["stop"] and finishes[0][1] < LONG
    assert not [e for e in logs if e["event"] == CRASHED]
    other_alone_and_idle(harness, other, alone)


# ---- Withdraw and Withdrawn ---------------------------------------------------------------------


def test_a_withdraw_that_raises_leaves_the_offer_to_its_step(
        harness: EngineHarness, alone: dict[str, Completion], finishes: list[tuple[str, int]],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The client leaves after three tokens (its slot's offer is out); the slot's Withdraw
    to the Batcher raises. The request still finishes once, cancelled, the slot does not
    crash (nor decode on for a finished session), and its pages go back when the step that
    took the offer answers."""
    engine = harness.engine
    failing, refused = raising(Withdraw, lambda _, msg: poisoned(engine.slots[msg.slot_id]),
                               actor=Batcher)
    monkeypatch.setattr(Batcher, "tell", failing)

    async def leave(engine: Engine) -> list[Delta]:
        got: list[Delta] = []
        async with contextlib.aclosing(engine.generate(mine(engine))) as stream:
            async for delta in stream:
                got.append(delta)
                if len(tokens_of(got)) >= 3:
                    break
        return got

    with capture_logs() as logs:
        other, got = beside_other(harness, leave)
    assert len(refused) == 1
    assert tokens_of(got) == alone["mine"].token_ids[: len(tokens_of(got))]
    assert [r for r, _ in finishes] == ["cancelled"] and finishes[0][1] < LONG
    assert not [e for e in logs if e["event"] == CRASHED]
    other_alone_and_idle(harness, other, alone)


def test_a_withdrawn_that_raises_leaves_the_offer_standing(
        harness: EngineHarness, alone: dict[str, Completion], finishes: list[tuple[str, int]],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The Batcher is held inside the other request's first step while the poisoned request
    offers its prompt; it is cancelled then, so its Withdraw finds the offer standing, and
    the Withdrawn the Batcher tells raises. The offer stands again: once the Batcher goes
    on, a step takes it and answers, and the slot is freed (dropped, the offer would leave
    the slot in flight, holding its pages, for ever)."""
    failing, refused = raising(Withdrawn, when=lambda _, __: True)
    monkeypatch.setattr(Slot, "tell", failing)
    step = Batcher._step
    gate, held = asyncio.Event(), asyncio.Event()

    async def gated(self: Batcher, planned: Any) -> None:
        if not gate.is_set():
            held.set()
            await gate.wait()
        await step(self, planned)

    monkeypatch.setattr(Batcher, "_step", gated)

    async def cancel_while_offered(engine: Engine) -> list[Delta]:
        await held.wait()  # (the other request's first step)
        session = engine.submit(mine(engine))
        slot = session.slot
        assert isinstance(slot, Slot)
        assert engine.batcher is not None
        while slot.id not in engine.batcher.offers:
            await asyncio.sleep(0.005)
        engine.cancel(session)
        while not refused:
            await asyncio.sleep(0.005)
        gate.set()
        return [d async for d in session.client]

    with capture_logs() as logs:
        other, got = beside_other(harness, cancel_while_offered)
    assert len(refused) == 1 and got[-1].finish_reason == "cancelled" and not tokens_of(got)
    assert finishes == [("cancelled", 0)]
    assert not [e for e in logs if e["event"] == CRASHED]
    other_alone_and_idle(harness, other, alone)


# ---- the session's Resume --------------------------------------------------------------------


def test_a_resume_that_raises_fails_the_request_and_frees_the_slot(
        harness: EngineHarness, alone: dict[str, Completion], finishes: list[tuple[str, int]],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The client reads nothing until its slot has parked (its session's mailbox is full),
    then reads; the session's Resume to the slot raises. The client reads what it was sent,
    then why the request failed, and the slot is freed (it would wait for the Resume for
    ever, and the client for the rest of its answer)."""
    failing, refused = raising(Resume)
    monkeypatch.setattr(Slot, "tell", failing)

    async def read_late(engine: Engine) -> list[Delta]:
        session = engine.submit(mine(engine))
        slot = session.slot
        assert isinstance(slot, Slot)
        while not slot.waiting_for_client:
            await asyncio.sleep(0.005)
        return [d async for d in session.client]

    with capture_logs() as logs:
        other, got = beside_other(harness, read_late)
    assert len(refused) == 1
    final = got[-1]
    assert final.finish_reason == "error", got
    assert "internal error resuming the request: MailboxFullError" in (final.error or "")
    sent = tokens_of(got)
    assert sent and sent == alone["mine"].token_ids[: len(sent)]
    assert final.usage is not None and final.usage.completion_tokens == len(sent)
    assert [r for r, _ in finishes] == ["cancelled"] and finishes[0][1] < LONG
    assert not [e for e in logs if e["event"] == CRASHED]
    other_alone_and_idle(harness, other, alone)


# ---- a step's result and the slot's answer to the Batcher -------------------------------------


def whole(engine: Engine) -> Any:
    """The poisoned request to its full ALONE_TOKENS, collected."""
    return engine.collect(engine.generate(engine.make_request(
        engine.render_chat(MINE), cache_salt=POISON, **opts())))


def served_as_alone(h: EngineHarness, alone: dict[str, Completion],
                    finishes: list[tuple[str, int]]) -> None:
    """The poisoned request in full beside the other: both give their alone tokens, it
    finishes once as asked, nothing crashes and the KV accounting is back to idle."""
    with capture_logs() as logs:
        other, done = beside_other(h, whole)
    assert done.finish_reason == "length" and done.token_ids == alone["mine"].token_ids
    assert [r for r, _ in finishes] == ["length"]
    assert not [e for e in logs if e["event"] == CRASHED]
    other_alone_and_idle(h, other, alone)


def test_step_results_that_raise_are_taken_at_once(
        harness: EngineHarness, alone: dict[str, Completion], finishes: list[tuple[str, int]],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Every StepDone the Batcher tells the poisoned slot raises. The slot takes each at
    once instead (it would otherwise never offer again, its request never finish): the
    request gives its alone tokens and finishes as asked, the other is undisturbed."""
    failing, refused = raising(StepDone)
    monkeypatch.setattr(Slot, "tell", failing)
    served_as_alone(harness, alone, finishes)
    assert len(refused) >= ALONE_TOKENS


def test_offers_and_answers_that_raise_are_taken_at_once(
        harness: EngineHarness, alone: dict[str, Completion], finishes: list[tuple[str, int]],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Every Ready and NoWork the poisoned slot tells the Batcher raises. The Batcher takes
    each at once instead (it waits for an answer from every slot it served, so one lost
    would stop every request): both requests give their alone tokens."""
    engine = harness.engine
    failing, refused = raising(Ready | NoWork,
                               lambda _, msg: poisoned(engine.slots[msg.slot_id]),
                               actor=Batcher)
    monkeypatch.setattr(Batcher, "tell", failing)
    served_as_alone(harness, alone, finishes)
    assert sum(isinstance(m, Ready) for m in refused) >= ALONE_TOKENS


# ---- shutdown --------------------------------------------------------------------------------


def test_a_shutdown_cancel_that_raises_stops_nothing_else(
        alone: dict[str, Completion], monkeypatch: pytest.MonkeyPatch) -> None:
    """An engine of its own shuts down with both requests running; the Cancel to slot 0
    raises. Both requests still end with the shutdown's error (slot 0's cancelled at once),
    their tokens are their alone tokens so far, and the shutdown completes."""
    h = EngineHarness(max_slots=2, max_queue=4)
    engine = h.engine
    try:
        failing, refused = raising(Cancel, when=lambda s, _: s.id == 0)

        async def shut_down() -> list[Completion]:
            with anyio.fail_after(60):
                sessions = [engine.submit(engine.make_request(
                    engine.render_chat(m), **opts(max_tokens=LONG))) for m in (OTHER, MINE)]
                assert sorted(s.slot.id for s in sessions) == [0, 1]  # type: ignore[union-attr]
                firsts = [await tokens(s, 2) for s in sessions]
                monkeypatch.setattr(Slot, "tell", failing)
                await engine.shutdown(deadline=0)
                rest = [[d async for d in s.client] for s in sessions]
                return [await Engine.collect(_replay(f + r))
                        for f, r in zip(firsts, rest, strict=True)]

        with capture_logs() as logs:
            done = h.call(shut_down)
        assert [m.reason for m in refused] == ["shutdown"]
        for name, c in zip(("other", "mine"), done, strict=True):
            assert c.finish_reason == "error" and c.error == "server shutting down", c
            want = alone[name].token_ids
            n = min(len(c.token_ids), len(want))
            assert c.token_ids[:n] == want[:n]
        assert all(s.request is None for s in engine.slots)
        assert not engine.sessions and engine._tg is None
        assert not [e for e in logs if e["event"] == CRASHED]
    finally:
        h.close()


async def _replay(deltas: list[Delta]) -> Any:
    for d in deltas:
        yield d
