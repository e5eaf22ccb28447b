"""Qwen3-Next family (Qwen3-Next-80B-A3B): qwen3_5_moe's model, with the DeltaNet
in-projections stored grouped by key head.

transformers' Qwen3NextGatedDeltaNet projects with `in_proj_qkvz` and `in_proj_ba`, whose
rows run per key head: that head's q, k, then the v and z of the value heads it serves
(`fix_query_key_value_ordering`; llama.cpp's GGUF keeps only in_proj_ba so, as ssm_ba: its
converter writes q/k/v and z apart). Reading a checkpoint reorders those rows into Qwen3.5's
separate `in_proj_qkv` (all q heads, all k heads, all v heads: the conv's channel order in
both), `in_proj_z`, `in_proj_b` and `in_proj_a`; everything else is qwen3_5_moe's (layers
outside `mlp_only_layers` and on `decoder_sparse_step` are sparse, the rest a dense MLP).
"""

from __future__ import annotations

import mlx.core as mx

import slotserve.model.families.qwen3_5 as qwen3_5
import slotserve.model.families.qwen3_5_moe as qwen3_5_moe
from slotserve.model.config import ModelConfig
from slotserve.model.family import Family
from slotserve.model.weights import Tensor


def grouped_rows(groups: int, sizes: list[int]) -> list[mx.array]:
    """Row indices of each part of a tensor stored as `groups` groups of parts of `sizes`
    rows each: part j's rows of every group, in group order."""
    width, out, offset = sum(sizes), [], 0
    for size in sizes:
        base = mx.arange(groups, dtype=mx.int32)[:, None] * width + offset
        out.append((base + mx.arange(size, dtype=mx.int32)[None, :]).reshape(-1))
        offset += size
    return out


def ungroup_projections(weights: dict[str, Tensor], cfg: ModelConfig) -> None:
    """in_proj_qkvz / in_proj_ba (grouped per key head) -> Qwen3.5's four projections."""
    qwen3_5_moe.sanitize(weights, cfg)
    assert isinstance(cfg, qwen3_5.Config)
    hk, r = cfg.linear_key_heads, cfg.linear_value_heads // cfg.linear_key_heads
    dk, dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
    for i in cfg.linear_layers():
        p = f"model.layers.{i}.linear_attn"
        if f"{p}.in_proj_qkvz.weight" in weights:  # (llama.cpp's GGUF has them apart)
            qkvz = weights.pop(f"{p}.in_proj_qkvz.weight")
            q, k, v, z = grouped_rows(hk, [dk, dk, r * dv, r * dv])
            weights[f"{p}.in_proj_qkv.weight"] = qwen3_5.take_rows(
                qkvz, mx.concatenate([q, k, v]))
            weights[f"{p}.in_proj_z.weight"] = qwen3_5.take_rows(qkvz, z)
        if f"{p}.in_proj_ba.weight" not in weights:
            continue
        ba = weights.pop(f"{p}.in_proj_ba.weight")
        b, a = grouped_rows(hk, [r, r])
        weights[f"{p}.in_proj_b.weight"] = qwen3_5.take_rows(ba, b)
        weights[f"{p}.in_proj_a.weight"] = qwen3_5.take_rows(ba, a)


FAMILY = Family(
    name="qwen3_next",
    config=qwen3_5_moe.Config,
    model=qwen3_5_moe.Model,
    hf_architectures=("Qwen3NextForCausalLM",),
    hf_model_type="qwen3_next",
    gguf_architecture="qwen3next",
    gguf_layer_names=qwen3_5_moe.GGUF_LAYER_NAMES,  # (its ssm_ba: b and a per key head)
    gguf_norm_offset=1.0,
    sanitize=ungroup_projections,
)
