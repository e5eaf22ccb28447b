"""DeepSeek-V4 family (DeepseekV4ForCausalLM), numerically following transformers 5.x.

What the model computes (transformers' modeling_deepseek_v4, the paper's section in brackets):

- **Hyper-connections** (mHC, 2.2): the residual is `hc_mult` streams [R, hc, D]. Before
  each attention and MoE block a small float32 projection of the normed streams gives
  `pre` (collapse the streams into the block's input), `post` (spread its output back)
  and `comb` (mix the streams; made doubly stochastic by Sinkhorn-Knopp iterations); the
  model's last streams are collapsed by the hyper-head before the final norm.
- **Attention** (2.3): a low-rank query (q_a -> RMS norm -> q_b, each head RMS-normed
  without weight), one shared K=V head (kv_proj + norm), interleaved RoPE on the *trailing*
  `qk_rope_head_dim` channels of each head, a learned sink logit per head, the output
  rotated back by its query position and projected by the grouped output linear (o_a per
  head group, then o_b). Every layer attends its last `sliding_window` positions; besides:
  - `compressed_sparse_attention` (CSA, m = 4): a compressor pools every window of m
    positions into one entry (a softmax-gated sum over the window's own second half-series
    and the previous window's first one: width 2m, stride m), and the Lightning Indexer
    (its own compressor at `index_head_dim`, queries from the low-rank query) picks the
    `index_topk` entries each query attends;
  - `heavily_compressed_attention` (HCA, m' = 128): one entry per window of m' positions,
    every closed window attended.
  Sliding layers rotate by the "main" RoPE (rope_theta), compressed ones and their
  compressors by the "compress" one (compress_rope_theta, YaRN when configured).
- **MoE** (2.1): routed experts with a clamped SwiGLU (swiglu_limit) and one shared
  expert; the router scores by `scoring_func` (sqrt-softplus), picks the top k by score +
  a correction bias, weights by the renormalized scores times `routed_scaling_factor`;
  `hash_moe` layers pick their experts by a fixed table of the input token (`tid2eid`).

What a sequence keeps (its `CompressedKV`), by how it grows:

- **Pages** (`KVPool`, one pool layer per compressed layer): the compressed entries, CSA's
  with their indexer key beside them. A page of BLOCK positions holds the entries of the
  BLOCK / m windows inside it (m divides BLOCK), written when their window closes, so a
  full page depends on the tokens up to its end alone and the prefix cache shares it like
  any K/V page. A window's entry is stored in the pool rows of the window's own positions
  (half in the keys array, half in the values array: `EntryLayout`), so a page costs
  exactly its entries (per layer and position: head_dim / 128 values for HCA,
  (head_dim + index_head_dim) / 4 for CSA, against head_dim uncompressed), and copying a
  page's first positions copies the entries of the windows closed there.
- **A fixed per-slot state** (`LayerState`, a floor per busy slot in the KV budget): every
  layer's last `sliding_window - 1` K=V rows, each compressor's open window (the positions
  since the last close, at most m - 1) and, for CSA, the previous window's first
  half-series. It cannot be cut at an arbitrary position, so it is kept as the hybrid
  families keep their recurrent state (deltanet.RecurrentState, state versions by
  position, snapshots at page boundaries in the prefix cache: actors.state_snapshots).

Every position is computed by the same operations in any batch, chunk or resume: windows
are pooled per window, attention reads fixed-shape blocks (the W window keys, entries in
blocks of ENTRY_BLOCK at fixed offsets, summed in order: a masked block adds exact zeros)
and the indexer's choice is a stable sort of scores that depend on the entry alone (equal
scores go to the earlier entry; transformers' torch.topk may pick another). Attention and
the indexer's scores run over tiles of ROW_TILE rows (a segment's rows zero-padded to whole
tiles), one entry block (ENTRY_BLOCK) or index group (INDEX_GROUP) per product, so every
matmul a row's output depends on has one shape whatever the segment's length, the chunk
or the context: MLX's GPU matmuls (cuBLAS) pick their algorithm, and so their rounding, by
the whole product's shape and batch count, and a segment of 86 rows would otherwise round
a row's attention unlike one of 150 or a decode step. So every state is canonical (a
decode row's bits are a prefill's) and a snapshot may be taken at any page boundary.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
import numpy as np

from slotserve.kernels.attention import BLOCK
from slotserve.model import decoder, layers, moe
from slotserve.model.config import ModelConfig
from slotserve.model.deltanet import STATE_VERSIONS, RecurrentState
from slotserve.model.errors import UnsupportedModelError
from slotserve.model.family import Family
from slotserve.model.kv import KVPool, SlotKV
from slotserve.model.weights import QuantizedWeight, Tensor

SLIDING, CSA, HCA = ("sliding_attention", "compressed_sparse_attention",
                     "heavily_compressed_attention")
HASH_MOE, MOE = "hash_moe", "moe"
ENTRY_BLOCK = 128  # compressed entries per attention / indexer block (fixed shapes)
ROW_TILE = 8  # rows per attention product (the module doc: fixed shapes on every device)
INDEX_GROUP = 8 * ENTRY_BLOCK  # compressed entries per indexer score product


@dataclass
class Config(ModelConfig):
    layer_types: list[str] = field(default_factory=list)
    mlp_layer_types: list[str] = field(default_factory=list)
    compress_rates: dict[str, int] = field(default_factory=dict)
    rope_dim: int = 64  # qk_rope_head_dim: the trailing channels of a head that rotate
    compress_rope_theta: float = 160000.0
    compress_rope_scaling: dict[str, Any] | None = None
    q_lora_rank: int = 1024
    o_groups: int = 8
    o_lora_rank: int = 1024
    sliding_window: int = 128
    hc_mult: int = 4
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1e-6
    index_n_heads: int = 64
    index_head_dim: int = 128
    index_topk: int = 512
    num_experts: int = 256
    experts_per_token: int = 6
    moe_intermediate_size: int = 2048
    scoring_func: str = "sqrtsoftplus"
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.5
    swiglu_limit: float = 10.0

    @classmethod
    def hf_fields(cls, cfg: dict[str, Any], num_layers: int) -> dict[str, Any]:
        rope = cfg.get("rope_parameters") or {}
        main, comp = rope.get("main") or {}, rope.get("compress") or {}
        partial = float(main.get("partial_rotary_factor")
                        or cfg.get("partial_rotary_factor") or 64 / cfg["head_dim"])
        # as transformers' config does, longer schedules are cut to the layer count
        layer_types = list(cfg.get("layer_types") or [])[:num_layers]
        mlp_types = list(cfg.get("mlp_layer_types") or [])[:num_layers]
        if len(layer_types) != num_layers or len(mlp_types) != num_layers:
            raise UnsupportedModelError(
                "deepseek_v4: config.json must list layer_types and mlp_layer_types for "
                f"every one of its {num_layers} layers (transformers' save_pretrained does)")
        rates = {**{CSA: 4, HCA: 128}, **(cfg.get("compress_rates") or {})}
        scaling = comp if comp.get("rope_type", "default") != "default" else None
        return dict(
            layer_types=layer_types, mlp_layer_types=mlp_types,
            compress_rates={k: int(v) for k, v in rates.items()},
            rope_dim=int(cfg["head_dim"] * partial),
            compress_rope_theta=float(comp.get("rope_theta",
                                               cfg.get("compress_rope_theta", 160000.0))),
            compress_rope_scaling=scaling,
            q_lora_rank=int(cfg["q_lora_rank"]), o_groups=int(cfg["o_groups"]),
            o_lora_rank=int(cfg["o_lora_rank"]), sliding_window=int(cfg["sliding_window"]),
            hc_mult=int(cfg["hc_mult"]), hc_sinkhorn_iters=int(cfg["hc_sinkhorn_iters"]),
            hc_eps=float(cfg["hc_eps"]), index_n_heads=int(cfg["index_n_heads"]),
            index_head_dim=int(cfg["index_head_dim"]), index_topk=int(cfg["index_topk"]),
            num_experts=int(cfg["n_routed_experts"]),
            experts_per_token=int(cfg["num_experts_per_tok"]),
            moe_intermediate_size=int(cfg["moe_intermediate_size"]),
            scoring_func=str(cfg.get("scoring_func", "sqrtsoftplus")),
            norm_topk_prob=bool(cfg.get("norm_topk_prob", True)),
            routed_scaling_factor=float(cfg.get("routed_scaling_factor", 1.5)),
            swiglu_limit=float(cfg.get("swiglu_limit", 10.0)),
        )

    @classmethod
    def gguf_fields(cls, get: Callable[..., Any], common: dict[str, Any]) -> dict[str, Any]:
        raise UnsupportedModelError(
            "GGUF files of deepseek_v4 are not supported; load the Hugging Face safetensors "
            "directory")

    def hf_keys(self) -> dict[str, Any]:
        return dict(layer_types=self.layer_types, mlp_layer_types=self.mlp_layer_types,
                    compress_rates=self.compress_rates, q_lora_rank=self.q_lora_rank,
                    o_groups=self.o_groups, o_lora_rank=self.o_lora_rank,
                    sliding_window=self.sliding_window, hc_mult=self.hc_mult,
                    hc_sinkhorn_iters=self.hc_sinkhorn_iters, hc_eps=self.hc_eps,
                    index_n_heads=self.index_n_heads, index_head_dim=self.index_head_dim,
                    index_topk=self.index_topk, n_routed_experts=self.num_experts,
                    num_experts_per_tok=self.experts_per_token,
                    moe_intermediate_size=self.moe_intermediate_size,
                    intermediate_size=self.moe_intermediate_size,  # transformers' alias of it
                    scoring_func=self.scoring_func, norm_topk_prob=self.norm_topk_prob,
                    routed_scaling_factor=self.routed_scaling_factor,
                    swiglu_limit=self.swiglu_limit,
                    compress_rope_theta=self.compress_rope_theta,
                    partial_rotary_factor=self.rope_dim / self.head_dim,
                    rope_parameters=self.rope_parameters())

    def rope_parameters(self) -> dict[str, Any]:
        """transformers' nested form: "main" (sliding layers), "compress" (the others)."""
        partial = self.rope_dim / self.head_dim
        compress = {"rope_type": "default", **(self.compress_rope_scaling or {}),
                    "rope_theta": self.compress_rope_theta, "partial_rotary_factor": partial}
        return {"main": {"rope_type": "default", "rope_theta": self.rope_theta,
                         "partial_rotary_factor": partial}, "compress": compress}

    def compressed_layers(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t != SLIDING]


# ---- small pieces ------------------------------------------------------------------------

def f32(t: Tensor) -> mx.array:
    assert isinstance(t, mx.array), "norms, biases and hyper-connection weights are never quantized"
    return t.astype(mx.float32)


def weighted_norm(x: mx.array, weight: mx.array, eps: float) -> mx.array:
    """transformers' DeepseekV4RMSNorm: in float32 with a float32 weight, then x's dtype."""
    return mx.fast.rms_norm(x.astype(mx.float32), weight, eps).astype(x.dtype)


def plain_norm(x: mx.array, eps: float) -> mx.array:
    """DeepseekV4UnweightedRMSNorm: x * rsqrt(mean(x^2) + eps), the factor in x's dtype."""
    xf = x.astype(mx.float32)
    return x * mx.rsqrt((xf * xf).mean(axis=-1, keepdims=True) + eps).astype(x.dtype)


class InterleavedRope:
    """V4's RoPE: pairs of consecutive channels (2i, 2i+1) of the trailing `dim` channels of
    a head rotate by position * inv_freq[i] (computed per position: a row's bits depend on
    its position alone)."""

    def __init__(self, dim: int, theta: float, scaling: dict[str, Any] | None) -> None:
        self.dim = dim
        self.inv_freq = layers.rope_inv_freq(dim, theta, scaling)
        self.factor = layers.rope_attention_factor(scaling)

    def cos_sin(self, positions: mx.array, dtype: mx.Dtype) -> tuple[mx.array, mx.array]:
        """[P, dim/2] cos and sin, rounded to dtype as transformers' rotary returns them."""
        ang = positions.astype(mx.float32)[:, None] * self.inv_freq[None, :]
        cos, sin = mx.cos(ang) * self.factor, mx.sin(ang) * self.factor
        return cos.astype(dtype).astype(mx.float32), sin.astype(dtype).astype(mx.float32)

    def apply(self, x: mx.array, positions: mx.array, inverse: bool = False) -> mx.array:
        """x [P, ..., d] rotated at positions [P] (inverse: by -position's sine)."""
        cos, sin = self.cos_sin(positions, x.dtype)
        if inverse:
            sin = -sin
        shape = (x.shape[0],) + (1,) * (x.ndim - 2) + (self.dim // 2,)
        cos, sin = cos.reshape(shape), sin.reshape(shape)
        d = x.shape[-1]
        nope, rot = x[..., : d - self.dim], x[..., d - self.dim :].astype(mx.float32)
        pairs = rot.reshape(*rot.shape[:-1], self.dim // 2, 2)
        even, odd = pairs[..., 0], pairs[..., 1]
        out = mx.stack([even * cos - odd * sin, odd * cos + even * sin], axis=-1)
        return mx.concatenate([nope, out.reshape(rot.shape).astype(x.dtype)], axis=-1)

    def arrays(self) -> list[mx.array]:
        return [self.inv_freq]


# ---- the per-slot state and the pages ----------------------------------------------------

@dataclass(frozen=True)
class LayerState:
    """One layer's fixed-size state of one sequence after some position (the module doc):
    `win` [W-1, D] the K=V rows of the positions before it (zeros before position 0);
    per compressor (prefix "c", CSA's indexer "i"): `kv`/`gate` [m, width] the open
    window's rows (the first pos % m hold values), `okv`/`ogate` [m, dim] the last closed
    window's first half-series (CSA only; gate with its position bias, float32)."""

    parts: dict[str, mx.array]
    canonical: bool = True  # every state is (see the module doc)


@dataclass
class StateShape:
    """Sizes of every layer's state (the floor a busy slot costs in the KV budget)."""

    zero: list[LayerState]  # each layer's state at position 0

    @property
    def layers(self) -> int:
        return len(self.zero)

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for s in self.zero for a in s.parts.values())


class CompressorState(RecurrentState):
    """deltanet.RecurrentState's versions, marks and snapshots, over LayerStates."""

    shape: StateShape  # type: ignore[assignment]

    def at(self, layer: int, pos: int) -> LayerState:  # type: ignore[override]
        if pos == 0:
            return self.shape.zero[layer]
        return super().at(layer, pos)  # type: ignore[return-value]

    def mark(self, layer: int, pos: int, state: Any) -> None:
        """Every state is canonical: keep the page boundaries' (snapshots) and the newest
        STATE_VERSIONS others alone (where the sequence's last steps stopped: its tail
        state, also when a speculated step ran one past it), so a decoding sequence marks
        no state beyond the versions it keeps anyway."""
        if self.keep_marks and pos % BLOCK:
            others = sorted(p for p in self.marks if p % BLOCK and p < pos)
            for p in others[: max(len(others) - STATE_VERSIONS + 1, 0)]:
                del self.marks[p]
        super().mark(layer, pos, state)

    def arrays(self) -> list[mx.array]:
        return [a for v in self.versions for s in v.values()
                for a in s.parts.values()]  # type: ignore[attr-defined]


class CompressedKV(SlotKV):
    """A sequence's pages of compressed entries and its fixed-size state (`recurrent`, the
    name actors.state_snapshots and the admission floor look for)."""

    def __init__(self, pool: KVPool, shape: StateShape) -> None:
        super().__init__(pool)
        self.recurrent = CompressorState(shape)  # type: ignore[arg-type]

    @property
    def state_bytes(self) -> int:
        return STATE_VERSIONS * self.recurrent.shape.nbytes

    def release(self) -> None:
        super().release()
        self.recurrent.restore(0, None)


@dataclass(frozen=True)
class EntryLayout:
    """Where a compressed layer's entries live in its pool layer: the entry of a window of
    m positions is stored in the pool rows of those positions, its first half in the keys
    array, its second half in the values array (m rows of `cols` values each). So a page
    costs exactly its entries, and copying a page's first n positions
    (`KVPool.copy_positions`, a prefix shared inside a page) copies every entry whose
    window closed there."""

    pool_layer: int
    rate: int
    width: int  # the entry's values (kv, then the indexer key), padded to 2 * rate * cols

    @property
    def per_page(self) -> int:
        return BLOCK // self.rate

    @property
    def cols(self) -> int:
        return self.width // (2 * self.rate)

    @staticmethod
    def padded(width: int, rate: int) -> int:
        r = 2 * rate
        return -(-width // r) * r

    def write(self, kv: SlotKV, first: int, entries: mx.array) -> None:
        """Store entries [n, width] of indices first.. into kv's pages (one scatter into
        the keys array, one into the values array)."""
        pool, n, m = kv.pool, entries.shape[0], self.rate
        e = np.arange(first, first + n)
        pages = np.asarray(kv.pages, dtype=np.int64)[(e * m) // BLOCK]
        rows = (pages * BLOCK + (e % self.per_page) * m)[:, None] + np.arange(m)[None, :]
        target = mx.array(rows.reshape(-1).astype(np.int32))
        half = self.width // 2
        pool.keys[self.pool_layer][target] = entries[:, :half].reshape(n * m, self.cols)
        pool.values[self.pool_layer][target] = entries[:, half:].reshape(n * m, self.cols)

    def read(self, kv: SlotKV, n: int) -> mx.array:
        """Entries 0..n-1 of kv's sequence, [n, width]."""
        pool, m = kv.pool, self.rate
        pages = mx.array(kv.pages[: -(-n // self.per_page)], dtype=mx.int32)
        shape = (-1, self.per_page, m * self.cols)
        k = pool.keys[self.pool_layer].reshape(-1, BLOCK, self.cols)[pages].reshape(shape)
        v = pool.values[self.pool_layer].reshape(-1, BLOCK, self.cols)[pages].reshape(shape)
        return mx.concatenate([k, v], axis=-1).reshape(-1, self.width)[:n]


# ---- compressors ---------------------------------------------------------------------------

@dataclass
class Compressor:
    """One compressor's fixed parts (the layer's own, or CSA's indexer): every `rate`
    positions, one entry of `dim` values pooled from the window's rows."""

    rate: int
    dim: int
    overlap: bool  # CSA: width 2 * rate over two half-series (transformers' Ca / Cb)
    bias: mx.array  # [rate, width] float32 position bias of the gates
    norm: mx.array  # [dim] float32
    eps: float

    @property
    def width(self) -> int:
        return 2 * self.dim if self.overlap else self.dim

    def zero(self, prefix: str, dtype: mx.Dtype) -> dict[str, mx.array]:
        m = self.rate
        out = {f"{prefix}kv": mx.zeros((m, self.width), dtype),
               f"{prefix}gate": mx.zeros((m, self.width), dtype)}
        if self.overlap:
            out[f"{prefix}okv"] = mx.zeros((m, self.dim), dtype)
            out[f"{prefix}ogate"] = mx.full((m, self.dim), -mx.inf, mx.float32)
        return out

    def run(self, state: dict[str, mx.array], prefix: str, kv: mx.array, gate: mx.array,
            start: int, rope: InterleavedRope) -> tuple[mx.array | None, dict[str, mx.array],
                                                        Callable[[int], dict[str, mx.array]]]:
        """A segment's rows kv, gate [L, width] at positions start..: (the entries of the
        windows that close in it [n, dim] or None, the state after it, the state at a
        window boundary p inside it)."""
        m, dtype = self.rate, kv.dtype
        end = start + kv.shape[0]
        b = start % m
        ext_kv = mx.concatenate([state[f"{prefix}kv"][:b], kv]) if b else kv
        ext_gate = mx.concatenate([state[f"{prefix}gate"][:b], gate]) if b else gate
        w0, n = start // m, end // m - start // m
        new: dict[str, mx.array] = {}
        rest = ext_kv.shape[0] - n * m
        pad = mx.zeros((m - rest, self.width), dtype)
        new[f"{prefix}kv"] = mx.concatenate([ext_kv[n * m :], pad])
        new[f"{prefix}gate"] = mx.concatenate([ext_gate[n * m :], pad])
        if n == 0:
            if self.overlap:
                new[f"{prefix}okv"], new[f"{prefix}ogate"] = (state[f"{prefix}okv"],
                                                              state[f"{prefix}ogate"])
            return None, new, lambda p: {}
        ck = ext_kv[: n * m].reshape(n, m, self.width)
        cg = ext_gate[: n * m].reshape(n, m, self.width).astype(mx.float32) + self.bias
        d = self.dim
        if self.overlap:
            ca_kv = mx.concatenate([state[f"{prefix}okv"][None], ck[:-1, :, :d]])
            ca_g = mx.concatenate([state[f"{prefix}ogate"][None], cg[:-1, :, :d]])
            win_kv = mx.concatenate([ca_kv, ck[:, :, d:]], axis=1)
            win_g = mx.concatenate([ca_g, cg[:, :, d:]], axis=1)
            new[f"{prefix}okv"], new[f"{prefix}ogate"] = ck[-1, :, :d], cg[-1, :, :d]
        else:
            win_kv, win_g = ck, cg
        weights = mx.softmax(win_g, axis=1).astype(dtype)
        pooled = (win_kv * weights).sum(axis=1)
        entries = weighted_norm(pooled, self.norm, self.eps)
        entries = rope.apply(entries, (mx.arange(n, dtype=mx.int32) + w0) * m)

        def at(p: int) -> dict[str, mx.array]:  # p: a window boundary, start < p < end
            out = {f"{prefix}kv": mx.zeros((m, self.width), dtype),
                   f"{prefix}gate": mx.zeros((m, self.width), dtype)}
            if self.overlap:
                i = p // m - 1 - w0
                out[f"{prefix}okv"], out[f"{prefix}ogate"] = ck[i, :, :d], cg[i, :, :d]
            return out

        return entries, new, at


# ---- attention -----------------------------------------------------------------------------

def blocks_of(entries: mx.array, size: int) -> mx.array:
    """[..., n, d] -> [..., nb, size, d], zero-padded."""
    n = entries.shape[-2]
    nb = max(1, -(-n // size))
    if nb * size > n:
        pad = mx.zeros((*entries.shape[:-2], nb * size - n, entries.shape[-1]), entries.dtype)
        entries = mx.concatenate([entries, pad], axis=-2)
    return entries.reshape(*entries.shape[:-2], nb, size, entries.shape[-1])


def padded(a: mx.array, rows: int) -> mx.array:
    """a with zero (False) rows appended up to `rows` rows."""
    extra = rows - a.shape[0]
    if extra <= 0:
        return a
    return mx.concatenate([a, mx.zeros((extra, *a.shape[1:]), a.dtype)])


def product(a: mx.array, b: mx.array) -> mx.array:
    """One tile's matmul a @ b (every attention and indexer product is one of these)."""
    return a @ b


def tiled(a: mx.array, b: mx.array) -> mx.array:
    """a @ b for rows a [R, ..., m, k] (R a multiple of ROW_TILE) against b [k, n] shared by
    the rows or b [R, k, n] each row its own, one product a tile of ROW_TILE rows (the
    module doc: its shape is the tile's whatever R is)."""
    shared = b.ndim == 2
    outs = [product(a[t : t + ROW_TILE], b if shared else b[t : t + ROW_TILE])
            for t in range(0, a.shape[0], ROW_TILE)]
    return outs[0] if len(outs) == 1 else mx.concatenate(outs)


def attend(q: mx.array, win: mx.array, win_ok: mx.array, comp: mx.array | None,
           comp_ok: mx.array | None, sinks: mx.array, scale: float) -> mx.array:
    """Each row's heads q [R, H, D] (float32; R a multiple of ROW_TILE) against its window
    keys win [R, W, D] and its compressed entries in blocks comp ([nb, C, D] shared by the
    rows, or [R, nb, C, D] each its own; ok [R, nb, C]: visible), one sink logit per head;
    K = V. Each block is its own product, in tiles of rows (`tiled`), reduced one by one in
    order (masked ones add exact zeros)."""
    s_w = tiled(q, win.swapaxes(-1, -2)) * scale  # [R, H, W]
    s_w = mx.where(win_ok[:, None, :], s_w, -mx.inf)
    top = mx.maximum(s_w.max(axis=-1), sinks[None, :])
    blocks: list[mx.array] = []
    s_c: list[mx.array] = []
    if comp is not None and comp_ok is not None:
        shared = comp.ndim == 3
        for b in range(comp.shape[0] if shared else comp.shape[1]):
            kb = comp[b] if shared else comp[:, b]  # [C, D] or [R, C, D]
            s = tiled(q, kb.swapaxes(-1, -2)) * scale  # [R, H, C]
            s = mx.where(comp_ok[:, b, None, :], s, -mx.inf)
            top = mx.maximum(top, s.max(axis=-1))
            blocks.append(kb)
            s_c.append(s)
    p_w = mx.exp(s_w - top[..., None])
    den = mx.exp(sinks[None, :] - top) + p_w.sum(axis=-1)
    acc = tiled(p_w, win)
    for kb, s in zip(blocks, s_c, strict=True):
        p_c = mx.exp(s - top[..., None])
        acc = acc + tiled(p_c, kb)
        den = den + p_c.sum(axis=-1)
    return acc / den[..., None]


class CompressedAttention(layers.Layer):
    """One V4 attention layer over a row batch (sliding, CSA or HCA; the module doc)."""

    backend = layers.Backend.MLX  # no native block kernel (decoder.PreNormBlock checks)

    def __init__(self, cfg: Config, w: dict[str, Tensor], p: str, index: int,
                 layout: EntryLayout | None, ropes: dict[str, InterleavedRope],
                 dtype: mx.Dtype, quant: bool) -> None:
        self.index, self.kind, self.dtype = index, cfg.layer_types[index], dtype
        self.heads, self.hd, self.eps = cfg.num_heads, cfg.head_dim, cfg.rms_norm_eps
        self.window, self.layout = cfg.sliding_window, layout
        self.rope = ropes["main" if self.kind == SLIDING else "compress"]
        self.comp_rope = ropes["compress"]
        a = f"{p}.self_attn"
        inputs = [w[f"{a}.q_a_proj.weight"], w[f"{a}.kv_proj.weight"]]
        self.splits = [cfg.q_lora_rank, cfg.head_dim]
        self.comp: Compressor | None = None
        self.indexer: Compressor | None = None
        if self.kind != SLIDING:
            c = f"{a}.compressor"
            rate = cfg.compress_rates[self.kind]
            self.comp = Compressor(rate, cfg.head_dim, self.kind == CSA,
                                   f32(w[f"{c}.position_bias"]), f32(w[f"{c}.kv_norm.weight"]),
                                   cfg.rms_norm_eps)
            inputs += [w[f"{c}.kv_proj.weight"], w[f"{c}.gate_proj.weight"]]
            self.splits += [self.comp.width] * 2
            if self.kind == CSA:
                x = f"{c}.indexer"
                self.indexer = Compressor(rate, cfg.index_head_dim, True,
                                          f32(w[f"{x}.position_bias"]),
                                          f32(w[f"{x}.kv_norm.weight"]), cfg.rms_norm_eps)
                inputs += [w[f"{x}.kv_proj.weight"], w[f"{x}.gate_proj.weight"],
                           w[f"{x}.scorer.weights_proj.weight"]]
                self.splits += [self.indexer.width] * 2 + [cfg.index_n_heads]
                self.index_q = layers.Linear(w[f"{x}.q_b_proj.weight"], dtype, quant)
                self.index_heads, self.index_dim = cfg.index_n_heads, cfg.index_head_dim
                self.topk = cfg.index_topk
        self.proj = layers.Linear.fused(inputs, dtype, quant)
        self.q_a_norm = f32(w[f"{a}.q_a_norm.weight"])
        self.kv_norm = f32(w[f"{a}.kv_norm.weight"])
        self.q_b = layers.Linear(w[f"{a}.q_b_proj.weight"], dtype, quant)
        self.sinks = f32(w[f"{a}.sinks"])
        o_a = w[f"{a}.o_a_proj.weight"]
        g, r = cfg.o_groups, cfg.o_lora_rank
        self.o_a = [layers.Linear(take_rows(o_a, mx.arange(i * r, (i + 1) * r)), dtype, quant)
                    for i in range(g)]
        self.o_b = layers.Linear(w[f"{a}.o_b_proj.weight"], dtype, quant)

    def parts(self) -> list[layers.Layer]:
        extra = [self.index_q] if self.indexer is not None else []
        return [self.proj, self.q_b, *self.o_a, self.o_b, *extra]

    def arrays(self) -> list[mx.array]:
        own = [self.q_a_norm, self.kv_norm, self.sinks]
        for c in (self.comp, self.indexer):
            if c is not None:
                own += [c.bias, c.norm]
        return [*super().arrays(), *own]

    def zero_state(self) -> LayerState:
        parts = {"win": mx.zeros((self.window - 1, self.hd), self.dtype)}
        if self.comp is not None:
            parts.update(self.comp.zero("c", self.dtype))
        if self.indexer is not None:
            parts.update(self.indexer.zero("i", self.dtype))
        return LayerState(parts)

    def __call__(self, x: mx.array, batch: layers.Batch) -> mx.array:
        y = self.proj(x)
        offsets = np.cumsum([0, *self.splits])
        parts = [y[:, offsets[i] : offsets[i + 1]] for i in range(len(self.splits))]
        q_res = weighted_norm(parts[0], self.q_a_norm, self.eps)
        rows = batch.positions
        q = self.q_b(q_res).reshape(-1, self.heads, self.hd)
        q = self.rope.apply(plain_norm(q, self.eps), rows)
        kv = self.rope.apply(weighted_norm(parts[1], self.kv_norm, self.eps), rows)
        iq = iw = None
        if self.indexer is not None:
            iq = self.index_q(q_res).reshape(-1, self.index_heads, self.index_dim)
            iq = self.comp_rope.apply(iq, rows)
            iw = parts[-1].astype(mx.float32) * self.index_heads ** -0.5
        outs = []
        for seg in batch.segments:
            r = slice(seg.row, seg.row + seg.length)
            outs.append(self._segment(seg, batch, q[r], kv[r], [t[r] for t in parts[2:]],
                                      None if iq is None else iq[r],
                                      None if iw is None else iw[r]))
        extra = x.shape[0] - batch.rows
        if extra:
            outs.append(mx.zeros((extra, self.heads, self.hd), self.dtype))
        out = outs[0] if len(outs) == 1 else mx.concatenate(outs)
        groups = out.reshape(out.shape[0], len(self.o_a), -1)
        mixed = mx.concatenate([o(groups[:, i]) for i, o in enumerate(self.o_a)], axis=-1)
        return self.o_b(mixed)

    def _segment(self, seg: layers.Segment, batch: layers.Batch, q: mx.array, kv: mx.array,
                 comp_in: list[mx.array], iq: mx.array | None,
                 iw: mx.array | None) -> mx.array:
        rec = _state(seg)
        st = rec.at(self.index, seg.start).parts
        start, n = seg.start, seg.length
        end = start + n
        wsize = self.window
        ext = mx.concatenate([st["win"], kv])  # positions start-W+1 .. end-1
        idx = mx.arange(n)[:, None] + mx.arange(wsize)[None, :]
        keys = ext[idx].astype(mx.float32)  # [L, W, D]
        key_pos = idx + (start - wsize + 1)
        new: dict[str, mx.array] = {"win": ext[n:]}
        at_fns: list[Callable[[int], dict[str, mx.array]]] = []
        comp: mx.array | None = None  # HCA: the entries' blocks, [nb, C, D]
        ikeys = ents = visible = None
        pos = mx.arange(start, end, dtype=mx.int32)
        if self.comp is not None and self.layout is not None:
            m = self.comp.rate
            entries, cnew, c_at = self.comp.run(st, "c", comp_in[0], comp_in[1], start,
                                                self.comp_rope)
            new.update(cnew)
            at_fns.append(c_at)
            record = entries
            if self.indexer is not None:
                ientries, inew, i_at = self.indexer.run(st, "i", comp_in[2], comp_in[3], start,
                                                        self.comp_rope)
                new.update(inew)
                at_fns.append(i_at)
                if entries is not None and ientries is not None:
                    record = mx.concatenate([entries, ientries], axis=-1)
            if record is not None:
                width = self.layout.width
                if record.shape[1] < width:
                    record = mx.concatenate(
                        [record, mx.zeros((record.shape[0], width - record.shape[1]),
                                          record.dtype)], axis=-1)
                self.layout.write(seg.kv, start // m, record)
            total = end // m
            if total:
                stored = self.layout.read(seg.kv, total)
                ents = stored[:, : self.hd].astype(mx.float32)
                visible = (pos + 1) // m  # entries a position may read
                if self.indexer is None:
                    comp = blocks_of(ents, ENTRY_BLOCK)
                else:
                    ikeys = stored[:, self.hd : self.hd + self.index_dim]
        out = self._attend_tiles(q, keys, key_pos >= 0, comp, ikeys, ents, visible, iq, iw)
        out = self.rope.apply(out.astype(self.dtype), pos, inverse=True)
        state = LayerState({**st, **new})
        rec.put(self.index, end, state)
        rec.mark(self.index, end, state)
        batch.effects.extend(state.parts.values())
        if rec.keep_marks:
            for p in range(-(-(start + 1) // BLOCK) * BLOCK, end, BLOCK):
                mark = {**st, "win": ext[p - start : p - start + wsize - 1]}
                for fn in at_fns:
                    mark.update(fn(p))
                ls = LayerState(mark)
                rec.mark(self.index, p, ls)
                batch.effects.extend(ls.parts.values())
        return out

    def _attend_tiles(self, q: mx.array, keys: mx.array, win_ok: mx.array,
                      comp: mx.array | None, ikeys: mx.array | None, ents: mx.array | None,
                      visible: mx.array | None, iq: mx.array | None,
                      iw: mx.array | None) -> mx.array:
        """attend() over the segment's rows zero-padded to whole tiles of ROW_TILE (the
        module doc), their compressed entries the HCA blocks `comp` or the indexer's choice
        from `ikeys`; [L, H, D] float32."""
        n = q.shape[0]
        rows = -(-n // ROW_TILE) * ROW_TILE
        q, keys, win_ok = (padded(q.astype(mx.float32), rows), padded(keys, rows),
                           padded(win_ok, rows))
        blocks = ok = None
        if comp is not None and visible is not None:
            e = mx.arange(comp.shape[0] * ENTRY_BLOCK).reshape(comp.shape[0], -1)
            blocks, ok = comp, e[None] < padded(visible, rows)[:, None, None]
        elif ikeys is not None and ents is not None and visible is not None:
            assert iq is not None and iw is not None
            blocks, ok = self._select(padded(iq, rows), padded(iw, rows), ikeys, ents,
                                      padded(visible, rows))
        out = attend(q, keys, win_ok, blocks, ok, self.sinks, self.hd ** -0.5)
        return out[:n]

    def _select(self, iq: mx.array, iw: mx.array, ikeys: mx.array, ents: mx.array,
                visible: mx.array) -> tuple[mx.array, mx.array]:
        """The Lightning Indexer: each row's `index_topk` entries by sum_h w_h relu(q_h . k)
        (future entries excluded), as blocks [R, nb, C, D] and their validity [R, nb, C]
        (R a multiple of ROW_TILE). The scores come INDEX_GROUP entries a product (zero keys
        past the last entry) in tiles of rows, so each product's shape is the same for any
        segment and context."""
        groups = blocks_of(ikeys.astype(mx.float32), INDEX_GROUP)  # [ng, G, I]
        q = iq.astype(mx.float32)  # [R, Hi, I]
        scores = []
        for g in range(groups.shape[0]):
            s = mx.maximum(tiled(q, groups[g].T), 0.0) * self.index_dim ** -0.5  # [R, Hi, G]
            scores.append((s * iw[:, :, None]).sum(axis=1))
        score = scores[0] if len(scores) == 1 else mx.concatenate(scores, axis=1)
        score = score[:, : ikeys.shape[0]]  # the sort is stable: its width changes no choice
        e = mx.arange(score.shape[1])
        score = mx.where(e[None] < visible[:, None], score, -mx.inf)
        k = self.topk
        if score.shape[1] < k:
            score = mx.concatenate(
                [score, mx.full((score.shape[0], k - score.shape[1]), -mx.inf)], axis=1)
        chosen = mx.argsort(-score, axis=-1)[:, :k]  # stable: ties by entry order
        ok = chosen < visible[:, None]
        n = ents.shape[0]
        with_zero = mx.concatenate([ents, mx.zeros((1, ents.shape[1]), ents.dtype)])
        picked = with_zero[mx.where(ok, chosen, n)]  # [R, k, D]
        size = min(k, ENTRY_BLOCK)
        return (picked.reshape(picked.shape[0], -1, size, picked.shape[-1]),
                ok.reshape(ok.shape[0], -1, size))


def _state(seg: layers.Segment) -> CompressorState:
    kv = seg.kv
    if not isinstance(kv, CompressedKV):
        raise TypeError("a DeepSeek-V4 attention layer needs its sequence's CompressedKV")
    return kv.recurrent


def take_rows(t: Tensor, rows: mx.array) -> Tensor:
    return t.take_rows(rows) if isinstance(t, QuantizedWeight) else t[rows]


# ---- hyper-connections, MoE, the block -------------------------------------------------------

class HyperConnection(layers.Layer):
    """transformers' DeepseekV4HyperConnection: (post [R, hc], comb [R, hc, hc], the
    collapsed block input [R, D]) from the streams [R, hc, D], in float32."""

    def __init__(self, w: dict[str, Tensor], p: str, cfg: Config) -> None:
        self.hc, self.iters, self.eps, self.norm_eps = (cfg.hc_mult, cfg.hc_sinkhorn_iters,
                                                         cfg.hc_eps, cfg.rms_norm_eps)
        self.fn = layers.Linear(f32(w[f"{p}.fn"]), mx.float32, False)
        self.base, self.scale = f32(w[f"{p}.base"]), f32(w[f"{p}.scale"])

    def parts(self) -> list[layers.Layer]:
        return [self.fn]

    def arrays(self) -> list[mx.array]:
        return [*super().arrays(), self.base, self.scale]

    def __call__(self, h: mx.array) -> tuple[mx.array, mx.array, mx.array]:
        n = self.hc
        flat = h.reshape(h.shape[0], -1).astype(mx.float32)
        mixes = self.fn(plain_norm(flat, self.norm_eps))
        pre = mx.sigmoid(mixes[:, :n] * self.scale[0] + self.base[:n]) + self.eps
        post = 2 * mx.sigmoid(mixes[:, n : 2 * n] * self.scale[1] + self.base[n : 2 * n])
        logits = mixes[:, 2 * n :] * self.scale[2] + self.base[2 * n :]
        comb = mx.softmax(logits.reshape(-1, n, n), axis=-1) + self.eps
        comb = comb / (comb.sum(axis=-2, keepdims=True) + self.eps)
        for _ in range(self.iters - 1):
            comb = comb / (comb.sum(axis=-1, keepdims=True) + self.eps)
            comb = comb / (comb.sum(axis=-2, keepdims=True) + self.eps)
        collapsed = (pre[..., None] * h.astype(mx.float32)).sum(axis=1).astype(h.dtype)
        return post, comb, collapsed


def spread(h: mx.array, out: mx.array, post: mx.array, comb: mx.array) -> mx.array:
    """The streams after a block: post[k] * out + sum_j comb[j, k] * h[j]."""
    dt = h.dtype
    mixed = (comb.astype(dt)[..., None] * h[:, :, None, :]).sum(axis=1)
    return post.astype(dt)[..., None] * out[:, None, :] + mixed


class SharedExpert(layers.Layer):
    """The shared expert: down(silu(min(gate, limit)) * clip(up, -limit, limit))."""

    def __init__(self, w: dict[str, Tensor], p: str, limit: float, dtype: mx.Dtype,
                 quant: bool) -> None:
        self.gate_up = layers.Linear.fused([w[f"{p}.gate_proj.weight"],
                                            w[f"{p}.up_proj.weight"]], dtype, quant)
        self.down = layers.Linear(w[f"{p}.down_proj.weight"], dtype, quant)
        self.limit = limit

    def parts(self) -> list[layers.Layer]:
        return [self.gate_up, self.down]

    def __call__(self, x: mx.array) -> mx.array:
        gu = self.gate_up(x)
        half = gu.shape[1] // 2
        return self.down(clamped_swiglu(self.limit)(gu[:, :half], gu[:, half:]))


def clamped_swiglu(limit: float) -> moe.Glu:
    def glu(gate: mx.array, up: mx.array) -> mx.array:
        g = mx.minimum(gate, limit)
        return layers.silu(g) * mx.clip(up, -limit, limit)
    return glu


class RoutedMoE(layers.Layer):
    """Routed experts (moe.SparseMoE's products) with V4's routing, plus the shared expert."""

    def __init__(self, cfg: Config, w: dict[str, Tensor], p: str, hashed: bool,
                 dtype: mx.Dtype, quant: bool) -> None:
        self.experts = moe.SparseMoE(
            w[f"{p}.gate.weight"], w[f"{p}.experts.gate_up_proj"], w[f"{p}.experts.down_proj"],
            inter=cfg.moe_intermediate_size, top_k=cfg.experts_per_token, norm_topk=True,
            dtype=dtype, keep_quantized=quant, glu=clamped_swiglu(cfg.swiglu_limit))
        self.shared = SharedExpert(w, f"{p}.shared_experts", cfg.swiglu_limit, dtype, quant)
        self.k, self.scale, self.score = (cfg.experts_per_token, cfg.routed_scaling_factor,
                                          cfg.scoring_func)
        if self.score not in ("sqrtsoftplus", "softmax", "sigmoid"):
            raise UnsupportedModelError(f"deepseek_v4: scoring_func {self.score!r}; supported: "
                                        "sqrtsoftplus, softmax, sigmoid")
        self.table: mx.array | None = None
        self.bias: mx.array | None = None
        if hashed:
            table = w[f"{p}.gate.tid2eid"]
            assert isinstance(table, mx.array)
            self.table = table.astype(mx.int32)
        else:
            self.bias = f32(w[f"{p}.gate.e_score_correction_bias"])

    def parts(self) -> list[layers.Layer]:
        return [self.experts, self.shared]

    def arrays(self) -> list[mx.array]:
        own = [a for a in (self.table, self.bias) if a is not None]
        return [*super().arrays(), *own]

    def __call__(self, x: mx.array, tokens: mx.array, rows: int) -> mx.array:
        logits = self.experts.router(x).astype(mx.float32)
        if self.score == "softmax":
            scores = mx.softmax(logits, axis=-1)
        elif self.score == "sigmoid":
            scores = mx.sigmoid(logits)
        else:
            scores = mx.sqrt(mx.logaddexp(logits, 0.0))  # sqrt(softplus)
        if self.table is not None:
            chosen = self.table[tokens]
        else:
            assert self.bias is not None
            n = scores.shape[-1]
            chosen = mx.argpartition(scores + self.bias, kth=n - self.k, axis=-1)[:, n - self.k :]
        weights = mx.take_along_axis(scores, chosen, axis=-1)
        weights = weights / (weights.sum(axis=-1, keepdims=True) + 1e-20) * self.scale
        routed = self.experts.mix(x, chosen, weights.astype(x.dtype), rows)
        return routed + self.shared(x)


class Block(layers.Layer):
    """One V4 decoder layer on the hyper-connection streams [R, hc, D]."""

    def __init__(self, cfg: Config, w: dict[str, Tensor], i: int,
                 layout: EntryLayout | None, ropes: dict[str, InterleavedRope],
                 dtype: mx.Dtype, quant: bool) -> None:
        p = f"model.layers.{i}"
        self.attn = CompressedAttention(cfg, w, p, i, layout, ropes, dtype, quant)
        self.mlp = RoutedMoE(cfg, w, f"{p}.mlp", cfg.mlp_layer_types[i] == HASH_MOE, dtype,
                             quant)
        self.attn_hc = HyperConnection(w, f"{p}.attn_hc", cfg)
        self.ffn_hc = HyperConnection(w, f"{p}.ffn_hc", cfg)
        self.in_norm = f32(w[f"{p}.input_layernorm.weight"])
        self.post_norm = f32(w[f"{p}.post_attention_layernorm.weight"])
        self.eps = cfg.rms_norm_eps

    def parts(self) -> list[layers.Layer]:
        return [self.attn, self.mlp, self.attn_hc, self.ffn_hc]

    def arrays(self) -> list[mx.array]:
        return [*super().arrays(), self.in_norm, self.post_norm]

    def __call__(self, h: mx.array, batch: layers.Batch, tokens: mx.array) -> mx.array:
        post, comb, x = self.attn_hc(h)
        h = spread(h, self.attn(weighted_norm(x, self.in_norm, self.eps), batch), post, comb)
        post, comb, x = self.ffn_hc(h)
        out = self.mlp(weighted_norm(x, self.post_norm, self.eps), tokens, batch.rows)
        return spread(h, out, post, comb)


class Model(decoder.Decoder):
    """The V4 decoder over a row batch; each sequence's KV is a CompressedKV."""

    def __init__(self, cfg: Config, w: dict[str, Tensor], dtype: mx.Dtype,
                 quant: bool) -> None:
        compressed = cfg.compressed_layers()
        if not compressed:
            raise UnsupportedModelError("deepseek_v4: no compressed attention layer in "
                                        "layer_types; supported: at least one CSA or HCA layer")
        for kind in (CSA, HCA):
            rate = cfg.compress_rates.get(kind, 0)
            if kind in cfg.layer_types and (rate < 1 or BLOCK % rate):
                raise UnsupportedModelError(
                    f"deepseek_v4: compress rate {rate} of {kind}; supported: divisors of "
                    f"{BLOCK} (a page holds whole windows)")
        topk = cfg.index_topk
        if CSA in cfg.layer_types and topk > ENTRY_BLOCK and topk % ENTRY_BLOCK:
            raise UnsupportedModelError(f"deepseek_v4: index_topk {topk}; supported: up to "
                                        f"{ENTRY_BLOCK} or a multiple of it")
        if cfg.rope_dim > min(cfg.head_dim, cfg.index_head_dim) or cfg.rope_dim % 2:
            raise UnsupportedModelError(f"deepseek_v4: rope dim {cfg.rope_dim} does not fit "
                                        "the heads")
        self.rotary = {"main": InterleavedRope(cfg.rope_dim, cfg.rope_theta, None),
                      "compress": InterleavedRope(cfg.rope_dim, cfg.compress_rope_theta,
                                                  cfg.compress_rope_scaling)}
        self.layouts: list[EntryLayout | None] = [None] * cfg.num_layers
        for j, i in enumerate(compressed):
            kind = cfg.layer_types[i]
            rate = cfg.compress_rates[kind]
            width = cfg.head_dim + (cfg.index_head_dim if kind == CSA else 0)
            self.layouts[i] = EntryLayout(j, rate, EntryLayout.padded(width, rate))
        embed = layers.Embedding(w["model.embed_tokens.weight"], dtype, quant)
        blocks = [Block(cfg, w, i, self.layouts[i], self.rotary, dtype, quant)
                  for i in range(cfg.num_layers)]
        head = w.get("lm_head.weight")
        lm_head = embed.as_linear() if head is None else layers.Linear(head, dtype, quant)
        norm = layers.RMSNorm(f32(w["model.norm.weight"]), cfg.rms_norm_eps)
        super().__init__(cfg, dtype, embed, blocks, norm, lm_head, [])  # type: ignore[arg-type]
        self.hc = cfg.hc_mult
        self.head_fn = layers.Linear(f32(w["model.hc_head.hc_fn"]), mx.float32, False)
        self.head_base = f32(w["model.hc_head.hc_base"])
        self.head_scale = f32(w["model.hc_head.hc_scale"])
        self.state_shape = StateShape([b.attn.zero_state() for b in blocks])

    def parts(self) -> list[layers.Layer]:
        return [*super().parts(), self.head_fn]

    def arrays(self) -> list[mx.array]:
        ropes = [a for r in self.rotary.values() for a in r.arrays()]
        return [*super().arrays(), self.head_base, self.head_scale, *ropes]

    def new_kv(self) -> CompressedKV:
        """A sequence's pages (compressed entries of the CSA / HCA layers) and its state."""
        if self.kv_pool is None:
            shapes = [(1, lay.cols) for lay in self.layouts if lay is not None]
            self.kv_pool = KVPool.of_shapes(shapes, self.dtype)
        return CompressedKV(self.kv_pool, self.state_shape)

    def runs_on_host(self) -> bool:
        return False

    def __call__(self, tokens: mx.array, batch: layers.Batch,
                 logit_rows: list[int]) -> mx.array | None:
        tokens = batch.pad_tokens(tokens)
        x = self.embed_tokens(tokens)
        h = mx.broadcast_to(x[:, None, :], (x.shape[0], self.hc, x.shape[1]))
        for block in self.layers:
            h = block(h, batch, tokens)  # type: ignore[call-arg]
        if not logit_rows:
            return None
        h = h[mx.array(logit_rows, dtype=mx.int32)]
        flat = plain_norm(h.reshape(h.shape[0], -1).astype(mx.float32), self.config.rms_norm_eps)
        # padded like every row batch: on the GPU a product of fewer rows than the probe's
        # floor rounds otherwise (a sequence's logits would depend on how many others ask)
        mixes = self.head_fn(layers.pad_rows(flat))[: h.shape[0]]
        pre = mx.sigmoid(mixes * self.head_scale + self.head_base) + self.config.hc_eps  # type: ignore[attr-defined]
        x = (pre[..., None] * h.astype(mx.float32)).sum(axis=1).astype(h.dtype)
        x = weighted_norm(x, self.norm.weight, self.config.rms_norm_eps)  # type: ignore[attr-defined]
        return self.lm_head(layers.pad_rows(x))[: len(logit_rows)].astype(mx.float32)


# the reference checkpoints' names (DeepSeek's release; transformers' save_pretrained writes
# them back) -> transformers' module names, applied in order (conversion_mapping.py)
RENAMES = [
    (r"\.attn\.", ".self_attn."), (r"\.ffn\.", ".mlp."),
    (r"\.indexer\.compressor\.", ".compressor.indexer."),
    (r"^embed\.weight", "embed_tokens.weight"), (r"^head\.weight", "lm_head.weight"),
    (r"^hc_head_fn", "hc_head.hc_fn"), (r"^hc_head_base", "hc_head.hc_base"),
    (r"^hc_head_scale", "hc_head.hc_scale"),
    (r"\.attn_norm\.", ".input_layernorm."), (r"\.ffn_norm\.", ".post_attention_layernorm."),
    (r"\.hc_attn_fn", ".attn_hc.fn"), (r"\.hc_attn_base", ".attn_hc.base"),
    (r"\.hc_attn_scale", ".attn_hc.scale"), (r"\.hc_ffn_fn", ".ffn_hc.fn"),
    (r"\.hc_ffn_base", ".ffn_hc.base"), (r"\.hc_ffn_scale", ".ffn_hc.scale"),
    (r"\.attn_sink", ".sinks"),
    (r"\.indexer\.weights_proj\.", ".compressor.indexer.scorer.weights_proj."),
    (r"\.indexer\.wq_b\.", ".compressor.indexer.q_b_proj."),
    (r"\.norm\.", ".kv_norm."), (r"\.ape", ".position_bias"), (r"\.wq_a\.", ".q_a_proj."),
    (r"\.self_attn\.wq_b\.", ".self_attn.q_b_proj."), (r"\.wkv\.", ".kv_proj."),
    (r"\.wgate\.", ".gate_proj."), (r"\.wo_a\.", ".o_a_proj."), (r"\.wo_b\.", ".o_b_proj."),
    (r"\.q_norm\.", ".q_a_norm."), (r"\.gate\.bias", ".gate.e_score_correction_bias"),
    (r"\.shared_experts\.w1\.", ".shared_experts.gate_proj."),
    (r"\.shared_experts\.w2\.", ".shared_experts.down_proj."),
    (r"\.shared_experts\.w3\.", ".shared_experts.up_proj."),
]
STACKED = (".experts.gate_up_proj.weight", ".experts.down_proj.weight")
EXPERT = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(\d+)\.(w[123])\.weight$")


def stack(parts: list[Tensor]) -> Tensor:
    """Per-expert matrices -> one [E, out, in] tensor (quantized ones stay quantized)."""
    if isinstance(parts[0], QuantizedWeight):
        qs: list[QuantizedWeight] = parts  # type: ignore[assignment]
        return QuantizedWeight(mx.stack([q.weight for q in qs]), mx.stack([q.scales for q in qs]),
                               mx.stack([q.biases for q in qs]), qs[0].group_size, qs[0].bits)
    return mx.stack(parts)  # type: ignore[arg-type]


def concat_rows(a: Tensor, b: Tensor) -> Tensor:
    """[E, n, in] and [E, m, in] -> [E, n + m, in] (gate rows, then up rows)."""
    if isinstance(a, QuantizedWeight) and isinstance(b, QuantizedWeight):
        return QuantizedWeight(mx.concatenate([a.weight, b.weight], axis=1),
                               mx.concatenate([a.scales, b.scales], axis=1),
                               mx.concatenate([a.biases, b.biases], axis=1), a.group_size, a.bits)
    assert isinstance(a, mx.array) and isinstance(b, mx.array)
    return mx.concatenate([a, b], axis=1)


def sanitize(weights: dict[str, Tensor], cfg: ModelConfig) -> None:
    """Read the reference names (DeepSeek's release, and what transformers'
    save_pretrained writes back) as transformers' modules name them, with each layer's
    per-expert w1 / w3 / w2 stacked into gate_up_proj [E, 2 * inter, H] and down_proj
    [E, H, inter] (4-bit stacks, named `.weight` to carry their scales, lose the suffix);
    drop the multi-token-prediction layers (`mtp.`, not run, as in
    transformers)."""
    for name in [n for n in weights if n.startswith(("mtp.", "model.mtp."))]:
        del weights[name]
    for name in [n for n in weights if n.endswith(STACKED)]:  # quantized stacks (mlx4)
        weights[name.removesuffix(".weight")] = weights.pop(name)
    if not any(".attn." in n or "hc_attn_fn" in n for n in weights):
        return  # already transformers' names
    experts: dict[str, dict[str, dict[int, Tensor]]] = {}
    for name in list(weights):
        t = weights.pop(name)
        n = name.removeprefix("model.")
        for pattern, repl in RENAMES:
            n = re.sub(pattern, repl, n)
        n = n if n.startswith("lm_head.") else f"model.{n}"
        hit = EXPERT.match(n)
        if hit:
            experts.setdefault(hit[1], {}).setdefault(hit[3], {})[int(hit[2])] = t
        else:
            weights[n] = t
    for prefix, by_kind in experts.items():
        order = sorted(by_kind["w1"])
        w1, w3, w2 = (stack([by_kind[k][e] for e in order]) for k in ("w1", "w3", "w2"))
        weights[f"{prefix}.gate_up_proj"] = concat_rows(w1, w3)
        weights[f"{prefix}.down_proj"] = w2


def reference_tensors(tensors: dict[str, Any]) -> dict[str, Any]:
    """Export: the tensors under the reference names, as transformers' save_pretrained
    writes them (which its from_pretrained reads back): the renames undone in reverse
    order, each stacked expert projection split into per-expert w1 / w3 / w2, the hash
    table as integers."""
    out: dict[str, Any] = {}
    for name, t in tensors.items():
        n = name.removeprefix("model.")
        hit = re.match(r"^(layers\.\d+\.mlp\.experts)\.(gate_up_proj|down_proj)$", n)
        if hit:
            prefix = "model." + hit[1].replace(".mlp.", ".ffn.")
            if hit[2] == "down_proj":
                out.update({f"{prefix}.{e}.w2.weight": t[e] for e in range(t.shape[0])})
            else:
                half = t.shape[1] // 2
                for e in range(t.shape[0]):
                    out[f"{prefix}.{e}.w1.weight"] = t[e, :half]
                    out[f"{prefix}.{e}.w3.weight"] = t[e, half:]
            continue
        if n.endswith(".tid2eid"):
            t = t.astype(mx.int64)
        for pattern, repl in reversed(RENAMES):
            if pattern.startswith("^"):  # embed / head / hc_head keep transformers' names
                continue
            n = n.replace(repl, pattern.replace("\\", ""))
        out[n if n == "lm_head.weight" else f"model.{n}"] = t
    if "lm_head.weight" in out:
        out["head.weight"] = out.pop("lm_head.weight")
    return out


FAMILY = Family(
    name="deepseek_v4",
    config=Config,
    model=Model,
    hf_architectures=("DeepseekV4ForCausalLM",),
    hf_model_type="deepseek_v4",
    gguf_architecture="deepseek4",
    sanitize=sanitize,
    hf_tensors=reference_tensors,
)
