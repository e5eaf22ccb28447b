"""Decoder blocks and the decoder: how a family's layers add up to a model, and the CPU
path that runs a whole step in native memory.

`PreNormBlock` is the llama-style residual block; when every part of it has a native CPU
kernel it runs as one native/block.c call (the same kernels in the same order, without
returning to MLX between them). `Decoder` is every family's Model: embedding, blocks,
final norm and lm_head over a row batch; when all its blocks are native pre-norm blocks,
a CPU step goes to native memory once and its logits come back once.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import mlx.core as mx
import numpy as np

from slotserve.kernels import cpu_attention, cpu_gemm, native
from slotserve.model.config import ModelConfig
from slotserve.model.kv import KVPool, SlotKV
from slotserve.model.layers import (
    Attention,
    Backend,
    Batch,
    Embedding,
    GatedMLP,
    Layer,
    Linear,
    Norm,
    RMSNorm,
    Rope,
    pad_rows,
)
from slotserve.model.moe import SparseMoE

FeedForward = GatedMLP | SparseMoE


@dataclass
class NativeBlock:
    """A PreNormBlock as native/block.c takes it: its four matrices and float32 norms."""

    matrices: tuple[cpu_gemm.SlotMatrix, ...]  # QKV, O, gate+up, down
    in_norm: np.ndarray
    post_norm: np.ndarray
    q_norm: np.ndarray | None
    k_norm: np.ndarray | None
    eps: float


class PreNormBlock(Layer):
    """The llama-style residual block: h = x + attn(in_norm(x)), then h + mlp(post_norm(h)).

    On the CPU, when every part has a native kernel (`native`), the whole block is one
    native/block.c call (`host`): the same kernels in the same order, without returning to
    MLX between them.
    """

    def __init__(self, attn: Attention, mlp: FeedForward, in_norm: Norm,
                 post_norm: Norm) -> None:
        self.attn, self.mlp = attn, mlp
        self.in_norm, self.post_norm = in_norm, post_norm

    def __call__(self, x: mx.array, batch: Batch) -> mx.array:
        h = self.attn(x, batch, residual=x, norm=self.in_norm)
        return self.mlp(h, residual=h, norm=self.post_norm, rows=batch.rows)

    def parts(self) -> list[Layer]:
        return [self.attn, self.mlp, self.in_norm, self.post_norm]  # type: ignore[list-item]

    def runs_on_host(self) -> bool:
        """Every part of this block has a native CPU kernel (`host` can run it)."""
        return self.native() is not None

    def native(self) -> NativeBlock | None:
        """The block as block.c takes it (decided once, at the first call: kernels are fixed
        at load), or None where a part lacks a native kernel."""
        if self._native is False:
            self._native = self._native_form()
        return self._native  # type: ignore[return-value]

    _native: NativeBlock | None | bool = False

    def _native_form(self) -> NativeBlock | None:
        """None unless block.c computes exactly this block: this class's __call__, attention
        and a SwiGLU MLP on the CPU kernels, no window, no projection bias, RMS norms of one
        eps (the q/k head norms too, if any) and widths the kernels take (multiples of 16)."""
        a, m = self.attn, self.mlp
        if (type(self).__call__ is not PreNormBlock.__call__ or not isinstance(m, GatedMLP)
                or m.backend is not Backend.CPU or a.backend is not Backend.CPU
                or a.window is not None or a.qkv.bias is not None or a.o.bias is not None
                or a.sinks is not None):
            return None
        norms = [n for n in (self.in_norm, self.post_norm, a.q_norm, a.k_norm) if n is not None]
        rms = [n for n in norms if isinstance(n, RMSNorm)]
        if len(rms) < len(norms) or len({n.eps for n in rms}) != 1:
            return None
        if rms[0].weight.shape[0] % 16 or (len(rms) > 2 and a.head_dim % 16):
            return None
        kernels = [a.qkv.kernel, a.o.kernel, m.gate_up.kernel, m.down.kernel]
        mats = [k.descriptor() for k in kernels if k is not None]
        if len(mats) < len(kernels) or any(d is None for d in mats):
            return None  # a float matrix whose K the kernel pads (block.c does not)
        weights = [cpu_gemm.to_host(n.weight.astype(mx.float32))[0] for n in rms]
        heads = (weights[2], weights[3]) if len(weights) > 2 else (None, None)
        return NativeBlock(tuple(d for d in mats if d is not None), weights[0], weights[1],
                           *heads, rms[0].eps)

    def host(self, lib: ctypes.CDLL, x: np.ndarray, batch: Batch) -> np.ndarray:
        """The block on host rows x (updated in place), in one native call (block.c): the
        residual stream never goes back to MLX."""
        nb, a = self.native(), self.attn
        pool, rows = batch.pool, batch.native
        assert nb is not None and pool is not None and rows is not None
        assert rows.write_rows is not None
        k_host, v_host = cpu_attention.pool_host(pool.keys[a.layer], pool.values[a.layer])
        tables = a.rope.host_tables()
        qn, kn = nb.q_norm, nb.k_norm
        rc = lib.slot_llama_block(
            x.ctypes.data, x.shape[0], x.shape[1], nb.in_norm.ctypes.data,
            nb.post_norm.ctypes.data, ctypes.c_float(nb.eps),
            None if qn is None else qn.ctypes.data, None if kn is None else kn.ctypes.data,
            *(ctypes.addressof(mat) for mat in nb.matrices), a.heads, a.kv_heads, a.head_dim,
            tables.cos.ctypes.data, tables.sin.ctypes.data, k_host.ctypes.data,
            v_host.ctypes.data, rows.write_rows.ctypes.data, rows.write_rows.shape[0],
            rows.tables.ctypes.data, rows.tables.shape[1], rows.row_table.ctypes.data,
            rows.row_pos.ctypes.data, ctypes.c_float(a.scale * cpu_attention.LOG2E), 0)
        if rc != 0:
            raise RuntimeError(f"slot_llama_block failed (code {rc})")
        return x


class DecoderBlock(Protocol):
    """A decoder block: the row batch's hidden states in, the next layer's out."""

    def __call__(self, x: mx.array, batch: Batch) -> mx.array: ...

    def arrays(self) -> list[mx.array]: ...

    def linears(self) -> list[Linear]: ...


class Decoder(Layer):
    """A decoder-only transformer over a row batch: embedding, blocks, final norm, lm_head.

    Each family's Model is one, built from its own blocks. A CPU model whose blocks are all
    native `PreNormBlock`s runs its steps in native memory (`runs_on_host`): the embedded
    rows go to the native kernels once and the logits come back once, instead of four
    hand-overs per layer.
    """

    kv_pool: KVPool | None = None  # created on the first new_kv()

    def __init__(self, config: ModelConfig, dtype: mx.Dtype, embed: Embedding,
                 blocks: Sequence[DecoderBlock], norm: Norm, lm_head: Linear,
                 ropes: list[Rope]) -> None:
        self.config, self.dtype = config, dtype
        self.embed, self.norm, self.lm_head = embed, norm, lm_head
        self.layers = list(blocks)
        self.ropes = ropes  # the RoPE tables the blocks rotate by (grown as positions do)

    def new_kv(self) -> SlotKV:
        """A slot's KV, backed by this model's shared page pool."""
        if self.kv_pool is None:
            c = self.config
            self.kv_pool = KVPool(c.num_layers, c.num_kv_heads, c.head_dim, self.dtype,
                                  **self.windowing())
        return SlotKV(self.kv_pool)

    def windowing(self) -> dict[str, Any]:
        """KVPool's `windowed` and `window`: the pool layers only sliding-window attention
        reads keep their K/V in window rows (kv.Windows), where some layer is global (a
        model whose every layer slides keeps paging them all: its budget is in pages)."""
        kinds: dict[int, set[int | None]] = {}
        for block in self.layers:
            attn = getattr(block, "attn", None)
            if isinstance(attn, Attention):
                kinds.setdefault(attn.layer, set()).add(attn.window)
        assert all(len(k) == 1 for k in kinds.values()), "a pool layer read two ways"
        windows = {i: next(iter(k)) for i, k in kinds.items()}
        sliding = frozenset(i for i, w in windows.items() if w is not None)
        sizes = {windows[i] for i in sliding}
        if not sliding or len(sliding) == len(windows) or len(sizes) != 1:
            return {}
        return {"windowed": sliding, "window": int(next(iter(sizes)))}  # type: ignore[arg-type]

    def parts(self) -> list[Layer]:
        return [self.embed, *self.layers, self.norm, self.lm_head, *self.ropes]  # type: ignore[list-item]

    def embed_tokens(self, tokens: mx.array) -> mx.array:
        return self.embed(tokens)

    def __call__(self, tokens: mx.array, batch: Batch, logit_rows: list[int]) -> mx.array | None:
        """Run R token rows; return float32 logits for the rows in logit_rows (None if empty).

        Rows not in logit_rows still write their K/V into their slots.
        """
        if self.runs_on_host():
            return self.host(tokens, batch, logit_rows)
        x = self.embed_tokens(batch.pad_tokens(tokens))
        for layer in self.layers:
            x = layer(x, batch)
        if not logit_rows:
            return None
        x = x[mx.array(logit_rows, dtype=mx.int32)]
        return self.lm_head(pad_rows(x), norm=self.norm)[: len(logit_rows)].astype(mx.float32)

    def runs_on_host(self) -> bool:
        """The whole forward has native CPU kernels (decided once: kernels are fixed at load)."""
        if self._on_host is None:
            self._on_host = (all(isinstance(b, PreNormBlock) and b.runs_on_host()
                                 for b in self.layers)
                             and isinstance(self.norm, RMSNorm)
                             and self.lm_head.kernel is not None and self.lm_head.bias is None)
        return self._on_host

    _on_host: bool | None = None

    def host(self, tokens: mx.array, batch: Batch, logit_rows: list[int]) -> mx.array | None:
        """The CPU forward in native memory: one hand-over from MLX (the embedded rows) and
        one back (the logits)."""
        lib = native.library()
        assert lib is not None and batch.native is not None
        for rope in self.ropes:
            rope.reserve(batch.max_pos)
        x = cpu_gemm.to_host(self.embed_tokens(batch.pad_tokens(tokens)))
        for layer in self.layers:
            x = layer.host(lib, x, batch)  # type: ignore[attr-defined]
        if not logit_rows:
            return None
        norm = self.norm
        assert isinstance(norm, RMSNorm) and self.lm_head.kernel is not None
        if self._final_norm is None:
            self._final_norm = cpu_gemm.to_host(norm.weight.astype(mx.float32))[0]
        rows = cpu_gemm.aligned_copy(x[logit_rows])
        normed_rows = cpu_gemm.rms_norm_host(lib, rows, self._final_norm, norm.eps)
        return mx.array(self.lm_head.kernel.host(normed_rows))

    _final_norm: np.ndarray | None = None
