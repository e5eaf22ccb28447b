"""Process settings read from the environment, in one place.

Every `SLOTSERVE_*` variable the package reads is a field here, so `slotserve --help`
and this module are the whole list of knobs. `current()` reads the environment at each
call (cheap), so a test or a child process that sets a variable is seen at once.
The API key (`SLOTSERVE_API_KEY`) is read by slotserve.api.keys with the other key sources.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass


@dataclass(frozen=True)
class Settings:
    native: bool  # SLOTSERVE_NATIVE=0: no native CPU kernels (MLX ops over the BLAS)
    cpu_arch: str  # SLOTSERVE_CPU_ARCH: the instruction set the CPU kernels are built for
    cuda_kernels: bool  # SLOTSERVE_CUDA_KERNELS=0: MLX's own ops on a CUDA GPU
    compile: bool  # SLOTSERVE_COMPILE=0: no compiled decode graph on the GPU
    tokenizer_dir: str | None  # SLOTSERVE_TOKENIZER_DIR: tokenizer for synthetic checkpoints


def current(env: Mapping[str, str] | None = None) -> Settings:
    e = os.environ if env is None else env
    return Settings(
        native=e.get("SLOTSERVE_NATIVE", "1") != "0",
        cpu_arch=e.get("SLOTSERVE_CPU_ARCH", "native") or "native",
        cuda_kernels=e.get("SLOTSERVE_CUDA_KERNELS", "1") != "0",
        compile=e.get("SLOTSERVE_COMPILE", "1") != "0",
        tokenizer_dir=e.get("SLOTSERVE_TOKENIZER_DIR") or None,
    )


def parse_bytes(text: str | None) -> int | None:
    """'2GiB' -> 2147483648; plain integers are bytes."""
    if text is None:
        return None
    units = {"kib": 2**10, "mib": 2**20, "gib": 2**30, "kb": 10**3, "mb": 10**6, "gb": 10**9}
    t = text.strip().lower()
    for suffix, mult in sorted(units.items(), key=lambda kv: -len(kv[0])):
        if t.endswith(suffix):
            return int(float(t[: -len(suffix)]) * mult)
    return int(t)
