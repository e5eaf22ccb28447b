"""Slot actor: owns one KV slot and the state of the request it serves.

The token ledger lists the tokens whose K/V are resident at positions 0..n-1. It
survives the request, so a later request sharing a prefix skips that prefill.
`epoch` changes with every assignment and finish, so a step result or a Ready
that belongs to an earlier request is recognised and ignored. `namespace` is the cache
namespace the resident KV belongs to: only a request of the same namespace reuses it.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from slotserve.actors.base import Actor, Address
from slotserve.actors.messages import (
    Assign,
    BatcherMessage,
    CacheNamespace,
    Cancel,
    FinishEvent,
    GenerationRequest,
    NoWork,
    Ready,
    Resume,
    SessionMessage,
    SlotMessage,
    Started,
    StepDone,
    StepFailed,
    TokenEvent,
    TokenLogprob,
    Usage,
    Withdraw,
    Withdrawn,
)
from slotserve.model.kv import SlotKV
from slotserve.runtime.grammar import Matcher
from slotserve.runtime.runner import RowWork
from slotserve.runtime.sampling import RowState


def common_prefix(a: list[int], b: list[int]) -> int:
    """Length of the longest common prefix. Compared a chunk at a time (list equality runs
    in C): admission compares a prompt with every conversation's ledger, and agents share
    system prompts thousands of tokens long."""
    n = min(len(a), len(b))
    i = 0
    for chunk in (256, 16, 1):
        while i + chunk <= n and a[i : i + chunk] == b[i : i + chunk]:
            i += chunk
    return i


class Slot(Actor[SlotMessage]):
    mailbox_size = 16

    def __init__(self, slot_id: int, kv: SlotKV, batcher: Address[BatcherMessage],
                 on_finish: Callable[[Slot, str], None]) -> None:
        super().__init__(f"slot-{slot_id}")
        self.id = slot_id
        self.kv = kv
        self.batcher = batcher
        self.on_finish = on_finish
        # called when a finished request's last outstanding offer is answered: only now can
        # the slot be reused (a step may have been writing its KV)
        self.on_idle: Callable[[Slot], None] | None = None
        self.ledger: list[int] = []
        # the cache namespace of the request that computed the ledger's KV (None: private)
        self.namespace: CacheNamespace | None = None
        self.epoch = 0
        self.busy = False  # reserved by admission or serving a request
        # an offer (Ready) is out: a step may be writing this slot's KV until it is answered
        self.in_flight = False
        self.waiting_for_client = False  # backpressure: no offers until the session resumes
        self.last_used = 0.0
        self.request: GenerationRequest | None = None
        self.session: Address[SessionMessage] | None = None
        self.pending: list[int] = []
        self.generated = 0
        self.reused = 0
        self.state: RowState | None = None
        self.matcher: Matcher | None = None  # the request's grammar position, if constrained
        self.arrived_at = 0.0

    # ---- read by admission and the Batcher (same event loop, no awaits) -----------

    def prefix_match(self, prompt: list[int], namespace: CacheNamespace | None) -> int:
        """Resident tokens a request with this prompt could reuse (one is always re-fed):
        none unless the request is in the cache namespace the resident KV belongs to."""
        if namespace is None or namespace != self.namespace:
            return 0
        return min(common_prefix(self.ledger, prompt), max(len(prompt) - 1, 0))

    def reserve(self) -> int:
        """Claim the slot for a request admission has chosen; returns the new epoch."""
        self.busy = True
        self.epoch += 1
        return self.epoch

    def _offer(self) -> None:
        """Offer this slot's pending tokens for the next step (Ready)."""
        assert self.request is not None and self.state is not None
        req = self.request
        work = RowWork(
            slot_id=self.id, kv=self.kv, start=len(self.ledger), tokens=self.pending,
            sample=True, params=req.params, state=self.state, draw=self.generated,
            logprobs=req.logprobs, top_logprobs=req.top_logprobs, grammar=self.matcher,
            epoch=self.epoch,
        )
        self.in_flight = True
        self.batcher.tell(Ready(self.id, self.epoch, work, self.prefilling, self.arrived_at,
                                self))

    @property
    def prefilling(self) -> bool:
        return len(self.pending) > 1 or (self.generated == 0 and bool(self.pending))

    def evict(self) -> None:
        """Drop the retained KV of an idle slot (admission needs the bytes)."""
        assert not self.busy and not self.in_flight
        self.kv.release()
        self.ledger = []
        self.namespace = None

    def detach(self) -> tuple[list[int], SlotKV]:
        """Hand over the retained conversation (ledger + its KV pages); keep an empty KV."""
        assert not self.busy and not self.in_flight
        ledger, kv = self.ledger, self.kv
        self.ledger, self.kv, self.namespace = [], SlotKV(kv.pool), None
        return ledger, kv

    def adopt(self, ledger: list[int], kv: SlotKV, namespace: CacheNamespace | None) -> None:
        """Take over a parked conversation (this slot's own retained KV must be gone)."""
        assert not self.busy and not self.in_flight and not self.kv.pages
        self.ledger, self.kv, self.namespace = ledger, kv, namespace

    # ---- messages --------------------------------------------------------------------

    def handle(self, msg: SlotMessage) -> None:
        if isinstance(msg, StepDone):
            self._step_done(msg)
        elif isinstance(msg, StepFailed):
            self.in_flight = False
            if msg.epoch == self.epoch and self.request is not None:
                self._finish("error", msg.error)
            self.batcher.tell(NoWork(self.id))
            self._idle()
        elif isinstance(msg, Withdrawn):
            self.in_flight = False
            self._idle()
        elif isinstance(msg, Assign):
            self._assign(msg)
        elif isinstance(msg, Cancel):
            if msg.epoch == self.epoch and self.request is not None:
                if msg.reason == "shutdown":
                    self._finish("error", "server shutting down")
                else:
                    self._finish(msg.reason)
        elif isinstance(msg, Resume):
            if msg.epoch == self.epoch and self.waiting_for_client and self.request is not None:
                self.waiting_for_client = False
                self._offer()

    def _assign(self, msg: Assign) -> None:
        req = msg.request
        self.request, self.session = req, msg.session  # type: ignore[assignment]
        # from the first position this request writes on, no page may be another's; KV of
        # another cache namespace is never reused (admission parks it first; this is the check)
        self.reused = self.kv.writable_from(self.prefix_match(req.prompt_ids,
                                                              req.cache_namespace))
        self.ledger = self.ledger[: self.reused]
        self.namespace = req.cache_namespace
        self.pending = list(req.prompt_ids[self.reused :])
        self.generated = 0
        self.waiting_for_client = False
        self.state = RowState(req.params, req.prompt_ids)
        self.matcher = req.grammar.matcher() if req.grammar is not None else None
        self.arrived_at = req.arrived
        msg.session.tell(Started(self.reused))
        self._offer()

    def _step_done(self, msg: StepDone) -> None:
        self.in_flight = False
        if msg.epoch != self.epoch or self.request is None:
            self.batcher.tell(NoWork(self.id))
            self._idle()
            return
        req, session = self.request, self.session
        assert session is not None and self.state is not None
        self.ledger.extend(self.pending[: msg.fed])
        self.pending = self.pending[msg.fed :]
        if msg.sampled is not None:
            s = msg.sampled
            self.generated += 1
            self.state.observe(s.token)
            if s.token in req.stop_ids:
                self._finish("stop")
                self.batcher.tell(NoWork(self.id))
                return
            lp = None if s.logprob is None else TokenLogprob(s.token, s.logprob, s.top_logprobs)
            session.tell(TokenEvent(s.token, lp))
            if self.matcher is not None and self._grammar_done():
                return
            if self.generated >= req.max_tokens:
                self._finish("length")
                self.batcher.tell(NoWork(self.id))
                return
            self.pending = [s.token]
        if session.room() >= 2:  # room for a token and a finish event
            self._offer()
        else:  # backpressure: skip ticks until the session drains (it sends Resume)
            self.waiting_for_client = True
            self.batcher.tell(NoWork(self.id))

    def _grammar_done(self) -> bool:
        """Finish when the grammar is complete (only a stop token could follow) or broken."""
        assert self.matcher is not None
        error = self.matcher.error
        if error is None and not self.matcher.stopped:
            return False
        self._finish("error" if error else "stop",
                     f"constrained decoding failed: {error}" if error else None)
        self.batcher.tell(NoWork(self.id))
        return True

    def _idle(self) -> None:
        if not self.busy and self.on_idle is not None:
            self.on_idle(self)

    def _finish(self, reason: str, error: str | None = None) -> None:
        assert self.request is not None and self.session is not None
        usage = Usage(len(self.request.prompt_ids), self.generated, self.reused)
        self.session.tell(FinishEvent(reason, usage, error))
        if self.in_flight:  # an offer is out: drop it, or let the step that took it answer
            self.batcher.tell(Withdraw(self.id, self.epoch))
        self.request = None
        self.session = None
        self.state = None
        self.matcher = None
        self.pending = []
        self.busy = False
        self.waiting_for_client = False
        self.epoch += 1
        self.last_used = time.monotonic()
        self.on_finish(self, reason)

    def on_crash(self, msg: SlotMessage, exc: Exception) -> None:
        was_step = isinstance(msg, StepDone | StepFailed)
        if was_step:
            self.in_flight = False
        if self.request is not None and self.session is not None:
            self._finish("error", f"internal error in slot: {exc}")
        if was_step:  # the Batcher waits for every served slot's answer
            self.batcher.tell(NoWork(self.id))
            self._idle()
