"""Qwen3.5 / Qwen3.6 MoE family (e.g. 35B-A3B): the hybrid layers of qwen3_5 with a sparse
mixture of experts plus a gated shared expert as every layer's MLP.

Following transformers' Qwen3_5MoeSparseMoeBlock: a softmax router (float32) keeps the top
k experts per row and renormalizes their weights to sum to one; the row's output is their
weighted SwiGLU outputs (slotserve.model.moe.SparseMoE: experts grouped across all rows of
the step) plus sigmoid(shared_expert_gate(x)) * shared_expert(x).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx

import slotserve.model.families.qwen3_5 as qwen3_5
from slotserve.model import layers, moe
from slotserve.model.config import ModelConfig
from slotserve.model.families.qwen3_moe import expert_weights, stack_experts
from slotserve.model.family import Family
from slotserve.model.weights import Tensor


@dataclass
class Config(qwen3_5.Config):
    num_experts: int = 0
    experts_per_token: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    norm_topk_prob: bool = True
    decoder_sparse_step: int = 1  # layer i is sparse when (i+1) % step == 0
    mlp_only_layers: list[int] = field(default_factory=list)  # dense layers

    def is_sparse(self, layer: int) -> bool:
        """transformers' rule (Qwen3NextDecoderLayer; Qwen3.5-MoE has no dense layers)."""
        return (layer not in self.mlp_only_layers and self.num_experts > 0
                and (layer + 1) % max(self.decoder_sparse_step, 1) == 0)

    @classmethod
    def hf_fields(cls, cfg: dict[str, Any], num_layers: int) -> dict[str, Any]:
        return dict(
            **super().hf_fields(cfg, num_layers),
            num_experts=int(cfg["num_experts"]),
            experts_per_token=int(cfg["num_experts_per_tok"]),
            moe_intermediate_size=int(cfg["moe_intermediate_size"]),
            shared_expert_intermediate_size=int(cfg.get("shared_expert_intermediate_size", 0)),
            norm_topk_prob=bool(cfg.get("norm_topk_prob", True)),
            decoder_sparse_step=int(cfg.get("decoder_sparse_step") or 1),
            mlp_only_layers=list(cfg.get("mlp_only_layers") or []),
        )

    @classmethod
    def gguf_fields(cls, get: Callable[..., Any], common: dict[str, Any]) -> dict[str, Any]:
        return dict(
            **super().gguf_fields(get, common),
            num_experts=int(get("expert_count", 0)),
            experts_per_token=int(get("expert_used_count", 0)),
            moe_intermediate_size=int(get("expert_feed_forward_length", 0)),
            shared_expert_intermediate_size=int(get("expert_shared_feed_forward_length", 0)),
        )

    def hf_keys(self) -> dict[str, Any]:
        return dict(**super().hf_keys(), num_experts=self.num_experts,
                    num_experts_per_tok=self.experts_per_token,
                    moe_intermediate_size=self.moe_intermediate_size,
                    shared_expert_intermediate_size=self.shared_expert_intermediate_size)


class SharedExpertMoE(layers.Layer):
    """Routed experts plus a shared SwiGLU expert scaled by a sigmoid gate of its own."""

    def __init__(self, cfg: Config, w: dict[str, Tensor], p: str, dtype: mx.Dtype,
                 quant: bool) -> None:
        gate_up, down = expert_weights(w, p)
        self.experts = moe.SparseMoE(
            w[f"{p}.gate.weight"], gate_up, down, inter=cfg.moe_intermediate_size,
            top_k=cfg.experts_per_token, norm_topk=cfg.norm_topk_prob, dtype=dtype,
            keep_quantized=quant)
        self.shared = qwen3_5.dense_mlp(w, f"{p}.shared_expert", dtype, quant)
        self.shared_gate = layers.Linear(w[f"{p}.shared_expert_gate.weight"], dtype, quant)

    def parts(self) -> list[layers.Layer]:
        return [self.experts, self.shared, self.shared_gate]

    def __call__(self, x: mx.array, residual: mx.array | None = None,
                 norm: layers.Norm | None = None, rows: int | None = None) -> mx.array:
        x = layers.normed(x, norm)
        shared = mx.sigmoid(self.shared_gate(x)) * self.shared(x)
        return layers.plus(self.experts(x, rows=rows) + shared, residual)


def block(cfg: Config, w: dict[str, Tensor], i: int, rope: layers.Rope, dtype: mx.Dtype,
          quant: bool) -> qwen3_5.Block:
    p = f"model.layers.{i}"
    mlp: layers.Layer = (SharedExpertMoE(cfg, w, f"{p}.mlp", dtype, quant) if cfg.is_sparse(i)
                         else qwen3_5.dense_mlp(w, f"{p}.mlp", dtype, quant))
    return qwen3_5.Block(qwen3_5.mixer(cfg, w, i, rope, dtype, quant), mlp,  # type: ignore[arg-type]
                         qwen3_5.zero_centered_norm(w, f"{p}.input_layernorm", cfg, dtype),
                         qwen3_5.zero_centered_norm(w, f"{p}.post_attention_layernorm", cfg,
                                                    dtype))


def sanitize(weights: dict[str, Tensor], cfg: ModelConfig) -> None:
    """The text decoder's tensors, each layer's experts stacked (qwen3_moe.stack_experts)."""
    qwen3_5.drop_unused(weights, cfg)
    stack_experts(weights, cfg)


class Model(qwen3_5.Model):
    """The hybrid decoder with MoE MLPs; see qwen3_5.Model."""

    block = staticmethod(block)  # type: ignore[assignment]


# llama.cpp's names: qwen3_5's, the experts as 3-D tensors [experts, out, in], the shared
# expert and its gate
GGUF_LAYER_NAMES = {
    **qwen3_5.GGUF_LAYER_NAMES,
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_exps": "mlp.experts.gate_proj",
    "ffn_up_exps": "mlp.experts.up_proj",
    "ffn_down_exps": "mlp.experts.down_proj",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
}

FAMILY = Family(
    name="qwen3_5_moe",
    config=Config,
    model=Model,
    hf_architectures=("Qwen3_5MoeForCausalLM", "Qwen3_5MoeForConditionalGeneration"),
    hf_model_type="qwen3_5_moe",
    gguf_architecture="qwen35moe",
    gguf_layer_names=GGUF_LAYER_NAMES,
    gguf_norm_offset=1.0,
    sanitize=sanitize,
)
