"""The elementwise glue around the matmuls and attention (rope_write.cu, swiglu.cu): one
launch each, so a layer's graph stays short (building and launching a graph is host time
on every step)."""

from __future__ import annotations

import mlx.core as mx

from slotserve.kernels.cuda.launch import GLUE_THREADS
from slotserve.kernels.cuda.sources import kernel


def rope_write(qkv: mx.array, cos: mx.array, sin: mx.array, positions: mx.array,
               write_rows: mx.array, kpool: mx.array, vpool: mx.array, heads: int,
               kv_heads: int, head_dim: int) -> mx.array:
    """Fused QKV rows -> RoPE'd q [R, heads * D]; RoPE'd k and v written into the pool.

    cos/sin: the whole [positions, D] tables; positions: [R] int32; write_rows: [n, kv_heads]
    int32 pool rows of each real row's K/V (Batch.write_rows; rows n.. of qkv are padding
    up to the probe's row floor and write nothing); kpool/vpool: a layer's pool
    arrays [rows, D], written in place: MLX sees them only as inputs, so the writes take
    effect when q is evaluated (the step's attention reads q, so they come first) and
    nothing else may hold a copy of the pool expecting its old contents. Saves the two
    scatters per layer a step otherwise adds (four graph ops and two launches).
    """
    r = qkv.shape[0]
    assert write_rows.shape[0] <= r and write_rows.shape[1] == kv_heads, "pool rows per row"
    pairs = r * (heads + 2 * kv_heads) * (head_dim // 2)
    (q,) = kernel("rope_write")(
        inputs=[qkv, cos, sin, positions, write_rows, kpool, vpool],
        template=[("T", qkv.dtype), ("D", head_dim), ("HKV", kv_heads)],
        grid=(pairs, 1, 1),
        threadgroup=(GLUE_THREADS, 1, 1),
        output_shapes=[(r, heads * head_dim)],
        output_dtypes=[qkv.dtype],
    )
    return q


def swiglu(gate_up: mx.array, paired: bool = False) -> mx.array:
    """[R, 2I] (gate then up, or paired: tiles in paired_rows order) -> silu(gate) * up, [R, I]."""
    r, two_i = gate_up.shape
    (out,) = kernel("swiglu")(
        inputs=[gate_up],
        template=[("T", gate_up.dtype), ("PAIRED", paired)],
        grid=(r * (two_i // 2), 1, 1),
        threadgroup=(GLUE_THREADS, 1, 1),
        output_shapes=[(r, two_i // 2)],
        output_dtypes=[gate_up.dtype],
    )
    return out
