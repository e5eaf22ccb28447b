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
from typing import TYPE_CHECKING

from slotserve.actors.base import Actor
from slotserve.actors.messages import (
    Assign,
    CacheNamespace,
    Cancel,
    FinishEvent,
    GenerationRequest,
    Parked,
    Ready,
    Resume,
    SlotMessage,
    StepDone,
    StepResult,
    TokenEvent,
    TokenLogprob,
    Usage,
)
from slotserve.model.kv import SlotKV
from slotserve.runtime.grammar import Matcher
from slotserve.runtime.runner import RowWork
from slotserve.runtime.sampling import RowState

if TYPE_CHECKING:
    from slotserve.actors.batcher import Batcher
    from slotserve.actors.session import Session


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

    def __init__(self, slot_id: int, kv: SlotKV, batcher: Batcher,
                 on_finish: Callable[[Slot, str], None]) -> None:
        super().__init__(f"slot-{slot_id}")
        self.id = slot_id
        self.kv = kv
        self.batcher = batcher
        self.on_finish = on_finish
        # called when a cancelled request's last step returns: only now can the slot be reused
        self.on_idle: Callable[[Slot], None] | None = None
        self.ledger: list[int] = []
        # the cache namespace of the request that computed the ledger's KV (None: private)
        self.namespace: CacheNamespace | None = None
        self.epoch = 0
        self.busy = False  # reserved by admission or serving a request
        self.in_flight = False  # part of the step the Batcher is running now
        self.parked = False
        self.last_used = 0.0
        self.request: GenerationRequest | None = None
        self.session: Session | None = None
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

    def work(self, max_tokens: int) -> RowWork:
        """This slot's rows for the next step (a prefill chunk or one decode token)."""
        assert self.request is not None and self.state is not None
        n = min(max_tokens, len(self.pending))
        req = self.request
        return RowWork(
            slot_id=self.id, kv=self.kv, start=len(self.ledger), tokens=self.pending[:n],
            sample=n == len(self.pending), params=req.params, state=self.state,
            draw=self.generated, logprobs=req.logprobs, top_logprobs=req.top_logprobs,
            grammar=self.matcher,
        )

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

    def step_result(self, msg: StepResult) -> None:
        """The Batcher's result for this slot's rows, delivered by a direct call.

        A step's results reach all its slots in one pass of the Batcher, without a mailbox
        hop and task switch per slot per token. Safe because every actor runs on the one
        event loop and this never awaits; a crash is contained as in the mailbox loop.
        """
        try:
            if isinstance(msg, StepDone):
                self._step_done(msg)
            else:
                self.in_flight = False
                if msg.epoch == self.epoch and self.request is not None:
                    self._finish("error", msg.error)
                self.batcher.tell(Parked(self.id))
                self._idle()
        except Exception as exc:
            self.contain(msg, exc)

    async def handle(self, msg: SlotMessage) -> None:
        if isinstance(msg, Assign):
            self._assign(msg)
        elif isinstance(msg, Cancel):
            if msg.epoch == self.epoch and self.request is not None:
                if msg.reason == "shutdown":
                    self._finish("error", "server shutting down")
                else:
                    self._finish(msg.reason)
        elif isinstance(msg, Resume):
            if msg.epoch == self.epoch and self.parked and self.request is not None:
                self.parked = False
                self.batcher.tell(Ready(self.id, self.epoch))

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
        self.parked = False
        self.state = RowState(req.params, req.prompt_ids)
        self.matcher = req.grammar.matcher() if req.grammar is not None else None
        self.arrived_at = req.arrived
        self.batcher.tell(Ready(self.id, self.epoch))

    def _step_done(self, msg: StepDone) -> None:
        self.in_flight = False
        if msg.epoch != self.epoch or self.request is None:
            self.batcher.tell(Parked(self.id))
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
                self.batcher.tell(Parked(self.id))
                return
            lp = None if s.logprob is None else TokenLogprob(s.token, s.logprob, s.top_logprobs)
            session.deliver(TokenEvent(s.token, lp))
            if self.matcher is not None and self._grammar_done():
                return
            if self.generated >= req.max_tokens:
                self._finish("length")
                self.batcher.tell(Parked(self.id))
                return
            self.pending = [s.token]
        if session.has_room():
            self.batcher.tell(Ready(self.id, self.epoch))
        else:  # backpressure: skip ticks until the session drains
            self.parked = True
            self.batcher.tell(Parked(self.id))

    def _grammar_done(self) -> bool:
        """Finish when the grammar is complete (only a stop token could follow) or broken."""
        assert self.matcher is not None
        error = self.matcher.error
        if error is None and not self.matcher.stopped:
            return False
        self._finish("error" if error else "stop",
                     f"constrained decoding failed: {error}" if error else None)
        self.batcher.tell(Parked(self.id))
        return True

    def _idle(self) -> None:
        if not self.busy and self.on_idle is not None:
            self.on_idle(self)

    def _finish(self, reason: str, error: str | None = None) -> None:
        assert self.request is not None and self.session is not None
        usage = Usage(len(self.request.prompt_ids), self.generated, self.reused)
        self.session.deliver(FinishEvent(reason, usage, error))
        self.request = None
        self.session = None
        self.state = None
        self.matcher = None
        self.pending = []
        self.busy = False
        self.parked = False
        self.epoch += 1
        self.last_used = time.monotonic()
        self.on_finish(self, reason)

    def on_crash(self, msg: SlotMessage | StepResult, exc: Exception) -> None:
        self.in_flight = False
        if self.request is not None and self.session is not None:
            self._finish("error", f"internal error in slot: {exc}")
        self.batcher.tell(Parked(self.id))
