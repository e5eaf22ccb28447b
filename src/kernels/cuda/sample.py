"""The sampled rows' draw in one launch (sample_draw.cu): truncation (top_k, top_p, min_p)
and the inverse-CDF draw of every row, after MLX's sort of the rows that rank.

In MLX ops the same work is ~40 launches over the vocabulary, most of them a reduction or
scan that MLX gives one block per row: at one row that is ~1 ms a step on the H200
(bench/gpu_bench.py --micro-parts sampler), a third of a decode step. Here a block per row
makes a few passes over it, and its masses are integers (exact in any order), so a row's
token never depends on its batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import cache

import mlx.core as mx
import numpy as np

from slotserve.kernels.cuda.launch import SAMPLE_THREADS
from slotserve.kernels.cuda.sources import kernel

_U64 = (1 << 64) - 1


@cache
def _nothing_sorted() -> mx.array:
    """The sorted input of a launch where no row ranks (never read)."""
    return mx.zeros((1, 1), dtype=mx.float32)


def sample_draw(z: mx.array, row_max: mx.array, scale: np.ndarray, top_k: np.ndarray,
                top_p: np.ndarray, min_p: np.ndarray, seeds: Sequence[int],
                positions: Sequence[int]) -> mx.array:
    """Tokens int32 [n] of float32 rows z [n, V] (row_max: their maxima): per row the
    scale log2 e / temperature, top_k (V: none), top_p, min_p, and the seed and draw
    position of its uniform (runtime.sampling.uniform_for). Lazy: nothing is read back."""
    n, vocab = z.shape
    ranked = (top_k < vocab) | (top_p < 1.0)
    sorted_row = np.full(n, -1, np.int32)
    if ranked.any():
        rows = np.nonzero(ranked)[0]
        sorted_row[rows] = np.arange(len(rows), dtype=np.int32)
        ranking = z if len(rows) == n else mx.take(z, mx.array(rows.astype(np.int32)), axis=0)
        ascending = mx.sort(ranking, axis=-1)
    else:
        ascending = _nothing_sorted()
    knobs = mx.array(np.stack([scale, top_p, min_p], axis=1).astype(np.float32))
    iknobs = mx.array(np.stack([top_k, sorted_row], axis=1).astype(np.int32))
    draws = mx.array(np.array([[s & _U64, (p + 1) & _U64] for s, p in
                               zip(seeds, positions, strict=True)], np.uint64).reshape(n, 2))
    (tokens,) = kernel("sample_draw")(
        inputs=[z, row_max, ascending, knobs, iknobs, draws],
        grid=(n * SAMPLE_THREADS, 1, 1), threadgroup=(SAMPLE_THREADS, 1, 1),
        output_shapes=[(n,)], output_dtypes=[mx.int32])
    return tokens
