"""Batch-invariance checks of single kernels: a matmul's row floor, the attention paths.

Batch invariance (a request's tokens do not depend on who shares its step) rests
on one property of the BLAS: a row's result must not depend on how many rows the
matmul has. That holds on some machines for every row count and on others only
above a threshold (OpenBLAS takes small-matrix or GEMV paths for few rows, and
the threshold depends on the matrix shape). The probe measures it for each
weight shape of the loaded model and for the attention kernel, and the model
pads every row batch to that floor. It takes well under a second on small models.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from typing import Any

import mlx.core as mx
import numpy as np

from slotserve.kernels import attention, cpu_attention
from slotserve.kernels.attention import (
    AttentionPlan,
    decode_attention,
    paged_blocks,
    segment_attention,
)

FLOORS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


def row_counts(limit: int) -> list[int]:
    small = list(range(1, min(limit, 20) + 1))
    big = [24, 32, 33, 48, 64, 75, 96, 128, 160, 192, 256]
    return sorted({m for m in small + big if m <= limit})


def linear_floor(fn: Any, in_dim: int, dtype: mx.Dtype, max_rows: int) -> int | None:
    """Smallest floor f so that fn(x[:m]) rows equal fn(x) rows for every m >= f."""
    x = mx.random.normal((max_rows, in_dim), key=mx.random.key(7)).astype(dtype)
    ref = fn(x)
    mx.eval(ref)
    bad = [m for m in row_counts(max_rows) if not mx.array_equal(fn(x[:m]), ref[:m]).item()]
    if not bad:
        return 1
    floor = next((f for f in FLOORS if f > max(bad)), None)
    return floor if floor is not None and floor <= max_rows else None


def attention_invariant(group: int, kv_heads: int, head_dim: int, dtype: mx.Dtype) -> bool:
    """Decode rows (alone or batched) must equal the same positions in prefill chunks."""
    cap = 3 * attention.BLOCK
    k = mx.random.normal((kv_heads, cap, head_dim), key=mx.random.key(1)).astype(dtype)
    v = mx.random.normal((kv_heads, cap, head_dim), key=mx.random.key(2)).astype(dtype)
    q = mx.random.normal((cap, kv_heads * group, head_dim), key=mx.random.key(3)).astype(dtype)
    others = [
        mx.random.normal((kv_heads, cap, head_dim), key=mx.random.key(4 + i)).astype(dtype)
        for i in range(5)
    ]
    scale = head_dim**-0.5
    own, own_blocks = paged_blocks([k])
    own_values, _ = paged_blocks([v])
    # a batch of six slots whose last one holds k/v, its blocks not first in the pool
    pool_k, idx = paged_blocks([*others, k])
    pool_v, _ = paged_blocks([*others, v])
    for pos in (0, 5, attention.BLOCK - 1, attention.BLOCK + 3, cap - 1):
        plan = AttentionPlan.build(pos, 1)
        nb = plan.span // attention.BLOCK
        one = segment_attention(q[pos : pos + 1], own, own_values, own_blocks, plan, scale)
        qs = mx.concatenate([q[:5], q[pos : pos + 1]])
        bias = mx.concatenate([mx.zeros((5, plan.span)), plan.bias(None)])
        batched = decode_attention(qs, pool_k, pool_v, idx[:, :nb], bias, scale)[5]
        if not mx.array_equal(batched, one[0]).item():
            return False
        for start in {0, max(0, pos - 7), pos}:
            n = min(cap - start, max(pos - start + 1, 40))
            many = segment_attention(q[start : start + n], own, own_values, own_blocks,
                                     AttentionPlan.build(start, n), scale)
            if not mx.array_equal(many[pos - start], one[0]).item():
                return False
    return True


RowTableAttention = Callable[[mx.array, mx.array, mx.array, cpu_attention.RowTables], np.ndarray]


def row_table_kernel_invariant(run: RowTableAttention, group: int, kv_heads: int,
                               head_dim: int, dtype: mx.Dtype) -> bool:
    """A row-table attention kernel (CPU native or CUDA) gives a row the same output alone,
    among other slots' rows, and inside a prefill chunk. run(q, keys, values, rows)."""
    pages, slots, block = 3, 6, attention.BLOCK
    cap = pages * block
    n_blocks = slots * pages * kv_heads
    keys = mx.random.normal((n_blocks * block, head_dim), key=mx.random.key(11)).astype(dtype)
    values = mx.random.normal((n_blocks * block, head_dim), key=mx.random.key(12)).astype(dtype)
    q = mx.random.normal((cap, group * kv_heads, head_dim), key=mx.random.key(13)).astype(dtype)
    page_ids = np.arange(slots * pages, dtype=np.int32).reshape(slots, pages)[::-1]
    tables = (page_ids[:, :, None] * kv_heads + np.arange(kv_heads, dtype=np.int32)).copy()

    def rows(table: list[int], pos: list[int]) -> cpu_attention.RowTables:
        return cpu_attention.RowTables(tables, np.array(table, np.int32), np.array(pos, np.int32))

    for pos in (0, 5, block - 1, block + 3, cap - 1):
        one = run(q[pos : pos + 1], keys, values, rows([2], [pos]))[0]
        mixed = run(mx.concatenate([q[:5], q[pos : pos + 1]]), keys, values,
                    rows([0, 1, 3, 4, 5, 2], [7, 300, 0, 128, 99, pos]))[5]
        start = max(0, pos - 7)
        chunk = run(q[start : pos + 1], keys, values,
                    rows([2] * (pos + 1 - start), list(range(start, pos + 1))))[-1]
        if not (np.array_equal(one, mixed) and np.array_equal(one, chunk)):
            return False
    return True


def native_attention_invariant(lib: ctypes.CDLL, group: int, kv_heads: int,
                               head_dim: int) -> bool:
    """The native CPU attention kernel: a row's output is the same alone, among other slots'
    rows, and in a prefill chunk."""

    def run(q: mx.array, keys: mx.array, values: mx.array,
            rows: cpu_attention.RowTables) -> np.ndarray:
        return np.asarray(cpu_attention.attend(lib, q, keys, values, rows, head_dim**-0.5, None))

    return row_table_kernel_invariant(run, group, kv_heads, head_dim, mx.float32)


def cuda_attention_invariant(group: int, kv_heads: int, head_dim: int) -> bool:
    """slotserve's CUDA paged attention (bf16): the same row-table checks."""
    from slotserve.kernels import cuda

    def run(q: mx.array, keys: mx.array, values: mx.array,
            rows: cpu_attention.RowTables) -> np.ndarray:
        out = cuda.paged_attention(q, keys, values, mx.array(rows.tables),
                                   mx.array(rows.row_table), mx.array(rows.row_pos),
                                   head_dim**-0.5)
        return np.asarray(out.astype(mx.float32))

    return row_table_kernel_invariant(run, group, kv_heads, head_dim, mx.bfloat16)
