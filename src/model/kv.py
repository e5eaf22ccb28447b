"""KV storage: one pool per model, handed out to slots in pages.

Every layer keeps all slots' keys (and values) in one array of shape
[pages * kv_heads * BLOCK, head_dim]: page-major, then kv head, then BLOCK
positions, so each (page, kv head) is one contiguous [BLOCK, head_dim] *block*.
A slot owns a list of pages (BLOCK positions each, BLOCK being the attention key
block), so

* a step writes the new K/V of every row of every slot with one scatter per layer,
* attention multiplies straight out of the pool (`mx.gather_mm` picks each
  slot's blocks by index): no per-step copy of anyone's keys,
* memory follows what is written: pages are taken as positions are reserved and
  given back when a slot's retained KV is evicted; the pool grows (never shrinks)
  to its high-water mark, never to max_slots x context up front,
* full pages of a prefix can be shared between slots (a new chat that starts with the
  system prompt another conversation holds): pages carry a reference count, and a slot
  never writes into a page another holds (SlotKV.writable_from).

Page bookkeeping is plain Python under a lock (the event loop evicts, the MLX
thread reserves); the arrays are touched only on the MLX thread.
"""

from __future__ import annotations

import threading
from functools import cache

import mlx.core as mx
import numpy as np

from slotserve.kernels.attention import BLOCK

GROW_STEP = 2 * BLOCK  # admission charges KV in steps of this many positions
POOL_GROWTH = 0.25  # grow the pool by at least this fraction when it runs out


class KVPool:
    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, dtype: mx.Dtype,
                 initial_pages: int = 0) -> None:
        self.num_layers = num_layers
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self.pages = 0
        self.free: list[int] = []
        self.refs: list[int] = []  # per page: how many slots' KV hold it (0: free)
        self.keys: list[mx.array] = []
        self.values: list[mx.array] = []
        self._lock = threading.Lock()
        if initial_pages:
            self._grow(initial_pages)

    @property
    def bytes_per_position(self) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.dtype.size

    @property
    def page_bytes(self) -> int:
        return BLOCK * self.bytes_per_position

    @property
    def nbytes(self) -> int:
        return self.pages * self.page_bytes

    def _grow(self, extra: int) -> None:
        """Append `extra` pages to every layer's arrays (MLX thread only)."""
        shape = (extra * self.num_kv_heads * BLOCK, self.head_dim)
        if self.pages == 0:
            self.keys = [mx.zeros(shape, self.dtype) for _ in range(self.num_layers)]
            self.values = [mx.zeros(shape, self.dtype) for _ in range(self.num_layers)]
        else:
            self.keys = [mx.concatenate([k, mx.zeros(shape, self.dtype)]) for k in self.keys]
            self.values = [mx.concatenate([v, mx.zeros(shape, self.dtype)]) for v in self.values]
        mx.eval(self.keys, self.values)
        self.free.extend(range(self.pages + extra - 1, self.pages - 1, -1))
        self.refs.extend([0] * extra)
        self.pages += extra

    def arrays(self) -> list[mx.array]:
        """Every layer's key and value arrays: what a step writing the pool must evaluate."""
        return [*self.keys, *self.values]

    def key_blocks(self, layer: int) -> mx.array:
        """Layer's keys as [pages * kv_heads, BLOCK, head_dim] (a view, no copy)."""
        return self.keys[layer].reshape(-1, BLOCK, self.head_dim)

    def value_blocks(self, layer: int) -> mx.array:
        return self.values[layer].reshape(-1, BLOCK, self.head_dim)

    def allocate(self, n: int) -> list[int]:
        with self._lock:
            if len(self.free) < n:
                need = n - len(self.free)
                self._grow(max(need, int(self.pages * POOL_GROWTH), 1))
            taken = [self.free.pop() for _ in range(n)]
            for p in taken:
                self.refs[p] = 1
        return taken

    def share(self, pages: list[int]) -> None:
        """One more holder of each of these pages."""
        with self._lock:
            for p in pages:
                assert self.refs[p] > 0, "sharing a free page"
                self.refs[p] += 1

    def shared(self, page: int) -> bool:
        return self.refs[page] > 1

    def release(self, pages: list[int]) -> None:
        """One holder less of each page; a page nobody holds is free again."""
        with self._lock:
            for p in reversed(pages):
                self.refs[p] -= 1
                if self.refs[p] == 0:
                    self.free.append(p)


@cache
def _head_offsets(heads: int) -> np.ndarray:
    """Pool-row offset of each kv head's block within a page (read-only)."""
    offsets = np.arange(heads, dtype=np.int64) * BLOCK
    offsets.flags.writeable = False
    return offsets


class SlotKV:
    """One slot's view of the pool: the pages holding its positions 0..capacity-1.

    Positions past the slot's ledger may hold stale values from an earlier request;
    attention masks them by position.
    """

    def __init__(self, pool: KVPool) -> None:
        self.pool = pool
        self.pages: list[int] = []
        self._blocks: tuple[int, np.ndarray] | None = None  # (span, blocks(span)), see blocks

    @property
    def capacity(self) -> int:
        return len(self.pages) * BLOCK

    @property
    def bytes_per_position(self) -> int:
        return self.pool.bytes_per_position

    @property
    def nbytes(self) -> int:
        return len(self.pages) * self.pool.page_bytes

    def reserve(self, end: int) -> None:
        """Make room for positions [0, end) before a step writes them (MLX thread)."""
        missing = -(-end // BLOCK) - len(self.pages)
        if missing > 0:
            self.pages.extend(self.pool.allocate(missing))
            self._blocks = None

    def rows_for(self, start: int, end: int) -> np.ndarray:
        """[end - start, kv_heads] pool rows receiving positions start..end-1, per kv head."""
        heads = self.pool.num_kv_heads
        if end - start == 1:  # a decode row: the same numbers without per-call arrays
            base = (self.pages[start // BLOCK] * heads * BLOCK) + start % BLOCK
            return (base + _head_offsets(heads))[None, :]
        pos = np.arange(start, end)
        page = np.asarray(self.pages, dtype=np.int64)[pos // BLOCK]
        block = page[:, None] * heads + np.arange(heads)[None, :]
        return block * BLOCK + (pos % BLOCK)[:, None]

    def blocks(self, span: int) -> np.ndarray:
        """[span // BLOCK, kv_heads] block indices of positions 0..span-1 (see key_blocks).

        Kept until the pages change: a decode step asks every slot for the same table as
        the step before. Callers only read it.
        """
        if self._blocks is not None and self._blocks[0] == span:
            return self._blocks[1]
        heads = self.pool.num_kv_heads
        pages = np.asarray(self.pages[: span // BLOCK], dtype=np.int64)
        table = pages[:, None] * heads + np.arange(heads)[None, :]
        self._blocks = (span, table)
        return table

    def share_prefix(self, other: SlotKV, pages: int) -> None:
        """Hold the first `pages` pages of `other` too (this KV must be empty): positions
        0 .. pages * BLOCK - 1 then read the same K/V without computing it again."""
        assert not self.pages and pages <= len(other.pages)
        shared = other.pages[:pages]
        self.pool.share(shared)
        self.pages = list(shared)
        self._blocks = None

    def writable_from(self, start: int) -> int:
        """Make positions start.. writable (no page from the one holding `start` on is
        held by another slot) and return the position writing may resume from: `start`,
        or the start of its page when that page was shared (dropped, so recomputed)."""
        first = start // BLOCK
        shared = next((j for j in range(first, len(self.pages))
                       if self.pool.shared(self.pages[j])), None)
        if shared is None:
            return start
        dropped, self.pages = self.pages[shared:], self.pages[:shared]
        self._blocks = None
        self.pool.release(dropped)
        return start if shared > first else first * BLOCK

    def release(self) -> None:
        """Give every page back (slot evicted)."""
        pages, self.pages = self.pages, []
        self._blocks = None
        self.pool.release(pages)
