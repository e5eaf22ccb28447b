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
from functools import cache

OPENBLAS_CANDIDATES = (
    "/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3",
    "/usr/lib/aarch64-linux-gnu/openblas-pthread/libblas.so.3",
    "/usr/lib/x86_64-linux-gnu/libopenblas.so.0",
    "/usr/lib/aarch64-linux-gnu/libopenblas.so.0",
)


@cache
def load_openblas() -> str | None:
    """Load OpenBLAS globally once; return its path, or None when it cannot be: not Linux
    (MLX uses Accelerate/Metal there), mlx.core imported before slotserve (too late to
    preload), or no OpenBLAS installed (apt-get install libopenblas0-pthread)."""
    if sys.platform != "linux" or "mlx.core" in sys.modules:
        return None
    for path in OPENBLAS_CANDIDATES:
        if os.path.exists(path):
            try:
                ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
            except OSError:  # a broken install: keep looking, then fall back
                continue
            return path
    return None
