"""slotserve's own CPU kernels (C in src/kernels/native/), built once per machine.

The C sources are compiled with the system C compiler and OpenMP into one shared
library cached in ~/.cache/slotserve, keyed by the sources, the flags and this CPU's
feature flags (the code is built with -march=native). `make setup` builds it; else
the first model load does (about a second). Without a compiler, or with
SLOTSERVE_NATIVE=0, callers fall back to MLX ops and a warning says so.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import threading
from pathlib import Path

import structlog

log = structlog.get_logger("slotserve.native")

SOURCES = sorted(Path(__file__).with_name("native").glob("*.[ch]"))
FLAGS = ["-O3", "-march=native", "-ffp-contract=fast", "-fopenmp", "-shared", "-fPIC"]

_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_tried = False

_c_i64, _c_ptr = ctypes.c_int64, ctypes.c_void_p
_SIGNATURES = {
    "slot_gemm": [_c_ptr, _c_i64, _c_i64, _c_ptr, ctypes.c_int, _c_i64, _c_ptr],
    "slot_attention": [_c_ptr, _c_i64, _c_i64, _c_i64, _c_i64, _c_i64, ctypes.c_float, _c_i64,
                       _c_ptr, _c_ptr, _c_ptr, _c_i64, _c_ptr, _c_ptr, _c_ptr],
    "slot_swiglu": [_c_ptr, _c_i64, _c_i64, _c_ptr],
    "slot_rope": [_c_ptr, _c_i64, _c_i64, _c_i64, _c_i64, _c_ptr, _c_ptr, _c_ptr],
    "slot_kv_write": [_c_ptr, _c_ptr, _c_ptr, _c_i64, _c_i64, _c_i64, _c_i64, _c_i64, _c_i64,
                      _c_ptr],
}


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
    digest = hashlib.sha256(" ".join(FLAGS).encode() + _cpu_signature().encode())
    for src in SOURCES:
        digest.update(src.name.encode() + src.read_bytes())
    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "slotserve"
    return cache / f"native-{digest.hexdigest()[:16]}.so"


def build() -> Path:
    """Compile the kernels for this machine (no-op when the cached build exists)."""
    out = library_path()
    if out.exists():
        return out
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        raise RuntimeError("no C compiler (cc/gcc) on PATH")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(f".{os.getpid()}.tmp")
    cfiles = [str(s) for s in SOURCES if s.suffix == ".c"]
    res = subprocess.run([cc, *FLAGS, *cfiles, "-o", str(tmp)], capture_output=True, text=True)
    if res.returncode != 0:
        raise RuntimeError(f"compiling the native kernels failed: {res.stderr.strip()[-800:]}")
    tmp.replace(out)
    return out


def library() -> ctypes.CDLL | None:
    """The loaded kernels, or None (disabled, or they could not be built: logged once)."""
    global _lib, _tried
    if _tried:  # the hot path: every Linear and attention call asks
        return _lib
    with _lock:
        if _tried:
            return _lib
        _tried = True
        if os.environ.get("SLOTSERVE_NATIVE", "1") == "0":
            log.info("native CPU kernels disabled (SLOTSERVE_NATIVE=0); using MLX ops")
            return None
        try:
            lib = ctypes.CDLL(str(build()))
        except (OSError, RuntimeError) as exc:
            log.warning("native CPU kernels unavailable; using MLX ops (slower)", error=str(exc))
            return None
        for name, args in _SIGNATURES.items():
            fn = getattr(lib, name)
            fn.argtypes = args
            fn.restype = ctypes.c_int
        _lib = lib
        return _lib


if __name__ == "__main__":  # `python -m slotserve.kernels.native`: build now (make setup)
    print(build())
