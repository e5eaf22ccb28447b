"""slotserve's CUDA kernels (slotserve.kernels.cuda) against plain MLX references, and
their batch invariance, on the GPU (skipped where MLX has no CUDA GPU, e.g. CI)."""

from __future__ import annotations

import math
from dataclasses import replace

import mlx.core as mx
import numpy as np
import pytest

from slotserve.kernels import cuda
from slotserve.kernels.attention import BLOCK, paged_blocks, reference_attention
from slotserve.kernels.cuda import launch, q4, sm90a
from slotserve.kernels.cuda.launch import Q4Shape
from slotserve.kernels.invariance import cuda_attention_invariant
from slotserve.model.layers import Rope
from slotserve.runtime.sampling import (
    _LOG2E,  # temperature _LOG2E / s gives the sampler's scale s exactly
    RowState,
    SamplingParams,
    sample_rows,
    uniform_for,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not cuda.enabled(), reason="needs MLX with a CUDA GPU"),
]

# key blocks (and keys) of a row's first attention split, and of its first two
FIRST_SPLIT = launch.split_first_block(1)
SPLIT1, SPLIT2 = FIRST_SPLIT * BLOCK, launch.split_first_block(2) * BLOCK


def _q4(n_out: int, n_in: int, seed: int) -> tuple[tuple[mx.array, mx.array], mx.array]:
    w = mx.random.normal((n_out, n_in), key=mx.random.key(seed)) * n_in**-0.5
    q, s, b = mx.quantize(w.astype(mx.bfloat16), group_size=64, bits=4)
    dense = mx.dequantize(q, s, b, group_size=64, bits=4).astype(mx.float32)
    return cuda.q4_pack(q, s, b), dense


@pytest.mark.parametrize(("n_out", "n_in"), [(512, 4096), (256, 640), (16384, 1024), (48, 256)])
def test_q4_matmul_matches_dequantized_matmul(n_out: int, n_in: int) -> None:
    packed, dense = _q4(n_out, n_in, 1)
    for m in (1, 3, 16, 17, 40, 100, 130):
        x = mx.random.normal((m, n_in), key=mx.random.key(m)).astype(mx.bfloat16)
        want = x.astype(mx.float32) @ dense.T
        got = cuda.q4_matmul(x, *packed).astype(mx.float32)
        err = mx.abs(got - want).max().item()
        assert err <= 2e-2 * (1 + mx.abs(want).max().item()), (m, err)


def test_q4_matmul_rows_do_not_depend_on_row_count() -> None:
    for n_out in (1024, 16384):  # both column widths per block
        packed, _ = _q4(n_out, 2048, 2)
        x = mx.random.normal((200, 2048), key=mx.random.key(3)).astype(mx.bfloat16)
        full = cuda.q4_matmul(x, *packed)
        # launch shapes other than the rule's (as bench/gpu_profile.py sweeps them)
        rule = launch.q4_shape(200, n_out)
        for nt in (1, 2, 4):
            same = q4.run(x, *packed, replace(rule, nt=nt))
            assert mx.array_equal(same, full).item(), nt
        for m, mt, nt, stages in ((1, 1, 8, 2), (1, 1, 4, 4), (1, 1, 2, 8), (33, 2, 8, 2),
                                  (20, 2, 4, 4), (64, 1, 8, 2), (64, 4, 2, 4), (100, 2, 4, 2),
                                  (130, 8, 2, 2)):
            same = q4.run(x[:m], *packed, Q4Shape(mt, nt, stages))  # launch only
            assert mx.array_equal(same, full[:m]).item(), (m, mt, nt, stages)
        for m in (1, 2, 7, 8, 9, 15, 16, 31, 33, 64, 65, 128, 129):
            assert mx.array_equal(cuda.q4_matmul(x[:m], *packed), full[:m]).item(), m
            one = cuda.q4_matmul(x[m - 1 : m], *packed)[0]
            assert mx.array_equal(one, full[m - 1]).item(), m


@pytest.mark.parametrize(("n_out", "n_in"), [(1024, 2048), (384, 14336), (256, 640)])
def test_q4_gemm_gives_q4_matmuls_bits(n_out: int, n_in: int) -> None:
    """Prefill row counts run q4_gemm (launch.q4_gemm), q4_wgmma on Hopper: each gives every
    row the bits of q4_matmul's own launch and of that row alone, the residual and SwiGLU
    forms too. K ranges of 2, 14 and 5 chunks (k_split 8, 8 and 1); row counts that end
    inside a 128-row block."""
    packed, _ = _q4(n_out, n_in, 4)
    wide = max(launch.GEMM_ROWS, -(-launch.GEMM_BLOCKS // (n_out // 128)) * 128)
    rows = max(3 * launch.GEMM_ROWS, wide)
    x = mx.random.normal((rows, n_in), key=mx.random.key(5)).astype(mx.bfloat16)
    res = mx.random.normal((rows, n_out), key=mx.random.key(6)).astype(mx.bfloat16)
    kernels = [q4.gemm_mma, *([q4.gemm_wgmma] if sm90a.available() else [])]
    for m in (launch.GEMM_ROWS, 2 * launch.GEMM_ROWS + 77, rows):
        tiles = q4.run(x[:m], *packed, launch.q4_shape(m, n_out))
        tiles_res = q4.run(x[:m], *packed, launch.q4_shape(m, n_out), residual=res[:m])
        for gemm_launch in kernels:
            gemm = gemm_launch(x[:m], *packed)
            assert mx.array_equal(gemm, tiles).item(), (gemm_launch.__name__, m)
            assert mx.array_equal(gemm_launch(x[:m], *packed, residual=res[:m]),
                                  tiles_res).item(), (gemm_launch.__name__, m)
            for r in (0, m // 2, m - 1):
                assert mx.array_equal(cuda.q4_matmul(x[r : r + 1], *packed)[0],
                                      gemm[r]).item(), (gemm_launch.__name__, m, r)
    m = wide
    assert launch.q4_gemm(m, n_out)  # the product API takes it there
    assert mx.array_equal(cuda.q4_matmul(x[:m], *packed),
                          q4.run(x[:m], *packed, launch.q4_shape(m, n_out))).item()
    paired = cuda.q4_pack(*mx.quantize(
        mx.random.normal((n_out, n_in), key=mx.random.key(7)).astype(mx.bfloat16),
        group_size=64, bits=4))
    assert mx.array_equal(cuda.q4_matmul(x[:m], *paired, gate_up=True),
                          cuda.swiglu(q4.run(x[:m], *paired, launch.q4_shape(m, n_out)),
                                      paired=True)).item()


def _paged_kv(slots: int, hkv: int, cap: int, d: int, k_seed: int, v_seed: int
              ) -> tuple[list[mx.array], list[mx.array], mx.array, mx.array, mx.array]:
    """Random bf16 K and V of `slots` slots ([hkv, cap, d] each), and the same in the pool's
    layout: (keys, values, key pool [rows, d], value pool [rows, d], block tables)."""
    keys = [mx.random.normal((hkv, cap, d), key=mx.random.key(k_seed + i)).astype(mx.bfloat16)
            for i in range(slots)]
    values = [mx.random.normal((hkv, cap, d), key=mx.random.key(v_seed + i)).astype(mx.bfloat16)
              for i in range(slots)]
    kblocks, tables = paged_blocks(keys)
    vblocks, _ = paged_blocks(values)
    return keys, values, kblocks.reshape(-1, d), vblocks.reshape(-1, d), tables


def test_q4_matmul_norm_launches_of_two_widths_in_one_process() -> None:
    """Two models of other hidden sizes in one process: the same NORM launch shape with a
    narrow K, then a wide one whose shared memory passes 48 KB. MLX sets a compiled
    kernel's shared-memory limit at its first launch, so each size must be its own kernel
    (sources.kernel; the wide one failed with cuGraphAddKernelNode: invalid argument while
    only the row count was in its name)."""
    m = 2
    for k in (1024, 4096):  # the narrow width first
        packed, _ = _q4(512, k, 8)
        shape = launch.q4_shape(m, 512, norm=True)
        assert shape.norm
        if k == 4096:
            assert launch.q4_shared_bytes(shape, launch.k_split(k // 128), m, k) > 48 * 1024
        x = mx.random.normal((m, k), key=mx.random.key(k)).astype(mx.bfloat16)
        w = (1.0 + 0.1 * mx.random.normal((k,), key=mx.random.key(k + 1))).astype(mx.bfloat16)
        got = cuda.q4_matmul(x, *packed, norm=(w, 1e-5))
        want = cuda.q4_matmul(cuda.rms_rows(x, w, 1e-5), *packed)
        assert mx.array_equal(got, want).item(), k


@pytest.mark.parametrize(("group", "head_dim", "window"),
                         [(4, 128, None), (2, 64, None), (3, 64, 100)])
def test_paged_attention_matches_reference(group: int, head_dim: int, window: int | None) -> None:
    hkv, cap = 2, 3 * BLOCK
    keys, values, kpool, vpool, tables = _paged_kv(3, hkv, cap, head_dim, 0, 9)
    q = mx.random.normal((cap, hkv * group, head_dim), key=mx.random.key(20)).astype(mx.bfloat16)
    # rows of slot 1: a prefill chunk over positions 0..199, then decode rows at 250 and cap-1
    positions = [*range(200), 250, cap - 1]
    rows = mx.array(positions, dtype=mx.int32)
    got = cuda.paged_attention(q[rows], kpool, vpool, tables,
                               mx.ones((len(positions),), mx.int32), rows, head_dim**-0.5, window)
    k1, v1 = keys[1], values[1]
    for i, p in enumerate(positions):
        if p >= 200 or p % 37 == 0:
            want = reference_attention(q[p : p + 1], k1, v1, p, head_dim**-0.5, window)
            err = mx.abs(got[i].astype(mx.float32) - want[0]).max().item()
            assert err < 3e-2, (p, err)


def test_paged_attention_probe() -> None:
    assert cuda_attention_invariant(4, 2, 128)
    assert cuda_attention_invariant(2, 2, 64)


def test_rope_write_and_swiglu_match_mlx() -> None:
    heads, kv_heads, d, r = 4, 2, 64, 5
    rope = Rope(d, 10000.0, None, mx.bfloat16)
    pos = mx.array([0, 3, 77, 4095, 12], dtype=mx.int32)
    cos, sin = rope.tables(pos, 4096)
    qkv = mx.random.normal((r, (heads + 2 * kv_heads) * d), key=mx.random.key(5))
    qkv = qkv.astype(mx.bfloat16)
    # pool rows of each row's K/V per kv head, scattered over a pool of 64 rows; the last
    # row is padding (the probe's row floor): it gets q but writes no K/V
    n = r - 1
    write_rows = mx.array(np.random.default_rng(0).permutation(64)[: n * kv_heads]
                          .reshape(n, kv_heads).astype(np.int32))
    kpool = mx.zeros((64, d), mx.bfloat16)
    vpool = mx.zeros((64, d), mx.bfloat16)
    mx.eval(kpool, vpool)
    q = cuda.rope_write(qkv, rope.cos, rope.sin, pos, write_rows, kpool, vpool, heads,
                        kv_heads, d)
    mx.eval(q)  # writes K/V into the pools in place
    k, v = kpool[write_rows], vpool[write_rows]  # [n, kv_heads, d]
    untouched = np.setdiff1d(np.arange(64), np.asarray(write_rows).ravel())
    for pool in (kpool, vpool):
        assert not np.asarray(pool[mx.array(untouched)].astype(mx.float32)).any()
    x = qkv.astype(mx.float32).reshape(r, heads + 2 * kv_heads, d)
    c, s = cos.astype(mx.float32), sin.astype(mx.float32)
    want_q = Rope.apply(x[:, :heads], c, s)
    want_k = Rope.apply(x[:n, heads : heads + kv_heads], c[:n], s[:n])
    assert q.shape == (r, heads * d)
    np.testing.assert_allclose(np.asarray(q.reshape(r, heads, d).astype(mx.float32)),
                               np.asarray(want_q), atol=3e-2)
    np.testing.assert_allclose(np.asarray(k.astype(mx.float32)), np.asarray(want_k), atol=3e-2)
    assert mx.array_equal(v, qkv.reshape(r, -1, d)[:n, heads + kv_heads :]).item()
    gu = mx.random.normal((r, 2 * 96), key=mx.random.key(6)).astype(mx.bfloat16)
    g, u = gu[:, :96].astype(mx.float32), gu[:, 96:].astype(mx.float32)
    np.testing.assert_allclose(np.asarray(cuda.swiglu(gu).astype(mx.float32)),
                               np.asarray(g * mx.sigmoid(g) * u), atol=3e-2)


def test_q4_matmul_gate_up_gives_swiglu_bits() -> None:
    inter, n_in = 256, 1024
    w = mx.random.normal((2 * inter, n_in), key=mx.random.key(7)) * n_in**-0.5
    q, s, b = mx.quantize(w.astype(mx.bfloat16), group_size=64, bits=4)
    plain = cuda.q4_pack(q, s, b)
    order = cuda.paired_rows(inter)
    paired = cuda.q4_pack(q[order], s[order], b[order])
    x = mx.random.normal((130, n_in), key=mx.random.key(8)).astype(mx.bfloat16)
    for m in (1, 5, 16, 17, 33, 64, 130):  # one launch up to 32 rows, matmul + swiglu over it
        want = cuda.swiglu(cuda.q4_matmul(x[:m], *plain))
        got = cuda.q4_matmul(x[:m], *paired, gate_up=True)
        assert got.shape == (m, inter)
        assert mx.array_equal(got, want).item(), m
        assert mx.array_equal(cuda.swiglu(cuda.q4_matmul(x[:m], *paired), paired=True),
                              want).item(), m


def test_q4_matmul_residual_gives_the_adds_bits() -> None:
    packed, _ = _q4(512, 1024, 9)
    x = mx.random.normal((130, 1024), key=mx.random.key(10)).astype(mx.bfloat16)
    res = mx.random.normal((130, 512), key=mx.random.key(11)).astype(mx.bfloat16)
    for m in (1, 5, 16, 17, 33, 64, 130):  # every launch shape's epilogue
        want = cuda.q4_matmul(x[:m], *packed) + res[:m]
        got = cuda.q4_matmul(x[:m], *packed, residual=res[:m])
        assert mx.array_equal(got, want).item(), m


@pytest.mark.parametrize("k", [4096, 1024, 256])  # 8, 8 and 2 warps over K
def test_rms_rows_matches_mlx_and_does_not_depend_on_row_count(k: int) -> None:
    x = (mx.random.normal((70, k), key=mx.random.key(20)) * 3).astype(mx.bfloat16)
    w = (1 + 0.1 * mx.random.normal((k,), key=mx.random.key(21))).astype(mx.bfloat16)
    full = cuda.rms_rows(x, w, 1e-5)
    want = mx.fast.rms_norm(x, w, 1e-5).astype(mx.float32)
    np.testing.assert_allclose(np.asarray(full.astype(mx.float32)), np.asarray(want),
                               rtol=2e-2, atol=2e-2)
    for m in (1, 2, 5, 33):
        assert mx.array_equal(cuda.rms_rows(x[:m], w, 1e-5), full[:m]).item(), m
        assert mx.array_equal(cuda.rms_rows(x[m : m + 1], w, 1e-5)[0], full[m]).item(), m


@pytest.mark.parametrize(("n_out", "k"), [(512, 4096), (256, 1024), (48, 256)])
def test_q4_matmul_norm_gives_rms_rows_bits(n_out: int, k: int) -> None:
    packed, _ = _q4(n_out, k, 22)
    w = mx.random.normal((2 * n_out, k), key=mx.random.key(23)) * k**-0.5
    q, s, b = mx.quantize(w.astype(mx.bfloat16), group_size=64, bits=4)
    order = cuda.paired_rows(n_out)
    gate_up = cuda.q4_pack(q[order], s[order], b[order])
    x = (mx.random.normal((70, k), key=mx.random.key(24)) * 3).astype(mx.bfloat16)
    res = mx.random.normal((70, n_out), key=mx.random.key(25)).astype(mx.bfloat16)
    nw = (1 + 0.1 * mx.random.normal((k,), key=mx.random.key(26))).astype(mx.bfloat16)
    norm = (nw, 1e-5)
    for m in (1, 2, 3, 4, 5, 17, 70):  # in the launch up to launch.NORM_ROWS, then rms_rows
        xn = cuda.rms_rows(x[:m], *norm)
        cases = [(cuda.q4_matmul(x[:m], *packed, norm=norm), cuda.q4_matmul(xn, *packed)),
                 (cuda.q4_matmul(x[:m], *packed, residual=res[:m], norm=norm),
                  cuda.q4_matmul(xn, *packed, residual=res[:m])),
                 (cuda.q4_matmul(x[:m], *gate_up, gate_up=True, norm=norm),
                  cuda.q4_matmul(xn, *gate_up, gate_up=True))]
        for i, (got, want) in enumerate(cases):
            assert mx.array_equal(got, want).item(), (m, i)


@pytest.mark.parametrize(("group", "head_dim", "window", "splits"),
                         [(4, 128, None, 1), (3, 64, 100, 1), (8, 128, None, 2),
                          (1, 64, 700, 2), (16, 128, None, 1)])
def test_paged_attention_tiles_keep_the_bits(group: int, head_dim: int, window: int | None,
                                             splits: int) -> None:
    """A step's rows in tiles (launch.attention_tiles: prompt chunks in tiles of
    ATTENTION_TILE, decode rows, padding) give the bits of the same rows a tile each, and
    of each row alone: which rows share a block's staged K/V never changes a bit."""
    hkv, d = 2, head_dim
    cap = SPLIT1 + 2 * BLOCK if splits > 1 else SPLIT1
    _, _, kpool, vpool, tables = _paged_kv(3, hkv, cap, d, 30, 40)
    assert launch.attention_splits(tables.shape[1]) == splits
    q = mx.random.normal((cap, hkv * group, d), key=mx.random.key(50)).astype(mx.bfloat16)
    # segments (slot, first position, length): a prompt chunk that starts mid-block and
    # spans a block edge, a decode row, a chunk shorter than a tile, a long chunk at the end
    segs = [(0, 100, 45), (1, 200, 1), (2, 0, 7), (1, cap - 70, 70)]
    positions = [p for _, start, n in segs for p in range(start, start + n)]
    slots = [s for s, _, n in segs for _ in range(n)]
    rows, padded = len(positions), len(positions) + 3  # three padding rows
    firsts = np.cumsum([0] + [n for _, _, n in segs[:-1]])
    tiles = launch.attention_tiles([(int(f), n) for f, (_, _, n) in zip(firsts, segs,
                                                                        strict=True)],
                                   rows, padded)
    assert len(tiles) < rows  # some tiles hold several rows
    pos = mx.array([*positions, 0, 0, 0], dtype=mx.int32)
    slot = mx.array([*slots, -1, -1, -1], dtype=mx.int32)
    qr = q[pos]
    scale = d**-0.5
    tiled = cuda.paged_attention(qr, kpool, vpool, tables, slot, pos, scale, window,
                                 tiles=mx.array(tiles, dtype=mx.int32))
    one_each = cuda.paged_attention(qr, kpool, vpool, tables, slot, pos, scale, window)
    assert mx.array_equal(tiled, one_each).item()
    assert not mx.any(tiled[rows:]).item()  # padding rows: zeros
    for i in (0, 44, 45, 46, 52, rows - 1):
        alone = cuda.paged_attention(qr[i : i + 1], kpool, vpool, tables, slot[i : i + 1],
                                     pos[i : i + 1], scale, window)
        assert mx.array_equal(alone[0], tiled[i]).item(), i


@pytest.mark.parametrize(("heads", "kv_heads", "d", "blocks"),
                         [(8, 2, 128, FIRST_SPLIT), (9, 3, 64, FIRST_SPLIT),
                          (8, 2, 128, launch.split_first_block(2) + 1),
                          (4, 1, 64, FIRST_SPLIT + 1),
                          (8, 2, 128, launch.split_first_block(launch.HEAD_SPLITS + 1) + 1)])
def test_rope_attention_gives_rope_write_and_attentions_bits(heads: int, kv_heads: int,
                                                             d: int, blocks: int) -> None:
    """A decode step's one launch (rope_attention: the rotation and the K/V write in the
    attention launch, split or not) gives the bits and the pool writes of rope_write +
    paged_attention. Past one split the rows' new positions sit in their first, second
    and last split (the last past the short head splits in the widest case), so each
    split's block either owns the new K/V or never reads it."""
    cap = blocks * BLOCK
    _, _, kflat, vflat, tables = _paged_kv(3, kv_heads, cap, d, 60, 70)
    rope = Rope(d, 10000.0, None, mx.bfloat16)
    rope.reserve(cap)
    # a decode step: one row per slot (at a block's first position, mid-block, the last
    # position), then a padding row; each row's K/V goes to its slot's row at its position
    positions = ([128, 200, cap - 1, 0] if blocks <= FIRST_SPLIT
                 else [SPLIT1 - 1, min(SPLIT1 + 130, cap - 2), cap - 1, 0])
    slots = [0, 1, 2, -1]
    writes = np.array([[int(tables[s, p // BLOCK, h]) * BLOCK + p % BLOCK
                        for h in range(kv_heads)]
                       for s, p in zip(slots[:3], positions[:3], strict=True)], dtype=np.int32)
    qkv = mx.random.normal((4, (heads + 2 * kv_heads) * d), key=mx.random.key(80))
    qkv = qkv.astype(mx.bfloat16)
    # the same rows as prefill rows (rope_write + paged_attention, two launches) and as the
    # decode step they are (one launch)
    assert not launch.rope_in_attention(False)
    assert launch.rope_in_attention(True)
    outs, pools = [], []
    for one_row_per_slot in (False, True):
        kpool, vpool = mx.array(kflat), mx.array(vflat)
        mx.eval(kpool, vpool)  # own copies: the kernels write them in place
        out = cuda.rope_attention(qkv, rope.cos, rope.sin, mx.array(writes), kpool, vpool,
                                  tables, mx.array(slots, dtype=mx.int32),
                                  mx.array(positions, dtype=mx.int32), d**-0.5, heads,
                                  kv_heads, d, one_row_per_slot=one_row_per_slot)
        mx.eval(out)
        outs.append(out)
        pools.append((kpool, vpool))
    assert mx.array_equal(outs[0], outs[1]).item()
    assert mx.array_equal(pools[0][0], pools[1][0]).item()
    assert mx.array_equal(pools[0][1], pools[1][1]).item()
    # the new K/V did go in: the pool rows written differ from the keys they replaced
    rows = mx.array(writes.reshape(-1))
    assert not mx.array_equal(pools[1][0][rows], kflat[rows]).item()


@pytest.mark.parametrize(("group", "head_dim", "window"), [(4, 128, None), (3, 64, 700)])
def test_long_rows_are_split_and_keep_their_bits(group: int, head_dim: int,
                                                 window: int | None) -> None:
    """Rows whose keys span more than one split (launch.split_of_block) run a block
    per split, combined in order: right against the reference, the same bits alone or in a
    launch with other rows, and rows that fit one split keep the whole kernel's bits."""
    hkv, d = 2, head_dim
    cap = launch.split_first_block(3) * BLOCK  # three splits
    keys, values, kpool, vpool, tables = _paged_kv(2, hkv, cap, d, 100, 110)
    assert launch.attention_splits(tables.shape[1]) == 3
    q = mx.random.normal((cap, hkv * group, d), key=mx.random.key(120)).astype(mx.bfloat16)
    positions = [5, 127, SPLIT1 - 124, SPLIT1 - 1, SPLIT1, SPLIT2 - 36, SPLIT2 - 1, SPLIT2,
                 cap - 2, cap - 1]
    slots = [1, 0, 1, 0, 1, 1, 0, 1, 0, 1]
    rows = mx.array(positions, dtype=mx.int32)
    scale = d**-0.5
    together = cuda.paged_attention(q[rows], kpool, vpool, tables,
                                    mx.array(slots, dtype=mx.int32), rows, scale, window)
    for i, (p, s) in enumerate(zip(positions, slots, strict=True)):
        one = mx.array([p], dtype=mx.int32)
        alone = cuda.paged_attention(q[one], kpool, vpool, tables, mx.array([s], dtype=mx.int32),
                                     one, scale, window)
        assert mx.array_equal(alone[0], together[i]).item(), p
        want = reference_attention(q[p : p + 1], keys[s], values[s], p, scale, window)
        err = mx.abs(together[i].astype(mx.float32) - want[0]).max().item()
        assert err < 3e-2, (p, err)
        if p < SPLIT1:  # fits one split: the whole kernel's bits
            whole = cuda.paged_attention(q[one], kpool, vpool, tables[:, :FIRST_SPLIT],
                                         mx.array([s], dtype=mx.int32), one, scale, window)
            assert mx.array_equal(whole[0], together[i]).item(), p


@pytest.mark.parametrize(("group", "head_dim", "window", "sinks"),
                         [(4, 128, None, False), (3, 64, 700, False), (1, 64, None, True),
                          (8, 128, 300, True)])
def test_merged_splits_give_the_split_launchs_bits(group: int, head_dim: int,
                                                   window: int | None, sinks: bool) -> None:
    """paged_attention's merge (each tile's block walks all its rows' keys and folds the
    splits as it leaves them) against the split launch and its combine: the same bits for
    prompt chunks in tiles that start mid-split, cross split edges and end past three
    splits, beside a decode row and padding; with windows (early splits without a row's
    keys) and sinks."""
    from slotserve.kernels.attention import LOG2E

    hkv, d = 2, head_dim
    cap = launch.split_first_block(3) * BLOCK + 2 * BLOCK
    keys, values, kpool, vpool, tables = _paged_kv(3, hkv, cap, d, 400, 410)
    assert launch.attention_splits(tables.shape[1]) == 4
    q = mx.random.normal((cap, hkv * group, d), key=mx.random.key(420)).astype(mx.bfloat16)
    segs = [(0, SPLIT1 - 20, 60), (1, SPLIT2 + 5, 1), (2, 0, 40), (0, cap - 33, 33)]
    positions = [p for _, start, n in segs for p in range(start, start + n)]
    slots = [s for s, _, n in segs for _ in range(n)]
    rows = len(positions)
    firsts = np.cumsum([0] + [n for _, _, n in segs[:-1]])
    tiles = mx.array(launch.attention_tiles(
        [(int(f), n) for f, (_, _, n) in zip(firsts, segs, strict=True)], rows, rows + 2),
        dtype=mx.int32)
    pos = mx.array([*positions, 0, 0], dtype=mx.int32)
    slot = mx.array([*slots, -1, -1], dtype=mx.int32)
    sink = mx.random.normal((hkv * group,), key=mx.random.key(430)) * 2.0 if sinks else None
    sink_in = sink * LOG2E if sink is not None else None
    scale = d**-0.5
    split_launch = cuda.paged_attention(q[pos], kpool, vpool, tables, slot, pos, scale, window,
                                        sink_in, tiles=tiles)
    merged = cuda.paged_attention(q[pos], kpool, vpool, tables, slot, pos, scale, window,
                                  sink_in, tiles=tiles, merge=True)
    assert mx.array_equal(merged, split_launch).item()
    assert not mx.any(merged[rows:]).item()  # padding rows: zeros
    for i in (0, 19, 20, 59, 60, 61, rows - 1):
        p, s = positions[i], slots[i]
        want = reference_attention(q[p : p + 1], keys[s], values[s], p, scale, window, sink)
        err = mx.abs(merged[i].astype(mx.float32) - want[0]).max().item()
        assert err < 3e-2, (p, err)


@pytest.mark.parametrize("context", [4096, 16384, 32768])
def test_long_context_prefill_rows_give_decode_rows_bits(context: int) -> None:
    """Issue 18's long contexts at the kernel level (Llama-3's GQA 4, head dim 128): the
    last rows of a prompt prefilled in ATTENTION_TILE tiles (a chunk that starts mid-block)
    give each row the bits it gets alone, as a decode row, and beside
    another slot's shorter rows; in its splits (short ones at the head, launch.split_of_block),
    folded in order, in a block a split or inside one block a tile (merge)."""
    hkv, group, d = 2, 4, 128
    keys, values, kpool, vpool, tables = _paged_kv(2, hkv, context, d, 300, 310)
    head = launch.HEAD_SPLITS * launch.split_first_block(1) * BLOCK  # keys in short splits
    assert launch.attention_splits(tables.shape[1]) == (
        launch.HEAD_SPLITS + (context - head) // (launch.SPLIT_BLOCKS * BLOCK))
    q = mx.random.normal((context, hkv * group, d), key=mx.random.key(320)).astype(mx.bfloat16)
    first, n = context - 45, 45  # the chunk: positions context - 45 .. context - 1
    positions = [*range(first, first + n), 700, 3000]  # then two rows of the other slot
    slots = [0] * n + [1, 1]
    tiles = launch.attention_tiles([(0, n), (n, 1), (n + 1, 1)], len(positions),
                                   len(positions))
    pos = mx.array(positions, dtype=mx.int32)
    slot = mx.array(slots, dtype=mx.int32)
    scale = d**-0.5
    prefill = cuda.paged_attention(q[pos], kpool, vpool, tables, slot, pos, scale,
                                   tiles=mx.array(tiles, dtype=mx.int32))
    folded = cuda.paged_attention(q[pos], kpool, vpool, tables, slot, pos, scale,
                                  tiles=mx.array(tiles, dtype=mx.int32), merge=True)
    assert mx.array_equal(folded, prefill).item()  # splits folded in the block: same bits
    for i in (0, 1, 15, 16, n - 2, n - 1, n, n + 1):
        one = pos[i : i + 1]
        decode = cuda.paged_attention(q[one], kpool, vpool, tables, slot[i : i + 1], one, scale)
        assert mx.array_equal(decode[0], prefill[i]).item(), positions[i]
    for i in (0, n - 1, n + 1):
        p, s = positions[i], slots[i]
        want = reference_attention(q[p : p + 1], keys[s], values[s], p, scale, None)
        err = mx.abs(prefill[i].astype(mx.float32) - want[0]).max().item()
        assert err < 3e-2, (p, err)


@pytest.mark.parametrize(("group", "head_dim", "window"), [(4, 64, None), (2, 128, 300)])
def test_attention_sinks_match_reference_and_keep_split_bits(group: int, head_dim: int,
                                                              window: int | None) -> None:
    """gpt-oss's sinks (one more softmax logit per query head, weighting no value; the
    kernel takes them in log2 units) in the whole and the split kernels: right against
    reference_attention with the same sinks, different from no sinks, and a row that fits
    one split gets the whole kernel's bits."""
    from slotserve.kernels.attention import LOG2E

    hkv, d = 2, head_dim
    cap = SPLIT1 + 2 * BLOCK  # two splits
    keys, values, kpool, vpool, tables = _paged_kv(1, hkv, cap, d, 200, 210)
    assert launch.attention_splits(tables.shape[1]) == 2
    hq = hkv * group
    sinks = mx.random.normal((hq,), key=mx.random.key(230)) * 2.0
    q = mx.random.normal((cap, hq, d), key=mx.random.key(240)).astype(mx.bfloat16)
    positions = [0, 5, SPLIT1 - 56, SPLIT1 - 1, SPLIT1, SPLIT1 + 76, cap - 1]
    rows = mx.array(positions, dtype=mx.int32)
    slot = mx.zeros((len(positions),), mx.int32)
    scale = d**-0.5
    got = cuda.paged_attention(q[rows], kpool, vpool, tables, slot, rows, scale, window,
                               sinks * LOG2E)
    plain = cuda.paged_attention(q[rows], kpool, vpool, tables, slot, rows, scale, window)
    assert not mx.array_equal(got, plain).item()
    for i, p in enumerate(positions):
        want = reference_attention(q[p : p + 1], keys[0], values[0], p, scale, window, sinks)
        err = mx.abs(got[i].astype(mx.float32) - want[0]).max().item()
        assert err < 3e-2, (p, err)
        if p < SPLIT1:  # fits one split: the whole kernel's bits
            one = mx.array([p], dtype=mx.int32)
            whole = cuda.paged_attention(q[one], kpool, vpool, tables[:, :FIRST_SPLIT],
                                         slot[:1], one, scale, window, sinks * LOG2E)
            assert mx.array_equal(whole[0], got[i]).item(), p


def test_rope_attention_with_sinks_gives_the_two_launches_bits() -> None:
    """The decode step's one launch (rope_attention) with sinks gives the bits of
    rope_write + paged_attention with the same sinks."""
    from slotserve.kernels.attention import LOG2E

    heads, kv_heads, d, cap = 8, 2, 64, 3 * BLOCK
    _, _, kflat, vflat, tables = _paged_kv(3, kv_heads, cap, d, 260, 270)
    rope = Rope(d, 10000.0, None, mx.bfloat16)
    rope.reserve(cap)
    positions, slots = [128, 200, cap - 1, 0], [0, 1, 2, -1]
    writes = np.array([[int(tables[s, p // BLOCK, h]) * BLOCK + p % BLOCK
                        for h in range(kv_heads)]
                       for s, p in zip(slots[:3], positions[:3], strict=True)], dtype=np.int32)
    qkv = mx.random.normal((4, (heads + 2 * kv_heads) * d), key=mx.random.key(280))
    qkv = qkv.astype(mx.bfloat16)
    sinks = mx.random.normal((heads,), key=mx.random.key(290)) * 2.0 * LOG2E
    outs = []
    for one_row_per_slot in (False, True):
        kpool, vpool = mx.array(kflat), mx.array(vflat)
        mx.eval(kpool, vpool)  # own copies: the kernels write them in place
        out = cuda.rope_attention(qkv, rope.cos, rope.sin, mx.array(writes), kpool, vpool,
                                  tables, mx.array(slots, dtype=mx.int32),
                                  mx.array(positions, dtype=mx.int32), d**-0.5, heads,
                                  kv_heads, d, one_row_per_slot=one_row_per_slot, sinks=sinks)
        mx.eval(out)
        outs.append(out)
    assert mx.array_equal(outs[0], outs[1]).item()



def _reference_draw(z: np.ndarray, scale: float, top_k: int, top_p: float, min_p: float,
                    u: float) -> int:
    """sample_draw.cu's rules in exact arithmetic, for rows whose e = 2^((z - max) * scale)
    are powers of two (integer z, scale 1 or 2), which exp2 gives exactly."""
    vocab = z.shape[0]
    e = np.exp2((z.astype(np.float64) - z.max()) * scale)
    q = np.floor(e * 2.0**40).astype(np.int64)
    thr, keep_ties = 0.0, vocab
    if top_k < vocab or top_p < 1.0:
        order = np.lexsort((np.arange(vocab), -e))  # descending e, ties to the lower id
        kk = min(top_k, vocab)
        c = kk
        if top_p < 1.0:
            p = math.ceil(float(np.float32(top_p)) * float(int(q[order[:kk]].sum())))
            c = min(kk, int(np.argmax(np.cumsum(q[order]) >= p)) + 1)
        thr = e[order[c - 1]]
        keep_ties = c - int((e > thr).sum())
    keep = (e >= float(np.float32(min_p))) & (e >= thr)
    ties = np.nonzero(keep & (e == thr))[0] if thr > 0 else np.zeros(0, np.int64)
    keep[ties[keep_ties:]] = False
    kept = np.where(keep, q, 0)
    target = math.floor(u * float(int(kept.sum())))
    return int(np.argmax(np.cumsum(kept) > target))


def test_sample_draw_matches_the_exact_reference() -> None:
    """Every knob mix on tie-heavy rows of the 8B's vocabulary (integer logits: a few
    distinct values, so thresholds fall inside runs of ties), against exact arithmetic."""
    rng = np.random.default_rng(7)
    vocab, n = 128256, 48
    spans = rng.choice([4, 13, 45], size=n)  # 45: some e below 2^-40 (no mass)
    z = np.stack([rng.integers(-int(s), 1, vocab) for s in spans]).astype(np.float32)
    knobs = [(float(rng.choice([_LOG2E, _LOG2E / 2])), int(rng.choice([2, 40, 5000, 0, 0])),
              float(rng.choice([1.0, 0.1, 0.5, 0.9, 0.99])),
              float(rng.choice([0.0, 0.0, 0.01, 0.3]))) for _ in range(n)]
    params = [SamplingParams(temperature=t, top_k=k, top_p=p, min_p=mp, seed=100 + i)
              for i, (t, k, p, mp) in enumerate(knobs)]
    positions = rng.integers(0, 10_000, n).tolist()
    got = sample_rows(mx.array(z), params, [RowState(p) for p in params], positions,
                      on_device=True).tokens
    want = [_reference_draw(z[i], round(_LOG2E / p.temperature), p.top_k or vocab, p.top_p,
                            p.min_p, uniform_for(p.seed, positions[i]))
            for i, p in enumerate(params)]
    assert got == want, [(i, params[i]) for i in range(n) if got[i] != want[i]]


def test_sample_draw_agrees_with_the_host_sampler_on_peaked_rows() -> None:
    """Real-valued logits where one token or a few dominate: float rounding decides nothing
    there, so the kernel and the host path (runtime.sampling, float sums) draw alike."""
    rng = np.random.default_rng(8)
    vocab, n = 128256, 32
    z = rng.standard_normal((n, vocab)).astype(np.float32)
    for i in range(n):  # the rest of the row: ~1e-4 of the mass at temperature 1.2
        z[i, rng.choice(vocab, 6, replace=False)] += rng.uniform(25, 30, 6)
    params = [SamplingParams(temperature=float(rng.uniform(0.5, 1.2)),
                             top_k=int(rng.choice([0, 3, 40])),
                             top_p=float(rng.choice([1.0, 0.8, 0.95])),
                             min_p=float(rng.choice([0.0, 0.05])), seed=200 + i)
              for i in range(n)]
    states = [RowState(p) for p in params]
    for pos in range(4):
        host = sample_rows(mx.array(z), params, states, [pos] * n).tokens
        dev = sample_rows(mx.array(z), params, states, [pos] * n, on_device=True).tokens
        assert dev == host, pos


def test_partials_past_the_cap_fold_in_the_block(monkeypatch: pytest.MonkeyPatch) -> None:
    """launch.split_partials_fit: with the cap at 0 every split launch folds in the block
    instead (a decode step's rope in rope_write's launch): the same bits, the same K/V."""
    heads, kv_heads, d = 8, 2, 64
    cap = launch.split_first_block(2) * BLOCK + BLOCK  # three splits
    _, _, kflat, vflat, tables = _paged_kv(2, kv_heads, cap, d, 500, 510)
    rope = Rope(d, 10000.0, None, mx.bfloat16)
    rope.reserve(cap)
    positions, slots = [cap - 1, SPLIT1 + 3], [0, 1]
    writes = np.array([[int(tables[s, p // BLOCK, h]) * BLOCK + p % BLOCK
                        for h in range(kv_heads)]
                       for s, p in zip(slots, positions, strict=True)], dtype=np.int32)
    qkv = mx.random.normal((2, (heads + 2 * kv_heads) * d), key=mx.random.key(520))
    qkv = qkv.astype(mx.bfloat16)
    got = []
    for partials_cap in (launch.PARTIALS_CAP, 0):
        monkeypatch.setattr(launch, "PARTIALS_CAP", partials_cap)
        assert launch.split_partials_fit(2, kv_heads, 3, heads // kv_heads, d) == (
            partials_cap > 0)
        kpool, vpool = mx.array(kflat), mx.array(vflat)
        mx.eval(kpool, vpool)
        out = cuda.rope_attention(qkv, rope.cos, rope.sin, mx.array(writes), kpool, vpool,
                                  tables, mx.array(slots, dtype=mx.int32),
                                  mx.array(positions, dtype=mx.int32), d**-0.5, heads,
                                  kv_heads, d, one_row_per_slot=True)
        mx.eval(out)
        got.append((out, kpool, vpool))
    for a, b in zip(got[0], got[1], strict=True):
        assert mx.array_equal(a, b).item()
