"""Gemma 3 text family (gemma-3-270m and up), numerically following HF's Gemma3ForCausalLM.

What differs from llama: embeddings scaled by sqrt(hidden); RMSNorm weights act as
(1 + w) in float32; per-head q/k norms; four norms per block (the attention and MLP
outputs are normed before their residual adds); a tanh-GELU MLP; sliding-window
layers interleaved with global ones, each kind with its own RoPE table; an
optional tanh cap on the final logits.
"""

from __future__ import annotations

import math

import mlx.core as mx

from slotserve.model.config import ModelConfig
from slotserve.model.families import llama
from slotserve.model.layers import Batch, Embedding, Linear, Rope, attend, pad_rows
from slotserve.model.weights import Tensor


class GemmaNorm:
    """RMSNorm with a (1 + w) scale, computed in float32 as HF does (w is stored centred)."""

    def __init__(self, weight: Tensor, eps: float) -> None:
        assert isinstance(weight, mx.array), "norm weights are never quantized"
        self.scale = 1.0 + weight.astype(mx.float32)
        self.eps = eps

    def __call__(self, x: mx.array) -> mx.array:
        return mx.fast.rms_norm(x.astype(mx.float32), self.scale, self.eps).astype(x.dtype)


def gelu_tanh(x: mx.array) -> mx.array:
    """HF's gelu_pytorch_tanh."""
    return 0.5 * x * (1.0 + mx.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x * x * x)))


class Attention(llama.Attention):
    """Llama attention plus per-head q/k norms before RoPE and an optional sliding window."""

    def __init__(self, cfg: ModelConfig, w: dict[str, Tensor], p: str, dtype: mx.Dtype,
                 quant: bool, window: int | None) -> None:
        super().__init__(cfg, w, p, dtype, quant)
        self.q_norm = GemmaNorm(w[f"{p}.q_norm.weight"], cfg.rms_norm_eps)
        self.k_norm = GemmaNorm(w[f"{p}.k_norm.weight"], cfg.rms_norm_eps)
        self.window = window

    def __call__(self, x: mx.array, batch: Batch, layer: int, cos: mx.array,
                 sin: mx.array) -> mx.array:
        q, k, v = self.split_heads(x)
        q = Rope.apply(self.q_norm(q), cos, sin)
        k = Rope.apply(self.k_norm(k), cos, sin)
        out = attend(q, k, v, batch, layer, self.scale, self.window)
        return self.o(out.reshape(out.shape[0], -1))


class MLP(llama.MLP):
    def __call__(self, x: mx.array) -> mx.array:
        gu = self.gate_up(x)
        return self.down(gelu_tanh(gu[:, : self.inter]) * gu[:, self.inter :])


class Block:
    def __init__(self, cfg: ModelConfig, w: dict[str, Tensor], i: int, dtype: mx.Dtype,
                 quant: bool) -> None:
        p = f"model.layers.{i}"
        self.sliding = cfg.is_sliding(i)
        window = cfg.sliding_window if self.sliding else None
        self.attn = Attention(cfg, w, f"{p}.self_attn", dtype, quant, window)
        self.mlp = MLP(w, f"{p}.mlp", dtype, quant)
        eps = cfg.rms_norm_eps
        self.in_norm = GemmaNorm(w[f"{p}.input_layernorm.weight"], eps)
        self.post_attn_norm = GemmaNorm(w[f"{p}.post_attention_layernorm.weight"], eps)
        self.pre_mlp_norm = GemmaNorm(w[f"{p}.pre_feedforward_layernorm.weight"], eps)
        self.post_mlp_norm = GemmaNorm(w[f"{p}.post_feedforward_layernorm.weight"], eps)

    def __call__(self, x: mx.array, batch: Batch, layer: int, cos: mx.array,
                 sin: mx.array, rope: Rope | None = None) -> mx.array:
        h = x + self.post_attn_norm(self.attn(self.in_norm(x), batch, layer, cos, sin))
        return h + self.post_mlp_norm(self.mlp(self.pre_mlp_norm(h)))


class Model(llama.Model):
    """Gemma 3 over a row batch; the lm_head is the (unscaled) embedding table."""

    block_class = Block

    def __init__(self, cfg: ModelConfig, w: dict[str, Tensor], dtype: mx.Dtype,
                 quant: bool) -> None:
        self.config, self.dtype = cfg, dtype
        self.embed = Embedding(w["model.embed_tokens.weight"], dtype, quant)
        # HF rounds the scale to the compute dtype before multiplying; so do we
        self.embed_scale = mx.array(math.sqrt(cfg.hidden_size), dtype=dtype)
        self.layers = [self.block_class(cfg, w, i, dtype, quant) for i in range(cfg.num_layers)]
        self.final_norm = GemmaNorm(w["model.norm.weight"], cfg.rms_norm_eps)
        head = w.get("lm_head.weight")
        self.lm_head = self.embed.as_linear() if head is None else Linear(head, dtype, quant)
        self.rope = Rope(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling, dtype)
        self.local_rope = Rope(cfg.head_dim, cfg.rope_local_theta, None, dtype)
        self.softcap = cfg.final_logit_softcapping

    def embed_tokens(self, tokens: mx.array) -> mx.array:
        return self.embed(tokens) * self.embed_scale

    def __call__(self, tokens: mx.array, batch: Batch, logit_rows: list[int]) -> mx.array | None:
        """Run R token rows; return float32 logits for the rows in logit_rows (None if empty).

        Rows not in logit_rows still write their K/V into their slots.
        """
        max_pos = max(s.start + s.length for s in batch.segments)
        tables = {
            False: self.rope.tables(batch.positions, max_pos),
            True: self.local_rope.tables(batch.positions, max_pos),
        }
        x = self.embed_tokens(batch.pad_tokens(tokens))
        for i, layer in enumerate(self.layers):
            x = layer(x, batch, i, *tables[layer.sliding])
        if not logit_rows:
            return None
        x = x[mx.array(logit_rows, dtype=mx.int32)]
        logits = self.lm_head(self.final_norm(pad_rows(x)))[: len(logit_rows)]
        logits = logits.astype(mx.float32)
        if self.softcap:
            logits = mx.tanh(logits / self.softcap) * self.softcap
        return logits
