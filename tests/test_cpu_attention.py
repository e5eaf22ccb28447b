"""slotserve's CPU attention kernel against plain softmax attention, and its batch invariance."""

from __future__ import annotations

import ctypes

import mlx.core as mx
import numpy as np
import pytest
from conftest import NATIVE_ARCHS

from slotserve.kernels import cpu_attention, native
from slotserve.kernels.attention import BLOCK, reference_attention
from slotserve.kernels.cpu_attention import RowTables
from slotserve.kernels.invariance import native_attention_invariant


def _pool_for(k: mx.array, v: mx.array, pages: list[int], spare: int) -> tuple:
    """Scatter dense [Hkv, T, D] caches into a pool whose pages are `pages` (in that order)."""
    hkv, t, d = k.shape
    n_pages = len(pages) + spare
    keys = np.zeros((n_pages * hkv * BLOCK, d), np.float32)
    values = np.zeros_like(keys)
    kn, vn = np.asarray(k), np.asarray(v)
    for pos in range(t):
        for h in range(hkv):
            row = (pages[pos // BLOCK] * hkv + h) * BLOCK + pos % BLOCK
            keys[row], values[row] = kn[h, pos], vn[h, pos]
    table = np.array(pages, np.int32)[:, None] * hkv + np.arange(hkv, dtype=np.int32)
    return mx.array(keys), mx.array(values), table[None]


@pytest.mark.parametrize("hq,hkv,d", [(9, 3, 64), (4, 1, 128), (2, 2, 256)])
@pytest.mark.parametrize("window", [None, 50])
def test_matches_reference_attention(hq: int, hkv: int, d: int, window: int | None,
                                     lib: ctypes.CDLL) -> None:
    t = 300
    k = mx.random.normal((hkv, t, d), key=mx.random.key(1))
    v = mx.random.normal((hkv, t, d), key=mx.random.key(2))
    q = mx.random.normal((t, hq, d), key=mx.random.key(3))
    keys, values, table = _pool_for(k, v, [4, 0, 2], spare=2)
    start = 170  # a prefill chunk of rows 170..299
    rows = RowTables(table, np.zeros(t - start, np.int32), np.arange(start, t, dtype=np.int32))
    got = cpu_attention.attend(lib, q[start:], keys, values, rows, d**-0.5, window)
    want = reference_attention(q[start:], k, v, start, d**-0.5, window)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-5, atol=2e-5)


def test_padding_rows_are_zero(lib: ctypes.CDLL) -> None:
    k = mx.random.normal((1, 10, 16), key=mx.random.key(4))
    keys, values, table = _pool_for(k, k, [1], spare=1)
    q = mx.random.normal((3, 1, 16), key=mx.random.key(5))
    rows = RowTables(table, np.array([0, -1, 0], np.int32), np.array([3, 0, 9], np.int32))
    out = np.asarray(cpu_attention.attend(lib, q, keys, values, rows, 0.25, None))
    assert np.all(out[1] == 0) and np.all(np.isfinite(out))


@pytest.mark.parametrize("group,hkv,d", [(3, 3, 64), (1, 2, 128), (4, 1, 256), (2, 4, 16)])
def test_row_alone_equals_row_in_batch_and_in_prefill(group: int, hkv: int, d: int,
                                                      lib: ctypes.CDLL) -> None:
    assert native_attention_invariant(lib, group, hkv, d)


def test_every_instruction_set_gives_the_same_bits() -> None:
    """The AVX2, AVX-512 (and NEON) builds run one sequence of float operations per output."""
    t, hq, hkv, d = 200, 6, 2, 64
    k = mx.random.normal((hkv, t, d), key=mx.random.key(6))
    v = mx.random.normal((hkv, t, d), key=mx.random.key(7))
    q = mx.random.normal((t, hq, d), key=mx.random.key(8))
    keys, values, table = _pool_for(k, v, [1, 0], spare=1)
    rows = RowTables(table, np.zeros(t, np.int32), np.arange(t, dtype=np.int32))
    outs = {arch: np.asarray(cpu_attention.attend(native.library(arch), q, keys, values, rows,
                                                  d**-0.5, None))
            for arch in NATIVE_ARCHS}
    for arch, out in outs.items():
        assert np.array_equal(out, outs[NATIVE_ARCHS[0]]), arch
