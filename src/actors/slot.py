"""Slot actor: one execution lane of the fused step, and the request it serves.

The token ledger lists the tokens whose K/V are written at positions 0..n-1 of the slot's
pages. Admission hands the slot its pages with the request (those the prefix cache already
holds first, so `reused` prompt tokens need no prefill) and takes them back when the
request ends; full pages are published to the cache as they fill, so other requests can
share them while this one still runs. Before each offer the slot asks admission for the
pages its next rows write (`Placement.grow`): granted; wait (for a page admission frees by
preempting a younger request, which steps back on `Preempt`); or full (its own context
outgrows the whole budget). `epoch` changes with every assignment and finish, so a step
result or a Ready that belongs to an earlier request is recognised and ignored.
"""

from __future__ import annotations

import enum
import time
from typing import Protocol

import structlog

from slotserve.actors.base import Actor, Address, Handler, try_tell
from slotserve.actors.kv_cache import Chain
from slotserve.actors.messages import (
    Assign,
    BatcherMessage,
    Cancel,
    FinishEvent,
    GenerationRequest,
    NoWork,
    PagesReady,
    Preempt,
    Progress,
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

log = structlog.get_logger("slotserve.slot")


class Growth(enum.Enum):
    OK = "ok"  # the pages are there
    WAIT = "wait"  # no page free: PagesReady follows (once a preemption or a finish frees one)
    FULL = "full"  # its own context needs more than the whole budget


class Placement(Protocol):
    """What a slot asks of admission (slotserve.actors.admission.Admission)."""

    def grow(self, slot: Slot, end: int) -> Growth: ...

    def written(self, slot: Slot) -> None: ...

    def release(self, slot: Slot, ledger: list[int], chain: Chain,
                settle: bool = False) -> None: ...

    def suspend(self, slot: Slot, request: GenerationRequest, progress: Progress,
                ledger: list[int], chain: Chain) -> None: ...

    def pump(self) -> None: ...


class Slot(Actor[SlotMessage]):
    mailbox_size = 16

    def __init__(self, slot_id: int, kv: SlotKV, batcher: Handler[BatcherMessage]) -> None:
        super().__init__(f"slot-{slot_id}")
        self.id = slot_id
        self.kv = kv
        self.batcher = batcher
        self.placement: Placement | None = None  # set by the engine once admission exists
        self.chain = Chain(None)
        self.ledger: list[int] = []
        self.epoch = 0
        self.busy = False  # reserved by admission or serving a request
        # an offer (Ready) is out: a step may be writing this slot's KV until it is answered
        self.in_flight = False
        self.waiting_for_client = False  # backpressure: no offers until the session resumes
        self.waiting_for_pages = False  # no offers until admission has pages (PagesReady)
        self.preempt_requested = False  # step back once the step in flight has answered
        # a request that ended while a step could still be writing its pages: they go back
        # to the cache when that step has answered (ledger and chain to release them under)
        # (and whether it finished as asked: its generated tokens may be settled)
        self._release_after: tuple[list[int], Chain, bool] | None = None
        self.last_used = 0.0
        self.request: GenerationRequest | None = None
        self.session: Address[SessionMessage] | None = None
        self.pending: list[int] = []
        self.generated = 0
        self.reused = 0
        self.state: RowState | None = None
        self.matcher: Matcher | None = None  # the request's grammar position, if constrained
        self.arrived_at = 0.0

    def reserve(self) -> int:
        """Claim the slot for a request admission has chosen; returns the new epoch."""
        self.busy = True
        self.epoch += 1
        return self.epoch

    def fail(self, error: str) -> None:
        """End the request now with a server error, from outside the mailbox: admission
        calls it for a running slot it could not tell a message (PagesReady, Preempt,
        Cancel) that the request needs to go on or to step back. It ends as a failed step
        ends it: the session hears `error`, and the pages go back through the finish path
        (after the step in flight answers, if one is out)."""
        if self.request is not None and self.session is not None:
            self._finish("error", error)

    @property
    def prefilling(self) -> bool:
        return len(self.pending) > 1 or (self.generated == 0 and bool(self.pending))

    # ---- messages --------------------------------------------------------------------

    def handle(self, msg: SlotMessage) -> None:
        if isinstance(msg, StepDone):
            self._step_done(msg)
        elif isinstance(msg, StepFailed):
            self.in_flight = False
            if msg.epoch == self.epoch and self.request is not None:
                self._finish("error", msg.error)
            self._answer_batcher(NoWork(self.id))
            self._idle()
        elif isinstance(msg, Withdrawn):
            self.in_flight = False
            if self.preempt_requested and self.request is not None:
                self._step_back()
            self._idle()
        elif isinstance(msg, Assign):
            self._assign(msg)
        elif isinstance(msg, Cancel):
            self._cancel(msg)
        elif isinstance(msg, Resume):
            if msg.epoch == self.epoch and self.waiting_for_client and self.request is not None:
                self.waiting_for_client = False
                self._offer()
        elif isinstance(msg, PagesReady):
            if msg.epoch == self.epoch and self.waiting_for_pages and self.request is not None:
                self.waiting_for_pages = False
                self._offer()
        elif isinstance(msg, Preempt):
            if msg.epoch != self.epoch or self.request is None:
                return
            if self.in_flight:  # the offer may already be in a step: step back after it
                self.preempt_requested = True
                self._withdraw()
            else:
                self._step_back()

    def _cancel(self, msg: Cancel) -> None:
        if msg.epoch == self.epoch and self.request is not None:
            if msg.reason == "shutdown":
                self._finish("error", "server shutting down")
            else:
                self._finish(msg.reason)

    def cancel(self, epoch: int, reason: str) -> None:
        """End the request of `epoch` (reason "cancelled", "stop" or "shutdown"): told as a
        Cancel, so it is handled in order after what the slot was told before. Should that
        tell raise (a full mailbox, a protocol bug), it is handled now, from outside the
        mailbox, as admission's `fail` is: the senders (a session whose client left or whose
        stop string matched, the engine shutting down) must go on (close, shut the others
        down), and the slot must not decode for nobody until its max_tokens, holding its
        pages. Its pages go back through the finish path either way."""
        self.tell_or_handle(Cancel(epoch, reason),
                            "telling a slot to cancel failed: it cancels now", reason=reason)

    def _withdraw(self) -> None:
        """Ask the Batcher to drop the offer that is out (Withdraw). Should the tell raise,
        only a row is lost: the offer stands, the step that takes it answers (StepDone),
        and that answer does what Withdrawn would have (release the finished request's
        pages, or step back). Left to propagate, the error would stop the finish or the
        step back halfway: the request left on the slot, decoding for a session that has
        its final delta, or a preempted one resumed for nobody."""
        try_tell(self.batcher, Withdraw(self.id, self.epoch), "telling the batcher to "
                 "withdraw an offer failed: the step that takes it answers", slot=self.id)

    def _assign(self, msg: Assign) -> None:
        req, p = msg.request, msg.progress
        self.request, self.session = req, msg.session
        tokens = p.tokens if p is not None else req.prompt_ids
        self.ledger = list(tokens[: msg.reused])
        self.pending = list(tokens[msg.reused :])
        self.waiting_for_client = self.waiting_for_pages = self.preempt_requested = False
        if p is None:
            self.generated, self.reused = 0, msg.reused
            self.state = RowState(req.params, req.prompt_ids)
            self.matcher = req.grammar.matcher() if req.grammar is not None else None
            msg.session.tell(Started(self.reused))
        else:  # a preempted request resumes where it stood
            self.generated, self.reused = p.generated, p.reused
            self.state, self.matcher = p.state, p.matcher
        self.arrived_at = req.arrived
        self._offer()

    def _offer(self) -> bool:
        """Offer this slot's pending tokens for the next step (Ready), once admission has
        the pages they write; False when nothing was offered."""
        assert self.request is not None and self.state is not None
        assert self.placement is not None
        growth = self.placement.grow(self, len(self.ledger) + len(self.pending))
        if self.request is None:  # admission failed it meanwhile (it could not be preempted)
            return False
        if growth is Growth.WAIT:
            self.waiting_for_pages = True
            return False
        if growth is Growth.FULL:
            log.warning("context outgrew the whole KV budget", slot=self.id,
                        tokens=len(self.ledger) + len(self.pending))
            self._finish("length")
            return False
        req = self.request
        work = RowWork(
            slot_id=self.id, kv=self.kv, start=len(self.ledger), tokens=self.pending,
            sample=True, params=req.params, state=self.state, draw=self.generated,
            logprobs=req.logprobs, top_logprobs=req.top_logprobs, grammar=self.matcher,
            epoch=self.epoch,
        )
        self.in_flight = True
        self._answer_batcher(Ready(self.id, self.epoch, work, self.prefilling,
                                   self.arrived_at, self, req.background))
        return True

    def _answer_batcher(self, msg: Ready | NoWork) -> None:
        """Offer (Ready) or answer that there is nothing (NoWork): the Batcher waits for one
        of them from every slot it served before it steps again, so one that cannot be told
        is handled now, never dropped (a dropped one would stop every request's decoding)."""
        self.batcher.tell_or_handle(msg, "telling the batcher failed: it takes it now",
                                    slot=self.id)

    def _answer(self) -> None:
        """After a step result: offer again, or tell the Batcher there is nothing (it waits
        for an answer from every slot it served)."""
        if self.preempt_requested:
            self._step_back()
        elif self._offer():
            return
        self._answer_batcher(NoWork(self.id))

    def _step_done(self, msg: StepDone) -> None:
        self.in_flight = False
        if msg.epoch != self.epoch or self.request is None:
            self._answer_batcher(NoWork(self.id))
            self._idle()
            return
        req, session = self.request, self.session
        assert session is not None and self.state is not None and self.placement is not None
        self.ledger.extend(self.pending[: msg.fed])
        self.pending = self.pending[msg.fed :]
        self.placement.written(self)
        if msg.sampled is not None:
            s = msg.sampled
            self.generated += 1
            self.state.observe(s.token)
            if s.token in req.stop_ids:
                self._finish("stop")
                self._answer_batcher(NoWork(self.id))
                return
            lp = None if s.logprob is None else TokenLogprob(s.token, s.logprob, s.top_logprobs)
            session.tell(TokenEvent(s.token, lp))
            if self.matcher is not None and self._grammar_done():
                return
            if self.matcher is not None:
                self.matcher = self.matcher.current()
            if self.generated >= req.max_tokens:
                self._finish("length")
                self._answer_batcher(NoWork(self.id))
                return
            self.pending = [s.token]
        if self.preempt_requested:
            self._step_back()
            self._answer_batcher(NoWork(self.id))
            return
        if session.room() < 2:  # backpressure: skip ticks until the session drains
            self.waiting_for_client = True
            self._answer_batcher(NoWork(self.id))
            return
        self._answer()

    def _grammar_done(self) -> bool:
        """Finish when the grammar is complete (only a stop token could follow) or broken."""
        assert self.matcher is not None
        error = self.matcher.error
        if error is None and not self.matcher.stopped:
            return False
        self._finish("error" if error else "stop",
                     f"constrained decoding failed: {error}" if error else None)
        self._answer_batcher(NoWork(self.id))
        return True

    def _idle(self) -> None:
        """The last step of a finished request has answered: its pages go back now."""
        if self.placement is None:
            return
        if self._release_after is not None:
            ledger, chain, settle = self._release_after
            self._release_after = None
            self.busy = False
            self.placement.release(self, ledger, chain, settle)
        elif not self.busy:
            self.placement.pump()

    def _clear(self) -> tuple[list[int], Chain]:
        """Forget the request (the slot is free from here on); returns the ledger and chain
        its pages are released under."""
        ledger, chain = self.ledger, self.chain
        self.chain = Chain(None)
        self.request = None
        self.session = None
        self.state = None
        self.matcher = None
        self.pending = []
        self.ledger = []
        self.busy = False
        self.waiting_for_client = self.waiting_for_pages = self.preempt_requested = False
        self.epoch += 1
        self.last_used = time.monotonic()
        return ledger, chain

    def _step_back(self) -> None:
        """Preempted: hand the request's state to admission (it requeues it) and the pages
        back to the cache; the session waits without noticing."""
        assert self.request is not None and self.state is not None and self.placement is not None
        assert not self.in_flight, "a slot steps back only once its offer is answered"
        request = self.request
        progress = Progress(self.ledger + self.pending, self.generated, self.state,
                            self.matcher, self.reused)
        ledger, chain = self._clear()
        self.placement.suspend(self, request, progress, ledger, chain)

    def _finish(self, reason: str, error: str | None = None) -> None:
        assert self.request is not None and self.session is not None
        assert self.placement is not None
        usage = Usage(len(self.request.prompt_ids), self.generated, self.reused)
        self.session.tell(FinishEvent(reason, usage, error))
        # a request that ended as asked may leave its generated tokens to a settle pass
        settle = reason in ("stop", "length") and not self.request.background
        in_flight = self.in_flight
        if in_flight:  # an offer is out: drop it, or let the step that took it answer
            self._withdraw()
        ledger, chain = self._clear()
        if in_flight:  # that step may still write these pages: release them after it
            self._release_after = (ledger, chain, settle)
            self.busy = True  # not placeable, and its pages still count, until then
        else:
            self.placement.release(self, ledger, chain, settle)

    def on_crash(self, msg: SlotMessage, exc: Exception) -> None:
        was_step = isinstance(msg, StepDone | StepFailed)
        if was_step:
            self.in_flight = False
        if self.request is not None and self.session is not None:
            self._finish("error", f"internal error in slot: {exc}")
        if was_step:  # the Batcher waits for every served slot's answer
            self._answer_batcher(NoWork(self.id))
            self._idle()
