"""Admission: decide admit / queue / reject under slot, queue and KV-byte budgets.

The KV budget is charged by physical high-water marks: a busy slot is charged a
fixed floor plus bytes-per-token x (prompt + max new tokens), rounded up to the KV
growth step; an idle slot that retains KV for prefix reuse holds its actual bytes
and is evicted (least recently used first) when an admission needs them. Every
slot keeps the model's full context: a request is limited only by the context
length and the budget, never by context / slots.

Conversations outlive their slot: when a request takes an idle slot that holds
another conversation, that conversation's KV pages are *parked* (kept in the pool,
detached from any slot) instead of dropped, and a later turn that continues it is
placed on a free slot that adopts those pages — so more agents than slots still
skip re-prefill. At most `max_parked` conversations are kept (default: as many as
slots) and they count against the KV budget; parked KV is evicted first, least
recently used first, when bytes are needed.

A new chat that opens with tokens another conversation holds (an agent's system prompt)
starts from that conversation's full KV pages, shared, not copied (`_share_prefix`);
retained KV counts each page once, however many conversations share it (`retained_bytes`).

Every one of these mechanisms stays inside a cache namespace (`GenerationRequest.
cache_namespace`: the API key and `cache_salt`, see `namespace_for`): a request reuses a
slot's ledger, adopts a parked conversation or shares pages only when they were computed
for its own namespace, so `cached_tokens` (and the time a prefill takes) never tells one
tenant anything about another's prompts. A request of namespace None (`--cache-scope none`)
reuses nothing and leaves nothing to reuse.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from slotserve.actors.messages import GLOBAL_NAMESPACE, CacheNamespace, GenerationRequest
from slotserve.actors.slot import Slot, common_prefix
from slotserve.kernels.attention import BLOCK
from slotserve.model.kv import GROW_STEP, SlotKV

MIN_REUSE = 16  # prefix tokens a retained slot must match to be chosen for reuse
# tokens of a retained conversation a request may drop when it takes that KV in place: its
# own next turn (the end of the last answer re-rendered); any other match shares pages
REUSE_TAIL = 16
# how far prefix reuse reaches: "key" (the default) within one API key, "global" across all
# requests (one namespace), "none" not across requests at all; cache_salt splits each further
CACHE_SCOPES = ("key", "global", "none")


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


@dataclass
class ParkedKV:
    """A conversation's resident tokens and their KV pages, held by no slot."""

    ledger: list[int]
    kv: SlotKV
    last_used: float
    namespace: CacheNamespace | None = GLOBAL_NAMESPACE  # only this namespace may adopt it

    def prefix_match(self, prompt: list[int], namespace: CacheNamespace | None) -> int:
        if namespace is None or namespace != self.namespace:
            return 0
        return min(common_prefix(self.ledger, prompt), max(len(prompt) - 1, 0))


class Admission:
    def __init__(self, slots: list[Slot], *, max_queue: int, kv_budget: int,
                 bytes_per_token: int, context_length: int, max_parked: int = 0) -> None:
        self.slots = slots
        self.max_queue = max_queue
        self.kv_budget = kv_budget
        self.bytes_per_token = bytes_per_token
        self.context_length = context_length
        self.floor = GROW_STEP * bytes_per_token
        self.queue: deque[Waiting] = deque()
        self.parked: list[ParkedKV] = []
        self.max_parked = max_parked  # parked conversations kept at most (LRU beyond)
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
        """Bytes of the pages only retained KV holds (idle slots but `exclude`, which is being
        placed, and parked conversations): what evicting all of it would free. A page that
        several conversations share (a common system prompt) counts once; one that a busy
        slot (or `exclude`) also holds lies inside that slot's charge."""
        if not self.slots:
            return 0
        charged = {p for s in self.slots if s.busy or s is exclude for p in s.kv.pages}
        held = {p for s in self.slots if not (s.busy or s is exclude) for p in s.kv.pages}
        held.update(p for c in self.parked for p in c.kv.pages)
        return len(held - charged) * self.slots[0].kv.pool.page_bytes

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
        slot, parked, reuse = self._choose(free, req.prompt_ids, req.cache_namespace)
        if parked is not None:
            self.parked.remove(parked)  # before parking the host: the cap must not drop it
        if not reuse and slot.kv.nbytes:
            self._park(slot)  # keep its conversation for a later turn; start this one empty
        charge = max(charge, slot.kv.nbytes, parked.kv.nbytes if parked else 0)
        if self.busy_bytes + charge > self.kv_budget:
            if parked is not None:
                self.parked.append(parked)
            return False
        if parked is not None:
            slot.adopt(parked.ledger, parked.kv, parked.namespace)
        elif not reuse:
            self._share_prefix(slot, req.prompt_ids, req.cache_namespace)
        # free retained KV until the charge fits: parked conversations first, then other
        # idle slots, least recently used first
        while self.busy_bytes + charge + self.retained_bytes(slot) > self.kv_budget:
            if not self._evict_one(exclude=slot):
                break
        self.charged[slot.id] = charge
        place(slot)
        return True

    def _share_prefix(self, slot: Slot, prompt: list[int],
                      namespace: CacheNamespace | None) -> None:
        """Start an empty slot with the full KV pages of the longest prefix of `prompt` that
        another conversation of the same cache namespace holds (a slot's, busy or not, or a
        parked one): a new chat that opens with an agent's system prompt skips prefilling
        it, and that conversation keeps all of its KV. Pages are shared, not copied
        (SlotKV.share_prefix); the K/V in them are what a prefill of the same tokens at the
        same positions computes (the invariance rules), so the output is the same bits as
        a cold start."""
        if namespace is None:
            return
        limit = (len(prompt) - 1) // BLOCK  # the last prompt token is always fed
        donors = [(s.ledger, s.kv) for s in self.slots
                  if s is not slot and s.kv.pages and s.namespace == namespace]
        donors += [(p.ledger, p.kv) for p in self.parked if p.namespace == namespace]
        best, source = 0, None
        for ledger, kv in donors:
            pages = min(common_prefix(ledger, prompt) // BLOCK, limit)
            if pages > best:
                best, source = pages, (ledger, kv)
        if source is not None:
            slot.kv.share_prefix(source[1], best)
            slot.ledger = source[0][: best * BLOCK]
            slot.namespace = namespace

    def _park(self, slot: Slot) -> None:
        if self.max_parked <= 0 or slot.namespace is None:  # None: nobody could adopt it
            slot.evict()
            return
        namespace = slot.namespace
        ledger, kv = slot.detach()
        self.parked.append(ParkedKV(ledger, kv, slot.last_used, namespace))
        while len(self.parked) > self.max_parked:
            oldest = min(self.parked, key=lambda p: p.last_used)
            self.parked.remove(oldest)
            oldest.kv.release()

    def _evict_one(self, exclude: Slot) -> bool:
        if self.parked:
            oldest = min(self.parked, key=lambda p: p.last_used)
            self.parked.remove(oldest)
            oldest.kv.release()
            return True
        idle = [s for s in self.slots
                if s is not exclude and not s.busy and not s.in_flight and s.kv.nbytes]
        if not idle:
            return False
        min(idle, key=lambda s: s.last_used).evict()
        return True

    def drop_parked(self) -> int:
        """Release every parked conversation's KV; returns the bytes freed."""
        freed = sum(p.kv.nbytes for p in self.parked)
        for p in self.parked:
            p.kv.release()
        self.parked = []
        return freed

    def _choose(self, free: list[Slot], prompt: list[int],
                namespace: CacheNamespace | None) -> tuple[Slot, ParkedKV | None, bool]:
        """(slot, parked conversation it adopts or None, whether the slot's own KV is reused).

        Only conversations of the request's cache namespace match at all. The longest exact
        prefix match wins, in a free slot or parked (a free slot then adopts it); otherwise
        an empty slot, else the least recently used one, whose conversation is parked. A
        match counts only when it is at least MIN_REUSE tokens (not just the chat template's
        opening) and reusing it in place throws away at most REUSE_TAIL tokens of that
        conversation (its own next turn, re-rendered): a new chat that only shares the
        system prompt must not truncate another conversation. That
        conversation is parked instead, and the new chat starts from its full pages of the
        shared prefix (_share_prefix).
        """

        def worth(match: int, resident: int) -> bool:
            return match >= MIN_REUSE and resident - match <= REUSE_TAIL

        slot_matches = [(s.prefix_match(prompt, namespace), s.last_used, s) for s in free]
        best_slot = max((m for m in slot_matches if worth(m[0], len(m[2].ledger))),
                        key=lambda m: (m[0], m[1]), default=None)
        parked_matches = [(p.prefix_match(prompt, namespace), p.last_used, p)
                          for p in self.parked]
        best_parked = max((m for m in parked_matches if worth(m[0], len(m[2].ledger))),
                          key=lambda m: (m[0], m[1]), default=None)
        empty = [s for s in free if not s.ledger and not s.kv.pages]
        host = empty[0] if empty else min(free, key=lambda s: s.last_used)
        if best_parked is not None and (best_slot is None or best_parked[0] > best_slot[0]):
            return host, best_parked[2], False
        if best_slot is not None:
            return best_slot[2], None, True
        return host, None, False

    def retry_after(self) -> int:
        """Seconds until the queue should have room, from the observed finish rate."""
        now = time.monotonic()
        recent = [t for t in self._finished_at if now - t < 60]
        rate = len(recent) / max(now - recent[0], 1.0) if len(recent) >= 2 else 0.5
        return int(min(60, max(1, math.ceil((len(self.queue) + 1) / max(rate, 0.05)))))
