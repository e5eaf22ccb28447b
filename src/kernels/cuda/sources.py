"""The CUDA kernels' sources: the .cu/.cuh files beside this module, read and compacted once.

Each kernel is the body of an `mx.fast.cuda_kernel` (MLX writes its signature from the
input and output names and the template arguments) after a header of device helpers.
MLX copies a custom kernel's whole source into every op and hashes it at every launch:
~0.2-0.6 µs a kB on the H200's hosts (measured with bench/gpu_bench.py's eval_us_per_op,
a one-line kernel with and without 10 kB more of source), at ~200 launches a step. So the
text handed to MLX is compacted (no comments, indentation or blank lines) once, when a
kernel's source is first asked for, and each kernel object is made once.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache
from importlib import resources
from typing import Any

import mlx.core as mx


@dataclass(frozen=True)
class KernelSource:
    """Where one kernel's text comes from: a body file, its headers after common.cuh, and
    for the attention kernels the fragments put at the body's `@Q@`, `@PATCH_K@` and
    `@PATCH_V@` lines (patch: the two patch files, or none) and at its other marked lines
    (`fragments`: marker, file)."""

    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    body: str
    headers: tuple[str, ...] = ()
    query: str | None = None
    patch: tuple[str, str] | None = None
    fragments: tuple[tuple[str, str], ...] = ()


_ATTENTION_INPUTS = ("kpool", "vpool", "tables", "row_table", "row_pos", "tiles", "params",
                     "sinks")
_ATTENTION_HEADERS = ("cp_async.cuh", "mma.cuh", "attention_out.cuh", "attention_splits.cuh")
_WHOLE = (("@BLOCK@", "attention_whole_block.cu"), ("@PAD@", "attention_whole_pad.cu"),
          ("@OUT@", "attention_whole_out.cu"))
_SPLIT = (("@BLOCK@", "attention_split_block.cu"), ("@PAD@", "attention_split_pad.cu"),
          ("@OUT@", "attention_split_out.cu"), ("@FOLD@", "attention_fold_none.cu"))
_ROPE: dict[str, Any] = {"query": "rope_attention_query.cu",
         "patch": ("rope_attention_patch_k.cu", "rope_attention_patch_v.cu")}

# q4_gemm.cu's and q4_wgmma.cu's headers and shared fragments (the weights' staging, x's fragments)
_Q4_HEADERS = ("cp_async.cuh", "mma.cuh", "q4_matmul.cuh")
_STAGE_W, _XA = ("@STAGE_W@", "q4_gemm_stage_w.cu"), ("@XA@", "q4_gemm_xa.cu")

KERNELS: dict[str, KernelSource] = {
    "q4_matmul": KernelSource(("x", "wp", "sp", "res", "nw"), ("y",), "q4_matmul.cu",
                              ("cp_async.cuh", "mma.cuh", "norm_row.cuh",
                               "q4_matmul.cuh")),
    "q4_gemm": KernelSource(("x", "wp", "sp", "res"), ("y",), "q4_gemm.cu", _Q4_HEADERS,
                            fragments=(_STAGE_W, _XA)),
    # not a cuda_kernel body but a whole kernel for sm_90a (q4_wgmma() below)
    "q4_wgmma": KernelSource(("x", "wp", "sp", "res"), ("y",), "q4_wgmma.cu", _Q4_HEADERS,
                             fragments=(_STAGE_W, _XA)),
    "rms_rows": KernelSource(("x", "w"), ("y",), "rms_rows.cu", ("norm_row.cuh",)),
    "paged_attention": KernelSource(("q", *_ATTENTION_INPUTS), ("out", "scratch"),
                                    "paged_attention.cu", (*_ATTENTION_HEADERS, "split_fold.cuh"),
                                    query="paged_attention_query.cu",
                                    fragments=(*_WHOLE, ("@FOLD@", "attention_fold_scratch.cu"),
                                               ("@LAST@", "attention_last_fold.cu"))),
    "paged_attention_split": KernelSource(("q", *_ATTENTION_INPUTS), ("partials",),
                                          "paged_attention.cu", _ATTENTION_HEADERS,
                                          query="paged_attention_query.cu", fragments=_SPLIT),
    "attention_combine": KernelSource(("part", "row_table", "row_pos", "sinks"), ("out",),
                                      "attention_combine.cu",
                                      ("split_fold.cuh", "attention_out.cuh",
                                       "attention_splits.cuh")),
    "rope_attention": KernelSource(("qkv", *_ATTENTION_INPUTS, "cos_t", "sin_t", "write_rows"),
                                   ("out",), "paged_attention.cu", _ATTENTION_HEADERS,
                                   **_ROPE,
                                   fragments=(*_WHOLE, ("@FOLD@", "attention_fold_none.cu"),
                                              ("@LAST@", "attention_last_run.cu"))),
    "rope_attention_split": KernelSource(("qkv", *_ATTENTION_INPUTS, "cos_t", "sin_t",
                                          "write_rows"), ("partials",), "paged_attention.cu",
                                         _ATTENTION_HEADERS, **_ROPE, fragments=_SPLIT),
    "rope_write": KernelSource(("qkv", "cos_t", "sin_t", "positions", "write_rows", "kpool",
                                "vpool"), ("q",), "rope_write.cu"),
    "swiglu": KernelSource(("gate_up",), ("out",), "swiglu.cu"),
    "sample_draw": KernelSource(("z", "row_max", "knobs", "iknobs", "draws"),
                                ("tokens",), "sample_draw.cu", ("sample_draw.cuh",)),
}


@cache
def _read(filename: str) -> str:
    """One source file's text (package data: found in a wheel and in the source tree)."""
    return resources.files(__package__).joinpath(filename).read_text(encoding="utf-8")


def _substitute(body: str, marker: str, fragment: str) -> str:
    """body with its one line reading exactly `marker` replaced by the fragment's lines."""
    lines = body.split("\n")
    assert lines.count(marker) == 1, f"{marker} must be one line of the body"
    at = lines.index(marker)
    inserted = fragment.strip("\n").split("\n") if fragment.strip() else []
    return "\n".join([*lines[:at], *inserted, *lines[at + 1 :]])


def compact(source: str) -> str:
    """CUDA source without comments, indentation or blank lines (what MLX hashes)."""
    out = []
    for line in source.splitlines():
        code = line.split("//", 1)[0].strip()
        if code:
            out.append(code)
    return "\n".join(out) + "\n"


@cache
def source(name: str) -> tuple[str, str]:
    """(body, header) of a kernel as MLX gets them: assembled and compacted once."""
    spec = KERNELS[name]
    body = _read(spec.body)
    if spec.query is not None:
        body = _substitute(body, "@Q@", _read(spec.query))
        patch_k, patch_v = (_read(f) for f in spec.patch) if spec.patch else ("", "")
        body = _substitute(body, "@PATCH_K@", patch_k)
        body = _substitute(body, "@PATCH_V@", patch_v)
    for marker, filename in spec.fragments:
        body = _substitute(body, marker, _read(filename))
    header = _read("common.cuh") + "".join(_read(h) for h in spec.headers)
    return compact(body), compact(header)


@cache
def kernel(name: str, shared_memory: int = 0) -> Any:
    """The kernel object; one per dynamic shared-memory size (MLX fixes it per object).

    MLX compiles one kernel per source and template values, and sets its shared-memory
    limit once, at its first launch: a later launch of the same compiled kernel asking for
    more fails (cuGraphAddKernelNode: invalid argument). So a launch with dynamic shared
    memory carries its size as one more template value (SMEM), and each size is a kernel
    of its own (a NORM q4_matmul's grows with its rows and K)."""
    spec = KERNELS[name]
    body, header = source(name)
    fn = mx.fast.cuda_kernel(name=f"slotserve_{name}", input_names=list(spec.inputs),
                             output_names=list(spec.outputs), source=body, header=header,
                             shared_memory=shared_memory)
    if not shared_memory:
        return fn

    def launch(*, template: list[tuple[str, Any]], **kwargs: Any) -> Any:
        return fn(template=[*template, ("SMEM", shared_memory)], **kwargs)

    return launch


@cache
def q4_wgmma(ksplit: int, resid: bool) -> tuple[str, str]:
    """(kernel name, whole source) of q4_wgmma.cu, a kernel built for sm_90a (sm90a.py),
    not a cuda_kernel body: its headers before it and its constants (q4_gemm.cu's template
    values) defined, with a name of its own a variant (MLX keeps a precompiled module by
    name) and uint32_t / uint64_t spelled out (NVRTC has no <cstdint>)."""
    name = f"slotserve_q4_wgmma_{ksplit}_{'t' if resid else 'f'}"
    head = ("#include <cuda_bf16.h>\n#define uint32_t unsigned int\n"
            "#define uint64_t unsigned long long\n"
            f"#define KSPLIT {ksplit}\n#define RESID {'true' if resid else 'false'}\n"
            f"#define KERNEL_NAME {name}\n")
    body, header = source("q4_wgmma")
    return name, head + header + body
