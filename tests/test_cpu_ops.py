"""The small native steps between matmuls (SwiGLU, RoPE, K/V write) against plain references."""

from __future__ import annotations

import ctypes

import mlx.core as mx
import numpy as np

from slotserve.kernels import cpu_gemm
from slotserve.model.layers import Rope


def test_swiglu_matches_float64(lib: ctypes.CDLL) -> None:
    rng = np.random.default_rng(0)
    gu = cpu_gemm.aligned_copy((rng.standard_normal((5, 64)) * 6).astype(np.float32))
    gu[0, :4] = [-100.0, 100.0, 0.0, -0.0]  # saturated and zero inputs
    out = cpu_gemm.aligned_empty((5, 32))
    assert lib.slot_swiglu(gu.ctypes.data, 5, 32, out.ctypes.data) == 0
    g, u = gu[:, :32].astype(np.float64), gu[:, 32:].astype(np.float64)
    want = g / (1 + np.exp(-g)) * u
    np.testing.assert_allclose(out, want, rtol=2e-6, atol=1e-30)


def test_rope_matches_the_mlx_formula(lib: ctypes.CDLL) -> None:
    rope = Rope(64, 10000.0, None, mx.float32)
    pos = mx.array([0, 3, 700, 4095], dtype=mx.int32)
    cos, sin = rope.tables(pos, 4095)
    x = mx.random.normal((4, 5, 64), key=mx.random.key(3))
    want = np.asarray(Rope.apply(x, cos, sin))
    host = cpu_gemm.aligned_copy(np.asarray(x).reshape(4, 5 * 64))
    tables = rope.host_tables()
    lib.slot_rope(host.ctypes.data, 4, 5 * 64, 5, 64, tables.cos.ctypes.data,
                  tables.sin.ctypes.data, np.asarray(pos).ctypes.data)
    np.testing.assert_allclose(host.reshape(4, 5, 64), want, rtol=1e-6, atol=1e-6)


def test_kv_write_puts_each_head_at_its_row(lib: ctypes.CDLL) -> None:
    heads, d, rows = 2, 16, 3
    src = cpu_gemm.aligned_copy(np.arange(rows * 5 * d, dtype=np.float32).reshape(rows, 5 * d))
    pool_k = np.zeros((20, d), np.float32)
    pool_v = np.zeros((20, d), np.float32)
    dest = np.array([[4, 9], [0, 1], [19, 7]], np.int32)
    lib.slot_kv_write(pool_k.ctypes.data, pool_v.ctypes.data, src.ctypes.data, rows, 5 * d,
                      1 * d, 3 * d, heads, d, dest.ctypes.data)
    for r in range(rows):
        for h in range(heads):
            k_off, v_off = (1 + h) * d, (3 + h) * d
            assert np.array_equal(pool_k[dest[r, h]], src[r, k_off : k_off + d])
            assert np.array_equal(pool_v[dest[r, h]], src[r, v_off : v_off + d])


def test_rms_norm_matches_mlx(lib: ctypes.CDLL) -> None:
    rng = np.random.default_rng(4)
    x = cpu_gemm.aligned_copy((rng.standard_normal((7, 576)) * 3).astype(np.float32))
    w = cpu_gemm.aligned_copy(rng.standard_normal((1, 576)).astype(np.float32))[0]
    got = cpu_gemm.rms_norm_host(lib, x, w, 1e-5)
    want = np.asarray(mx.fast.rms_norm(mx.array(x), mx.array(w), 1e-5))
    np.testing.assert_allclose(got, want, rtol=2e-6, atol=2e-6)
    assert np.array_equal(cpu_gemm.rms_norm_host(lib, cpu_gemm.aligned_copy(x[3:4]), w, 1e-5),
                          got[3:4])  # a row alone: the same bits


def test_top_values_are_each_rows_largest_in_order(lib: ctypes.CDLL) -> None:
    """cpu_sampler.top_values gives what MLX's topk and a descending sort give: probabilities
    (ties, zeros, a flat row), then signed values (negatives, -0.0, infinities)."""
    from slotserve.kernels import cpu_sampler

    rng = np.random.default_rng(7)
    e = np.exp2(rng.standard_normal((6, 5000)).astype(np.float32) * 4 - 8).astype(np.float32)
    e[1, ::3] = e[1, 7]  # a third of the row tied
    e[2] = 0.5  # flat
    e[3, 100:] = 0.0  # zeros below a short head
    e[4] = np.round(e[4] * 8) / 8  # few distinct values
    signed = rng.standard_normal((3, 777)).astype(np.float32)
    signed[0, :5] = [-0.0, 0.0, np.inf, -np.inf, -0.0]
    for x in (e, signed):
        n, v = x.shape
        for k in sorted({1, 2, 40, min(1024, v), v}):
            got = np.empty((n, k), np.float32)
            assert lib.slot_top_values(x.ctypes.data, n, v, k, got.ctypes.data) == 0
            want = np.asarray(-mx.sort(-mx.topk(mx.array(x), k, axis=-1), axis=-1))
            np.testing.assert_array_equal(got, want)
            if k == 40:  # the wrapper the sampler calls (the engine's build)
                np.testing.assert_array_equal(cpu_sampler.top_values(x, k), want)
    with_mx = cpu_sampler.top_values(mx.array(e), 40)
    np.testing.assert_array_equal(with_mx, cpu_sampler.top_values(e, 40))
    assert lib.slot_top_values(e.ctypes.data, 6, 5000, 0, e.ctypes.data) == -1  # k < 1


def test_sampler_probabilities_and_draw_are_mlxs_bits(lib: ctypes.CDLL) -> None:
    """slot_sampler_exp2 gives mx.power(2, (z - max) * scale)'s bits (peaked, flat and
    -inf entries, a row of one value), and slot_sampler_draw the token of _draw's MLX ops
    (the truncation mask, a running sum, its two counts) without truncation and under
    min_p, top_k and top_p rules, a tie at the cut among them; the sampler's own probe of
    that (sampling.native_draw_agrees) finds it too, so the host path takes them."""
    from slotserve.kernels import cpu_sampler
    from slotserve.runtime import sampling

    assert sampling.native_draw_agrees()
    rng = np.random.default_rng(11)
    n, v = 7, 49152
    z = (rng.standard_normal((n, v)) * 4).astype(np.float32)
    z[1] *= 0.01  # nearly flat
    z[2, ::5] = -np.inf  # banned entries (logit_bias)
    z[3] = 1.5
    scale = np.array([2.0, 1.44, 0.5, 1.0, 3.7, 1e-3, 40.0], np.float32)
    e = np.empty_like(z)
    assert lib.slot_sampler_exp2(z.ctypes.data, n, v, scale.ctypes.data, e.ctypes.data) == 0
    zm = mx.array(z)
    want = mx.power(2.0, (zm - mx.max(zm, axis=-1)[:, None]) * mx.array(scale)[:, None])
    assert np.array_equal(e.view(np.uint32), np.asarray(want).view(np.uint32))
    u = rng.random(n).astype(np.float32)
    u[0] = 0.0
    u[-1] = np.nextafter(np.float32(1.0), np.float32(0.0))
    at_mass = u.copy()
    at_mass[1] = 1.0  # a target at the mass: no running sum passes it (both counts in full)
    em = mx.array(e)
    total = mx.sum(em, axis=-1)
    off, none = np.full(n, v), np.zeros(n, np.float32)
    cases = [(off, np.ones(n, np.float32), none),  # no truncation
             (off, np.ones(n, np.float32), np.full(n, 0.05, np.float32)),  # min_p alone
             # top_k, top_p and min_p mixed; row 3 is one value, so its top 2 are a tie cut
             (np.array([40, 1, 5, 2, 100, v, 7]),
              np.array([1.0, 0.9, 1.0, 1.0, 0.5, 0.8, 0.95], np.float32),
              np.array([0.0, 0.0, 0.01, 0.0, 0.0, 0.1, 0.0], np.float32))]
    for k_eff, top_p, min_p in cases:
        rule = sampling._truncation(em, total, k_eff, top_p, min_p)
        mask = sampling._truncation_mask(em, total, k_eff, top_p, min_p)
        for uu in (u, at_mass):
            want_t = np.asarray(sampling._cdf_draw(em, mask, mx.array(uu)))
            got = np.empty(n, np.int32)
            ptrs = [None] * 3 if rule is None else [
                a.ctypes.data for a in (rule.lo, rule.tied, rule.ranks)]
            assert lib.slot_sampler_draw(e.ctypes.data, n, v, *ptrs, uu.ctypes.data,
                                         got.ctypes.data) == 0
            np.testing.assert_array_equal(got, want_t)
            if rule is not None:
                np.testing.assert_array_equal(
                    cpu_sampler.draw(e, uu, rule.lo, rule.tied, rule.ranks), want_t)
    assert rule is not None and rule.ranks[3] == 2 and rule.tied[3] == 1.0  # the tie cut
    assert want_t[3] in (0, 1)  # of a flat row's ties, the two lowest ids
