"""Causal attention whose result for a query row never depends on its batch.

A query at position p must get bit-identical output whether it is a decode row
(one query) or one row of a prefill chunk, and whatever the slot's KV capacity.
BLAS picks different code paths by matrix shape, so the construction is:

* Q·K^T has a fixed reduction length (head_dim); only its row count varies, and
  rows are padded to at least ROW_FLOOR so small row counts take the same kernel.
* Keys run from position 0 to a span rounded up to BLOCK; positions a query may
  not see get -inf and so add exact zeros to the max, the exponent sum and P·V.
* P·V is cut into blocks of BLOCK keys at fixed absolute offsets, so every matmul
  has the same reduction length; block results are summed one after another.

The start-up probe (slotserve.kernels.invariance) checks this on the machine.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import mlx.core as mx

BLOCK = 128
ROW_FLOOR = 16


@dataclass
class AttentionPlan:
    """Per-segment masks shared by all layers of one step."""

    start: int
    tokens: int
    span: int
    full_bias: mx.array  # [tokens, span]: 0 where visible, -inf elsewhere
    window_biases: dict[int, mx.array]

    @staticmethod
    def build(start: int, tokens: int) -> AttentionPlan:
        span = -(-(start + tokens) // BLOCK) * BLOCK
        qpos = mx.arange(start, start + tokens, dtype=mx.int32)[:, None]
        kpos = mx.arange(span, dtype=mx.int32)[None, :]
        bias = mx.where(kpos <= qpos, 0.0, -mx.inf).astype(mx.float32)
        return AttentionPlan(start, tokens, span, bias, {})

    def bias(self, window: int | None) -> mx.array:
        if window is None:
            return self.full_bias
        if window not in self.window_biases:
            qpos = mx.arange(self.start, self.start + self.tokens, dtype=mx.int32)[:, None]
            kpos = mx.arange(self.span, dtype=mx.int32)[None, :]
            keep = (kpos <= qpos) & (kpos > qpos - window)
            self.window_biases[window] = mx.where(keep, 0.0, -mx.inf).astype(mx.float32)
        return self.window_biases[window]


def padded_rows(rows: int) -> int:
    return max(rows, ROW_FLOOR)


def block_attention(q: mx.array, keys: mx.array, values: mx.array, plan: AttentionPlan,
                    scale: float, window: int | None = None) -> mx.array:
    """Attend T queries (positions plan.start..) to the cached keys 0..start+T-1.

    q: [T, Hq, D]; keys/values: [Hkv, capacity, D], capacity >= plan.span, already
    holding this chunk's keys. `window` limits each query to the last `window`
    positions (sliding-window layers). Returns [T, Hq, D].
    """
    t, hq, d = q.shape
    hkv = keys.shape[0]
    group = hq // hkv
    rows = t * group
    span, nb = plan.span, plan.span // BLOCK
    # rows ordered (token, group member) so the real rows come first after padding
    qh = (q * scale).reshape(t, hkv, group, d).transpose(1, 0, 2, 3).reshape(hkv, rows, d)
    if padded_rows(rows) > rows:
        qh = mx.concatenate([qh, mx.zeros((hkv, padded_rows(rows) - rows, d), qh.dtype)], axis=1)
    scores = (qh @ keys[:, :span].swapaxes(-1, -2))[:, :rows].astype(mx.float32)
    bias = mx.repeat(plan.bias(window), group, axis=0)  # [rows, span]
    scores = scores + bias
    probs = mx.exp(scores - scores.max(axis=-1, keepdims=True))
    denom = probs.sum(axis=-1)  # [hkv, rows]
    pb = probs.astype(values.dtype).reshape(hkv, rows, nb, BLOCK).swapaxes(1, 2)
    out = (pb @ values[:, :span].reshape(hkv, nb, BLOCK, d)).sum(axis=1)  # [hkv, rows, d]
    out = (out / denom[..., None].astype(out.dtype)).reshape(hkv, t, group, d)
    return out.transpose(1, 0, 2, 3).reshape(t, hq, d)


def reference_attention(q: mx.array, keys: mx.array, values: mx.array, start: int,
                        scale: float, window: int | None = None) -> mx.array:
    """Plain softmax attention (float32) used by tests as the numerical reference."""
    t, hq, d = q.shape
    hkv = keys.shape[0]
    group = hq // hkv
    end = start + t
    k = mx.repeat(keys[:, :end], group, axis=0).astype(mx.float32)
    v = mx.repeat(values[:, :end], group, axis=0).astype(mx.float32)
    s = (q.astype(mx.float32).transpose(1, 0, 2) * scale) @ k.swapaxes(-1, -2)
    qpos = mx.arange(start, end)[:, None]
    kpos = mx.arange(end)[None, :]
    keep = kpos <= qpos
    if window is not None:
        keep = keep & (kpos > qpos - window)
    s = mx.where(keep, s, -math.inf)
    return (mx.softmax(s, axis=-1) @ v).transpose(1, 0, 2)
