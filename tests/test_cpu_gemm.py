"""slotserve's CPU matmul kernel: right answers, and a row's result never depends on its batch."""

from __future__ import annotations

import ctypes

import mlx.core as mx
import numpy as np
import pytest
from conftest import NATIVE_ARCHS

from slotserve.kernels import cpu_gemm, native


def _reference(x: mx.array, w: mx.array) -> np.ndarray:
    return np.asarray(x, dtype=np.float64) @ np.asarray(w.astype(mx.float32), np.float64).T


@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16])
@pytest.mark.parametrize("n,k", [(200, 576), (7, 50), (33, 1536)])
def test_matches_float64_reference(dtype: mx.Dtype, n: int, k: int, lib: ctypes.CDLL) -> None:
    rng = np.random.default_rng(n + k)
    w = mx.array(rng.standard_normal((n, k)).astype(np.float32)).astype(dtype)
    x = mx.array(rng.standard_normal((37, k)).astype(np.float32))
    y = np.asarray(cpu_gemm.Matrix(w, lib)(x))
    assert y.shape == (37, n)
    np.testing.assert_allclose(y, _reference(x, w), rtol=1e-4, atol=2e-4)


@pytest.mark.parametrize("dtype", [mx.float32, mx.float16])
def test_row_results_do_not_depend_on_the_batch(dtype: mx.Dtype, lib: ctypes.CDLL) -> None:
    rng = np.random.default_rng(1)
    w = mx.array(rng.standard_normal((70, 640)).astype(np.float32)).astype(dtype)
    x = mx.array(rng.standard_normal((300, 640)).astype(np.float32))
    m = cpu_gemm.Matrix(w, lib)
    full = np.asarray(m(x))
    for rows in (1, 2, 3, 4, 5, 6, 7, 11, 64, 256):
        for start in (0, 1, 40):
            part = np.asarray(m(x[start : start + rows]))
            assert np.array_equal(part, full[start : start + rows]), (rows, start)


def test_leading_dims_and_strided_input(lib: ctypes.CDLL) -> None:
    rng = np.random.default_rng(2)
    w = mx.array(rng.standard_normal((48, 64)).astype(np.float16))
    big = mx.array(rng.standard_normal((2, 5, 128)).astype(np.float32))
    x = big[:, :, ::2]  # not contiguous
    y = cpu_gemm.Matrix(w, lib)(x)
    assert y.shape == (2, 5, 48)
    np.testing.assert_allclose(np.asarray(y).reshape(10, 48),
                               _reference(x.reshape(10, 64), w), rtol=1e-4, atol=1e-4)


def test_rejects_other_weight_types(lib: ctypes.CDLL) -> None:
    with pytest.raises(TypeError):
        cpu_gemm.Matrix(mx.zeros((4, 16), dtype=mx.int32), lib)


@pytest.mark.parametrize("dtype", [mx.float32, mx.float16])
def test_every_instruction_set_gives_the_same_bits(dtype: mx.Dtype) -> None:
    """The AVX2, AVX-512 (and NEON) builds run one sequence of float operations per output,
    whatever their register tiles: a token stream is the same on every CPU type."""
    rng = np.random.default_rng(3)
    w = mx.array(rng.standard_normal((130, 576)).astype(np.float32)).astype(dtype)
    x = mx.array(rng.standard_normal((19, 576)).astype(np.float32))
    outs = {arch: np.asarray(cpu_gemm.Matrix(w, native.library(arch))(x))
            for arch in NATIVE_ARCHS}
    for arch, out in outs.items():
        assert np.array_equal(out, outs[NATIVE_ARCHS[0]]), arch
