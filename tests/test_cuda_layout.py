"""What of slotserve's CUDA kernels can be checked on any machine: the 4-bit kernel's weight
layout (slotserve.kernels.cuda.q4_pack: a NumPy model of which codes and scales each kernel
thread reads must give back MLX's own quantized matrix), the kernel sources as MLX gets
them, and the launch-shape rules. The kernels themselves run only on a GPU
(tests/test_cuda_kernels.py)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from slotserve.kernels import cuda
from slotserve.kernels.attention import BLOCK
from slotserve.kernels.cuda import launch, sources
from slotserve.model.layers import device_inputs


def _codes(q: np.ndarray, k: int) -> np.ndarray:
    """MLX 4-bit words [N, K/8] -> codes [N, K] (code j of a word in bits 4j..4j+3)."""
    shifts = np.arange(8, dtype=np.uint32) * 4
    return ((q[:, :, None] >> shifts) & 0xF).reshape(q.shape[0], k)


def _bf16(words: np.ndarray) -> np.ndarray:
    return (words.astype(np.uint32) << 16).view(np.float32)


def _as_kernel_reads(wp: np.ndarray, sp: np.ndarray, n: int, k: int
                     ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Codes [N, K], scales and biases [N, K/64] as the kernel's threads see them."""
    codes = np.full((n, k), -1, np.int64)
    scales = np.full((n, k // 64), np.nan, np.float32)
    biases = np.full((n, k // 64), np.nan, np.float32)
    for tile in range(n // 8):
        for c in range(k // 128):
            for lane in range(32):
                g, t = lane // 4, lane % 4
                col = 8 * tile + g
                for par in range(2):  # the chunk's two 64-wide groups
                    group = 2 * c + par
                    words = (int(wp[tile, c, lane, 2 * par]), int(wp[tile, c, lane, 2 * par + 1]))
                    for s in range(4):  # dequant8: mma step s, k-slots (2t, 2t+1), (2t+8, 2t+9)
                        word = words[s // 2]
                        for half in range(2):  # q4_pair(word, j): bits 4j and 4j + 16
                            v = word >> (4 * (2 * (s & 1) + half))
                            kk = 64 * group + 16 * t + 4 * s + 2 * half
                            codes[col, kk] = v & 0xF
                            codes[col, kk + 1] = (v >> 16) & 0xF
                    # col_scale(scales, g, par): the pair of the lane's own column g (its B
                    # fragment's), word 2 par + g % 2 of the scale lane g // 2
                    sb = np.uint32(sp[tile, c, g // 2, 2 * par + g % 2])
                    for seen, got in ((scales, sb & 0xFFFF), (biases, sb >> 16)):
                        v = _bf16(np.array([got]))[0]
                        # every lane of a column reads the same pair
                        assert np.isnan(seen[col, group]) or seen[col, group] == v, (col, group)
                        seen[col, group] = v
    return codes, scales, biases


@pytest.mark.parametrize(("n", "k"), [(16, 128), (24, 256), (48, 384)])
def test_q4_pack_puts_every_code_and_scale_where_the_kernel_reads_it(n: int, k: int) -> None:
    w = mx.random.normal((n, k), key=mx.random.key(n + k)).astype(mx.bfloat16)
    q, s, b = mx.quantize(w, group_size=64, bits=4)
    wp, sp = cuda.q4_pack(q, s, b)
    assert wp.shape == (n // 8, k // 128, 32, 4) and sp.shape == (n // 8, k // 128, 4, 4)
    codes, scales, biases = _as_kernel_reads(np.array(wp), np.array(sp), n, k)
    np.testing.assert_array_equal(codes, _codes(np.array(q), k))
    np.testing.assert_array_equal(scales, np.array(s.astype(mx.float32)))
    np.testing.assert_array_equal(biases, np.array(b.astype(mx.float32)))


@pytest.mark.parametrize("name", sorted(sources.KERNELS))
def test_kernel_sources_are_read_and_compacted_once(name: str) -> None:
    body, header = sources.source(name)
    assert sources.source(name)[0] is body  # cached: MLX hashes this text at every launch
    for text in (body, header):
        assert text.strip(), name
        assert "//" not in text and "@" not in text, name  # no comments, no placeholders
        assert all(line == line.strip() and line for line in text.splitlines()), name
    assert "#include <cuda_bf16.h>" in header


def test_the_attention_kernels_differ_only_in_their_query_and_patch() -> None:
    plain, _ = sources.source("paged_attention")
    rope, _ = sources.source("rope_attention")
    assert "reinterpret_cast<const uint32_t*>(q + " in plain  # q read into qs
    assert "rope_rotate(" in rope and "rope_rotate(" not in plain
    assert "newk" in rope and "newk" not in plain and "newv" in rope


def test_attention_tiles_cut_each_segment_and_the_padding() -> None:
    """launch.attention_tiles: each segment from its first row in ATTENTION_TILE pieces (a
    decode row alone), then the padding rows likewise; ascending, so a tile's rows end where
    the next tile's begin (paged_attention.cu reads them so)."""
    t = launch.ATTENTION_TILE
    segments = [(0, 2 * t + 3), (2 * t + 3, 1), (2 * t + 4, t)]
    rows = 3 * t + 4
    tiles = launch.attention_tiles(segments, rows, rows + t + 1)
    assert tiles == [0, t, 2 * t, 2 * t + 3, 2 * t + 4, rows, rows + t]
    assert launch.attention_tiles([(0, 1), (1, 1)], 2, 2) == [0, 1]


def test_attention_merge_takes_prefill_steps_whose_longest_walk_is_not_the_step() -> None:
    """launch.attention_merge (splits folded in one block a tile) for a 1,024-row chunk at a
    16k context (Llama-3's 8 kv heads); not for rows within one split, a short chunk at a
    long context, or a decode row at 32k beside a short prompt: there one block's walk over
    all its keys would be the step."""
    b, t = BLOCK, launch.ATTENTION_TILE
    chunk = [(15 * 1024 + t * (i + 1) - 1) // b + 1 for i in range(1024 // t)]
    assert launch.attention_merge(chunk, 8)
    assert not launch.attention_merge([launch.split_first_block(1)] * 500, 8)  # one split each
    assert not launch.attention_merge(chunk[:8], 8)  # 128 rows
    short = [(t * (i + 1) - 1) // b + 1 for i in range(64)]  # a 1,024-token prompt
    assert not launch.attention_merge([*short, 32 * 1024 // b], 8)
    assert not launch.attention_merge([], 8)


def test_split_partials_fit_the_cap() -> None:
    """A decode step of 128 rows beside one at 128k (256 splits of 512 keys), Llama-3's
    shape: 545 MB of partials, past the cap; the same rows at 16k fit."""
    assert not launch.split_partials_fit(128, 8, 128 * 1024 // 512, 4, 128)
    assert launch.split_partials_fit(128, 8, 16 * 1024 // 512, 4, 128)


def test_a_steps_tiles_walk_to_their_last_rows_key_block() -> None:
    """launch.tile_walks: each tile of launch.attention_tiles' cut, up to its last row."""
    t = launch.ATTENTION_TILE
    segs = [(BLOCK - 2, t + 3), (5 * BLOCK - 1, 1), (0, t)]  # (first position, length)
    positions = [p for start, n in segs for p in range(start, start + n)]
    firsts = np.cumsum([0] + [n for _, n in segs[:-1]])
    rows = len(positions)
    tiles = launch.attention_tiles([(int(f), n) for f, (_, n) in zip(firsts, segs, strict=True)],
                                   rows, rows + 3)
    assert launch.tile_walks(tiles, [*positions, 0, 0, 0], rows) == [2, 2, 5, 1]


@pytest.mark.parametrize("n", [48, 256, 1024, 4096, 6144, 14336, 16384, 28672, 65536, 128256])
def test_q4_launch_shapes_cover_every_row_count(n: int) -> None:
    for m in range(1, 300):
        for norm in (False, True):
            for gate_up in (False, True):
                shape = launch.q4_shape(m, n, norm=norm, gate_up=gate_up)
                assert n % (8 * shape.nt) == 0 and shape.nt >= 2, (m, n, shape)
                assert shape.mt in (1, 2) and shape.stages >= 2, (m, n, shape)
                assert shape.norm == (norm and shape.mt == 1 and m <= launch.NORM_ROWS)
                assert shape.swiglu == gate_up  # every launch's epilogue, whole pairs
                assert not shape.swiglu or shape.nt % 2 == 0, (m, n, shape)


def test_q4_gemm_takes_wide_prefill_launches_that_fit_an_sm() -> None:
    """q4_gemm runs launches of launch.GEMM_ROWS rows or more that fill GEMM_BLOCKS of its
    128 x 128 blocks, whole 128-column blocks only; its shared memory fits an H100/H200 SM
    (227 KiB a block)."""
    assert not launch.q4_gemm(launch.GEMM_ROWS - 1, 28672)
    assert launch.q4_gemm(launch.GEMM_ROWS, 28672)
    assert not launch.q4_gemm(4096, 28672 + 16)  # not a multiple of 128
    assert not launch.q4_gemm(launch.GEMM_ROWS, 128)  # too few blocks
    assert launch.q4_gemm(128 * launch.GEMM_BLOCKS, 128)
    assert launch.q4_gemm_shared_bytes() <= 227 * 1024


def test_k_split_depends_on_k_alone() -> None:
    assert [launch.k_split(k // 128) for k in (128, 256, 384, 512, 640, 1024, 4096, 14336)] == [
        1, 2, 1, 4, 1, 8, 8, 8]
    assert launch.rms_threads(4096) == 32 * launch.k_split(32)


@pytest.mark.parametrize("group", [1, 2, 4, 8, 16])
def test_a_decode_rows_block_is_narrow(group: int) -> None:
    """A decode row (a tile of one) fits one warp's 16 mma rows for GQA groups up to 16; a
    prefill tile of 16 rows does only where the group is 1 (paged_attention.cu's NARROW)."""
    assert launch.attention_narrow(group, 1)
    assert launch.attention_narrow(group, launch.ATTENTION_TILE) == (group == 1)
    assert not launch.attention_narrow(32, 1)  # 32 heads a row: two warps' mma rows


def test_three_decode_blocks_fit_an_sm() -> None:
    """A head-dim-128 attention block's shared memory (its K and V blocks, the 16 staged
    query rows of a NARROW block beside them, and the 1 KB the SM reserves a block) lets
    three blocks share an H100 / H200 SM's 228 KB: a 16k-context decode row's 288 split
    blocks run in one wave on 132 SMs."""
    staged_queries = 16 * (128 + 8) * 2
    assert 3 * (launch.attention_shared_bytes(128) + staged_queries + 1024) <= 228 * 1024


def test_device_inputs_are_the_step_arrays_views_of_one_buffer() -> None:
    """Batch.build hands the GPU kernels a step's int32 arrays as slices of one array (one
    managed buffer faults in once): each slice has its part's shape and values, with parts
    of every rank and an empty one among them."""
    rng = np.random.default_rng(3)
    parts = [rng.integers(-5, 1 << 20, size=shape).astype(dtype)
             for shape, dtype in [((7,), np.int32), ((3, 8), np.int64), ((2, 5, 8), np.int32),
                                  ((0,), np.int32), ((1,), np.int32)]]
    got = device_inputs(parts)
    assert len(got) == len(parts)
    for a, p in zip(got, parts, strict=True):
        assert a.dtype == mx.int32 and a.shape == p.shape
        assert np.array_equal(np.array(a), p.astype(np.int32))


def test_attention_splits_are_short_at_the_head_then_split_blocks_long() -> None:
    """launch.split_of_block (attention_splits.cuh's KeySplits): the first HEAD_SPLITS splits
    take SPLIT_BLOCKS // 2 key blocks, the rest SPLIT_BLOCKS; split_first_block is its
    inverse, every block lies in exactly one split, and the splits of a launch follow."""
    half, n = launch.SPLIT_BLOCKS // 2, launch.HEAD_SPLITS
    assert [launch.split_of_block(b) for b in range(2 * half)] == [0] * half + [1] * half
    head = n * half
    assert launch.split_of_block(head - 1) == n - 1
    assert launch.split_of_block(head) == n
    assert launch.split_of_block(head + launch.SPLIT_BLOCKS) == n + 1
    for s in range(3 * n):
        first, end = launch.split_first_block(s), launch.split_first_block(s + 1)
        assert end - first == (half if s < n else launch.SPLIT_BLOCKS)
        assert {launch.split_of_block(b) for b in range(first, end)} == {s}
    assert launch.attention_splits(1) == 1
    assert launch.attention_splits(half) == 1
    assert launch.attention_splits(half + 1) == 2
    # a 1k-context decode row (8 key blocks) and a 16k one (128)
    assert launch.attention_splits(8) == 8 // half
    assert launch.attention_splits(128) == n + (128 - head) // launch.SPLIT_BLOCKS
