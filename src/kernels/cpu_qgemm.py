"""Quantized CPU matmul: 4/8-bit weights stay quantized, activations go to int8 per 32.

The C kernel (native/qgemm.c) takes MLX affine-quantized weights (GGUF Q4_0/Q4_1/Q8_0
arrive as those) repacked once here into 16-row panels, quantizes each activation row
per block of 32 to int8 with one float scale, and does the block dot products in
integers (AVX-512 VNNI / AVX2 maddubs / NEON sdot). Per output it then runs one fixed
sequence of float operations over the blocks in order (spelled out at the top of
qgemm.c), so a row's result never depends on its batch or on the build's instruction
set. Weights cost ~0.625 bytes each (4-bit) instead of 2 for float16.

`QMatrix` has cpu_gemm.Matrix's interface (.n, .k, .host, __call__); `quantize_rows`
and `QMatrix.host_rows` let several matrices share one quantized input (q, k, v).
"""

from __future__ import annotations

import ctypes

import mlx.core as mx
import numpy as np

from slotserve.kernels.cpu_gemm import SlotMatrix, to_host
from slotserve.kernels.quantized import QuantizedWeight

BLOCK = 32  # activation quantization block, and the weight block inside a group
PANEL = 16  # weight rows interleaved per panel (one AVX-512 register of int32 lanes)
SUPPORTED_BITS = (4, 8)


def supported(q: QuantizedWeight) -> bool:
    """Whether QMatrix takes q: 4 or 8 bits, groups a multiple of 32, 2-D uint32 codes."""
    return (
        q.bits in SUPPORTED_BITS
        and q.group_size >= BLOCK
        and q.group_size % BLOCK == 0
        and q.weight.ndim == 2
        and q.weight.dtype == mx.uint32
        and q.weight.shape[1] * 32 // q.bits == q.scales.shape[-1] * q.group_size
    )


def _aligned_bytes(nbytes: int) -> tuple[np.ndarray, int]:
    """An uninitialized uint8 buffer starting on a 64-byte boundary (vector loads), and
    its address (asking numpy for it costs ~1 us each time)."""
    raw = np.empty(nbytes + 64, dtype=np.uint8)
    addr = raw.ctypes.data
    start = -addr % 64
    return raw[start : start + nbytes], addr + start


class QuantizedRows:
    """Activations quantized by slot_quantize_rows: rows [R, K] -> int8 codes q and, per
    block of 32, the scale d, the code sum xs and d * xs (see qgemm.c), in one aligned
    buffer; `ptrs` are the four arrays' addresses, the views are made on demand."""

    def __init__(self, rows: int, k: int) -> None:
        self.rows, self.k = rows, k
        nb = k // BLOCK
        self._qbytes = -(-rows * k // 64) * 64  # keeps the per-block arrays aligned too
        self._side = 4 * rows * nb
        self.buf, base = _aligned_bytes(self._qbytes + 3 * self._side)
        q, side = self._qbytes, self._side
        self.ptrs = (base, base + q, base + q + side, base + q + 2 * side)

    def _part(self, i: int, dtype: type[np.generic]) -> np.ndarray:
        start = self._qbytes + i * self._side
        return self.buf[start : start + self._side].view(dtype).reshape(self.rows, -1)

    @property
    def q(self) -> np.ndarray:
        """int8 [R, K]"""
        return self.buf[: self.rows * self.k].view(np.int8).reshape(self.rows, self.k)

    @property
    def d(self) -> np.ndarray:
        """float32 [R, K/32]"""
        return self._part(0, np.float32)

    @property
    def dxs(self) -> np.ndarray:
        """float32 [R, K/32]"""
        return self._part(1, np.float32)

    @property
    def xs(self) -> np.ndarray:
        """int32 [R, K/32]"""
        return self._part(2, np.int32)

    def dequantize(self) -> np.ndarray:
        """The activations the kernel actually multiplies, exactly, as float64."""
        d = np.repeat(self.d.astype(np.float64), BLOCK, axis=1)
        return d * self.q.astype(np.float64)


def quantize_rows(lib: ctypes.CDLL, xs: np.ndarray) -> QuantizedRows:
    """Quantize a C-contiguous float32 [R, K] host array (K a multiple of 32)."""
    if xs.dtype != np.float32 or xs.ndim != 2 or not xs.flags.c_contiguous:
        raise TypeError("quantize_rows needs a C-contiguous float32 [rows, K] array")
    rows, k = xs.shape
    if k % BLOCK:
        raise ValueError(f"K={k} is not a multiple of {BLOCK}")
    out = QuantizedRows(rows, k)
    rc = lib.slot_quantize_rows(xs.ctypes.data, rows, k, *out.ptrs)
    if rc != 0:
        raise RuntimeError(f"slot_quantize_rows failed (code {rc})")
    return out


def _codes(q: QuantizedWeight) -> np.ndarray:
    """The unsigned codes [N, K] as uint8 (MLX packs element i of a word at bits*i)."""
    mx.eval(q.weight)
    words = np.asarray(q.weight).astype(np.uint32)
    per = 32 // q.bits
    shifts = (np.arange(per, dtype=np.uint32) * q.bits)[None, None, :]
    codes = (words[:, :, None] >> shifts) & np.uint32((1 << q.bits) - 1)
    return codes.reshape(words.shape[0], -1).astype(np.uint8)


def _per_block(a: mx.array, group_size: int) -> np.ndarray:
    """Per-group float32 values [N, K/group] repeated to one per 32-block [N, K/32]."""
    mx.eval(a)
    host = np.asarray(a.astype(mx.float32))
    return np.repeat(host, group_size // BLOCK, axis=1)


def repack(q: QuantizedWeight) -> tuple[np.ndarray, bool]:
    """The kernel's panel layout (qgemm.c, top comment) as an aligned uint8 buffer, and
    whether its scales/biases are float16 (chosen only when that is exact)."""
    if not supported(q):
        raise ValueError(f"unsupported quantized weight: bits={q.bits}, "
                         f"group_size={q.group_size}, codes {q.weight.dtype} {q.weight.shape}")
    n, k = q.shape
    nb = k // BLOCK
    scales = _per_block(q.scales, q.group_size)
    biases = _per_block(q.biases, q.group_size)
    if q.bits == 8:  # signed codes so AVX2's maddubs cannot saturate; the bias absorbs the 128
        biases = (biases + np.float32(128) * scales).astype(np.float32)
    f16 = bool(
        np.array_equal(scales.astype(np.float16).astype(np.float32), scales)
        and np.array_equal(biases.astype(np.float16).astype(np.float32), biases)
    )
    sdtype = np.float16 if f16 else np.float32
    panels = -(-n // PANEL)
    block = (256 if q.bits == 4 else 512) + 2 * PANEL * np.dtype(sdtype).itemsize
    out, _ = _aligned_bytes(panels * nb * block)
    # a chunk of panels at a time: unpacking all codes at once (uint32 words, one per code)
    # would hold ~8 bytes per weight at load, 230 MB more peak RSS for SmolLM2's lm_head
    for p0 in range(0, panels, _REPACK_PANELS):
        p1 = min(panels, p0 + _REPACK_PANELS)
        r0, r1 = p0 * PANEL, min(n, p1 * PANEL)
        chunk = _pack_panels(_codes(QuantizedWeight(q.weight[r0:r1], q.scales[r0:r1],
                                                    q.biases[r0:r1], q.group_size, q.bits)),
                             scales[r0:r1], biases[r0:r1], q.bits, sdtype)
        out[p0 * nb * block : p1 * nb * block] = chunk.reshape(-1)
    return out, f16


_REPACK_PANELS = 256  # 4,096 weight rows


def _pack_panels(codes: np.ndarray, scales: np.ndarray, biases: np.ndarray, bits: int,
                 sdtype: type[np.generic]) -> np.ndarray:
    """Whole panels of rows (the last one padded with zero rows) in the kernel's layout."""
    n, k = codes.shape
    nb = k // BLOCK
    if bits == 8:
        codes = (codes.astype(np.int16) - 128).astype(np.int8).view(np.uint8)
    panels = -(-n // PANEL)
    pad = panels * PANEL - n
    if pad:
        codes = np.pad(codes, [(0, pad), (0, 0)])
        scales = np.pad(scales, [(0, pad), (0, 0)])
        biases = np.pad(biases, [(0, pad), (0, 0)])
    c = codes.reshape(panels, PANEL, nb, BLOCK)
    if bits == 4:
        # chunk ch, byte 4j+t = code[j][4ch+t] | code[j][16+4ch+t] << 4
        c = c.reshape(panels, PANEL, nb, 2, 4, 4).transpose(0, 2, 4, 1, 5, 3)
        packed = (c[..., 0] | (c[..., 1] << 4)).reshape(panels, nb, 256)
    else:
        # chunk g, byte 4j+t = code[j][4g+t]
        packed = c.reshape(panels, PANEL, nb, 8, 4).transpose(0, 2, 3, 1, 4)
        packed = packed.reshape(panels, nb, 512)
    sc = scales.reshape(panels, PANEL, nb).transpose(0, 2, 1).astype(sdtype)
    bi = biases.reshape(panels, PANEL, nb).transpose(0, 2, 1).astype(sdtype)
    return np.concatenate(
        [packed, np.ascontiguousarray(sc).view(np.uint8), np.ascontiguousarray(bi).view(np.uint8)],
        axis=2,
    )


class QMatrix:
    """A quantized weight W [N, K] multiplied as y = x W^T (f32 in, f32 out)."""

    def __init__(self, qweight: QuantizedWeight, lib: ctypes.CDLL) -> None:
        if not isinstance(qweight, QuantizedWeight):
            raise TypeError(f"QMatrix needs a QuantizedWeight, not {type(qweight).__name__}")
        if qweight.bits not in SUPPORTED_BITS:
            raise ValueError(f"cpu qgemm supports {SUPPORTED_BITS}-bit weights, "
                             f"not {qweight.bits}-bit")
        if qweight.group_size < BLOCK or qweight.group_size % BLOCK:
            raise ValueError(f"cpu qgemm needs a group size that is a multiple of {BLOCK}, "
                             f"not {qweight.group_size}")
        if qweight.weight.dtype != mx.uint32:
            raise TypeError(f"quantized codes must be uint32 words, not {qweight.weight.dtype}")
        self.lib = lib
        self.bits = qweight.bits
        self.n, self.k = qweight.shape
        self.w, self.f16 = repack(qweight)
        self._wptr = self.w.ctypes.data

    def descriptor(self) -> SlotMatrix:
        """For native/block.c: the same call as host() makes."""
        return SlotMatrix(1, self.n, self.k, 0, self.bits, int(self.f16), self._wptr)

    @property
    def nbytes(self) -> int:
        """Bytes of weight data the kernel streams per call."""
        return int(self.w.nbytes)

    def host_rows(self, qx: QuantizedRows) -> np.ndarray:
        """y [rows, N] for activations already quantized by quantize_rows."""
        if qx.k != self.k:
            raise ValueError(f"activations have K={qx.k}, the weight has K={self.k}")
        y, yptr = _aligned_bytes(4 * qx.rows * self.n)
        rc = self.lib.slot_qgemm(*qx.ptrs, qx.rows, self.k, self._wptr, self.bits,
                                 int(self.f16), self.n, yptr)
        if rc != 0:
            raise RuntimeError(f"slot_qgemm failed (code {rc})")
        return y.view(np.float32).reshape(qx.rows, self.n)

    def host(self, xs: np.ndarray) -> np.ndarray:
        """y = xs W^T for an aligned float32 host array xs [rows, K]; y is aligned too.
        The same bits as host_rows(quantize_rows(lib, xs)), in one native call."""
        if xs.dtype != np.float32 or xs.ndim != 2 or not xs.flags.c_contiguous:
            raise TypeError("QMatrix.host needs a C-contiguous float32 [rows, K] array")
        rows, k = xs.shape
        if k != self.k:
            raise ValueError(f"activations have K={k}, the weight has K={self.k}")
        y, yptr = _aligned_bytes(4 * rows * self.n)
        rc = self.lib.slot_qgemm_f32(xs.ctypes.data, rows, k, self._wptr, self.bits,
                                     int(self.f16), self.n, yptr)
        if rc != 0:
            raise RuntimeError(f"slot_qgemm_f32 failed (code {rc})")
        return y.view(np.float32).reshape(rows, self.n)

    def __call__(self, x: mx.array) -> mx.array:
        lead = x.shape[:-1]
        return mx.array(self.host(to_host(x))).reshape(*lead, self.n)
