"""Phi-3 / Phi-4 family (Phi3ForCausalLM): Llama's block with fused projections and LongRoPE.

What differs from llama: the checkpoint stores q/k/v as one `qkv_proj` and gate/up as one
`gate_up_proj` (gate rows first), which are split here and fused again by the layers;
RoPE may rotate only the first `partial_rotary_factor` of each head (Phi-4-mini: 0.75) and
may use LongRoPE ("longrope", old name "su": per-frequency short/long factors switching at
`original_max_position_embeddings`, an attention factor on cos/sin; layers.LongRope). An
optional `sliding_window` applies to every layer. llama.cpp's GGUF files keep the fused
projections (`attn_qkv`, `ffn_up`) and write LongRoPE's factors as tensors.

A partial rotation (HF pairs dims i and i + rotary/2 of the first `rotary` dims) is run as
slotserve's full-width rotate-half (pairs i and i + head_dim/2) by reordering each q and k
head's rows at load so the rotated pairs land on those positions and the rest sit at zero
frequency: q.k is unchanged since both are reordered alike, and every attention kernel
keeps its one RoPE layout.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import mlx.core as mx

import slotserve.model.families.llama as llama
from slotserve.model import decoder, layers
from slotserve.model.family import Family
from slotserve.model.weights import QuantizedWeight, Tensor


@dataclass
class Config(llama.Config):
    original_max_position_embeddings: int | None = None
    partial_rotary_factor: float = 1.0

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    def rope(self) -> dict[str, Any] | None:
        """The RoPE scaling as layers.Rope reads it: LongRoPE with the original context and
        the factor HF derives from it; a partial rotation alone is LongRoPE without factors."""
        if self.rope_scaling is None:
            if self.partial_rotary_factor == 1.0:
                return None
            return dict(rope_type="longrope", partial_rotary_factor=self.partial_rotary_factor,
                        attention_factor=1.0)
        orig = self.original_max_position_embeddings or self.max_position
        return {"factor": self.max_position / orig, **self.rope_scaling,
                "rope_type": "longrope", "original_max_position_embeddings": orig,
                "partial_rotary_factor": self.partial_rotary_factor}

    @classmethod
    def hf_fields(cls, cfg: dict[str, Any], num_layers: int) -> dict[str, Any]:
        rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
        orig = rope.get("original_max_position_embeddings") or cfg.get(
            "original_max_position_embeddings")
        partial = rope.get("partial_rotary_factor") or cfg.get("partial_rotary_factor") or 1.0
        return dict(super().hf_fields(cfg, num_layers),
                    original_max_position_embeddings=int(orig) if orig else None,
                    partial_rotary_factor=float(partial))

    @classmethod
    def gguf_fields(cls, get: Callable[..., Any], common: dict[str, Any]) -> dict[str, Any]:
        """As llama.cpp's converter writes Phi-3 / Phi-4 (conversion/phi.py): the rotated part
        of each head as `rope.dimension_count`, LongRoPE's original context as
        `rope.scaling.original_context_length` (its factors are tensors, read into
        rope_scaling by config.gguf_rope_scaling), the window on every layer as
        `attention.sliding_window` (0: none, Phi-4's). The window applies as in
        transformers (llama.cpp currently runs Phi-3 without it, src/models/phi3.cpp)."""
        head_dim = common["head_dim"]
        rotary = int(get("rope.dimension_count") or head_dim)
        orig = get("rope.scaling.original_context_length")
        window = get("attention.sliding_window")
        return dict(partial_rotary_factor=rotary / head_dim,
                    original_max_position_embeddings=int(orig) if orig else None,
                    sliding_window=int(window) if window else None)


def split_rows(t: Tensor, sizes: list[int]) -> list[Tensor]:
    """A fused [sum(sizes), in] projection cut into its parts, in order."""
    out, start = [], 0
    for n in sizes:
        rows = mx.arange(start, start + n)
        out.append(t.take_rows(rows) if isinstance(t, QuantizedWeight) else t[rows])
        start += n
    return out


def rotated_to_halves(t: Tensor, heads: int, head_dim: int, rotary: int) -> Tensor:
    """q or k rows, reordered within each head so HF's partial rotation becomes full-width
    rotate-half: the rotated halves go to [0, rotary/2) and [head_dim/2, head_dim/2 +
    rotary/2), the unrotated dims to the positions between (zero frequency)."""
    if rotary == head_dim:
        return t
    r, p = rotary // 2, (head_dim - rotary) // 2
    order = [*range(r), *range(rotary, rotary + p), *range(r, rotary),
             *range(rotary + p, head_dim)]
    rows = (mx.arange(heads)[:, None] * head_dim + mx.array(order)[None, :]).reshape(-1)
    return t.take_rows(rows) if isinstance(t, QuantizedWeight) else t[rows]


class Attention(layers.Attention):
    """The fused qkv_proj split into q, k and v (fused again by the layer), RoPE over the
    rotated dims, grouped-query attention (in the sliding window, if any), o_proj."""

    def __init__(self, cfg: Config, w: dict[str, Tensor], p: str, layer: int,
                 rope: layers.Rope, dtype: mx.Dtype, quant: bool) -> None:
        d = cfg.head_dim
        q, k, v = split_rows(w[f"{p}.qkv_proj.weight"],
                             [cfg.num_heads * d, cfg.num_kv_heads * d, cfg.num_kv_heads * d])
        super().__init__(
            rotated_to_halves(q, cfg.num_heads, d, cfg.rotary_dim),
            rotated_to_halves(k, cfg.num_kv_heads, d, cfg.rotary_dim), v,
            w[f"{p}.o_proj.weight"], dtype, quant, layer=layer, heads=cfg.num_heads,
            kv_heads=cfg.num_kv_heads, head_dim=d, scale=cfg.attn_scale, rope=rope,
            window=cfg.window(layer),
        )


class MLP(layers.GatedMLP):
    """down(silu(gate(x)) * up(x)) from the fused gate_up_proj (gate rows first)."""

    def __init__(self, cfg: Config, w: dict[str, Tensor], p: str, dtype: mx.Dtype,
                 quant: bool) -> None:
        gate, up = split_rows(w[f"{p}.gate_up_proj.weight"], [cfg.intermediate_size] * 2)
        super().__init__(gate, up, w[f"{p}.down_proj.weight"], layers.silu, dtype, quant)


class Block(decoder.PreNormBlock):
    def __init__(self, cfg: Config, w: dict[str, Tensor], i: int, rope: layers.Rope,
                 dtype: mx.Dtype, quant: bool) -> None:
        p = f"model.layers.{i}"
        super().__init__(Attention(cfg, w, f"{p}.self_attn", i, rope, dtype, quant),
                         MLP(cfg, w, f"{p}.mlp", dtype, quant),
                         llama.rms_norm(w, f"{p}.input_layernorm", cfg, dtype),
                         llama.rms_norm(w, f"{p}.post_attention_layernorm", cfg, dtype))


class Model(decoder.Decoder):
    """Phi-3 over a row batch; see slotserve.model.decoder."""

    def __init__(self, cfg: Config, w: dict[str, Tensor], dtype: mx.Dtype,
                 quant: bool) -> None:
        self.rope = layers.Rope(cfg.head_dim, cfg.rope_theta, cfg.rope(), dtype)
        embed = layers.Embedding(w["model.embed_tokens.weight"], dtype, quant)
        blocks = [Block(cfg, w, i, self.rope, dtype, quant) for i in range(cfg.num_layers)]
        head = w.get("lm_head.weight")
        lm_head = embed.as_linear() if head is None else layers.Linear(head, dtype, quant)
        super().__init__(cfg, dtype, embed, blocks, llama.rms_norm(w, "model.norm", cfg, dtype),
                         lm_head, [self.rope])


FAMILY = Family(
    name="phi3",
    config=Config,
    model=Model,
    hf_architectures=("Phi3ForCausalLM",),
    hf_model_type="phi3",
    gguf_architecture="phi3",
    # llama.cpp keeps the fused projections fused, in HF's row order (gate rows first)
    gguf_layer_names={"attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"},
)
