"""The layers the model families are built of, and the one place that picks how each runs.

Every forward works on a *row batch*: R token rows that may belong to several
sequences (slots). `Segment` says which consecutive rows belong to which slot
and at which absolute positions, so projections and MLPs run once over all rows
(weights read once per step) while attention reads each slot's own KV.

Each layer picks its path once, when it is built, from its weights, the compute dtype and
the device; a family file only says what its model computes (which weights, which norms,
which activation, how a block adds up) and gets every path below without a branch:

- `Linear`: the CUDA 4-bit kernel (GPU, bf16, 4-bit weights of a supported shape; it also
  takes the input's `RMSNorm` and the residual add into its launch), slotserve's CPU
  kernels (CPU, float32: cpu_gemm for float weights, cpu_qgemm for 4/8-bit ones), or MLX's
  own matmul (quantized, or dense).
- `Attention`: the CUDA kernels (RoPE, the K/V write and attention in
  `cuda.rope_attention`), slotserve's CPU attention kernel, or MLX ops
  (slotserve.kernels.attention); `attention_backend` decides, for the layer and for the
  tables `Batch.build` prepares alike.
- `GatedMLP`: SwiGLU in native memory between the CPU kernels; on the CUDA 4-bit kernel,
  SwiGLU in the gate+up matmul's own launch (its rows stored in tile pairs, which its own
  `split` undoes for any other use); the CUDA SwiGLU kernel; or MLX ops.

The mixture-of-experts layer is `slotserve.model.moe`; how layers add up to a model (and
the CPU path that runs a whole block in one native call) is `slotserve.model.decoder`.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from functools import cached_property
from typing import Any, Protocol

import mlx.core as mx
import numpy as np

from slotserve.kernels import cpu_attention, cpu_gemm, cpu_qgemm, cuda, native
from slotserve.kernels.attention import (
    BLOCK,
    LOG2E,
    AttentionPlan,
    decode_attention,
    position_bias,
    segment_attention,
    span_for,
)
from slotserve.kernels.cpu_attention import RopeTables, RowTables
from slotserve.kernels.cuda.launch import attention_merge, attention_tiles, tile_walks
from slotserve.model.kv import KVPool, SlotKV, rewindow
from slotserve.model.weights import QuantizedWeight, Tensor

LINEAR_ROW_FLOOR = 1  # raised by the start-up invariance probe when BLAS needs it


class Backend(enum.Enum):
    """Where a layer's work runs (chosen once, when the layer is built)."""

    CPU = "slotserve's CPU kernels"
    CUDA = "slotserve's CUDA kernels"
    MLX = "MLX ops"


def native_attention_for(dtype: mx.Dtype, head_dim: int) -> bool:
    """The CPU attention kernel runs steps of this model (CPU, float32 KV, supported shape)."""
    return (dtype == mx.float32 and mx.default_device() == mx.cpu
            and cpu_attention.supported(head_dim) and native.library() is not None)


def attention_backend(dtype: mx.Dtype, head_dim: int) -> Backend:
    """Which attention runs the steps of a model with this KV dtype and head size: what each
    `Attention` layer calls and what row tables `Batch.build` prepares for it."""
    if native_attention_for(dtype, head_dim):
        return Backend.CPU
    if cuda.enabled() and cuda.attention_supported(dtype, head_dim):
        return Backend.CUDA
    return Backend.MLX


def device_inputs(parts: list[np.ndarray]) -> list[mx.array]:
    """A step's int32 host arrays for the GPU kernels, as views of one MLX array.

    MLX (CUDA) puts an array made from host data in managed memory, and the GPU's first
    read of a page the host wrote stalls on a page fault: ~7-13 µs an array on the H200's
    host (one tiny kernel per array, 6-12 arrays a step: 96 -> 81 and 259 -> 142 µs packed
    against fresh arrays). A decode step reads five such arrays (positions, write rows,
    block tables, row tables, tiles); one buffer faults in once. Slices of a
    contiguous array are views in MLX: no copy, and the kernels read the same bytes.
    """
    host = mx.array(np.concatenate([p.astype(np.int32, copy=False).ravel() for p in parts]))
    out, at = [], 0
    for p in parts:
        out.append(host[at : at + p.size].reshape(p.shape))
        at += p.size
    return out


# ---- the row batch ----------------------------------------------------------------------

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
            starts = mx.array(self.starts, dtype=mx.int32)
            self.biases[window] = position_bias(starts, self.span, window)
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
    # GPU kernels: RowTables on device (tables, row_table, row_pos) and the attention tiles
    cuda: tuple[mx.array, mx.array, mx.array, mx.array] | None = None
    # the kernels fold long rows' attention splits in one block a tile (a prefill step's
    # launch choice, launch.attention_merge; the same bits either way)
    merge: bool = False
    # arrays whose evaluation performs K/V writes made in place (cuda.rope_write): a step
    # that asks for no logits must still evaluate them (see written())
    effects: list[mx.array] = field(default_factory=list)
    # each RoPE table's cos/sin gathered at the rows' positions, once a step (rope_rows)
    rope_cache: dict[int, tuple[mx.array, mx.array]] = field(default_factory=dict)
    # kv heads its tables address (0: the pool's); views for layers of other head counts
    kv_heads: int = 0
    views: dict[int, Batch] = field(default_factory=dict)
    # this step as the pool's sliding-window layers address it (KVPool.windowed: their
    # arrays hold window rows, kv.Windows), where the pool has such layers
    window: Batch | None = None

    @staticmethod
    def build(parts: list[tuple[SlotKV, int, int]], reserve: bool = True,
              merge: bool | None = None) -> Batch:
        """Reserve KV pages for every segment and precompute all pool indices.

        reserve=False (a speculated step): never take pages; fail if a segment lacks them.
        merge: the GPU kernels' attention form for a step with prompt rows (None: the launch
        rule, launch.attention_merge; the warm-up pins it to compile both).
        """
        segs: list[Segment] = []
        pos: list[int] = []
        writes: list[np.ndarray] = []
        row = 0
        for kv, start, length in parts:
            if reserve:
                kv.reserve(start + length)
            elif start + length > kv.capacity or not kv.writes_window(start + length):
                raise ValueError("no KV page (or window row) for a speculated row")
            segs.append(Segment(kv, start, length, row))
            pos.extend(range(start, start + length))
            writes.append(kv.rows_for(start, start + length))
            row += length
        pos.extend([0] * (LINEAR_ROW_FLOOR - len(pos)))  # padding rows (discarded)
        positions = np.array(pos, dtype=np.int32)
        pool = segs[0].kv.pool if segs else None
        backend = (attention_backend(pool.dtype, pool.head_dim) if pool is not None
                   else Backend.MLX)
        write_rows = np.concatenate(writes).astype(np.int32) if segs else None
        tables = None
        if backend is Backend.CUDA:
            assert pool is not None and write_rows is not None
            t = Batch._tables_of(segs, positions, pool.num_kv_heads)
            tiles = attention_tiles([(s.row, s.length) for s in segs], row, len(positions))
            # the row positions are the step's positions: one view serves both
            pos_in, rows_in, tables_in, row_table_in, tiles_in = device_inputs(
                [positions, write_rows, t.tables, t.row_table, np.array(tiles, np.int32)])
            batch = Batch(segs, pos_in, pool, rows_in)
            batch.cuda = (tables_in, row_table_in, pos_in, tiles_in)
            batch.merge = not batch.one_row_per_slot and (
                attention_merge(tile_walks(tiles, positions, row), pool.num_kv_heads)
                if merge is None else merge)
            tables = t.tables
        else:
            batch = Batch(segs, mx.array(positions), pool,
                          None if write_rows is None else mx.array(write_rows))
            if backend is Backend.CPU:
                assert pool is not None
                batch.native = Batch._tables_of(segs, positions, pool.num_kv_heads)
                batch.native.write_rows = write_rows
                tables = batch.native.tables
            else:
                batch._group()
        if batch.pool is not None and batch.pool.windowed:
            assert write_rows is not None
            batch.window = batch._windowed(write_rows, tables)
        return batch

    def _windowed(self, write_rows: np.ndarray, tables: np.ndarray | None) -> Batch:
        """The window view (see `window`): the same step with its write rows and tables
        (the backend's: `tables` for the kernels, else the MLX groups') mapped from page ids
        to window rows (kv.rewindow); rows, positions, effects and RoPE rows shared."""
        assert self.pool is not None
        rows, heads = self.pool.windows.table(), self.pool.num_kv_heads

        def blocks(t: np.ndarray) -> np.ndarray:
            return rewindow(t, heads, rows)

        w_rows = blocks(write_rows // BLOCK) * BLOCK + write_rows % BLOCK
        view = replace(self, views={}, window=None, decode_groups=[], prefill=[])
        if self.cuda is not None and tables is not None:
            view.write_rows, w_tables = device_inputs([w_rows, blocks(tables)])
            view.cuda = (w_tables, *self.cuda[1:])
            return view
        view.write_rows = mx.array(w_rows)
        if self.native is not None and tables is not None:
            n = self.native
            view.native = RowTables(blocks(tables), n.row_table, n.row_pos, w_rows)
        else:
            view._group(blocks)
        return view

    def windowed(self) -> Batch:
        """This step as a sliding-window layer addresses the pool (itself, where the pool
        keeps every layer by page)."""
        return self if self.window is None else self.window

    @staticmethod
    def _tables_of(segments: list[Segment], positions: np.ndarray, heads: int) -> RowTables:
        """The kernels' row tables of a step's segments (positions: every row's, padded)."""
        spans = [span_for(s.start + s.length) // BLOCK for s in segments]
        tables = np.zeros((len(segments), max(spans), heads), dtype=np.int32)
        row_table = np.full(len(positions), -1, dtype=np.int32)
        for t, (seg, nb) in enumerate(zip(segments, spans, strict=True)):
            tables[t, :nb] = seg.kv.blocks(nb * BLOCK)
            row_table[seg.row : seg.row + seg.length] = t
        return RowTables(tables, row_table, positions)

    def _group(self, remap: Callable[[np.ndarray], np.ndarray] | None = None) -> None:
        """The MLX ops' decode groups and prefill tables (block indices through `remap`:
        the window view's)."""
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
            blocks = blocks if remap is None else remap(blocks)
            self.decode_groups.append(
                DecodeGroup(span, mx.array(rows, dtype=mx.int32), mx.array(blocks),
                            [m.start for m in members])
            )
        for seg in prefill:
            emitted.extend(range(seg.row, seg.row + seg.length))
            span = seg.attention_plan().span
            blocks = seg.kv.blocks(span)[None].astype(np.int32)
            self.prefill.append((seg, mx.array(blocks if remap is None else remap(blocks))))
        emitted.extend(range(self.rows, self.padded_rows))
        if emitted != list(range(len(emitted))):
            inverse = [0] * len(emitted)
            for i, r in enumerate(emitted):
                inverse[r] = i
            self.order = mx.array(inverse, dtype=mx.int32)

    def for_heads(self, heads: int) -> Batch:
        """This step as a pool layer of `heads` kv heads sees it (a pool whose layers differ,
        KVPool.of_shapes): the same rows, positions, RoPE rows and K/V effects, with its write
        rows and block tables addressing that layer's blocks. Derived from this batch's own
        tables by array arithmetic, so a traced step (runtime.compiled) derives them too."""
        pool = self.pool
        own = self.kv_heads or (pool.num_kv_heads if pool is not None else heads)
        if pool is None or heads == own:
            return self
        if heads not in self.views:
            def blocks(t: Any) -> Any:
                return _rehead(t, own, heads)

            def rows(w: Any) -> Any:
                return blocks(w // BLOCK) * BLOCK + w[:, :1] % BLOCK

            native = self.native
            if native is not None:
                native = RowTables(blocks(native.tables), native.row_table, native.row_pos,
                                   None if native.write_rows is None
                                   else rows(native.write_rows))
            self.views[heads] = replace(
                self, kv_heads=heads, views={}, native=native,
                write_rows=None if self.write_rows is None else rows(self.write_rows),
                cuda=None if self.cuda is None else (blocks(self.cuda[0]), *self.cuda[1:]),
                decode_groups=[replace(g, blocks=blocks(g.blocks)) for g in self.decode_groups],
                prefill=[(seg, blocks(b)) for seg, b in self.prefill])
        return self.views[heads]

    def written(self) -> list[mx.array]:
        """What a step's forward must evaluate for its K/V to be in the pool."""
        return [*self.pool.arrays(), *self.effects] if self.pool is not None else []

    def rope_rows(self, rope: Rope) -> tuple[mx.array, mx.array]:
        """rope's cos and sin at every row's position, [R, 1, head_dim] (gathered once a step
        however many layers rotate by them)."""
        if id(rope) not in self.rope_cache:
            self.rope_cache[id(rope)] = rope.tables(self.positions, self.max_pos)
        return self.rope_cache[id(rope)]

    @cached_property
    def max_pos(self) -> int:
        """One past the last position any row of the step has."""
        return max(s.start + s.length for s in self.segments)

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


def _rehead(table: Any, heads: int, to: int) -> Any:
    """Pool block indices (page * heads + kv head, along the last axis) of `heads`-head
    layers, readdressed for a layer of `to` kv heads; numpy or MLX arrays alike."""
    page = table[..., :1] // heads
    lanes = (mx.arange(to, dtype=table.dtype) if isinstance(table, mx.array)
             else np.arange(to, dtype=table.dtype))
    return page * to + lanes


def pad_rows(x: mx.array) -> mx.array:
    """Pad the row batch so every matmul sees at least LINEAR_ROW_FLOOR rows."""
    r = x.shape[0]
    if r >= LINEAR_ROW_FLOOR:
        return x
    return mx.concatenate([x, mx.zeros((LINEAR_ROW_FLOOR - r, *x.shape[1:]), dtype=x.dtype)])


def plus(y: mx.array, residual: mx.array | None) -> mx.array:
    """y + residual, or y alone when there is none (a block's residual stream)."""
    return y if residual is None else y + residual


# ---- what a model is made of --------------------------------------------------------------

class Layer:
    """A piece of a model. `parts` names the layers it is made of, so whatever walks a model
    (the start-up probe's `linears`, the loader's `arrays`) follows declared structure."""

    def parts(self) -> list[Layer]:
        return []

    def arrays(self) -> list[mx.array]:
        """Every MLX array the layer holds (the loader evaluates them at load)."""
        return [a for part in self.parts() for a in part.arrays()]

    def linears(self) -> list[Linear]:
        """The layer's matmuls, in model order (each Linear once)."""
        return [lin for part in self.parts() for lin in part.linears()]


class Norm(Protocol):
    """A norm over the last axis (RMSNorm, or a family's own such as Gemma's)."""

    def __call__(self, x: mx.array) -> mx.array: ...

    def arrays(self) -> list[mx.array]: ...


def rms_norm(x: mx.array, weight: mx.array, eps: float) -> mx.array:
    return mx.fast.rms_norm(x, weight, eps)


@dataclass(frozen=True)
class RMSNorm(Layer):
    """An RMS norm handed to the layer that consumes its output (Linear, the MLP,
    Attention): on the GPU the 4-bit matmul normalizes its own input rows
    (cuda.q4_matmul(norm=...)) and the CPU block kernel its own; elsewhere it is rms_norm
    first. Any other norm (`Norm`) is applied first everywhere."""

    weight: mx.array
    eps: float

    def __call__(self, x: mx.array) -> mx.array:
        return rms_norm(x, self.weight, self.eps)

    def arrays(self) -> list[mx.array]:
        return [self.weight]


def normed(x: mx.array, norm: Norm | None) -> mx.array:
    """norm(x), or x when there is no norm (layers that take an optional norm)."""
    return x if norm is None else norm(x)


def kernel_norm(x: mx.array, norm: Norm | None) -> tuple[mx.array, tuple[mx.array, float] | None]:
    """(x, the (weight, eps) pair cuda.q4_matmul(norm=...) applies) for an RMSNorm; (norm(x),
    None) for any other norm, which the kernel does not compute."""
    if isinstance(norm, RMSNorm):
        return x, (norm.weight, norm.eps)
    return normed(x, norm), None


# ---- matmuls ----------------------------------------------------------------------------

_EXACT = (mx.float32, mx.float16, mx.bfloat16)


def _use_cpu_kernel(compute_dtype: mx.Dtype, keep_quantized: bool) -> bool:
    """The CPU compute policy (float32, weights not kept quantized) on the CPU device."""
    return (compute_dtype == mx.float32 and not keep_quantized
            and mx.default_device() == mx.cpu)


def one_group_rows(weight: QuantizedWeight) -> bool:
    """Whether each row of the matrix is one quantization group or less (in_dim <=
    group_size): such a matrix is held dense even where weights stay quantized. MLX 0.32's
    CUDA quantized_matmul sends exactly these to its qmm_sm90 kernel (supports_qmm_sm90 asks
    group_size >= K), whose rows came back NaN on the H200 (tiny-gemma4's 64-wide per-layer
    projection, 256 x 64: the first NaN of that model's forward, and the start-up probe's
    row floor 256 for it); dense, it holds at most group_size values a row."""
    return weight.shape[1] <= weight.group_size


class Linear(Layer):
    """y = x W^T (+ b), with W kept dense or affine-quantized.

    CPU: dense W in the narrowest float type that holds its values exactly (dequantized
    GGUF weights are exact in float16) through slotserve's own kernel
    (slotserve.kernels.cpu_gemm), 4/8-bit W through cpu_qgemm, or W in float32 through
    MLX/OpenBLAS when those kernels are unavailable. GPU: quantized tensors stay quantized
    (except those of one quantization group a row, `one_group_rows`: dense); 4-bit ones run
    through slotserve's batch-invariant CUDA kernel (slotserve.kernels.cuda) when it
    applies, the rest through MLX's matmuls. A bias (Qwen2's q/k/v, `attention_bias`
    / `mlp_bias` checkpoints) is one MLX add after whichever matmul ran, before the residual
    (HF's order: (x W^T + b) + residual), the same on every backend.
    """

    def __init__(self, weight: Tensor, compute_dtype: mx.Dtype, keep_quantized: bool,
                 pack: bool = True, bias: Tensor | None = None) -> None:
        self.bias: mx.array | None = None
        if bias is not None:
            assert isinstance(bias, mx.array), "biases are never quantized"
            assert bias.shape == (weight.shape[0],), (bias.shape, weight.shape)
            self.bias = bias.astype(compute_dtype)
        self.q: QuantizedWeight | None = None
        self.w: mx.array | None = None
        self.q4: tuple[mx.array, mx.array] | None = None  # cuda.q4_pack layouts
        lib = native.library() if _use_cpu_kernel(compute_dtype, keep_quantized) else None
        self.kernel: cpu_gemm.HostMatmul | None = None
        if isinstance(weight, QuantizedWeight):
            if keep_quantized and not one_group_rows(weight):
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
        if self.q is not None and not self.packable():
            # MLX's quantized_matmul runs it, and returns the promotion of x's dtype and the
            # scales': float32 scales (a checkpoint quantized from float32 weights) would
            # turn every activation after the first matmul float32 (the CUDA kernel takes
            # bfloat16 copies, q4_pack). On the GPU that is also a launch MLX 0.32.4 cannot
            # make: its CUDA gather_mm (attention's block_matmul) asks float32 products of
            # more than 64 rows for 64-96 KiB of shared memory without opting in past 48 KiB
            # (cuGraphAddKernelNode: invalid argument; gpt-oss on MLX ops, 88-token prefill)
            self.q = self.q.with_scales_in(compute_dtype)
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

    def take_rows(self, order: mx.array) -> None:
        """Store the output rows in another order (a quantized weight kept for the GPU,
        before it is packed): output column i is then row order[i]'s."""
        assert self.q is not None and self.q4 is None, "reorder kept weights before packing"
        self.q = self.q.take_rows(order)
        if self.bias is not None:
            self.bias = self.bias[order]

    @staticmethod
    def fused(parts: list[Tensor], compute_dtype: mx.Dtype, keep_quantized: bool,
              pack: bool = True, biases: list[Tensor | None] | None = None) -> Linear:
        """One matrix for several projections of the same input (QKV, gate+up); their biases,
        when any part has one, as one vector (zeros for a part without)."""
        bias = None
        if biases is not None and any(b is not None for b in biases):
            vectors = [mx.zeros((p.shape[0],), mx.float32) if b is None else b
                       for p, b in zip(parts, biases, strict=True)]
            assert all(isinstance(b, mx.array) for b in vectors), "biases are never quantized"
            bias = mx.concatenate([b.astype(mx.float32) for b in vectors])  # type: ignore[union-attr]
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
                    bias,
                )
        exact = _use_cpu_kernel(compute_dtype, keep_quantized) and native.library()
        dense = [
            p.dequantize(None if exact else compute_dtype) if isinstance(p, QuantizedWeight)
            else p for p in parts
        ]
        if len({d.dtype for d in dense}) > 1 or not exact:
            dense = [d.astype(compute_dtype) for d in dense]
        return Linear(mx.concatenate(dense), compute_dtype, False, pack, bias)

    def __call__(self, x: mx.array, residual: mx.array | None = None,
                 norm: Norm | None = None) -> mx.array:
        """norm(x) W^T (x W^T without a norm) + the bias, plus `residual` when given; the CUDA
        4-bit kernel does an RMS norm and the residual add in its own launch."""
        if self.bias is not None:
            return plus(self._product(x, None, norm) + self.bias, residual)
        return self._product(x, residual, norm)

    def _product(self, x: mx.array, residual: mx.array | None, norm: Norm | None) -> mx.array:
        """norm(x) W^T, plus `residual` when given (no bias)."""
        if self.q4 is not None:
            x, fused_norm = kernel_norm(x, norm)
            return cuda.q4_matmul(x, *self.q4, residual=residual, norm=fused_norm)
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

    def arrays(self) -> list[mx.array]:
        out = [] if self.w is None else [self.w]
        if self.bias is not None:
            out.append(self.bias)
        if self.q is not None:
            out += [self.q.weight, self.q.scales, self.q.biases]
        if self.q4 is not None:
            out += list(self.q4)
        if isinstance(self.kernel, cpu_gemm.Matrix):
            out.append(self.kernel.w)  # float weights padded for the kernel
        return out

    def linears(self) -> list[Linear]:
        return [self]


class Embedding(Layer):
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

    def arrays(self) -> list[mx.array]:
        codes = self.codes
        return self.linear.arrays() + ([] if codes is None
                                       else [codes.weight, codes.scales, codes.biases])

    def linears(self) -> list[Linear]:
        """None: a lookup reads only the step's rows (a tied lm_head is the model's own)."""
        return []


# ---- RoPE -------------------------------------------------------------------------------

def rope_inv_freq(head_dim: int, theta: float, scaling: dict[str, Any] | None) -> mx.array:
    """Inverse frequencies, with Llama-3 and linear scaling as HF defines them."""
    inv = 1.0 / (theta ** (mx.arange(0, head_dim, 2, dtype=mx.float32) / head_dim))
    if not scaling:
        return inv
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind == "freq_factors":  # llama.cpp's rope_freqs tensor (Llama 3.1+ GGUF): divisors
        return inv / mx.array(scaling["factors"], dtype=mx.float32)
    if kind == "proportional":  # Gemma 4's global layers: only the first frequencies rotate
        rotated = int(float(scaling.get("partial_rotary_factor", 1.0)) * head_dim // 2)
        inv = mx.where(mx.arange(head_dim // 2) < rotated, inv, 0.0)
        return inv / float(scaling.get("factor", 1.0))
    factor = float(scaling["factor"])
    if kind == "linear":
        return inv / factor
    if kind == "yarn":
        return yarn_inv_freq(head_dim, theta, factor, scaling)
    low = float(scaling.get("low_freq_factor", 1.0))
    high = float(scaling.get("high_freq_factor", 4.0))
    old_ctx = float(scaling.get("original_max_position_embeddings", 8192))
    wavelen = 2 * math.pi / inv
    smooth = (old_ctx / wavelen - low) / (high - low)
    mid = (1 - smooth) * inv / factor + smooth * inv
    out = mx.where(wavelen > old_ctx / low, inv / factor, inv)
    is_mid = (wavelen <= old_ctx / low) & (wavelen >= old_ctx / high)
    return mx.where(is_mid, mid, out)


def yarn_inv_freq(head_dim: int, theta: float, factor: float,
                  scaling: dict[str, Any]) -> mx.array:
    """YaRN's inverse frequencies as HF computes them (gpt-oss): interpolated by `factor`
    below the correction range of beta_fast/beta_slow rotations over the original
    context, extrapolated (unscaled) above it, a linear ramp between."""
    orig = float(scaling["original_max_position_embeddings"])
    fast, slow = float(scaling.get("beta_fast") or 32), float(scaling.get("beta_slow") or 1)

    def dim_of(rotations: float) -> float:
        return head_dim * math.log(orig / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = dim_of(fast), dim_of(slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001
    pos = theta ** (mx.arange(0, head_dim, 2, dtype=mx.float32) / head_dim)
    ramp = mx.clip((mx.arange(head_dim // 2, dtype=mx.float32) - low) / (high - low), 0, 1)
    extrapolation = 1 - ramp
    return (1.0 / (factor * pos)) * (1 - extrapolation) + (1.0 / pos) * extrapolation


def rope_attention_factor(scaling: dict[str, Any] | None) -> float:
    """The scale HF puts on cos and sin (YaRN's attention factor; 1 for the others)."""
    kind = (scaling or {}).get("rope_type", (scaling or {}).get("type"))
    if kind != "yarn" or scaling is None:
        return 1.0
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    factor = float(scaling["factor"])

    def mscale(m: float) -> float:
        return 1.0 if factor <= 1 else 0.1 * m * math.log(factor) + 1.0

    if scaling.get("mscale") and scaling.get("mscale_all_dim"):
        return mscale(float(scaling["mscale"])) / mscale(float(scaling["mscale_all_dim"]))
    return mscale(1.0)


LONGROPE = ("longrope", "su")


@dataclass
class LongRope:
    """LongRoPE (Phi-3's "su"/"longrope" scaling) as HF computes it: inverse frequencies
    over the first `partial_rotary_factor` of the head (exponents over that width, the
    rest of the head not rotated: zero frequencies), divided by the short factors, or by
    the long ones from `original_max_position_embeddings` on, and the rotated cos/sin
    scaled by the attention factor.

    HF's forward picks short or long for a whole forward by its longest position (and its
    `generate` recomputes the whole sequence with the long factors once it grows past the
    original context); this position-keyed table picks per position: the same as HF for
    every sequence within the original context and for HF's forward stepped on its cache
    past it, while keys written before the switch keep the short factors. It keeps each
    position's bits independent of the batch and of prefix reuse.
    """

    short: mx.array  # [head_dim // 2] inverse frequencies before `switch`
    long: mx.array | None  # from `switch` on (None: no long factors)
    switch: int
    mscale: mx.array  # [head_dim] cos/sin scale (attention factor on the rotated dims)

    @staticmethod
    def build(head_dim: int, theta: float, scaling: dict[str, Any]) -> LongRope:
        dim = int(head_dim * float(scaling.get("partial_rotary_factor", 1.0)))
        base = theta ** (mx.arange(0, dim, 2, dtype=mx.float32) / dim)
        pad = mx.zeros((head_dim // 2 - dim // 2,), mx.float32)

        def inv(factors: list[float] | None) -> mx.array:
            ext = mx.ones((dim // 2,)) if factors is None else mx.array(factors, mx.float32)
            return mx.concatenate([1.0 / (ext * base), pad])

        orig = int(scaling.get("original_max_position_embeddings") or 0)
        factor = float(scaling.get("factor") or 1.0)
        attn = scaling.get("attention_factor")
        if attn is None:
            attn = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(orig))
        half = mx.where(mx.arange(head_dim // 2) < dim // 2, float(attn), 1.0)
        long = scaling.get("long_factor")
        return LongRope(inv(scaling.get("short_factor")), None if long is None else inv(long),
                        orig, mx.concatenate([half, half]).astype(mx.float32))

    def angles(self, positions: mx.array) -> mx.array:
        """[P, head_dim // 2] rotation angles of positions [P, 1]."""
        ang = positions * self.short[None, :]
        if self.long is None:
            return ang
        return mx.where(positions < self.switch, ang, positions * self.long[None, :])


class Rope(Layer):
    """Rotate-half RoPE from a cos/sin table gathered by each row's absolute position.

    A table lookup (instead of a kernel with a scalar offset) lets every row of a
    mixed batch carry its own position, and gives each position the same bits
    whatever batch it is computed in. LongRoPE (`LongRope`) is such a table too.
    """

    def __init__(self, head_dim: int, theta: float, scaling: dict[str, Any] | None,
                 dtype: mx.Dtype) -> None:
        kind = (scaling or {}).get("rope_type", (scaling or {}).get("type"))
        self.long_rope = LongRope.build(head_dim, theta, scaling) if kind in LONGROPE \
            and scaling else None
        self.inv_freq = (self.long_rope.short if self.long_rope is not None
                         else rope_inv_freq(head_dim, theta, scaling))
        self.attention_factor = rope_attention_factor(scaling)
        self.dtype = dtype
        self.size = 0
        self.cos = self.sin = mx.zeros((0,))
        self._host: RopeTables | None = None

    def _grow(self, n: int) -> None:
        size = max(4096, 1 << (n - 1).bit_length())
        positions = mx.arange(size, dtype=mx.float32)[:, None]
        lr = self.long_rope
        ang = positions * self.inv_freq[None, :] if lr is None else lr.angles(positions)
        emb = mx.concatenate([ang, ang], axis=-1)
        cos, sin = mx.cos(emb), mx.sin(emb)
        if lr is not None:
            cos, sin = cos * lr.mscale, sin * lr.mscale
        elif self.attention_factor != 1.0:
            cos, sin = cos * self.attention_factor, sin * self.attention_factor
        self.cos, self.sin = cos.astype(self.dtype), sin.astype(self.dtype)
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

    def arrays(self) -> list[mx.array]:
        return [self.inv_freq, self.cos, self.sin]


# ---- attention --------------------------------------------------------------------------

class Attention(Layer):
    """Self-attention of one layer over a row batch: a fused QKV projection, optionally a
    norm of each q and k head, rotate-half RoPE, the K/V write into the pool, each row
    against its own slot's keys (causal; within `window` positions when given), and the
    output projection; `biases` are the (q, k, v, o) projection biases, each optional;
    `sinks` [heads] are attention-sink logits (gpt-oss: one more logit per head in the
    softmax, weighting no value; every backend)."""

    sinks: mx.array | None = None  # [heads] float32, when the family has attention sinks
    _host_sinks: np.ndarray | None = None  # the same for the CPU kernel
    _cuda_sinks: mx.array | None = None  # the same times log2 e, for the CUDA kernel

    def __init__(self, q: Tensor, k: Tensor, v: Tensor, o: Tensor, dtype: mx.Dtype,
                 keep_quantized: bool, *, layer: int, heads: int, kv_heads: int,
                 head_dim: int, scale: float, rope: Rope, q_norm: Norm | None = None,
                 k_norm: Norm | None = None, window: int | None = None,
                 biases: tuple[Tensor | None, ...] | None = None,
                 sinks: Tensor | None = None) -> None:
        assert (q_norm is None) == (k_norm is None), "q and k heads are normed alike"
        q_bias, k_bias, v_bias, o_bias = biases or (None,) * 4
        self.qkv = Linear.fused([q, k, v], dtype, keep_quantized,
                                biases=[q_bias, k_bias, v_bias])
        self.o = Linear(o, dtype, keep_quantized, bias=o_bias)
        self.layer, self.heads, self.kv_heads, self.head_dim = layer, heads, kv_heads, head_dim
        self.scale, self.rope, self.window = scale, rope, window
        self.q_norm, self.k_norm = q_norm, k_norm
        self.backend = attention_backend(dtype, head_dim)
        self._attend = {Backend.CUDA: self._cuda_kernels, Backend.CPU: self._cpu_kernel,
                        Backend.MLX: self._mlx_ops}[self.backend]
        if sinks is not None:
            assert isinstance(sinks, mx.array) and sinks.shape == (heads,), "one sink a head"
            self.sinks = sinks.astype(mx.float32)
            self._host_sinks = np.array(self.sinks)
            self._cuda_sinks = self.sinks * LOG2E  # the CUDA kernel's, in log2 units

    def __call__(self, x: mx.array, batch: Batch, residual: mx.array | None = None,
                 norm: Norm | None = None) -> mx.array:
        """The attention output for norm(x) (x when no norm is given), plus `residual` when
        given (the block's residual stream: the CUDA 4-bit kernel normalizes in the QKV
        projection's launch and adds it in the output projection's)."""
        view = batch if self.window is None else batch.windowed()
        return self.o(self._attend(self.qkv(x, norm=norm), view), residual)

    def parts(self) -> list[Layer]:
        norms = [] if self.q_norm is None else [self.q_norm, self.k_norm]
        return [self.qkv, self.o, *norms]  # type: ignore[list-item]

    def _split(self, qkv: mx.array) -> tuple[mx.array, mx.array, mx.array]:
        r, d = qkv.shape[0], self.head_dim
        nq, nk = self.heads * d, self.kv_heads * d
        q = qkv[:, :nq].reshape(r, self.heads, d)
        k = qkv[:, nq : nq + nk].reshape(r, self.kv_heads, d)
        v = qkv[:, nq + nk :].reshape(r, self.kv_heads, d)
        return q, k, v

    def _cuda_kernels(self, qkv: mx.array, batch: Batch) -> mx.array:
        """RoPE, the K/V write into the pool and attention from the fused QKV rows
        (cuda.rope_attention: one launch on decode steps)."""
        pool = batch.pool
        assert pool is not None and batch.write_rows is not None and batch.cuda is not None
        if self.q_norm is not None:  # the heads normed in place of the rows the kernel reads
            q, k, _ = self._split(qkv)
            r, nkv = qkv.shape[0], (self.heads + self.kv_heads) * self.head_dim
            assert self.k_norm is not None
            qkv = mx.concatenate([self.q_norm(q).reshape(r, -1), self.k_norm(k).reshape(r, -1),
                                  qkv[:, nkv:]], axis=1)
        return self._rope_attention(qkv, batch)

    def _rope_attention(self, rows: mx.array, batch: Batch) -> mx.array:
        """cuda.rope_attention of fused q/k/v rows (their K/V written into this layer's pool
        arrays), kept among the step's effects: its K/V writes must run even if no logits
        are asked."""
        pool = batch.pool
        assert pool is not None and batch.write_rows is not None and batch.cuda is not None
        self.rope.reserve(batch.max_pos)
        tables, row_table, row_pos, tiles = batch.cuda
        out = cuda.rope_attention(rows, self.rope.cos, self.rope.sin, batch.write_rows,
                                  pool.keys[self.layer], pool.values[self.layer], tables,
                                  row_table, row_pos, self.scale, self.heads, self.kv_heads,
                                  self.head_dim, batch.one_row_per_slot, self.window,
                                  sinks=self._cuda_sinks, tiles=tiles, merge=batch.merge)
        batch.effects.append(out)
        return out

    def _write_rotated(self, qkv: mx.array, batch: Batch) -> mx.array:
        """Rotate q and k by their rows' positions (each head normed first when the family
        norms them), write the rows' K/V into the pool (one scatter each) and return q
        [R, heads, head_dim]."""
        q, k, v = self._split(qkv)
        if self.q_norm is not None:
            assert self.k_norm is not None
            q, k = self.q_norm(q), self.k_norm(k)
        cos, sin = batch.rope_rows(self.rope)
        q, k = Rope.apply(q, cos, sin), Rope.apply(k, cos, sin)
        pool = batch.pool
        assert pool is not None and batch.write_rows is not None
        n = batch.rows
        pool.keys[self.layer][batch.write_rows] = k[:n] if k.shape[0] > n else k
        pool.values[self.layer][batch.write_rows] = v[:n] if v.shape[0] > n else v
        return q

    def _cpu_kernel(self, qkv: mx.array, batch: Batch) -> mx.array:
        """slotserve's CPU attention kernel, reading each slot's K/V in place in the pool."""
        q = self._write_rotated(qkv, batch)
        pool, lib = batch.pool, native.library()
        assert pool is not None and lib is not None and batch.native is not None
        out = cpu_attention.attend(lib, q, pool.keys[self.layer], pool.values[self.layer],
                                   batch.native, self.scale, self.window, self._host_sinks)
        return out.reshape(out.shape[0], -1)

    def _mlx_ops(self, qkv: mx.array, batch: Batch) -> mx.array:
        """MLX ops (slotserve.kernels.attention): all decode rows of one key span in one
        batched dispatch, each prefill chunk over its own slot's positions."""
        q = self._write_rotated(qkv, batch)
        pool = batch.pool
        assert pool is not None
        keys, values = pool.key_blocks(self.layer), pool.value_blocks(self.layer)
        outs = []
        for group in batch.decode_groups:
            outs.append(decode_attention(q[group.rows], keys, values, group.blocks,
                                         group.bias(self.window), self.scale, self.sinks))
        for seg, blocks in batch.prefill:
            rows = slice(seg.row, seg.row + seg.length)
            outs.append(segment_attention(q[rows], keys, values, blocks, seg.attention_plan(),
                                          self.scale, self.window, self.sinks))
        extra = q.shape[0] - batch.rows
        if extra:
            outs.append(mx.zeros((extra, *q.shape[1:]), dtype=q.dtype))
        out = outs[0] if len(outs) == 1 else mx.concatenate(outs, axis=0)
        out = out if batch.order is None else out[batch.order]
        return out.reshape(out.shape[0], -1)



class SharedKVAttention(Attention):
    """Attention of a model whose layers differ in K/V and may share it (Gemma 4): each
    layer addresses the pool with its own kv heads and head size (KVPool.of_shapes); a
    layer without k (`k` None) writes nothing and reads pool layer `layer`, which an
    earlier layer wrote; a layer without v takes its values from the keys' projection
    (before the k norm); `v_norm` norms each value head. Every layer of a model runs on the
    backend its widest head allows (`backend_dim`), as the step's tables are built once."""

    # what the base class's __init__ sets that this one leaves as it is (no attention sinks)
    sinks: mx.array | None = None
    _host_sinks: np.ndarray | None = None
    _cuda_sinks: mx.array | None = None

    def __init__(self, q: Tensor, k: Tensor | None, v: Tensor | None, o: Tensor,
                 dtype: mx.Dtype, keep_quantized: bool, *, layer: int, heads: int,
                 kv_heads: int, head_dim: int, scale: float, rope: Rope, q_norm: Norm,
                 k_norm: Norm | None, v_norm: Norm | None, window: int | None,
                 backend_dim: int) -> None:
        self.writes = k is not None
        self.keys_as_values = v is None
        assert self.writes or v is None, "a layer reading shared K/V has no v projection"
        assert (k_norm is not None) == self.writes, "a layer that writes keys norms them"
        projections = [t for t in (q, k, v) if t is not None]
        self.qkv = (Linear.fused(projections, dtype, keep_quantized) if len(projections) > 1
                    else Linear(q, dtype, keep_quantized))
        self.o = Linear(o, dtype, keep_quantized)
        self.layer, self.heads, self.kv_heads, self.head_dim = layer, heads, kv_heads, head_dim
        self.scale, self.rope, self.window = scale, rope, window
        self.q_norm, self.k_norm, self.v_norm = q_norm, k_norm, v_norm
        self.backend = attention_backend(dtype, max(head_dim, backend_dim))
        self._attend = {Backend.CUDA: self._cuda_kernels, Backend.CPU: self._cpu_kernel,
                        Backend.MLX: self._mlx_ops}[self.backend]

    def __call__(self, x: mx.array, batch: Batch, residual: mx.array | None = None,
                 norm: Norm | None = None) -> mx.array:
        view = batch if self.window is None else batch.windowed()
        return self.o(self._attend(self.qkv(x, norm=norm), view.for_heads(self.kv_heads)),
                      residual)

    def parts(self) -> list[Layer]:
        norms = [n for n in (self.q_norm, self.k_norm, self.v_norm) if n is not None]
        return [self.qkv, self.o, *norms]  # type: ignore[list-item]

    def _heads(self, qkv: mx.array) -> tuple[mx.array, mx.array | None, mx.array | None]:
        """q, and k and v (None on a layer that reads shared K/V), each head normed."""
        r, d = qkv.shape[0], self.head_dim
        nq, nk = self.heads * d, self.kv_heads * d
        q = self.q_norm(qkv[:, :nq].reshape(r, self.heads, d))
        if not self.writes:
            return q, None, None
        k = qkv[:, nq : nq + nk].reshape(r, self.kv_heads, d)
        v = k if self.keys_as_values else qkv[:, nq + nk :].reshape(r, self.kv_heads, d)
        assert self.k_norm is not None
        k = self.k_norm(k)
        return q, k, v if self.v_norm is None else self.v_norm(v)

    def _cuda_kernels(self, qkv: mx.array, batch: Batch) -> mx.array:
        """The normed heads as the fused rows cuda.rope_attention reads; a layer reading
        shared K/V rotates q with MLX ops and runs the paged attention kernel alone."""
        pool = batch.pool
        assert pool is not None and batch.write_rows is not None and batch.cuda is not None
        q, k, v = self._heads(qkv)
        if k is None or v is None:
            cos, sin = batch.rope_rows(self.rope)
            tables, row_table, row_pos, tiles = batch.cuda
            return cuda.paged_attention(Rope.apply(q, cos, sin), pool.keys[self.layer],
                                        pool.values[self.layer], tables, row_table, row_pos,
                                        self.scale, self.window, tiles=tiles,
                                        merge=batch.merge).reshape(q.shape[0], -1)
        r = qkv.shape[0]
        rows = mx.concatenate([q.reshape(r, -1), k.reshape(r, -1), v.reshape(r, -1)], axis=1)
        return self._rope_attention(rows, batch)

    def _write_rotated(self, qkv: mx.array, batch: Batch) -> mx.array:
        """q rotated; k rotated and written with v, on a layer that writes K/V."""
        q, k, v = self._heads(qkv)
        cos, sin = batch.rope_rows(self.rope)
        q = Rope.apply(q, cos, sin)
        if k is None or v is None:
            return q
        k = Rope.apply(k, cos, sin)
        pool = batch.pool
        assert pool is not None and batch.write_rows is not None
        n = batch.rows
        pool.keys[self.layer][batch.write_rows] = k[:n] if k.shape[0] > n else k
        pool.values[self.layer][batch.write_rows] = v[:n] if v.shape[0] > n else v
        return q


# ---- MLPs -------------------------------------------------------------------------------

def silu(x: mx.array) -> mx.array:
    return x * mx.sigmoid(x)


def gelu_tanh(x: mx.array) -> mx.array:
    """HF's gelu_pytorch_tanh."""
    return 0.5 * x * (1.0 + mx.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x * x * x)))


Activation = Callable[[mx.array], mx.array]


class GatedMLP(Layer):
    """down(act(gate(x)) * up(x)), gate and up as one fused matmul (SwiGLU with silu)."""

    def __init__(self, gate: Tensor, up: Tensor, down: Tensor, act: Activation,
                 dtype: mx.Dtype, keep_quantized: bool,
                 biases: tuple[Tensor | None, Tensor | None, Tensor | None] | None = None) -> None:
        """biases: (gate, up, down) biases of an `mlp_bias` checkpoint (each may be None);
        the kernels that fuse SwiGLU into a matmul add none, so the MLP then takes the
        unfused paths (each Linear adds its own)."""
        self.inter = gate.shape[0]
        self.act = act
        gate_bias, up_bias, down_bias = biases or (None, None, None)
        self.gate_up = Linear.fused([gate, up], dtype, keep_quantized, pack=False,
                                    biases=[gate_bias, up_bias])
        unbiased = self.gate_up.bias is None
        # on the CUDA 4-bit kernel, silu(gate) * up comes out of the gate+up matmul's own
        # launch when gate and up rows are stored in 8-row tile pairs (cuda.paired_rows);
        # `split` undoes the pairing wherever else the product is read
        self.paired = (act is silu and unbiased and self.inter % 8 == 0
                       and self.gate_up.packable())
        if self.paired:
            self.gate_up.take_rows(cuda.paired_rows(self.inter))
        self.gate_up.pack_for_gpu()
        self.down = Linear(down, dtype, keep_quantized, bias=down_bias)
        swiglu = act is silu
        if (swiglu and unbiased and self.down.bias is None and self.gate_up.kernel is not None
                and self.down.kernel is not None and self.inter % 16 == 0):
            self.backend, self._forward = Backend.CPU, self._cpu_kernels
        elif self.paired:
            self.backend, self._forward = Backend.CUDA, self._cuda_in_matmul
        elif swiglu and cuda.enabled():  # the model is built on the device it will run on
            self.backend, self._forward = Backend.CUDA, self._cuda_kernel
        else:
            self.backend, self._forward = Backend.MLX, self._mlx_ops

    def __call__(self, x: mx.array, residual: mx.array | None = None,
                 norm: Norm | None = None, rows: int | None = None) -> mx.array:
        """The MLP's output for norm(x) (x when no norm is given), plus `residual` when given
        (on the CUDA 4-bit kernel an RMS norm runs in the gate+up launch, the add in the down
        projection's). rows: the real rows (a dense MLP runs the padding rows too)."""
        return self._forward(x, residual, norm)

    def parts(self) -> list[Layer]:
        return [self.gate_up, self.down]

    def split(self, gu: mx.array) -> tuple[mx.array, mx.array]:
        """The gate and up halves of a gate+up product [..., 2 * inter], in the row order this
        layer stored them (halves, or tile pairs)."""
        lead, i = gu.shape[:-1], self.inter
        if not self.paired:
            return gu[..., :i], gu[..., i:]
        tiles = gu.reshape(*lead, i // 8, 2, 8)
        return tiles[..., 0, :].reshape(*lead, i), tiles[..., 1, :].reshape(*lead, i)

    def _cpu_kernels(self, x: mx.array, residual: mx.array | None,
                     norm: Norm | None) -> mx.array:
        """gate+up, SwiGLU and down in native memory (cpu_gemm.swiglu_mlp)."""
        lib = native.library()
        assert lib is not None and self.gate_up.kernel is not None
        assert self.down.kernel is not None
        return plus(cpu_gemm.swiglu_mlp(lib, self.gate_up.kernel, self.down.kernel,
                                        normed(x, norm)), residual)

    def _cuda_in_matmul(self, x: mx.array, residual: mx.array | None,
                        norm: Norm | None) -> mx.array:
        """SwiGLU in the 4-bit gate+up matmul's launch (paired rows)."""
        assert self.gate_up.q4 is not None
        x, fused_norm = kernel_norm(x, norm)
        return self.down(cuda.q4_matmul(x, *self.gate_up.q4, gate_up=True, norm=fused_norm),
                         residual)

    def _cuda_kernel(self, x: mx.array, residual: mx.array | None,
                     norm: Norm | None) -> mx.array:
        """SwiGLU in one CUDA kernel, no chain of bf16 ops for mx.compile to fuse otherwise."""
        return self.down(cuda.swiglu(self.gate_up(x, norm=norm)), residual)

    def _mlx_ops(self, x: mx.array, residual: mx.array | None, norm: Norm | None) -> mx.array:
        g, u = self.split(self.gate_up(x, norm=norm))
        return self.down(self.act(g) * u, residual)
