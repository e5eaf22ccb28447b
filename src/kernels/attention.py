"""Causal attention whose result for a query row never depends on its batch.

A query at position p must get bit-identical output whether it is a decode row
(batched with other slots' decode rows) or one token of a prefill chunk, and
whatever the slot's KV capacity. BLAS picks kernels by matrix shape, so every
matmul here has a shape fixed by the model, never by the batch:

* Each query token is its own GEMM per kv head: [GQA group, head_dim] x
  [head_dim, BLOCK] for Q·K^T, [group, BLOCK] x [BLOCK, head_dim] for P·V.
* Keys run from position 0 to a span rounded up to BLOCK, in blocks at fixed
  absolute offsets; positions a query may not see get -inf and so add exact zeros
  to the max, the exponent sum and P·V; block results are summed one after another.

Decode rows of many slots run as one batched dispatch (their K/V stacked per key
span); a prefill chunk shares its slot's cache across its tokens. The start-up
probe (slotserve.kernels.invariance) checks all of this on the machine it runs on.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import mlx.core as mx

BLOCK = 128
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

    @staticmethod
    def build(start: int, tokens: int) -> AttentionPlan:
        return AttentionPlan(start, tokens, span_for(start + tokens))

    def bias(self, window: int | None) -> mx.array:
        if window not in self.biases:
            self.biases[window] = causal_bias(self.start, self.tokens, self.span, window)
        return self.biases[window]


def token_attention(q: mx.array, keys: mx.array, values: mx.array, bias: mx.array,
                    scale: float) -> mx.array:
    """Attention for query tokens, each token its own small GEMM per kv head.

    q: [T, Hq, D]; keys/values: [T or 1, Hkv, span, D] (per-token caches for decode
    rows of different slots, or one cache shared by a prefill chunk's tokens), span a
    multiple of BLOCK; bias: [T, span] additive mask. Returns [T, Hq, D].

    Every GEMM is [group, D] x [D, BLOCK] or [group, BLOCK] x [BLOCK, D], whether the
    token is a decode row or part of a prefill chunk: the same shapes, so the same
    BLAS kernel and the same bits. Small GEMMs also stay single-threaded in BLAS.
    """
    t, hq, d = q.shape
    hkv, span = keys.shape[1], keys.shape[2]
    group, nb = hq // hkv, span // BLOCK
    # scores in log2 units: exp2 is cheaper than exp on CPU and the mask stays -inf
    qh = (q * (scale * LOG2E)).reshape(t, hkv, 1, group, d)
    kb = keys.reshape(keys.shape[0], hkv, nb, BLOCK, d)
    scores = (qh @ kb.swapaxes(-1, -2)).astype(mx.float32)  # [T, hkv, nb, group, BLOCK]
    scores = scores + bias.reshape(t, 1, nb, 1, BLOCK)
    peak = scores.max(axis=-1, keepdims=True).max(axis=2, keepdims=True)
    # weights under 2^-64 of the largest become exact zeros: they are far below float32
    # resolution of the sum, and left alone they turn into subnormals, which make exp2
    # and the P·V GEMMs several times slower on CPU
    shifted = scores - peak
    probs = mx.power(2.0, mx.where(shifted > -64.0, shifted, -mx.inf))
    denom = probs.sum(axis=-1, keepdims=True).sum(axis=2)  # [T, hkv, group, 1]
    vb = values.reshape(values.shape[0], hkv, nb, BLOCK, d)
    out = (probs.astype(values.dtype) @ vb).sum(axis=2)  # [T, hkv, group, d]
    out = out / denom.astype(out.dtype)
    return out.reshape(t, hq, d)


def segment_attention(q: mx.array, keys: mx.array, values: mx.array, plan: AttentionPlan,
                      scale: float, window: int | None = None) -> mx.array:
    """One slot's T query tokens (positions plan.start..) over its cache [Hkv, cap, D]."""
    span = plan.span
    return token_attention(q, keys[None, :, :span], values[None, :, :span], plan.bias(window),
                           scale)


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
