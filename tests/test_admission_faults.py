"""Placing a waiting request is all or nothing: when a step of it raises (a cache lookup, the
page accounting, a copy, the slot's Assign), what was reserved for it goes back, that
request alone fails with a server error, and the queue moves on.

- Admission over a real page pool and prefix cache: whatever step raises, the cache, the
  budget and the slot are exactly as before the attempt (a tail taken over is a tail again,
  a copy's source is let go), the request's `fail` hears why, the error is logged, and the
  same request placed again finds what it found before. Queued requests behind it are
  placed in the same pump; a settle pass that fails is dropped.
- The engine (bundled SmolLM2, one slot): a request whose placement raises, queued between
  two others, fails promptly while both others give the tokens they give alone; the KV
  accounting is back to idle and the engine serves on.
- Over HTTP: a 500 error body of the API's style (OpenAI, streamed OpenAI, Anthropic), and
  the server keeps serving.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Iterator
from typing import Any

import anyio
import httpx
import mlx.core as mx
import pytest
from engine_harness import EngineHarness, wait_until
from structlog.testing import capture_logs

from slotserve.actors.admission import Admission
from slotserve.actors.base import MailboxFullError
from slotserve.actors.kv_cache import Chain, KVCache
from slotserve.actors.messages import Assign, GenerationRequest, Progress
from slotserve.actors.settle import Settles
from slotserve.actors.slot import Slot
from slotserve.api.app import create_app
from slotserve.api.server import BackgroundServer
from slotserve.engine import Completion, EngineConfig
from slotserve.kernels.attention import BLOCK
from slotserve.model.kv import KVPool, SlotKV
from slotserve.runtime.sampling import RowState, SamplingParams

NS = ("", "")
POISON = "poison"  # the cache_salt of the one request whose placement raises
FAILED_EVENT = "placing a request failed: it fails alone"


def injected(*_: Any, **__: Any) -> Any:
    raise RuntimeError("injected placement fault")


# ---- Admission over a real pool ------------------------------------------------------------


class Nowhere:
    """The Batcher's address for slots that are placed but never step here."""

    def tell(self, msg: object) -> None:
        raise AssertionError(f"nothing steps in these tests: {msg!r}")

    def room(self) -> int:
        return 1


class Client:
    """A request's side of admission: where it was placed, or why it failed. `raises`: its
    slot's Assign raises (after the slot was reserved, as the engine's place does)."""

    def __init__(self, raises: bool = False) -> None:
        self.raises = raises
        self.placed: list[tuple[Slot, int]] = []
        self.errors: list[str] = []

    def place(self, slot: Slot, reused: int, progress: Progress | None) -> None:
        slot.reserve()
        if self.raises:
            raise MailboxFullError(f"{slot.name}: mailbox full (injected)")
        self.placed.append((slot, reused))

    def fail(self, error: str) -> None:
        self.errors.append(error)


def admission(slots: int = 1) -> Admission:
    pool = KVPool(num_layers=1, num_kv_heads=1, head_dim=8, dtype=mx.float32)
    adm = Admission([Slot(i, SlotKV(pool), Nowhere()) for i in range(slots)], KVCache(pool),
                    max_queue=4, kv_budget=64 * pool.page_bytes, context_length=4096)
    for s in adm.slots:
        s.placement = adm
        s.kv.managed = True
    return adm


def request(name: str, tokens: list[int], **extra: Any) -> GenerationRequest:
    return GenerationRequest(request_id=name, prompt_ids=tokens, max_tokens=8,
                             params=SamplingParams(temperature=0.0), **extra)


def finish(adm: Admission, slot: Slot, ledger: list[int]) -> None:
    """The slot's request ended with `ledger` written (what Slot._finish does)."""
    chain, slot.chain = slot.chain, Chain(None)
    slot.busy = False
    adm.release(slot, ledger, chain)


def state(adm: Admission) -> dict[str, Any]:
    """Everything a placement reserves or changes: pages and their holders, what the cache
    can find, the budget's commitments, and the slots. (A page id handed out for the first
    time and freed again is just free.)"""
    c = adm.cache
    return {
        "holders": {p: n for p, n in enumerate(c.pool.refs) if n},
        "resident": c.resident, "idle": set(c.idle),
        "pages": dict(c.pages), "key_of": dict(c.key_of),
        "full": {k: dict(v) for k, v in c.full.under.items()},
        "tails": {k: dict(v) for k, v in c.tails.under.items()},
        "committed": adm.committed_pages, "promised": dict(adm.promised),
        "places": dict(adm.places), "queue": len(adm.queue),
        "slots": [(s.busy, s.kv.pages, s.chain.namespace) for s in adm.slots],
    }


A = list(range(2 * BLOCK + 40))  # two full pages and a tail of 40
SHAPES = {
    "tail": [*A, 999, 998],  # continues A: takes A's tail over
    "copy": [*A[: BLOCK + 30], -5, -6, -7],  # parts ways inside A's second page: copies it
}


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("step", ["lookup", "allocate", "copy_into", "assign"])
def test_a_placement_that_raises_leaves_everything_as_it_was(
        shape: str, step: str, monkeypatch: pytest.MonkeyPatch) -> None:
    adm = admission()
    first = Client()
    assert adm.submit(request("a", A), first.place, first.fail)
    finish(adm, first.placed[0][0], A)  # A's pages stay: two full ones and its tail
    tokens = SHAPES[shape]
    found = adm.cache.lookup(tokens, NS)
    assert (found.tail is not None) == (shape == "tail")
    assert (found.copy is not None) == (shape == "copy")
    before = state(adm)

    client = Client(raises=step == "assign")
    if step != "assign":
        monkeypatch.setattr(adm.cache, step, injected)
    with capture_logs() as logs:
        assert adm.submit(request("q", tokens), client.place, client.fail)
    assert not client.placed and len(client.errors) == 1
    assert client.errors[0].startswith("internal error placing the request: ")
    assert "injected" in client.errors[0]
    failed = [e for e in logs if e["event"] == FAILED_EVENT]
    assert len(failed) == 1 and failed[0]["request_id"] == "q"
    assert failed[0]["log_level"] == "error" and failed[0]["exc_info"] is True
    assert state(adm) == before  # nothing held, promised or lost; the slot free

    monkeypatch.undo()  # the same request again: it finds what it found before
    again = Client()
    assert adm.submit(request("q", tokens), again.place, again.fail)
    slot, reused = again.placed[0]
    assert not again.errors and reused == found.tokens
    finish(adm, slot, tokens[:reused])
    assert adm.committed_pages == 0 and adm.cache.held == 0


def test_the_queue_moves_on_past_a_request_that_fails_to_place() -> None:
    """One slot: x runs, q (whose Assign raises) and r wait; when x finishes, the pump that
    fails q places r."""
    adm = admission()
    x, q, r = Client(), Client(raises=True), Client()
    assert adm.submit(request("x", list(range(300))), x.place, x.fail)
    assert not adm.submit(request("q", list(range(500, 800))), q.place, q.fail)
    assert not adm.submit(request("r", list(range(900, 1000))), r.place, r.fail)
    with capture_logs() as logs:
        finish(adm, x.placed[0][0], list(range(300)))
    assert len(q.errors) == 1 and not q.placed
    assert [e["request_id"] for e in logs if e["event"] == FAILED_EVENT] == ["q"]
    assert len(r.placed) == 1 and not r.errors and not adm.queue
    slot, reused = r.placed[0]
    assert reused == 0 and list(adm.places) == [slot.id]
    finish(adm, slot, list(range(900, 1000)))
    assert adm.committed_pages == 0 and adm.cache.held == 0 and not adm.promised


def test_a_preempted_request_that_fails_to_resume_fails_through_its_own_fail() -> None:
    """A preempted request goes back to the queue with how it fails: when placing its resume
    raises, its client hears it (it is not left waiting to resume for ever)."""
    adm = admission()
    x = Client()
    req = request("x", list(range(300)))
    assert adm.submit(req, x.place, x.fail)
    slot = x.placed[0][0]
    ledger = [*range(300), 7, 8]  # two tokens generated when it stepped back
    progress = Progress(ledger, 2, RowState(req.params, req.prompt_ids), None, 0)
    x.raises = True  # the Assign of its resume raises
    chain, slot.chain = slot.chain, Chain(None)
    slot.busy = False
    adm.suspend(slot, req, progress, ledger, chain)  # requeued, and placed again at once
    assert adm.preemptions["budget"] == 1
    assert len(x.errors) == 1 and "injected" in x.errors[0] and not adm.queue
    assert not slot.busy and adm.committed_pages == 0 and adm.cache.held == 0


def test_a_settle_pass_that_fails_to_place_is_dropped() -> None:
    """Settle passes (models with a recurrent state; queued here directly): the one whose
    Assign raises is dropped and logged, what it reserved goes back, the next is placed."""
    adm = admission(slots=3)
    adm.settles = Settles(BLOCK)
    told: list[tuple[int, str]] = []

    def tell(slot: Slot) -> Callable[[Any], None]:
        def record(msg: Any) -> None:
            assert isinstance(msg, Assign), msg
            if msg.request.request_id == "settle-bad":
                raise MailboxFullError(f"{slot.name}: mailbox full (injected)")
            told.append((slot.id, msg.request.request_id))
        return record

    for s in adm.slots:
        s.tell = tell(s)  # type: ignore[method-assign]
    bad = request("settle-bad", list(range(2 * BLOCK)), background=True)
    good = request("settle-good", list(range(1000, 1000 + 2 * BLOCK)), background=True)
    adm.settles.queue.extend([(bad, 0), (good, 0)])
    with capture_logs() as logs:
        adm.pump()
    failed = [e for e in logs if e["event"] == FAILED_EVENT]
    assert [(e["request_id"], e["background"]) for e in failed] == [("settle-bad", True)]
    assert told == [(0, "settle-good")] and adm.settles.done == 1 and not adm.settles.queue
    placed = adm.slots[0]
    assert [s.busy for s in adm.slots] == [True, False, False]
    assert adm.cache.held == len(placed.kv.pages) == 2 and list(adm.promised) == [0]


# ---- the engine ----------------------------------------------------------------------------


def poison_assign(monkeypatch: pytest.MonkeyPatch) -> None:
    """A slot's Assign of a request salted POISON raises, as a full mailbox does."""
    tell = Slot.tell

    def failing(self: Slot, msg: Any) -> None:
        if isinstance(msg, Assign) and msg.request.cache_namespace == ("", POISON):
            raise MailboxFullError(f"{self.name}: mailbox full (injected)")
        tell(self, msg)

    monkeypatch.setattr(Slot, "tell", failing)


def poison_lookup(monkeypatch: pytest.MonkeyPatch) -> None:
    """The prefix cache's lookup raises for a request salted POISON."""
    lookup = KVCache.lookup

    def failing(self: KVCache, tokens: list[int], namespace: Any) -> Any:
        if namespace == ("", POISON):
            raise RuntimeError("injected lookup fault")
        return lookup(self, tokens, namespace)

    monkeypatch.setattr(KVCache, "lookup", failing)


FIRST = [{"role": "user", "content": "Count from one to twenty, please, slowly."}]
LAST = [{"role": "user", "content": "List the planets of the solar system in order."}]
OPTIONS: dict[str, Any] = {"max_tokens": 12, "ignore_eos": True, "temperature": 0}


@pytest.fixture(scope="module")
def one_slot() -> Iterator[EngineHarness]:
    h = EngineHarness(max_slots=1, max_queue=4)
    yield h
    h.close()


def kv_idle(h: EngineHarness) -> bool:
    """Nothing placed, queued, held or promised (a queued copy may still be letting go)."""
    adm = h.engine.admission
    assert adm is not None
    return (not adm.queue and not adm.promised and not adm.places
            and all(not s.busy and not s.in_flight and not s.kv.pages for s in adm.slots)
            and adm.cache.held == 0 and adm.committed_pages == 0)


@pytest.mark.parametrize("inject", [poison_assign, poison_lookup],
                         ids=["assign", "lookup"])
def test_a_request_that_fails_to_place_fails_alone(
        one_slot: EngineHarness, inject: Callable[[pytest.MonkeyPatch], None],
        monkeypatch: pytest.MonkeyPatch) -> None:
    engine = one_slot.engine
    alone = []
    for messages in (FIRST, LAST):
        engine.drop_retained()
        alone.append(one_slot.call(lambda m=messages: engine.chat_complete(m, **OPTIONS)))
    inject(monkeypatch)

    async def queued() -> list[Completion]:
        # the one slot runs the first; the poisoned one and the last wait behind it and are
        # placed by the pump its finish runs
        with anyio.fail_after(60):
            return await asyncio.gather(
                engine.chat_complete(FIRST, **OPTIONS),
                engine.chat_complete(FIRST, cache_salt=POISON, **OPTIONS),
                engine.chat_complete(LAST, **OPTIONS))

    engine.drop_retained()
    first, poisoned, last = one_slot.call(queued)
    assert poisoned.finish_reason == "error" and not poisoned.token_ids
    assert "internal error placing the request" in (poisoned.error or "")
    assert "injected" in (poisoned.error or "")
    for got, want in zip((first, last), alone, strict=True):
        assert got.finish_reason == "length" and got.token_ids == want.token_ids
    assert wait_until(lambda: kv_idle(one_slot), 60)

    async def alone_poisoned() -> Completion:  # placed at submit, on an idle engine
        with anyio.fail_after(60):
            return await engine.chat_complete(LAST, cache_salt=POISON, **OPTIONS)

    again = one_slot.call(alone_poisoned)
    assert again.finish_reason == "error" and "injected" in (again.error or "")
    assert wait_until(lambda: kv_idle(one_slot), 60)
    monkeypatch.undo()
    after = one_slot.call(lambda: engine.chat_complete(FIRST, **OPTIONS))
    assert after.token_ids == alone[0].token_ids
    assert engine.failure is None and engine.ready
    assert wait_until(lambda: kv_idle(one_slot), 60)


# ---- over HTTP -----------------------------------------------------------------------------


def test_over_http_a_failed_placement_is_a_500_and_the_server_serves_on(
        monkeypatch: pytest.MonkeyPatch) -> None:
    srv = BackgroundServer(create_app(EngineConfig(max_slots=1, max_queue=4))).start()
    try:
        poison_assign(monkeypatch)
        chat = {"messages": LAST, **OPTIONS}
        with httpx.Client(base_url=srv.url, timeout=60) as c:
            r = c.post("/v1/chat/completions", json={**chat, "cache_salt": POISON})
            assert r.status_code == 500, r.text
            err = r.json()["error"]
            assert err["type"] == "server_error"
            assert "internal error placing the request" in err["message"]

            with c.stream("POST", "/v1/chat/completions",
                          json={**chat, "cache_salt": POISON, "stream": True}) as s:
                assert s.status_code == 200
                events = [json.loads(line[6:]) for line in s.iter_lines()
                          if line.startswith("data: {")]
            errors = [e["error"] for e in events if "error" in e]
            assert len(errors) == 1 and errors[0]["type"] == "server_error"
            assert "internal error placing the request" in errors[0]["message"]

            r = c.post("/v1/messages", json={"model": "default", "max_tokens": 4,
                                             "messages": LAST, "cache_salt": POISON})
            assert r.status_code == 500, r.text
            body = r.json()
            assert body["type"] == "error" and body["error"]["type"] == "api_error"
            assert "internal error placing the request" in body["error"]["message"]

            r = c.post("/v1/chat/completions", json=chat)
            assert r.status_code == 200, r.text
            reply = r.json()["choices"][0]
            assert reply["finish_reason"] == "length" and reply["message"]["content"]
        engine = srv.state.engine
        assert wait_until(lambda: not engine.admission.queue and engine.admission.cache.held
                          == 0 and not any(s.busy or s.in_flight for s in engine.slots), 5)
    finally:
        srv.stop()
