"""Each row's k largest values, descending, on the CPU: native/topk.c through ctypes.

The host sampler ranks every top_k / top_p row by a prefix of its largest probabilities
(runtime.sampling). MLX's CPU topk is a selection per row on one thread (~10 ms for 32
rows of a 49,152-token vocabulary) and numpy's partition no faster; the native radix
select takes ~1 ms on this 2-core machine. The values are the rows' k largest whatever
computes them, so the sampler's cutoffs, and its tokens, are unchanged.
"""

from __future__ import annotations

import ctypes

import mlx.core as mx
import numpy as np

from slotserve.kernels import native


def top_values(x: mx.array | np.ndarray, k: int) -> np.ndarray | None:
    """[n, k] float32: each row of x [n, v]'s k largest values (1 <= k <= v), descending;
    None where the native kernels are not available (the caller ranks with MLX)."""
    lib = native.library()
    if lib is None:
        return None
    if isinstance(x, mx.array):
        mx.eval(x)
    host = np.ascontiguousarray(np.asarray(x), dtype=np.float32)
    n, v = host.shape
    if not 1 <= k <= v:
        raise ValueError(f"k must be in [1, {v}], got {k}")
    out = np.empty((n, k), dtype=np.float32)
    rc = lib.slot_top_values(host.ctypes.data_as(ctypes.c_void_p), n, v, k,
                             out.ctypes.data_as(ctypes.c_void_p))
    if rc != 0:
        raise MemoryError("slot_top_values could not allocate its row buffers")
    return out
