"""gpt-oss family (GptOssForCausalLM), numerically following transformers' implementation.

What differs from llama: every attention projection has a bias and each head an attention
sink (one more logit in its softmax that weights no value); sliding-window layers (window
128) alternate with full ones (`layer_types`); YaRN RoPE with its attention factor on
cos/sin; every MLP is a mixture of experts whose router has a bias, whose top-k weights are
a softmax over the chosen experts' logits (the full softmax renormalized over them, as
moe.SparseMoE computes it), and whose experts have biases and a clamped GLU:
(clip(up, -limit, limit) + 1) * g * sigmoid(alpha * g) with g = min(gate, limit).

transformers stores float experts as [E, in, out] with gate and up columns interleaved;
they are brought to moe.SparseMoE's [E, out, in] with gate rows before up rows here. The
released checkpoints keep the experts in MXFP4 (`*_blocks` [E, out, in / 32, 16] bytes and
`*_scales`, rows interleaved alike), which are MLX's own `mxfp4` codes: kept so on every
device (gather_qmm, mode mxfp4).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import mlx.core as mx

import slotserve.model.families.llama as llama
from slotserve.kernels.quantized import Mxfp4Weight
from slotserve.model import decoder, layers, moe
from slotserve.model.errors import UnsupportedModelError
from slotserve.model.family import Family
from slotserve.model.weights import Tensor


@dataclass
class Config(llama.Config):
    num_experts: int = 0
    experts_per_token: int = 0
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0

    @classmethod
    def hf_fields(cls, cfg: dict[str, Any], num_layers: int) -> dict[str, Any]:
        return dict(super().hf_fields(cfg, num_layers),
                    attention_bias=bool(cfg.get("attention_bias", True)),
                    num_experts=int(cfg["num_local_experts"]),
                    experts_per_token=int(cfg["num_experts_per_tok"]),
                    swiglu_alpha=float(cfg.get("swiglu_alpha", 1.702)),
                    swiglu_limit=float(cfg.get("swiglu_limit", 7.0)))

    @classmethod
    def gguf_fields(cls, get: Callable[..., Any], common: dict[str, Any]) -> dict[str, Any]:
        """Refused: the GGUF reader does not take gpt-oss's sinks, YaRN keys and MXFP4
        experts yet (a file read without them would answer wrong)."""
        raise UnsupportedModelError(
            "gpt-oss GGUF files are not supported yet; supported for gpt-oss: Hugging Face "
            "directories with float (bf16/f32) weights")


def clamped_glu(alpha: float, limit: float) -> moe.Glu:
    """gpt-oss's expert activation of the (gate, up) rows."""

    def glu(gate: mx.array, up: mx.array) -> mx.array:
        gate = mx.minimum(gate, limit)
        up = mx.clip(up, -limit, limit)
        return (up + 1) * (gate * mx.sigmoid(gate * alpha))

    return glu


def deinterleave(t: mx.array | Mxfp4Weight, axis: int) -> mx.array | Mxfp4Weight:
    """gpt-oss's interleaved gate/up outputs (gate at even indices) as gate, then up."""
    n = t.weight.shape[axis] if isinstance(t, Mxfp4Weight) else t.shape[axis]
    order = mx.concatenate([mx.arange(0, n, 2), mx.arange(1, n, 2)])
    return t.take(order, axis) if isinstance(t, Mxfp4Weight) else mx.take(t, order, axis=axis)


def expert_matrix(w: dict[str, Tensor], name: str) -> mx.array | Mxfp4Weight:
    """An expert projection as [E, out, in]: MXFP4 blocks as they are, float [E, in, out]
    transposed."""
    if f"{name}_blocks" in w:
        blocks, scales = w[f"{name}_blocks"], w[f"{name}_scales"]
        assert isinstance(blocks, mx.array) and isinstance(scales, mx.array)
        return Mxfp4Weight.from_blocks(blocks, scales)
    dense = w[name]
    assert isinstance(dense, mx.array), "float or MXFP4 experts"
    return dense.swapaxes(1, 2)


class Experts(moe.SparseMoE):
    """The router (with bias) and the experts (with biases, clamped GLU) of one layer."""

    def __init__(self, cfg: Config, w: dict[str, Tensor], p: str, dtype: mx.Dtype,
                 quant: bool) -> None:
        e = f"{p}.experts"
        gate_up_bias = w[f"{e}.gate_up_proj_bias"]
        assert isinstance(gate_up_bias, mx.array), "biases are never quantized"
        super().__init__(
            w[f"{p}.router.weight"],
            deinterleave(expert_matrix(w, f"{e}.gate_up_proj"), axis=1),  # type: ignore[arg-type]
            expert_matrix(w, f"{e}.down_proj"),  # type: ignore[arg-type]
            inter=cfg.intermediate_size, top_k=cfg.experts_per_token, norm_topk=True,
            dtype=dtype, keep_quantized=quant,
            glu=clamped_glu(cfg.swiglu_alpha, cfg.swiglu_limit),
            biases=(w[f"{p}.router.bias"], deinterleave(gate_up_bias, axis=1),  # type: ignore[arg-type]
                    w[f"{e}.down_proj_bias"]),
        )


class Block(decoder.PreNormBlock):
    def __init__(self, cfg: Config, w: dict[str, Tensor], i: int, rope: layers.Rope,
                 dtype: mx.Dtype, quant: bool) -> None:
        p = f"model.layers.{i}"
        a = f"{p}.self_attn"
        super().__init__(llama.Attention(cfg, w, a, i, rope, dtype, quant, sinks=w[f"{a}.sinks"]),
                         Experts(cfg, w, f"{p}.mlp", dtype, quant),
                         llama.rms_norm(w, f"{p}.input_layernorm", cfg, dtype),
                         llama.rms_norm(w, f"{p}.post_attention_layernorm", cfg, dtype))


class Model(llama.Model):
    """gpt-oss over a row batch; see slotserve.model.decoder."""

    block_class = Block


FAMILY = Family(
    name="gpt_oss",
    config=Config,
    model=Model,
    hf_architectures=("GptOssForCausalLM",),
    hf_model_type="gpt_oss",
    gguf_architecture="gpt-oss",
)
