"""The config every family shares, read from HF config.json or GGUF metadata.

A family whose models have more knobs subclasses `ModelConfig` in its own module (Gemma 3's
sliding window, Qwen3-MoE's experts) and reads those keys there (`hf_fields`,
`gguf_fields`) and writes them back (`hf_keys`, for export); this module reads only what
every family has.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol

import mlx.core as mx

from slotserve.model.errors import UnsupportedModelError


@dataclass
class ModelConfig:
    family: str
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    max_position: int = 4096
    tie_embeddings: bool = False

    # tie_word_embeddings when config.json leaves it out (transformers' default per family)
    tied_by_default: ClassVar[bool] = False
    # config.json keys the family's released files leave out, at transformers' defaults
    # (Gemma 3 4B-27B's text_config names only what differs from them)
    hf_defaults: ClassVar[dict[str, Any]] = {}

    @property
    def attn_scale(self) -> float:
        return self.head_dim**-0.5

    @classmethod
    def hf_fields(cls, cfg: dict[str, Any], num_layers: int) -> dict[str, Any]:
        """The family's own fields from config.json (none here)."""
        return {}

    @classmethod
    def gguf_fields(cls, get: Callable[..., Any], common: dict[str, Any]) -> dict[str, Any]:
        """The family's own fields from GGUF metadata; get(key, default) reads
        `<architecture>.<key>`, common holds the shared fields already read (none here)."""
        return {}

    def hf_keys(self) -> dict[str, Any]:
        """The family's own config.json keys, for export (none here)."""
        return {}


class ConfigFamily(Protocol):
    """What the readers ask of a family (slotserve.model.family.Family has it)."""

    @property
    def name(self) -> str: ...

    @property
    def config(self) -> type[ModelConfig]: ...

    @property
    def gguf_architecture(self) -> str: ...


def config_from_hf(cfg: dict[str, Any], family: ConfigFamily, source: str) -> ModelConfig:
    """Build the family's config from a Hugging Face config.json dict."""
    if "text_config" in cfg:
        cfg = {**cfg, **cfg["text_config"]}
    cfg = {**family.config.hf_defaults, **cfg}
    heads = cfg["num_attention_heads"]
    hidden = cfg["hidden_size"]
    rope = cfg.get("rope_scaling") or None
    rope_params = cfg.get("rope_parameters") or None
    theta = cfg.get("rope_theta")
    if rope_params:  # transformers 5.x: per layer-type or flat rope parameters
        full = rope_params.get("full_attention", rope_params)
        theta = full.get("rope_theta", theta)
        if full.get("rope_type", "default") != "default":
            rope = full
    if rope and rope.get("rope_type", rope.get("type", "default")) == "default":
        rope = None
    if rope and rope.get("rope_type", rope.get("type")) not in ("llama3", "linear",
                                                                 "proportional", "longrope",
                                                                 "su", "yarn"):
        raise UnsupportedModelError(f"{source}: unsupported rope_scaling {rope!r}")
    layers = cfg["num_hidden_layers"]
    kind = family.config
    return kind(
        family=family.name,
        hidden_size=hidden,
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=cfg.get("num_key_value_heads", heads),
        head_dim=cfg.get("head_dim") or hidden // heads,
        intermediate_size=cfg.get("intermediate_size", 0),
        vocab_size=cfg["vocab_size"],
        rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
        rope_theta=float(theta if theta is not None else 10000.0),
        rope_scaling=rope,
        max_position=cfg.get("max_position_embeddings", 4096),
        tie_embeddings=bool(cfg.get("tie_word_embeddings", kind.tied_by_default)),
        **kind.hf_fields(cfg, layers),
    )


def gguf_rope_scaling(get: Callable[..., Any], rope_freqs: Any, source: str,
                      rope_factors: dict[str, Any] | None = None) -> dict[str, Any] | None:
    """The RoPE scaling llama.cpp wrote, as slotserve.model.layers.rope_inv_freq reads it.

    `<arch>.rope.scaling.type` says linear / yarn / longrope (none: no scaling); Llama 3's
    scaling is written instead as the tensor `rope_freqs.weight`, one divisor per frequency
    (llama.cpp divides each frequency by it, which is HF's llama3 formula, evaluated by the
    converter), read here as rope_type "freq_factors"; Phi-3's LongRoPE as the tensors
    `rope_factors_short` / `rope_factors_long` (`rope_factors`) with the attention factor
    in `rope.scaling.attn_factor`, read as HF's "longrope" (the family adds the original
    context and the rotated share of the head). YaRN's factor, original context and beta
    keys are HF's (the family says what the file does not, e.g. gpt-oss's `truncate`).
    What rope_inv_freq cannot do is refused, naming what it can."""
    kind = get("rope.scaling.type") or "none"
    rope: dict[str, Any] | None = None
    if kind == "linear":
        rope = {"rope_type": "linear", "factor": float(get("rope.scaling.factor"))}
    elif kind == "yarn":
        rope = {"rope_type": "yarn", "factor": float(get("rope.scaling.factor")),
                "original_max_position_embeddings":
                    int(get("rope.scaling.original_context_length")),
                "beta_fast": float(get("rope.scaling.yarn_beta_fast", 32.0)),
                "beta_slow": float(get("rope.scaling.yarn_beta_slow", 1.0))}
        if get("rope.scaling.yarn_attn_factor") is not None:  # HF's attention_factor
            rope["attention_factor"] = float(get("rope.scaling.yarn_attn_factor"))
        ext, log_mul = get("rope.scaling.yarn_ext_factor"), get("rope.scaling.yarn_log_multiplier")
        if (ext is not None and float(ext) != 1.0) or log_mul is not None:
            raise UnsupportedModelError(
                f"{source}: YaRN with yarn_ext_factor {ext} / yarn_log_multiplier {log_mul}; "
                "supported: HF's YaRN (factor, original context, betas, attention factor)")
    elif kind != "none":
        raise UnsupportedModelError(
            f"{source}: unsupported GGUF rope scaling {kind!r}; supported: none, linear, "
            "yarn, llama3 (the rope_freqs tensor), longrope (the rope_factors tensors)")
    if rope_factors:
        if rope is not None or set(rope_factors) != {"short", "long"}:
            raise UnsupportedModelError(
                f"{source}: LongRoPE tensors {sorted(rope_factors)} with rope scaling "
                f"{kind!r}; supported: both rope_factors_short and rope_factors_long, alone")
        rope = {"rope_type": "longrope",
                **{f"{k}_factor": [float(f) for f in v.astype(mx.float32).tolist()]
                   for k, v in rope_factors.items()}}
        attn = get("rope.scaling.attn_factor")
        if attn is not None:
            rope["attention_factor"] = float(attn)
    if rope_freqs is not None:
        if rope is not None:
            raise UnsupportedModelError(
                f"{source}: both rope_freqs and rope scaling {kind!r}; supported: one of them")
        rope = {"rope_type": "freq_factors",
                "factors": [float(f) for f in rope_freqs.astype(mx.float32).tolist()]}
    return rope


def _first(v: Any) -> Any:
    """A value llama.cpp may write once per layer (Gemma 4's kv heads and MLP widths): the
    first layer's; a family whose layers differ reads the whole array itself."""
    return v[0].item() if isinstance(v, mx.array) and v.ndim == 1 else v


def config_from_gguf(meta: dict[str, Any], family: ConfigFamily, source: str,
                     rope_freqs: Any = None, rope_factors: dict[str, Any] | None = None
                     ) -> ModelConfig:
    """Build the family's config from GGUF metadata (values are str/list or 0-d arrays);
    `rope_freqs` is the file's rope_freqs.weight tensor, if it has one, `rope_factors` its
    rope_factors_{short,long}.weight tensors by "short" / "long"."""

    def get(key: str, default: Any = None) -> Any:
        v = meta.get(key, default)
        return v.item() if isinstance(v, mx.array) and v.ndim == 0 else v

    p = f"{family.gguf_architecture}."
    heads = int(get(p + "attention.head_count"))
    hidden = int(get(p + "embedding_length"))
    n_vocab = get(p + "vocab_size") or len(meta["tokenizer.ggml.tokens"])
    rope = gguf_rope_scaling(lambda key, default=None: get(p + key, default), rope_freqs,
                             source, rope_factors)
    common: dict[str, Any] = dict(
        family=family.name,
        hidden_size=hidden,
        num_layers=int(get(p + "block_count")),
        num_heads=heads,
        num_kv_heads=int(_first(get(p + "attention.head_count_kv", heads))),
        head_dim=int(get(p + "attention.key_length") or hidden // heads),
        intermediate_size=int(_first(get(p + "feed_forward_length", 0))),
        vocab_size=int(n_vocab),
        rms_norm_eps=float(get(p + "attention.layer_norm_rms_epsilon", 1e-6)),
        rope_theta=float(get(p + "rope.freq_base", 10000.0)),
        rope_scaling=rope,
        max_position=int(get(p + "context_length", 4096)),
        tie_embeddings="output.weight" not in meta.get("__tensor_names__", ()),
    )
    own = family.config.gguf_fields(lambda key, default=None: get(p + key, default), common)
    return family.config(**{**common, **own})  # (a family may correct a common field)
