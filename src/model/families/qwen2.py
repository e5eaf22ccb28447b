"""Qwen2 / Qwen2.5 family: Llama's block with biases on the q, k and v projections.

Qwen2's q/k/v projections always carry a bias (the o projection and the MLP none), which a
model without biases would drop and answer wrong. Its config names a `sliding_window` that
applies only when `use_sliding_window` is set, and then to the layers from
`max_window_layers` on (or as `layer_types` says); the released checkpoints leave it off.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import mlx.core as mx

import slotserve.model.families.llama as llama
from slotserve.model import decoder, layers
from slotserve.model.family import Family
from slotserve.model.weights import Tensor

FULL = "full_attention"


@dataclass
class Config(llama.Config):
    @classmethod
    def hf_fields(cls, cfg: dict[str, Any], num_layers: int) -> dict[str, Any]:
        window = cfg.get("sliding_window") if cfg.get("use_sliding_window") else None
        types = list(cfg.get("layer_types") or [])
        if window and not types:  # transformers' rule: sliding from max_window_layers on
            first = int(cfg.get("max_window_layers", num_layers))
            types = [llama.SLIDING if i >= first else FULL for i in range(num_layers)]
        return dict(sliding_window=window or None, layer_types=types if window else [])

    def hf_keys(self) -> dict[str, Any]:
        if self.sliding_window is None:
            return dict(use_sliding_window=False)
        return dict(use_sliding_window=True, sliding_window=self.sliding_window,
                    layer_types=self.layer_types)


class Block(decoder.PreNormBlock):
    def __init__(self, cfg: Config, w: dict[str, Tensor], i: int, rope: layers.Rope,
                 dtype: mx.Dtype, quant: bool) -> None:
        p = f"model.layers.{i}"
        a = f"{p}.self_attn"
        qkv_biases = llama.biases(w, a, ("q_proj", "k_proj", "v_proj"), True)
        super().__init__(
            llama.Attention(cfg, w, a, i, rope, dtype, quant, biases=(*qkv_biases, None)),
            llama.MLP(w, f"{p}.mlp", dtype, quant),
            llama.rms_norm(w, f"{p}.input_layernorm", cfg, dtype),
            llama.rms_norm(w, f"{p}.post_attention_layernorm", cfg, dtype))


class Model(llama.Model):
    """Qwen2 over a row batch; see slotserve.model.decoder."""

    block_class = Block


FAMILY = Family(
    name="qwen2",
    config=Config,
    model=Model,
    hf_architectures=("Qwen2ForCausalLM",),
    hf_model_type="qwen2",
    gguf_architecture="qwen2",
)
