"""Gemma 4 text family (gemma-4 E2B/E4B, 26B-A4B, 31B), numerically following HF's
Gemma4ForCausalLM and the text part of Gemma4ForConditionalGeneration.

What differs from Gemma 3: plain RMSNorms (the weight is the scale, not 1 + w); attention
unscaled (q and k are normed per head, v is normed without a scale); the global layers'
heads are wider and may be fewer (`per_layer_config`, or `global_head_dim` and
`num_global_key_value_heads`), rotated by proportional RoPE (only a leading fraction of the
frequencies turn) and, with `attention_k_eq_v`, take their values from the keys'
projection; the last `num_kv_shared_layers` layers compute no K/V and read those of the
last earlier layer of their kind (so they hold no pool memory); a per-layer input (a
token's own embedding slice plus a projection of its embedding) is gated into each
block's residual stream; a mixture of experts can run beside the dense MLP, each with its
own norms; every block's output is scaled by a learned scalar; the logits are capped.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar

import mlx.core as mx

from slotserve.model import decoder, layers, moe
from slotserve.model.config import ModelConfig
from slotserve.model.errors import UnsupportedModelError
from slotserve.model.families.gemma3 import FULL, MLP, SLIDING, layer_pattern
from slotserve.model.families.qwen3_moe import expert_weights
from slotserve.model.family import Family
from slotserve.model.kv import KVPool, SlotKV
from slotserve.model.weights import QuantizedWeight, Tensor

# the parts of a Gemma4ForConditionalGeneration checkpoint that are not its text decoder
NOT_TEXT = ("model.vision_tower.", "model.embed_vision.", "model.audio_tower.",
            "model.embed_audio.")

# what every Gemma 4 chat template writes: its turns, and its tool calls and results
TEMPLATE_MARKERS = ("<|turn>", "<turn|>", "<|tool_call>", "<tool_call|>", "<|tool_response>")


@dataclass
class Config(ModelConfig):
    sliding_window: int | None = None
    layer_types: list[str] = field(default_factory=list)  # SLIDING | FULL per layer
    rope_local_theta: float = 10000.0  # the sliding layers' RoPE base
    final_logit_softcapping: float | None = None
    global_head_dim: int = 0  # the full layers' head size (head_dim is the sliding one's)
    global_kv_heads: int = 0  # the full layers' kv heads
    attention_k_eq_v: bool = False  # full layers: values are the keys' projection
    num_kv_shared_layers: int = 0  # the last layers read earlier layers' K/V
    hidden_size_per_layer_input: int = 0  # per-layer input width (0: none)
    vocab_size_per_layer_input: int = 0
    enable_moe_block: bool = False
    num_experts: int = 0
    top_k_experts: int = 0
    moe_intermediate_size: int = 0
    use_double_wide_mlp: bool = False  # shared-K/V layers' MLPs are twice as wide
    # a GGUF file says nothing of attention_k_eq_v: its full layers simply lack attn_v, so it
    # is read off the tensors (text_decoder) before the model is built
    k_eq_v_from_tensors: bool = False

    tied_by_default: ClassVar[bool] = True

    @property
    def attn_scale(self) -> float:
        return 1.0  # q and k are normed per head instead

    def is_sliding(self, layer: int) -> bool:
        return self.layer_types[layer] == SLIDING

    def head_dim_of(self, layer: int) -> int:
        return self.head_dim if self.is_sliding(layer) else self.global_head_dim

    def kv_heads_of(self, layer: int) -> int:
        return self.num_kv_heads if self.is_sliding(layer) else self.global_kv_heads

    @property
    def first_shared(self) -> int:
        return self.num_layers - self.num_kv_shared_layers

    def kv_source(self, layer: int) -> int:
        """The layer whose K/V this layer attends over: itself, or for a shared layer the
        last layer of its kind before the shared ones (HF's kv_sharing_modes "store")."""
        if layer < self.first_shared:
            return layer
        kind = self.layer_types[layer]
        owners = [i for i in range(self.first_shared) if self.layer_types[i] == kind]
        if not owners:
            raise UnsupportedModelError(f"gemma4: shared layer {layer} ({kind}) has no "
                                        "earlier layer of its kind to read K/V from")
        return owners[-1]

    @classmethod
    def hf_fields(cls, cfg: dict[str, Any], num_layers: int) -> dict[str, Any]:
        unsupported = {
            "use_bidirectional_attention": cfg.get("use_bidirectional_attention") == "all",
            "attention_bias": bool(cfg.get("attention_bias")),
            "hidden_activation": cfg.get("hidden_activation",
                                         "gelu_pytorch_tanh") != "gelu_pytorch_tanh",
        }
        for key, bad in unsupported.items():
            if bad:
                raise UnsupportedModelError(f"gemma4: {key}={cfg.get(key)!r} is unsupported "
                                            "(supported: causal text, no attention bias, "
                                            "gelu_pytorch_tanh)")
        types = list(cfg.get("layer_types") or layer_pattern(num_layers))
        types[-1] = FULL  # as HF forces it
        rope = cfg.get("rope_parameters") or {}
        local = rope.get(SLIDING, {})
        if local.get("rope_type", "default") != "default":
            raise UnsupportedModelError(f"gemma4: sliding-layer RoPE {local!r} is unsupported "
                                        "(supported: default)")
        k_eq_v = bool(cfg.get("attention_k_eq_v", False))
        heads, dims = cls._per_layer(cfg, types, k_eq_v)
        shared = int(cfg.get("num_kv_shared_layers") or 0)
        if shared >= num_layers:
            raise UnsupportedModelError("gemma4: every layer reads shared K/V; "
                                        "supported: num_kv_shared_layers < num_hidden_layers")
        return dict(
            sliding_window=cfg.get("sliding_window"),
            layer_types=types,
            rope_local_theta=float(local.get("rope_theta", 10000.0)),
            final_logit_softcapping=cfg.get("final_logit_softcapping"),
            global_head_dim=dims[FULL],
            global_kv_heads=heads[FULL],
            attention_k_eq_v=k_eq_v,
            num_kv_shared_layers=shared,
            hidden_size_per_layer_input=int(cfg.get("hidden_size_per_layer_input") or 0),
            vocab_size_per_layer_input=int(cfg.get("vocab_size_per_layer_input")
                                           or cfg["vocab_size"]),
            enable_moe_block=bool(cfg.get("enable_moe_block", False)),
            num_experts=int(cfg.get("num_experts") or 0),
            top_k_experts=int(cfg.get("top_k_experts") or 0),
            moe_intermediate_size=int(cfg.get("moe_intermediate_size") or 0),
            use_double_wide_mlp=bool(cfg.get("use_double_wide_mlp", False)),
        )

    @staticmethod
    def _per_layer(cfg: dict[str, Any], types: list[str],
                   k_eq_v: bool) -> tuple[dict[str, int], dict[str, int]]:
        """(kv heads, head size) of each kind of layer, as HF's Gemma4TextConfig resolves
        them: an explicit per_layer_config, else global_head_dim (512 unless given) and, with
        attention_k_eq_v, num_global_key_value_heads for the full layers."""
        base_heads = cfg.get("num_key_value_heads", cfg["num_attention_heads"])
        base_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
        table = cfg.get("per_layer_config")
        if table is None:
            glob: dict[str, Any] = {"head_dim": cfg.get("global_head_dim") or 512}
            if k_eq_v and cfg.get("num_global_key_value_heads") is not None:
                glob["num_key_value_heads"] = cfg["num_global_key_value_heads"]
            table = {str(i): glob for i, t in enumerate(types) if t == FULL}
        found: dict[str, set[tuple[int, int]]] = {SLIDING: set(), FULL: set()}
        for i, kind in enumerate(types):
            own = table.get(str(i)) or table.get(i) or {}  # type: ignore[call-overload]
            found[kind].add((int(own.get("num_key_value_heads", base_heads)),
                             int(own.get("head_dim", base_dim))))
        if any(len(v) > 1 for v in found.values()):
            raise UnsupportedModelError(f"gemma4: layers of one kind differ in shape {found}; "
                                        "supported: one (kv heads, head_dim) per kind")
        shape = {k: next(iter(v), (base_heads, base_dim)) for k, v in found.items()}
        return {k: s[0] for k, s in shape.items()}, {k: s[1] for k, s in shape.items()}

    @classmethod
    def gguf_fields(cls, get: Callable[..., Any], common: dict[str, Any]) -> dict[str, Any]:
        """As llama.cpp's converter writes Gemma 4 (conversion/gemma.py, Gemma4Model): the
        layer kinds as a per-layer `sliding_window_pattern`, kv heads per layer, the global
        head size as `key_length` and the sliding one as `key_length_swa`, MLP widths per
        layer (double-wide shared layers), and the global layers' proportional RoPE as the
        `rope_freqs` tensor (divisor 1 for the frequencies that turn, 1e30 for the rest)."""
        n = common["num_layers"]
        pattern = get("attention.sliding_window_pattern")
        if not isinstance(pattern, mx.array) or pattern.size != n:
            raise UnsupportedModelError("gemma4 GGUF: attention.sliding_window_pattern is not "
                                        "a per-layer list; supported: llama.cpp's converter's")
        types = [SLIDING if bool(x) else FULL for x in pattern.tolist()]
        kv = get("attention.head_count_kv", common["num_kv_heads"])
        kv = [int(h) for h in kv.tolist()] if isinstance(kv, mx.array) else [int(kv)] * n
        heads = {kind: {h for h, t in zip(kv, types, strict=True) if t == kind}
                 for kind in (SLIDING, FULL)}
        dims = {SLIDING: int(get("attention.key_length_swa") or common["head_dim"]),
                FULL: int(get("attention.key_length") or common["head_dim"])}
        values = {SLIDING: get("attention.value_length_swa"), FULL: get("attention.value_length")}
        if any(len(h) > 1 for h in heads.values()) or any(
                v is not None and int(v) != dims[k] for k, v in values.items()):
            raise UnsupportedModelError(f"gemma4 GGUF: kv heads {kv}, key/value lengths "
                                        f"{dims}/{values}; supported: one shape per layer kind, "
                                        "values as long as keys")
        if int(get("rope.dimension_count_swa") or dims[SLIDING]) != dims[SLIDING]:
            raise UnsupportedModelError("gemma4 GGUF: partial RoPE on sliding layers is "
                                        "unsupported (supported: the whole head)")
        shared = int(get("attention.shared_kv_layers") or 0)
        ff = get("feed_forward_length", common["intermediate_size"])
        ff = [int(f) for f in ff.tolist()] if isinstance(ff, mx.array) else [int(ff)] * n
        experts = int(get("expert_count") or 0)
        cap = get("final_logit_softcapping")
        window = get("attention.sliding_window")
        return dict(
            head_dim=dims[SLIDING], num_kv_heads=next(iter(heads[SLIDING]), kv[0]),
            intermediate_size=ff[0],
            rope_scaling=cls._gguf_rope(common["rope_scaling"], dims[FULL]),
            sliding_window=int(window) if window else None, layer_types=types,
            rope_local_theta=float(get("rope.freq_base_swa", 10000.0)),
            final_logit_softcapping=float(cap) if cap else None,
            global_head_dim=dims[FULL], global_kv_heads=next(iter(heads[FULL]), kv[0]),
            num_kv_shared_layers=shared, k_eq_v_from_tensors=True,
            hidden_size_per_layer_input=int(get("embedding_length_per_layer_input") or 0),
            vocab_size_per_layer_input=common["vocab_size"],
            enable_moe_block=experts > 0, num_experts=experts,
            top_k_experts=int(get("expert_used_count") or 0),
            moe_intermediate_size=int(get("expert_feed_forward_length") or 0),
            use_double_wide_mlp=ff[-1] == 2 * ff[0] and shared > 0,
        )

    @staticmethod
    def _gguf_rope(scaling: dict[str, Any] | None, head_dim: int) -> dict[str, Any] | None:
        """The global layers' RoPE from the converter's rope_freqs divisors: the leading
        frequencies divided by 1 turn, the rest (divided by 1e30) stand still, which is HF's
        proportional RoPE with partial_rotary_factor = 2 * turning / head_dim (there they are
        exactly 0, as here)."""
        if scaling is None:
            return None
        factors = scaling.get("factors") if scaling.get("rope_type") == "freq_factors" else None
        if factors is None or len(factors) != head_dim // 2:
            raise UnsupportedModelError(f"gemma4 GGUF: global-layer RoPE {scaling!r}; "
                                        "supported: the converter's proportional rope_freqs")
        turning = sum(1 for f in factors if f == 1.0)
        if factors[:turning] != [1.0] * turning or any(f < 1e29 for f in factors[turning:]):
            raise UnsupportedModelError("gemma4 GGUF: rope_freqs is not 1s then 1e30s; "
                                        "supported: the converter's proportional RoPE")
        return {"rope_type": "proportional", "partial_rotary_factor": 2 * turning / head_dim}

    def hf_keys(self) -> dict[str, Any]:
        full = [i for i in range(self.num_layers) if not self.is_sliding(i)]
        return dict(
            hidden_activation="gelu_pytorch_tanh", sliding_window=self.sliding_window,
            layer_types=self.layer_types,
            rope_parameters={
                SLIDING: {"rope_type": "default", "rope_theta": self.rope_local_theta},
                FULL: {**(self.rope_scaling or {"rope_type": "default"}),
                       "rope_theta": self.rope_theta},
            },
            per_layer_config={str(i): {"head_dim": self.global_head_dim,
                                       "num_key_value_heads": self.global_kv_heads}
                              for i in full},
            final_logit_softcapping=self.final_logit_softcapping,
            attention_k_eq_v=self.attention_k_eq_v,
            num_kv_shared_layers=self.num_kv_shared_layers,
            hidden_size_per_layer_input=self.hidden_size_per_layer_input,
            vocab_size_per_layer_input=self.vocab_size_per_layer_input,
            enable_moe_block=self.enable_moe_block, num_experts=self.num_experts,
            top_k_experts=self.top_k_experts, moe_intermediate_size=self.moe_intermediate_size,
            use_double_wide_mlp=self.use_double_wide_mlp,
        )


def norm(w: dict[str, Tensor], name: str, cfg: Config, dtype: mx.Dtype) -> layers.RMSNorm:
    weight = w[f"{name}.weight"]
    assert isinstance(weight, mx.array), "norm weights are never quantized"
    return layers.RMSNorm(weight.astype(dtype), cfg.rms_norm_eps)


class UnitNorm(layers.Layer):
    """An RMS norm without a scale (Gemma 4's value heads)."""

    def __init__(self, eps: float) -> None:
        self.eps = eps

    def __call__(self, x: mx.array) -> mx.array:
        return mx.fast.rms_norm(x, None, self.eps)


class Lookup(layers.Layer):
    """A table only ever read by row, kept as stored (no matmul layout of it): the per-layer
    input table, [vocab, layers * width], E2B's and E4B's largest tensor."""

    def __init__(self, table: Tensor, dtype: mx.Dtype) -> None:
        self.table, self.dtype = table, dtype

    def __call__(self, tokens: mx.array) -> mx.array:
        t = self.table
        if isinstance(t, QuantizedWeight):
            return mx.dequantize(t.weight[tokens], t.scales[tokens], t.biases[tokens],
                                 group_size=t.group_size, bits=t.bits).astype(self.dtype)
        return t[tokens].astype(self.dtype)

    def arrays(self) -> list[mx.array]:
        t = self.table
        return [t.weight, t.scales, t.biases] if isinstance(t, QuantizedWeight) else [t]


class Attention(layers.SharedKVAttention):
    """Sliding or global attention of layer i, over its own K/V or a shared layer's."""

    def __init__(self, cfg: Config, w: dict[str, Tensor], i: int, pool_layer: int,
                 rope: layers.Rope, dtype: mx.Dtype, quant: bool) -> None:
        p, eps = f"model.layers.{i}.self_attn", cfg.rms_norm_eps
        writes = cfg.kv_source(i) == i
        values = writes and not (cfg.attention_k_eq_v and not cfg.is_sliding(i))
        super().__init__(
            w[f"{p}.q_proj.weight"], w[f"{p}.k_proj.weight"] if writes else None,
            w[f"{p}.v_proj.weight"] if values else None, w[f"{p}.o_proj.weight"], dtype,
            quant, layer=pool_layer, heads=cfg.num_heads, kv_heads=cfg.kv_heads_of(i),
            head_dim=cfg.head_dim_of(i), scale=cfg.attn_scale, rope=rope,
            q_norm=norm(w, f"{p}.q_norm", cfg, dtype),
            k_norm=norm(w, f"{p}.k_norm", cfg, dtype) if writes else None,
            v_norm=UnitNorm(eps) if writes else None,
            window=cfg.sliding_window if cfg.is_sliding(i) else None,
            backend_dim=max(cfg.head_dim, cfg.global_head_dim),
        )


class Experts(moe.SparseMoE):
    """The experts beside the dense MLP: the router reads the block's residual stream
    (RMS-normed times its scale and 1/sqrt(hidden)), keeps the top k of a softmax over all
    experts renormalized, each times its expert's own scale; the experts read that stream
    through their own pre-norm; tanh-GELU gated units."""

    def __init__(self, cfg: Config, w: dict[str, Tensor], p: str, dtype: mx.Dtype,
                 quant: bool) -> None:
        gate_up, down = expert_weights(w, p)
        super().__init__(w[f"{p}.router.proj.weight"], gate_up, down,
                         inter=cfg.moe_intermediate_size, top_k=cfg.top_k_experts,
                         norm_topk=True, dtype=dtype, keep_quantized=quant,
                         act=layers.gelu_tanh)
        self.router_scale = (w[f"{p}.router.scale"].astype(mx.float32)  # type: ignore[union-attr]
                             * cfg.hidden_size**-0.5).astype(dtype)
        self.expert_scale = w[f"{p}.router.per_expert_scale"].astype(dtype)  # type: ignore[union-attr]
        self.eps = cfg.rms_norm_eps

    def route(self, x: mx.array) -> tuple[mx.array, mx.array]:
        experts, weights = super().route(mx.fast.rms_norm(x, self.router_scale, self.eps))
        return experts, weights * self.expert_scale[experts]

    def __call__(self, x: mx.array, residual: mx.array | None = None,
                 norm: layers.Norm | None = None, rows: int | None = None) -> mx.array:
        """The router reads x itself, the experts norm(x)."""
        experts, weights = self.route(x)
        return layers.plus(self.mix(layers.normed(x, norm), experts, weights, rows), residual)

    def arrays(self) -> list[mx.array]:
        return [*super().arrays(), self.router_scale, self.expert_scale]


class Block(layers.Layer):
    """h = x + norm(attn(norm(x))); h + norm(mlp(norm(h)) [+ its experts' share]); then the
    layer's own input gated in; the whole times the layer scalar."""

    def __init__(self, cfg: Config, w: dict[str, Tensor], i: int, pool_layer: int,
                 rope: layers.Rope, dtype: mx.Dtype, quant: bool) -> None:
        p = f"model.layers.{i}"
        self.attn = Attention(cfg, w, i, pool_layer, rope, dtype, quant)
        self.mlp = MLP(w, f"{p}.mlp", dtype, quant)
        self.in_norm = norm(w, f"{p}.input_layernorm", cfg, dtype)
        self.post_attn_norm = norm(w, f"{p}.post_attention_layernorm", cfg, dtype)
        self.pre_mlp_norm = norm(w, f"{p}.pre_feedforward_layernorm", cfg, dtype)
        self.post_mlp_norm = norm(w, f"{p}.post_feedforward_layernorm", cfg, dtype)
        self.experts: Experts | None = None
        self.moe_norms: list[layers.RMSNorm] = []
        if cfg.enable_moe_block:
            self.experts = Experts(cfg, w, p, dtype, quant)
            self.moe_norms = [norm(w, f"{p}.{n}", cfg, dtype) for n in (
                "post_feedforward_layernorm_1", "pre_feedforward_layernorm_2",
                "post_feedforward_layernorm_2")]
        self.gate: layers.Linear | None = None
        self.extra: list[layers.Layer] = []
        if cfg.hidden_size_per_layer_input:
            self.gate = layers.Linear(w[f"{p}.per_layer_input_gate.weight"], dtype, quant)
            self.project = layers.Linear(w[f"{p}.per_layer_projection.weight"], dtype, quant)
            self.post_extra_norm = norm(w, f"{p}.post_per_layer_input_norm", cfg, dtype)
            self.extra = [self.gate, self.project, self.post_extra_norm]
        scalar = w[f"{p}.layer_scalar"]
        assert isinstance(scalar, mx.array), "the layer scalar is never quantized"
        self.scalar = scalar.astype(dtype)

    def __call__(self, x: mx.array, batch: layers.Batch,
                 extra: mx.array | None = None) -> mx.array:
        """extra: this layer's per-layer input rows [R, width] (models that have them)."""
        h = x + self.post_attn_norm(self.attn(x, batch, norm=self.in_norm))
        y = self.mlp(h, norm=self.pre_mlp_norm)
        if self.experts is not None:
            post_dense, pre_experts, post_experts = self.moe_norms
            y = post_dense(y) + post_experts(self.experts(h, norm=pre_experts,
                                                          rows=batch.rows))
        h = h + self.post_mlp_norm(y)
        if self.gate is not None:
            assert extra is not None
            gated = layers.gelu_tanh(self.gate(h)) * extra
            h = h + self.post_extra_norm(self.project(gated))
        return h * self.scalar

    def parts(self) -> list[layers.Layer]:
        moe_parts: list[layers.Layer] = [] if self.experts is None else [self.experts]
        return [self.attn, self.mlp, self.in_norm, self.post_attn_norm, self.pre_mlp_norm,
                self.post_mlp_norm, *moe_parts, *self.moe_norms, *self.extra]

    def arrays(self) -> list[mx.array]:
        return [*super().arrays(), self.scalar]


class Model(decoder.Decoder):
    """Gemma 4 over a row batch: the pool holds the layers that write K/V only, each in its
    own (kv heads, head_dim); the lm_head is the (unscaled) embedding table."""

    def __init__(self, cfg: Config, w: dict[str, Tensor], dtype: mx.Dtype,
                 quant: bool) -> None:
        self.rope = layers.Rope(cfg.global_head_dim, cfg.rope_theta, cfg.rope_scaling, dtype)
        self.local_rope = layers.Rope(cfg.head_dim, cfg.rope_local_theta, None, dtype)
        embed = layers.Embedding(w["model.embed_tokens.weight"], dtype, quant)
        self.embed_scale = mx.array(math.sqrt(cfg.hidden_size), dtype=dtype)
        owners = [i for i in range(cfg.num_layers) if cfg.kv_source(i) == i]
        self.kv_shapes = [(cfg.kv_heads_of(i), cfg.head_dim_of(i)) for i in owners]
        blocks = [Block(cfg, w, i, owners.index(cfg.kv_source(i)),
                        self.local_rope if cfg.is_sliding(i) else self.rope, dtype, quant)
                  for i in range(cfg.num_layers)]
        head = w.get("lm_head.weight")
        lm_head = embed.as_linear() if head is None else layers.Linear(head, dtype, quant)
        super().__init__(cfg, dtype, embed, blocks, norm(w, "model.norm", cfg, dtype), lm_head,
                         [self.rope, self.local_rope])
        self.softcap = cfg.final_logit_softcapping
        self.width = cfg.hidden_size_per_layer_input
        self.extra_parts: list[layers.Layer] = []
        if self.width:
            self.extra_embed = Lookup(w["model.embed_tokens_per_layer.weight"], dtype)
            self.extra_scale = mx.array(math.sqrt(self.width), dtype=dtype)
            self.extra_project = layers.Linear(w["model.per_layer_model_projection.weight"],
                                               dtype, quant)
            self.extra_norm = norm(w, "model.per_layer_projection_norm", cfg, dtype)
            self.extra_parts = [self.extra_embed, self.extra_project, self.extra_norm]

    def new_kv(self) -> SlotKV:
        if self.kv_pool is None:
            self.kv_pool = KVPool.of_shapes(self.kv_shapes, self.dtype, **self.windowing())
        return SlotKV(self.kv_pool)

    def parts(self) -> list[layers.Layer]:
        return [*super().parts(), *self.extra_parts]

    def embed_tokens(self, tokens: mx.array) -> mx.array:
        return self.embed(tokens) * self.embed_scale

    def layer_inputs(self, tokens: mx.array, x: mx.array) -> mx.array:
        """Every layer's own input rows [R, layers, width]: the token's slice of the
        per-layer table (scaled by sqrt(width)) and the normed projection of its embedding
        (scaled by 1/sqrt(hidden)), averaged in the 1/sqrt(2) sense as HF does."""
        r, n = x.shape[0], self.config.num_layers
        own = (self.extra_embed(tokens) * self.extra_scale).reshape(r, n, self.width)
        proj = self.extra_project(x) * (self.config.hidden_size**-0.5)
        proj = self.extra_norm(proj.reshape(r, n, self.width))
        return (proj + own) * (2.0**-0.5)

    def __call__(self, tokens: mx.array, batch: layers.Batch,
                 logit_rows: list[int]) -> mx.array | None:
        """Run R token rows; float32 logits (tanh-capped when configured) for logit_rows."""
        tokens = batch.pad_tokens(tokens)
        x = self.embed_tokens(tokens)
        extra = self.layer_inputs(tokens, x) if self.width else None
        for i, layer in enumerate(self.layers):
            x = layer(x, batch, None if extra is None else extra[:, i])  # type: ignore[call-arg]
        if not logit_rows:
            return None
        x = x[mx.array(logit_rows, dtype=mx.int32)]
        logits = self.lm_head(layers.pad_rows(x), norm=self.norm)[: len(logit_rows)]
        logits = logits.astype(mx.float32)
        if not self.softcap:
            return logits
        return mx.tanh(logits / self.softcap) * self.softcap


# llama.cpp's block tensors under HF's names (the rest of weights.GGUF_LAYER_NAMES holds)
GGUF_LAYER_NAMES = {
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
    "post_ffw_norm_1": "post_feedforward_layernorm_1",
    "pre_ffw_norm_2": "pre_feedforward_layernorm_2",
    "post_ffw_norm_2": "post_feedforward_layernorm_2",
    "ffn_gate_inp": "router.proj",
    "ffn_gate_up_exps": "experts.gate_up_proj",
    "ffn_down_exps": "experts.down_proj",
    "layer_output_scale": "layer_scalar",
    "inp_gate": "per_layer_input_gate",
    "proj": "per_layer_projection",
    "post_norm": "post_per_layer_input_norm",
}
GGUF_TOP_NAMES = {
    "per_layer_token_embd": "model.embed_tokens_per_layer",
    "per_layer_model_proj": "model.per_layer_model_projection",
    "per_layer_proj_norm": "model.per_layer_projection_norm",
}
# (name ending as read from GGUF, HF's): tensors HF keeps without ".weight", and the router's
# scales, which llama.cpp stores beside the router and the experts' down projections
GGUF_RENAMES = (
    (".layer_scalar.weight", ".layer_scalar"),
    (".experts.gate_up_proj.weight", ".experts.gate_up_proj"),
    (".experts.down_proj.weight", ".experts.down_proj"),
    (".router.proj.scale", ".router.scale"),
    (".experts.down_proj.scale", ".router.per_expert_scale"),
)


def text_decoder(weights: dict[str, Tensor], cfg: ModelConfig) -> None:
    """Keep the text decoder's tensors: drop a multimodal checkpoint's vision and audio
    towers, and the K/V projections shared layers still carry (HF ignores them too); read
    mlx-lm's expert stacks (`experts.switch_glu.<proj>`) as stacked `experts.<proj>`, and
    llama.cpp's names (GGUF_RENAMES; attention_k_eq_v from its full layers' missing
    attn_v)."""
    assert isinstance(cfg, Config)
    for name in list(weights):  # llama.cpp's names for what HF stores without ".weight"
        for stored, held in GGUF_RENAMES:
            if name.endswith(stored):
                weights[name.removesuffix(stored) + held] = weights.pop(name)
                break
    if cfg.k_eq_v_from_tensors:
        full = [i for i in range(cfg.first_shared) if not cfg.is_sliding(i)]
        cfg.attention_k_eq_v = bool(full) and all(
            f"model.layers.{i}.self_attn.v_proj.weight" not in weights for i in full)
        cfg.k_eq_v_from_tensors = False
    shared = [f"model.layers.{i}.self_attn.{name}" for i in range(cfg.first_shared,
                                                                   cfg.num_layers)
              for name in ("k_proj", "v_proj", "k_norm", "v_norm")]
    for name in list(weights):
        if name.startswith(NOT_TEXT) or name.rsplit(".", 1)[0] in shared:
            del weights[name]
        elif ".experts.switch_glu." in name:
            weights[name.replace(".switch_glu.", ".")] = weights.pop(name)


FAMILY = Family(
    name="gemma4",
    config=Config,
    model=Model,
    hf_architectures=("Gemma4ForCausalLM", "Gemma4ForConditionalGeneration"),
    hf_model_type="gemma4_text",
    gguf_architecture="gemma4",
    gguf_layer_names=GGUF_LAYER_NAMES,
    gguf_top_names=GGUF_TOP_NAMES,
    sanitize=text_decoder,
    template_markers=TEMPLATE_MARKERS,
)
