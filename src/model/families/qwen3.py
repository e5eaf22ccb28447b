"""Qwen3 dense family: Llama's block with an RMS norm on each query and key head.

Qwen3 normalizes each query/key head (weights of size head_dim) after the projection and
before RoPE; head_dim is set by the config and need not equal hidden_size / num_heads.
The fused QKV, SwiGLU MLP, residual layout and row-batch forward are llama's.
"""

from __future__ import annotations

import mlx.core as mx

import slotserve.model.families.llama as llama
from slotserve.model import decoder, layers
from slotserve.model.config import ModelConfig
from slotserve.model.family import Family
from slotserve.model.weights import Tensor

# llama.cpp's names of the head norms (its other names are every family's)
GGUF_HEAD_NORMS = {"attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}


class Attention(llama.Attention):
    """Llama attention with rms_norm over each q and k head (before RoPE)."""

    def __init__(self, cfg: ModelConfig, w: dict[str, Tensor], p: str, layer: int,
                 rope: layers.Rope, dtype: mx.Dtype, quant: bool) -> None:
        super().__init__(cfg, w, p, layer, rope, dtype, quant,
                         q_norm=llama.rms_norm(w, f"{p}.q_norm", cfg, dtype),
                         k_norm=llama.rms_norm(w, f"{p}.k_norm", cfg, dtype))


class Block(decoder.PreNormBlock):
    def __init__(self, cfg: ModelConfig, w: dict[str, Tensor], i: int, rope: layers.Rope,
                 dtype: mx.Dtype, quant: bool) -> None:
        p = f"model.layers.{i}"
        super().__init__(Attention(cfg, w, f"{p}.self_attn", i, rope, dtype, quant),
                         llama.MLP(w, f"{p}.mlp", dtype, quant),
                         llama.rms_norm(w, f"{p}.input_layernorm", cfg, dtype),
                         llama.rms_norm(w, f"{p}.post_attention_layernorm", cfg, dtype))


class Model(llama.Model):
    """Qwen3 over a row batch; see slotserve.model.decoder."""

    block_class = Block


FAMILY = Family(
    name="qwen3",
    config=ModelConfig,
    model=Model,
    hf_architectures=("Qwen3ForCausalLM",),
    hf_model_type="qwen3",
    gguf_architecture="qwen3",
    gguf_layer_names=GGUF_HEAD_NORMS,
)
