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
                 initial_pages: int = 0, shapes: list[tuple[int, int]] | None = None,
                 windowed: frozenset[int] = frozenset(), window: int = 0) -> None:
        """shapes: each layer's (kv heads, head_dim) where layers differ (see `of_shapes`);
        else every layer has num_kv_heads heads of head_dim. windowed: the layers of a
        sliding `window` (positions), whose arrays hold window rows instead of pages (see
        `Windows`)."""
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
        self.windowed = frozenset(windowed)
        self.window = window if self.windowed else 0
        assert not self.windowed or window > 0, "windowed layers need their window"
        self.windows = Windows()  # each page's row in the windowed layers' arrays
        self.window_rows = 0  # window rows the windowed layers' arrays hold
        if initial_pages:
            self._grow(initial_pages)

    @staticmethod
    def of_shapes(shapes: list[tuple[int, int]], dtype: mx.Dtype,
                  windowed: frozenset[int] = frozenset(), window: int = 0) -> KVPool:
        """A pool whose layers hold K/V of their own (kv heads, head_dim) each (Gemma 4's
        global layers have fewer, wider heads than its sliding ones). A page id stands for
        the same positions in every layer; each layer addresses its blocks with its own head
        count (`SlotKV.rows_for`, `blocks`)."""
        return KVPool(len(shapes), shapes[0][0], max(d for _, d in shapes), dtype,
                      shapes=shapes, windowed=windowed, window=window)

    @property
    def bytes_per_position(self) -> int:
        """K and V of one position in every paged layer that holds K/V: what each token of
        a context costs (layers that read another layer's K/V are not in the pool, and the
        windowed layers' rows are a fixed floor per sequence, `window_bytes`)."""
        return 2 * sum(h * d for i, (h, d) in enumerate(self.shapes)
                       if i not in self.windowed) * self.dtype.size

    @property
    def page_bytes(self) -> int:
        return BLOCK * self.bytes_per_position

    @property
    def window_bytes(self) -> int:
        """One window row: K and V of BLOCK positions of every windowed layer."""
        return 2 * BLOCK * sum(h * d for i, (h, d) in enumerate(self.shapes)
                               if i in self.windowed) * self.dtype.size

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in (*self.keys, *self.values))

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
        if self.windowed:  # a free page keeps no window row
            self.windows.detach(pages)

    # ---- arrays (MLX thread only) ------------------------------------------------------

    def ensure_arrays(self) -> None:
        """Grow every layer's arrays to cover each page id (windowed layers: each window
        row) handed out (start of a step)."""
        extra = extra_rows = 0
        if self.ids > self.pages:
            extra = max(self.ids - self.pages, int(self.pages * POOL_GROWTH), 1)
        rows = self.windows.ids
        if self.windowed and rows > self.window_rows:
            extra_rows = max(rows - self.window_rows, int(self.window_rows * POOL_GROWTH), 1)
        if extra or extra_rows:
            self._grow(extra, extra_rows)

    def _grow(self, extra: int, extra_rows: int | None = None) -> None:
        """extra pages (paged layers) and extra_rows window rows (windowed layers; as many
        as pages where not given)."""
        extra_rows = (extra if extra_rows is None else extra_rows) if self.windowed else 0
        shapes = [((extra_rows if i in self.windowed else extra) * h * BLOCK, d)
                  for i, (h, d) in enumerate(self.shapes)]
        if not self.keys:
            self.keys = [mx.zeros(shape, self.dtype) for shape in shapes]
            self.values = [mx.zeros(shape, self.dtype) for shape in shapes]
        else:  # one array at a time, its old buffer released before the next grows: the
            # pool never needs twice its size (a device-sized budget would not fit twice)
            for arrays in (self.keys, self.values):
                for i, shape in enumerate(shapes):
                    if not shape[0]:
                        continue
                    arrays[i] = mx.concatenate([arrays[i], mx.zeros(shape, self.dtype)])
                    mx.eval(arrays[i])
                    mx.clear_cache()
        mx.eval(self.keys, self.values)
        self.pages += extra
        self.window_rows += extra_rows

    def copy_positions(self, src: int, dst: int, n: int) -> None:
        """Copy positions 0..n-1 of page src into page dst, every layer and kv head (a
        sequence that shares the start of another's page; see actors.kv_cache)."""
        self.ensure_arrays()
        # per (head count, windowed): (from, to) rows
        index: dict[tuple[int, bool], tuple[mx.array, mx.array]] = {}
        win_src, win_dst = self.windows.row(src), self.windows.row(dst)

        def rows(layer: int) -> tuple[mx.array, mx.array]:
            heads, windowed = self.shapes[layer][0], layer in self.windowed
            if (heads, windowed) not in index:
                s, d = (win_src, win_dst) if windowed else (src, dst)
                assert s >= 0 and d >= 0, "copying a window a page does not have"
                within = (np.arange(heads)[:, None] * BLOCK + np.arange(n)[None, :]).ravel()
                index[heads, windowed] = (mx.array(s * heads * BLOCK + within, dtype=mx.int32),
                                          mx.array(d * heads * BLOCK + within, dtype=mx.int32))
            return index[heads, windowed]

        # read everything first: a scatter whose input a pending read still needs copies
        # the whole array instead of writing in place
        arrays = [*self.keys, *self.values]
        layer_of = [*range(self.num_layers)] * 2
        copied = [a[rows(i)[0]] for a, i in zip(arrays, layer_of, strict=True)]
        mx.eval(copied)
        for a, c, i in zip(arrays, copied, layer_of, strict=True):
            a[rows(i)[1]] = c
        mx.eval(arrays)

    def arrays(self) -> list[mx.array]:
        """Every layer's key and value arrays: what a step writing the pool must evaluate."""
        return [*self.keys, *self.values]

    def key_blocks(self, layer: int) -> mx.array:
        """Layer's keys as [pages * kv_heads, BLOCK, head_dim] (a view, no copy)."""
        return self.keys[layer].reshape(-1, BLOCK, self.shapes[layer][1])

    def value_blocks(self, layer: int) -> mx.array:
        return self.values[layer].reshape(-1, BLOCK, self.shapes[layer][1])


class Windows:
    """Which row of the windowed layers' arrays holds each page's K/V there, and who holds it.

    A sliding-window layer reads only the last `window` positions before each query, so
    its K/V need not stay in every page: its arrays are indexed by *window rows* (BLOCK
    positions of every windowed layer each) and a page id maps to one row, or to none.
    A step's tables and write rows for those layers are the page ones mapped through this
    table (`layers.Batch.windowed`), so every backend's kernel reads the same K/V at the
    same positions: the kernels never read a block before the window's first (the MLX
    ops read and mask it), so a page past every query's window may have no row.

    A row has holders, as a page does: the sequences whose window covers its page
    (`SlotKV.open_window`, `slide`). One nobody holds is freed (`detach`) or kept by the
    prefix cache (slotserve.actors.kv_cache) for a later sequence that resumes there.
    Bookkeeping on the pool's thread, like the page ids; a step maps its page tables
    through a copy of the row table (`table`).

    Why rows by page and not a ring of window positions per slot: a row belongs to a page,
    and a page to its chain key, so the prefix cache shares, keeps and evicts window rows
    with the pages it already shares, keeps and evicts (a chat that opens with another's
    system prompt, a conversation's next turn, a preempted request's resume), and a resume
    is exact whenever the rows its first query's window reaches are resident. A ring would
    tie the window to a slot: every resume on another slot, or after the slot moved on,
    would need a copy or a snapshot of the window, the hybrids' machinery. The kernels
    need nothing new: a window row is addressed as a page is.
    """

    def __init__(self) -> None:
        self._row = np.full(64, -1, dtype=np.int64)  # page id -> its window row (-1: none)
        self.holders: dict[int, int] = {}  # page id -> holders of its row (pages with one)
        self.ids = 0  # window rows handed out at least once (the arrays must cover them)
        self._free: list[int] = []  # a heap, as the pool's page ids

    @property
    def used(self) -> int:
        """Rows pages have now."""
        return len(self.holders)

    def row(self, page: int) -> int:
        return int(self._row[page]) if page < self._row.shape[0] else -1

    def has(self, page: int) -> bool:
        return page in self.holders

    def attach(self, pages: list[int]) -> None:
        """A window row for each of these pages (which have none), one holder each."""
        top = max(pages, default=-1)
        if top >= self._row.shape[0]:
            grown = np.full(max(2 * self._row.shape[0], top + 1), -1, dtype=np.int64)
            grown[: self._row.shape[0]] = self._row
            self._row = grown
        for p in pages:
            assert p not in self.holders, "a page with a window row already"
            if self._free:
                self._row[p] = heapq.heappop(self._free)
            else:
                self._row[p] = self.ids
                self.ids += 1
            self.holders[p] = 1

    def hold(self, page: int) -> None:
        """One more holder of the page's row (it may have had none: kept for reuse)."""
        self.holders[page] += 1

    def drop(self, page: int) -> bool:
        """One holder less; True when nobody holds the row now (the caller detaches it or
        keeps it for reuse)."""
        self.holders[page] -= 1
        assert self.holders[page] >= 0, "dropping a window row nobody holds"
        return self.holders[page] == 0

    def detach(self, pages: list[int]) -> None:
        """These pages' rows go back (pages without one are skipped)."""
        for p in pages:
            assert not self.holders.get(p), "detaching a window row someone holds"
            if self.holders.pop(p, None) is not None:
                heapq.heappush(self._free, int(self._row[p]))
                self._row[p] = -1

    def table(self) -> np.ndarray:
        """page id -> window row (-1: none; `rewindow` reads row 0 for those, never at a
        position a query may see: see the class doc). The live table: a step reads its own
        pages' entries, which nothing changes while it is built."""
        return self._row


def rewindow(blocks: np.ndarray, heads: int, rows: np.ndarray) -> np.ndarray:
    """Pool block indices (page * heads + kv head) as the windowed layers address them
    (window row * heads + kv head), through `rows` (Windows.table); a page without a row
    reads row 0."""
    pages = blocks // heads
    row = np.where(pages < rows.shape[0], rows[np.minimum(pages, rows.shape[0] - 1)], 0)
    return (np.maximum(row, 0) * heads + blocks % heads).astype(blocks.dtype)


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

    With windowed layers (KVPool.windowed) the sequence also holds the window rows of
    pages[win_from:win_to]: every page its next rows' windows reach (`open_window`, before
    a step writes them) back to the first one its next query still sees (`slide`, after).
    A single sequence (`managed` False) keeps a row for every page it has.
    """

    def __init__(self, pool: KVPool) -> None:
        self.pool = pool
        self.pages: list[int] = []
        # the engine's cache grants the pages (on the event loop): reserve never takes any
        self.managed = False
        self._blocks: tuple[int, np.ndarray] | None = None  # (span, blocks(span)), see blocks
        self.win_from = self.win_to = 0  # pages[win_from:win_to] have rows this one holds

    @property
    def capacity(self) -> int:
        return len(self.pages) * BLOCK

    @property
    def bytes_per_position(self) -> int:
        return self.pool.bytes_per_position

    @property
    def nbytes(self) -> int:
        """Its pages' bytes and its window rows'."""
        rows = (self.win_to - self.win_from) * self.pool.window_bytes
        return len(self.pages) * self.pool.page_bytes + rows

    def set_pages(self, pages: list[int]) -> None:
        """Hold exactly these pages (the engine's cache hands them out and takes them back;
        it also sets which window rows the sequence holds, `win_from`/`win_to`)."""
        self.pages = pages
        self._blocks = None
        self.win_from = self.win_to = 0

    # ---- window rows (pools with windowed layers; bookkeeping, on the pages' thread) ----

    def window_pages(self) -> list[int]:
        """The pages whose window rows this sequence holds."""
        return self.pages[self.win_from : self.win_to]

    def window_first(self, pos: int) -> int:
        """Index of the first page a query at `pos` reads in the windowed layers."""
        return max(0, pos - self.pool.window + 1) // BLOCK

    def open_window(self, start: int, end: int) -> None:
        """Window rows for the pages positions [start, end) write, before a step writes
        them (the pages are there; the rows behind start are already held)."""
        if not self.pool.windowed:
            return
        assert self.win_to >= -(-start // BLOCK), "window rows missing before a step's start"
        last = -(-end // BLOCK)
        if last > self.win_to:
            self.pool.windows.attach(self.pages[self.win_to : last])
            self.win_to = last

    def writes_window(self, end: int) -> bool:
        """Whether every position up to end - 1 has its page's window row (a step may
        write them: a speculated row takes none)."""
        return not self.pool.windowed or self.win_to * BLOCK >= end

    def slide(self, cursor: int) -> list[int]:
        """The next query is at `cursor`: let go of the window rows of the pages wholly
        before its window. Returns those nobody holds now (the caller detaches them or
        keeps them for reuse)."""
        if not self.pool.windowed:
            return []
        first = min(self.window_first(cursor), self.win_to)
        if first <= self.win_from:
            return []
        windows = self.pool.windows
        gone = [p for p in self.pages[self.win_from : first] if windows.drop(p)]
        self.win_from = first
        return gone

    def add_pages(self, pages: list[int]) -> None:
        self.pages.extend(pages)
        self._blocks = None

    def reserve(self, end: int) -> None:
        """Make room for positions [0, end) before a step writes them (MLX thread). In the
        engine the pages are already there (the cache granted them on the event loop); a
        single sequence (runtime.plain, tests) takes them from the pool here."""
        missing = -(-end // BLOCK) - len(self.pages)
        if self.managed and not self.writes_window(end):
            raise RuntimeError(f"window rows for positions up to {end} were never opened")
        if missing > 0:
            if self.managed:
                raise RuntimeError(f"KV pages for positions up to {end} were never granted")
            fresh = self.pool.take(missing)
            self.add_pages(fresh)
            if self.pool.windowed:  # a single sequence keeps every page's window row
                self.pool.windows.attach(fresh)
                self.win_to = len(self.pages)
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
        windows = self.pool.windows
        self.pool.windows.detach([p for p in self.window_pages() if windows.drop(p)])
        pages, self.pages = self.pages, []
        self._blocks = None
        self.win_from = self.win_to = 0
        self.pool.free(self.pool.drop(pages))
