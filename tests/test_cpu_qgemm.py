"""The quantized CPU matmul (cpu_qgemm): exact against its own definition, close to the
dense product, batch-invariant, and the same bits on every instruction set."""

from __future__ import annotations

import ctypes

import mlx.core as mx
import numpy as np
import pytest

from slotserve.kernels import cpu_gemm, cpu_qgemm, native
from slotserve.model.weights import QuantizedWeight

pytestmark = pytest.mark.skipif(native.library() is None,
                                reason="no C compiler: the kernel is not built")


def _weight(n: int, k: int, bits: int, seed: int, group_size: int = 32,
            scale_dtype: mx.Dtype = mx.float16) -> QuantizedWeight:
    rng = np.random.default_rng(seed)
    w = mx.array((rng.standard_normal((n, k)) * 0.05).astype(np.float32))
    q, scales, biases = mx.quantize(w, group_size=group_size, bits=bits)
    return QuantizedWeight(q, scales.astype(scale_dtype), biases.astype(scale_dtype),
                           group_size, bits)


def _rows(r: int, k: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    scale = np.exp(rng.standard_normal((r, 1)))  # rows of different magnitudes
    return cpu_gemm.aligned_copy((rng.standard_normal((r, k)) * scale).astype(np.float32))


def _parts(q: QuantizedWeight) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Codes, scales and biases per element [N, K] as float64."""
    def expand(a: mx.array) -> np.ndarray:
        return np.repeat(np.asarray(a.astype(mx.float32), np.float64), q.group_size, axis=1)

    return cpu_qgemm._codes(q).astype(np.float64), expand(q.scales), expand(q.biases)


def _dense(q: QuantizedWeight) -> np.ndarray:
    """Dequantized weights in float64 (mx.dequantize rounds to the scales' dtype)."""
    codes, scales, biases = _parts(q)
    return scales * codes + biases


def _check_exact(m: cpu_qgemm.QMatrix, q: QuantizedWeight, x: np.ndarray) -> None:
    """y against float64 dequant(x) @ dequant(W)^T, to within float32 rounding of the
    kernel's own sums (the bound scales with the magnitudes summed, not the result)."""
    qx = cpu_qgemm.quantize_rows(m.lib, x)
    y = m.host_rows(qx)
    xd = qx.dequantize()
    codes, scales, biases = _parts(q)
    ref = xd @ (scales * codes + biases).T
    if q.bits == 8:  # the kernel's form: signed codes, the 128 moved into the bias
        codes, biases = codes - 128, biases + 128 * scales
    # per block, a rounded product and two fused adds, each off by at most 2^-24 of the
    # sums' magnitude: a single code off by one would be ~50x over this bound
    magnitude = np.abs(xd) @ (np.abs(scales * codes) + np.abs(biases)).T
    nb = q.shape[1] // 32
    assert y.shape == ref.shape
    assert np.all(np.abs(y - ref) <= (2 * nb + 1) * 2.0**-24 * magnitude)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("n,k", [(200, 576), (37, 96), (16, 32), (1, 64), (45, 1536)])
def test_matches_its_definition_in_float64(lib: ctypes.CDLL, bits: int, n: int, k: int) -> None:
    q = _weight(n, k, bits, seed=n + k)
    m = cpu_qgemm.QMatrix(q, lib)
    assert (m.n, m.k) == (n, k)
    for rows in (1, 7, 40):
        _check_exact(m, q, _rows(rows, k, seed=rows))


@pytest.mark.parametrize("bits", [4, 8])
def test_close_to_the_dense_product(bits: int) -> None:
    """What a user sees: int8 activations cost well under 1 % of the output."""
    lib = native.library()
    q = _weight(300, 640, bits, seed=3)
    x = _rows(24, 640, seed=4)
    y = cpu_qgemm.QMatrix(q, lib).host(x)
    ref = x.astype(np.float64) @ _dense(q).T
    rel = np.linalg.norm(y - ref, axis=1) / np.linalg.norm(ref, axis=1)
    assert rel.max() < 1e-2


@pytest.mark.parametrize("bits", [4, 8])
def test_row_results_do_not_depend_on_the_batch(lib: ctypes.CDLL, bits: int) -> None:
    q = _weight(70, 640, bits, seed=5)  # 70 rows: a partial last panel
    m = cpu_qgemm.QMatrix(q, lib)
    x = _rows(300, 640, seed=6)
    full = m.host(x)
    # the one-call path (quantize + matmul in one parallel region) and the two-step one
    assert np.array_equal(full, m.host_rows(cpu_qgemm.quantize_rows(lib, x)))
    for rows in (*range(1, 13), 31, 64, 256):
        for start in (0, 1, 40):
            part = m.host(cpu_gemm.aligned_copy(x[start : start + rows]))
            assert np.array_equal(part, full[start : start + rows]), (rows, start)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("scale_dtype", [mx.float16, mx.float32])
def test_same_bits_on_every_instruction_set(bits: int, scale_dtype: mx.Dtype) -> None:
    archs = native.runnable_archs()
    q = _weight(77, 320, bits, seed=7, scale_dtype=scale_dtype)
    x = _rows(29, 320, seed=8)
    x[3, :32] = 0.0  # a block of zeros (d = 0)
    x[4, 5] = 1e-30  # a block whose scale is subnormal
    results = {}
    for arch in archs:
        lib = native.library(arch)
        assert lib is not None, arch
        m = cpu_qgemm.QMatrix(q, lib)
        assert m.f16 == (scale_dtype == mx.float16)
        qx = cpu_qgemm.quantize_rows(lib, x)
        results[arch] = (qx.q.copy(), qx.d.view(np.uint32).copy(), m.host_rows(qx))
    base = results[archs[0]]
    for arch, got in results.items():
        for a, b in zip(got, base, strict=True):
            assert np.array_equal(a.view(np.uint8), b.view(np.uint8)), arch


def test_activation_quantization_is_as_defined() -> None:
    lib = native.library()
    x = _rows(5, 96, seed=9)
    x[1, 32:64] = 0.0
    qx = cpu_qgemm.quantize_rows(lib, x)
    blocks = x.reshape(5, 3, 32)
    d = np.abs(blocks).max(axis=2) / np.float32(127)
    assert np.array_equal(qx.d, d)
    with np.errstate(invalid="ignore", divide="ignore"):
        codes = np.where(d[..., None] > 0, np.rint(blocks / d[..., None]), 0)
    assert np.array_equal(qx.q.reshape(5, 3, 32), codes.astype(np.int8))
    assert np.array_equal(qx.xs, codes.sum(axis=2).astype(np.int32))
    assert np.array_equal(qx.dxs, d * qx.xs.astype(np.float32))
    assert np.abs(qx.q).max() <= 127


@pytest.mark.parametrize("group_size", [64, 128])
def test_larger_groups_are_blocks_that_share_a_scale(group_size: int) -> None:
    lib = native.library()
    q = _weight(40, 256, 4, seed=10, group_size=group_size)
    _check_exact(cpu_qgemm.QMatrix(q, lib), q, _rows(9, 256, seed=11))


def test_gguf_style_symmetric_weights() -> None:
    """Q4_0 / Q8_0 as mx.load gives them: bias = -8 * scale / -128 * scale in float16."""
    lib = native.library()
    rng = np.random.default_rng(12)
    for bits, offset in ((4, 8), (8, 128)):
        codes = rng.integers(0, 1 << bits, size=(48, 128), dtype=np.uint32)
        per = 32 // bits
        words = np.zeros((48, 128 // per), np.uint32)
        for i in range(per):
            words |= codes[:, i::per] << np.uint32(bits * i)
        scales = (rng.random((48, 4)) * 0.01).astype(np.float16)
        biases = (-offset * scales.astype(np.float32)).astype(np.float16)
        q = QuantizedWeight(mx.array(words), mx.array(scales), mx.array(biases), 32, bits)
        m = cpu_qgemm.QMatrix(q, lib)
        assert m.f16  # 8-bit: bias + 128 * scale is exactly 0
        _check_exact(m, q, _rows(6, 128, seed=bits))


def test_real_smollm2_layers() -> None:
    from slotserve.model.loader import default_model_path

    lib = native.library()
    raw = mx.load(str(default_model_path()))
    assert isinstance(raw, dict)
    x = _rows(5, 1536, seed=13)
    for name in ("blk.0.ffn_up", "blk.0.ffn_down"):
        w, scales = raw[name + ".weight"], raw[name + ".scales"]
        bits = w.shape[1] * 32 // (scales.shape[1] * 32)
        q = QuantizedWeight(w, scales, raw[name + ".biases"], 32, bits)
        m = cpu_qgemm.QMatrix(q, lib)
        assert m.f16 and bits == 4  # Q4_1: float16 scales and mins
        xs = cpu_gemm.aligned_copy(x[:, : m.k])
        _check_exact(m, q, xs)
        ref = xs.astype(np.float64) @ _dense(q).T
        rel = np.linalg.norm(m.host(xs) - ref, axis=1) / np.linalg.norm(ref, axis=1)
        assert rel.max() < 1e-2, name


def test_leading_dims_through_mlx() -> None:
    lib = native.library()
    q = _weight(48, 64, 4, seed=14)
    big = mx.array(_rows(10, 128, seed=15).reshape(2, 5, 128))
    x = big[:, :, ::2]  # not contiguous
    m = cpu_qgemm.QMatrix(q, lib)
    y = m(x)
    assert y.shape == (2, 5, 48) and y.dtype == mx.float32
    flat = cpu_gemm.aligned_copy(np.asarray(x).reshape(10, 64))
    assert np.array_equal(np.asarray(y).reshape(10, 48), m.host(flat))


def test_zero_rows_give_zeros() -> None:
    lib = native.library()
    m = cpu_qgemm.QMatrix(_weight(20, 64, 8, seed=16), lib)
    y = m.host(cpu_gemm.aligned_copy(np.zeros((3, 64), np.float32)))
    assert np.array_equal(y, np.zeros((3, 20), np.float32))


def test_rejects_what_it_cannot_run() -> None:
    lib = native.library()
    assert cpu_qgemm.supported(_weight(8, 64, 4, seed=0))
    q3 = _weight(8, 64, 3, seed=0)
    assert not cpu_qgemm.supported(q3)
    with pytest.raises(ValueError, match="3-bit"):
        cpu_qgemm.QMatrix(q3, lib)
    q = _weight(8, 64, 4, seed=0)
    odd = QuantizedWeight(q.weight, mx.repeat(q.scales, 2, axis=1),
                          mx.repeat(q.biases, 2, axis=1), 16, 4)
    assert not cpu_qgemm.supported(odd)
    with pytest.raises(ValueError, match="group size"):
        cpu_qgemm.QMatrix(odd, lib)
    with pytest.raises(TypeError):
        cpu_qgemm.QMatrix(mx.zeros((8, 64)), lib)  # type: ignore[arg-type]
    m = cpu_qgemm.QMatrix(q, lib)
    with pytest.raises(ValueError, match="K="):
        m.host(cpu_gemm.aligned_copy(np.zeros((2, 96), np.float32)))
    with pytest.raises(ValueError, match="multiple of 32"):
        cpu_qgemm.quantize_rows(lib, cpu_gemm.aligned_copy(np.zeros((2, 40), np.float32)))
