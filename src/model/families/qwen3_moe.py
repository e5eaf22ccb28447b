"""Qwen3-MoE family: Qwen3 attention with a sparse mixture-of-experts MLP.

The router scores all experts (softmax in float32), keeps the top k per row and,
when the config says so, renormalizes those k weights to sum to one; the row's
output is the weighted sum of its k experts' SwiGLU outputs. Layers that are not
sparse (`mlp_only_layers`, `decoder_sparse_step`) keep a dense MLP.

Experts run through `gather_mm`: each (row, expert) pair is its own one-row
product against that expert's matrix, so all rows go in one call per projection
and a row's result never depends on which other rows share the batch.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from slotserve.kernels import cuda
from slotserve.model.config import ModelConfig
from slotserve.model.families import llama, qwen3
from slotserve.model.layers import Batch, Linear, Rope, rms_norm
from slotserve.model.weights import QuantizedWeight, Tensor

# From this many (row, expert) pairs, issuing them grouped by expert pays on CPU
# (measured E=64, k=8, H=1024: 2.4x at 64 rows, 2.5x at 256; about even below 64 pairs).
GROUP_MIN_PAIRS = 64


def _concat_out(a: Tensor, b: Tensor) -> Tensor:
    """Stack two [E, out, in] expert tensors along `out` (gate then up)."""
    if isinstance(a, QuantizedWeight) and isinstance(b, QuantizedWeight) and (
        (a.bits, a.group_size) == (b.bits, b.group_size)
    ):
        return QuantizedWeight(
            mx.concatenate([a.weight, b.weight], axis=1),
            mx.concatenate([a.scales, b.scales], axis=1),
            mx.concatenate([a.biases, b.biases], axis=1),
            a.group_size,
            a.bits,
        )
    parts = [t.dequantize(mx.float32) if isinstance(t, QuantizedWeight) else t for t in (a, b)]
    return mx.concatenate(parts, axis=1)


def expert_weights(w: dict[str, Tensor], p: str) -> tuple[Tensor, Tensor]:
    """(gate_up [E, 2I, H], down [E, H, I]) from any of the stored expert layouts.

    Accepts stacked per-projection tensors (`stack_experts`, GGUF, mlx-lm's
    `switch_mlp`) and transformers 5's fused `experts.gate_up_proj`/`down_proj`.
    """
    fused = w.get(f"{p}.experts.gate_up_proj")
    if fused is not None:
        return fused, w[f"{p}.experts.down_proj"]
    group = "switch_mlp" if f"{p}.switch_mlp.gate_proj.weight" in w else "experts"
    gate, up = w[f"{p}.{group}.gate_proj.weight"], w[f"{p}.{group}.up_proj.weight"]
    return _concat_out(gate, up), w[f"{p}.{group}.down_proj.weight"]


class ExpertProj:
    """One projection of every expert of a layer, applied to (row, expert) pairs."""

    def __init__(self, weight: Tensor, dtype: mx.Dtype, quant: bool) -> None:
        self.q: QuantizedWeight | None = None
        self.wt: mx.array | None = None
        if quant and isinstance(weight, QuantizedWeight):
            self.q = weight
        else:
            dense = (
                weight.dequantize(dtype) if isinstance(weight, QuantizedWeight)
                else weight.astype(dtype)
            )
            # [E, in, out] kept contiguous so each pair is a plain row-times-matrix product.
            self.wt = mx.contiguous(dense.swapaxes(1, 2))

    def __call__(self, x: mx.array, experts: mx.array, grouped: bool = False) -> mx.array:
        """x: [*B, 1, in] with B broadcasting against experts' shape -> [*B', 1, out]."""
        if self.q is not None:
            q = self.q
            return mx.gather_qmm(
                x, q.weight, q.scales, q.biases, rhs_indices=experts, transpose=True,
                group_size=q.group_size, bits=q.bits, sorted_indices=grouped,
            )
        assert self.wt is not None
        return mx.gather_mm(x, self.wt, rhs_indices=experts, sorted_indices=grouped)


class SparseMoE:
    def __init__(self, cfg: ModelConfig, w: dict[str, Tensor], p: str, dtype: mx.Dtype,
                 quant: bool) -> None:
        self.router = Linear(w[f"{p}.gate.weight"], dtype, quant)
        self.top_k = cfg.experts_per_token
        self.norm_topk = cfg.norm_topk_prob
        self.inter = cfg.moe_intermediate_size
        gate_up, down = expert_weights(w, p)
        self.gate_up = ExpertProj(gate_up, dtype, quant)
        self.down = ExpertProj(down, dtype, quant)
        # MLX's CPU gather_mm runs one BLAS call per pair whatever the order, so grouping
        # pairs by expert changes no bits there; GPU kernels may differ, so CPU only.
        self.can_group = self.down.wt is not None and mx.default_device() == mx.cpu
        # GPU expert kernels change path with the row count (CUDA: 1-7 rows give other bits
        # than 8+), so there padding rows go through the experts too, as through every Linear
        # (routed to row 0's experts, so they read no other expert's weights).
        self.skip_padding = mx.default_device() == mx.cpu
        self.cuda = cuda.enabled()

    def route(self, x: mx.array) -> tuple[mx.array, mx.array]:
        """Per row: the k chosen experts [R, k] and their weights [R, k] (x's dtype)."""
        probs = mx.softmax(self.router(x).astype(mx.float32), axis=-1)
        n = probs.shape[-1]
        experts = mx.argpartition(probs, kth=n - self.top_k, axis=-1)[:, n - self.top_k :]
        weights = mx.take_along_axis(probs, experts, axis=-1)
        if self.norm_topk:
            weights = weights / weights.sum(axis=-1, keepdims=True)
        return experts, weights.astype(x.dtype)

    def swiglu(self, x: mx.array, experts: mx.array, grouped: bool = False) -> mx.array:
        gu = self.gate_up(x, experts, grouped)
        if self.cuda:  # one kernel, no chain of bf16 ops for mx.compile to fuse differently
            h = cuda.swiglu(gu.reshape(-1, 2 * self.inter)).reshape(*gu.shape[:-1], self.inter)
        else:
            g, u = gu[..., : self.inter], gu[..., self.inter :]
            h = g * mx.sigmoid(g) * u
        return self.down(h, experts, grouped)

    def grouped_swiglu(self, x: mx.array, experts: mx.array) -> mx.array:
        """The same per-pair products, issued expert by expert so weights stay in cache."""
        r, k = experts.shape
        flat = experts.flatten()
        order = mx.argsort(flat)
        y = self.swiglu(x[order // k][:, None, :], flat[order], grouped=True)  # [R*k, 1, H]
        return y[mx.argsort(order)].reshape(r, k, -1)

    def __call__(self, x: mx.array, rows: int | None = None) -> mx.array:
        """x: [R, H]; only the first `rows` rows (default all) are real, the rest padding.

        The router sees every row (it is a plain Linear, padded for invariance); the
        experts, which cost k weight reads per row, skip the padding rows (output 0).
        """
        experts, weights = self.route(x)
        r = x.shape[0]
        real = r if rows is None else rows
        n = real if self.skip_padding else r
        if n > real:  # GPU: padding rows take row 0's experts
            pad = mx.broadcast_to(experts[:1], (n - real, experts.shape[1]))
            experts = mx.concatenate([experts[:real], pad])
        xs, experts, weights = x[:n], experts[:n], weights[:n]
        if self.can_group and experts.size >= GROUP_MIN_PAIRS:
            out = self.grouped_swiglu(xs, experts)
        else:
            out = self.swiglu(xs[:, None, None, :], experts)[:, :, 0, :]  # [n, k, H]
        y = (out * weights[..., None]).sum(axis=1)
        return y if n == r else mx.concatenate([y, mx.zeros((r - n, y.shape[1]), y.dtype)])


def is_sparse(cfg: ModelConfig, layer: int) -> bool:
    """Which layers carry experts, by the rule of HF's Qwen3MoeDecoderLayer."""
    return (
        layer not in cfg.mlp_only_layers
        and cfg.num_experts > 0
        and (layer + 1) % max(cfg.decoder_sparse_step, 1) == 0
    )


class Block(qwen3.Block):
    def make_mlp(self, cfg: ModelConfig, w: dict[str, Tensor], i: int, p: str,
                 dtype: mx.Dtype, quant: bool) -> Any:
        if is_sparse(cfg, i):
            return SparseMoE(cfg, w, p, dtype, quant)
        return llama.MLP(w, p, dtype, quant)

    def __call__(self, x: mx.array, batch: Batch, layer: int, cos: mx.array,
                 sin: mx.array, rope: Rope | None = None) -> mx.array:
        """As llama's block, but telling the MoE which rows are padding."""
        h = x + self.attn(rms_norm(x, self.in_norm, self.eps), batch, layer, cos, sin)
        y = rms_norm(h, self.post_norm, self.eps)
        return h + (self.mlp(y, batch.rows) if isinstance(self.mlp, SparseMoE) else self.mlp(y))


class Model(qwen3.Model):
    """Qwen3-MoE decoder over a row batch; see slotserve.model.layers."""

    block_class = Block
