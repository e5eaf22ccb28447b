"""slotserve's own CUDA kernels (through `mx.fast.cuda_kernel`), batch-invariant by construction.

The kernels are the .cu/.cuh files of this package; a thin Python wrapper per kernel
launches each one:

* `q4_matmul` (q4.py, q4_matmul.cu): y = x W^T for MLX affine 4-bit weights (group 64),
  bf16 activations, on the tensor cores; every output element is computed the same way
  whatever the row count, so one row alone and the same row in a batch of 128 give the
  same bits. It can take the RMS norm before it (`norm=`, `rms_rows` being the same
  arithmetic in a launch of its own), SwiGLU (`gate_up=`) and the residual add after it.
* `paged_attention` (attention.py, paged_attention.cu): one thread block per (tile of a
  prompt's rows, kv head) over the slot's paged KV on the tensor cores; a row has the same
  bits in any tile, so decode and prefill rows agree. `rope_attention` does the rotation
  and the K/V write inside that launch on decode steps.
* `sample_draw` (sample.py, sample_draw.cu): the sampled rows' truncation and draw in one
  launch, a block per row, with integer masses.
* `rope_write` and `swiglu` (glue.py): the elementwise glue in one launch each;
  `rope_write` also puts K/V straight into the pool (no scatter ops).

How each launch is cut (block shapes, when work moves into a neighbour's launch) is one
table, launch.py; sources.py reads and compacts the sources once. The tests compare each
kernel against a plain MLX reference and check invariance on the GPU
(tests/test_cuda_kernels.py, marked gpu).
"""

from __future__ import annotations

import mlx.core as mx

from slotserve import settings
from slotserve.kernels.cuda.attention import (
    attention_supported,
    paged_attention,
    rope_attention,
)
from slotserve.kernels.cuda.glue import rope_write, swiglu
from slotserve.kernels.cuda.q4 import paired_rows, q4_matmul, q4_pack, q4_supported, rms_rows
from slotserve.kernels.cuda.sample import sample_draw

__all__ = [
    "attention_supported",
    "enabled",
    "paged_attention",
    "paired_rows",
    "q4_matmul",
    "q4_pack",
    "q4_supported",
    "rms_rows",
    "rope_attention",
    "rope_write",
    "sample_draw",
    "swiglu",
]


def enabled() -> bool:
    """Kernels run on a CUDA GPU unless SLOTSERVE_CUDA_KERNELS=0."""
    return (settings.current().cuda_kernels
            and mx.default_device() == mx.gpu and mx.cuda.is_available())
