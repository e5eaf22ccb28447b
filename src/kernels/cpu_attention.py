"""CPU attention through slotserve's own kernel (native/attention.c), read in place from the pool.

One call per layer covers every row of the step (decode tokens of all slots and
prefill chunks alike): each row attends to its own slot's keys up to its position.
MLX's batched matmuls ran one small BLAS call per (slot, kv head, key block) plus
the softmax as separate ops; this is one pass per (row, head) over 2 cores.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from slotserve.kernels.cpu_gemm import aligned_empty, to_host

LOG2E = 1.4426950408889634


@dataclass
class RowTables:
    """Where each row of a step reads its keys from (built once per step, numpy int32).

    tables[t, j, h]: pool block of positions j*BLOCK.. of kv head h for table t;
    row_table[r]: the table of row r (-1 for padding rows); row_pos[r]: its position.
    """

    tables: np.ndarray
    row_table: np.ndarray
    row_pos: np.ndarray
    write_rows: np.ndarray | None = None  # [real rows, kv_heads] pool row of each K/V head


def _run(lib: ctypes.CDLL, q: np.ndarray, q_stride: int, r: int, hq: int, hkv: int, d: int,
         keys: np.ndarray, values: np.ndarray, rows: RowTables, scale: float,
         window: int | None, sinks: np.ndarray | None = None) -> np.ndarray:
    out = aligned_empty((r, hq * d))
    rc = lib.slot_attention(
        q.ctypes.data, q_stride, r, hq, hkv, d, ctypes.c_float(scale * LOG2E), window or 0,
        None if sinks is None else sinks.ctypes.data, keys.ctypes.data, values.ctypes.data,
        rows.tables.ctypes.data, rows.tables.shape[1],
        rows.row_table.ctypes.data, rows.row_pos.ctypes.data, out.ctypes.data,
    )
    if rc != 0:
        raise RuntimeError(f"slot_attention failed (code {rc}; head_dim {d} must be a multiple "
                           "of 16 and at most 512)")
    return out


def pool_host(keys: mx.array, values: mx.array) -> tuple[np.ndarray, np.ndarray]:
    """The layer's pool arrays as host views (no copy; the kernels read and write them)."""
    mx.eval(keys, values)
    k_host, v_host = np.asarray(keys), np.asarray(values)
    if not (k_host.flags.c_contiguous and v_host.flags.c_contiguous):
        raise ValueError("KV pool arrays must be contiguous")
    return k_host, v_host


def attend(lib: ctypes.CDLL, q: mx.array, keys: mx.array, values: mx.array, rows: RowTables,
           scale: float, window: int | None, sinks: np.ndarray | None = None) -> mx.array:
    """q: [R, Hq, D] float32; keys/values: the layer's pool arrays [blocks * BLOCK, D];
    sinks: [Hq] float32 attention-sink logits (gpt-oss), one more logit per head in the
    softmax that weights no value."""
    r, hq, d = q.shape
    k_host, v_host = pool_host(keys, values)
    log2_sinks = None if sinks is None else np.ascontiguousarray(sinks * np.float32(LOG2E),
                                                                  dtype=np.float32)
    out = _run(lib, to_host(q.reshape(r, hq * d)), hq * d, r, hq, rows.tables.shape[2], d,
               k_host, v_host, rows, scale, window, log2_sinks)
    return mx.array(out).reshape(r, hq, d)


@dataclass
class RopeTables:
    """A model's cos/sin tables [positions, head_dim] as float32 host views."""

    cos: np.ndarray
    sin: np.ndarray


def supported(head_dim: int) -> bool:
    """Head sizes the kernel handles (others use the MLX path)."""
    return head_dim % 16 == 0 and head_dim <= 512
