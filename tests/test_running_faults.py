"""A running request that admission cannot tell what it needs fails alone, and a request that
fails away from its slot still tells its client why.

- The engine (bundled SmolLM2, two slots, a budget of two pages, no reserve): the older
  request crosses into its second page while the younger runs, so the younger must step
  back. When the Preempt to the younger cannot be delivered, or the PagesReady to the older
  once the younger has stepped back, that request fails with a server error that says so,
  its pages go back, and the other gives the tokens it gives alone (the younger resumed).
  A younger whose client reads nothing is parked when its Preempt raises: it fails at once,
  inside the older's request for the page, and the older still goes on. A younger whose
  Withdraw to the Batcher raises (its offer is out when it is preempted) steps back once the
  step that took the offer answers, resumes, and gives its alone tokens.
- Settle passes (Admission over a real pool, real Slots): a settle pass that cannot be told
  to stop (Cancel) is stopped, and the request that wanted its slot, or that continues its
  ledger, is placed; the settle pass's request does not fail it.
- A preempted request whose client does not read until after the request failed (its
  resume cannot be placed): the client reads every token it was sent, then the final delta
  with the reason, and its usage counts those tokens.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from typing import Any

import anyio
import mlx.core as mx
import pytest
from engine_harness import EngineHarness, wait_until
from structlog.testing import capture_logs

from slotserve.actors.admission import Admission
from slotserve.actors.base import MailboxFullError
from slotserve.actors.batcher import Batcher
from slotserve.actors.kv_cache import KVCache
from slotserve.actors.messages import (
    Cancel,
    Delta,
    GenerationRequest,
    PagesReady,
    Preempt,
    StepDone,
    Withdraw,
)
from slotserve.actors.session import Session
from slotserve.actors.settle import Settles
from slotserve.actors.slot import Slot
from slotserve.engine import Completion, Engine
from slotserve.kernels.attention import BLOCK
from slotserve.model.kv import KVPool, SlotKV
from slotserve.runtime.sampling import SamplingParams

POISON = "poison"  # the cache_salt of the one request a fault is injected for
TOLD_EVENT = "telling a running request failed: it fails alone"

# the older request's prompt is longer: it crosses into its second page while the younger,
# which fits in one page, still runs
# (long prompts: few tokens to generate before the older needs its second page)
OLDER = [{"role": "user", "content": (
    "Write one long sentence about rivers, mountains, oceans, skies, forests, deserts, islands "
    "and the stars above; then describe a lighthouse keeper who walks along the cliffs every "
    "evening, counting the ships that pass on their way to harbours far to the south, and the "
    "birds that follow them, until the last light fades over the water.")}]
YOUNGER = [{"role": "user", "content": (
    "Describe a small village market on a busy Saturday morning: the stalls, the bread, the "
    "cheese, the flowers, and the people who come to buy them.")}]


def injected(kind: type) -> Callable[[Slot, Any], None]:
    """Slot.tell, raising as a full mailbox does for a `kind` message to the request salted
    POISON."""
    tell = Slot.tell

    def failing(self: Slot, msg: Any) -> None:
        req = self.request
        if isinstance(msg, kind) and req is not None and req.cache_namespace == ("", POISON):
            raise MailboxFullError(f"{self.name}: mailbox full (injected)")
        tell(self, msg)

    return failing


@pytest.fixture(scope="module")
def two_slots() -> Iterator[EngineHarness]:
    h = EngineHarness(max_slots=2, max_queue=4, kv_reserve_tokens=0)
    yield h
    h.close()


def options(engine: Engine, messages: list[dict[str, str]], younger: bool) -> dict[str, Any]:
    n = len(engine.render_chat(messages))
    # the younger ends inside its first page; the older goes 16 tokens past its first
    return {"max_tokens": BLOCK - n if younger else BLOCK - n + 16, "ignore_eos": True,
            "temperature": 0}


@pytest.fixture(scope="module")
def alone(two_slots: EngineHarness) -> dict[str, Completion]:
    engine = two_slots.engine
    old, young = len(engine.render_chat(OLDER)), len(engine.render_chat(YOUNGER))
    assert old > young + 8 and old < BLOCK  # the older crosses first
    out = {}
    for name, messages in (("older", OLDER), ("younger", YOUNGER)):
        engine.drop_retained()
        out[name] = two_slots.call(lambda m=messages, y=name == "younger": engine.chat_complete(
            m, **options(engine, m, y)))
        assert out[name].finish_reason == "length"
    return out


def kv_idle(h: EngineHarness) -> bool:
    adm = h.engine.admission
    assert adm is not None
    return (not adm.queue and not adm.promised and not adm.places and adm.preempting is None
            and not adm.growth_waiters
            and all(not s.busy and not s.in_flight and not s.kv.pages for s in adm.slots)
            and adm.cache.held == 0 and adm.committed_pages == 0)


def run_both(h: EngineHarness, poisoned: str) -> tuple[Completion, Completion]:
    """The older and the younger request at once (the `poisoned` one salted POISON);
    returns (older, younger)."""
    engine = h.engine

    async def both() -> tuple[Completion, Completion]:
        with anyio.fail_after(120):
            older, younger = await asyncio.gather(*(
                engine.chat_complete(m, **options(engine, m, name == "younger"),
                                     **({"cache_salt": POISON} if name == poisoned else {}))
                for name, m in (("older", OLDER), ("younger", YOUNGER))))
            return older, younger

    return h.call(both)


@pytest.fixture
def small_budget(two_slots: EngineHarness) -> Iterator[Admission]:
    """Two pages: one for each prompt, none for the older's second page."""
    adm = two_slots.engine.admission
    assert adm is not None
    budget = adm.budget_pages
    two_slots.engine.drop_retained()
    adm.budget_pages = 2
    yield adm
    adm.budget_pages = budget
    two_slots.engine.drop_retained()


@pytest.mark.parametrize("kind", [Preempt, PagesReady], ids=["preempt", "pages_ready"])
def test_a_running_request_that_cannot_be_told_fails_alone(
        two_slots: EngineHarness, alone: dict[str, Completion], small_budget: Admission,
        kind: type, monkeypatch: pytest.MonkeyPatch) -> None:
    """Preempt: the younger is the victim, it fails instead of stepping back and the older
    goes on; PagesReady: the older waits for the younger's page, it fails instead of going
    on, and the younger, stepped back, resumes and finishes."""
    engine, adm = two_slots.engine, small_budget
    failing = "younger" if kind is Preempt else "older"
    monkeypatch.setattr(Slot, "tell", injected(kind))
    preempted = adm.preemptions["budget"]

    with capture_logs() as logs:
        older, younger = run_both(two_slots, failing)
    got = {"older": older, "younger": younger}
    bad, good = got.pop(failing), next(iter(got.values()))
    doing = "preempting" if kind is Preempt else "granting pages to"
    assert bad.finish_reason == "error", bad
    assert f"internal error {doing} the request: MailboxFullError" in (bad.error or "")
    assert "injected" in (bad.error or "")
    # what it produced before it failed is what it produces alone, and no more
    want = alone[failing].token_ids
    assert bad.token_ids and len(bad.token_ids) < len(want)
    assert bad.token_ids == want[: len(bad.token_ids)]
    other = next(n for n in alone if n != failing)
    assert good.finish_reason == "length" and good.token_ids == alone[other].token_ids
    assert adm.preemptions["budget"] - preempted == (1 if kind is PagesReady else 0)
    told = [e for e in logs if e["event"] == TOLD_EVENT]
    assert [(e["message"], e["log_level"]) for e in told] == [(kind.__name__, "error")]
    assert wait_until(lambda: kv_idle(two_slots), 60)
    assert engine.failure is None and engine.ready


def test_a_victim_whose_withdraw_raises_steps_back_after_its_step(
        two_slots: EngineHarness, alone: dict[str, Completion], small_budget: Admission,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The younger is preempted while its offer is out, and its Withdraw to the Batcher
    raises: the step that takes the offer answers instead, the younger steps back then (it
    does not crash and fail), resumes and gives its alone tokens, as the older does."""
    engine, adm = two_slots.engine, small_budget
    tell = Batcher.tell
    refused: list[Withdraw] = []

    def failing(self: Batcher, msg: Any) -> None:
        req = engine.slots[msg.slot_id].request if isinstance(msg, Withdraw) else None
        if req is not None and req.cache_namespace == ("", POISON):
            refused.append(msg)
            raise MailboxFullError("batcher: mailbox full (injected)")
        tell(self, msg)

    monkeypatch.setattr(Batcher, "tell", failing)
    preempted = adm.preemptions["budget"]

    with capture_logs() as logs:
        older, younger = run_both(two_slots, "younger")
    assert len(refused) == 1
    assert adm.preemptions["budget"] - preempted == 1
    for name, got in (("older", older), ("younger", younger)):
        assert got.finish_reason == "length", (name, got)
        assert got.token_ids == alone[name].token_ids, name
    assert not [e for e in logs if e["event"] == "actor crashed on message"]
    assert wait_until(lambda: kv_idle(two_slots), 60)
    assert engine.failure is None and engine.ready


def beside_older(h: EngineHarness, prompt: list[int]) -> tuple[asyncio.Future[Completion], Any]:
    """The older request, then the poisoned younger one (`prompt`), submitted in that
    order; returns (the older's completion, the younger's session)."""
    engine = h.engine

    async def submit() -> tuple[asyncio.Future[Completion], Any]:
        older = asyncio.ensure_future(engine.chat_complete(
            OLDER, **options(engine, OLDER, False)))
        await asyncio.sleep(0)  # (the older is submitted first)
        request = engine.make_request(prompt, cache_salt=POISON,
                                      **options(engine, YOUNGER, True))
        return older, engine.submit(request)

    return h.call(submit)


def read_late(h: EngineHarness, older: asyncio.Future[Completion],
              session: Any) -> tuple[Completion, list[Delta]]:
    """The younger's stream, read only now, and the older's completion."""
    async def read() -> tuple[Completion, list[Delta]]:
        with anyio.fail_after(120):
            deltas = [d async for d in session.client]
            return await older, deltas

    return h.call(read)


def failed_late(done: Completion, deltas: list[Delta], alone: dict[str, Completion],
                error: str) -> None:
    """The older ran as alone; the younger's stream has a prefix of its alone tokens, then
    `error`, with those tokens counted in its usage."""
    assert done.finish_reason == "length" and done.token_ids == alone["older"].token_ids
    final = deltas[-1]
    assert final.finish_reason == "error", deltas
    assert error in (final.error or "")
    tokens = [t for d in deltas for t in d.token_ids]
    assert tokens and tokens == alone["younger"].token_ids[: len(tokens)]
    assert final.usage is not None and final.usage.completion_tokens == len(tokens)


def test_a_preempted_client_that_reads_late_hears_why_its_request_failed(
        two_slots: EngineHarness, alone: dict[str, Completion], small_budget: Admission,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The younger's client reads nothing: its slot parks, is preempted when the older needs
    the page, and its resume fails to place. Read only then, the stream has every token it
    was sent, then the error, and its usage counts them."""
    engine = two_slots.engine
    prompt = engine.render_chat(YOUNGER)
    lookup = KVCache.lookup

    def failing(self: KVCache, tokens: list[int], namespace: Any) -> Any:
        # its resume, not its first placement: the tokens it generated follow the prompt
        if namespace == ("", POISON) and len(tokens) > len(prompt):
            raise RuntimeError("injected lookup fault")
        return lookup(self, tokens, namespace)

    monkeypatch.setattr(KVCache, "lookup", failing)

    # (it runs beside the older until its client's stream and its mailbox are full, then
    # its slot parks: the older needs its second page well after that)
    older, session = beside_older(two_slots, prompt)
    assert wait_until(lambda: session.finished, 120)
    done, deltas = read_late(two_slots, older, session)
    assert engine.admission.preemptions["budget"] >= 1
    failed_late(done, deltas, alone, "internal error placing the request")
    assert deltas[-1].usage.prompt_tokens == len(prompt)
    assert wait_until(lambda: kv_idle(two_slots), 60)


def test_a_parked_victim_that_cannot_be_told_to_step_back_fails_and_says_why(
        two_slots: EngineHarness, alone: dict[str, Completion], small_budget: Admission,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The younger's client reads nothing, so its slot is parked (no step in flight) when
    the older needs its page: its Preempt raises, it fails at once, and its release, inside
    the older's request for the page, lets the older go on. Read late, its stream has its
    tokens, then why it failed."""
    engine = two_slots.engine
    monkeypatch.setattr(Slot, "tell", injected(Preempt))

    with capture_logs() as logs:
        older, session = beside_older(two_slots, engine.render_chat(YOUNGER))
        # (its final event waits in its session's mailbox for the client to read)
        assert wait_until(lambda: older.done() and not any(
            s.request is not None for s in engine.slots), 120)
        done, deltas = read_late(two_slots, older, session)
    failed_late(done, deltas, alone, "internal error preempting the request: MailboxFullError")
    assert [e["message"] for e in logs if e["event"] == TOLD_EVENT] == ["Preempt"]
    assert wait_until(lambda: kv_idle(two_slots), 60)


# ---- settle passes that cannot be told to stop -----------------------------------------------


class Recorder:
    """An address that keeps what it is told (the Batcher's)."""

    def __init__(self) -> None:
        self.told: list[Any] = []

    def tell(self, msg: Any) -> None:
        self.told.append(msg)

    def tell_or_handle(self, msg: Any, failure: str, **context: object) -> None:
        self.tell(msg)

    def room(self) -> int:
        return 1 << 10


def admission(slots: int) -> tuple[Admission, Recorder]:
    """Admission over a real pool with settle passes on; its slots handle what they are told
    at once (no event loop here), except a Cancel to a settle pass, which raises."""
    pool = KVPool(num_layers=1, num_kv_heads=1, head_dim=8, dtype=mx.float32)
    batcher = Recorder()
    adm = Admission([Slot(i, SlotKV(pool), batcher) for i in range(slots)], KVCache(pool),
                    max_queue=4, kv_budget=64 * pool.page_bytes, context_length=4096)
    adm.settles = Settles(BLOCK)
    for s in adm.slots:
        s.placement = adm
        s.kv.managed = True

        def tell(msg: Any, s: Slot = s) -> None:
            req = s.request
            if isinstance(msg, Cancel) and req is not None and req.background:
                raise MailboxFullError(f"{s.name}: mailbox full (injected)")
            s.handle(msg)

        s.tell = tell  # type: ignore[method-assign]
    return adm, batcher


def generation(name: str, tokens: list[int], **extra: Any) -> GenerationRequest:
    return GenerationRequest(request_id=name, prompt_ids=tokens, max_tokens=8,
                             params=SamplingParams(temperature=0.0), cache_namespace=("", ""),
                             **extra)


def settle_running(adm: Admission, tokens: list[int]) -> Slot:
    """A settle pass of `tokens` placed and offered (its prefill is in a step)."""
    request = generation("settle-0", tokens, background=True)
    assert adm.settles is not None
    adm.settles.queue.append((request, 0))
    adm.pump()
    slot = next(s for s in adm.slots if s.request is request)
    assert slot.in_flight
    return slot


class Client:
    def __init__(self) -> None:
        self.placed: list[Slot] = []
        self.errors: list[str] = []

    def place(self, slot: Slot, reused: int, progress: Any) -> None:
        slot.reserve()
        self.placed.append(slot)

    def fail(self, error: str) -> None:
        self.errors.append(error)


def stopped(slot: Slot, batcher: Recorder) -> bool:
    """The settle pass on `slot` ended: its step in flight withdrawn (its pages go back once
    that step answers), nothing left of it on the slot."""
    return slot.request is None and any(
        isinstance(m, Withdraw) and m.slot_id == slot.id for m in batcher.told)


def test_a_settle_pass_that_cannot_be_told_to_yield_is_stopped_and_the_request_placed(
        ) -> None:
    """One slot, a settle pass on it: the request that arrives asks it to give the slot
    back; the Cancel raises, so the pass is stopped, and the request (not failed) takes the
    slot once the pass's step has answered, as after a Cancel delivered."""
    adm, batcher = admission(1)
    settle = settle_running(adm, list(range(2 * BLOCK)))
    client = Client()
    with capture_logs() as logs:
        placed = adm.submit(generation("q", list(range(5000, 5100))), client.place,
                            client.fail)
    assert not client.errors and not placed and len(adm.queue) == 1
    assert stopped(settle, batcher)
    told = [e for e in logs if e["event"] == TOLD_EVENT]
    assert [(e["message"], e["background"]) for e in told] == [("Cancel", True)]
    settle.handle(StepDone(settle.epoch - 1, 2 * BLOCK, None))  # its step answers (stale)
    assert client.placed == [settle] and not adm.queue and not client.errors
    assert adm.cache.held == len(settle.kv.pages) and list(adm.places) == [settle.id]


def test_a_settle_pass_a_request_supersedes_is_stopped_when_it_cannot_be_told() -> None:
    """Three slots (one stays free beside a settle pass): the request continues a running
    settle pass's ledger; the pass's Cancel raises, so it is stopped, and the request is
    placed at once on a free slot."""
    adm, batcher = admission(3)
    ledger = list(range(2 * BLOCK))
    settle = settle_running(adm, ledger)
    client = Client()
    assert adm.submit(generation("q", [*ledger, 7, 8, 9]), client.place, client.fail)
    assert not client.errors and len(client.placed) == 1 and client.placed[0] is not settle
    assert stopped(settle, batcher)
    settle.handle(StepDone(settle.epoch - 1, 2 * BLOCK, None))
    assert not settle.busy and list(adm.places) == [client.placed[0].id]


# ---- a session that crashes and cannot cancel its slot ------------------------------------


def test_a_crashed_session_whose_cancel_raises_still_tells_its_client(
        two_slots: EngineHarness, alone: dict[str, Completion],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The poisoned request's session crashes on its third token and its Cancel to the slot
    raises: the client still hears why at once (the session fails before it tells the
    slot: it crashes once, not again on every token the slot goes on sending), the other
    request gives its alone tokens, and the slot, never told, cancels the request at once
    (`Slot.cancel`) and frees itself."""
    engine = two_slots.engine
    engine.drop_retained()
    token = Session._token

    def crashing(self: Session, ev: Any) -> list[Delta]:
        if self.request.cache_namespace == ("", POISON) and self.completion_tokens == 2:
            raise RuntimeError("injected session crash")
        return token(self, ev)

    monkeypatch.setattr(Session, "_token", crashing)
    monkeypatch.setattr(Slot, "tell", injected(Cancel))

    with capture_logs() as logs:
        older, younger = run_both(two_slots, "younger")
        assert wait_until(lambda: kv_idle(two_slots), 120)
    crashes = [e for e in logs if e["event"] == "actor crashed on message"]
    assert len(crashes) == 1, f"the session crashed on {len(crashes)} tokens, not once"
    assert younger.finish_reason == "error", younger
    assert "internal error in session: injected session crash" in (younger.error or "")
    assert younger.token_ids == alone["younger"].token_ids[:2]
    assert older.finish_reason == "length" and older.token_ids == alone["older"].token_ids
    assert engine.failure is None and engine.ready
