"""CPU matmul for the Linear layers: our own C kernel (native/gemm.c) through ctypes.

Why: OpenBLAS (through MLX) reads f32 weights at ~15 GB/s for the few rows of a
decode step and rounds 1-4 rows differently from 5+, so the engine had to pad
every batch. The kernel computes each output element the same way whatever the
row count (batch-invariant by construction) and widens 16-bit weights in
registers, so dequantized GGUF weights (exact in float16) stream at half the bytes.
"""

from __future__ import annotations

import ctypes
import math
from typing import Protocol

import mlx.core as mx
import numpy as np

LANES = 16
_WTYPE = {mx.float32: 0, mx.float16: 1, mx.bfloat16: 2}
_NP_VIEW = {mx.float32: np.float32, mx.float16: np.float16, mx.bfloat16: np.uint16}


def aligned_empty(shape: tuple[int, ...]) -> np.ndarray:
    """An uninitialized float32 array starting on a 64-byte boundary (MLX buffers are not:
    misaligned rows cost the kernels ~20 %, every vector load splitting a cache line)."""
    size = math.prod(shape)
    buf = np.empty(size + 16, dtype=np.float32)
    start = (-buf.ctypes.data % 64) // 4
    return buf[start : start + size].reshape(shape)


def aligned_copy(a: np.ndarray) -> np.ndarray:
    """A C-contiguous, 64-byte aligned float32 copy of a."""
    out = aligned_empty(a.shape)
    np.copyto(out, a)
    return out


def to_host(x: mx.array) -> np.ndarray:
    """x (evaluated now) as an aligned float32 [rows, last dim] host array."""
    mx.eval(x)
    h = np.asarray(x)
    if h.dtype != np.float32:
        h = h.astype(np.float32)
    return aligned_copy(h.reshape(-1, h.shape[-1]))


class SlotMatrix(ctypes.Structure):
    """A weight as native/block.c takes it: kind 0 = slot_gemm (wtype f32/f16/bf16),
    kind 1 = slot_qgemm_f32 (cpu_qgemm's panels; bits, f16 scales)."""

    _fields_ = [("kind", ctypes.c_int64), ("n", ctypes.c_int64), ("k", ctypes.c_int64),
                ("wtype", ctypes.c_int64), ("bits", ctypes.c_int64), ("f16", ctypes.c_int64),
                ("w", ctypes.c_void_p)]


class HostMatmul(Protocol):
    """y = x W^T on host rows: Matrix (f32/f16/bf16 weights) or cpu_qgemm.QMatrix (4/8-bit)."""

    n: int
    k: int

    def host(self, xs: np.ndarray) -> np.ndarray: ...

    def __call__(self, x: mx.array) -> mx.array: ...

    def descriptor(self) -> SlotMatrix | None: ...


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

    def descriptor(self) -> SlotMatrix | None:
        """For native/block.c (None when K is padded: the block kernel does not pad x)."""
        if self.pad:
            return None
        return SlotMatrix(0, self.n, self.k, self.wtype, 0, 0, self._weights().ctypes.data)

    def host(self, xs: np.ndarray) -> np.ndarray:
        """y = xs W^T for an aligned float32 host array xs [rows, K]; y is aligned too."""
        if self.pad:
            xs = aligned_copy(np.pad(xs, [(0, 0), (0, self.pad)]))
        w = self._weights()
        rows = xs.shape[0]
        y = aligned_empty((rows, self.n))
        rc = self.lib.slot_gemm(xs.ctypes.data, rows, self.k + self.pad, w.ctypes.data,
                                self.wtype, self.n, y.ctypes.data)
        if rc != 0:
            raise RuntimeError(f"slot_gemm failed (code {rc})")
        return y

    def __call__(self, x: mx.array) -> mx.array:
        lead = x.shape[:-1]
        return mx.array(self.host(to_host(x))).reshape(*lead, self.n)


def swiglu_host(lib: ctypes.CDLL, gate_up: HostMatmul, down: HostMatmul,
                xs: np.ndarray) -> np.ndarray:
    """down(silu(gate(xs)) * up(xs)) with gate_up = [gate; up], for an aligned host xs."""
    gu = gate_up.host(xs)
    inter = gate_up.n // 2
    h = aligned_empty((gu.shape[0], inter))
    if lib.slot_swiglu(gu.ctypes.data, gu.shape[0], inter, h.ctypes.data) != 0:
        raise RuntimeError("slot_swiglu failed (intermediate size must be a multiple of 16)")
    return down.host(h)


def swiglu_mlp(lib: ctypes.CDLL, gate_up: HostMatmul, down: HostMatmul,
               x: mx.array) -> mx.array:
    """swiglu_host for an MLX x, all in native memory between the two matmuls."""
    return mx.array(swiglu_host(lib, gate_up, down, to_host(x)))


def rms_norm_host(lib: ctypes.CDLL, xs: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    """Row-wise RMS norm of an aligned host xs [rows, H] (H a multiple of 16)."""
    out = aligned_empty(xs.shape)
    if lib.slot_rms_norm(xs.ctypes.data, xs.shape[0], xs.shape[1], weight.ctypes.data,
                         ctypes.c_float(eps), out.ctypes.data) != 0:
        raise RuntimeError("slot_rms_norm failed (hidden size must be a multiple of 16)")
    return out
