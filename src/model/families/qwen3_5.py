"""Qwen3.5 / Qwen3.6 dense family: hybrid layers of Gated DeltaNet and gated attention.

Following transformers' Qwen3_5ForCausalLM (and the text part of
Qwen3_5ForConditionalGeneration, whose `model.language_model.` names the reader maps):

- `layer_types` says which layers are linear attention (a Gated DeltaNet,
  slotserve.model.deltanet: a recurrent state per sequence) and which full attention
  (three of four by default);
- full attention is Qwen3's (q/k head norms, grouped-query) with an output gate: q_proj
  yields each head's query and gate side by side, and the attention output is multiplied by
  sigmoid(gate) before o_proj; RoPE turns only the first `partial_rotary_factor` of each
  head (the text positions of its multimodal RoPE are one position for all three axes);
- every RMS norm but the DeltaNet's own gated one scales by (1 + w) ("zero-centered");
- pre-norm residual blocks with a SwiGLU MLP (the MoE variants: qwen3_5_moe).

Partial RoPE runs on every attention backend unchanged: the q and k rows of each head are
stored permuted so that the rotated dims pair as rotate-half pairs the whole head
(i with i + head_dim/2), and the frequencies of the dims that stay put are zero (cos 1,
sin 0: those dims pass through exactly). q.k is a sum over dims, so the order is the
model's own choice; V and the output are not permuted.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx

from slotserve.model import decoder, deltanet, layers
from slotserve.model.config import ModelConfig
from slotserve.model.errors import UnsupportedModelError
from slotserve.model.family import Family
from slotserve.model.kv import KVPool
from slotserve.model.weights import QuantizedWeight, Tensor

LINEAR, FULL = "linear_attention", "full_attention"


def layer_pattern(n: int, every: int = 4) -> list[str]:
    """transformers' default: each `every`-th layer full attention, the others linear."""
    return [FULL if (i + 1) % every == 0 else LINEAR for i in range(n)]


@dataclass
class Config(ModelConfig):
    layer_types: list[str] = field(default_factory=list)
    partial_rotary_factor: float = 0.25
    linear_conv_kernel: int = 4
    linear_key_heads: int = 16
    linear_value_heads: int = 32
    linear_key_head_dim: int = 128
    linear_value_head_dim: int = 128
    # the DeltaNet value heads in llama.cpp's tiled order (its Qwen3.5 GGUF files)
    value_heads_tiled: bool = False

    @classmethod
    def hf_fields(cls, cfg: dict[str, Any], num_layers: int) -> dict[str, Any]:
        rope = cfg.get("rope_parameters") or {}
        rope = rope.get(FULL, rope)
        return dict(
            layer_types=list(cfg.get("layer_types") or
                             layer_pattern(num_layers, cfg.get("full_attention_interval", 4))),
            partial_rotary_factor=float(rope.get("partial_rotary_factor",
                                                 cfg.get("partial_rotary_factor", 0.25))),
            linear_conv_kernel=int(cfg.get("linear_conv_kernel_dim", 4)),
            linear_key_heads=int(cfg["linear_num_key_heads"]),
            linear_value_heads=int(cfg["linear_num_value_heads"]),
            linear_key_head_dim=int(cfg["linear_key_head_dim"]),
            linear_value_head_dim=int(cfg["linear_value_head_dim"]),
        )

    @classmethod
    def gguf_fields(cls, get: Callable[..., Any], common: dict[str, Any]) -> dict[str, Any]:
        """llama.cpp's keys (convert_hf_to_gguf.py's Qwen3NextModel): the DeltaNet's sizes
        as ssm.*, the linear layers as `attention.recurrent_layers`, the MTP head's blocks
        after the decoder's (`nextn_predict_layers`: left unread); its Qwen3.5 files
        (not Qwen3-Next's) reorder the value heads to tiled order when there are more value
        than key heads (`value_heads_tiled`)."""
        # block_count counts the multi-token-prediction head's blocks too (not read)
        n = common["num_layers"] - int(get("nextn_predict_layers", 0))
        recurrent = get("attention.recurrent_layers")
        if recurrent is not None and len(recurrent) >= n:
            types = [LINEAR if bool(r) else FULL for r in list(recurrent)[:n]]
        else:
            types = layer_pattern(n, int(get("full_attention_interval", 4)))
        key_heads, value_heads = int(get("ssm.group_count")), int(get("ssm.time_step_rank"))
        rotary = int(get("rope.dimension_count", common["head_dim"] // 4))
        return dict(
            num_layers=n,
            layer_types=types,
            partial_rotary_factor=rotary / common["head_dim"],
            linear_conv_kernel=int(get("ssm.conv_kernel", 4)),
            linear_key_heads=key_heads,
            linear_value_heads=value_heads,
            linear_key_head_dim=int(get("ssm.state_size")),
            linear_value_head_dim=int(get("ssm.inner_size")) // value_heads,
            value_heads_tiled=common["family"] != "qwen3_next" and key_heads != value_heads,
        )

    def hf_keys(self) -> dict[str, Any]:
        return dict(layer_types=self.layer_types,
                    partial_rotary_factor=self.partial_rotary_factor,
                    linear_conv_kernel_dim=self.linear_conv_kernel,
                    linear_num_key_heads=self.linear_key_heads,
                    linear_num_value_heads=self.linear_value_heads,
                    linear_key_head_dim=self.linear_key_head_dim,
                    linear_value_head_dim=self.linear_value_head_dim)

    def attention_layers(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t == FULL]

    def linear_layers(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t == LINEAR]


# ---- partial RoPE as whole-head rotate-half ------------------------------------------------

def rotary_dims(cfg: Config) -> int:
    return int(cfg.head_dim * cfg.partial_rotary_factor)


def head_order(head_dim: int, rotary: int) -> mx.array:
    """Stored dim -> checkpoint dim within a head: the rotated halves at 0 and head_dim/2,
    each followed by half of the dims that stay put (see the module doc)."""
    half, rot_half = head_dim // 2, rotary // 2
    kept = list(range(rotary, head_dim))
    order = ([*range(rot_half), *kept[: half - rot_half], *range(rot_half, rotary),
              *kept[half - rot_half :]])
    return mx.array(order, dtype=mx.int32)


class PartialRope(layers.Rope):
    """Rotate-half RoPE over the whole (permuted) head whose last head_dim/2 - rotary/2
    frequencies are zero: those dims keep their values (cos 1, sin 0)."""

    def __init__(self, cfg: Config, dtype: mx.Dtype) -> None:
        super().__init__(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling, dtype)
        rot = rotary_dims(cfg)
        own = layers.rope_inv_freq(rot, cfg.rope_theta, cfg.rope_scaling)
        self.inv_freq = mx.concatenate(
            [own, mx.zeros(((cfg.head_dim - rot) // 2,), dtype=mx.float32)])


def take_rows(t: Tensor, rows: mx.array) -> Tensor:
    return t.take_rows(rows) if isinstance(t, QuantizedWeight) else t[rows]


def zero_centered_norm(w: dict[str, Tensor], name: str, cfg: ModelConfig, dtype: mx.Dtype,
                       order: mx.array | None = None) -> layers.RMSNorm:
    """An RMS norm that scales by (1 + w) (in float32, then the compute dtype)."""
    weight = w[f"{name}.weight"]
    assert isinstance(weight, mx.array), "norm weights are never quantized"
    scale = 1.0 + weight.astype(mx.float32)
    return layers.RMSNorm((scale if order is None else scale[order]).astype(dtype),
                          cfg.rms_norm_eps)


class GatedAttention(layers.Attention):
    """Qwen3 attention whose output is gated: o_proj(attention * sigmoid(gate)). The gate
    rows ride in the fused QKV matmul (after V) and are split off before attention."""

    def __init__(self, cfg: Config, w: dict[str, Tensor], p: str, layer: int,
                 rope: layers.Rope, dtype: mx.Dtype, quant: bool) -> None:
        hd, heads, kv_heads = cfg.head_dim, cfg.num_heads, cfg.num_kv_heads
        order = head_order(hd, rotary_dims(cfg))
        per_head = mx.arange(heads, dtype=mx.int32)[:, None] * (2 * hd)
        q_rows = (per_head + order[None, :]).reshape(-1)
        gate_rows = (per_head + hd + mx.arange(hd, dtype=mx.int32)[None, :]).reshape(-1)
        k_rows = (mx.arange(kv_heads, dtype=mx.int32)[:, None] * hd + order[None, :]).reshape(-1)
        q_proj = w[f"{p}.q_proj.weight"]
        q, gate = take_rows(q_proj, q_rows), take_rows(q_proj, gate_rows)
        k = take_rows(w[f"{p}.k_proj.weight"], k_rows)
        super().__init__(
            q, k, w[f"{p}.v_proj.weight"], w[f"{p}.o_proj.weight"], dtype, quant, layer=layer,
            heads=heads, kv_heads=kv_heads, head_dim=hd, scale=cfg.attn_scale, rope=rope,
            q_norm=zero_centered_norm(w, f"{p}.q_norm", cfg, dtype, order),
            k_norm=zero_centered_norm(w, f"{p}.k_norm", cfg, dtype, order))
        self.qkv = layers.Linear.fused([q, k, w[f"{p}.v_proj.weight"], gate], dtype, quant)
        self.gate_width = heads * hd

    def __call__(self, x: mx.array, batch: layers.Batch, residual: mx.array | None = None,
                 norm: layers.Norm | None = None) -> mx.array:
        y = self.qkv(x, norm=norm)
        n = y.shape[1] - self.gate_width
        out = self._attend(y[:, :n], batch)
        return self.o(out * mx.sigmoid(y[:, n:]), residual)


class Block(decoder.PreNormBlock):
    """h = x + mixer(norm(x)), then h + mlp(norm(h)); the mixer a GatedDeltaNet or a
    GatedAttention. (Its own __call__: block.c computes neither mixer.)"""

    def __call__(self, x: mx.array, batch: layers.Batch) -> mx.array:
        h = self.attn(x, batch, residual=x, norm=self.in_norm)
        return self.mlp(h, residual=h, norm=self.post_norm, rows=batch.rows)


def mixer(cfg: Config, w: dict[str, Tensor], i: int, rope: layers.Rope, dtype: mx.Dtype,
          quant: bool) -> layers.Attention | deltanet.GatedDeltaNet:
    p = f"model.layers.{i}"
    if cfg.layer_types[i] == FULL:
        return GatedAttention(cfg, w, f"{p}.self_attn", cfg.attention_layers().index(i),
                              rope, dtype, quant)
    return deltanet.GatedDeltaNet(
        w, f"{p}.linear_attn", index=cfg.linear_layers().index(i),
        key_heads=cfg.linear_key_heads, value_heads=cfg.linear_value_heads,
        dk=cfg.linear_key_head_dim, dv=cfg.linear_value_head_dim, eps=cfg.rms_norm_eps,
        dtype=dtype, quant=quant, tiled_value_heads=cfg.value_heads_tiled)


def dense_mlp(w: dict[str, Tensor], p: str, dtype: mx.Dtype, quant: bool) -> layers.GatedMLP:
    return layers.GatedMLP(w[f"{p}.gate_proj.weight"], w[f"{p}.up_proj.weight"],
                           w[f"{p}.down_proj.weight"], layers.silu, dtype, quant)


def dense_block(cfg: Config, w: dict[str, Tensor], i: int, rope: layers.Rope,
                dtype: mx.Dtype, quant: bool) -> Block:
    p = f"model.layers.{i}"
    return Block(mixer(cfg, w, i, rope, dtype, quant), dense_mlp(w, f"{p}.mlp", dtype, quant),
                 zero_centered_norm(w, f"{p}.input_layernorm", cfg, dtype),
                 zero_centered_norm(w, f"{p}.post_attention_layernorm", cfg, dtype))


class Model(decoder.Decoder):
    """A hybrid decoder over a row batch; each sequence's KV is a deltanet.HybridKV (pages
    for the attention layers alone, plus the DeltaNet state)."""

    block: Callable[..., Block] = staticmethod(dense_block)

    def __init__(self, cfg: Config, w: dict[str, Tensor], dtype: mx.Dtype,
                 quant: bool) -> None:
        if not cfg.attention_layers() or not cfg.linear_layers():
            raise UnsupportedModelError(f"{cfg.family}: layer_types must hold both "
                                        f"{LINEAR!r} and {FULL!r} layers")
        self.rope = PartialRope(cfg, dtype)
        embed = layers.Embedding(w["model.embed_tokens.weight"], dtype, quant)
        blocks = [self.block(cfg, w, i, self.rope, dtype, quant) for i in range(cfg.num_layers)]
        head = w.get("lm_head.weight")
        lm_head = embed.as_linear() if head is None else layers.Linear(head, dtype, quant)
        super().__init__(cfg, dtype, embed, blocks,
                         zero_centered_norm(w, "model.norm", cfg, dtype), lm_head, [self.rope])
        first = next(b.attn for b in blocks if isinstance(b.attn, deltanet.GatedDeltaNet))
        assert isinstance(first, deltanet.GatedDeltaNet)
        self.state_shape = first.state_shape(len(cfg.linear_layers()))

    # the Batcher cuts prefill chunks at multiples of this (see slotserve.model.deltanet)
    prefill_align = deltanet.CHUNK

    def new_kv(self) -> deltanet.HybridKV:
        """A sequence's pages (attention layers only) and its recurrent state."""
        if self.kv_pool is None:
            c = self.config
            self.kv_pool = KVPool(len(c.attention_layers()),  # type: ignore[attr-defined]
                                  c.num_kv_heads, c.head_dim, self.dtype)
        return deltanet.HybridKV(self.kv_pool, self.state_shape)


# the (1 + w) norms, which mlx-lm stores as 1 + w when it converts a checkpoint
SHIFTED_NORMS = (".input_layernorm.weight", ".post_attention_layernorm.weight",
                 "model.norm.weight", ".q_norm.weight", ".k_norm.weight")


# llama.cpp's names of the hybrid layers' tensors (its convert_hf_to_gguf.py). Three differ
# from transformers' beyond the name, put right by `from_gguf`: ssm_a holds -exp(A_log),
# ssm_dt only a bias (dt_bias), and ssm_norm, the DeltaNet's gated norm, is read under
# another name because it alone is stored without the +1 of the zero-centered norms
# (Family.gguf_norm_offset takes the 1 back from every name ending in "norm").
GGUF_LAYER_NAMES = {
    "attn_qkv": "linear_attn.in_proj_qkv",
    "attn_gate": "linear_attn.in_proj_z",
    "ssm_alpha": "linear_attn.in_proj_a",
    "ssm_beta": "linear_attn.in_proj_b",
    "ssm_ba": "linear_attn.in_proj_ba",  # Qwen3-Next's b and a, grouped per key head
    "ssm_a": "linear_attn.ssm_a",
    "ssm_dt": "linear_attn.dt",
    "ssm_conv1d": "linear_attn.conv1d",
    "ssm_norm": "linear_attn.gated_norm_",
    "ssm_out": "linear_attn.out_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "post_attention_norm": "post_attention_layernorm",
}


def from_gguf(weights: dict[str, Tensor]) -> None:
    """A GGUF file's DeltaNet tensors under transformers' names and values."""
    for name in [n for n in weights if n.endswith(".linear_attn.ssm_a.weight")]:
        neg_a = weights.pop(name)
        assert isinstance(neg_a, mx.array)
        weights[name.replace("ssm_a.weight", "A_log")] = mx.log(-neg_a.astype(mx.float32))
    for name in [n for n in weights if n.endswith(".linear_attn.dt.bias")]:
        weights[name.replace("dt.bias", "dt_bias")] = weights.pop(name)
    for name in [n for n in weights if n.endswith(".linear_attn.gated_norm_.weight")]:
        weights[name.replace("gated_norm_", "norm")] = weights.pop(name)


def drop_unused(weights: dict[str, Tensor], cfg: ModelConfig) -> None:
    """Drop what the text decoder never reads: the multi-token-prediction head and the
    vision tower of the ForConditionalGeneration layout (transformers ignores them too).
    A checkpoint written by mlx-lm (its conv weights [D, K, 1], MLX's conv layout) holds its
    zero-centered norms as 1 + w: they are brought back to transformers' w. A GGUF file's
    tensors get transformers' names (`from_gguf`)."""
    for name in [n for n in weights
                 if n.startswith(("mtp.", "model.visual.", "visual.", "model.mtp."))]:
        del weights[name]
    from_gguf(weights)
    convs = [t for n, t in weights.items() if n.endswith("conv1d.weight")]
    if convs and convs[0].shape[-1] == 1 and convs[0].shape[1] > 1:
        for name in [n for n in weights if n.endswith(SHIFTED_NORMS)]:
            norm = weights[name]
            assert isinstance(norm, mx.array), "norm weights are never quantized"
            weights[name] = norm.astype(mx.float32) - 1.0


FAMILY = Family(
    name="qwen3_5",
    config=Config,
    model=Model,
    hf_architectures=("Qwen3_5ForCausalLM", "Qwen3_5ForConditionalGeneration"),
    hf_model_type="qwen3_5",
    gguf_architecture="qwen35",
    gguf_layer_names=GGUF_LAYER_NAMES,
    gguf_norm_offset=1.0,
    sanitize=drop_unused,
)
