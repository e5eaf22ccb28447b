"""Kernels built for sm_90a (Hopper's architecture-specific features: wgmma) and launched
through mx.fast.precompiled_cuda_kernel.

MLX's cuda_kernel compiles with NVRTC for `sm_<major><minor>` (sm_90 on an H100), where
ptxas rejects wgmma. This compiles a whole kernel (an `extern "C"` function) with the same
NVRTC library MLX has loaded, for sm_90a, with MLX's include paths, once per source text a
process, and hands the cubin to MLX, which launches it like its own.
"""

from __future__ import annotations

import ctypes
import os
from functools import cache
from pathlib import Path

import mlx.core as mx
import structlog

log = structlog.get_logger(__name__)


@cache
def _nvrtc() -> ctypes.CDLL:
    """The NVRTC library MLX compiles its kernels with (loaded by its first kernel)."""
    def mapped() -> list[str]:
        with open("/proc/self/maps", encoding="utf-8") as maps:
            return sorted({line.split()[-1] for line in maps
                           if "libnvrtc" in line and "/" in line and "builtins" not in line})

    if not mapped():  # MLX loads NVRTC when it first compiles a kernel
        k = mx.fast.cuda_kernel(name="slotserve_nvrtc_load", input_names=["a"],
                                output_names=["b"], source="b[0] = a[0];")
        mx.eval(k(inputs=[mx.zeros((1,), mx.float32)], grid=(1, 1, 1), threadgroup=(1, 1, 1),
                  output_shapes=[(1,)], output_dtypes=[mx.float32])[0])
    paths = mapped()
    if not paths:
        raise RuntimeError("MLX has not loaded libnvrtc")
    return ctypes.CDLL(paths[0])


# the headers every sm_90a kernel here includes, compiled once to see that NVRTC finds them
_PROBE = """#include <cuda_bf16.h>
extern "C" __global__ void slotserve_sm90a_probe(__nv_bfloat16* y) {
  y[0] = __float2bfloat16(1.0f);
}
"""


@cache
def available() -> bool:
    """Whether kernels built here run on the default device: Hopper (sm_90, built for as
    sm_90a; Blackwell and later drop wgmma, Ampere and Ada never had it) where NVRTC builds
    for sm_90a with the headers MLX uses. Where it cannot, a warning says why and callers
    keep their mma.sync kernels (the same bits, slower)."""
    if mx.device_info().get("architecture") != "sm_90":
        return False
    try:
        cubin(_PROBE)
    except (RuntimeError, OSError) as e:
        log.warning("sm_90a kernels unavailable: NVRTC cannot build them", error=str(e))
        return False
    return True


def _include_paths() -> list[str]:
    """Where MLX's NVRTC finds the CCCL and CUDA headers, in its order
    (mlx/backend/cuda/jit_module.cpp): the CCCL bundled with mlx, then the CUDA runtime's
    headers of the pip package beside it, else the toolkit's (CUDA_HOME, CUDA_PATH,
    /usr/local/cuda)."""
    root = Path(mx.__file__).parent
    cccl = root / "include" / "cccl"
    runtime = root.parent / "nvidia" / "cuda_runtime" / "include"
    if not runtime.is_dir():
        home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH") or "/usr/local/cuda"
        runtime = Path(home) / "include"
    return [str(p) for p in ([cccl] if cccl.is_dir() else []) + [runtime]]


@cache
def cubin(source: str) -> bytes:
    """source compiled for sm_90a; RuntimeError with NVRTC's log where it does not compile."""
    lib = _nvrtc()
    prog = ctypes.c_void_p()
    if lib.nvrtcCreateProgram(ctypes.byref(prog), source.encode(), b"slotserve.cu", 0, None,
                              None):
        raise RuntimeError("nvrtcCreateProgram failed")
    options = [b"--gpu-architecture=sm_90a", b"--std=c++17",
               *(f"--include-path={p}".encode() for p in _include_paths())]
    status = lib.nvrtcCompileProgram(prog, len(options), (ctypes.c_char_p * len(options))(*options))
    size = ctypes.c_size_t()
    lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
    messages = ctypes.create_string_buffer(size.value)
    lib.nvrtcGetProgramLog(prog, messages)
    if status:
        lib.nvrtcDestroyProgram(ctypes.byref(prog))
        raise RuntimeError(f"NVRTC: {messages.value.decode(errors='replace')}")
    lib.nvrtcGetCUBINSize(prog, ctypes.byref(size))
    out = ctypes.create_string_buffer(size.value)
    lib.nvrtcGetCUBIN(prog, out)
    lib.nvrtcDestroyProgram(ctypes.byref(prog))
    return out.raw
