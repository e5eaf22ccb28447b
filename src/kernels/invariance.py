"""Start-up probe: find the row count from which matmuls stop depending on it.

Batch invariance (a request's tokens do not depend on who shares its step) rests
on one property of the BLAS: a row's result must not depend on how many rows the
matmul has. That holds on some machines for every row count and on others only
above a threshold (OpenBLAS takes small-matrix or GEMV paths for few rows, and
the threshold depends on the matrix shape). The probe measures it for each
weight shape of the loaded model and for the attention kernel, and the model
pads every row batch to that floor. It takes well under a second on small models.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
import numpy as np
import structlog

from slotserve.kernels import attention, cpu_attention, cuda, native
from slotserve.kernels.attention import (
    AttentionPlan,
    decode_attention,
    paged_blocks,
    segment_attention,
)

log = structlog.get_logger("slotserve.invariance")

FLOORS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


@dataclass
class ProbeReport:
    linear_floor: int
    invariant: bool
    failures: list[str] = field(default_factory=list)


def _row_counts(limit: int) -> list[int]:
    small = list(range(1, min(limit, 20) + 1))
    big = [24, 32, 33, 48, 64, 75, 96, 128, 160, 192, 256]
    return sorted({m for m in small + big if m <= limit})


def linear_floor(fn: Any, in_dim: int, dtype: mx.Dtype, max_rows: int) -> int | None:
    """Smallest floor f so that fn(x[:m]) rows equal fn(x) rows for every m >= f."""
    x = mx.random.normal((max_rows, in_dim), key=mx.random.key(7)).astype(dtype)
    ref = fn(x)
    mx.eval(ref)
    bad = [m for m in _row_counts(max_rows) if not mx.array_equal(fn(x[:m]), ref[:m]).item()]
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


def probe_model(model: Any, max_rows: int) -> ProbeReport:
    """Measure floors for every distinct linear shape of `model`; set them globally."""
    from slotserve.model import layers

    cfg = model.config
    seen: dict[tuple[int, ...], Any] = {}
    for lin in linears(model):
        shape = ((lin.kernel.n, lin.kernel.k) if lin.kernel is not None
                 else lin.q.shape if lin.q is not None else tuple(lin.w.shape))
        seen.setdefault(shape, lin)
    failures: list[str] = []
    floor = 1
    for shape, lin in seen.items():
        rows = max_rows if shape[0] < 32768 else min(max_rows, 64)  # lm_head: logit rows only
        f = linear_floor(lin, shape[1], model.dtype, rows)
        if f is None:
            failures.append(f"linear {shape}: row results vary at every row count up to {rows}")
        else:
            floor = max(floor, f)
    group = cfg.num_heads // cfg.num_kv_heads
    lib = native.library()
    if layers.native_attention_for(model.dtype, cfg.head_dim):
        assert lib is not None
        attention_ok = cpu_attention.invariant(lib, group, cfg.num_kv_heads, cfg.head_dim)
    elif cuda.enabled() and cuda.attention_supported(model.dtype, cfg.head_dim):
        attention_ok = cuda.attention_invariant(group, cfg.num_kv_heads, cfg.head_dim)
    else:
        attention_ok = attention_invariant(group, cfg.num_kv_heads, cfg.head_dim, model.dtype)
    if not attention_ok:
        failures.append("attention: decode rows differ from the same rows in prefill chunks")
    layers.LINEAR_ROW_FLOOR = floor
    report = ProbeReport(floor, not failures, failures)
    if failures:
        log.warning("batch invariance NOT guaranteed on this machine", failures=failures)
    else:
        log.info("batch invariance probe passed", linear_row_floor=floor, shapes=len(seen))
    return report


def linears(model: Any) -> list[Any]:
    """The model's matmuls. An embedding table is only gathered from, so it is left out;
    when it doubles as the lm_head it is reached through `model.lm_head`."""
    from slotserve.model.layers import Embedding, Linear

    found: list[Any] = []
    seen_ids: set[int] = set()

    def walk(obj: Any, depth: int) -> None:
        if id(obj) in seen_ids or depth > 6:
            return
        seen_ids.add(id(obj))
        if isinstance(obj, Embedding):
            return
        if isinstance(obj, Linear):
            found.append(obj)
        elif isinstance(obj, list | tuple):
            for o in obj:
                walk(o, depth + 1)
        elif hasattr(obj, "__dict__") and not isinstance(obj, mx.array):
            for v in vars(obj).values():
                walk(v, depth + 1)

    walk(model, 0)
    return found
