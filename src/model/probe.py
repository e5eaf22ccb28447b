"""Start-up probe of a loaded model: the row count from which its matmuls stop depending
on it, and whether its attention path is batch-invariant on this machine.

The kernel-level checks live in slotserve.kernels.invariance; this module walks the model
and applies them to every distinct weight shape, then sets the row floor the layers pad to.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import structlog

from slotserve.kernels import cuda, native
from slotserve.kernels.invariance import (
    attention_invariant,
    cuda_attention_invariant,
    linear_floor,
    native_attention_invariant,
)
from slotserve.model import layers

log = structlog.get_logger("slotserve.invariance")


@dataclass
class ProbeReport:
    linear_floor: int
    invariant: bool
    failures: list[str] = field(default_factory=list)



def probe_model(model: Any, max_rows: int) -> ProbeReport:
    """Measure floors for every distinct linear shape of `model`; set them globally."""
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
        attention_ok = native_attention_invariant(lib, group, cfg.num_kv_heads, cfg.head_dim)
    elif cuda.enabled() and cuda.attention_supported(model.dtype, cfg.head_dim):
        attention_ok = cuda_attention_invariant(group, cfg.num_kv_heads, cfg.head_dim)
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
    """The model's matmuls, as its layers declare them (layers.Layer.linears). An embedding
    table is only gathered from, so it is left out; when it doubles as the lm_head it is
    the model's lm_head."""
    return model.linears()
