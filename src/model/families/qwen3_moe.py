"""Qwen3-MoE family: Qwen3 attention with a sparse mixture-of-experts MLP.

The router scores all experts (softmax in float32), keeps the top k per row and, when the
config says so, renormalizes those k weights to sum to one; the row's output is the
weighted sum of its k experts' SwiGLU outputs (moe.SparseMoE). Layers that are not
sparse (`mlp_only_layers`, `decoder_sparse_step`) keep a dense MLP.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx

import slotserve.model.families.llama as llama
import slotserve.model.families.qwen3 as qwen3
from slotserve.kernels.quantized import Mxfp4Weight
from slotserve.model import decoder, layers, moe
from slotserve.model.config import ModelConfig
from slotserve.model.errors import UnsupportedModelError
from slotserve.model.family import Family
from slotserve.model.weights import QuantizedWeight, Tensor

PROJECTIONS = ("gate_proj", "up_proj", "down_proj")


@dataclass
class Config(ModelConfig):
    num_experts: int = 0
    experts_per_token: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True
    decoder_sparse_step: int = 1  # layer i is sparse when (i+1) % step == 0
    mlp_only_layers: list[int] = field(default_factory=list)  # dense layers

    def is_sparse(self, layer: int) -> bool:
        """Which layers carry experts, by the rule of HF's Qwen3MoeDecoderLayer."""
        return (layer not in self.mlp_only_layers and self.num_experts > 0
                and (layer + 1) % max(self.decoder_sparse_step, 1) == 0)

    @classmethod
    def hf_fields(cls, cfg: dict[str, Any], num_layers: int) -> dict[str, Any]:
        return dict(
            num_experts=cfg.get("num_experts") or cfg.get("num_local_experts", 0),
            experts_per_token=cfg.get("num_experts_per_tok", 0),
            moe_intermediate_size=cfg.get("moe_intermediate_size", 0),
            norm_topk_prob=bool(cfg.get("norm_topk_prob", True)),
            decoder_sparse_step=int(cfg.get("decoder_sparse_step") or 1),
            mlp_only_layers=list(cfg.get("mlp_only_layers") or []),
        )

    @classmethod
    def gguf_fields(cls, get: Callable[..., Any], common: dict[str, Any]) -> dict[str, Any]:
        return dict(num_experts=int(get("expert_count", 0)),
                    experts_per_token=int(get("expert_used_count", 0)),
                    moe_intermediate_size=int(get("expert_feed_forward_length", 0)))

    def hf_keys(self) -> dict[str, Any]:
        return dict(num_experts=self.num_experts, num_experts_per_tok=self.experts_per_token,
                    moe_intermediate_size=self.moe_intermediate_size,
                    norm_topk_prob=self.norm_topk_prob,
                    decoder_sparse_step=self.decoder_sparse_step,
                    mlp_only_layers=self.mlp_only_layers)


def _concat_out(a: Tensor, b: Tensor) -> Tensor:
    """Stack two [E, out, in] expert tensors along `out` (gate then up)."""
    if isinstance(a, Mxfp4Weight) and isinstance(b, Mxfp4Weight):  # GGUF MXFP4_MOE experts
        return Mxfp4Weight(mx.concatenate([a.weight, b.weight], axis=1),  # type: ignore[return-value]
                           mx.concatenate([a.scales, b.scales], axis=1))
    if isinstance(a, QuantizedWeight) and isinstance(b, QuantizedWeight) and (
        (a.bits, a.group_size) == (b.bits, b.group_size)
    ):
        return QuantizedWeight(
            mx.concatenate([a.weight, b.weight], axis=1),
            mx.concatenate([a.scales, b.scales], axis=1),
            mx.concatenate([a.biases, b.biases], axis=1),
            a.group_size,
            a.bits,
        )
    parts = [t.dequantize(mx.float32) if isinstance(t, QuantizedWeight) else t for t in (a, b)]
    return mx.concatenate(parts, axis=1)


def expert_weights(w: dict[str, Tensor], p: str) -> tuple[Tensor, Tensor]:
    """(gate_up [E, 2I, H], down [E, H, I]) from any of the stored expert layouts.

    Accepts stacked per-projection tensors (`stack_experts`, GGUF, mlx-lm's
    `switch_mlp`) and transformers 5's fused `experts.gate_up_proj`/`down_proj`.
    """
    fused = w.get(f"{p}.experts.gate_up_proj")
    if fused is not None:
        return fused, w[f"{p}.experts.down_proj"]
    group = "switch_mlp" if f"{p}.switch_mlp.gate_proj.weight" in w else "experts"
    gate, up = w[f"{p}.{group}.gate_proj.weight"], w[f"{p}.{group}.up_proj.weight"]
    return _concat_out(gate, up), w[f"{p}.{group}.down_proj.weight"]


def stack_experts(weights: dict[str, Tensor], cfg: ModelConfig) -> None:
    """Turn HF per-expert tensors into one [E, out, in] tensor per layer and projection
    (of any config with `num_experts`: Qwen3.5-MoE's experts are stored alike)."""
    experts = getattr(cfg, "num_experts", 0)
    if not experts:
        return
    for i in range(cfg.num_layers):
        for proj in PROJECTIONS:
            stacked = f"model.layers.{i}.mlp.experts.{proj}.weight"
            if stacked in weights:
                continue
            keys = [f"model.layers.{i}.mlp.experts.{e}.{proj}.weight"
                    for e in range(experts)]
            if all(k in weights for k in keys):
                parts = [weights.pop(k) for k in keys]
                if any(isinstance(p, QuantizedWeight) for p in parts):
                    raise UnsupportedModelError("per-expert quantized tensors are unsupported")
                weights[stacked] = mx.stack(parts)  # type: ignore[arg-type]


def unstack_experts(tensors: dict[str, Any]) -> dict[str, Any]:
    """Stacked [E, out, in] expert tensors back to HF's one tensor per expert (export)."""
    out: dict[str, Any] = {}
    for name, t in tensors.items():
        if ".mlp.experts." in name and t.ndim == 3:
            layer, proj = name.split(".mlp.experts.")
            for e in range(t.shape[0]):
                out[f"{layer}.mlp.experts.{e}.{proj}"] = t[e]
        else:
            out[name] = t
    return out


class Block(decoder.PreNormBlock):
    """Qwen3's block; its MLP is the experts on sparse layers, llama's MLP on the others."""

    def __init__(self, cfg: Config, w: dict[str, Tensor], i: int, rope: layers.Rope,
                 dtype: mx.Dtype, quant: bool) -> None:
        p = f"model.layers.{i}"
        attn = qwen3.Attention(cfg, w, f"{p}.self_attn", i, rope, dtype, quant)
        mlp: decoder.FeedForward
        if cfg.is_sparse(i):
            gate_up, down = expert_weights(w, f"{p}.mlp")
            mlp = moe.SparseMoE(w[f"{p}.mlp.gate.weight"], gate_up, down,
                                   inter=cfg.moe_intermediate_size, top_k=cfg.experts_per_token,
                                   norm_topk=cfg.norm_topk_prob, dtype=dtype,
                                   keep_quantized=quant)
        else:
            mlp = llama.MLP(w, f"{p}.mlp", dtype, quant)
        super().__init__(attn, mlp, llama.rms_norm(w, f"{p}.input_layernorm", cfg, dtype),
                         llama.rms_norm(w, f"{p}.post_attention_layernorm", cfg, dtype))


class Model(llama.Model):
    """Qwen3-MoE over a row batch; see slotserve.model.decoder."""

    block_class = Block


FAMILY = Family(
    name="qwen3_moe",
    config=Config,
    model=Model,
    hf_architectures=("Qwen3MoeForCausalLM",),
    hf_model_type="qwen3_moe",
    gguf_architecture="qwen3moe",
    gguf_layer_names={
        **qwen3.GGUF_HEAD_NORMS,
        "ffn_gate_inp": "mlp.gate",
        "ffn_gate_exps": "mlp.experts.gate_proj",
        "ffn_up_exps": "mlp.experts.up_proj",
        "ffn_down_exps": "mlp.experts.down_proj",
    },
    sanitize=stack_experts,
    hf_tensors=unstack_experts,
)
