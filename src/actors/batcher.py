"""Batcher actor: the one loop that turns the slots' offers into fused steps.

Slots offer work by message (Ready, carrying the row they would feed). Each tick the
Batcher plans one step from the offers (every decoding slot's next token plus prefill
chunks under a token budget), runs it on the MLX thread, and tells each slot its result
(StepDone / StepFailed). It then waits only for the slots it just served to answer
(Ready again, or NoWork), so a slot that became ready during the step joins the next
tick and a slot waiting for a slow client is simply left out. Messages are handled as
they arrive (actors.base); the loop in `run` only decides when to step.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from dataclasses import dataclass, field

import structlog

from slotserve.actors.base import Actor, Handler, try_tell
from slotserve.actors.messages import (
    BatcherMessage,
    Ready,
    SlotMessage,
    StepDone,
    StepFailed,
    Withdraw,
    Withdrawn,
)
from slotserve.runtime.mlx_thread import MLXThread
from slotserve.runtime.runner import ModelRunner, RowWork

log = structlog.get_logger("slotserve.batcher")
_UNTOLD_RESULT = "telling a slot its step result failed: it takes it now"


@dataclass
class StepStats:
    """Running totals the benchmark and /metrics read."""

    steps: int = 0
    rows: int = 0
    decode_rows: int = 0
    prefill_tokens: int = 0
    model_seconds: float = 0.0
    tick_seconds: float = 0.0
    # (rows, model seconds, step start): wall time between busy step starts minus model
    # time is the engine's own per-step overhead
    recent: list[tuple[int, float, float]] = field(default_factory=list)


class Batcher(Actor[BatcherMessage]):
    mailbox_size = 4096

    def __init__(self, runner: ModelRunner, mlx: MLXThread, prefill_budget: int) -> None:
        super().__init__("batcher")
        self.runner = runner
        self.mlx = mlx
        self.prefill_budget = prefill_budget
        # prefill chunks end at multiples of this (the model's `prefill_align`: a Gated
        # DeltaNet computes whole sub-chunks at fixed positions, slotserve.model.deltanet)
        self.align: int = getattr(runner.model, "prefill_align", 1)
        self.offers: dict[int, Ready] = {}  # slot id -> its standing offer
        self.awaiting: set[int] = set()  # slots served by the last step, not yet answered
        self.stats = StepStats()
        self._arrived = asyncio.Event()

    def handle(self, msg: BatcherMessage) -> None:
        if isinstance(msg, Ready):
            self.offers[msg.slot_id] = msg
        elif isinstance(msg, Withdraw):
            offer = self.offers.get(msg.slot_id)
            if offer is not None and offer.epoch == msg.epoch:
                del self.offers[msg.slot_id]
                self._withdrawn(offer)
            return  # not an answer to a step: a step that took the offer answers itself
        self.awaiting.discard(msg.slot_id)
        self._arrived.set()

    def _withdrawn(self, offer: Ready) -> None:
        """Answer a withdrawn offer (Withdrawn). Should the tell raise, the offer stands
        again: the step that takes it answers (StepDone), as for a Withdraw that came after
        a step took the offer, and the slot does with that answer what Withdrawn would have
        done. Dropped unanswered, the offer would leave its slot waiting for ever (in flight,
        its pages held; a preempted one never stepping back, and admission's preemption with
        it, so every request waiting for a page)."""
        if try_tell(offer.slot, Withdrawn(offer.epoch), "telling a slot its offer was "
                    "withdrawn failed: the offer stands, a step answers it",
                    slot=offer.slot_id) is not None:
            self.offers[offer.slot_id] = offer

    async def run(self) -> None:
        """Step whenever there are offers and the last step's slots have all answered."""
        while True:
            while self.awaiting or not self.offers:
                self._arrived.clear()
                await self._arrived.wait()
            work = self._plan()
            if work:
                await self._step(work)

    def _plan(self) -> list[tuple[Handler[SlotMessage], RowWork]]:
        """Decode rows first (one token each), then prefill chunks under the token budget.

        Prefill: the oldest waiting prompt always gets at least half the budget (nothing
        starves), the rest goes to the prompts closest to their first token (the oldest's
        own remainder among them), so a short chat is not held behind a long document and
        prompts of one length get their first tokens one after another. Chunking never
        changes a request's tokens: rows are computed the same way in any batch (the
        batch-invariance rules).
        """
        decode = [o for o in self.offers.values() if not o.prefilling]
        prefill = [o for o in self.offers.values() if o.prefilling and not o.background]
        background = sorted((o for o in self.offers.values() if o.prefilling and o.background),
                            key=lambda o: o.arrived_at)
        self.offers = {}
        planned = [(o.slot, o.work) for o in decode]
        budget = max(self.prefill_budget - len(planned), 1)
        for offer, take in self._share_prefill(prefill, budget):
            if take <= 0:
                self.offers[offer.slot_id] = offer  # next tick
            else:
                take = self._aligned(offer.work, take)
                budget -= take
                planned.append((offer.slot, _feed(offer.work, take)))
        for offer in background:  # settle passes: what the prompts left of the budget
            w = offer.work
            # beside other rows one aligned chunk a tick, alone four (steps stay short: a
            # request that arrives waits for one at most)
            cap = self.align if planned else 4 * self.align
            take = max(min(len(w.tokens), budget, cap), 0)
            whole = take == len(w.tokens) or (w.start + take) // self.align * self.align \
                > w.start  # (an aligned chunk fits in it)
            if planned and not whole:
                self.offers[offer.slot_id] = offer  # next tick
                continue
            take = self._aligned(w, max(take, 1))  # (alone in the step: at least one chunk)
            budget -= take
            planned.append((offer.slot, _feed(offer.work, take)))
        return planned

    @staticmethod
    def _share_prefill(prefill: list[Ready], budget: int) -> list[tuple[Ready, int]]:
        """(offer, tokens to feed this tick) for every slot waiting to prefill."""
        if not prefill:
            return []
        prefill.sort(key=lambda o: o.arrived_at)
        oldest = prefill[0]
        shares = {o.slot_id: 0 for o in prefill}
        shares[oldest.slot_id] = min(len(oldest.work.tokens), max(budget // 2, 1))
        left = budget - shares[oldest.slot_id]

        def remaining(o: Ready) -> int:
            return len(o.work.tokens) - shares[o.slot_id]

        # the rest by tokens left to their first token, the oldest's remainder among them:
        # prompts of one length go one after another, not two at half speed each
        for o in sorted(prefill, key=lambda o: (remaining(o), o.arrived_at)):
            take = min(remaining(o), left)
            shares[o.slot_id] += take
            left -= take
        return [(o, shares[o.slot_id]) for o in prefill]

    def _aligned(self, work: RowWork, take: int) -> int:
        """A prefill share cut back to end at a multiple of `align` (or the offer's end;
        at least up to the next multiple, so a chunk is never empty)."""
        if self.align == 1 or take >= len(work.tokens):
            return take
        end = (work.start + take) // self.align * self.align
        if end <= work.start:
            end = (work.start // self.align + 1) * self.align
        return min(end - work.start, len(work.tokens))

    async def _step(self, planned: list[tuple[Handler[SlotMessage], RowWork]]) -> None:
        t0 = time.perf_counter()
        work = [w for _, w in planned]
        for w in work:  # sliding-window layers: rows for the pages these rows write
            w.kv.open_window(w.start, w.start + len(w.tokens))
        self.awaiting.update(w.slot_id for w in work)
        try:
            out = await self.mlx.run(lambda: self.runner.step(work))
        except Exception as exc:  # contain: fail these requests, keep serving
            log.exception("step failed", rows=sum(len(w.tokens) for w in work))
            for slot, w in planned:
                slot.tell_or_handle(StepFailed(w.epoch, f"model step failed: {exc}"),
                                    _UNTOLD_RESULT, slot_id=w.slot_id)
            return
        # every served slot gets its result, whatever another's tell does: a slot without
        # one never offers again, and the Batcher waits for its answer
        for slot, w in planned:
            slot.tell_or_handle(StepDone(w.epoch, len(w.tokens), out.sampled.get(w.slot_id)),
                                _UNTOLD_RESULT, slot_id=w.slot_id)
        tick = time.perf_counter() - t0
        st = self.stats
        st.steps += 1
        st.rows += out.rows
        st.decode_rows += sum(1 for w in work if len(w.tokens) == 1 and w.sample)
        st.prefill_tokens += sum(len(w.tokens) for w in work if len(w.tokens) > 1)
        st.model_seconds += out.seconds
        st.tick_seconds += tick
        st.recent.append((out.rows, out.seconds, t0))
        if len(st.recent) > 4096:
            del st.recent[:2048]


def _feed(work: RowWork, take: int) -> RowWork:
    """The first `take` of an offer's pending tokens; it samples only if they are all fed."""
    if take >= len(work.tokens):
        return work
    return dataclasses.replace(work, tokens=work.tokens[:take], sample=False)
