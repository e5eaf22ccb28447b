"""Causal attention whose result for a query row never depends on its batch.

A query at position p must get bit-identical output whether it is a decode row
(batched with other slots' decode rows) or one row of a prefill chunk, and
whatever the slot's KV capacity. BLAS picks kernels by matrix shape, so:

* Q·K^T runs per (slot, kv head) with the query rows on the row axis: the GQA
  group for a decode token, group x tokens for a prefill chunk. Row counts under
  ROW_FLOOR take other BLAS kernels, so they are padded up to it; the reduction
  (head_dim) is fixed, and the key span only changes N, which leaves columns alone.
* Keys run from position 0 to a span rounded up to BLOCK; positions a query may
  not see get -inf and so add exact zeros to the max, the exponent sum and P·V.
* P·V is cut into blocks of BLOCK keys at fixed absolute offsets, so every GEMM
  has the same reduction length; the blocks are summed one after another.

Decode rows of many slots run as one batched dispatch (their K/V stacked per key
span); a prefill chunk attends over its own slot's cache. The start-up probe
(slotserve.kernels.invariance) checks all of this on the machine it runs on.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import mlx.core as mx

BLOCK = 128
ROW_FLOOR = 16
LOG2E = 1.4426950408889634


def span_for(end: int) -> int:
    """Key positions attention reads for queries up to position end-1."""
    return -(-end // BLOCK) * BLOCK


def causal_bias(start: int, tokens: int, span: int, window: int | None = None) -> mx.array:
    """[tokens, span] additive mask: 0 where a query may look, -inf elsewhere."""
    qpos = mx.arange(start, start + tokens, dtype=mx.int32)[:, None]
    kpos = mx.arange(span, dtype=mx.int32)[None, :]
    keep = kpos <= qpos
    if window is not None:
        keep = keep & (kpos > qpos - window)
    return mx.where(keep, 0.0, -mx.inf).astype(mx.float32)


@dataclass
class AttentionPlan:
    """One segment's (or one decode group's) masks, shared by all layers of a step."""

    start: int
    tokens: int
    span: int
    biases: dict[int | None, mx.array] = field(default_factory=dict)
    row_biases: dict[tuple[int | None, int], mx.array] = field(default_factory=dict)

    @staticmethod
    def build(start: int, tokens: int) -> AttentionPlan:
        return AttentionPlan(start, tokens, span_for(start + tokens))

    def bias(self, window: int | None) -> mx.array:
        if window not in self.biases:
            self.biases[window] = causal_bias(self.start, self.tokens, self.span, window)
        return self.biases[window]

    def row_bias(self, window: int | None, group: int) -> mx.array:
        """The mask repeated for each GQA group member: [tokens * group, span]."""
        key = (window, group)
        if key not in self.row_biases:
            self.row_biases[key] = mx.repeat(self.bias(window), group, axis=0)
        return self.row_biases[key]


def grouped_attention(qh: mx.array, keys: mx.array, values: mx.array, bias: mx.array,
                      scale: float) -> mx.array:
    """Attention for M query rows per (slot, kv head).

    qh: [S, Hkv, M, D]; keys/values: [S, Hkv, span, D] (span a multiple of BLOCK);
    bias: [S, M, span] additive mask. Returns [S, Hkv, M, D].
    """
    s_, hkv, m, d = qh.shape
    span = keys.shape[2]
    nb = span // BLOCK
    # scores in log2 units: exp2 is cheaper than exp on CPU and the mask stays -inf
    qh = qh * (scale * LOG2E)
    if m < ROW_FLOOR:
        qh = mx.concatenate([qh, mx.zeros((s_, hkv, ROW_FLOOR - m, d), qh.dtype)], axis=2)
    scores = qh @ keys.swapaxes(-1, -2)
    if m < ROW_FLOOR:
        scores = scores[:, :, :m]
    scores = scores.astype(mx.float32) + bias[:, None]
    # weights under 2^-64 of the largest become exact zeros: far below float32 resolution
    # of the sum, and left alone they turn into subnormals, which are slow on CPU
    shifted = scores - scores.max(axis=-1, keepdims=True)
    probs = mx.power(2.0, mx.where(shifted > -64.0, shifted, -mx.inf))
    denom = probs.sum(axis=-1)  # [S, hkv, m]
    pb = probs.astype(values.dtype).reshape(s_, hkv, m, nb, BLOCK).transpose(0, 1, 3, 2, 4)
    vb = values.reshape(s_, hkv, nb, BLOCK, d)
    out = (pb @ vb).sum(axis=2)  # [S, hkv, m, d]
    return out / denom[..., None].astype(out.dtype)


def decode_attention(q: mx.array, keys: mx.array, values: mx.array, bias: mx.array,
                     scale: float) -> mx.array:
    """One decode token per slot. q: [S, Hq, D]; keys/values: [S, Hkv, span, D]; bias [S, span]."""
    s_, hq, d = q.shape
    hkv = keys.shape[1]
    group = hq // hkv
    qh = q.reshape(s_, hkv, group, d)
    out = grouped_attention(qh, keys, values, bias[:, None, :], scale)
    return out.reshape(s_, hq, d)


def segment_attention(q: mx.array, keys: mx.array, values: mx.array, plan: AttentionPlan,
                      scale: float, window: int | None = None) -> mx.array:
    """One slot's T query tokens (positions plan.start..) over its cache [Hkv, cap, D]."""
    t, hq, d = q.shape
    hkv = keys.shape[0]
    group = hq // hkv
    span = plan.span
    # rows token-major within each kv head: row = token * group + member
    qh = q.reshape(t, hkv, group, d).transpose(1, 0, 2, 3).reshape(1, hkv, t * group, d)
    bias = plan.row_bias(window, group)
    out = grouped_attention(qh, keys[None, :, :span], values[None, :, :span], bias[None], scale)
    return out.reshape(hkv, t, group, d).transpose(1, 0, 2, 3).reshape(t, hq, d)


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
