"""The sparse mixture-of-experts layer (Qwen3-MoE's MLP on its sparse layers).

Experts run through MLX's `gather_mm` / `gather_qmm`: each (row, expert) pair is its own
one-row product against that expert's matrix, so all rows go in one call per projection
and a row's result never depends on which other rows share the batch. On the CPU the pairs
of a large batch are issued grouped by expert (the same products, weights kept in cache);
on the GPU padding rows go through the experts too and SwiGLU is one CUDA kernel.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import mlx.core as mx

from slotserve.kernels import cuda
from slotserve.kernels.quantized import Mxfp4Weight
from slotserve.model.layers import Activation, Layer, Linear, Norm, normed, plus, silu
from slotserve.model.weights import QuantizedWeight, Tensor

Glu = Callable[[mx.array, mx.array], mx.array]  # (gate, up) -> the expert's hidden rows

# From this many (row, expert) pairs, issuing them grouped by expert pays on CPU
# (measured E=64, k=8, H=1024: 2.4x at 64 rows, 2.5x at 256; about even below 64 pairs).
GROUP_MIN_PAIRS = 64


class ExpertProj(Layer):
    """One projection of every expert of a layer, applied to (row, expert) pairs; `bias`
    [E, out] adds each pair's expert's bias (gpt-oss)."""

    def __init__(self, weight: Tensor | Mxfp4Weight, dtype: mx.Dtype, keep_quantized: bool,
                 bias: Tensor | None = None) -> None:
        self.q: QuantizedWeight | Mxfp4Weight | None = None
        self.wt: mx.array | None = None
        assert bias is None or isinstance(bias, mx.array), "biases are never quantized"
        self.bias = None if bias is None else bias.astype(dtype)
        # MXFP4 experts stay MXFP4 on the CPU too (gpt-oss-20b: 13 GB, not 84 GB in float32);
        # gather_qmm still takes each (row, expert) pair as its own one-row product
        if isinstance(weight, Mxfp4Weight) or (keep_quantized
                                                and isinstance(weight, QuantizedWeight)):
            if isinstance(weight, QuantizedWeight):  # products in dtype (see Linear)
                weight = weight.with_scales_in(dtype)
            self.q = _with_spare_expert(weight) if mx.default_device() == mx.gpu else weight
        else:
            dense = (
                weight.dequantize(dtype) if isinstance(weight, QuantizedWeight)
                else weight.astype(dtype)
            )
            # [E, in, out] kept contiguous so each pair is a plain row-times-matrix product.
            self.wt = mx.contiguous(dense.swapaxes(1, 2))

    def __call__(self, x: mx.array, experts: mx.array, grouped: bool = False) -> mx.array:
        """x: [*B, 1, in] with B broadcasting against experts' shape -> [*B', 1, out]."""
        y = self._product(x, experts, grouped)
        return y if self.bias is None else y + self.bias[experts][..., None, :]

    def _product(self, x: mx.array, experts: mx.array, grouped: bool) -> mx.array:
        if isinstance(self.q, Mxfp4Weight):
            q4 = self.q
            return mx.gather_qmm(
                x, q4.weight, q4.scales, None, rhs_indices=experts, transpose=True,
                group_size=q4.group_size, bits=q4.bits, mode=q4.mode, sorted_indices=grouped,
            )
        if self.q is not None:
            q = self.q
            return mx.gather_qmm(
                x, q.weight, q.scales, q.biases, rhs_indices=experts, transpose=True,
                group_size=q.group_size, bits=q.bits, sorted_indices=grouped,
            )
        assert self.wt is not None
        return mx.gather_mm(x, self.wt, rhs_indices=experts, sorted_indices=grouped)

    def arrays(self) -> list[mx.array]:
        q = self.q
        out = ([self.wt] if q is None else [q.weight, q.scales] if isinstance(q, Mxfp4Weight)
               else [q.weight, q.scales, q.biases])
        return out + ([] if self.bias is None else [self.bias])  # type: ignore[list-item]


def _with_spare_expert(q: QuantizedWeight | Mxfp4Weight) -> QuantizedWeight | Mxfp4Weight:
    """q with one zero expert after the last, which no row is routed to. MLX 0.32's CUDA
    gather_qmm (its qmm_sm80 kernel) reads a few bytes past the end of the expert weights:
    compute-sanitizer on the H200 shows it on tiny qwen3_moe and Gemma 4 MoE layers, and
    where nothing is mapped after them the step dies with an illegal memory access. The
    spare expert keeps those reads inside our own array (1/E more expert memory)."""

    def spare(a: mx.array) -> mx.array:
        return mx.concatenate([a, mx.zeros((1, *a.shape[1:]), dtype=a.dtype)])

    if isinstance(q, Mxfp4Weight):
        return replace(q, weight=spare(q.weight), scales=spare(q.scales))
    return replace(q, weight=spare(q.weight), scales=spare(q.scales), biases=spare(q.biases))


class SparseMoE(Layer):
    """A mixture of SwiGLU experts: a softmax router over all experts (float32) keeps the top
    k per row, optionally renormalized to sum to one; the row's output is the weighted sum
    of its k experts' outputs.

    Experts run through `gather_mm`: each (row, expert) pair is its own one-row product
    against that expert's matrix, so all rows go in one call per projection and a row's
    result never depends on which other rows share the batch.
    """

    def __init__(self, router: Tensor, gate_up: Tensor, down: Tensor, *, inter: int,
                 top_k: int, norm_topk: bool, dtype: mx.Dtype, keep_quantized: bool,
                 act: Activation = silu, glu: Glu | None = None,
                 biases: tuple[Tensor | None, Tensor | None, Tensor | None] | None = None
                 ) -> None:
        """gate_up [E, 2 * inter, H] (gate rows, then up rows), down [E, H, inter]; each
        expert computes down(act(gate x) * up x) (act: silu, or Gemma 4's tanh GELU), or
        down(glu(gate x, up x)) when `glu` is given (gpt-oss's clamped one); biases: the
        (router [E], gate_up [E, 2 * inter], down [E, H]) biases, each optional."""
        router_bias, gate_up_bias, down_bias = biases or (None, None, None)
        self.router = Linear(router, dtype, keep_quantized, bias=router_bias)
        self.act, self.glu = act, glu
        self.top_k, self.norm_topk, self.inter = top_k, norm_topk, inter
        self.gate_up = ExpertProj(gate_up, dtype, keep_quantized, gate_up_bias)
        self.down = ExpertProj(down, dtype, keep_quantized, down_bias)
        # MLX's CPU gather_mm runs one BLAS call per pair whatever the order, so grouping
        # pairs by expert changes no bits there; GPU kernels may differ, so CPU only.
        self.can_group = self.down.wt is not None and mx.default_device() == mx.cpu
        # GPU expert kernels change path with the row count (CUDA: 1-7 rows give other bits
        # than 8+), so there padding rows go through the experts too, as through every Linear
        # (routed to row 0's experts, so they read no other expert's weights).
        self.skip_padding = mx.default_device() == mx.cpu
        self.cuda = cuda.enabled() and act is silu and glu is None

    def parts(self) -> list[Layer]:
        return [self.router, self.gate_up, self.down]

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
            h = self.act(g) * u if self.glu is None else self.glu(g, u)
        return self.down(h, experts, grouped)

    def grouped_swiglu(self, x: mx.array, experts: mx.array) -> mx.array:
        """The same per-pair products, issued expert by expert so weights stay in cache."""
        r, k = experts.shape
        flat = experts.flatten()
        order = mx.argsort(flat)
        y = self.swiglu(x[order // k][:, None, :], flat[order], grouped=True)  # [R*k, 1, H]
        return y[mx.argsort(order)].reshape(r, k, -1)

    def __call__(self, x: mx.array, residual: mx.array | None = None,
                 norm: Norm | None = None, rows: int | None = None) -> mx.array:
        """norm(x) [R, H] through the experts, plus `residual` when given; only the first
        `rows` rows (default all) are real, the rest padding.

        The router sees every row (it is a plain Linear, padded for invariance); the
        experts, which cost k weight reads per row, skip the padding rows (output 0).
        """
        x = normed(x, norm)
        experts, weights = self.route(x)
        return plus(self.mix(x, experts, weights, rows), residual)

    def mix(self, x: mx.array, experts: mx.array, weights: mx.array,
            rows: int | None = None) -> mx.array:
        """x [R, H] through its rows' chosen experts [R, k], summed with their weights [R, k]
        (a family whose router reads another input than the experts routes on its own)."""
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


