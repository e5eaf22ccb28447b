"""Gemma 3 text family (gemma-3-270m and up), numerically following HF's Gemma3ForCausalLM.

The 4B/12B/27B checkpoints are `Gemma3ForConditionalGeneration` (model_type gemma3): the
text config under `text_config`, which names only what differs from transformers' defaults
(`Config.hf_defaults`), and the text weights under `language_model.`; their text part is
this model, the vision tower and its projector are left out at load (one log line).

What differs from llama: embeddings scaled by sqrt(hidden); RMSNorm weights act as
(1 + w) in float32; per-head q/k norms; four norms per block (the attention and MLP
outputs are normed before their residual adds); a tanh-GELU MLP; sliding-window
layers interleaved with global ones, each kind with its own RoPE table; an
optional tanh cap on the final logits.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar

import mlx.core as mx
import structlog

from slotserve.model import decoder, layers
from slotserve.model.config import ModelConfig
from slotserve.model.family import Family
from slotserve.model.weights import Tensor

SLIDING, FULL = "sliding_attention", "full_attention"
# what a Gemma3ForConditionalGeneration checkpoint holds beside its text model
VISION_PREFIXES = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.",
                   "model.multi_modal_projector.")

log = structlog.get_logger("slotserve.gemma3")


def layer_pattern(n: int, every: int = 6) -> list[str]:
    """Gemma 3's default: each `every`-th layer global, the others sliding."""
    return [FULL if (i + 1) % every == 0 else SLIDING for i in range(n)]


@dataclass
class Config(ModelConfig):
    sliding_window: int | None = None
    layer_types: list[str] = field(default_factory=list)  # SLIDING | FULL per layer
    rope_local_theta: float = 10000.0  # the sliding layers' RoPE base
    query_pre_attn_scalar: float | None = None
    final_logit_softcapping: float | None = None

    tied_by_default: ClassVar[bool] = True
    # transformers' Gemma3TextConfig defaults (what 4B's text_config leaves out)
    hf_defaults: ClassVar[dict[str, Any]] = dict(
        vocab_size=262_208, hidden_size=2304, intermediate_size=9216, num_hidden_layers=26,
        num_attention_heads=8, num_key_value_heads=4, head_dim=256, rms_norm_eps=1e-6,
        rope_theta=1_000_000.0, rope_local_base_freq=10_000.0, query_pre_attn_scalar=256,
        max_position_embeddings=131_072, sliding_window=4096,
    )

    @property
    def attn_scale(self) -> float:
        if self.query_pre_attn_scalar is not None:
            return float(self.query_pre_attn_scalar) ** -0.5
        return self.head_dim**-0.5

    def is_sliding(self, layer: int) -> bool:
        return bool(self.layer_types) and self.layer_types[layer] == SLIDING

    @classmethod
    def hf_fields(cls, cfg: dict[str, Any], num_layers: int) -> dict[str, Any]:
        local = cfg.get("rope_local_base_freq", 10000.0)
        rope_params = cfg.get("rope_parameters") or {}
        if FULL in rope_params:  # transformers 5.x: rope parameters per layer type
            local = rope_params.get(SLIDING, {}).get("rope_theta", local)
        types = list(cfg.get("layer_types") or [])
        return dict(
            sliding_window=cfg.get("sliding_window"),
            layer_types=types or layer_pattern(num_layers, cfg.get("sliding_window_pattern", 6)),
            rope_local_theta=float(local),
            query_pre_attn_scalar=cfg.get("query_pre_attn_scalar"),
            final_logit_softcapping=cfg.get("final_logit_softcapping"),
        )

    @classmethod
    def gguf_fields(cls, get: Callable[..., Any], common: dict[str, Any]) -> dict[str, Any]:
        """As llama.cpp reads them (src/models/gemma3.cpp): with a window, layers slide by
        `attention.sliding_window_pattern` (a per-layer list, or n: every n-th layer global,
        default 6); the query scale is `attention.scale` when written, else
        hidden / heads for the 62-layer 27B (its query_pre_attn_scalar, 168, is not its
        head_dim, 128, and the converter writes no key for it) and head_dim otherwise."""
        n, window = common["num_layers"], get("attention.sliding_window")
        pattern = get("attention.sliding_window_pattern", 6)
        if not window:
            types = [FULL] * n
        elif isinstance(pattern, mx.array):
            types = [SLIDING if bool(x) else FULL for x in pattern.tolist()]
        else:
            types = layer_pattern(n, int(pattern))
        scale = get("attention.scale")
        if scale:
            scalar = float(scale) ** -2
        elif n == 62:
            scalar = float(common["hidden_size"] // common["num_heads"])
        else:
            scalar = float(common["head_dim"])
        cap = get("final_logit_softcapping")
        return dict(sliding_window=int(window) if window else None, layer_types=types,
                    rope_local_theta=float(get("rope.freq_base_swa", 10000.0)),
                    query_pre_attn_scalar=scalar,
                    final_logit_softcapping=float(cap) if cap else None)

    def hf_keys(self) -> dict[str, Any]:
        return dict(hidden_act="gelu_pytorch_tanh", hidden_activation="gelu_pytorch_tanh",
                    sliding_window=self.sliding_window, layer_types=self.layer_types,
                    rope_local_base_freq=self.rope_local_theta,
                    query_pre_attn_scalar=self.query_pre_attn_scalar,
                    final_logit_softcapping=self.final_logit_softcapping)


class GemmaNorm(layers.Layer):
    """RMSNorm with a (1 + w) scale, computed in float32 as HF does (w is stored centred)."""

    def __init__(self, weight: Tensor, eps: float) -> None:
        assert isinstance(weight, mx.array), "norm weights are never quantized"
        self.scale = 1.0 + weight.astype(mx.float32)
        self.eps = eps

    def __call__(self, x: mx.array) -> mx.array:
        return mx.fast.rms_norm(x.astype(mx.float32), self.scale, self.eps).astype(x.dtype)

    def arrays(self) -> list[mx.array]:
        return [self.scale]


class Attention(layers.Attention):
    """Llama attention with a GemmaNorm over each q and k head and, on sliding layers, a
    window."""

    def __init__(self, cfg: Config, w: dict[str, Tensor], p: str, layer: int,
                 rope: layers.Rope, dtype: mx.Dtype, quant: bool) -> None:
        eps = cfg.rms_norm_eps
        super().__init__(
            w[f"{p}.q_proj.weight"], w[f"{p}.k_proj.weight"], w[f"{p}.v_proj.weight"],
            w[f"{p}.o_proj.weight"], dtype, quant, layer=layer, heads=cfg.num_heads,
            kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim, scale=cfg.attn_scale, rope=rope,
            q_norm=GemmaNorm(w[f"{p}.q_norm.weight"], eps),
            k_norm=GemmaNorm(w[f"{p}.k_norm.weight"], eps),
            window=cfg.sliding_window if cfg.is_sliding(layer) else None,
        )


class MLP(layers.GatedMLP):
    """down(gelu_tanh(gate(x)) * up(x))."""

    def __init__(self, w: dict[str, Tensor], p: str, dtype: mx.Dtype, quant: bool) -> None:
        super().__init__(w[f"{p}.gate_proj.weight"], w[f"{p}.up_proj.weight"],
                         w[f"{p}.down_proj.weight"], layers.gelu_tanh, dtype, quant)


class Block(layers.Layer):
    """h = x + norm(attn(norm(x))), then h + norm(mlp(norm(h)))."""

    def __init__(self, cfg: Config, w: dict[str, Tensor], i: int, rope: layers.Rope,
                 dtype: mx.Dtype, quant: bool) -> None:
        p, eps = f"model.layers.{i}", cfg.rms_norm_eps
        self.attn = Attention(cfg, w, f"{p}.self_attn", i, rope, dtype, quant)
        self.mlp = MLP(w, f"{p}.mlp", dtype, quant)
        self.in_norm = GemmaNorm(w[f"{p}.input_layernorm.weight"], eps)
        self.post_attn_norm = GemmaNorm(w[f"{p}.post_attention_layernorm.weight"], eps)
        self.pre_mlp_norm = GemmaNorm(w[f"{p}.pre_feedforward_layernorm.weight"], eps)
        self.post_mlp_norm = GemmaNorm(w[f"{p}.post_feedforward_layernorm.weight"], eps)

    def __call__(self, x: mx.array, batch: layers.Batch) -> mx.array:
        h = x + self.post_attn_norm(self.attn(x, batch, norm=self.in_norm))
        return h + self.post_mlp_norm(self.mlp(h, norm=self.pre_mlp_norm))

    def parts(self) -> list[layers.Layer]:
        return [self.attn, self.mlp, self.in_norm, self.post_attn_norm, self.pre_mlp_norm,
                self.post_mlp_norm]


class Model(decoder.Decoder):
    """Gemma 3 over a row batch; the lm_head is the (unscaled) embedding table."""

    def __init__(self, cfg: Config, w: dict[str, Tensor], dtype: mx.Dtype,
                 quant: bool) -> None:
        self.rope = layers.Rope(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling, dtype)
        self.local_rope = layers.Rope(cfg.head_dim, cfg.rope_local_theta, None, dtype)
        embed = layers.Embedding(w["model.embed_tokens.weight"], dtype, quant)
        # HF rounds the scale to the compute dtype before multiplying; so do we
        self.embed_scale = mx.array(math.sqrt(cfg.hidden_size), dtype=dtype)
        blocks = [Block(cfg, w, i, self.local_rope if cfg.is_sliding(i) else self.rope, dtype,
                        quant) for i in range(cfg.num_layers)]
        head = w.get("lm_head.weight")
        lm_head = embed.as_linear() if head is None else layers.Linear(head, dtype, quant)
        super().__init__(cfg, dtype, embed, blocks, GemmaNorm(w["model.norm.weight"],
                                                              cfg.rms_norm_eps),
                         lm_head, [self.rope, self.local_rope])
        self.softcap = cfg.final_logit_softcapping

    def embed_tokens(self, tokens: mx.array) -> mx.array:
        return self.embed(tokens) * self.embed_scale

    def __call__(self, tokens: mx.array, batch: layers.Batch,
                 logit_rows: list[int]) -> mx.array | None:
        """Llama's forward, then the tanh cap on the logits when the config sets one."""
        logits = super().__call__(tokens, batch, logit_rows)
        if logits is None or not self.softcap:
            return logits
        return mx.tanh(logits / self.softcap) * self.softcap


def drop_vision(weights: dict[str, Tensor], cfg: ModelConfig) -> None:
    """Leave a Gemma3ForConditionalGeneration's vision tower and projector out: slotserve
    serves its text part (text in, text out)."""
    vision = [k for k in weights if k.startswith(VISION_PREFIXES)]
    for k in vision:
        del weights[k]
    if vision:
        log.info("vision tower not loaded: serving the text model", tensors=len(vision))


FAMILY = Family(
    name="gemma3",
    config=Config,
    model=Model,
    hf_architectures=("Gemma3ForCausalLM", "Gemma3TextForCausalLM",
                      "Gemma3ForConditionalGeneration"),
    hf_model_type="gemma3_text",
    gguf_architecture="gemma3",
    gguf_layer_names={
        "attn_q_norm": "self_attn.q_norm",
        "attn_k_norm": "self_attn.k_norm",
        "post_attention_norm": "post_attention_layernorm",
        "ffn_norm": "pre_feedforward_layernorm",  # gemma puts a norm before and after the MLP
        "post_ffw_norm": "post_feedforward_layernorm",
    },
    gguf_norm_offset=1.0,
    sanitize=drop_vision,
)
