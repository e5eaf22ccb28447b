"""`slotserve synth`: random-weight checkpoints with the real shapes of named models.

    slotserve synth llama3-8b /tmp/llama3-8b --format mlx4

Writes a Hugging Face directory (config.json, sharded safetensors with an index,
tokenizer.json, tokenizer_config.json) that the loader reads like any other. The
tokenizer is the bundled SmolLM2 one (49152 tokens); presets keep their own
vocabulary size, so ids above SmolLM2's never come out of the tokenizer and decode
to empty text when sampled. Throughput on these weights is real throughput: same
shapes, same bytes read, same work per step.

Formats: `bf16` (HF layout, per-expert MoE tensors) and `mlx4` (MLX affine 4-bit,
group 64, weight/scales/biases triples as mlx-lm stores them, MoE experts stacked
under `switch_mlp`). Weights are drawn with `mx.random` on the default device (the
GPU when there is one), so an 8B checkpoint takes seconds plus the disk write.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import mlx.core as mx
import structlog

from slotserve import settings

log = structlog.get_logger("slotserve.tools.synth")

GROUP_SIZE = 64
BITS = 4
SHARD_BYTES = 4 * 2**30
TOKENIZER_ENV = "SLOTSERVE_TOKENIZER_DIR"  # a folder with tokenizer.json + tokenizer_config.json
FORMATS = ("bf16", "mlx4")


@dataclass(frozen=True)
class Preset:
    """A named model shape: its HF architecture and config.json fields."""

    arch: str
    config: dict[str, Any] = field(default_factory=dict)

    @property
    def moe(self) -> bool:
        return int(self.config.get("num_experts", 0)) > 0


_LLAMA3_ROPE = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192, "rope_type": "llama3"}

_GEMMA4_ROPE = {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                                   "rope_theta": 1000000.0}}
_GEMMA4 = {"model_type": "gemma4_text", "head_dim": 256, "global_head_dim": 512,
           "attention_k_eq_v": True, "sliding_window": 1024, "vocab_size": 262144,
           "rms_norm_eps": 1e-6, "rope_parameters": _GEMMA4_ROPE,
           "max_position_embeddings": 262144, "tie_word_embeddings": True,
           "final_logit_softcapping": 30.0, "hidden_activation": "gelu_pytorch_tanh",
           "hidden_size_per_layer_input": 0, "num_kv_shared_layers": 0}


def _gemma4_layers(n: int, every: int = 6) -> list[str]:
    return ["full_attention" if (i + 1) % every == 0 else "sliding_attention"
            for i in range(n)]


def _deepseek_v4_rope(partial: float, yarn: dict[str, Any] | None) -> dict[str, Any]:
    """V4's rope_parameters: "main" (sliding layers) and "compress" (compressed layers and
    their compressors; YaRN in the released models, with no attention factor)."""
    compress = {"rope_type": "default", "rope_theta": 160000.0, "partial_rotary_factor": partial}
    if yarn:
        compress = {**compress, **yarn, "rope_type": "yarn", "attention_factor": 1.0}
    return {"main": {"rope_type": "default", "rope_theta": 10000.0,
                     "partial_rotary_factor": partial}, "compress": compress}


def _deepseek_v4_layers(n: int) -> list[str]:
    """transformers' default schedule: two HCA layers, then CSA and HCA in turn."""
    return (["heavily_compressed_attention"] * min(n, 2)
            + ["compressed_sparse_attention" if i % 2 else "heavily_compressed_attention"
               for i in range(max(n - 2, 0))])


def _deepseek_v4_mlp(n: int, hashed: int = 3) -> list[str]:
    return ["hash_moe"] * min(n, hashed) + ["moe"] * max(n - hashed, 0)


_DEEPSEEK_V4 = {
    "model_type": "deepseek_v4", "hidden_size": 4096, "num_attention_heads": 64,
    "num_key_value_heads": 1, "head_dim": 512, "q_lora_rank": 1024, "o_groups": 8,
    "o_lora_rank": 1024, "n_routed_experts": 256, "num_experts_per_tok": 6,
    "n_shared_experts": 1, "moe_intermediate_size": 2048, "scoring_func": "sqrtsoftplus",
    "norm_topk_prob": True, "routed_scaling_factor": 1.5, "swiglu_limit": 10.0,
    "hc_mult": 4, "hc_sinkhorn_iters": 20, "hc_eps": 1e-6, "sliding_window": 128,
    "index_n_heads": 64, "index_head_dim": 128, "index_topk": 512, "vocab_size": 129280,
    "rms_norm_eps": 1e-6, "max_position_embeddings": 1048576, "tie_word_embeddings": False,
    "compress_rates": {"compressed_sparse_attention": 4, "heavily_compressed_attention": 128},
    "rope_theta": 10000.0, "compress_rope_theta": 160000.0,
    "rope_parameters": _deepseek_v4_rope(64 / 512, {"factor": 16.0, "beta_fast": 32,
                                                     "beta_slow": 1,
                                                     "original_max_position_embeddings": 65536}),
    "hidden_act": "silu",
}


PRESETS: dict[str, Preset] = {
    "llama3-8b": Preset("LlamaForCausalLM", {
        "model_type": "llama", "hidden_size": 4096, "num_hidden_layers": 32,
        "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
        "intermediate_size": 14336, "vocab_size": 128256, "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0, "rope_scaling": _LLAMA3_ROPE,
        "max_position_embeddings": 131072, "tie_word_embeddings": False,
        "attention_bias": False, "mlp_bias": False, "hidden_act": "silu",
    }),
    "qwen3-30b-a3b": Preset("Qwen3MoeForCausalLM", {
        "model_type": "qwen3_moe", "hidden_size": 2048, "num_hidden_layers": 48,
        "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128,
        "intermediate_size": 6144, "moe_intermediate_size": 768, "num_experts": 128,
        "num_experts_per_tok": 8, "norm_topk_prob": True, "decoder_sparse_step": 1,
        "mlp_only_layers": [], "vocab_size": 151936, "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0, "max_position_embeddings": 40960,
        "tie_word_embeddings": False, "attention_bias": False, "hidden_act": "silu",
    }),
    # Qwen3.5/3.6-35B-A3B: 3 of 4 layers Gated DeltaNet, MoE with a shared expert
    "qwen3.5-35b-a3b": Preset("Qwen3_5MoeForCausalLM", {
        "model_type": "qwen3_5_moe", "hidden_size": 2048, "num_hidden_layers": 40,
        "num_attention_heads": 16, "num_key_value_heads": 2, "head_dim": 256,
        "linear_num_key_heads": 16, "linear_num_value_heads": 32, "linear_key_head_dim": 128,
        "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4, "full_attention_interval": 4,
        "moe_intermediate_size": 512, "shared_expert_intermediate_size": 512,
        "num_experts": 256, "num_experts_per_tok": 8, "vocab_size": 248320,
        "rms_norm_eps": 1e-6, "max_position_embeddings": 262144, "tie_word_embeddings": False,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000000.0,
                            "partial_rotary_factor": 0.25},
        "hidden_act": "silu",
    }),
    # Gemma 4 31B (dense) and 26B-A4B (experts beside the MLP): 5 sliding layers (window
    # 1024, 256-wide heads) to 1 global (fewer 512-wide heads, k = v, proportional RoPE)
    "gemma4-31b": Preset("Gemma4ForCausalLM", {
        **_GEMMA4, "hidden_size": 5376, "num_hidden_layers": 60, "num_attention_heads": 32,
        "num_key_value_heads": 16, "num_global_key_value_heads": 4,
        "intermediate_size": 21504, "layer_types": _gemma4_layers(60),
    }),
    "gemma4-26b-a4b": Preset("Gemma4ForCausalLM", {
        **_GEMMA4, "hidden_size": 2816, "num_hidden_layers": 30, "num_attention_heads": 16,
        "num_key_value_heads": 8, "num_global_key_value_heads": 2, "intermediate_size": 2112,
        "enable_moe_block": True, "num_experts": 128, "top_k_experts": 8,
        "moe_intermediate_size": 704, "layer_types": _gemma4_layers(30),
    }),
    # DeepSeek-V4-Flash's dims (hidden 4096, 64 heads of 512, one shared K=V head, 256
    # experts of 2048 + a shared one, 4 hyper-connection streams, CSA m=4 / HCA m=128) with
    # 10 of its 43 layers: the full model is ~150 GB in 4-bit, more than one H200 holds
    # (and more than its disk takes); 10 layers are ~37 GB
    "deepseek-v4-flash-10l": Preset("DeepseekV4ForCausalLM", {
        **_DEEPSEEK_V4, "num_hidden_layers": 10,
        "layer_types": _deepseek_v4_layers(10), "mlp_layer_types": _deepseek_v4_mlp(10),
    }),
    # small shapes for tests (every input width a multiple of the 4-bit group)
    "tiny-llama": Preset("LlamaForCausalLM", {
        "model_type": "llama", "hidden_size": 256, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
        "intermediate_size": 512, "vocab_size": 49152, "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0, "max_position_embeddings": 4096, "tie_word_embeddings": False,
        "hidden_act": "silu",
    }),
    "tiny-moe": Preset("Qwen3MoeForCausalLM", {
        "model_type": "qwen3_moe", "hidden_size": 256, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
        "intermediate_size": 512, "moe_intermediate_size": 128, "num_experts": 8,
        "num_experts_per_tok": 2, "norm_topk_prob": True, "decoder_sparse_step": 1,
        "mlp_only_layers": [], "vocab_size": 49152, "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0, "max_position_embeddings": 4096,
        "tie_word_embeddings": False, "hidden_act": "silu",
    }),
    "tiny-qwen3.5-moe": Preset("Qwen3_5MoeForCausalLM", {
        "model_type": "qwen3_5_moe", "hidden_size": 256, "num_hidden_layers": 4,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
        "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 64,
        "linear_value_head_dim": 64, "linear_conv_kernel_dim": 4, "full_attention_interval": 4,
        "moe_intermediate_size": 128, "shared_expert_intermediate_size": 128,
        "num_experts": 8, "num_experts_per_tok": 2, "vocab_size": 49152, "rms_norm_eps": 1e-6,
        "max_position_embeddings": 4096, "tie_word_embeddings": False,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000000.0,
                            "partial_rotary_factor": 0.25},
        "hidden_act": "silu",
    }),
    # Gemma 4 in miniature: per-layer inputs and shared K/V (E2B's parts), then experts
    "tiny-gemma4": Preset("Gemma4ForCausalLM", {
        **_GEMMA4, "hidden_size": 256, "num_hidden_layers": 6, "num_attention_heads": 4,
        "num_key_value_heads": 2, "num_global_key_value_heads": 1, "head_dim": 64,
        "global_head_dim": 128, "sliding_window": 64, "intermediate_size": 512,
        "vocab_size": 49216, "vocab_size_per_layer_input": 49216,
        "hidden_size_per_layer_input": 64, "num_kv_shared_layers": 2,
        "use_double_wide_mlp": True, "max_position_embeddings": 4096,
        "layer_types": _gemma4_layers(6, 3),
    }),
    "tiny-gemma4-moe": Preset("Gemma4ForCausalLM", {
        **_GEMMA4, "hidden_size": 256, "num_hidden_layers": 4, "num_attention_heads": 4,
        "num_key_value_heads": 2, "num_global_key_value_heads": 1, "head_dim": 64,
        "global_head_dim": 128, "sliding_window": 64, "intermediate_size": 512,
        "enable_moe_block": True, "num_experts": 8, "top_k_experts": 2,
        "moe_intermediate_size": 128, "vocab_size": 49216, "max_position_embeddings": 4096,
        "layer_types": _gemma4_layers(4, 2),
    }),
    # DeepSeek-V4 in miniature: every layer kind (sliding, CSA, HCA at 16 so that short
    # prompts close its windows), hash-routed and top-k MoE
    "tiny-deepseek-v4": Preset("DeepseekV4ForCausalLM", {
        **_DEEPSEEK_V4, "hidden_size": 256, "num_hidden_layers": 4, "num_attention_heads": 4,
        "head_dim": 128, "q_lora_rank": 128, "o_groups": 2, "o_lora_rank": 128,
        "n_routed_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 128,
        "index_n_heads": 8, "index_head_dim": 64, "index_topk": 8, "sliding_window": 64,
        "vocab_size": 49152, "max_position_embeddings": 4096,
        "compress_rates": {"compressed_sparse_attention": 4, "heavily_compressed_attention": 16},
        "rope_parameters": _deepseek_v4_rope(0.5, None),
        "layer_types": ["sliding_attention", "compressed_sparse_attention",
                        "heavily_compressed_attention", "compressed_sparse_attention"],
        "mlp_layer_types": ["hash_moe", "moe", "moe", "moe"],
    }),
}

# Gated DeltaNet hybrids (slotserve.model.families.qwen3_5*): their own tensor layout
HYBRID_TYPES = ("qwen3_5", "qwen3_5_moe")


def preset_config(name: str, layers: int | None = None) -> dict[str, Any]:
    """The config.json dict of a preset (optionally with fewer layers)."""
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; known: {', '.join(sorted(PRESETS))}")
    p = PRESETS[name]
    cfg = {"architectures": [p.arch], **p.config, "torch_dtype": "bfloat16",
           "bos_token_id": 1, "eos_token_id": 2}
    if layers is not None:
        if layers < 1:
            raise ValueError("layers must be at least 1")
        cfg["num_hidden_layers"] = layers
        # per-layer schedules follow the layer count (the first `layers` of the preset's)
        for key in ("layer_types", "mlp_layer_types"):
            if key in cfg:
                cfg[key] = list(cfg[key])[:layers]
        if cfg["model_type"] == "gemma4_text":  # its last layer is global (HF forces it)
            cfg["layer_types"][-1] = "full_attention"
    return cfg


def tensor_shapes(cfg: dict[str, Any], fmt: str) -> Iterator[tuple[str, tuple[int, ...]]]:
    """(HF tensor name, shape) for every weight, in file order; MoE layout depends on fmt."""
    h, v = cfg["hidden_size"], cfg["vocab_size"]
    hd = cfg.get("head_dim") or h // cfg["num_attention_heads"]
    nq, nkv = cfg["num_attention_heads"] * hd, cfg["num_key_value_heads"] * hd
    experts = int(cfg.get("num_experts", 0))
    qk_norm = cfg["model_type"] in ("qwen3", "qwen3_moe")
    if cfg["model_type"] in HYBRID_TYPES:
        yield from _hybrid_shapes(cfg, fmt)
        return
    if cfg["model_type"] == "gemma4_text":
        yield from _gemma4_shapes(cfg, fmt)
        return
    if cfg["model_type"] == "deepseek_v4":
        yield from _deepseek_v4_shapes(cfg, fmt)
        return
    yield "model.embed_tokens.weight", (v, h)
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}"
        yield f"{p}.input_layernorm.weight", (h,)
        yield f"{p}.post_attention_layernorm.weight", (h,)
        yield f"{p}.self_attn.q_proj.weight", (nq, h)
        yield f"{p}.self_attn.k_proj.weight", (nkv, h)
        yield f"{p}.self_attn.v_proj.weight", (nkv, h)
        yield f"{p}.self_attn.o_proj.weight", (h, nq)
        if qk_norm:
            yield f"{p}.self_attn.q_norm.weight", (hd,)
            yield f"{p}.self_attn.k_norm.weight", (hd,)
        if experts and i not in cfg.get("mlp_only_layers", []):
            yield from _expert_shapes(cfg, f"{p}.mlp", fmt)
        else:
            inter = cfg["intermediate_size"]
            yield f"{p}.mlp.gate_proj.weight", (inter, h)
            yield f"{p}.mlp.up_proj.weight", (inter, h)
            yield f"{p}.mlp.down_proj.weight", (h, inter)
    yield "model.norm.weight", (h,)
    if not cfg.get("tie_word_embeddings"):
        yield "lm_head.weight", (v, h)


def _expert_shapes(cfg: dict[str, Any], p: str, fmt: str) -> Iterator[tuple[str, tuple[int, ...]]]:
    """A sparse MLP's router and experts (mlp prefix p)."""
    h, experts, inter = cfg["hidden_size"], int(cfg["num_experts"]), cfg["moe_intermediate_size"]
    yield f"{p}.gate.weight", (experts, h)
    if fmt == "mlx4":  # mlx-lm: one stacked tensor per projection
        yield f"{p}.switch_mlp.gate_proj.weight", (experts, inter, h)
        yield f"{p}.switch_mlp.up_proj.weight", (experts, inter, h)
        yield f"{p}.switch_mlp.down_proj.weight", (experts, h, inter)
    else:  # HF: one tensor per expert (expanded from a stacked draw in _arrays)
        yield f"{p}.experts.gate_proj.weight", (experts, inter, h)
        yield f"{p}.experts.up_proj.weight", (experts, inter, h)
        yield f"{p}.experts.down_proj.weight", (experts, h, inter)


def _hybrid_shapes(cfg: dict[str, Any], fmt: str) -> Iterator[tuple[str, tuple[int, ...]]]:
    """Qwen3.5's layout: Gated DeltaNet layers (linear_attn) and gated attention
    (q_proj yields query and gate), every MLP routed experts plus a gated shared expert."""
    h, v = cfg["hidden_size"], cfg["vocab_size"]
    hd, heads, kv = cfg["head_dim"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    nk = cfg["linear_num_key_heads"] * cfg["linear_key_head_dim"]
    nvh = cfg["linear_num_value_heads"]
    nv = nvh * cfg["linear_value_head_dim"]
    every = cfg.get("full_attention_interval", 4)
    yield "model.embed_tokens.weight", (v, h)
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}"
        yield f"{p}.input_layernorm.weight", (h,)
        yield f"{p}.post_attention_layernorm.weight", (h,)
        if (i + 1) % every == 0:
            a = f"{p}.self_attn"
            yield f"{a}.q_proj.weight", (2 * heads * hd, h)
            yield f"{a}.k_proj.weight", (kv * hd, h)
            yield f"{a}.v_proj.weight", (kv * hd, h)
            yield f"{a}.o_proj.weight", (h, heads * hd)
            yield f"{a}.q_norm.weight", (hd,)
            yield f"{a}.k_norm.weight", (hd,)
        else:
            a = f"{p}.linear_attn"
            yield f"{a}.in_proj_qkv.weight", (2 * nk + nv, h)
            yield f"{a}.in_proj_z.weight", (nv, h)
            yield f"{a}.in_proj_b.weight", (nvh, h)
            yield f"{a}.in_proj_a.weight", (nvh, h)
            yield f"{a}.conv1d.weight", (2 * nk + nv, 1, cfg["linear_conv_kernel_dim"])
            yield f"{a}.dt_bias", (nvh,)
            yield f"{a}.A_log", (nvh,)
            yield f"{a}.norm.weight", (cfg["linear_value_head_dim"],)
            yield f"{a}.out_proj.weight", (h, nv)
        if cfg.get("num_experts"):
            yield from _expert_shapes(cfg, f"{p}.mlp", fmt)
            inter = cfg["shared_expert_intermediate_size"]
            yield f"{p}.mlp.shared_expert.gate_proj.weight", (inter, h)
            yield f"{p}.mlp.shared_expert.up_proj.weight", (inter, h)
            yield f"{p}.mlp.shared_expert.down_proj.weight", (h, inter)
            yield f"{p}.mlp.shared_expert_gate.weight", (1, h)
        else:
            yield f"{p}.mlp.gate_proj.weight", (cfg["intermediate_size"], h)
            yield f"{p}.mlp.up_proj.weight", (cfg["intermediate_size"], h)
            yield f"{p}.mlp.down_proj.weight", (h, cfg["intermediate_size"])
    yield "model.norm.weight", (h,)
    if not cfg.get("tie_word_embeddings"):
        yield "lm_head.weight", (v, h)


def _gemma4_shapes(cfg: dict[str, Any], fmt: str) -> Iterator[tuple[str, tuple[int, ...]]]:
    """Gemma 4's layout: per-kind head shapes (k = v on the global layers: no v_proj), q/k
    head norms, four block norms and a layer scalar, experts (HF's fused gate_up_proj, or
    mlx-lm's switch_glu stacks) with their router and own norms, per-layer inputs."""
    h, v, n = cfg["hidden_size"], cfg["vocab_size"], cfg["num_hidden_layers"]
    heads, width = cfg["num_attention_heads"], cfg.get("hidden_size_per_layer_input") or 0
    first_shared = n - cfg.get("num_kv_shared_layers", 0)
    yield "model.embed_tokens.weight", (v, h)
    if width:
        yield "model.embed_tokens_per_layer.weight", (cfg.get("vocab_size_per_layer_input", v),
                                                      n * width)
        yield "model.per_layer_model_projection.weight", (n * width, h)
        yield "model.per_layer_projection_norm.weight", (width,)
    for i, kind in enumerate(cfg["layer_types"]):
        p, full = f"model.layers.{i}", kind == "full_attention"
        d = cfg["global_head_dim"] if full else cfg["head_dim"]
        kv = cfg["num_global_key_value_heads"] if full else cfg["num_key_value_heads"]
        for norm in ("input_layernorm", "post_attention_layernorm",
                     "pre_feedforward_layernorm", "post_feedforward_layernorm"):
            yield f"{p}.{norm}.weight", (h,)
        yield f"{p}.layer_scalar", (1,)
        yield f"{p}.self_attn.q_proj.weight", (heads * d, h)
        yield f"{p}.self_attn.q_norm.weight", (d,)
        if i < first_shared:
            yield f"{p}.self_attn.k_proj.weight", (kv * d, h)
            yield f"{p}.self_attn.k_norm.weight", (d,)
            if not (full and cfg.get("attention_k_eq_v")):
                yield f"{p}.self_attn.v_proj.weight", (kv * d, h)
        yield f"{p}.self_attn.o_proj.weight", (h, heads * d)
        inter = cfg["intermediate_size"] * (2 if cfg.get("use_double_wide_mlp")
                                            and i >= first_shared else 1)
        yield f"{p}.mlp.gate_proj.weight", (inter, h)
        yield f"{p}.mlp.up_proj.weight", (inter, h)
        yield f"{p}.mlp.down_proj.weight", (h, inter)
        if cfg.get("enable_moe_block"):
            e, m = cfg["num_experts"], cfg["moe_intermediate_size"]
            yield f"{p}.router.proj.weight", (e, h)
            yield f"{p}.router.scale", (h,)
            yield f"{p}.router.per_expert_scale", (e,)
            if fmt == "mlx4":
                yield f"{p}.experts.switch_glu.gate_proj.weight", (e, m, h)
                yield f"{p}.experts.switch_glu.up_proj.weight", (e, m, h)
                yield f"{p}.experts.switch_glu.down_proj.weight", (e, h, m)
            else:
                yield f"{p}.experts.gate_up_proj", (e, 2 * m, h)
                yield f"{p}.experts.down_proj", (e, h, m)
            for norm in ("post_feedforward_layernorm_1", "pre_feedforward_layernorm_2",
                         "post_feedforward_layernorm_2"):
                yield f"{p}.{norm}.weight", (h,)
        if width:
            yield f"{p}.per_layer_input_gate.weight", (width, h)
            yield f"{p}.per_layer_projection.weight", (h, width)
            yield f"{p}.post_per_layer_input_norm.weight", (h,)
    yield "model.norm.weight", (h,)


def _deepseek_v4_shapes(cfg: dict[str, Any], fmt: str) -> Iterator[tuple[str, tuple[int, ...]]]:
    """DeepSeek-V4 in transformers' module names (slotserve.model.families.deepseek_v4):
    low-rank queries, one K=V head, grouped output, the compressors and indexer of CSA /
    HCA layers, hyper-connection weights, stacked experts (`.weight` in mlx4, so they are
    quantized) and the hash layers' token -> experts table."""
    h, v, n = cfg["hidden_size"], cfg["vocab_size"], cfg["num_hidden_layers"]
    hd, heads, q = cfg["head_dim"], cfg["num_attention_heads"], cfg["q_lora_rank"]
    g, r, hc = cfg["o_groups"], cfg["o_lora_rank"], cfg["hc_mult"]
    e, k, inter = cfg["n_routed_experts"], cfg["num_experts_per_tok"], cfg["moe_intermediate_size"]
    ih, idim, mix = cfg["index_n_heads"], cfg["index_head_dim"], (2 + hc) * hc
    suffix = ".weight" if fmt == "mlx4" else ""
    yield "model.embed_tokens.weight", (v, h)
    for i in range(n):
        p, kind = f"model.layers.{i}", cfg["layer_types"][i]
        a = f"{p}.self_attn"
        yield f"{p}.input_layernorm.weight", (h,)
        yield f"{p}.post_attention_layernorm.weight", (h,)
        for name in ("attn_hc", "ffn_hc"):
            yield f"{p}.{name}.fn", (mix, hc * h)
            yield f"{p}.{name}.base", (mix,)
            yield f"{p}.{name}.scale", (3,)
        yield f"{a}.q_a_proj.weight", (q, h)
        yield f"{a}.q_a_norm.weight", (q,)
        yield f"{a}.q_b_proj.weight", (heads * hd, q)
        yield f"{a}.kv_proj.weight", (hd, h)
        yield f"{a}.kv_norm.weight", (hd,)
        yield f"{a}.o_a_proj.weight", (g * r, heads * hd // g)
        yield f"{a}.o_b_proj.weight", (h, g * r)
        yield f"{a}.sinks", (heads,)
        if kind != "sliding_attention":
            m, csa = cfg["compress_rates"][kind], kind == "compressed_sparse_attention"
            c, width = f"{a}.compressor", 2 * hd if kind == "compressed_sparse_attention" else hd
            yield f"{c}.kv_proj.weight", (width, h)
            yield f"{c}.gate_proj.weight", (width, h)
            yield f"{c}.position_bias", (m, width)
            yield f"{c}.kv_norm.weight", (hd,)
            if csa:
                x = f"{c}.indexer"
                yield f"{x}.kv_proj.weight", (2 * idim, h)
                yield f"{x}.gate_proj.weight", (2 * idim, h)
                yield f"{x}.position_bias", (m, 2 * idim)
                yield f"{x}.kv_norm.weight", (idim,)
                yield f"{x}.q_b_proj.weight", (ih * idim, q)
                yield f"{x}.scorer.weights_proj.weight", (ih, h)
        mlp = f"{p}.mlp"
        yield f"{mlp}.gate.weight", (e, h)
        if cfg["mlp_layer_types"][i] == "hash_moe":
            yield f"{mlp}.gate.tid2eid", (v, k)
        else:
            yield f"{mlp}.gate.e_score_correction_bias", (e,)
        yield f"{mlp}.experts.gate_up_proj{suffix}", (e, 2 * inter, h)
        yield f"{mlp}.experts.down_proj{suffix}", (e, h, inter)
        yield f"{mlp}.shared_experts.gate_proj.weight", (inter, h)
        yield f"{mlp}.shared_experts.up_proj.weight", (inter, h)
        yield f"{mlp}.shared_experts.down_proj.weight", (h, inter)
    yield "model.norm.weight", (h,)
    yield "model.hc_head.hc_fn", (hc, hc * h)
    yield "model.hc_head.hc_base", (hc,)
    yield "model.hc_head.hc_scale", (1,)
    if not cfg.get("tie_word_embeddings"):
        yield "lm_head.weight", (v, h)


def _draw(name: str, shape: tuple[int, ...], key: mx.array, experts: int = 0) -> mx.array:
    """Norms are ones; matrices N(0, 1/in) so activations stay O(1) through the depth;
    DeepSeek-V4's hash table (`tid2eid`, token -> experts) valid expert ids (`experts`)."""
    if name.endswith(".tid2eid"):
        return mx.random.randint(0, experts, shape, dtype=mx.int32, key=key)
    if len(shape) == 1:
        return mx.ones(shape, dtype=mx.bfloat16)
    std = 1.0 if "embed_tokens" in name else shape[-1] ** -0.5
    return (mx.random.normal(shape, dtype=mx.float32, key=key) * std).astype(mx.bfloat16)


# one kernel launch draws or quantizes at most this many values: MLX's CUDA launches of
# DeepSeek-V4-Flash's whole expert stack (256 x 2048 x 4096 = 2^31 values) fail
# (cudaGraphAddKernelNode: invalid argument)
CHUNK_VALUES = 1 << 28


def _drawn_parts(name: str, shape: tuple[int, ...], key: mx.array, fmt: str,
                 experts: int) -> dict[str, mx.array]:
    """_draw + _arrays, evaluated; mlx4 stacks larger than CHUNK_VALUES by slices of axis 0
    (bf16 stacks are stored per expert already)."""
    step = max(1, CHUNK_VALUES // math.prod(shape[1:]))
    if fmt != "mlx4" or len(shape) < 3 or shape[0] <= step:
        parts = _arrays(name, _draw(name, shape, key, experts), fmt)
        mx.eval(list(parts.values()))
        return parts
    pieces: list[dict[str, mx.array]] = []
    for j, k in enumerate(mx.random.split(key, -(-shape[0] // step))):
        rows = min(step, shape[0] - j * step)
        piece = _arrays(name, _draw(name, (rows, *shape[1:]), k, experts), fmt)
        mx.eval(list(piece.values()))
        pieces.append(piece)
    parts = {t: mx.concatenate([p[t] for p in pieces]) for t in pieces[0]}
    mx.eval(list(parts.values()))
    return parts


def _arrays(name: str, w: mx.array, fmt: str) -> dict[str, mx.array]:
    """The stored tensors for one weight in the chosen format."""
    if fmt == "mlx4" and w.ndim >= 2 and w.shape[-1] % GROUP_SIZE == 0 \
            and name.endswith(".weight"):
        q, scales, biases = mx.quantize(w, group_size=GROUP_SIZE, bits=BITS)
        base = name[: -len(".weight")]
        return {name: q, f"{base}.scales": scales, f"{base}.biases": biases}
    if w.ndim == 3 and ".experts." in name and name.endswith(".weight"):  # bf16: per expert
        prefix, proj = name.rsplit(".experts.", 1)
        return {f"{prefix}.experts.{e}.{proj}": w[e] for e in range(w.shape[0])}
    return {name: w}


def _copy_tokenizer(outdir: Path, tokenizer_dir: str | Path | None,
                    model_type: str = "") -> int:
    """Write tokenizer.json + tokenizer_config.json; returns the tokenizer's vocab size (the
    bundled SmolLM2's by default, with Gemma 4's control tokens and template for gemma4)."""
    src = tokenizer_dir or settings.current().tokenizer_dir
    if model_type == "gemma4_text":
        return write_gemma4_tokenizer(outdir, base_dir=src)
    if src:
        for f in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copyfile(Path(src) / f, outdir / f)
        from tokenizers import Tokenizer as HFTokenizer

        return HFTokenizer.from_file(str(outdir / "tokenizer.json")).get_vocab_size(True)
    return write_smollm2_tokenizer(outdir)


def write_smollm2_tokenizer(outdir: Path) -> int:
    """The bundled SmolLM2's tokenizer and chat template as HF files; returns its vocab size."""
    from slotserve.model.loader import default_model_path
    from slotserve.model.tokenizer import Tokenizer

    _, meta = mx.load(str(default_model_path()), return_metadata=True)
    tok = Tokenizer.from_gguf_metadata(meta, "smollm2")
    (outdir / "tokenizer.json").write_text(tok.to_hf_tokenizer_json())
    cfg = {"chat_template": tok.chat_template, "bos_token": "<|im_start|>",
           "eos_token": "<|im_end|>", "add_bos_token": False}
    (outdir / "tokenizer_config.json").write_text(json.dumps(cfg))
    return tok.vocab_size


# Gemma 4's control tokens (bos/eos, turns, tools, thinking, media), as the synthetic Gemma 4
# tokenizer adds them to SmolLM2's
GEMMA4_TOKENS = ("<bos>", "<eos>", "<|turn>", "<turn|>", "<|tool>", "<tool|>", "<|tool_call>",
                 "<tool_call|>", "<|tool_response>", "<tool_response|>", '<|"|>', "<|channel>",
                 "<channel|>", "<|think|>", "<|image|>", "<|audio|>", "<|video|>")
# A short template in Gemma 4's turn and tool-call format for synthetic checkpoints (a real
# Gemma 4 checkpoint ships Google's, which slotserve renders as it is)
GEMMA4_SYNTH_TEMPLATE = r"""{{- bos_token -}}
{%- if tools or messages[0]['role'] == 'system' -%}
{{- '<|turn>system\n' -}}
{%- if messages[0]['role'] == 'system' %}{{ messages[0]['content'] | trim }}{% endif -%}
{%- for tool in tools or [] %}{{ '<|tool>' + (tool | tojson) + '<tool|>' }}{% endfor -%}
{{- '<turn|>\n' -}}
{%- endif -%}
{%- for m in messages if m['role'] != 'system' -%}
{%- if m['role'] == 'tool' -%}
{{- '<|tool_response>' + m['content'] + '<tool_response|>' -}}
{%- else -%}
{{- '<|turn>' + ('model' if m['role'] == 'assistant' else m['role']) + '\n' -}}
{{- m['content'] | trim -}}
{%- for call in m.get('tool_calls') or [] -%}
{{- '<|tool_call>call:' + call['function']['name'] + (call['function']['arguments'] | tojson)
    + '<tool_call|>' -}}
{%- endfor -%}
{{- '<turn|>\n' -}}
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt %}{{ '<|turn>model\n' }}{% endif -%}"""


def write_gemma4_tokenizer(outdir: Path, template: str = GEMMA4_SYNTH_TEMPLATE,
                           base_dir: str | Path | None = None) -> int:
    """SmolLM2's tokenizer (or the one in base_dir) plus Gemma 4's control tokens, with a
    Gemma 4 chat template (the gemma4 family refuses any other); returns its vocab size."""
    from tokenizers import AddedToken
    from tokenizers import Tokenizer as HFTokenizer

    if base_dir:
        shutil.copyfile(Path(base_dir) / "tokenizer.json", outdir / "tokenizer.json")
    else:
        write_smollm2_tokenizer(outdir)
    tok = HFTokenizer.from_file(str(outdir / "tokenizer.json"))
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t in GEMMA4_TOKENS])
    tok.save(str(outdir / "tokenizer.json"))
    cfg = {"chat_template": template, "bos_token": "<bos>", "eos_token": "<turn|>",
           "add_bos_token": False}
    (outdir / "tokenizer_config.json").write_text(json.dumps(cfg))
    return tok.get_vocab_size(True)


def synth(preset: str, outdir: str | Path, fmt: str = "mlx4", layers: int | None = None,
          seed: int = 0, tokenizer_dir: str | Path | None = None) -> dict[str, Any]:
    """Write a random-weight checkpoint of `preset` to `outdir`; returns a summary."""
    if fmt not in FORMATS:
        raise ValueError(f"format must be one of {FORMATS}, not {fmt!r}")
    cfg = preset_config(preset, layers)
    if fmt == "mlx4":
        cfg["quantization"] = {"group_size": GROUP_SIZE, "bits": BITS}
    out = Path(outdir)
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob("model*.safetensors*"):
        old.unlink()
    t0 = time.perf_counter()
    tok_vocab = _copy_tokenizer(out, tokenizer_dir, cfg["model_type"])
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    meta = {"format": "mlx" if fmt == "mlx4" else "pt"}
    weight_map: dict[str, str] = {}
    shard: dict[str, mx.array] = {}
    shard_bytes = total = params = 0
    files: list[Path] = []

    def flush() -> None:
        nonlocal shard, shard_bytes
        if not shard:
            return
        path = out / f"model-{len(files) + 1:05d}.safetensors"
        mx.eval(list(shard.values()))
        mx.save_safetensors(str(path), shard, metadata=meta)
        files.append(path)
        weight_map.update({k: path.name for k in shard})
        shard, shard_bytes = {}, 0

    for i, (name, shape) in enumerate(tensor_shapes(cfg, fmt)):
        parts = _drawn_parts(name, shape, mx.random.key(seed * 1_000_003 + i), fmt,
                             int(cfg.get("n_routed_experts", 0)))
        params += math.prod(shape)
        size = sum(a.nbytes for a in parts.values())
        if shard and shard_bytes + size > SHARD_BYTES:
            flush()
        shard.update(parts)
        shard_bytes += size
        total += size
    flush()
    # the index is always written (one shard or many), as HF writes it for sharded models
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    summary = {"preset": preset, "format": fmt, "layers": cfg["num_hidden_layers"],
               "params": params, "bytes": total, "shards": len(files),
               "tokenizer_vocab": tok_vocab, "vocab": cfg["vocab_size"],
               "seconds": round(time.perf_counter() - t0, 2), "device": str(mx.default_device()),
               "path": str(out)}
    log.info("synthetic checkpoint written", **summary)
    return summary


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The `synth` subcommand's arguments (shared by cli.py and `python -m`)."""
    p.add_argument("preset", choices=sorted(PRESETS))
    p.add_argument("outdir")
    p.add_argument("--format", dest="fmt", choices=FORMATS, default="mlx4")
    p.add_argument("--layers", type=int, default=None, help="fewer layers than the preset")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tokenizer", default=None,
                   help=f"folder with tokenizer.json + tokenizer_config.json (default: "
                        f"${TOKENIZER_ENV}, else the bundled SmolLM2)")


def main(args: argparse.Namespace) -> int:
    summary = synth(args.preset, args.outdir, args.fmt, args.layers, args.seed, args.tokenizer)
    print(json.dumps(summary))  # noqa: T201 - the command's output
    return 0


if __name__ == "__main__":
    import sys

    parser = argparse.ArgumentParser(prog="python -m slotserve.tools.synth", description=__doc__)
    add_arguments(parser)
    sys.exit(main(parser.parse_args()))
