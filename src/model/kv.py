"""KV storage: one pool per model, handed out to slots in pages.

Every layer keeps all slots' keys (and values) in one array of shape
[pages * kv_heads * BLOCK, head_dim]: page-major, then kv head, then BLOCK
positions, so each (page, kv head) is one contiguous [BLOCK, head_dim] *block*.
A slot's KV is a list of pages (BLOCK positions each, BLOCK being the attention key
block), so

* a step writes the new K/V of every row of every slot with one scatter per layer,
* attention multiplies straight out of the pool (`mx.gather_mm` picks each
  slot's blocks by index): no per-step copy of anyone's keys,
* memory follows what is written: the arrays grow (never shrink) to the highest page
  handed out, never to max_slots x context up front,
* full pages can be held by several slots at once (a shared prefix): pages carry a
  reference count.

Two sides, two threads. The page *bookkeeping* (which ids are free, who holds what) is
plain Python used by one thread: the event loop in the engine (the prefix cache in
slotserve.actors.kv_cache hands out and takes back pages), or the caller's own thread in
single-sequence uses (`SlotKV.reserve`). The *arrays* are touched only on the MLX thread:
`ensure_arrays` grows them to cover every page handed out, at the start of a step. The
loop therefore never waits on MLX work, and nothing needs a lock.
"""

from __future__ import annotations

import heapq
from functools import cache

import mlx.core as mx
import numpy as np

from slotserve.kernels.attention import BLOCK

POOL_GROWTH = 0.25  # grow the arrays by at least this fraction when they run out


class KVPool:
    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, dtype: mx.Dtype,
                 initial_pages: int = 0, shapes: list[tuple[int, int]] | None = None) -> None:
        """shapes: each layer's (kv heads, head_dim) where layers differ (see `of_shapes`);
        else every layer has num_kv_heads heads of head_dim."""
        self.shapes = list(shapes) if shapes else [(num_kv_heads, head_dim)] * num_layers
        self.num_layers = len(self.shapes)
        self.num_kv_heads = num_kv_heads  # the heads a step's tables address by default
        self.head_dim = head_dim  # the widest head (what the attention backend must take)
        self.dtype = dtype
        self.pages = 0  # pages the arrays hold
        self.refs: list[int] = []  # per page id handed out so far: its holders (0: free)
        self._free: list[int] = []  # a heap: the lowest free id first keeps the arrays small
        self.keys: list[mx.array] = []
        self.values: list[mx.array] = []
        if initial_pages:
            self._grow(initial_pages)

    @staticmethod
    def of_shapes(shapes: list[tuple[int, int]], dtype: mx.Dtype) -> KVPool:
        """A pool whose layers hold K/V of their own (kv heads, head_dim) each (Gemma 4's
        global layers have fewer, wider heads than its sliding ones). A page id stands for
        the same positions in every layer; each layer addresses its blocks with its own head
        count (`SlotKV.rows_for`, `blocks`)."""
        return KVPool(len(shapes), shapes[0][0], max(d for _, d in shapes), dtype,
                      shapes=shapes)

    @property
    def bytes_per_position(self) -> int:
        """K and V of one position in every layer that holds K/V (layers that read another
        layer's K/V are not in the pool, so they cost nothing here)."""
        return 2 * sum(h * d for h, d in self.shapes) * self.dtype.size

    @property
    def page_bytes(self) -> int:
        return BLOCK * self.bytes_per_position

    @property
    def nbytes(self) -> int:
        return self.pages * self.page_bytes

    # ---- bookkeeping (one thread: the event loop in the engine) ----------------------

    @property
    def ids(self) -> int:
        """Page ids handed out at least once (the arrays must cover them)."""
        return len(self.refs)

    @property
    def free_count(self) -> int:
        return len(self._free)

    def take(self, n: int) -> list[int]:
        """n page ids, each with one holder: free ones first (lowest id first), then new."""
        taken = [heapq.heappop(self._free) for _ in range(min(n, len(self._free)))]
        new, first = n - len(taken), len(self.refs)
        self.refs.extend([0] * new)
        taken.extend(range(first, first + new))
        for p in taken:
            self.refs[p] = 1
        return taken

    def hold(self, pages: list[int]) -> None:
        """One more holder of each of these pages."""
        for p in pages:
            assert self.refs[p] > 0, "holding a free page"
            self.refs[p] += 1

    def holders(self, page: int) -> int:
        return self.refs[page]

    def drop(self, pages: list[int]) -> list[int]:
        """One holder less of each page; returns the pages nobody holds now (the caller
        frees them with `free`, or keeps them resident for reuse)."""
        unheld = []
        for p in pages:
            self.refs[p] -= 1
            assert self.refs[p] >= 0, "dropping a free page"
            if self.refs[p] == 0:
                unheld.append(p)
        return unheld

    def revive(self, page: int) -> None:
        """A page nobody held (kept resident by its caller) gets a holder again."""
        assert self.refs[page] == 0
        self.refs[page] = 1

    def free(self, pages: list[int]) -> None:
        for p in pages:
            assert self.refs[p] == 0, "freeing a held page"
            heapq.heappush(self._free, p)

    # ---- arrays (MLX thread only) ------------------------------------------------------

    def ensure_arrays(self) -> None:
        """Grow every layer's arrays to cover each page id handed out (start of a step)."""
        if self.ids > self.pages:
            self._grow(max(self.ids - self.pages, int(self.pages * POOL_GROWTH), 1))

    def _grow(self, extra: int) -> None:
        shapes = [(extra * h * BLOCK, d) for h, d in self.shapes]
        if self.pages == 0:
            self.keys = [mx.zeros(shape, self.dtype) for shape in shapes]
            self.values = [mx.zeros(shape, self.dtype) for shape in shapes]
        else:  # one array at a time, its old buffer released before the next grows: the
            # pool never needs twice its size (a device-sized budget would not fit twice)
            for arrays in (self.keys, self.values):
                for i, shape in enumerate(shapes):
                    arrays[i] = mx.concatenate([arrays[i], mx.zeros(shape, self.dtype)])
                    mx.eval(arrays[i])
                    mx.clear_cache()
        mx.eval(self.keys, self.values)
        self.pages += extra

    def copy_positions(self, src: int, dst: int, n: int) -> None:
        """Copy positions 0..n-1 of page src into page dst, every layer and kv head (a
        sequence that shares the start of another's page; see actors.kv_cache)."""
        self.ensure_arrays()
        index: dict[int, tuple[mx.array, mx.array]] = {}  # per head count: (from, to) rows

        def rows(a: mx.array) -> tuple[mx.array, mx.array]:
            heads = a.shape[0] // (self.pages * BLOCK)  # (layers may differ)
            if heads not in index:
                within = (np.arange(heads)[:, None] * BLOCK + np.arange(n)[None, :]).ravel()
                index[heads] = (mx.array(src * heads * BLOCK + within, dtype=mx.int32),
                                mx.array(dst * heads * BLOCK + within, dtype=mx.int32))
            return index[heads]

        # read everything first: a scatter whose input a pending read still needs copies
        # the whole array instead of writing in place
        arrays = [*self.keys, *self.values]
        copied = [a[rows(a)[0]] for a in arrays]
        mx.eval(copied)
        for a, c in zip(arrays, copied, strict=True):
            a[rows(a)[1]] = c
        mx.eval(arrays)

    def arrays(self) -> list[mx.array]:
        """Every layer's key and value arrays: what a step writing the pool must evaluate."""
        return [*self.keys, *self.values]

    def key_blocks(self, layer: int) -> mx.array:
        """Layer's keys as [pages * kv_heads, BLOCK, head_dim] (a view, no copy)."""
        return self.keys[layer].reshape(-1, BLOCK, self.shapes[layer][1])

    def value_blocks(self, layer: int) -> mx.array:
        return self.values[layer].reshape(-1, BLOCK, self.shapes[layer][1])


@cache
def _head_offsets(heads: int) -> np.ndarray:
    """Pool-row offset of each kv head's block within a page (read-only)."""
    offsets = np.arange(heads, dtype=np.int64) * BLOCK
    offsets.flags.writeable = False
    return offsets


class SlotKV:
    """One sequence's view of the pool: the pages holding its positions 0..capacity-1.

    Positions past the sequence's ledger may hold stale values from an earlier request;
    attention masks them by position.
    """

    def __init__(self, pool: KVPool) -> None:
        self.pool = pool
        self.pages: list[int] = []
        # the engine's cache grants the pages (on the event loop): reserve never takes any
        self.managed = False
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

    def set_pages(self, pages: list[int]) -> None:
        """Hold exactly these pages (the engine's cache hands them out and takes them back)."""
        self.pages = pages
        self._blocks = None

    def add_pages(self, pages: list[int]) -> None:
        self.pages.extend(pages)
        self._blocks = None

    def reserve(self, end: int) -> None:
        """Make room for positions [0, end) before a step writes them (MLX thread). In the
        engine the pages are already there (the cache granted them on the event loop); a
        single sequence (runtime.plain, tests) takes them from the pool here."""
        missing = -(-end // BLOCK) - len(self.pages)
        if missing > 0:
            if self.managed:
                raise RuntimeError(f"KV pages for positions up to {end} were never granted")
            self.add_pages(self.pool.take(missing))
        self.pool.ensure_arrays()

    def rows_for(self, start: int, end: int, heads: int | None = None) -> np.ndarray:
        """[end - start, kv_heads] pool rows receiving positions start..end-1, per kv head
        (of a layer with `heads` kv heads; default the pool's)."""
        heads = heads or self.pool.num_kv_heads
        if end - start == 1:  # a decode row: the same numbers without per-call arrays
            base = (self.pages[start // BLOCK] * heads * BLOCK) + start % BLOCK
            return (base + _head_offsets(heads))[None, :]
        pos = np.arange(start, end)
        page = np.asarray(self.pages, dtype=np.int64)[pos // BLOCK]
        block = page[:, None] * heads + np.arange(heads)[None, :]
        return block * BLOCK + (pos % BLOCK)[:, None]

    def blocks(self, span: int, heads: int | None = None) -> np.ndarray:
        """[span // BLOCK, kv_heads] block indices of positions 0..span-1 (see key_blocks), of
        a layer with `heads` kv heads (default the pool's).

        The default table is kept until the pages change: a decode step asks every slot for
        the same table as the step before. Callers only read it.
        """
        default = heads is None or heads == self.pool.num_kv_heads
        if default and self._blocks is not None and self._blocks[0] == span:
            return self._blocks[1]
        heads = heads or self.pool.num_kv_heads
        pages = np.asarray(self.pages[: span // BLOCK], dtype=np.int64)
        table = pages[:, None] * heads + np.arange(heads)[None, :]
        if default:
            self._blocks = (span, table)
        return table

    def release(self) -> None:
        """Give every page back to the pool (a single sequence that is done)."""
        pages, self.pages = self.pages, []
        self._blocks = None
        self.pool.free(self.pool.drop(pages))
