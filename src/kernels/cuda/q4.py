"""The 4-bit matmul (q4_matmul.cu) and the RMS norm it shares with rms_rows.cu.

MLX 0.32's CUDA 4-bit matmul reads weights at 90-530 GB/s of the H200's ~3 TB/s at
decode row counts and changes kernels (and so a row's bits) at 8 rows. This one
dequantizes each weight as bf16(scale * q + bias) in one rounding, chains the tensor-core
steps of a warp's K range into one float32 sum and adds the K split's partials in warp
order, so a row's bits never depend on the launch's row count. Prefill row counts run q4_gemm.cu
(q4_wgmma.cu on Hopper), which does the same operations in the same order in larger tiles.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from slotserve.kernels.cuda import launch, sm90a, sources
from slotserve.kernels.cuda.glue import swiglu
from slotserve.kernels.cuda.launch import Q4Shape
from slotserve.kernels.cuda.sources import kernel

GROUP = 64  # quantization group size the matmul kernel handles


def q4_supported(in_dim: int, out_dim: int, bits: int, group_size: int) -> bool:
    return bits == 4 and group_size == GROUP and in_dim % 128 == 0 and out_dim % 16 == 0


def q4_pack(w: mx.array, scales: mx.array, biases: mx.array) -> tuple[mx.array, mx.array]:
    """MLX 4-bit [N, K/8] weights and [N, K/64] scales/biases -> the kernel's layouts
    (q4_matmul.cu says which thread reads what)."""
    n, words = w.shape
    chunks = words // 16
    wp = (w.reshape(n // 8, 8, chunks, 2, 4, 2).transpose(0, 2, 1, 4, 3, 5)
          .reshape(n // 8, chunks, 32, 4))
    # each word's codes interleaved for q4_pair: code j (bits 4j..) to nibble _NIBBLE_TO[j]
    wp = _interleave(wp.astype(mx.uint32))
    pairs = mx.stack([scales, biases], axis=-1).astype(mx.bfloat16).view(mx.uint32)
    sp = (pairs.reshape(n // 8, 4, 2, chunks, 2).transpose(0, 3, 1, 4, 2)
          .reshape(n // 8, chunks, 4, 4))
    return mx.contiguous(wp), mx.contiguous(sp)


_NIBBLE_TO = (0, 4, 1, 5, 2, 6, 3, 7)  # code j of an MLX word -> nibble in the packed word


def _interleave(words: mx.array) -> mx.array:
    out = mx.zeros_like(words)
    for j, dst in enumerate(_NIBBLE_TO):
        out = out | (((words >> (4 * j)) & 0xF) << (4 * dst))
    return out


def paired_rows(inter: int) -> mx.array:
    """The row order of a fused [gate; up] matrix (2 * inter rows) that puts 8-row tile j of
    gate and of up side by side (tiles 2j, 2j + 1): q4_matmul(gate_up=True) then finds each
    output's gate and up columns in one block."""
    rows = mx.arange(2 * inter, dtype=mx.int32).reshape(2, inter // 8, 8)
    return rows.transpose(1, 0, 2).reshape(-1)


def q4_matmul(x: mx.array, wp: mx.array, sp: mx.array, *, gate_up: bool = False,
              residual: mx.array | None = None,
              norm: tuple[mx.array, float] | None = None) -> mx.array:
    """x [M, K] bf16 times 4-bit weights packed by q4_pack -> [M, N] bf16.

    gate_up: the weights are a [gate; up] pair in paired_rows order; the result is
    silu(gate) * up [M, N/2], the same bits as swiglu() of the plain product. residual
    [M, N] bf16: the result is product + residual, the same bits as the two ops. norm
    (weight [K], eps): x is RMS-normalized first, the bits of rms_rows(x, *norm). Each is
    done inside the matmul's own launch where the launch shape allows (launch.py), else by
    a launch of its own.
    """
    m, n = x.shape[0], wp.shape[0] * 8
    # prefill row counts run q4_gemm (the same bits, faster), which fuses neither
    wide = launch.q4_gemm(m, n)
    shape = launch.q4_shape(m, n, norm=norm is not None and not wide,
                            gate_up=gate_up and not wide)
    if norm is not None and not shape.norm:
        x = rms_rows(x, *norm)
    if wide:
        y = gemm(x, wp, sp, residual=residual)
    else:
        y = run(x, wp, sp, shape, residual=residual, norm=norm if shape.norm else None)
    return swiglu(y, paired=True) if gate_up and not shape.swiglu else y


def run(x: mx.array, wp: mx.array, sp: mx.array, shape: Q4Shape, *,
        residual: mx.array | None = None,
        norm: tuple[mx.array, float] | None = None) -> mx.array:
    """One q4_matmul launch of the given shape (q4_matmul picks it by launch.q4_shape;
    bench/gpu_profile.py sweeps others: a shape changes the speed, never the bits)."""
    m, k = x.shape
    n = wp.shape[0] * 8
    ksplit = launch.k_split(k // 128)
    assert shape.norm == (norm is not None), "norm given exactly when the launch does it"
    assert not shape.swiglu or shape.nt % 2 == 0, "a block holds whole (gate, up) tile pairs"
    x = x.astype(mx.bfloat16)
    # the norm's weight and eps (as int bits) for the launch; x stands in without NORM
    nw, eps_bits = (norm[0].astype(mx.bfloat16), _float_bits(norm[1])) if norm else (x, 0)
    (y,) = kernel("q4_matmul", launch.q4_shared_bytes(shape, ksplit, m, k))(
        inputs=[x, wp, sp, x if residual is None else residual, nw],
        template=[("MT", shape.mt), ("NT", shape.nt), ("KSPLIT", ksplit),
                  ("STAGES", shape.stages), ("SWIGLU", shape.swiglu),
                  ("RESID", residual is not None), ("NORM", shape.norm), ("EPS", eps_bits)],
        grid=(n // (8 * shape.nt) * -(-m // (16 * shape.mt)) * 32 * ksplit, 1, 1),
        threadgroup=(32 * ksplit, 1, 1),
        output_shapes=[(m, n // 2 if shape.swiglu else n)],
        output_dtypes=[mx.bfloat16],
    )
    return y


def gemm(x: mx.array, wp: mx.array, sp: mx.array, *,
         residual: mx.array | None = None) -> mx.array:
    """The product q4_matmul's launches give, bit for bit, in 128 x 128 block tiles, for
    prefill row counts; n % 128 == 0. residual: product + residual, as run(). On Hopper the
    multiplies run on its warpgroup multiply (gemm_wgmma), elsewhere on mma.sync (gemm_mma):
    the same bits."""
    return (gemm_wgmma if sm90a.available() else gemm_mma)(x, wp, sp, residual=residual)


def gemm_mma(x: mx.array, wp: mx.array, sp: mx.array, *,
             residual: mx.array | None = None) -> mx.array:
    """One q4_gemm launch (q4_gemm.cu), any GPU the kernels run on (sm_80 on)."""
    m, k = x.shape
    n = wp.shape[0] * 8
    assert n % 128 == 0, "q4_gemm takes whole 128-column blocks"
    (y,) = kernel("q4_gemm", launch.q4_gemm_shared_bytes())(
        inputs=[x.astype(mx.bfloat16), wp, sp, x if residual is None else residual],
        template=[("KSPLIT", launch.k_split(k // 128)), ("STAGES", launch.GEMM_STAGES),
                  ("RESID", residual is not None)],
        grid=(-(-m // 128) * (n // 128) * 256, 1, 1),
        threadgroup=(256, 1, 1),
        output_shapes=[(m, n)],
        output_dtypes=[mx.bfloat16],
    )
    return y


def gemm_wgmma(x: mx.array, wp: mx.array, sp: mx.array, *,
               residual: mx.array | None = None) -> mx.array:
    """One q4_wgmma launch (q4_wgmma.cu, built for sm_90a by sm90a.py): Hopper only."""
    m, k = x.shape
    n = wp.shape[0] * 8
    assert n % 128 == 0, "q4_wgmma takes whole 128-column blocks"
    name, source = sources.q4_wgmma(launch.k_split(k // 128), residual is not None)
    (y,) = mx.fast.precompiled_cuda_kernel(
        name=name, compiled_source=sm90a.cubin(source),
        inputs=[x.astype(mx.bfloat16), wp, sp, x if residual is None else residual],
        output_shapes=[(m, n)], output_dtypes=[mx.bfloat16], scalars=[m, k, n],
        grid=(-(-m // 128) * (n // 128) * 256, 1, 1), threadgroup=(256, 1, 1),
        shared_memory=launch.q4_wgmma_shared_bytes(), ensure_row_contiguous=True)
    return y


def rms_rows(x: mx.array, w: mx.array, eps: float) -> mx.array:
    """RMS norm of each row of x [M, K] (K % 128 == 0) with weight w [K], bf16: the bits
    q4_matmul(norm=(w, eps)) multiplies (a fixed summation order whatever M)."""
    m, k = x.shape
    threads = launch.rms_threads(k)
    (y,) = kernel("rms_rows")(
        inputs=[x.astype(mx.bfloat16), w.astype(mx.bfloat16)],
        template=[("EPS", _float_bits(eps))],
        grid=(m * threads, 1, 1),
        threadgroup=(threads, 1, 1),
        output_shapes=[(m, k)],
        output_dtypes=[mx.bfloat16],
    )
    return y


def _float_bits(v: float) -> int:
    """A float32's bits as an int template argument (the kernel takes __int_as_float)."""
    return int(np.array(v, dtype=np.float32).view(np.int32))
