"""Batcher actor: the one loop that turns ready slots into fused steps.

Each tick it gathers Ready slots, plans one step (every decoding slot's next
token plus prefill chunks under a token budget), runs it on the MLX thread, and
sends each slot its result. It then waits only for the slots it just served to
answer (Ready again, or Parked), so a slot that became ready during the step
joins the next tick and a parked slot (slow client) is simply left out.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import anyio
import structlog

from slotserve.actors.base import Actor
from slotserve.actors.messages import BatcherMessage, Ready, StepDone, StepFailed
from slotserve.runtime.mlx_thread import MLXThread
from slotserve.runtime.runner import ModelRunner, RowWork, StepOutput

if TYPE_CHECKING:
    from slotserve.actors.slot import Slot

log = structlog.get_logger("slotserve.batcher")

ACK_TIMEOUT = 5.0


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
        self.slots: dict[int, Slot] = {}
        self.ready: dict[int, int] = {}  # slot id -> epoch
        self.awaiting: set[int] = set()
        self.stats = StepStats()
        self.on_step: Callable[[StepOutput, list[RowWork]], None] | None = None

    async def handle(self, msg: BatcherMessage) -> None:
        if isinstance(msg, Ready):
            self.ready[msg.slot_id] = msg.epoch
        self.awaiting.discard(msg.slot_id)

    async def run(self) -> None:
        async with self._recv:
            while True:
                if not self.ready and not self.awaiting:
                    msg = await self._recv.receive()
                    await self.handle(msg)
                await self._gather()
                work = self._plan()
                if work:
                    await self._step(work)

    async def _gather(self) -> None:
        """Take every message already queued; wait for acks of the last step's slots."""
        deadline = time.monotonic() + ACK_TIMEOUT
        while True:
            try:
                msg = self._recv.receive_nowait()
            except anyio.WouldBlock:
                if not self.awaiting:
                    return
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    log.error("slots did not acknowledge a step", slots=sorted(self.awaiting))
                    self.awaiting.clear()
                    return
                with anyio.move_on_after(remaining):
                    msg = await self._recv.receive()
                    await self.handle(msg)
                continue
            await self.handle(msg)

    def _plan(self) -> list[RowWork]:
        """Decode rows first (one token each), then prefill chunks under the token budget.

        Prefill: the oldest waiting prompt always gets at least half the budget (nothing
        starves), the rest goes to the prompts closest to their first token, so a short
        chat is not held behind a long document. Chunking never changes a request's tokens:
        rows are computed the same way in any batch (the batch-invariance rules).
        """
        decode: list[Slot] = []
        prefill: list[Slot] = []
        for sid, epoch in self.ready.items():
            slot = self.slots[sid]
            if slot.epoch != epoch or slot.request is None or not slot.pending:
                continue
            (prefill if slot.prefilling else decode).append(slot)
        self.ready.clear()
        work = [s.work(1) for s in decode]
        budget = max(self.prefill_budget - len(work), 1)
        for slot, take in self._share_prefill(prefill, budget):
            if take <= 0:
                self.ready[slot.id] = slot.epoch  # next tick
            else:
                work.append(slot.work(take))
        for w in work:
            slot = self.slots[w.slot_id]
            slot.in_flight = True
            w.epoch = slot.epoch
        return work

    @staticmethod
    def _share_prefill(prefill: list[Slot], budget: int) -> list[tuple[Slot, int]]:
        """(slot, tokens to feed this tick) for every slot waiting to prefill."""
        if not prefill:
            return []
        prefill.sort(key=lambda s: s.arrived_at)
        oldest = prefill[0]
        floor = min(len(oldest.pending), max(budget // 2, 1))
        left = budget - floor
        shares: dict[int, int] = {}
        for slot in sorted(prefill[1:], key=lambda s: (len(s.pending), s.arrived_at)):
            take = min(len(slot.pending), left)
            shares[slot.id] = take
            left -= take
        shares[oldest.id] = min(len(oldest.pending), floor + left)
        return [(s, shares[s.id]) for s in prefill]

    async def _step(self, work: list[RowWork]) -> None:
        t0 = time.perf_counter()
        try:
            out = await self.mlx.run(lambda: self.runner.step(work))
        except Exception as exc:  # contain: fail these requests, keep serving
            log.exception("step failed", rows=sum(len(w.tokens) for w in work))
            for w in work:
                slot = self.slots[w.slot_id]
                self.awaiting.add(w.slot_id)
                slot.step_result(StepFailed(slot.epoch, f"model step failed: {exc}"))
            return
        for w in work:
            self.awaiting.add(w.slot_id)
            self.slots[w.slot_id].step_result(
                StepDone(w.epoch, len(w.tokens), out.sampled.get(w.slot_id)))
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
        if self.on_step is not None:
            self.on_step(out, work)
