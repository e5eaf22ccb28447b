"""Building blocks shared by the model families.

Every forward works on a *row batch*: R token rows that may belong to several
sequences (slots). `Segment` says which consecutive rows belong to which slot
and at which absolute positions, so projections and MLPs run once over all rows
(weights read once per step) while attention reads each slot's own KV.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
import numpy as np

from slotserve.kernels import cpu_attention, cpu_gemm, cpu_qgemm, cuda, native
from slotserve.kernels.attention import (
    BLOCK,
    AttentionPlan,
    causal_bias,
    decode_attention,
    segment_attention,
    span_for,
)
from slotserve.kernels.cpu_attention import RopeTables, RowTables
from slotserve.model.kv import KVPool, SlotKV
from slotserve.model.weights import QuantizedWeight, Tensor

LINEAR_ROW_FLOOR = 1  # raised by the start-up invariance probe when BLAS needs it


@dataclass
class Segment:
    """Rows [row, row+length) of the batch are positions [start, start+length) of kv."""

    kv: SlotKV
    start: int
    length: int
    row: int = 0
    plan: AttentionPlan | None = None

    def attention_plan(self) -> AttentionPlan:
        if self.plan is None:
            self.plan = AttentionPlan.build(self.start, self.length)
        return self.plan


@dataclass
class DecodeGroup:
    """Decode rows (one token each) of slots whose keys span the same length."""

    span: int
    rows: mx.array  # [n] batch row of each member
    blocks: mx.array  # [n, span // BLOCK, kv_heads] pool blocks of positions 0..span-1
    starts: list[int]
    biases: dict[int | None, mx.array] = field(default_factory=dict)

    def bias(self, window: int | None) -> mx.array:
        if window not in self.biases:
            self.biases[window] = mx.concatenate(
                [causal_bias(p, 1, self.span, window) for p in self.starts]
            )
        return self.biases[window]


@dataclass
class Batch:
    """A step's rows: where each row's K/V goes in the pool and what each row attends."""

    segments: list[Segment]
    positions: mx.array  # [R] int32 absolute position per row (padded)
    pool: KVPool | None = None
    write_rows: mx.array | None = None  # [rows, kv_heads] pool rows receiving each row's K/V
    decode_groups: list[DecodeGroup] = field(default_factory=list)
    prefill: list[tuple[Segment, mx.array]] = field(default_factory=list)  # (seg, blocks)
    order: mx.array | None = None  # puts attention outputs back in row order
    native: RowTables | None = None  # set when the CPU attention kernel runs this step
    cuda: tuple[mx.array, mx.array, mx.array] | None = None  # GPU kernel: RowTables on device
    # arrays whose evaluation performs K/V writes made in place (cuda.rope_write): a step
    # that asks for no logits must still evaluate them (see written())
    effects: list[mx.array] = field(default_factory=list)

    @staticmethod
    def build(parts: list[tuple[SlotKV, int, int]], reserve: bool = True) -> Batch:
        """Reserve KV pages for every segment and precompute all pool indices.

        reserve=False (a speculated step): never take pages; fail if a segment lacks them.
        """
        segs: list[Segment] = []
        pos: list[int] = []
        writes: list[np.ndarray] = []
        row = 0
        for kv, start, length in parts:
            if reserve:
                kv.reserve(start + length)
            elif start + length > kv.capacity:
                raise ValueError("no KV page for a speculated row")
            segs.append(Segment(kv, start, length, row))
            pos.extend(range(start, start + length))
            writes.append(kv.rows_for(start, start + length))
            row += length
        pos.extend([0] * (LINEAR_ROW_FLOOR - len(pos)))  # padding rows (discarded)
        batch = Batch(segs, mx.array(pos, dtype=mx.int32))
        write_rows = np.concatenate(writes).astype(np.int32) if segs else None
        if segs:
            batch.pool = segs[0].kv.pool
            batch.write_rows = mx.array(write_rows)
        if batch.pool is not None and native_attention_for(batch.pool.dtype,
                                                           batch.pool.head_dim):
            batch.native = batch._row_tables()
            batch.native.write_rows = write_rows
        elif batch.pool is not None and cuda_attention_for(batch.pool):
            t = batch._row_tables()
            batch.cuda = (mx.array(t.tables), mx.array(t.row_table), mx.array(t.row_pos))
        else:
            batch._group()
        return batch

    def _row_tables(self) -> RowTables:
        spans = [span_for(s.start + s.length) // BLOCK for s in self.segments]
        heads = self.segments[0].kv.pool.num_kv_heads
        tables = np.zeros((len(self.segments), max(spans), heads), dtype=np.int32)
        row_table = np.full(self.padded_rows, -1, dtype=np.int32)
        for t, (seg, nb) in enumerate(zip(self.segments, spans, strict=True)):
            tables[t, :nb] = seg.kv.blocks(nb * BLOCK)
            row_table[seg.row : seg.row + seg.length] = t
        row_pos = np.array(self.positions, dtype=np.int32)
        return RowTables(tables, row_table, row_pos)

    def _group(self) -> None:
        by_span: dict[int, list[Segment]] = {}
        prefill: list[Segment] = []
        for seg in self.segments:
            if seg.length == 1:
                by_span.setdefault(span_for(seg.start + 1), []).append(seg)
            else:
                prefill.append(seg)
        emitted: list[int] = []
        for span, members in sorted(by_span.items()):
            rows = [m.row for m in members]
            emitted.extend(rows)
            blocks = np.stack([m.kv.blocks(span) for m in members]).astype(np.int32)
            self.decode_groups.append(
                DecodeGroup(span, mx.array(rows, dtype=mx.int32), mx.array(blocks),
                            [m.start for m in members])
            )
        for seg in prefill:
            emitted.extend(range(seg.row, seg.row + seg.length))
            span = seg.attention_plan().span
            self.prefill.append((seg, mx.array(seg.kv.blocks(span)[None].astype(np.int32))))
        emitted.extend(range(self.rows, self.padded_rows))
        if emitted != list(range(len(emitted))):
            inverse = [0] * len(emitted)
            for i, r in enumerate(emitted):
                inverse[r] = i
            self.order = mx.array(inverse, dtype=mx.int32)

    def written(self) -> list[mx.array]:
        """What a step's forward must evaluate for its K/V to be in the pool."""
        return [*self.pool.arrays(), *self.effects] if self.pool is not None else []

    @property
    def rows(self) -> int:
        return sum(s.length for s in self.segments)

    @property
    def one_row_per_slot(self) -> bool:
        """Every slot has one row this step (a decode step): no row reads another row's new
        K/V in the same step."""
        return all(s.length == 1 for s in self.segments)

    @property
    def padded_rows(self) -> int:
        return self.positions.shape[0]

    def pad_tokens(self, tokens: mx.array) -> mx.array:
        extra = self.padded_rows - tokens.shape[0]
        return tokens if extra == 0 else mx.concatenate([tokens, mx.zeros((extra,), tokens.dtype)])


class Linear:
    """y = x W^T, with W kept dense or affine-quantized.

    CPU: dense W in the narrowest float type that holds its values exactly (dequantized
    GGUF weights are exact in float16) through slotserve's own kernel
    (slotserve.kernels.cpu_gemm), or in float32 through MLX/OpenBLAS when that kernel
    is unavailable. GPU: quantized tensors stay quantized; 4-bit ones run through
    slotserve's batch-invariant CUDA kernel (slotserve.kernels.cuda) when it applies.
    """

    def __init__(self, weight: Tensor, compute_dtype: mx.Dtype, keep_quantized: bool,
                 pack: bool = True) -> None:
        self.q: QuantizedWeight | None = None
        self.w: mx.array | None = None
        self.q4: tuple[mx.array, mx.array] | None = None  # cuda.q4_pack layouts
        lib = native.library() if _use_cpu_kernel(compute_dtype, keep_quantized) else None
        self.kernel: cpu_gemm.HostMatmul | None = None
        if isinstance(weight, QuantizedWeight):
            if keep_quantized:
                self.q = weight
            elif lib is not None and cpu_qgemm.supported(weight):
                self.kernel = cpu_qgemm.QMatrix(weight, lib)  # stays 4/8-bit in memory
            else:
                self.w = weight.dequantize(None if lib else compute_dtype)
        else:
            self.w = weight if lib and weight.dtype in _EXACT else weight.astype(compute_dtype)
        if lib is not None and self.w is not None:
            self.kernel = cpu_gemm.Matrix(self.w, lib)
        self.compute_dtype = compute_dtype
        if pack:
            self.pack_for_gpu()

    def packable(self) -> bool:
        """slotserve's CUDA 4-bit kernel applies (GPU, bf16, a supported shape)."""
        q = self.q
        return (q is not None and self.compute_dtype == mx.bfloat16 and cuda.enabled()
                and cuda.q4_supported(q.shape[1], q.shape[0], q.bits, q.group_size))

    def pack_for_gpu(self) -> None:
        """Repack 4-bit weights for slotserve's CUDA kernel when it applies."""
        if self.q4 is None and self.packable():
            q = self.q
            assert q is not None
            self.q4 = cuda.q4_pack(q.weight, q.scales, q.biases)
            mx.eval(self.q4)

    @staticmethod
    def fused(parts: list[Tensor], compute_dtype: mx.Dtype, keep_quantized: bool,
              pack: bool = True) -> Linear:
        """One matrix for several projections of the same input (QKV, gate+up)."""
        cpu_quantized = (_use_cpu_kernel(compute_dtype, keep_quantized)
                         and native.library() is not None
                         and all(isinstance(p, QuantizedWeight) and cpu_qgemm.supported(p)
                                 for p in parts))
        if cpu_quantized or (keep_quantized and all(isinstance(p, QuantizedWeight)
                                                    for p in parts)):
            qs: list[QuantizedWeight] = parts  # type: ignore[assignment]
            if len({(p.bits, p.group_size) for p in qs}) == 1:
                return Linear(
                    QuantizedWeight(
                        mx.concatenate([p.weight for p in qs]),
                        mx.concatenate([p.scales for p in qs]),
                        mx.concatenate([p.biases for p in qs]),
                        qs[0].group_size,
                        qs[0].bits,
                    ),
                    compute_dtype,
                    keep_quantized,
                    pack,
                )
        exact = _use_cpu_kernel(compute_dtype, keep_quantized) and native.library()
        dense = [
            p.dequantize(None if exact else compute_dtype) if isinstance(p, QuantizedWeight)
            else p for p in parts
        ]
        if len({d.dtype for d in dense}) > 1 or not exact:
            dense = [d.astype(compute_dtype) for d in dense]
        return Linear(mx.concatenate(dense), compute_dtype, False, pack)

    def __call__(self, x: mx.array, residual: mx.array | None = None,
                 norm: RMSNorm | None = None) -> mx.array:
        """norm(x) W^T (x W^T without a norm), plus `residual` when given; the CUDA 4-bit
        kernel does the norm and the add in its own launch where it can."""
        if self.q4 is not None:
            return cuda.q4_matmul(x, *self.q4, residual=residual, norm=kernel_norm(norm))
        x = normed(x, norm)
        if self.kernel is not None:
            y = self.kernel(x)
        elif self.q is not None:
            q = self.q
            y = mx.quantized_matmul(
                x, q.weight, q.scales, q.biases, transpose=True, group_size=q.group_size,
                bits=q.bits,
            )
        else:
            assert self.w is not None
            y = x @ self.w.T
        return plus(y, residual)


_EXACT = (mx.float32, mx.float16, mx.bfloat16)


def plus(y: mx.array, residual: mx.array | None) -> mx.array:
    """y + residual, or y alone when there is none (a block's residual stream)."""
    return y if residual is None else y + residual


def _use_cpu_kernel(compute_dtype: mx.Dtype, keep_quantized: bool) -> bool:
    """The CPU compute policy (float32, weights not kept quantized) on the CPU device."""
    return (compute_dtype == mx.float32 and not keep_quantized
            and mx.default_device() == mx.cpu)


class Embedding:
    """Token embedding table; doubles as the tied lm_head."""

    def __init__(self, weight: Tensor, compute_dtype: mx.Dtype, keep_quantized: bool) -> None:
        # packed for the GPU matmul only if it also serves as the (tied) lm_head
        self.linear = Linear(weight, compute_dtype, keep_quantized, pack=False)
        self.compute_dtype = compute_dtype
        # rows are gathered from the quantized codes when the table stays quantized (on the
        # GPU, or under the CPU's quantized matmul)
        self.codes = weight if isinstance(weight, QuantizedWeight) and self.linear.w is None \
            else None

    def __call__(self, tokens: mx.array) -> mx.array:
        lin = self.linear
        if self.codes is not None:
            q = self.codes
            return mx.dequantize(
                q.weight[tokens], q.scales[tokens], q.biases[tokens], group_size=q.group_size,
                bits=q.bits,
            ).astype(self.compute_dtype)
        assert lin.w is not None
        return lin.w[tokens].astype(self.compute_dtype)

    def as_linear(self) -> Linear:
        self.linear.pack_for_gpu()
        return self.linear


def rope_inv_freq(head_dim: int, theta: float, scaling: dict[str, Any] | None) -> mx.array:
    """Inverse frequencies, with Llama-3 and linear scaling as HF defines them."""
    inv = 1.0 / (theta ** (mx.arange(0, head_dim, 2, dtype=mx.float32) / head_dim))
    if not scaling:
        return inv
    kind = scaling.get("rope_type", scaling.get("type"))
    factor = float(scaling["factor"])
    if kind == "linear":
        return inv / factor
    low = float(scaling.get("low_freq_factor", 1.0))
    high = float(scaling.get("high_freq_factor", 4.0))
    old_ctx = float(scaling.get("original_max_position_embeddings", 8192))
    wavelen = 2 * math.pi / inv
    smooth = (old_ctx / wavelen - low) / (high - low)
    mid = (1 - smooth) * inv / factor + smooth * inv
    out = mx.where(wavelen > old_ctx / low, inv / factor, inv)
    is_mid = (wavelen <= old_ctx / low) & (wavelen >= old_ctx / high)
    return mx.where(is_mid, mid, out)


class Rope:
    """Rotate-half RoPE from a cos/sin table gathered by each row's absolute position.

    A table lookup (instead of a kernel with a scalar offset) lets every row of a
    mixed batch carry its own position, and gives each position the same bits
    whatever batch it is computed in.
    """

    def __init__(self, head_dim: int, theta: float, scaling: dict[str, Any] | None,
                 dtype: mx.Dtype) -> None:
        self.inv_freq = rope_inv_freq(head_dim, theta, scaling)
        self.dtype = dtype
        self.size = 0
        self.cos = self.sin = mx.zeros((0,))
        self._host: RopeTables | None = None

    def _grow(self, n: int) -> None:
        size = max(4096, 1 << (n - 1).bit_length())
        ang = mx.arange(size, dtype=mx.float32)[:, None] * self.inv_freq[None, :]
        emb = mx.concatenate([ang, ang], axis=-1)
        self.cos, self.sin = mx.cos(emb).astype(self.dtype), mx.sin(emb).astype(self.dtype)
        mx.eval(self.cos, self.sin)
        self.size = size

    def host_tables(self) -> RopeTables:
        """The whole cos/sin tables as float32 host views (for the native CPU kernels)."""
        if self._host is None or self._host.cos.shape[0] != self.size:
            mx.eval(self.cos, self.sin)
            self._host = RopeTables(np.asarray(self.cos.astype(mx.float32)),
                                    np.asarray(self.sin.astype(mx.float32)))
        return self._host

    def reserve(self, max_pos: int) -> None:
        """Grow the tables to hold position max_pos."""
        if max_pos >= self.size:
            self._grow(max_pos + 1)

    def tables(self, positions: mx.array, max_pos: int) -> tuple[mx.array, mx.array]:
        self.reserve(max_pos)
        return self.cos[positions][:, None, :], self.sin[positions][:, None, :]

    @staticmethod
    def apply(x: mx.array, cos: mx.array, sin: mx.array) -> mx.array:
        """x: [R, heads, head_dim]."""
        half = x.shape[-1] // 2
        rotated = mx.concatenate([-x[..., half:], x[..., :half]], axis=-1)
        return x * cos + rotated * sin


def attend(q: mx.array, k: mx.array, v: mx.array, batch: Batch, layer: int, scale: float,
           window: int | None = None) -> mx.array:
    """Write every row's new K/V into the pool, then attend; q/k/v: [R, heads, D].

    All decode rows of one key span go through one batched dispatch; each prefill
    chunk attends over its own slot's positions.
    """
    pool = batch.pool
    assert pool is not None and batch.write_rows is not None
    n = batch.rows
    pool.keys[layer][batch.write_rows] = k[:n] if k.shape[0] > n else k
    pool.values[layer][batch.write_rows] = v[:n] if v.shape[0] > n else v
    if batch.cuda is not None:
        return cuda.paged_attention(q, pool.keys[layer], pool.values[layer], *batch.cuda,
                                    scale, window)
    if batch.native is not None:
        lib = native.library()
        assert lib is not None
        return cpu_attention.attend(lib, q, pool.keys[layer], pool.values[layer], batch.native,
                                    scale, window)
    keys, values = pool.key_blocks(layer), pool.value_blocks(layer)
    outs = []
    for group in batch.decode_groups:
        outs.append(decode_attention(q[group.rows], keys, values, group.blocks,
                                     group.bias(window), scale))
    for seg, blocks in batch.prefill:
        rows = slice(seg.row, seg.row + seg.length)
        outs.append(segment_attention(q[rows], keys, values, blocks, seg.attention_plan(),
                                      scale, window))
    extra = q.shape[0] - n
    if extra:
        outs.append(mx.zeros((extra, *q.shape[1:]), dtype=q.dtype))
    out = outs[0] if len(outs) == 1 else mx.concatenate(outs, axis=0)
    return out if batch.order is None else out[batch.order]


def native_attention_for(dtype: mx.Dtype, head_dim: int) -> bool:
    """The CPU attention kernel runs steps of this model (CPU, float32 KV, supported shape)."""
    return (dtype == mx.float32 and mx.default_device() == mx.cpu
            and cpu_attention.supported(head_dim) and native.library() is not None)


def cuda_attention_for(pool: KVPool) -> bool:
    """The CUDA attention kernel runs steps of this model (GPU, bf16 KV, supported shape)."""
    return cuda.enabled() and cuda.attention_supported(pool.dtype, pool.head_dim)


def rms_norm(x: mx.array, weight: mx.array, eps: float) -> mx.array:
    return mx.fast.rms_norm(x, weight, eps)


@dataclass(frozen=True)
class RMSNorm:
    """An RMS norm handed to the layer that consumes its output (Linear, the MLP,
    Attention): on the GPU the 4-bit matmul normalizes its own input rows
    (cuda.q4_matmul(norm=...)), elsewhere it is rms_norm first."""

    weight: mx.array
    eps: float

    def __call__(self, x: mx.array) -> mx.array:
        return rms_norm(x, self.weight, self.eps)


def kernel_norm(norm: RMSNorm | None) -> tuple[mx.array, float] | None:
    """The (weight, eps) pair cuda.q4_matmul(norm=...) takes, or None."""
    return None if norm is None else (norm.weight, norm.eps)


def normed(x: mx.array, norm: RMSNorm | None) -> mx.array:
    """norm(x), or x when there is no norm (layers that take an optional norm)."""
    return x if norm is None else norm(x)


def pad_rows(x: mx.array) -> mx.array:
    """Pad the row batch so every matmul sees at least LINEAR_ROW_FLOOR rows."""
    r = x.shape[0]
    if r >= LINEAR_ROW_FLOOR:
        return x
    return mx.concatenate([x, mx.zeros((LINEAR_ROW_FLOOR - r, *x.shape[1:]), dtype=x.dtype)])
