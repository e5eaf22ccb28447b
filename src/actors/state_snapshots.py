"""Recurrent-state snapshots in the prefix cache, for models whose sequences carry a state
beside their K/V pages (Gated DeltaNet layers: slotserve.model.deltanet).

A recurrent state cannot be cut at an arbitrary position: a cached prefix is only usable up
to a position where the sequence's state was kept. So the cache keeps, beside the pages, a
snapshot of every layer's state at page boundaries (every `interval` pages), keyed by the
chain key of the page that ends there: the same exact tokens, positions and namespace as
the page. A snapshot is taken only where the state has the bits a cold prefill of those
tokens gives (the model's `canonical` marks), so a continuation resumed from it computes
every later position exactly as the same prompt prefilled cold.

Only pages below a sequence's canonical end (`canonical_end`: where it resumed from, or the
deepest state its chunked prefill reached since) are published: past it, positions were
decoded or ran the recurrent form, and their K/V are not a cold prefill's bits either.

A finished sequence also leaves the deepest canonical state it reached (where its prompt's
chunked prefill stopped, e.g. an agent's previous turn; or where a settle pass over its
generated tokens stopped, see admission's settle passes) with the page it lies in: the
cache's *tail* of its chain, or its last published page when it lies at that page's end.
A lookup whose tokens agree with such a tail up to that state copies the tail's positions
before it into a page of its own (the tail stays, for the next turn or a repeat) and
resumes there; otherwise it keeps the deepest page snapshot inside the pages it matched and
trims the match there (the state starts there).
Snapshots count as resident memory in the budget (`pages`: each costs the page-equivalents
of its bytes, never committed to a running request) and are dropped with their page, or on
their own (least recently used first, tails last) when the budget needs room and no idle
page is left. Everything here runs on the event loop; the arrays are MLX values made by
earlier steps (already evaluated) and only referenced here.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any, Protocol

from slotserve.kernels.attention import BLOCK

Key = bytes

DEFAULT_INTERVAL = 2  # pages between snapshots (every 256 positions)


class Stateful(Protocol):
    """A sequence's KV that carries a recurrent state (deltanet.HybridKV)."""

    recurrent: Any
    state_bytes: int


def carries_state(kv: object) -> bool:
    return hasattr(kv, "recurrent")


class StateSnapshots:
    def __init__(self, snapshot_bytes: int, page_bytes: int,
                 interval: int = DEFAULT_INTERVAL) -> None:
        if interval < 1:
            raise ValueError(f"state snapshot interval must be at least 1 page, not {interval}")
        self.interval = interval
        self.cost = max(1, -(-snapshot_bytes // page_bytes))  # pages a snapshot stands for
        self.states: OrderedDict[Key, list[Any]] = OrderedDict()  # LRU first
        # tail page -> (position, states): a finished sequence's deepest canonical state
        self.tails: OrderedDict[int, tuple[int, list[Any]]] = OrderedDict()
        self.taken = 0  # snapshots a lookup resumed from (stats, tests)

    @property
    def pages(self) -> int:
        """The budget pages the snapshots take."""
        return (len(self.states) + len(self.tails)) * self.cost

    def trim(self, match: Any, tokens: list[int], tails: dict[int, list[int]]) -> Any:
        """Cut a Match (slotserve.actors.kv_cache) of `tokens` to its deepest state: a tail
        state among `tails` (the idle tail pages past its full pages, with the tokens
        written in each) that `tokens` agree with, else the deepest page snapshot; the
        pages up to there, that state in `match.state` (None: start cold)."""
        match.copy = None
        if match.tail is not None:
            match.pages, match.tail = match.pages[:-1], None
        full = len(match.keys) * BLOCK
        best: tuple[int, int, list[Any]] | None = None
        for page, written in tails.items():
            got = self.tails.get(page)
            if got is None:
                continue
            pos, states = got
            if (full < pos < len(tokens) and (best is None or pos > best[0])
                    and written[: pos - full] == tokens[full:pos]):
                best = (pos, page, states)
        if best is not None:  # copied, not taken over: the tail stays for other turns
            pos, page, states = best
            self.tails.move_to_end(page)
            match.copy, match.tokens, match.state = (page, pos - full), pos, states
            return match
        depth = len(match.keys)
        while depth > 0 and match.keys[depth - 1] not in self.states:
            depth -= 1
        match.pages, match.keys = match.pages[:depth], match.keys[:depth]
        match.tokens = depth * BLOCK
        match.state = self.states[match.keys[-1]] if depth else None
        if depth:
            self.states.move_to_end(match.keys[-1])
        return match

    def start(self, kv: Stateful, match: Any, publishes: bool) -> None:
        """A sequence placed on `kv` starts from the match's snapshot (or position 0) and,
        if it `publishes` (has a cache namespace), marks its canonical states for `publish`."""
        kv.recurrent.restore(match.tokens, match.state)
        kv.recurrent.keep_marks = publishes
        if match.state is not None:
            self.taken += 1

    @staticmethod
    def canonical_end(kv: Stateful) -> int:
        """Positions of kv's sequence below this hold cold-prefill bits (K/V and state):
        only pages below it are published (a decoded position's K/V are not a prefill's)."""
        return kv.recurrent.canonical_end  # type: ignore[no-any-return]

    def publish(self, kv: Stateful, key: Key, page_index: int) -> None:
        """Page `page_index` of kv's sequence was published under `key`: keep the state at
        its end if the interval asks for one there and the sequence reached it exactly."""
        end = (page_index + 1) * BLOCK
        rec = kv.recurrent
        marks = rec.marks
        states = rec.snapshot(end)
        deepest = rec.deepest()  # kept whatever happens: it may yet be a tail (`tail`)
        for pos in [p for p in marks if p < end and p != deepest]:
            del marks[pos]
        if states is not None and (page_index + 1) % self.interval == 0 \
                and key not in self.states:
            self.states[key] = states

    def tail(self, kv: Stateful, page: int, start: int, end: int) -> bool:
        """kv's sequence finished with `page` (positions `start`..`end`-1 written) as its
        chain's tail: keep the deepest canonical state it reached in there with that page.
        False when it reached none there (the page is no use to a lookup)."""
        rec = kv.recurrent
        found = [p for p in rec.marks
                 if start < p <= end and rec.snapshot(p) is not None]
        if not found:
            return False
        pos = max(found)
        self.tails[page] = (pos, rec.snapshot(pos))
        return True

    def page_end(self, kv: Stateful, key: Key, end: int) -> None:
        """kv's sequence finished with its deepest canonical state at the end of its last
        published page (`key`): keep it there, whatever the interval."""
        states = kv.recurrent.snapshot(end)
        if states is not None and key not in self.states:
            self.states[key] = states

    def resume_exact(self, kv: Stateful, prompt_tokens: int) -> None:
        """kv's sequence is a preempted request resuming (its prompt `prompt_tokens` long,
        the rest generated): from its prompt's last whole sub-chunk on, every position runs
        the recurrent form, as its uninterrupted run's prompt end and decode steps did, so
        it gives the same tokens."""
        kv.recurrent.recurrent_from = prompt_tokens

    def finish(self, kv: Stateful) -> None:
        """The sequence let go: its live state is no longer needed."""
        kv.recurrent.restore(0, None)
        kv.recurrent.keep_marks = False

    def drop(self, key: Key) -> None:
        self.states.pop(key, None)

    def drop_tail(self, page: int) -> None:
        self.tails.pop(page, None)

    @property
    def any(self) -> bool:
        return bool(self.states or self.tails)

    def evict_one(self) -> None:
        """The least recently used page snapshot; tails (the deepest states) last."""
        if self.states:
            self.states.popitem(last=False)
        else:
            self.tails.popitem(last=False)
