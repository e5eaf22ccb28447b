"""The GPU decode step's forward through `mx.compile`: its graph built once per shape.

A decode step's graph on the GPU is ~450 ops, and Python builds it anew every step
(2-6 ms of host time on the lent H200's hosts, more than a 1-row step's GPU time at
times; slotserve's custom kernels cost the most to add, `mx.fast.cuda_kernel` rebuilding
their source on every call). Compiled, the step is traced once per input shape and then
replayed in C++: the same primitives (custom kernels included) on the new inputs.

Only steps the CUDA kernels run whose every row decodes one token are compiled: then the
graph depends on nothing but the input shapes (rows, block-table width, pool size and
RoPE table size). The block-table width (the longest row's KV pages) is padded up to a
power of two, so a batch whose sequences grow is traced again at 2, 4, 8, ... pages, not
at every page: a row's kernels read only its own pages (its bits cannot depend on the
width, which is the longest row's in its batch), and `same_bits` checks a padded step.
Everything that changes between steps is an input: the tokens, the
row tables, every layer's K/V pool arrays (the step's scatters return new ones, put back
into the pool as an uncompiled step leaves them) and the RoPE tables (which grow).

The compiled step runs the same kernels on the same operands, but MLX's compile also fuses
chains of elementwise ops into one kernel, which may round differently. So the engine runs
compiled steps only where `same_bits` finds a compiled step bit-identical to the plain
forward (prefill always runs plain). Traces are kept per shape, least recently used dropped
past MAX_TRACES.
"""

from __future__ import annotations

import copy
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import mlx.core as mx
import numpy as np

from slotserve.kernels.attention import BLOCK
from slotserve.model.layers import Batch, Rope

MAX_TRACES = 64


class CompiledDecode:
    """Runs a model's decode steps (GPU kernels, one token per row) compiled."""

    def __init__(self, model: Any) -> None:
        self.model = model
        self.ropes: list[Rope] = list(model.ropes)  # the tables its layers rotate by
        self._traces: OrderedDict[tuple[Any, ...], Callable[..., Any]] = OrderedDict()
        self._last_key: tuple[Any, ...] | None = None
        self._batch: Batch | None = None  # the batch being traced (its Python parts)
        self.traced = 0  # shapes traced so far (stats, tests)

    @staticmethod
    def applies(batch: Batch, logit_rows: list[int]) -> bool:
        """A decode step on the CUDA kernels, logits of every row in order (no sequence
        with a recurrent state: model.deltanet keeps it outside the traced arrays)."""
        return (batch.cuda is not None and batch.pool is not None
                and batch.rows == batch.padded_rows == len(logit_rows)
                and all(s.length == 1 and not hasattr(s.kv, "recurrent")
                        for s in batch.segments)
                and logit_rows == list(range(len(logit_rows))))

    def run(self, tokens: mx.array, batch: Batch, logit_rows: list[int]) -> mx.array | None:
        """The step's logits, compiled; None where the plain forward should run instead:
        a step that is not a decode step, or the first of its shape in a row (while rows
        join and leave, shapes change every step and a trace would not be used again)."""
        if not self.applies(batch, logit_rows):
            return None
        inputs = self._inputs(tokens, batch)
        key = tuple((a.shape, a.dtype) for a in inputs)
        last, self._last_key = self._last_key, key
        if key not in self._traces and key != last:
            return None
        return self._call(key, inputs, batch)

    def __call__(self, tokens: mx.array, batch: Batch) -> mx.array:
        """A decode step's logits, compiled whatever its shape (applies() must hold)."""
        inputs = self._inputs(tokens, batch)
        return self._call(tuple((a.shape, a.dtype) for a in inputs), inputs, batch)

    def _inputs(self, tokens: mx.array, batch: Batch) -> list[mx.array]:
        pool = batch.pool
        assert pool is not None and batch.cuda is not None and batch.write_rows is not None
        max_pos = max(s.start + s.length for s in batch.segments)
        for rope in self.ropes:  # grown here: a trace must not change the model
            rope.reserve(max_pos)
        tables = [t for rope in self.ropes for t in (rope.cos, rope.sin)]
        blocks, row_table, row_pos, tiles = batch.cuda
        window = []  # the sliding-window layers' own write rows and tables (Batch.window)
        if batch.window is not None:
            assert batch.window.write_rows is not None and batch.window.cuda is not None
            window = [batch.window.write_rows, padded_width(batch.window.cuda[0])]
        return [tokens, batch.positions, batch.write_rows, padded_width(blocks), row_table,
                row_pos, tiles, *tables, *pool.keys, *pool.values, *window]

    def _call(self, key: tuple[Any, ...], inputs: list[mx.array], batch: Batch) -> mx.array:
        pool = batch.pool
        assert pool is not None
        fn = self._trace_for(key)
        self._batch = batch
        try:
            out = fn(*inputs)
        finally:
            self._batch = None
        inputs.clear()  # the pool's old arrays are then held by the graph alone (in place)
        layers = len(pool.keys)
        pool.keys, pool.values = list(out[1 : 1 + layers]), list(out[1 + layers :])
        return out[0]

    def clear(self) -> None:
        """Drop every trace (engine shutdown, on the MLX thread)."""
        self._traces.clear()
        self._last_key = None

    def same_bits(self, rows: int = 3, steps: int = 1) -> bool:
        """Whether compiled decode steps give the plain forward's bits (logits and the K/V
        they write), on this model and machine: `steps` greedy steps of `rows` prompts,
        each run plain, then again compiled. The last prompt spans three KV pages, so the
        compiled steps read a block table padded to four. Compiled steps run only where
        this holds, so a row's output is the same whichever way its step ran."""
        model = self.model
        kvs = [model.new_kv() for _ in range(rows)]
        lengths = [5 + i + (2 * BLOCK if i == rows - 1 else 0) for i in range(rows)]
        try:
            for i, (kv, n) in enumerate(zip(kvs, lengths, strict=True)):
                batch = Batch.build([(kv, 0, n)])
                model(mx.arange(n, dtype=mx.int32) * (7 + i) % 1000, batch, [])
                mx.eval(batch.written())
            tokens = mx.arange(rows, dtype=mx.int32) + 3
            for step in range(steps):
                parts = [(kv, n + step, 1) for kv, n in zip(kvs, lengths, strict=True)]
                batch = Batch.build(parts)
                if not self.applies(batch, list(range(rows))):
                    return False
                plain = model(tokens, batch, list(range(rows)))
                mx.eval(plain, batch.written())
                want = [_bits(a) for a in (plain, *kvs[0].pool.arrays())]
                # the same step again, compiled: it writes the same K/V rows, with the same
                # bits only if it computes them the same way
                batch = Batch.build(parts)
                got = self(tokens, batch)
                mx.eval(got, batch.written())
                if not all(np.array_equal(a, _bits(b)) for a, b in
                           zip(want, (got, *kvs[0].pool.arrays()), strict=True)):
                    return False
                tokens = mx.argmax(got, axis=-1).astype(mx.int32)
            return True
        finally:
            self.clear()
            for kv in kvs:
                kv.release()

    def _trace_for(self, key: tuple[Any, ...]) -> Callable[..., Any]:
        fn = self._traces.get(key)
        if fn is None:
            fn = self._traces[key] = mx.compile(self._forward)
            self.traced += 1
            if len(self._traces) > MAX_TRACES:
                self._traces.popitem(last=False)
        else:
            self._traces.move_to_end(key)
        return fn

    def _forward(self, tokens: mx.array, positions: mx.array, write_rows: mx.array,
                 tables: mx.array, row_table: mx.array, row_pos: mx.array, tiles: mx.array,
                 *rest: mx.array) -> list[mx.array]:
        """The model's forward on traced inputs (runs only while tracing)."""
        real = self._batch
        assert real is not None and real.pool is not None
        n_tables = 2 * len(self.ropes)
        pool = copy.copy(real.pool)
        layers = pool.num_layers
        kv = rest[n_tables : n_tables + 2 * layers]
        pool.keys, pool.values = list(kv[:layers]), list(kv[layers:])
        batch = Batch(real.segments, positions, pool, write_rows,
                      cuda=(tables, row_table, row_pos, tiles))
        if real.window is not None:
            win_rows, win_tables = rest[n_tables + 2 * layers :]
            batch.window = Batch(real.segments, positions, pool, win_rows,
                                 cuda=(win_tables, row_table, row_pos, tiles),
                                 effects=batch.effects, rope_cache=batch.rope_cache)
        saved = [(rope.cos, rope.sin) for rope in self.ropes]
        try:
            for i, rope in enumerate(self.ropes):
                rope.cos, rope.sin = rest[2 * i], rest[2 * i + 1]
            logits = self.model(tokens, batch, list(range(batch.rows)))
        finally:
            for rope, (cos, sin) in zip(self.ropes, saved, strict=True):
                rope.cos, rope.sin = cos, sin
        return [logits, *pool.keys, *pool.values]


def padded_width(blocks: mx.array) -> mx.array:
    """A step's block tables [segments, pages, kv heads] with the pages axis padded (page 0,
    never read) up to a power of two: the compiled step's shape changes less often."""
    width = blocks.shape[1]
    bucket = 1 << max(width - 1, 0).bit_length()
    if bucket == width:
        return blocks
    return mx.pad(blocks, [(0, 0), (0, bucket - width), (0, 0)])


def _bits(a: mx.array) -> np.ndarray:
    return np.array(a.view({2: mx.uint16, 4: mx.uint32}[a.dtype.size]))
