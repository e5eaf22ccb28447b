"""slotserve's own CPU kernels (C in src/kernels/native/), built once per machine.

The C sources are compiled with the system C compiler and OpenMP into one shared
library cached in ~/.cache/slotserve, keyed by the sources, the flags and this CPU's
feature flags. The target instruction set is `-march=native` by default;
SLOTSERVE_CPU_ARCH picks another one this CPU can run (`x86-64-v3` = AVX2 + FMA, so an
AVX-512 machine runs, and tests, the AVX2 kernels; `x86-64-v4` = AVX-512). The kernels
shape their register tiles per instruction set (vec.h) but keep one reduction order,
so results do not depend on the build. `make setup` builds it; else the first model
load does (about a second). Without a compiler, or with SLOTSERVE_NATIVE=0, callers
fall back to MLX ops and a warning says so.
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

from slotserve import settings

log = structlog.get_logger("slotserve.native")

SOURCES = sorted(Path(__file__).with_name("native").glob("*.[ch]"))
FLAGS = ["-O3", "-ffp-contract=fast", "-fopenmp", "-shared", "-fPIC"]
# x86-64 levels a test or a user may ask for, with the CPU flags each one needs
X86_LEVELS = {"x86-64-v3": ("avx2", "fma", "f16c", "bmi2"),
              "x86-64-v4": ("avx512f", "avx512bw", "avx512dq", "avx512vl")}

_lock = threading.Lock()
_libs: dict[str, ctypes.CDLL | None] = {}

_c_i64, _c_ptr = ctypes.c_int64, ctypes.c_void_p
_SIGNATURES = {
    "slot_gemm": [_c_ptr, _c_i64, _c_i64, _c_ptr, ctypes.c_int, _c_i64, _c_ptr],
    "slot_attention": [_c_ptr, _c_i64, _c_i64, _c_i64, _c_i64, _c_i64, ctypes.c_float, _c_i64,
                       _c_ptr, _c_ptr, _c_ptr, _c_ptr, _c_i64, _c_ptr, _c_ptr, _c_ptr],
    "slot_swiglu": [_c_ptr, _c_i64, _c_i64, _c_ptr],
    "slot_rms_norm": [_c_ptr, _c_i64, _c_i64, _c_ptr, ctypes.c_float, _c_ptr],
    "slot_rope": [_c_ptr, _c_i64, _c_i64, _c_i64, _c_i64, _c_ptr, _c_ptr, _c_ptr],
    "slot_kv_write": [_c_ptr, _c_ptr, _c_ptr, _c_i64, _c_i64, _c_i64, _c_i64, _c_i64, _c_i64,
                      _c_ptr],
    "slot_quantize_rows": [_c_ptr, _c_i64, _c_i64, _c_ptr, _c_ptr, _c_ptr, _c_ptr],
    "slot_qgemm": [_c_ptr, _c_ptr, _c_ptr, _c_ptr, _c_i64, _c_i64, _c_ptr, ctypes.c_int,
                   ctypes.c_int, _c_i64, _c_ptr],
    "slot_qgemm_f32": [_c_ptr, _c_i64, _c_i64, _c_ptr, ctypes.c_int, ctypes.c_int, _c_i64,
                       _c_ptr],
    "slot_top_values": [_c_ptr, _c_i64, _c_i64, _c_i64, _c_ptr],
    "slot_sampler_exp2": [_c_ptr, _c_i64, _c_i64, _c_ptr, _c_ptr],
    "slot_sampler_draw": [_c_ptr, _c_i64, _c_i64, _c_ptr, _c_ptr, _c_ptr, _c_ptr, _c_ptr],
    "slot_llama_block": [_c_ptr, _c_i64, _c_i64, _c_ptr, _c_ptr, ctypes.c_float, _c_ptr,
                         _c_ptr, _c_ptr, _c_ptr, _c_ptr, _c_ptr, _c_i64, _c_i64, _c_i64,
                         _c_ptr, _c_ptr, _c_ptr, _c_ptr, _c_ptr, _c_i64, _c_ptr, _c_i64,
                         _c_ptr, _c_ptr, ctypes.c_float, _c_i64],
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


def default_arch() -> str:
    """The instruction set the engine's kernels are built for (SLOTSERVE_CPU_ARCH)."""
    return settings.current().cpu_arch


def runnable_archs() -> list[str]:
    """Targets this CPU can run: "native", plus the x86-64 levels its flags cover."""
    flags = set(_cpu_signature().split())
    return ["native"] + [a for a, need in X86_LEVELS.items() if flags.issuperset(need)]


def _arch_flags(arch: str) -> list[str]:
    if arch != "native" and arch not in X86_LEVELS:
        raise ValueError(f"unknown CPU target {arch!r} (native, {', '.join(X86_LEVELS)})")
    if arch != "native" and arch not in runnable_archs():
        raise RuntimeError(f"this CPU cannot run {arch} code")
    return [f"-march={arch}"]


def library_path(arch: str | None = None) -> Path:
    arch = arch or default_arch()
    flags = " ".join([*FLAGS, *_arch_flags(arch)])
    digest = hashlib.sha256(flags.encode() + _cpu_signature().encode())
    for src in SOURCES:
        digest.update(src.name.encode() + src.read_bytes())
    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "slotserve"
    return cache / f"native-{digest.hexdigest()[:16]}.so"


def build(arch: str | None = None) -> Path:
    """Compile the kernels for this machine (no-op when the cached build exists)."""
    arch = arch or default_arch()
    out = library_path(arch)
    if out.exists():
        return out
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        raise RuntimeError("no C compiler (cc/gcc) on PATH")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(f".{os.getpid()}.tmp")
    cfiles = [str(s) for s in SOURCES if s.suffix == ".c"]
    cmd = [cc, *FLAGS, *_arch_flags(arch), *cfiles, "-lm", "-o", str(tmp)]
    res = subprocess.run(cmd, capture_output=True, text=True)
    if res.returncode != 0:
        raise RuntimeError(f"compiling the native kernels failed: {res.stderr.strip()[-800:]}")
    tmp.replace(out)
    return out


def library(arch: str | None = None) -> ctypes.CDLL | None:
    """The loaded kernels for `arch` (default: the engine's target), or None (disabled,
    or they could not be built: logged once per target)."""
    key = arch or "default"
    lib = _libs.get(key, False)  # the hot path: every Linear and attention call asks
    if lib is not False:
        return lib  # type: ignore[return-value]
    with _lock:
        if key not in _libs:
            _libs[key] = _load(arch)
        return _libs[key]


def _load(arch: str | None) -> ctypes.CDLL | None:
    if not settings.current().native:
        log.info("native CPU kernels disabled (SLOTSERVE_NATIVE=0); using MLX ops")
        return None
    try:
        lib = ctypes.CDLL(str(build(arch)))
    except (OSError, RuntimeError, ValueError) as exc:
        log.warning("native CPU kernels unavailable; using MLX ops (slower)", error=str(exc))
        return None
    for name, args in _SIGNATURES.items():
        fn = getattr(lib, name)
        fn.argtypes = args
        fn.restype = ctypes.c_int
    return lib


if __name__ == "__main__":  # `python -m slotserve.kernels.native`: build now (make setup)
    for target in dict.fromkeys([default_arch(), *runnable_archs()]):
        print(build(target))
