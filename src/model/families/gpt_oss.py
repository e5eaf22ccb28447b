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

llama.cpp's GGUF files store the experts as separate gate / up / down stacks [E, out, in]
(`ffn_{gate,up,down}_exps`, with biases), MXFP4 in its released files (slotserve.model.gguf
keeps them mxfp4), the sinks as `attn_sinks`; the file says neither the layer pattern
(llama.cpp fixes it: even layers sliding) nor YaRN's `truncate` (false in gpt-oss's config).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import mlx.core as mx

import slotserve.model.families.llama as llama
from slotserve.kernels.quantized import Mxfp4Weight, QuantizedWeight
from slotserve.model import decoder, layers, moe
from slotserve.model.errors import UnsupportedModelError
from slotserve.model.family import Family
from slotserve.model.weights import Tensor

FULL = "full_attention"


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
        """As llama.cpp's converter writes gpt-oss (conversion/gpt_oss.py) and its runtime
        reads it (src/models/openai-moe.cpp): experts from `expert_*` keys, the window
        from `attention.sliding_window` on the layers `attention.sliding_window_pattern`
        marks (a per-layer list, or n: every n-th layer full), by default the even ones (as
        gpt-oss's layer_types alternate), YaRN without truncation of its correction range
        (the released config's `truncate: false`; the file has no key for it: common's
        rope_scaling is completed in place). The clamp and alpha are the architecture's
        constants in llama.cpp too; a sliding layers' own RoPE base is refused."""
        rope = common["rope_scaling"]
        if rope is not None and rope.get("rope_type") == "yarn":
            rope.setdefault("truncate", False)
        local_base = get("rope.freq_base_swa")
        if local_base is not None and float(local_base) != common["rope_theta"]:
            raise UnsupportedModelError(
                f"gpt-oss GGUF: rope.freq_base_swa {float(local_base)} differs from "
                f"rope.freq_base {common['rope_theta']}; supported: one RoPE base")
        window = get("attention.sliding_window")
        n = common["num_layers"]
        pattern = get("attention.sliding_window_pattern", 2)
        if isinstance(pattern, mx.array):
            sliding = [bool(x) for x in pattern.tolist()]
        else:  # llama.cpp's set_swa_pattern: the last layer of every n is full
            sliding = [int(pattern) == 0 or i % int(pattern) < int(pattern) - 1
                       for i in range(n)]
        return dict(attention_bias=True, num_experts=int(get("expert_count")),
                    experts_per_token=int(get("expert_used_count")),
                    sliding_window=int(window) if window else None,
                    layer_types=[llama.SLIDING if x else FULL for x in sliding]
                    if window else [])


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


def concat_rows(a: Tensor | Mxfp4Weight, b: Tensor | Mxfp4Weight) -> Tensor | Mxfp4Weight:
    """Two [E, out, in] expert stacks of one format as one, a's rows first (llama.cpp's
    separate gate and up stacks as moe.SparseMoE's gate_up); mixed formats in float."""
    if isinstance(a, Mxfp4Weight) and isinstance(b, Mxfp4Weight):
        return Mxfp4Weight(mx.concatenate([a.weight, b.weight], axis=1),
                           mx.concatenate([a.scales, b.scales], axis=1))
    if isinstance(a, QuantizedWeight) and isinstance(b, QuantizedWeight) and (
            (a.bits, a.group_size) == (b.bits, b.group_size)):
        return QuantizedWeight(*(mx.concatenate([x, y], axis=1) for x, y in (
            (a.weight, b.weight), (a.scales, b.scales), (a.biases, b.biases))),
            a.group_size, a.bits)
    return mx.concatenate([t if isinstance(t, mx.array) else t.dequantize(mx.float32)
                           for t in (a, b)], axis=1)


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
        if f"{e}.gate_proj.weight" in w:  # llama.cpp's separate stacks (GGUF)
            gate_up = concat_rows(w[f"{e}.gate_proj.weight"], w[f"{e}.up_proj.weight"])
            gate_up_bias = mx.concatenate([w[f"{e}.gate_proj.bias"],  # type: ignore[list-item]
                                           w[f"{e}.up_proj.bias"]], axis=1)
            down, down_bias = w[f"{e}.down_proj.weight"], w[f"{e}.down_proj.bias"]
        else:  # transformers' fused, interleaved gate_up
            gate_up = deinterleave(expert_matrix(w, f"{e}.gate_up_proj"), axis=1)
            bias = w[f"{e}.gate_up_proj_bias"]
            assert isinstance(bias, mx.array), "biases are never quantized"
            gate_up_bias = deinterleave(bias, axis=1)
            down, down_bias = expert_matrix(w, f"{e}.down_proj"), w[f"{e}.down_proj_bias"]
        super().__init__(
            w[f"{p}.router.weight"], gate_up, down,  # type: ignore[arg-type]
            inter=cfg.intermediate_size, top_k=cfg.experts_per_token, norm_topk=True,
            dtype=dtype, keep_quantized=quant,
            glu=clamped_glu(cfg.swiglu_alpha, cfg.swiglu_limit),
            biases=(w[f"{p}.router.bias"], gate_up_bias, down_bias),  # type: ignore[arg-type]
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


def gguf_sinks(weights: dict[str, Tensor], cfg: llama.Config) -> None:
    """llama.cpp's `attn_sinks.weight` under transformers' name (`self_attn.sinks`)."""
    for name in [k for k in weights if k.endswith(".self_attn.sinks.weight")]:
        weights[name.removesuffix(".weight")] = weights.pop(name)


FAMILY = Family(
    name="gpt_oss",
    config=Config,
    model=Model,
    hf_architectures=("GptOssForCausalLM",),
    hf_model_type="gpt_oss",
    gguf_architecture="gpt-oss",
    gguf_layer_names={
        "attn_sinks": "self_attn.sinks",
        "post_attention_norm": "post_attention_layernorm",
        "ffn_gate_inp": "mlp.router",
        "ffn_gate_exps": "mlp.experts.gate_proj",
        "ffn_up_exps": "mlp.experts.up_proj",
        "ffn_down_exps": "mlp.experts.down_proj",
    },
    sanitize=gguf_sinks,
)
