"""Settle passes: a finished turn's generated tokens prefilled again, so the prefix cache can
resume the next turn past them (models whose sequences carry a recurrent state).

A Gated DeltaNet's state after a decoded position has the recurrent form's bits, not the
bits a cold prefill of the same tokens gives (slotserve.model.deltanet), and so do the K/V
of every later layer at those positions. The prefix cache therefore resumes only from
states chunked prefill reached (slotserve.actors.state_snapshots): an agent's follow-up
turn, whose prompt is the previous prompt plus the tokens the model generated plus the
new message, would re-prefill the generated tokens every turn.

When such a request finishes (stop or length, within a cache namespace) with at least a
whole sub-chunk of generated tokens past its canonical end, admission queues a *settle
pass*: an internal request whose prompt is the finished ledger cut at its last whole
sub-chunk. It resumes from the finished request's own tail state and prefills the rest as
any continuation does, so what it leaves (pages, snapshots, its tail state) is exactly what
a cold prefill of those tokens computes: a follow-up served from it keeps the prefix-reuse
invariance. It runs off the critical path: the finished request's client already has its
answer, a settle takes a slot only when no request is queued and another slot stays free
(and gives it back at once, cancelled, when a request finds none free), and the Batcher
gives its chunks only the prefill budget real prompts leave over (one aligned chunk a tick
beside other rows, four alone).
A request that continues the ledger of a settle pass not yet done (the agent's next turn,
sent before the pass ran) supersedes it: the request prefills those tokens itself, as it
would without settle passes. Its one sampled token is dropped.
"""

from __future__ import annotations

import hashlib
import itertools
from collections import OrderedDict, deque

import numpy as np

from slotserve.actors.messages import CacheNamespace, GenerationRequest, SessionMessage
from slotserve.runtime.sampling import SamplingParams

MAX_QUEUED = 64  # settle passes waiting for a slot (the oldest go first when full)
REMEMBERED = 1024  # ledgers settled or queued lately (a repeated request settles once)


class Sink:
    """The session of a settle pass: nobody reads its tokens."""

    def tell(self, msg: SessionMessage) -> None:
        pass

    def room(self) -> int:
        return 1 << 30


SINK = Sink()


class Settles:
    """Settle passes waiting for a slot, and the ledgers already settled or queued."""

    def __init__(self, align: int) -> None:
        self.align = align  # the model's prefill_align (the DeltaNet sub-chunk)
        self.queue: deque[tuple[GenerationRequest, int]] = deque()  # (request, resume at)
        self.seen: OrderedDict[bytes, None] = OrderedDict()
        self.done = 0  # settle passes placed (stats, tests)
        self._ids = itertools.count()

    def __bool__(self) -> bool:
        """Whether any settle pass waits for a slot."""
        return bool(self.queue)

    def plan(self, ledger: list[int], canonical_end: int,
             namespace: CacheNamespace | None) -> None:
        """A request finished with `ledger` written and cold-prefill bits up to
        `canonical_end`: queue a settle pass if a whole sub-chunk lies past it."""
        end = len(ledger) // self.align * self.align
        if namespace is None or end - canonical_end < self.align:
            return
        key = hashlib.blake2b(repr(namespace).encode() + np.asarray(
            ledger[:end], dtype=np.int64).tobytes(), digest_size=16).digest()
        if key in self.seen:
            return
        self.seen[key] = None
        while len(self.seen) > REMEMBERED:
            self.seen.popitem(last=False)
        request = GenerationRequest(
            request_id=f"settle-{next(self._ids)}", prompt_ids=list(ledger[:end]),
            max_tokens=1, params=SamplingParams(temperature=0.0),
            cache_namespace=namespace, background=True)
        self.queue.append((request, canonical_end))
        while len(self.queue) > MAX_QUEUED:
            self.queue.popleft()

    def clear(self) -> None:
        self.queue.clear()
        self.seen.clear()
