"""The one prefix cache: every reusable KV page, keyed by the exact tokens that made it.

A sequence's KV is a list of pages of BLOCK positions (slotserve.model.kv). Every *full*
page a sequence writes is published under a key that chains the keys of the pages before
it with the page's own tokens and the sequence's cache namespace:

    key(page j) = blake2b(key(page j - 1) + tokens[j * BLOCK : (j + 1) * BLOCK])
    key(page -1) = blake2b(namespace)

so two sequences reach the same key exactly when they hold the same tokens at the same
positions, in the same namespace, and then the page's K/V are the same bits too (the batch
invariance rules: a position's K/V never depend on the batch that computed them). A new
request walks its prompt's chain and holds every page found, shared, not copied: a chat
that opens with another's system prompt, an agent's next turn, a preempted request that
resumes. A sequence's unfinished last page is kept too when it finishes, as a *tail* of
its chain (several conversations may part ways inside one page, each keeps its own); only
a continuation of that chain can use it, and it takes the page over (it will write into
it), so a conversation's next turn resumes from its very last token. A request that
shares only the first positions of a page (a full page or a tail: a repeated question
with a new ending, a conversation that parts ways inside a page) gets those positions
*copied* into a fresh page of its own (`copy_into`, one job on the MLX thread, queued
before any step that could read them), so nothing it shares is recomputed.

Pages nobody holds stay resident (`idle`, least recently used first) until the budget
needs them: `allocate` evicts from the front. Namespace None publishes and finds nothing.
Models whose sequences carry a recurrent state keep snapshots of it beside the pages and
resume only from one; they publish only pages of cold-prefill bits, and a tail is copied
from, never taken over (slotserve.actors.state_snapshots).

Models with sliding-window layers (KVPool.windowed) keep those layers' K/V in window rows
(slotserve.model.kv.Windows): a running sequence holds the rows of the pages its window
covers (a fixed floor per busy slot in admission's budget) and lets go of each page's row
once its next query no longer sees the page (`slide`). A row nobody holds stays resident
while the cache can find its page (`idle_windows`, evicted with the idle pages, least
recently used first), else it is freed. The rule that keeps reuse exact: a match resumes at
position P only if every page from the one holding P - window + 1 to the one holding P - 1
still has its row (then its first query reads exactly the K/V a cold prefill wrote there);
otherwise it is cut back to the deepest page boundary where that holds (`_reach_window`),
down to a cold start. A conversation's next turn resumes from its very end (its last
window's rows stay with its tail and last pages); a request sharing another's prefix
resumes where the rows of that prefix's end are still resident.
Everything here runs on the event loop (page bookkeeping only; the arrays grow on the MLX
thread, see KVPool.ensure_arrays).
"""

from __future__ import annotations

import hashlib
from collections import Counter, OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from slotserve.actors.messages import CacheNamespace
from slotserve.actors.state_snapshots import StateSnapshots
from slotserve.kernels.attention import BLOCK
from slotserve.model.kv import KVPool, SlotKV

Key = bytes


def root_key(namespace: CacheNamespace) -> Key:
    return hashlib.blake2b(repr(namespace).encode(), digest_size=16).digest()


def next_key(prev: Key, page_tokens: list[int]) -> Key:
    data = np.asarray(page_tokens, dtype=np.int64).tobytes()
    return hashlib.blake2b(prev + data, digest_size=16).digest()


def common_prefix(a: list[int], b: list[int]) -> int:
    """Length of the longest common prefix (compared a chunk at a time: list equality runs
    in C, and agents share prompts thousands of tokens long)."""
    n = min(len(a), len(b))
    i = 0
    for chunk in (256, 16, 1):
        while i + chunk <= n and a[i : i + chunk] == b[i : i + chunk]:
            i += chunk
    return i


@dataclass
class Match:
    """What the cache holds of a token sequence: `pages` cover positions 0..tokens-1, but
    for the `copy` part, which goes into the first page granted after them."""

    pages: list[int] = field(default_factory=list)
    tokens: int = 0
    keys: list[Key] = field(default_factory=list)  # chain keys of the full pages matched
    tail: int | None = None  # the tail page taken over (the last of `pages`), if any
    # (page, n): its first n positions are copied into the sequence's next page
    copy: tuple[int, int] | None = None
    # the recurrent-state snapshot the match resumes from (models with one; state_snapshots)
    state: Any = None


@dataclass
class Chain:
    """A running sequence's place in the cache: the keys of its full pages published so
    far (so publishing the next one hashes one page, not the whole prefix)."""

    namespace: CacheNamespace | None
    keys: list[Key] = field(default_factory=list)

    def last_key(self) -> Key:
        assert self.namespace is not None
        return self.keys[-1] if self.keys else root_key(self.namespace)


# runs a job on the MLX thread, then the callback on the caller's thread (MLXThread.post)
Post = Callable[[Callable[[], None], Callable[[], None]], None]


def _inline(job: Callable[[], None], then: Callable[[], None]) -> None:
    """The default `Post` for single-threaded uses (tests, tools): run both now."""
    job()
    then()


class PageIndex:
    """Pages by the chain key of the full pages before them, each with the tokens written
    in it: where a lookup that found no whole page looks for a page to copy the start of."""

    def __init__(self) -> None:
        self.under: dict[Key, dict[int, list[int]]] = {}
        self.parent: dict[int, Key] = {}

    def __contains__(self, page: int) -> bool:
        return page in self.parent

    def add(self, parent: Key, page: int, written: list[int]) -> None:
        self.remove(page)
        self.under.setdefault(parent, {})[page] = written
        self.parent[page] = parent

    def remove(self, page: int) -> None:
        parent = self.parent.pop(page, None)
        if parent is not None:
            siblings = self.under[parent]
            del siblings[page]
            if not siblings:
                del self.under[parent]

    def get(self, parent: Key) -> dict[int, list[int]]:
        return self.under.get(parent, {})


class KVCache:
    def __init__(self, pool: KVPool, post: Post = _inline) -> None:
        self.pool = pool
        self.post = post
        self.pages: dict[Key, int] = {}  # full pages by chain key
        self.key_of: dict[int, Key] = {}
        self.full = PageIndex()  # the same full pages, under their parent's key
        self.tails = PageIndex()  # finished sequences' last, unfinished pages
        self.idle: OrderedDict[int, None] = OrderedDict()  # resident, unheld; LRU first
        # pages whose window row nobody holds, kept for a lookup that resumes there (models
        # with sliding-window layers); LRU first
        self.idle_windows: OrderedDict[int, None] = OrderedDict()
        self.windows = pool.windows if pool.windowed else None
        self.evictions: Counter[str] = Counter()
        # recurrent-state snapshots, for models whose sequences carry a state (Admission
        # sets it; see slotserve.actors.state_snapshots)
        self.snapshots: StateSnapshots | None = None

    # ---- counts ---------------------------------------------------------------------

    @property
    def resident(self) -> int:
        """Pages in use or kept for reuse, state snapshots and window rows nobody holds
        included, in pages (what the budget bounds; held window rows are in the busy
        slots' floors)."""
        snapshots = self.snapshots.pages if self.snapshots is not None else 0
        return self.pool.ids - self.pool.free_count + snapshots + self.idle_window_pages

    @property
    def held(self) -> int:
        return self.pool.ids - self.pool.free_count - len(self.idle)

    @property
    def idle_window_pages(self) -> int:
        """The pages' worth of bytes the idle window rows take."""
        if not self.idle_windows:
            return 0
        return -(-len(self.idle_windows) * self.pool.window_bytes // self.pool.page_bytes)

    @property
    def shared(self) -> int:
        return sum(1 for r in self.pool.refs if r > 1)

    # ---- lookups ----------------------------------------------------------------------

    def lookup(self, tokens: list[int], namespace: CacheNamespace | None) -> Match:
        """The longest prefix of `tokens` the cache holds, leaving at least the last token
        to be fed (its logits choose the next token); with state snapshots, the longest
        that ends at one (`StateSnapshots.trim`)."""
        match = self._lookup_pages(tokens, namespace)
        if self.windows is not None:
            match = self._reach_window(match)
        if self.snapshots is None or namespace is None:
            return match
        parent = match.keys[-1] if match.keys else root_key(namespace)
        tails = {p: w for p, w in self.tails.get(parent).items() if p in self.idle}
        return self.snapshots.trim(match, tokens, tails)

    def _lookup_pages(self, tokens: list[int], namespace: CacheNamespace | None) -> Match:
        match = Match()
        if namespace is None or len(tokens) < 2:
            return match
        key = root_key(namespace)
        limit = len(tokens) - 1
        while (len(match.pages) + 1) * BLOCK <= limit:
            j = len(match.pages)
            nk = next_key(key, tokens[j * BLOCK : (j + 1) * BLOCK])
            page = self.pages.get(nk)
            if page is None:
                break
            match.pages.append(page)
            match.keys.append(nk)
            key = nk
        match.tokens = len(match.pages) * BLOCK
        rest = tokens[match.tokens :]
        best, best_page = 0, None
        for page, written in self.tails.get(key).items():
            # only a continuation takes a tail over: it holds everything written there (one
            # that parts ways inside the page would destroy another conversation's end)
            if (len(written) > best and page in self.idle
                    and match.tokens + len(written) <= limit
                    and common_prefix(written, rest) == len(written)):
                best, best_page = len(written), page
        if best_page is not None:
            match.tail = best_page
            match.pages.append(best_page)
            match.tokens += best
            return match
        # no page continues it whole: copy the start of the one sharing the most with it
        room = limit - match.tokens
        for index in (self.full, self.tails):
            for page, written in index.get(key).items():
                n = min(common_prefix(written, rest), room)
                if n > best:
                    best, best_page = n, page
        if best_page is not None:
            match.copy = (best_page, best)
            match.tokens += best
        return match

    def _reach_window(self, match: Match) -> Match:
        """The match cut back to where every page its first query's window reaches still
        has its window row (the module doc's rule)."""
        windows, w = self.windows, self.pool.window
        assert windows is not None

        def reachable(pages: list[int], end: int) -> bool:
            first, last = max(0, end - w + 1) // BLOCK, -(-end // BLOCK)
            return all(windows.has(pages[j]) for j in range(first, last))

        extra = [match.copy[0]] if match.copy is not None else []
        if reachable([*match.pages, *extra], match.tokens):
            return match
        match.copy = None
        if match.tail is not None:
            match.pages, match.tail = match.pages[:-1], None
        depth = len(match.keys)
        while depth and not reachable(match.pages, depth * BLOCK):
            depth -= 1
        match.pages, match.keys, match.tokens = match.pages[:depth], match.keys[:depth], \
            depth * BLOCK
        return match

    def newly_held(self, match: Match) -> int:
        """Pages of the match nobody holds now (holding them takes budget; a copy's source
        is held until the copy is done)."""
        pages = match.pages if match.copy is None else [*match.pages, match.copy[0]]
        return sum(1 for p in pages if p in self.idle)

    def take(self, match: Match, kv: SlotKV, namespace: CacheNamespace | None) -> Chain:
        """Hold the match's pages in `kv` (which must be empty); the tail is taken over.
        What can raise (a family's state restore) runs first: a raise holds nothing."""
        assert not kv.pages
        if self.snapshots is not None:
            self.snapshots.start(kv, match, namespace is not None)  # type: ignore[arg-type]
        for p in match.pages:
            self._hold(p)
        if match.tail is not None:
            self._forget(match.tail)
        if match.copy is not None:
            self._hold(match.copy[0])
        kv.set_pages(list(match.pages))
        if self.windows is not None:  # the rows the first query's window reaches
            end = min(-(-match.tokens // BLOCK), len(match.pages))
            kv.win_from, kv.win_to = min(kv.window_first(match.tokens), end), end
            for p in [*kv.window_pages(), *([match.copy[0]] if match.copy else [])]:
                self._hold_window(p)
        return Chain(namespace, list(match.keys))

    def copy_into(self, match: Match, kv: SlotKV) -> None:
        """Copy the match's partial page into kv's first page past the match (granted by
        now); its source is let go once the copy has run."""
        if match.copy is None:
            return
        src, n = match.copy
        dst = kv.pages[len(match.pages)]
        if self.windows is not None:  # the copy's own window row (its source's is held)
            self.windows.attach([dst])
            kv.win_to = len(match.pages) + 1

        self.post(lambda: self.pool.copy_positions(src, dst, n),
                  lambda: self._let_copy_source_go(src))

    def cancel_copy(self, match: Match) -> None:
        """The copy `take` held the match's source page for will not run (its placement
        was undone before `copy_into`): let go of the source."""
        if match.copy is not None:
            self._let_copy_source_go(match.copy[0])

    def _let_copy_source_go(self, src: int) -> None:
        if self.windows is not None:
            self._let_window_go(src)
        self._let_go(src)

    def slide(self, kv: SlotKV, cursor: int) -> None:
        """kv's next query is at `cursor`: the window rows it no longer sees go idle (their
        pages published) or are freed."""
        for page in kv.slide(cursor):
            self._settle_window(page)

    def _hold_window(self, page: int) -> None:
        assert self.windows is not None
        self.idle_windows.pop(page, None)
        self.windows.hold(page)

    def _let_window_go(self, page: int) -> None:
        assert self.windows is not None
        if self.windows.drop(page):
            self._settle_window(page)

    def _settle_window(self, page: int) -> None:
        """A window row nobody holds: kept (idle) while the cache can find its page."""
        assert self.windows is not None
        if page in self.key_of or page in self.tails:
            self.idle_windows[page] = None
        else:
            self.windows.detach([page])

    def _free(self, pages: list[int]) -> None:
        """Free pages nobody holds (an idle window row of theirs goes with them)."""
        for p in pages:
            self.idle_windows.pop(p, None)
        self.pool.free(pages)

    def _hold(self, page: int) -> None:
        if page in self.idle:
            del self.idle[page]
            self.pool.revive(page)
        else:
            self.pool.hold([page])

    def _let_go(self, page: int) -> None:
        """One holder less of a page outside any sequence (a copy's source): back to idle
        if the cache still knows it, else freed."""
        if self.pool.drop([page]):
            self._settle(page)

    def _settle(self, page: int) -> None:
        """A page nobody holds: kept (idle) while the cache can find it, else freed."""
        if page in self.key_of or page in self.tails:
            self.idle[page] = None
        else:
            self._forget(page)
            self._free([page])

    # ---- growth ---------------------------------------------------------------------

    def allocate(self, n: int, budget: int) -> list[int]:
        """n fresh pages: free ids while the resident count stays within `budget`, then the
        least recently used idle pages (evicted: their cache entries dropped)."""
        while n > 0 and self.resident + n > budget and (self.idle or self.idle_windows):
            self._evict_oldest()
        while n > 0 and self.resident + n > budget and self.snapshots and self.snapshots.any:
            self.snapshots.evict_one()  # snapshots of pages still held: shallower ones stay
        return self.pool.take(n)

    def _evict_oldest(self) -> None:
        """Make room: first the window row a running sequence passed (its page still held:
        only a new request resuming exactly there could use it), least recently idle first;
        then the least recently idle page (its row with it), or a row alone."""
        passed = next((p for p in self.idle_windows if self.pool.refs[p] > 0), None)
        if passed is None and self.idle:
            self.evict_one("budget")
            return
        page = passed if passed is not None else next(iter(self.idle_windows))
        del self.idle_windows[page]
        assert self.windows is not None
        self.windows.detach([page])
        self.evictions["budget"] += 1

    def trim(self, budget: int) -> None:
        """Evict until what is resident fits `budget` pages again (window rows a running
        sequence let go of go idle without a page being asked for)."""
        while self.resident > budget and (self.idle_windows or self.idle):
            self._evict_oldest()

    def evict_one(self, reason: str) -> None:
        page, _ = self.idle.popitem(last=False)
        self._forget(page)
        self._free([page])
        self.evictions[reason] += 1

    def evict_idle(self, pages: list[int]) -> None:
        """Evict those of `pages` that are idle (what a dropped settle pass left)."""
        for page in pages:
            if page in self.idle:
                del self.idle[page]
                self._forget(page)
                self._free([page])
                self.evictions["dropped"] += 1

    def drop_idle(self) -> int:
        """Evict every idle page (forces cold prefills); returns how many."""
        n = len(self.idle) + self.idle_window_pages
        while self.idle:
            self.evict_one("dropped")
        if self.windows is not None:
            self.windows.detach(list(self.idle_windows))
            self.idle_windows.clear()
        return n

    # ---- publishing -------------------------------------------------------------------

    def publish(self, kv: SlotKV, ledger: list[int], chain: Chain) -> None:
        """Publish every full page of `ledger` (tokens whose K/V are written) not yet in the
        chain. A page whose key another page already holds stays private (freed at the
        end)."""
        if chain.namespace is None:
            return
        full = len(ledger) // BLOCK
        if self.snapshots is not None:  # a recurrent state: cold-prefill bits alone
            full = min(full, self.snapshots.canonical_end(kv) // BLOCK)  # type: ignore[arg-type]
        while len(chain.keys) < full:
            j = len(chain.keys)
            parent, written = chain.last_key(), ledger[j * BLOCK : (j + 1) * BLOCK]
            key = next_key(parent, written)
            chain.keys.append(key)
            page = kv.pages[j]
            if self.snapshots is not None:
                self.snapshots.publish(kv, key, j)  # type: ignore[arg-type]
            if key not in self.pages and page not in self.key_of:
                self.pages[key] = page
                self.key_of[page] = key
                self.full.add(parent, page, list(written))

    def finish(self, kv: SlotKV, ledger: list[int], chain: Chain) -> None:
        """A sequence lets go of its KV: published pages nobody else holds become idle; its
        unfinished last page becomes its chain's tail (namespace None: everything freed)."""
        self.publish(kv, ledger, chain)
        pages, rows = kv.pages, kv.window_pages()
        kv.set_pages([])
        if self.snapshots is not None:
            self._finish_stateful(kv, ledger, chain, pages)
        else:
            full = len(ledger) // BLOCK
            if len(ledger) % BLOCK and len(pages) > full and chain.namespace is not None:
                self.tails.add(chain.last_key(), pages[full], list(ledger[full * BLOCK :]))
        if self.windows is not None:  # its last window's rows stay with their pages
            for p in rows:
                self._let_window_go(p)
        for p in self.pool.drop(pages):
            self._settle(p)

    def _finish_stateful(self, kv: SlotKV, ledger: list[int], chain: Chain,
                         pages: list[int]) -> None:
        """The tail of a sequence with a recurrent state: the page its canonical end lies in
        (what was written there past it is recomputed by whoever resumes), with the state
        there; the pages past it are freed (never published)."""
        snaps = self.snapshots
        assert snaps is not None
        if chain.namespace is not None:
            end = min(snaps.canonical_end(kv), len(ledger))  # type: ignore[arg-type]
            full = len(chain.keys)
            if end > full * BLOCK and len(pages) > full:
                written = list(ledger[full * BLOCK : min(len(ledger), (full + 1) * BLOCK)])
                if snaps.tail(kv, pages[full], full * BLOCK, end):  # type: ignore[arg-type]
                    self.tails.add(chain.last_key(), pages[full], written)
            elif end == full * BLOCK and full:
                snaps.page_end(kv, chain.keys[-1], end)  # type: ignore[arg-type]
        snaps.finish(kv)  # type: ignore[arg-type]

    def _forget(self, page: int) -> None:
        key = self.key_of.pop(page, None)
        if key is not None and self.pages.get(key) == page:
            del self.pages[key]
            if self.snapshots is not None:
                self.snapshots.drop(key)
        self.full.remove(page)
        self.tails.remove(page)
        if self.snapshots is not None:
            self.snapshots.drop_tail(page)
