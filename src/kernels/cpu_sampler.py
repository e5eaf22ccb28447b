"""The host sampler's passes over the vocabulary on the CPU: native/sampler.c via ctypes.

runtime.sampling's host path on MLX's CPU ops spends ~25 ms of a 32-row step of a
49,152-token vocabulary in them, each on one thread: the rows' max and power (~9 ms), the
top-k prefix the cutoffs read (~10 ms with its sort), the keep mask, the cumsum and the
draw's counts.
These compute the same numbers (the max and selection are exact; MLX's CPU power is
glibc's powf on Linux, whose bits at base 2 are glibc's exp2f's, which these call, and its
cumsum is sequential, as here), rows side by side,
so the sampler's tokens are unchanged (tests/test_cpu_ops.py compares the bits). The
probabilities and the draw depend on MLX's CPU math agreeing with the C library's, which
runtime.sampling checks once on a probe before it takes them (`native_draw_agrees`). Each
returns None where the native kernels are not available: the caller keeps MLX.
"""

from __future__ import annotations

import ctypes

import mlx.core as mx
import numpy as np

from slotserve.kernels import native


def _host(x: mx.array | np.ndarray, dtype: type = np.float32) -> np.ndarray:
    if isinstance(x, mx.array):
        mx.eval(x)
    return np.ascontiguousarray(np.asarray(x), dtype=dtype)


def _ptr(a: np.ndarray) -> ctypes.c_void_p:
    return a.ctypes.data_as(ctypes.c_void_p)


def top_values(x: mx.array | np.ndarray, k: int) -> np.ndarray | None:
    """[n, k] float32: each row of x [n, v]'s k largest values (1 <= k <= v), descending."""
    lib = native.library()
    if lib is None:
        return None
    host = _host(x)
    n, v = host.shape
    if not 1 <= k <= v:
        raise ValueError(f"k must be in [1, {v}], got {k}")
    out = np.empty((n, k), dtype=np.float32)
    if lib.slot_top_values(_ptr(host), n, v, k, _ptr(out)) != 0:
        raise MemoryError("slot_top_values could not allocate its row buffers")
    return out


def probabilities(z: mx.array | np.ndarray, scale: np.ndarray) -> np.ndarray | None:
    """[n, v] float32: 2^((z - each row's max) * scale[row]), as
    mx.power(2.0, (z - mx.max(z, axis=-1)[:, None]) * scale[:, None]) gives them."""
    lib = native.library()
    if lib is None:
        return None
    host = _host(z)
    n, v = host.shape
    scales = np.ascontiguousarray(scale, dtype=np.float32)
    assert scales.shape == (n,), "a scale a row"
    out = np.empty((n, v), dtype=np.float32)
    lib.slot_sampler_exp2(_ptr(host), n, v, _ptr(scales), _ptr(out))
    return out


def draw(e: np.ndarray, u: np.ndarray, lo: np.ndarray | None = None,
         tied: np.ndarray | None = None, cut_ranks: np.ndarray | None = None
         ) -> np.ndarray | None:
    """[n] int32: per row the inverse-CDF draw of runtime.sampling._draw over e [n, v] at
    uniform u[row], under the truncation runtime.sampling._truncation_mask builds from the
    same per-row numbers (lo, tied and cut_ranks, its `Truncation`; None: no truncation),
    applied entry by entry rather than as a mask."""
    lib = native.library()
    if lib is None:
        return None
    host = _host(e)
    n, v = host.shape
    uniforms = np.ascontiguousarray(u, dtype=np.float32)
    rule: list[ctypes.c_void_p | None] = [None, None, None]
    if lo is not None:
        assert tied is not None and cut_ranks is not None, "the whole truncation rule"
        arrays = (np.ascontiguousarray(lo, dtype=np.float32),
                  np.ascontiguousarray(tied, dtype=np.float32),
                  np.ascontiguousarray(cut_ranks, dtype=np.int64))
        assert all(a.shape == (n,) for a in arrays), "a rule a row"
        rule = [_ptr(a) for a in arrays]
    tokens = np.empty((n,), dtype=np.int32)
    lib.slot_sampler_draw(_ptr(host), n, v, *rule, _ptr(uniforms), _ptr(tokens))
    return tokens
