"""Llama family (SmolLM2, Llama 2/3 with rope scaling, Mistral / Ministral).

Pre-norm blocks: h = x + attention(rms_norm(x)), then h + SwiGLU MLP(rms_norm(h)), with
rotate-half RoPE (Hugging Face's layout: llama.cpp stores the Q/K rows of its GGUF files
interleaved, which the reader undoes) and an lm_head of its own or tied to the embedding.
Projection biases when the config asks for them (`attention_bias`, `mlp_bias`); a sliding
window on the layers `layer_types` marks sliding (Ministral), or on every layer when only
`sliding_window` is set (Mistral).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx

from slotserve.model import decoder, layers
from slotserve.model.config import ModelConfig
from slotserve.model.family import Family
from slotserve.model.weights import Tensor

SLIDING = "sliding_attention"


@dataclass
class Config(ModelConfig):
    attention_bias: bool = False  # q/k/v/o biases
    mlp_bias: bool = False  # gate/up/down biases
    sliding_window: int | None = None
    layer_types: list[str] = field(default_factory=list)  # "sliding_attention" | "full_..."

    def window(self, layer: int) -> int | None:
        """The layer's sliding window (None: it attends to every earlier position)."""
        if not self.layer_types:
            return self.sliding_window
        return self.sliding_window if self.layer_types[layer] == SLIDING else None

    @classmethod
    def hf_fields(cls, cfg: dict[str, Any], num_layers: int) -> dict[str, Any]:
        return dict(attention_bias=bool(cfg.get("attention_bias", False)),
                    mlp_bias=bool(cfg.get("mlp_bias", False)),
                    sliding_window=cfg.get("sliding_window") or None,
                    layer_types=list(cfg.get("layer_types") or []))

    def hf_keys(self) -> dict[str, Any]:
        keys: dict[str, Any] = dict(attention_bias=self.attention_bias, mlp_bias=self.mlp_bias)
        if self.sliding_window is not None:
            keys.update(sliding_window=self.sliding_window, layer_types=self.layer_types)
        return keys


def rms_norm(w: dict[str, Tensor], name: str, cfg: ModelConfig, dtype: mx.Dtype) -> layers.RMSNorm:
    weight = w[f"{name}.weight"]
    assert isinstance(weight, mx.array), "norm weights are never quantized"
    return layers.RMSNorm(weight.astype(dtype), cfg.rms_norm_eps)


def biases(w: dict[str, Tensor], p: str, names: tuple[str, ...],
           present: bool) -> tuple[Tensor | None, ...]:
    """The `{p}.{name}.bias` tensors when the config gives these projections biases (a
    missing one is then a missing tensor, not a zero), else None for each."""
    return tuple(w[f"{p}.{n}.bias"] if present else None for n in names)


def attention_biases(cfg: ModelConfig, w: dict[str, Tensor], p: str) -> tuple[Tensor | None, ...]:
    """q/k/v/o biases of an `attention_bias` checkpoint (None each otherwise)."""
    return biases(w, p, ("q_proj", "k_proj", "v_proj", "o_proj"),
                  bool(getattr(cfg, "attention_bias", False)))


def window(cfg: ModelConfig, layer: int) -> int | None:
    """The layer's sliding window, for configs that have one (llama.Config and its kin)."""
    return cfg.window(layer) if isinstance(cfg, Config) else None


class Attention(layers.Attention):
    """q/k/v projections (fused; biases when the config has them), RoPE, grouped-query
    attention (within the layer's sliding window, if any), o projection."""

    def __init__(self, cfg: ModelConfig, w: dict[str, Tensor], p: str, layer: int,
                 rope: layers.Rope, dtype: mx.Dtype, quant: bool,
                 biases: tuple[Tensor | None, ...] | None = None, **extra: Any) -> None:
        """extra: what layers.Attention takes beyond llama's (Qwen3's head norms, gpt-oss's
        sinks); biases: the (q, k, v, o) biases when the family fixes them (Qwen2's)."""
        super().__init__(
            w[f"{p}.q_proj.weight"], w[f"{p}.k_proj.weight"], w[f"{p}.v_proj.weight"],
            w[f"{p}.o_proj.weight"], dtype, quant, layer=layer, heads=cfg.num_heads,
            kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim, scale=cfg.attn_scale, rope=rope,
            window=window(cfg, layer),
            biases=attention_biases(cfg, w, p) if biases is None else biases, **extra,
        )


class MLP(layers.GatedMLP):
    """down(silu(gate(x)) * up(x)) (with biases in an `mlp_bias` checkpoint)."""

    def __init__(self, w: dict[str, Tensor], p: str, dtype: mx.Dtype, quant: bool,
                 bias: bool = False) -> None:
        names = ("gate_proj", "up_proj", "down_proj")
        super().__init__(w[f"{p}.gate_proj.weight"], w[f"{p}.up_proj.weight"],
                         w[f"{p}.down_proj.weight"], layers.silu, dtype, quant,
                         biases=biases(w, p, names, bias))  # type: ignore[arg-type]


class Block(decoder.PreNormBlock):
    def __init__(self, cfg: ModelConfig, w: dict[str, Tensor], i: int, rope: layers.Rope,
                 dtype: mx.Dtype, quant: bool) -> None:
        p = f"model.layers.{i}"
        super().__init__(Attention(cfg, w, f"{p}.self_attn", i, rope, dtype, quant),
                         MLP(w, f"{p}.mlp", dtype, quant, getattr(cfg, "mlp_bias", False)),
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
    config=Config,
    model=Model,
    hf_architectures=("LlamaForCausalLM", "MistralForCausalLM", "MinistralForCausalLM"),
    hf_model_type="llama",
    gguf_architecture="llama",
    gguf_interleaved_qk=True,
)
