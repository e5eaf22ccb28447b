"""CPU matmul for the Linear layers: our own C kernel (native/gemm.c) through ctypes.

Why: OpenBLAS (through MLX) reads f32 weights at ~15 GB/s for the few rows of a
decode step and rounds 1-4 rows differently from 5+, so the engine had to pad
every batch. The kernel computes each output element the same way whatever the
row count (batch-invariant by construction) and widens 16-bit weights in
registers, so dequantized GGUF weights (exact in float16) stream at half the bytes.
"""

from __future__ import annotations

import ctypes

import mlx.core as mx
import numpy as np

LANES = 16
_WTYPE = {mx.float32: 0, mx.float16: 1, mx.bfloat16: 2}
_NP_VIEW = {mx.float32: np.float32, mx.float16: np.float16, mx.bfloat16: np.uint16}


class Matrix:
    """A weight W [N, K] (float32, float16 or bfloat16) multiplied as y = x W^T in f32."""

    def __init__(self, w: mx.array, lib: ctypes.CDLL) -> None:
        if w.dtype not in _WTYPE:
            raise TypeError(f"cpu gemm weights must be f32/f16/bf16, not {w.dtype}")
        self.lib = lib
        self.n, self.k = w.shape
        self.pad = -self.k % LANES
        self.w = w if not self.pad else mx.pad(w, [(0, 0), (0, self.pad)])
        self.wtype = _WTYPE[w.dtype]
        self._host: np.ndarray | None = None

    def _weights(self) -> np.ndarray:
        if self._host is None:
            mx.eval(self.w)
            w = self.w.view(mx.uint16) if self.w.dtype == mx.bfloat16 else self.w
            self._host = np.ascontiguousarray(np.asarray(w, dtype=_NP_VIEW[self.w.dtype]))
        return self._host

    def __call__(self, x: mx.array) -> mx.array:
        lead = x.shape[:-1]
        x2 = x.reshape(-1, x.shape[-1]).astype(mx.float32)
        if self.pad:
            x2 = mx.pad(x2, [(0, 0), (0, self.pad)])
        mx.eval(x2)
        xs = aligned_copy(np.asarray(x2))
        w = self._weights()
        rows = xs.shape[0]
        y = np.empty((rows, self.n), dtype=np.float32)
        rc = self.lib.slot_gemm(xs.ctypes.data, rows, self.k + self.pad, w.ctypes.data,
                                self.wtype, self.n, y.ctypes.data)
        if rc != 0:
            raise RuntimeError(f"slot_gemm failed (code {rc})")
        return mx.array(y).reshape(*lead, self.n)


def aligned_copy(a: np.ndarray) -> np.ndarray:
    """A C-contiguous float32 copy starting on a 64-byte boundary (MLX buffers are not):
    misaligned rows cost the kernel ~20 % (every vector load splits a cache line)."""
    buf = np.empty(a.size + 16, dtype=np.float32)
    start = (-buf.ctypes.data % 64) // 4
    out = buf[start : start + a.size].reshape(a.shape)
    np.copyto(out, a)
    return out
