"""Llama family (SmolLM2, Llama 2/3 with rope scaling, Mistral-style dense models)."""

from __future__ import annotations

import ctypes

import mlx.core as mx
import numpy as np

from slotserve.kernels import cpu_attention, cpu_gemm, cuda, native
from slotserve.model.config import ModelConfig
from slotserve.model.kv import KVPool, SlotKV
from slotserve.model.layers import (
    Batch,
    Embedding,
    Linear,
    RMSNorm,
    Rope,
    attend,
    kernel_norm,
    normed,
    pad_rows,
    plus,
)
from slotserve.model.weights import Tensor


class Attention:
    # On the GPU, rotates q/k, writes K/V and attends in one or two CUDA kernels
    # (cuda.rope_attention); subclasses that change q/k between projection and RoPE (Qwen3's
    # norms) opt out. On the CPU the whole block runs in native/block.c (Block.host).
    native_block = True
    # per-head RMS norms of q and k before RoPE (Qwen3 sets them); block.c applies them
    q_norm: mx.array | None = None
    k_norm: mx.array | None = None

    def __init__(self, cfg: ModelConfig, w: dict[str, Tensor], p: str, dtype: mx.Dtype,
                 quant: bool) -> None:
        self.heads, self.kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.qkv = Linear.fused(
            [w[f"{p}.q_proj.weight"], w[f"{p}.k_proj.weight"], w[f"{p}.v_proj.weight"]],
            dtype, quant,
        )
        self.o = Linear(w[f"{p}.o_proj.weight"], dtype, quant)
        self.scale = cfg.attn_scale

    def split_heads(self, x: mx.array) -> tuple[mx.array, mx.array, mx.array]:
        r = x.shape[0]
        nq, nk = self.heads * self.head_dim, self.kv_heads * self.head_dim
        qkv = self.qkv(x)
        q = qkv[:, :nq].reshape(r, self.heads, self.head_dim)
        k = qkv[:, nq : nq + nk].reshape(r, self.kv_heads, self.head_dim)
        v = qkv[:, nq + nk :].reshape(r, self.kv_heads, self.head_dim)
        return q, k, v

    def __call__(self, x: mx.array, batch: Batch, layer: int, cos: mx.array,
                 sin: mx.array, rope: Rope | None = None,
                 residual: mx.array | None = None, norm: RMSNorm | None = None) -> mx.array:
        """The attention output for norm(x) (x when no norm is given), plus `residual` when
        given (the block's residual stream: the CUDA path normalizes in the QKV projection's
        launch and adds it in the output projection's)."""
        if self.native_block and batch.cuda is not None and rope is not None:
            pool = batch.pool
            assert pool is not None and batch.write_rows is not None
            out = cuda.rope_attention(self.qkv(x, norm=norm), rope.cos, rope.sin, batch.write_rows,
                                      pool.keys[layer], pool.values[layer], *batch.cuda,
                                      self.scale, self.heads, self.kv_heads, self.head_dim,
                                      batch.one_row_per_slot)
            batch.effects.append(out)  # its K/V writes must run even if no logits are asked
            return self.o(out, residual)
        q, k, v = self.split_heads(normed(x, norm))
        q, k = Rope.apply(q, cos, sin), Rope.apply(k, cos, sin)
        out = attend(q, k, v, batch, layer, self.scale)
        return self.o(out.reshape(out.shape[0], -1), residual)


class MLP:
    def __init__(self, w: dict[str, Tensor], p: str, dtype: mx.Dtype, quant: bool) -> None:
        gate = w[f"{p}.gate_proj.weight"]
        self.inter = gate.shape[0]
        self.gate_up = Linear.fused([gate, w[f"{p}.up_proj.weight"]], dtype, quant, pack=False)
        # on the CUDA 4-bit kernel, gate and up rows in tile pairs: silu(gate) * up comes out
        # of the matmul's own launch
        self.paired = self.gate_up.packable() and self.inter % 8 == 0
        if self.paired:
            assert self.gate_up.q is not None
            self.gate_up.q = self.gate_up.q.take_rows(cuda.paired_rows(self.inter))
        self.gate_up.pack_for_gpu()
        self.down = Linear(w[f"{p}.down_proj.weight"], dtype, quant)
        self.cuda = cuda.enabled()  # the model is built on the device it will run on

    def __call__(self, x: mx.array, residual: mx.array | None = None,
                 norm: RMSNorm | None = None) -> mx.array:
        """The MLP's output for norm(x) (x when no norm is given), plus `residual` when given
        (on the GPU the norm runs in the gate+up launch, the add in the down projection's)."""
        lib = native.library()
        if lib is not None and self.gate_up.kernel is not None and self.down.kernel is not None:
            x = normed(x, norm)
            return plus(cpu_gemm.swiglu_mlp(lib, self.gate_up.kernel, self.down.kernel, x),
                        residual)
        if self.paired:
            assert self.gate_up.q4 is not None
            return self.down(cuda.q4_matmul(x, *self.gate_up.q4, gate_up=True,
                                            norm=kernel_norm(norm)), residual)
        gu = self.gate_up(x, norm=norm)
        if self.cuda:
            return self.down(cuda.swiglu(gu), residual)
        g, u = gu[:, : self.inter], gu[:, self.inter :]
        return self.down(g * mx.sigmoid(g) * u, residual)


class Block:
    def __init__(self, cfg: ModelConfig, w: dict[str, Tensor], i: int, dtype: mx.Dtype,
                 quant: bool) -> None:
        p = f"model.layers.{i}"
        self.attn = Attention(cfg, w, f"{p}.self_attn", dtype, quant)
        self.mlp = MLP(w, f"{p}.mlp", dtype, quant)
        self.in_norm = w[f"{p}.input_layernorm.weight"].astype(dtype)
        self.post_norm = w[f"{p}.post_attention_layernorm.weight"].astype(dtype)
        self.eps = cfg.rms_norm_eps

    def __call__(self, x: mx.array, batch: Batch, layer: int, cos: mx.array,
                 sin: mx.array, rope: Rope | None = None) -> mx.array:
        h = self.attn(x, batch, layer, cos, sin, rope, residual=x,
                      norm=RMSNorm(self.in_norm, self.eps))
        return self.mlp(h, residual=h, norm=RMSNorm(self.post_norm, self.eps))

    def runs_on_host(self) -> bool:
        """Every part of this block has a native CPU kernel (Model.host can run it)."""
        a, m = self.attn, self.mlp
        heads_ok = a.q_norm is None or (a.head_dim % 16 == 0 and a.k_norm is not None)
        return (type(self).__call__ is Block.__call__ and type(m) is MLP
                and (a.native_block or a.q_norm is not None) and heads_ok
                and self.in_norm.shape[0] % 16 == 0 and self._matrices() is not None)

    def _matrices(self) -> tuple[cpu_gemm.SlotMatrix, ...] | None:
        """QKV, O, gate+up, down as native/block.c takes them (None: one lacks a kernel)."""
        if getattr(self, "_mats", False) is False:
            kernels = (self.attn.qkv.kernel, self.attn.o.kernel, self.mlp.gate_up.kernel,
                       self.mlp.down.kernel)
            mats = [k.descriptor() if k is not None else None for k in kernels]
            self._mats = None if None in mats else tuple(mats)  # type: ignore[arg-type]
            norms = (self.in_norm, self.post_norm, self.attn.q_norm, self.attn.k_norm)
            self._norms = tuple(None if n is None else cpu_gemm.to_host(n.astype(mx.float32))[0]
                                for n in norms)
        return self._mats

    def host(self, lib: ctypes.CDLL, x: np.ndarray, batch: Batch, layer: int,
             rope: Rope) -> np.ndarray:
        """The block on host rows x (updated in place), in one native call (block.c): the
        residual stream never goes back to MLX."""
        mats, (n0, n1, qn, kn), a = self._matrices(), self._norms, self.attn
        pool, rows = batch.pool, batch.native
        assert mats is not None and pool is not None and rows is not None
        assert rows.write_rows is not None
        k_host, v_host = cpu_attention.pool_host(pool.keys[layer], pool.values[layer])
        tables = rope.host_tables()
        rc = lib.slot_llama_block(
            x.ctypes.data, x.shape[0], x.shape[1], n0.ctypes.data, n1.ctypes.data,
            ctypes.c_float(self.eps), None if qn is None else qn.ctypes.data,
            None if kn is None else kn.ctypes.data, *(ctypes.addressof(m) for m in mats), a.heads,
            a.kv_heads, a.head_dim, tables.cos.ctypes.data, tables.sin.ctypes.data,
            k_host.ctypes.data, v_host.ctypes.data, rows.write_rows.ctypes.data,
            rows.write_rows.shape[0], rows.tables.ctypes.data, rows.tables.shape[1],
            rows.row_table.ctypes.data, rows.row_pos.ctypes.data,
            ctypes.c_float(a.scale * cpu_attention.LOG2E), 0)
        if rc != 0:
            raise RuntimeError(f"slot_llama_block failed (code {rc})")
        return x


class Model:
    """Decoder-only transformer over a row batch; see slotserve.model.layers."""

    block_class = Block
    kv_pool: KVPool | None = None  # created on the first new_kv()

    def __init__(self, cfg: ModelConfig, w: dict[str, Tensor], dtype: mx.Dtype,
                 quant: bool) -> None:
        self.config, self.dtype = cfg, dtype
        self.embed = Embedding(w["model.embed_tokens.weight"], dtype, quant)
        self.layers = [self.block_class(cfg, w, i, dtype, quant) for i in range(cfg.num_layers)]
        self.norm = w["model.norm.weight"].astype(dtype)
        head = w.get("lm_head.weight")
        self.lm_head = self.embed.as_linear() if head is None else Linear(head, dtype, quant)
        self.rope = Rope(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling, dtype)

    def new_kv(self) -> SlotKV:
        """A slot's KV, backed by this model's shared page pool."""
        if self.kv_pool is None:
            c = self.config
            self.kv_pool = KVPool(c.num_layers, c.num_kv_heads, c.head_dim, self.dtype)
        return SlotKV(self.kv_pool)

    def embed_tokens(self, tokens: mx.array) -> mx.array:
        return self.embed(tokens)

    def __call__(self, tokens: mx.array, batch: Batch, logit_rows: list[int]) -> mx.array | None:
        """Run R token rows; return float32 logits for the rows in logit_rows (None if empty).

        Rows not in logit_rows still write their K/V into their slots.
        """
        lib = native.library()
        if lib is not None and batch.native is not None and self.runs_on_host():
            return self.host(lib, tokens, batch, logit_rows)
        max_pos = max(s.start + s.length for s in batch.segments)
        cos, sin = self.rope.tables(batch.positions, max_pos)
        x = self.embed_tokens(batch.pad_tokens(tokens))
        for i, layer in enumerate(self.layers):
            x = layer(x, batch, i, cos, sin, self.rope)
        if not logit_rows:
            return None
        x = x[mx.array(logit_rows, dtype=mx.int32)]
        norm = RMSNorm(self.norm, self.config.rms_norm_eps)
        return self.lm_head(pad_rows(x), norm=norm)[: len(logit_rows)].astype(mx.float32)

    def runs_on_host(self) -> bool:
        """The whole forward has native CPU kernels (decided once: kernels are fixed at load)."""
        if self._on_host is None:
            self._on_host = (all(b.runs_on_host() for b in self.layers)
                             and self.lm_head.kernel is not None)
        return self._on_host

    _on_host: bool | None = None

    def host(self, lib: ctypes.CDLL, tokens: mx.array, batch: Batch,
             logit_rows: list[int]) -> mx.array | None:
        """The CPU forward in native memory: one hand-over from MLX (the embedded rows) and
        one back (the logits), instead of four per layer."""
        self.rope.reserve(max(s.start + s.length for s in batch.segments))
        x = cpu_gemm.to_host(self.embed_tokens(batch.pad_tokens(tokens)))
        for i, layer in enumerate(self.layers):
            x = layer.host(lib, x, batch, i, self.rope)
        if not logit_rows:
            return None
        if self._final_norm is None:
            self._final_norm = cpu_gemm.to_host(self.norm.astype(mx.float32))[0]
        rows = cpu_gemm.aligned_copy(x[logit_rows])
        assert self.lm_head.kernel is not None
        normed_rows = cpu_gemm.rms_norm_host(lib, rows, self._final_norm,
                                             self.config.rms_norm_eps)
        return mx.array(self.lm_head.kernel.host(normed_rows))

    _final_norm: np.ndarray | None = None
