"""Causal attention whose result for a query row never depends on its batch.

A query at position p must get bit-identical output whether it is a decode row
(batched with other slots' decode rows) or one row of a prefill chunk, and
whatever the slot's KV capacity. BLAS picks kernels by matrix shape, so:

* Q·K^T runs per (slot, kv head, key block) with the query rows on the row axis:
  the GQA group for a decode token, group x tokens for a prefill chunk. Row counts
  under ROW_FLOOR take other BLAS kernels, so they are padded up to it; the
  reduction (head_dim) and the columns (BLOCK keys) are fixed.
* Keys run from position 0 to a span rounded up to BLOCK; positions a query may
  not see get -inf and so add exact zeros to the max, the exponent sum and P·V.
* P·V is cut into blocks of BLOCK keys at fixed absolute offsets, so every GEMM
  has the same reduction length; the blocks are summed one after another.

K/V live in the paged pool (slotserve.model.kv); one small GEMM runs per (slot,
key block, kv head) with the block chosen by index (`block_matmul`). On the CPU
this module is the fallback: slotserve.kernels.cpu_attention runs instead when
its native kernel is built. Decode rows of many slots run as one
batched dispatch; a prefill chunk attends over its own slot's blocks. The start-up
probe (slotserve.kernels.invariance) checks all of this on the machine it runs on.
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
    """[tokens, span] additive mask of positions start.. : 0 where a query may look, -inf
    elsewhere."""
    return position_bias(mx.arange(start, start + tokens, dtype=mx.int32), span, window)


def position_bias(positions: mx.array, span: int, window: int | None = None) -> mx.array:
    """[len(positions), span] additive mask of queries at these positions (int32), in one
    set of ops however many rows (a decode group's: one row a slot)."""
    qpos = positions[:, None]
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


def paged_blocks(caches: list[mx.array]) -> tuple[mx.array, mx.array]:
    """Dense per-slot caches [Hkv, cap, D] (cap a multiple of BLOCK) in the pool's layout.

    Returns (blocks [B, BLOCK, D], indices [S, cap // BLOCK, Hkv]); used by the probe
    and the tests to feed the attention below from plain arrays.
    """
    blocks, indices, base = [], [], 0
    for c in caches:
        hkv, cap, d = c.shape
        nb = cap // BLOCK
        blocks.append(c.reshape(hkv, nb, BLOCK, d).transpose(1, 0, 2, 3).reshape(-1, BLOCK, d))
        indices.append(base + mx.arange(nb * hkv, dtype=mx.int32).reshape(nb, hkv))
        base += nb * hkv
    return mx.concatenate(blocks), mx.stack(indices)


def block_matmul(a: mx.array, pool: mx.array, blocks: mx.array, a_index: mx.array | None = None,
                 transpose: bool = False) -> mx.array:
    """a (or a[a_index]) times pool[blocks] (or its transpose), per (slot, key block, kv head).

    `mx.gather_mm` multiplies straight out of the pool, nothing copied. Gathering the
    blocks first and running one batched matmul was slower: measured on the H200
    (Llama-3-8B heads, span 256, one layer) gather_mm took 361 / 443 / 462 us at 8 / 64 /
    128 slots against 629 / 964 / 1368 us; on the CPU gather_mm is faster too.
    """
    return mx.gather_mm(a, pool.swapaxes(-1, -2) if transpose else pool, a_index, blocks)


def grouped_attention(qh: mx.array, keys: mx.array, values: mx.array, blocks: mx.array,
                      bias: mx.array, scale: float, sinks: mx.array | None = None) -> mx.array:
    """Attention for M query rows per (slot, kv head), reading K/V in place from the pool.

    qh: [S, Hkv, M, D]; keys/values: [B, BLOCK, D] pool blocks; blocks: [S, nb, Hkv]
    index of the block holding positions j*BLOCK.. of each slot and kv head;
    bias: [S, M, nb * BLOCK] additive mask; sinks: [Hkv, M] float32 attention-sink logits
    of each row's head (gpt-oss), one more logit in the softmax that weights no value.
    Returns [S, Hkv, M, D].
    """
    s_, hkv, m, d = qh.shape
    nb = blocks.shape[1]
    # scores in log2 units: exp2 is cheaper than exp on CPU and the mask stays -inf
    qh = qh * (scale * LOG2E)
    if m < ROW_FLOOR:
        qh = mx.concatenate([qh, mx.zeros((s_, hkv, ROW_FLOOR - m, d), qh.dtype)], axis=2)
    mp = qh.shape[2]
    q_index = mx.broadcast_to(
        (mx.arange(s_, dtype=mx.int32)[:, None] * hkv + mx.arange(hkv, dtype=mx.int32))[:, None],
        blocks.shape,
    )
    # one GEMM per (slot, key block, kv head): [M, D] x [D, BLOCK]
    scores = block_matmul(qh.reshape(s_ * hkv, mp, d), keys, blocks, q_index, True)
    scores = scores[:, :, :, :m].transpose(0, 2, 3, 1, 4).reshape(s_, hkv, m, nb * BLOCK)
    scores = scores.astype(mx.float32) + bias[:, None]
    # weights under 2^-64 of the largest become exact zeros: far below float32 resolution
    # of the sum, and left alone they turn into subnormals, which are slow on CPU
    top = scores.max(axis=-1, keepdims=True)
    if sinks is not None:
        sinks = (sinks * LOG2E)[None, :, :, None]
        top = mx.maximum(top, sinks)
    shifted = scores - top
    probs = mx.power(2.0, mx.where(shifted > -64.0, shifted, -mx.inf))
    denom = probs.sum(axis=-1)  # [S, hkv, m]
    if sinks is not None:
        sink = sinks - top
        denom = denom + mx.power(2.0, mx.where(sink > -64.0, sink, -mx.inf))[..., 0]
    pb = probs.astype(values.dtype).reshape(s_, hkv, m, nb, BLOCK).transpose(0, 3, 1, 2, 4)
    # P.V per key block (fixed reduction length BLOCK), blocks summed in order
    out = block_matmul(pb, values, blocks).sum(axis=1)  # [S, hkv, m, d]
    return out / denom[..., None].astype(out.dtype)


def decode_attention(q: mx.array, keys: mx.array, values: mx.array, blocks: mx.array,
                     bias: mx.array, scale: float, sinks: mx.array | None = None) -> mx.array:
    """One decode token per slot. q: [S, Hq, D]; blocks [S, nb, Hkv]; bias [S, nb * BLOCK];
    sinks [Hq] (see grouped_attention)."""
    s_, hq, d = q.shape
    hkv = blocks.shape[2]
    group = hq // hkv
    qh = q.reshape(s_, hkv, group, d)
    row_sinks = None if sinks is None else sinks.reshape(hkv, group)
    out = grouped_attention(qh, keys, values, blocks, bias[:, None, :], scale, row_sinks)
    return out.reshape(s_, hq, d)


def segment_attention(q: mx.array, keys: mx.array, values: mx.array, blocks: mx.array,
                      plan: AttentionPlan, scale: float, window: int | None = None,
                      sinks: mx.array | None = None) -> mx.array:
    """One slot's T query tokens (positions plan.start..); blocks [1, plan.span // BLOCK, Hkv];
    sinks [Hq] (see grouped_attention)."""
    t, hq, d = q.shape
    hkv = blocks.shape[2]
    group = hq // hkv
    blocks = blocks[:, : plan.span // BLOCK]
    # rows token-major within each kv head: row = token * group + member
    qh = q.reshape(t, hkv, group, d).transpose(1, 0, 2, 3).reshape(1, hkv, t * group, d)
    bias = plan.row_bias(window, group)
    row_sinks = None if sinks is None else mx.tile(sinks.reshape(hkv, 1, group),
                                                   (1, t, 1)).reshape(hkv, t * group)
    out = grouped_attention(qh, keys, values, blocks, bias[None], scale, row_sinks)
    return out.reshape(hkv, t, group, d).transpose(1, 0, 2, 3).reshape(t, hq, d)


def reference_attention(q: mx.array, keys: mx.array, values: mx.array, start: int,
                        scale: float, window: int | None = None,
                        sinks: mx.array | None = None) -> mx.array:
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
    if sinks is None:
        return (mx.softmax(s, axis=-1) @ v).transpose(1, 0, 2)
    sink = mx.broadcast_to(sinks.astype(mx.float32)[:, None, None], (*s.shape[:2], 1))
    probs = mx.softmax(mx.concatenate([s, sink], axis=-1), axis=-1)[..., :-1]
    return (probs @ v).transpose(1, 0, 2)
