"""Llama family (SmolLM2, Llama 2/3 with rope scaling, Mistral-style dense models).

Pre-norm blocks: h = x + attention(rms_norm(x)), then h + SwiGLU MLP(rms_norm(h)), with
rotate-half RoPE (Hugging Face's layout: llama.cpp stores the Q/K rows of its GGUF files
interleaved, which the reader undoes) and an lm_head of its own or tied to the embedding.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import mlx.core as mx

from slotserve.model import decoder, layers
from slotserve.model.config import ModelConfig
from slotserve.model.family import Family
from slotserve.model.weights import Tensor


def rms_norm(w: dict[str, Tensor], name: str, cfg: ModelConfig, dtype: mx.Dtype) -> layers.RMSNorm:
    weight = w[f"{name}.weight"]
    assert isinstance(weight, mx.array), "norm weights are never quantized"
    return layers.RMSNorm(weight.astype(dtype), cfg.rms_norm_eps)


class Attention(layers.Attention):
    """q/k/v projections (fused, no bias), RoPE, grouped-query attention, o projection."""

    def __init__(self, cfg: ModelConfig, w: dict[str, Tensor], p: str, layer: int,
                 rope: layers.Rope, dtype: mx.Dtype, quant: bool, **head_norms: Any) -> None:
        super().__init__(
            w[f"{p}.q_proj.weight"], w[f"{p}.k_proj.weight"], w[f"{p}.v_proj.weight"],
            w[f"{p}.o_proj.weight"], dtype, quant, layer=layer, heads=cfg.num_heads,
            kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim, scale=cfg.attn_scale, rope=rope,
            **head_norms,
        )


class MLP(layers.GatedMLP):
    """down(silu(gate(x)) * up(x))."""

    def __init__(self, w: dict[str, Tensor], p: str, dtype: mx.Dtype, quant: bool) -> None:
        super().__init__(w[f"{p}.gate_proj.weight"], w[f"{p}.up_proj.weight"],
                         w[f"{p}.down_proj.weight"], layers.silu, dtype, quant)


class Block(decoder.PreNormBlock):
    def __init__(self, cfg: ModelConfig, w: dict[str, Tensor], i: int, rope: layers.Rope,
                 dtype: mx.Dtype, quant: bool) -> None:
        p = f"model.layers.{i}"
        super().__init__(Attention(cfg, w, f"{p}.self_attn", i, rope, dtype, quant),
                         MLP(w, f"{p}.mlp", dtype, quant),
                         rms_norm(w, f"{p}.input_layernorm", cfg, dtype),
                         rms_norm(w, f"{p}.post_attention_layernorm", cfg, dtype))


class Model(decoder.Decoder):
    """Llama over a row batch; see slotserve.model.decoder."""

    block_class: Callable[..., decoder.PreNormBlock] = Block

    def __init__(self, cfg: ModelConfig, w: dict[str, Tensor], dtype: mx.Dtype,
                 quant: bool) -> None:
        self.rope = layers.Rope(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling, dtype)
        embed = layers.Embedding(w["model.embed_tokens.weight"], dtype, quant)
        blocks = [self.block_class(cfg, w, i, self.rope, dtype, quant)
                  for i in range(cfg.num_layers)]
        head = w.get("lm_head.weight")
        lm_head = embed.as_linear() if head is None else layers.Linear(head, dtype, quant)
        super().__init__(cfg, dtype, embed, blocks, rms_norm(w, "model.norm", cfg, dtype),
                         lm_head, [self.rope])


FAMILY = Family(
    name="llama",
    config=ModelConfig,
    model=Model,
    hf_architectures=("LlamaForCausalLM", "MistralForCausalLM"),
    hf_model_type="llama",
    gguf_architecture="llama",
    gguf_interleaved_qk=True,
)
