"""CPU matmul for the Linear layers: our own C kernel (cpu_gemm.c) called through ctypes.

Why: OpenBLAS (through MLX) reads f32 weights at ~15 GB/s for the few rows of a
decode step and rounds 1-4 rows differently from 5+, so the engine had to pad
every batch. The kernel computes each output element the same way whatever the
row count (batch-invariant by construction) and widens 16-bit weights in
registers, so dequantized GGUF weights (exact in float16) stream at half the bytes.

The library is compiled once per machine with the system C compiler (`make setup`
does it; otherwise the first model load does) into ~/.cache/slotserve. Without a
compiler, or with SLOTSERVE_CPU_GEMM=0, Linear falls back to MLX's matmul and a
warning says so.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import mlx.core as mx
import numpy as np
import structlog

log = structlog.get_logger("slotserve.cpu_gemm")

SOURCE = Path(__file__).with_name("cpu_gemm.c")
FLAGS = ["-O3", "-march=native", "-ffp-contract=fast", "-fopenmp", "-shared", "-fPIC"]
LANES = 16
_WTYPE = {mx.float32: 0, mx.float16: 1, mx.bfloat16: 2}
_NP_VIEW = {mx.float32: np.float32, mx.float16: np.float16, mx.bfloat16: np.uint16}

_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_tried = False


def _cpu_signature() -> str:
    """Flags of this CPU: -march=native code must not run on another CPU type."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor() or platform.machine()


def library_path() -> Path:
    key = hashlib.sha256(
        SOURCE.read_bytes() + " ".join(FLAGS).encode() + _cpu_signature().encode()
    ).hexdigest()[:16]
    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "slotserve"
    return cache / f"cpu_gemm-{key}.so"


def build() -> Path:
    """Compile the kernel for this machine (no-op when the cached build exists)."""
    out = library_path()
    if out.exists():
        return out
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        raise RuntimeError("no C compiler (cc/gcc) on PATH")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(f".{os.getpid()}.tmp")
    res = subprocess.run([cc, *FLAGS, str(SOURCE), "-o", str(tmp)], capture_output=True,
                         text=True)
    if res.returncode != 0:
        raise RuntimeError(f"compiling {SOURCE.name} failed: {res.stderr.strip()[-500:]}")
    tmp.replace(out)
    return out


def library() -> ctypes.CDLL | None:
    """The loaded kernel, or None (disabled, or it could not be built: logged once)."""
    global _lib, _tried
    with _lock:
        if _tried:
            return _lib
        _tried = True
        if os.environ.get("SLOTSERVE_CPU_GEMM", "1") == "0":
            log.info("cpu gemm kernel disabled (SLOTSERVE_CPU_GEMM=0); using MLX matmul")
            return None
        if sys.platform not in ("linux", "darwin"):
            return None
        try:
            lib = ctypes.CDLL(str(build()))
        except (OSError, RuntimeError) as exc:
            log.warning("cpu gemm kernel unavailable; Linear layers use MLX matmul (slower)",
                        error=str(exc))
            return None
        lib.slot_gemm.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64,
                                  ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_void_p]
        lib.slot_gemm.restype = ctypes.c_int
        _lib = lib
        return _lib


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
        xs = _aligned_copy(np.asarray(x2))
        w = self._weights()
        rows = xs.shape[0]
        y = np.empty((rows, self.n), dtype=np.float32)
        rc = self.lib.slot_gemm(xs.ctypes.data, rows, self.k + self.pad, w.ctypes.data,
                                self.wtype, self.n, y.ctypes.data)
        if rc != 0:
            raise RuntimeError(f"slot_gemm failed (code {rc})")
        return mx.array(y).reshape(*lead, self.n)


def _aligned_copy(a: np.ndarray) -> np.ndarray:
    """A C-contiguous float32 copy starting on a 64-byte boundary (MLX buffers are not):
    misaligned rows cost the kernel ~20 % (every vector load splits a cache line)."""
    buf = np.empty(a.size + 16, dtype=np.float32)
    start = (-buf.ctypes.data % 64) // 4
    out = buf[start : start + a.size].reshape(a.shape)
    np.copyto(out, a)
    return out


if __name__ == "__main__":  # `python -m slotserve.kernels.cpu_gemm`: build now (make setup)
    print(build())
