"""The sampled rows' draw in one launch (sample_draw.cu): truncation (top_k, top_p, min_p)
and the inverse-CDF draw of every row, without sorting the vocabulary.

In MLX ops the same work is ~40 launches over the vocabulary, most of them a reduction or
scan that MLX gives one block per row: at one row that is ~1 ms a step on the H200
(bench/gpu_bench.py --micro-parts sampler), a third of a decode step. Here a block per row
makes a few passes over it, and its masses are integers (exact in any order), so a row's
token never depends on its batch. The ranks top_k and top_p cut at are found by a radix
select in the same block, not by a sort of the row (MLX's sort of 128,256-wide rows took
45-52 us a step at one row and ~430 us at 64, on an H100: bench/gpu_bench.py --micro
--micro-parts sampler).
"""

from __future__ import annotations

from collections.abc import Sequence

import mlx.core as mx
import numpy as np

from slotserve.kernels.cuda.launch import SAMPLE_THREADS
from slotserve.kernels.cuda.sources import kernel

_U64 = (1 << 64) - 1


def sample_draw(z: mx.array, row_max: mx.array, scale: np.ndarray, top_k: np.ndarray,
                top_p: np.ndarray, min_p: np.ndarray, seeds: Sequence[int],
                positions: Sequence[int]) -> mx.array:
    """Tokens int32 [n] of float32 rows z [n, V] (row_max: their maxima): per row the
    scale log2 e / temperature, top_k (V: none), top_p, min_p, and the seed and draw
    position of its uniform (runtime.sampling.uniform_for). Lazy: nothing is read back."""
    n, vocab = z.shape
    ranked = (top_k < vocab) | (top_p < 1.0)
    knobs = mx.array(np.stack([scale, top_p, min_p], axis=1).astype(np.float32))
    iknobs = mx.array(np.stack([top_k, ranked], axis=1).astype(np.int32))
    draws = mx.array(np.array([[s & _U64, (p + 1) & _U64] for s, p in
                               zip(seeds, positions, strict=True)], np.uint64).reshape(n, 2))
    (tokens,) = kernel("sample_draw")(
        inputs=[z, row_max, knobs, iknobs, draws],
        grid=(n * SAMPLE_THREADS, 1, 1), threadgroup=(SAMPLE_THREADS, 1, 1),
        output_shapes=[(n,)], output_dtypes=[mx.int32])
    return tokens
