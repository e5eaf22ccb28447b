"""Admission: decide admit / queue / reject under slot, queue and KV-byte budgets.

The KV budget is charged by physical high-water marks: a busy slot is charged a
fixed floor plus bytes-per-token x (prompt + max new tokens), rounded up to the KV
growth step; an idle slot that retains KV for prefix reuse holds its actual bytes
and is evicted (least recently used first) when an admission needs them. Every
slot keeps the model's full context: a request is limited only by the context
length and the budget, never by context / slots.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from slotserve.actors.messages import GenerationRequest
from slotserve.actors.slot import Slot
from slotserve.model.kv import GROW_STEP

MIN_REUSE = 16  # prefix tokens a retained slot must match to be chosen for reuse


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
    """A single request larger than the whole KV budget: it could never run."""


class OverloadedError(Exception):
    """Queue full: retry later (HTTP 429 with Retry-After)."""

    def __init__(self, reason: str, retry_after: int) -> None:
        super().__init__(f"server overloaded ({reason}); retry after {retry_after} s")
        self.reason, self.retry_after = reason, retry_after


@dataclass
class Waiting:
    request: GenerationRequest
    place: Callable[[Slot], None]
    charge: int


class Admission:
    def __init__(self, slots: list[Slot], *, max_queue: int, kv_budget: int,
                 bytes_per_token: int, context_length: int) -> None:
        self.slots = slots
        self.max_queue = max_queue
        self.kv_budget = kv_budget
        self.bytes_per_token = bytes_per_token
        self.context_length = context_length
        self.floor = GROW_STEP * bytes_per_token
        self.queue: deque[Waiting] = deque()
        self.charged: dict[int, int] = {}  # slot id -> bytes charged while busy
        self.rejections: dict[str, int] = {}
        self._finished_at: deque[float] = deque(maxlen=64)

    # ---- accounting ------------------------------------------------------------

    def charge_for(self, req: GenerationRequest) -> int:
        tokens = len(req.prompt_ids) + req.max_tokens
        return self.floor + math.ceil(tokens / GROW_STEP) * GROW_STEP * self.bytes_per_token

    @property
    def busy_bytes(self) -> int:
        return sum(self.charged.values())

    def retained_bytes(self, exclude: Slot | None = None) -> int:
        return sum(s.kv.nbytes for s in self.slots if not s.busy and s is not exclude)

    @property
    def used_bytes(self) -> int:
        return self.busy_bytes + self.retained_bytes()

    def check(self, req: GenerationRequest) -> int:
        """Raise for a request that can never run; return its charge."""
        if len(req.prompt_ids) + req.max_tokens > self.context_length:
            raise ContextOverflowError(len(req.prompt_ids), req.max_tokens, self.context_length)
        charge = self.charge_for(req)
        if charge > self.kv_budget:
            raise BudgetExceededError(
                f"request needs {charge} KV bytes (prompt {len(req.prompt_ids)} + max_tokens "
                f"{req.max_tokens}) but the whole KV budget is {self.kv_budget} bytes; lower "
                f"max_tokens"
            )
        return charge

    # ---- placement -------------------------------------------------------------

    def submit(self, req: GenerationRequest, place: Callable[[Slot], None]) -> bool:
        """Place now (True), queue (False), or raise OverloadedError / AdmissionError."""
        charge = self.check(req)
        if not self.queue and self._try_place(req, place, charge):
            return True
        if len(self.queue) >= self.max_queue:
            self.rejections["queue_full"] = self.rejections.get("queue_full", 0) + 1
            raise OverloadedError("queue full", self.retry_after())
        self.queue.append(Waiting(req, place, charge))
        return False

    def withdraw(self, request_id: str) -> bool:
        for w in self.queue:
            if w.request.request_id == request_id:
                self.queue.remove(w)
                return True
        return False

    def release(self, slot: Slot) -> None:
        """A slot finished: return its charge and admit what now fits, in order."""
        self.charged.pop(slot.id, None)
        self._finished_at.append(time.monotonic())
        self.pump()

    def pump(self) -> None:
        while self.queue:
            w = self.queue[0]
            if not self._try_place(w.request, w.place, w.charge):
                return
            self.queue.popleft()

    def _try_place(self, req: GenerationRequest, place: Callable[[Slot], None],
                   charge: int) -> bool:
        free = [s for s in self.slots if not s.busy and not s.in_flight]
        if not free:
            return False
        slot = self._choose(free, req.prompt_ids)
        if slot.prefix_match(req.prompt_ids) == 0 and slot.kv.nbytes:
            slot.evict()  # nothing to reuse: start from an empty KV, grown as written
        charge = max(charge, slot.kv.nbytes)
        if self.busy_bytes + charge > self.kv_budget:
            return False
        # evict other slots' retained KV, least recently used first, until the charge fits
        others = sorted((s for s in free if s is not slot and s.kv.nbytes),
                        key=lambda s: s.last_used)
        while others and self.busy_bytes + charge + self.retained_bytes(slot) > self.kv_budget:
            others.pop(0).evict()
        self.charged[slot.id] = charge
        place(slot)
        return True

    @staticmethod
    def _choose(free: list[Slot], prompt: list[int]) -> Slot:
        """Longest exact prefix match, else an empty slot, else the LRU idle slot.

        A match shorter than MIN_REUSE tokens (e.g. only the chat template's opening) does
        not count: taking that slot would throw away a conversation worth keeping.
        """
        best = max(free, key=lambda s: (s.prefix_match(prompt), -s.last_used))
        if best.prefix_match(prompt) >= MIN_REUSE:
            return best
        empty = [s for s in free if not s.ledger]
        if empty:
            return empty[0]
        return min(free, key=lambda s: s.last_used)

    def retry_after(self) -> int:
        """Seconds until the queue should have room, from the observed finish rate."""
        now = time.monotonic()
        recent = [t for t in self._finished_at if now - t < 60]
        rate = len(recent) / max(now - recent[0], 1.0) if len(recent) >= 2 else 0.5
        return int(min(60, max(1, math.ceil((len(self.queue) + 1) / max(rate, 0.05)))))
