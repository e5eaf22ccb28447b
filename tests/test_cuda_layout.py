"""The 4-bit kernel's weight layout (slotserve.kernels.cuda.q4_pack), checked on any machine:
a NumPy model of which codes and scales each kernel thread reads must give back MLX's own
quantized matrix. The kernel itself runs only on a GPU (tests/test_cuda_kernels.py)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from slotserve.kernels import cuda


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
                    for j in range(2):  # sword(nt, 2 par + j): columns 2t + j of the tile
                        sb = np.uint32(sp[tile, c, t, 2 * par + j])
                        scol = 8 * tile + 2 * t + j
                        scales[scol, group] = _bf16(np.array([sb & 0xFFFF]))[0]
                        biases[scol, group] = _bf16(np.array([sb >> 16]))[0]
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
