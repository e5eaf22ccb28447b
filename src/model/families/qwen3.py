"""Qwen3 dense family: Llama's block plus a per-head RMSNorm on queries and keys.

Qwen3 normalizes each query/key head (weights of size head_dim) after the
projection and before RoPE; head_dim is set by the config and need not equal
hidden_size / num_heads. Everything else (fused QKV, SwiGLU MLP, residual
layout, row-batch forward) is inherited from the llama family.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from slotserve.model.config import ModelConfig
from slotserve.model.families import llama
from slotserve.model.layers import rms_norm
from slotserve.model.weights import Tensor


class Attention(llama.Attention):
    native_block = False  # q/k norms sit between the projection and RoPE

    def __init__(self, cfg: ModelConfig, w: dict[str, Tensor], p: str, dtype: mx.Dtype,
                 quant: bool) -> None:
        super().__init__(cfg, w, p, dtype, quant)
        self.q_norm = w[f"{p}.q_norm.weight"].astype(dtype)
        self.k_norm = w[f"{p}.k_norm.weight"].astype(dtype)
        self.eps = cfg.rms_norm_eps

    def split_heads(self, x: mx.array) -> tuple[mx.array, mx.array, mx.array]:
        # rms_norm works on the last axis, i.e. per head, as Qwen3 defines it.
        q, k, v = super().split_heads(x)
        return rms_norm(q, self.q_norm, self.eps), rms_norm(k, self.k_norm, self.eps), v


class Block(llama.Block):
    """Llama's pre-norm residual block with Qwen3 attention; `make_mlp` picks the MLP."""

    def __init__(self, cfg: ModelConfig, w: dict[str, Tensor], i: int, dtype: mx.Dtype,
                 quant: bool) -> None:
        p = f"model.layers.{i}"
        self.attn = Attention(cfg, w, f"{p}.self_attn", dtype, quant)
        self.mlp = self.make_mlp(cfg, w, i, f"{p}.mlp", dtype, quant)
        self.in_norm = w[f"{p}.input_layernorm.weight"].astype(dtype)
        self.post_norm = w[f"{p}.post_attention_layernorm.weight"].astype(dtype)
        self.eps = cfg.rms_norm_eps

    def make_mlp(self, cfg: ModelConfig, w: dict[str, Tensor], i: int, p: str,
                 dtype: mx.Dtype, quant: bool) -> Any:
        return llama.MLP(w, p, dtype, quant)


class Model(llama.Model):
    """Qwen3 decoder over a row batch; see slotserve.model.layers."""

    block_class = Block
