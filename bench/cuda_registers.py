"""Registers and spills of slotserve's CUDA kernels as MLX compiles them, without a GPU.

    python3 bench/cuda_registers.py           # needs nvcc (CUDA 13) on the PATH
    python3 bench/cuda_registers.py --digest  # and a digest of each launch's machine code

Several launch rules in slotserve.kernels.cuda.launch hang on a register count: a q4_matmul
block of two row tiles (256 threads) keeps two blocks an SM at 128 registers and one above
it, and the history of these kernels has changes that crossed that line unseen. This
writes each kernel in the form `mx.fast.cuda_kernel` gives NVRTC (the body inside a
`__global__` function whose shapes are `__grid_constant__` arrays and whose template values
are constexprs, after MLX's default header and the kernel's own) and compiles it with
`nvcc -arch=sm_90a -Xptxas -v`, for the launch shapes the engine uses on the Llama-3-8B
widths. nvcc and MLX's NVRTC agreed on the counts checked so far (docs/history.md); a
change to a kernel should leave these numbers where the launch rules need them.

`--digest` adds an MD5 of each cubin's .text sections (the machine code, without the
metadata that changes with the source text): a change meant to move no instruction, a
refactor of the sources, shows the same digests before and after, and so needs no GPU run
to keep the GPU tests' verdict.
"""

from __future__ import annotations

import hashlib
import re
import struct
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from slotserve.kernels.cuda import launch, sources

# what MLX's default header brings that the kernels use (mlx/backend/cuda/device/utils.cuh)
MLX_HEADER = """#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda/std/array>
#include <cuda/std/limits>
#include <cstdint>
#include <cooperative_groups.h>
namespace mlx::core::cu {
using Shape = cuda::std::array<int32_t, 10>;
}
#define inf cuda::std::numeric_limits<float>::infinity()
"""

BF16, F32, I32, U32 = "__nv_bfloat16", "float", "int32_t", "uint32_t"
DTYPES = {"wp": U32, "sp": U32, "tables": I32, "row_table": I32, "row_pos": I32,
          "tiles": I32, "write_rows": I32, "params": F32, "sinks": F32, "part": F32,
          "partials": F32, "scratch": F32, "z": F32, "row_max": F32, "knobs": F32,
          "iknobs": I32, "draws": "uint64_t", "tokens": I32}


def kernel_source(name: str, template: list[tuple[str, Any]]) -> str:
    """The kernel as MLX hands it to NVRTC, every input's shape passed (as MLX does for the
    names the body reads); q4_wgmma, a whole kernel for sm_90a, as sm90a.py compiles it."""
    if name == "q4_wgmma":
        values = dict(template)
        return sources.q4_wgmma(values["KSPLIT"], values["RESID"])[1]
    body, header = sources.source(name)
    spec = sources.KERNELS[name]
    params = []
    for n in spec.inputs:
        params.append(f"const {DTYPES.get(n, BF16)}* {n}")
        if f"{n}_shape" in body:
            params.append(f"const __grid_constant__ Shape {n}_shape")
    params += [f"{DTYPES.get(n, BF16)}* {n}" for n in spec.outputs]
    consts = []
    for key, value in template:
        if isinstance(value, bool):
            consts.append(f"constexpr bool {key} = {'true' if value else 'false'};")
        elif isinstance(value, int):
            consts.append(f"constexpr int {key} = {value};")
        else:
            consts.append(f"using {key} = {value};")
    return (MLX_HEADER + header + "namespace mlx::core::cu {\n__global__ void k(\n"
            + ",\n".join(params) + ") {\n" + "\n".join(consts) + "\n" + body + "\n}\n}\n")


def text_digest(cubin: Path) -> str:
    """MD5 (10 hex digits) of an ELF cubin's .text sections, in section order."""
    b = cubin.read_bytes()
    (shoff,) = struct.unpack_from("<Q", b, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", b, 0x3A)
    headers = [struct.unpack_from("<IIQQQQIIQQ", b, shoff + i * shentsize) for i in range(shnum)]
    names = headers[shstrndx][4]  # the section-name table's offset
    text = b"".join(b[h[4] : h[4] + h[5]] for h in headers
                    if b[names + h[0] : b.index(b"\0", names + h[0])].startswith(b".text"))
    return hashlib.md5(text).hexdigest()[:10]


def counts(name: str, template: list[tuple[str, Any]], workdir: Path) -> tuple[int, int]:
    """(registers, bytes spilled) of one kernel form, its cubin left at workdir/k.cubin;
    RuntimeError with nvcc's message when it does not compile."""
    cu = workdir / "k.cu"
    cu.write_text(kernel_source(name, template), encoding="utf-8")
    run = subprocess.run(["nvcc", "-arch=sm_90a", "-cubin", "-o", str(workdir / "k.cubin"),
                          "-Xptxas", "-v", str(cu)], capture_output=True, text=True,
                         check=False)
    used = re.search(r"Used (\d+) registers", run.stderr)
    if used is None:
        raise RuntimeError(f"{name}: " + run.stderr.strip()[-400:])
    spill = re.search(r"(\d+) bytes spill stores", run.stderr)
    return int(used.group(1)), int(spill.group(1)) if spill else 0


def nvcc_major() -> int | None:
    """nvcc's CUDA major version, None without nvcc (MLX's wheels compile with CUDA 13's
    NVRTC: another major version may count differently)."""
    try:
        out = subprocess.run(["nvcc", "--version"], capture_output=True, text=True,
                             check=False).stdout
    except FileNotFoundError:
        return None
    found = re.search(r"release (\d+)\.", out)
    return int(found.group(1)) if found else None


def cases() -> list[tuple[str, str, list[tuple[str, Any]]]]:
    """(label, kernel, template) of the engine's launches on the Llama-3-8B widths (q4_matmul
    labels end in the launch's Q4Shape)."""
    out = []
    k = 4096
    # (rows, columns, what the projection asks): QKV and gate+up take the norm, O and
    # down the residual
    projections = (("qkv", 6144, {"norm": True}), ("o", 4096, {"residual": True}),
                   ("gate_up", 28672, {"norm": True, "gate_up": True}),
                   ("down", 4096, {"residual": True}))
    for m in (1, 8, 32, 64):
        for proj, n, asks in projections:
            if launch.q4_gemm(m, n):
                continue
            shape = launch.q4_shape(m, n, norm=asks.get("norm", False),
                                    gate_up=asks.get("gate_up", False))
            kk = 14336 if proj == "down" else k
            ksplit = launch.k_split(kk // 128)
            smem = launch.q4_shared_bytes(shape, ksplit, m, kk)
            template = [("MT", shape.mt), ("NT", shape.nt), ("KSPLIT", ksplit),
                        ("STAGES", shape.stages), ("SWIGLU", shape.swiglu),
                        ("RESID", asks.get("residual", False)), ("NORM", shape.norm),
                        ("EPS", 925353388), ("SMEM", smem)]
            out.append((f"q4_matmul {proj} {m} rows {shape}", "q4_matmul", template))
    for resid in (False, True):
        out.append((f"q4_gemm resid={resid}", "q4_gemm",
                    [("KSPLIT", 8), ("STAGES", launch.GEMM_STAGES), ("RESID", resid),
                     ("SMEM", launch.q4_gemm_shared_bytes())]))
        out.append((f"q4_wgmma resid={resid}", "q4_wgmma", [("KSPLIT", 8), ("RESID", resid)]))
    for name, tile, merge in (("paged_attention", launch.ATTENTION_TILE, False),
                              ("paged_attention", launch.ATTENTION_TILE, True),
                              ("paged_attention_split", launch.ATTENTION_TILE, False),
                              ("paged_attention_split", 1, False), ("rope_attention", 1, False),
                              ("rope_attention_split", 1, False)):
        smem = launch.attention_shared_bytes(128)
        out.append((f"{name} tile {tile}{' merge' if merge else ''}", name,
                    [("T", BF16), ("G", 4), ("D", 128), ("WINDOW", 0), ("TILE", tile),
                     *launch.split_template(), ("SINKS", False),
                     ("MERGE", merge), ("SMEM", smem)]))
    out.append(("attention_combine", "attention_combine",
                [("G", 4), ("D", 128), *launch.split_template(),
                 ("SINKS", False)]))
    out.append(("sample_draw", "sample_draw", []))
    return out


def main() -> int:
    digest = "--digest" in sys.argv[1:]
    with tempfile.TemporaryDirectory() as tmp:
        for label, name, template in cases():
            used, spilled = counts(name, template, Path(tmp))
            code = f", code {text_digest(Path(tmp) / 'k.cubin')}" if digest else ""
            print(f"{label}: {used} registers, {spilled} bytes spilled{code}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
