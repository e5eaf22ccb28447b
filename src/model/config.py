"""One config dataclass for every family, read from HF config.json or GGUF metadata."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from slotserve.model.errors import UnsupportedModelError

FAMILY_BY_HF_ARCH = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "llama",
    "Qwen3ForCausalLM": "qwen3",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "Gemma3ForCausalLM": "gemma3",
    "Gemma3TextForCausalLM": "gemma3",
}
FAMILY_BY_GGUF_ARCH = {
    "llama": "llama", "qwen3": "qwen3", "qwen3moe": "qwen3_moe", "gemma3": "gemma3"
}


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
    # gemma3
    sliding_window: int | None = None
    layer_types: list[str] = field(default_factory=list)  # "sliding_attention" | "full_attention"
    rope_local_theta: float = 10000.0
    query_pre_attn_scalar: float | None = None
    final_logit_softcapping: float | None = None
    # MoE
    num_experts: int = 0
    experts_per_token: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True
    decoder_sparse_step: int = 1  # qwen3_moe: layer i is sparse when (i+1) % step == 0
    mlp_only_layers: list[int] = field(default_factory=list)  # qwen3_moe: dense layers

    @property
    def attn_scale(self) -> float:
        if self.query_pre_attn_scalar is not None:
            return float(self.query_pre_attn_scalar) ** -0.5
        return self.head_dim**-0.5

    def is_sliding(self, layer: int) -> bool:
        return bool(self.layer_types) and self.layer_types[layer] == "sliding_attention"


def _gemma3_layer_types(n: int, pattern: int = 6) -> list[str]:
    return ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(n)]


def config_from_hf(cfg: dict[str, Any], source: str) -> ModelConfig:
    """Build a ModelConfig from a Hugging Face config.json dict."""
    archs = cfg.get("architectures") or []
    family = next((FAMILY_BY_HF_ARCH[a] for a in archs if a in FAMILY_BY_HF_ARCH), None)
    if family is None:
        family = {"llama": "llama", "qwen3": "qwen3", "qwen3_moe": "qwen3_moe",
                  "gemma3_text": "gemma3"}.get(cfg.get("model_type", ""))
    if family is None:
        raise UnsupportedModelError(
            f"{source}: unsupported architecture {archs or cfg.get('model_type')!r}; "
            f"supported: {sorted(FAMILY_BY_HF_ARCH)}"
        )
    if "text_config" in cfg:
        cfg = {**cfg, **cfg["text_config"]}
    heads = cfg["num_attention_heads"]
    hidden = cfg["hidden_size"]
    rope = cfg.get("rope_scaling") or None
    rope_params = cfg.get("rope_parameters") or None
    theta = cfg.get("rope_theta")
    local_theta = cfg.get("rope_local_base_freq", 10000.0)
    if rope_params:  # transformers 5.x: per layer-type or flat rope parameters
        if "full_attention" in rope_params:
            full = rope_params["full_attention"]
            local_theta = rope_params.get("sliding_attention", {}).get("rope_theta", local_theta)
        else:
            full = rope_params
        theta = full.get("rope_theta", theta)
        if full.get("rope_type", "default") != "default":
            rope = full
    if rope and rope.get("rope_type", rope.get("type", "default")) == "default":
        rope = None
    if rope and rope.get("rope_type", rope.get("type")) not in ("llama3", "linear"):
        raise UnsupportedModelError(f"{source}: unsupported rope_scaling {rope!r}")
    layers = cfg["num_hidden_layers"]
    layer_types = list(cfg.get("layer_types") or [])
    if family == "gemma3" and not layer_types:
        layer_types = _gemma3_layer_types(layers, cfg.get("sliding_window_pattern", 6))
    if family != "gemma3":
        layer_types = []
    return ModelConfig(
        family=family,
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
        tie_embeddings=bool(cfg.get("tie_word_embeddings", family == "gemma3")),
        sliding_window=cfg.get("sliding_window") if family == "gemma3" else None,
        layer_types=layer_types,
        rope_local_theta=float(local_theta),
        query_pre_attn_scalar=cfg.get("query_pre_attn_scalar") if family == "gemma3" else None,
        final_logit_softcapping=cfg.get("final_logit_softcapping"),
        num_experts=(cfg.get("num_experts") or cfg.get("num_local_experts", 0))
        if family == "qwen3_moe" else 0,
        experts_per_token=cfg.get("num_experts_per_tok", 0),
        moe_intermediate_size=cfg.get("moe_intermediate_size", 0),
        norm_topk_prob=bool(cfg.get("norm_topk_prob", True)),
        decoder_sparse_step=int(cfg.get("decoder_sparse_step") or 1),
        mlp_only_layers=list(cfg.get("mlp_only_layers") or []),
    )


def config_from_gguf(meta: dict[str, Any], source: str) -> ModelConfig:
    """Build a ModelConfig from GGUF metadata (values are str/list or 0-d arrays)."""

    def get(key: str, default: Any = None) -> Any:
        v = meta.get(key, default)
        return v.item() if hasattr(v, "item") else v

    arch = get("general.architecture")
    family = FAMILY_BY_GGUF_ARCH.get(arch)
    if family is None:
        raise UnsupportedModelError(
            f"{source}: unsupported GGUF architecture {arch!r}; supported: "
            f"{sorted(FAMILY_BY_GGUF_ARCH)}"
        )
    p = f"{arch}."
    heads = int(get(p + "attention.head_count"))
    hidden = int(get(p + "embedding_length"))
    layers = int(get(p + "block_count"))
    n_vocab = get(p + "vocab_size") or len(meta["tokenizer.ggml.tokens"])
    head_dim = int(get(p + "attention.key_length") or hidden // heads)
    rope = None
    if get(p + "rope.scaling.type") == "linear":
        rope = {"rope_type": "linear", "factor": float(get(p + "rope.scaling.factor"))}
    window = get(p + "attention.sliding_window")
    return ModelConfig(
        family=family,
        hidden_size=hidden,
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=int(get(p + "attention.head_count_kv", heads)),
        head_dim=head_dim,
        intermediate_size=int(get(p + "feed_forward_length", 0)),
        vocab_size=int(n_vocab),
        rms_norm_eps=float(get(p + "attention.layer_norm_rms_epsilon", 1e-6)),
        rope_theta=float(get(p + "rope.freq_base", 10000.0)),
        rope_scaling=rope,
        max_position=int(get(p + "context_length", 4096)),
        tie_embeddings="output.weight" not in meta.get("__tensor_names__", ()),
        sliding_window=int(window) if window and family == "gemma3" else None,
        layer_types=_gemma3_layer_types(layers) if family == "gemma3" else [],
        query_pre_attn_scalar=float(head_dim) if family == "gemma3" else None,
        num_experts=int(get(p + "expert_count", 0)),
        experts_per_token=int(get(p + "expert_used_count", 0)),
        moe_intermediate_size=int(get(p + "expert_feed_forward_length", 0)),
    )
