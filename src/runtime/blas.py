"""Load an optimized CPU BLAS ahead of MLX.

MLX's Linux CPU wheel links the reference Netlib BLAS, which is ~10x slower on the
f32 matmuls that dominate a CPU forward. Loading Debian's OpenBLAS with RTLD_GLOBAL
before `mlx.core` is imported makes MLX's `cblas_sgemm` calls resolve to OpenBLAS.
This must run before anything imports MLX, so `slotserve/__init__.py` calls it.
"""

from __future__ import annotations

import ctypes
import os
import sys

OPENBLAS_CANDIDATES = (
    "/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3",
    "/usr/lib/aarch64-linux-gnu/openblas-pthread/libblas.so.3",
    "/usr/lib/x86_64-linux-gnu/libopenblas.so.0",
    "/usr/lib/aarch64-linux-gnu/libopenblas.so.0",
)

_state: dict[str, str | None] = {"loaded": None, "reason": None}


def load_openblas() -> str | None:
    """Load OpenBLAS globally once; return its path, or None when it is unavailable.

    Set SLOTSERVE_BLAS=reference to keep MLX's bundled BLAS (for comparisons).
    """
    if _state["loaded"] is not None or _state["reason"] is not None:
        return _state["loaded"]
    if sys.platform != "linux":
        _state["reason"] = "not linux: MLX uses Accelerate/Metal"
        return None
    if os.environ.get("SLOTSERVE_BLAS", "").lower() == "reference":
        _state["reason"] = "SLOTSERVE_BLAS=reference"
        return None
    if "mlx.core" in sys.modules:
        _state["reason"] = "mlx.core was imported before slotserve; OpenBLAS not preloaded"
        return None
    for path in OPENBLAS_CANDIDATES:
        if os.path.exists(path):
            try:
                ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
            except OSError as exc:  # a broken install: keep looking, then fall back
                _state["reason"] = f"{path}: {exc}"
                continue
            _state["loaded"] = path
            _state["reason"] = None
            return path
    _state["reason"] = "OpenBLAS not found (apt-get install libopenblas0-pthread)"
    return None


def blas_status() -> tuple[str | None, str | None]:
    """(loaded path, reason it is not loaded) for start-up logs."""
    return _state["loaded"], _state["reason"]
