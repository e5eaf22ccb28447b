"""Admission: admit / queue / preempt / refuse under slot, queue and KV-page budgets.

Every slot keeps the model's full context; one physical KV budget (in pages of BLOCK
positions) governs what is resident. The rule, in full:

* **Charge what is written.** A request placed on a slot holds the pages of its prompt
  (those the prefix cache already has are shared, not charged twice) plus a *promise* of a
  small generation reserve (`reserve_tokens`, default two pages). It grows page by page as
  it generates: first out of its promise, then out of what the budget has left.
* **Committed = pages held + pages promised** never exceeds the budget. Pages nobody holds
  (finished conversations, shared prefixes: the prefix cache's idle pages) fill the rest and
  are evicted, least recently used first, whenever a request needs the room.
* **Preempt instead of refusing.** A running request that needs a page the budget cannot
  give preempts the youngest running request (its full pages stay in the cache as idle
  pages, so the resume finds them while the budget allows; what was evicted is recomputed
  from its token ledger). A preempted request goes back to the front of the queue with its
  sampler and grammar state and resumes with the tokens it would have produced
  uninterrupted (prefills and decodes compute every position the same way). If the
  oldest waiting request is itself the youngest, nobody steps back: it waits for the older
  ones to finish. One preemption at a time; queued requests wait while a running one
  waits for a page.
* **Sliding windows are a floor.** A model's sliding-window layers keep K/V only for the
  pages their windows reach (slotserve.actors.kv_cache), so a page costs its global
  layers alone and every busy slot a fixed floor of window rows (`window_rows`).
* **Refuse only what can never run**: a prompt that does not fit the whole budget alone
  (400). A full queue is a 429 with Retry-After. A request whose own context outgrows the
  whole budget alone (max_tokens left open on a small budget) finishes with "length".

Requests reuse KV only within their cache namespace (`GenerationRequest.cache_namespace`:
the API key and `cache_salt`, see `namespace_for`), because the cache keys its pages by
namespace: `cached_tokens` never tells one tenant anything about another's prompts. A
request of namespace None (`--cache-scope none`) reuses nothing and leaves nothing.
"""

from __future__ import annotations

import math
import time
from collections import Counter, deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import structlog

from slotserve.actors import state_snapshots
from slotserve.actors.base import try_tell
from slotserve.actors.kv_cache import Chain, KVCache, Match
from slotserve.actors.messages import (
    Assign,
    CacheNamespace,
    Cancel,
    GenerationRequest,
    PagesReady,
    Preempt,
    Progress,
    SlotMessage,
)
from slotserve.actors.settle import SINK, Settles
from slotserve.actors.slot import Growth, Slot
from slotserve.kernels.attention import BLOCK

log = structlog.get_logger("slotserve.admission")

# how far prefix reuse reaches: "key" (the default) within one API key, "global" across all
# requests (one namespace), "none" not across requests at all; cache_salt splits each further
CACHE_SCOPES = ("key", "global", "none")
DEFAULT_RESERVE_TOKENS = 2 * BLOCK


def namespace_for(scope: str, tenant: str | None = None,
                  salt: str | None = None) -> CacheNamespace | None:
    """The cache namespace of a request from `tenant` (the API key's id; None or "" when the
    server has no key: one tenant) with `cache_salt` `salt`, under `scope`."""
    if scope not in CACHE_SCOPES:
        raise ValueError(f"cache scope must be one of {', '.join(CACHE_SCOPES)}, not {scope!r}")
    for name, value in (("cache_namespace", tenant), ("cache_salt", salt)):
        if value is not None and not isinstance(value, str):
            raise ValueError(f"{name} must be a string, got {type(value).__name__}")
    if scope == "none":
        return None
    if scope == "global":
        tenant = None
    return (tenant or "", salt or "")


def pages_for(tokens: int) -> int:
    return -(-tokens // BLOCK)


def window_rows(window: int, step_tokens: int) -> int:
    """The most window rows a busy slot holds (slotserve.model.kv.SlotKV): the pages of the
    window - 1 positions before a step's rows and of the up to `step_tokens` rows it writes
    (one more where they straddle a page), and a copied page's source."""
    return pages_for(window - 1 + step_tokens) + 2


def _settle_place(request: GenerationRequest, settles: Settles) -> Place:
    """How a settle pass is placed: its tokens go to a sink (slotserve.actors.settle)."""

    def place(slot: Slot, reused: int, progress: Progress | None) -> None:
        slot.reserve()
        slot.tell(Assign(request, SINK, reused, progress))
        settles.done += 1

    return place


def _arrival(slot: Slot) -> float:
    return slot.request.arrived if slot.request is not None else 0.0


class AdmissionError(Exception):
    """A request that cannot be served as asked (maps to HTTP 400)."""


class ContextOverflowError(AdmissionError):
    def __init__(self, prompt_tokens: int, max_tokens: int, context: int) -> None:
        super().__init__(
            f"prompt ({prompt_tokens} tokens) plus max_tokens ({max_tokens}) exceeds the "
            f"model's context length of {context} tokens"
        )
        self.prompt_tokens, self.max_tokens, self.context = prompt_tokens, max_tokens, context


class BudgetExceededError(AdmissionError):
    """A prompt larger than the whole KV budget: it could never run."""


class OverloadedError(Exception):
    """Queue full: retry later (HTTP 429 with Retry-After)."""

    def __init__(self, reason: str, retry_after: int) -> None:
        super().__init__(f"server overloaded ({reason}); retry after {retry_after} s")
        self.reason, self.retry_after = reason, retry_after


# tells the slot its request (after reserving it); it tells last, so a raise means untold
Place = Callable[[Slot, int, Progress | None], None]
Fail = Callable[[str], None]  # ends a request with a server error (its session's final delta)


@dataclass
class Waiting:
    request: GenerationRequest
    place: Place  # (slot, prompt tokens found in the cache, progress to resume or None)
    progress: Progress | None = None  # a preempted request's state
    fail: Fail | None = None  # how it fails when placing it raises (None: a settle pass)
    # a settle pass: the position it resumes from (dropped once the cache holds less)
    resume_at: int = 0

    @property
    def tokens(self) -> list[int]:
        return self.progress.tokens if self.progress else self.request.prompt_ids


class Admission:
    def __init__(self, slots: list[Slot], cache: KVCache, *, max_queue: int, kv_budget: int,
                 context_length: int, reserve_tokens: int = DEFAULT_RESERVE_TOKENS,
                 state_interval: int = state_snapshots.DEFAULT_INTERVAL,
                 settle_align: int = 0, step_tokens: int = DEFAULT_RESERVE_TOKENS) -> None:
        """state_interval: pages between the recurrent-state snapshots the cache keeps, for
        models whose sequences carry a state (Gated DeltaNet layers); settle_align: their
        prefill alignment, > 0 to run settle passes (slotserve.actors.settle); step_tokens:
        the most positions one step writes for a slot (the Batcher's prefill budget)."""
        self.slots = slots
        self.cache = cache
        self.max_queue = max_queue
        self.kv_budget = kv_budget
        self.page_bytes = cache.pool.page_bytes
        self.budget_pages = max(kv_budget // self.page_bytes, 1)
        self.context_length = context_length
        self.reserve_pages = pages_for(reserve_tokens)
        # a recurrent state per busy slot: a fixed floor of pages whatever its length
        self.floor_pages = 0
        if slots and state_snapshots.carries_state(slots[0].kv):
            state = slots[0].kv.state_bytes  # type: ignore[attr-defined]
            self.floor_pages = -(-state // self.page_bytes)
            cache.snapshots = state_snapshots.StateSnapshots(
                slots[0].kv.recurrent.shape.nbytes,  # type: ignore[attr-defined]
                self.page_bytes, state_interval)
        pool = cache.pool
        if pool.windowed:  # sliding-window layers: the rows a step's windows reach, per slot
            self.floor_pages += -(-window_rows(pool.window, step_tokens) * pool.window_bytes
                                  // self.page_bytes)
        self.settles = Settles(settle_align) if self.floor_pages and settle_align else None
        self._yielding: set[tuple[int, int]] = set()  # (slot, epoch) of settles told to stop
        self._discard: set[int] = set()  # slots whose settle pass must leave nothing
        self.queue: deque[Waiting] = deque()
        self.promised: dict[int, int] = {}  # slot id -> pages promised, not yet taken
        self.places: dict[int, Waiting] = {}  # slot id -> how its request was placed
        self.growth_waiters: list[Slot] = []  # running slots waiting for a page
        self.preempting: int | None = None  # the slot told to step back, until it has
        # a pump asked for while one runs (a slot failed inside it released its pages) runs
        # once that one is done (`_pumps_held`)
        self._pumping = False
        self._pump_again = False
        self.rejections: Counter[str] = Counter()
        self.preemptions: Counter[str] = Counter()
        self._finished_at: deque[float] = deque(maxlen=64)

    # ---- accounting ------------------------------------------------------------

    @property
    def committed_pages(self) -> int:
        return self.cache.held + sum(self.promised.values()) + self._floors()

    def _floors(self) -> int:
        """Pages the busy slots' recurrent states take (0 for models without one)."""
        return self.floor_pages * sum(1 for s in self.slots if s.busy) if self.floor_pages \
            else 0

    @property
    def busy_bytes(self) -> int:
        return self.committed_pages * self.page_bytes

    @property
    def used_bytes(self) -> int:
        """Resident KV: held and idle pages (promises are not yet written)."""
        return self.cache.resident * self.page_bytes

    def check(self, req: GenerationRequest) -> None:
        """Raise for a request that can never run."""
        if len(req.prompt_ids) + req.max_tokens > self.context_length:
            raise ContextOverflowError(len(req.prompt_ids), req.max_tokens, self.context_length)
        need = (pages_for(len(req.prompt_ids) + 1) + self.floor_pages) * self.page_bytes
        if need > self.kv_budget:
            raise BudgetExceededError(
                f"the prompt ({len(req.prompt_ids)} tokens) needs {need} bytes of KV but the "
                f"whole KV budget is {self.kv_budget} bytes; shorten the prompt")

    # ---- placement -------------------------------------------------------------

    def submit(self, req: GenerationRequest, place: Place, fail: Fail) -> bool:
        """Place now (True; or fail it through `fail` if placing it raised, see `_place`),
        queue (False), or raise OverloadedError / AdmissionError."""
        self.check(req)
        w = Waiting(req, place, fail=fail)
        with self._pumps_held():
            if not self.queue and self._place(w):
                return True
            full = len(self.queue) >= self.max_queue
            if not full:
                self.queue.append(w)
        if full:
            self.rejections["queue_full"] += 1
            raise OverloadedError("queue full", self.retry_after())
        return False

    def withdraw(self, request_id: str) -> bool:
        for w in self.queue:
            if w.request.request_id == request_id:
                self.queue.remove(w)
                return True
        return False

    def pump(self) -> None:
        """Serve what now fits: running requests waiting for a page first (oldest first, as
        many as there are free pages; if none is free, preempt for them), and only when none
        waits, the queue in order (preempted requests first, by arrival)."""
        if self._pumping:  # (from inside a pump or a placement: it runs once that is done)
            self._pump_again = True
            return
        with self._pumps_held():
            self._pump()

    @contextmanager
    def _pumps_held(self) -> Iterator[None]:
        """Pumps asked for inside run after it, once. A running request failed inside a
        pump or a placement (`_tell_running`) releases its pages there, and its release
        pumps: nested, that pump would place the queue's next request ahead of the one
        being placed (out of the queue while it is) or into the slot it is about to take."""
        if self._pumping:
            yield
            return
        self._pumping = True
        try:
            yield
        finally:
            self._pumping = False
            again, self._pump_again = self._pump_again, False
        if again:
            self.pump()

    def _pump(self) -> None:
        if self.preempting is not None:
            return
        self.growth_waiters = [s for s in self.growth_waiters
                               if s.request is not None and s.waiting_for_pages]
        if self.growth_waiters:
            free = self.budget_pages - self.committed_pages
            if free <= 0:
                self._preempt_for_waiters()
                return
            for slot in sorted(self.growth_waiters, key=_arrival)[:free]:
                self.growth_waiters.remove(slot)
                self._tell_running(slot, PagesReady(slot.epoch), "granting pages to")
            return
        while self.queue:
            w = self.queue.popleft()  # (out of the queue while placed: failing it withdraws)
            if not self._place(w):
                self.queue.appendleft(w)
                return
        self._place_settles()

    def _place_settles(self) -> None:
        """Settle passes into the free slots but one (only when nothing is queued); one
        whose resume point the cache no longer holds is dropped (it would prefill it all)."""
        settles = self.settles
        while settles and not self.queue and not self.growth_waiters:
            free = sum(1 for s in self.slots if not s.busy and not s.in_flight)
            if free < 2 and len(self.slots) > 1:
                return  # one slot stays free: a request that arrives takes it at once
            request, start = settles.queue.popleft()
            if not self._place(Waiting(request, _settle_place(request, settles),
                                       resume_at=start)):
                settles.queue.appendleft((request, start))
                return

    def _yield_settle(self) -> None:
        """A request waits for a slot: one running settle pass gives its slot back (what it
        settled so far stays in the cache)."""
        for s in self.slots:
            req = s.request
            if req is not None and req.background and (s.id, s.epoch) not in self._yielding:
                self._yielding.add((s.id, s.epoch))
                self._tell_running(s, Cancel(s.epoch, "cancelled"), "stopping")
                return

    def _preempt_for_waiters(self) -> None:
        """Tell the youngest running request to step back, for the oldest waiting one. When
        the oldest waiter is itself the youngest, nobody steps back: it waits for the older
        ones to finish (stepping back would only make room for itself)."""
        if self.preempting is not None or not self.growth_waiters:
            return
        oldest = min(self.growth_waiters, key=_arrival)
        busy = [s for s in self.slots if s.busy and s.request is not None]
        victim = next((s for s in busy if s.request.background),  # type: ignore[union-attr]
                      max(busy, key=_arrival))
        if victim is oldest:
            return
        self.preempting = victim.id
        if not self._tell_running(victim, Preempt(victim.epoch), "preempting") \
                and victim.request is not None:
            # it could not even be failed: no release will end this preemption
            self.preempting = None
        # (failed, it ends it as a step back would: its release frees its pages, now or
        # once its step in flight answers, and pumps)

    def _supersede_settles(self, tokens: list[int], namespace: CacheNamespace | None) -> None:
        """A request continues the ledger of a settle pass that has not finished: it
        prefills those tokens itself, so the pass goes (queued: dropped; running: told to
        stop, what it settled so far stays)."""
        settles = self.settles
        if settles is None or namespace is None:
            return

        def continues(req: GenerationRequest) -> bool:
            n = len(req.prompt_ids)
            return (req.cache_namespace == namespace and len(tokens) > n
                    and tokens[:n] == req.prompt_ids)

        for queued in [q for q in settles.queue if continues(q[0])]:
            settles.queue.remove(queued)
        for s in self.slots:
            req = s.request
            if (req is not None and req.background and (s.id, s.epoch) not in self._yielding
                    and continues(req)):
                self._yielding.add((s.id, s.epoch))
                self._tell_running(s, Cancel(s.epoch, "cancelled"), "stopping")

    def _tell_running(self, slot: Slot, msg: SlotMessage, doing: str) -> bool:
        """Tell a running request's slot `msg`; True when told. When the tell raises (a full
        mailbox, a closed one: a bug in the protocol), that request fails alone instead
        (`Slot.fail`: its client gets a server error, its pages go back through the finish
        path, now or once its step in flight answers, and that release pumps). A settle
        pass told to stop (Cancel) is stopped this way: all its Cancel would have done, and
        the request that wanted its slot is placed, not failed.

        Failing it, not telling it again on a later pump, is what cannot wedge: nothing
        promises a later pump (a request waiting for a page does not step, so no finish of
        its own comes; when every running request waits, nobody pumps) and a fault that
        lasts (a closed mailbox) fails every retry, so the request would hang silently,
        and an untold Preempt would leave `preempting` set, stalling every waiter and the
        whole queue. Left to propagate, the error would escape `pump` into the slot or the
        Batcher that called it, as a failed placement once did."""
        req = slot.request
        exc = try_tell(slot, msg, "telling a running request failed: it fails alone",
                       slot=slot.id, request_id=req.request_id if req is not None else None,
                       background=req.background if req is not None else None)
        if exc is None:
            return True
        try:
            slot.fail(f"internal error {doing} the request: {type(exc).__name__}: {exc}")
        except Exception:
            log.exception("failing a running request failed too: its slot is out of service",
                          slot=slot.id)
        return False

    def _place(self, w: Waiting) -> bool:
        """Place `w` if a slot and the budget allow; True when it waits no more (placed,
        dropped, or failed), False when it must wait on.

        Placement is all or nothing (`_try_place` undoes what it reserved when a step of it
        raises), and its errors stop here: a bug in a cache lookup, in the page accounting
        or in a family's state snapshot, or a slot that cannot take its Assign, fails this
        request alone with a server error (`w.fail`; a settle pass is just dropped) and the
        queue moves on. Left to propagate, the error would escape `pump` into the slot
        whose finish called it, strand the request in the queue (its client never hears
        back) and keep whatever it had reserved."""
        try:
            return self._try_place(w)
        except Exception as exc:
            log.exception("placing a request failed: it fails alone",
                          request_id=w.request.request_id, background=w.request.background)
            if w.fail is not None:
                w.fail(f"internal error placing the request: {type(exc).__name__}: {exc}")
            return True

    def _free_slot(self) -> Slot | None:
        return next((s for s in self.slots if not s.busy and not s.in_flight), None)

    def _try_place(self, w: Waiting) -> bool:
        """`_place` without its containment: when a step of placing `w` raises, what was
        reserved for it is undone (`_unplace`) and the error goes on to `_place`."""
        if not w.request.background:
            self._supersede_settles(w.tokens, w.request.cache_namespace)
        slot = self._free_slot()
        if slot is None and not w.request.background:
            self._yield_settle()
            slot = self._free_slot()  # (a settle pass that could not be told was stopped)
        if slot is None:
            return False
        req, tokens = w.request, w.tokens
        reach = tokens
        if w.progress is not None and self.cache.snapshots is not None:
            # a preempted request resumes within its prompt (snapshots lie at whole
            # sub-chunks: no deeper than its last one), never from another sequence's state
            # past it, which has the chunked form's bits where its own run decoded
            reach = tokens[: len(tokens) - w.progress.generated + 1]
        match = self.cache.lookup(reach, req.cache_namespace)
        if match.tokens < w.resume_at:
            return True  # a settle pass the cache no longer holds the start of: dropped
        new = pages_for(len(tokens)) - len(match.pages)
        generated = w.progress.generated if w.progress else 0
        room = pages_for(len(tokens) + req.max_tokens - generated) - pages_for(len(tokens))
        reserve = min(self.reserve_pages, max(room, 0))
        if self.committed_pages + new + self.cache.newly_held(match) + reserve \
                + self.floor_pages > self.budget_pages:
            return False
        slot.chain = self.cache.take(match, slot.kv, req.cache_namespace)  # (or nothing)
        copied = False
        try:
            if w.progress is not None and self.cache.snapshots is not None:
                # a preempted request computes its decoded positions as its decode steps did
                self.cache.snapshots.resume_exact(
                    slot.kv, len(tokens) - w.progress.generated)  # type: ignore[arg-type]
            pages_room = self.budget_pages - self._floors() - self.floor_pages
            slot.kv.add_pages(self.cache.allocate(new, pages_room))
            self.cache.copy_into(match, slot.kv)
            copied = True
            self.promised[slot.id] = reserve
            self.places[slot.id] = w
            w.place(slot, match.tokens, w.progress)
        except Exception:
            self._unplace(slot, tokens, match, copied)
            raise
        return True

    def _unplace(self, slot: Slot, tokens: list[int], match: Match, copied: bool) -> None:
        """Undo a placement that raised after `take`: the slot's pages go back to the cache
        as when a request is cancelled before its first step, but with only what the cache
        already held (the pages it matched idle again, a tail it took over a tail again;
        what was copied or granted is freed), and the slot is free again. `copied`: the
        copy's job is queued; it lets go of its source itself once it has run (it writes a
        freed page, before any later step that could read it: the MLX thread keeps order).
        A slot whose undo raises too stays busy: out of service, never reused half
        released."""
        self.promised.pop(slot.id, None)
        self.places.pop(slot.id, None)
        slot.busy = True
        if match.copy is not None and not copied:
            self.cache.cancel_copy(match)
        held = match.tokens - (match.copy[1] if match.copy is not None else 0)
        self.cache.finish(slot.kv, tokens[:held], slot.chain)
        slot.chain = Chain(None)
        slot.busy = False

    # ---- a running request's life -----------------------------------------------------

    def grow(self, slot: Slot, end: int) -> Growth:
        """Pages for positions [0, end) of a running slot, or what it must do instead."""
        need = pages_for(end) - len(slot.kv.pages)
        if need <= 0:
            return Growth.OK
        promise = self.promised.get(slot.id, 0)
        extra = max(0, need - promise)
        if self.committed_pages + extra <= self.budget_pages:
            self.promised[slot.id] = promise - (need - extra)
            slot.kv.add_pages(self.cache.allocate(need, self.budget_pages - self._floors()))
            return Growth.OK
        if len(slot.kv.pages) + need + self.floor_pages > self.budget_pages:
            return Growth.FULL  # its own context outgrows the whole budget
        if slot.request is not None and slot.request.background:
            return Growth.FULL  # a settle pass never waits, nor preempts, for a page
        if slot not in self.growth_waiters:
            self.growth_waiters.append(slot)
        # it waits from here, as pump's filter reads: a victim failed instead of preempted
        # (`_tell_running`) releases its pages and pumps before this returns
        slot.waiting_for_pages = True
        self._preempt_for_waiters()
        return Growth.WAIT

    def written(self, slot: Slot) -> None:
        """The slot's ledger grew: publish its new full pages (and let go of the window rows
        its next query no longer sees)."""
        self.cache.publish(slot.kv, slot.ledger, slot.chain)
        if self.cache.windows is not None:
            self.cache.slide(slot.kv, len(slot.ledger))
            self.cache.trim(self.budget_pages - self._floors())

    def release(self, slot: Slot, ledger: list[int], chain: Chain,
                settle: bool = False) -> None:
        """A slot finished: its pages go back to the cache; admit what now fits. `settle`:
        it finished as asked, so its generated tokens may get a settle pass."""
        if settle and self.settles is not None:
            self.settles.plan(ledger, state_snapshots.StateSnapshots.canonical_end(
                slot.kv), chain.namespace)  # type: ignore[arg-type]
        self._yielding = {y for y in self._yielding if y[0] != slot.id}
        discard = list(slot.kv.pages) if slot.id in self._discard else None
        self._discard.discard(slot.id)
        self._let_go(slot, ledger, chain)
        if discard is not None:  # a settle pass that ran past drop_idle: as if dropped then
            self.cache.evict_idle(discard)
        self.places.pop(slot.id, None)
        self._finished_at.append(time.monotonic())
        self.pump()

    def suspend(self, slot: Slot, request: GenerationRequest, progress: Progress,
                ledger: list[int], chain: Chain) -> None:
        """A preempted slot stepped back: requeue its request at the front (by arrival)."""
        self._let_go(slot, ledger, chain)
        placed = self.places.pop(slot.id)
        if request.background:  # a settle pass is not resumed: what it settled stays
            self.pump()
            return
        self.preemptions["budget"] += 1
        waiting = Waiting(request, placed.place, progress, placed.fail)
        # (it is placed again by pump once no running request waits for a page)
        pos = next((i for i, w in enumerate(self.queue)
                    if w.progress is None or w.request.arrived > request.arrived),
                   len(self.queue))
        self.queue.insert(pos, waiting)
        self.pump()

    def _let_go(self, slot: Slot, ledger: list[int], chain: Chain) -> None:
        self.cache.finish(slot.kv, ledger, chain)
        self.promised.pop(slot.id, None)
        if slot in self.growth_waiters:
            self.growth_waiters.remove(slot)
        if self.preempting == slot.id:
            self.preempting = None

    def drop_idle(self) -> int:
        """Evict every idle page (forces cold prefills; queued settle passes go too);
        returns the bytes freed."""
        if self.settles is not None:
            self.settles.clear()
            # (no message from here: tests and tools call this from outside the loop)
            self._discard.update(s.id for s in self.slots
                                 if s.request is not None and s.request.background)
        return self.cache.drop_idle() * self.page_bytes

    def retry_after(self) -> int:
        """Seconds until the queue should have room, from the observed finish rate."""
        now = time.monotonic()
        recent = [t for t in self._finished_at if now - t < 60]
        rate = len(recent) / max(now - recent[0], 1.0) if len(recent) >= 2 else 0.5
        return int(min(60, max(1, math.ceil((len(self.queue) + 1) / max(rate, 0.05)))))
