"""Read a GGUF file into MLX arrays: its metadata, and every tensor type llama.cpp's `gguf`
package can dequantize, each held in the form slotserve's kernels run.

The container (header, key/values, tensor index) is parsed here directly, with the value
and tensor types of the `gguf` package: its `GGUFReader` builds numpy views per string and
takes 11 s for gemma-3-270m's 262,144-token vocabulary (this parser: well under a second).
Tensor data is read through a memory map. What each type becomes:

- F32 / F16 / BF16: dense arrays, as stored.
- Q4_0, Q4_1, Q4_K -> MLX affine 4-bit, Q8_0, Q5_0, Q5_1, Q5_K -> MLX affine 8-bit, group
  32: each 32-weight block of these types is scale * code + bias with one scale and one bias,
  so the codes are taken as they are (lossless; the K-quants' per-block scales
  d * sc and biases -dmin * m are rounded to float16, as MLX's own GGUF reader stores the
  legacy types' d). These are the layouts the CPU and GPU quantized matmuls take.
- MXFP4 expert stacks (3-D [experts, out, in], as llama.cpp's MXFP4_MOE and its gpt-oss
  files hold them) -> MLX `mxfp4` (lossless: the same E2M1 codes and E8M0 scales per 32
  weights, as slotserve.kernels.quantized.Mxfp4Weight; the expert kernels run it). A 2-D
  MXFP4 tensor is requantized as below (the dense matmuls take no mxfp4).
- Every other type the `gguf` package dequantizes (Q2_K, Q3_K, Q6_K, the IQ and TQ types,
  ...): dequantized by it once at load and requantized to MLX affine 8-bit, group 32
  (error within about one 8-bit step and the float16 rounding of its scale and bias: under
  2% of each 32-weight group's largest magnitude, where Q6_K's own step is 3%).
- Anything else is refused, naming the types that load.

The result is shaped as `mx.load` gives GGUF (`<name>.weight` / `.scales` / `.biases`
triples for quantized tensors, `.weight` / `.scales` (uint8) pairs for mxfp4 ones; metadata
values as str, list or MLX arrays), which
`slotserve.model.weights.read_gguf` maps to Hugging Face names.
"""

from __future__ import annotations

import mmap
import struct
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import structlog
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType
from gguf import quants as gguf_quants

from slotserve.model.errors import UnsupportedModelError

log = structlog.get_logger("slotserve.gguf")

GROUP = 32  # MLX group size of every quantized tensor read from GGUF
_SCALAR = {
    GGUFValueType.UINT8: "<u1", GGUFValueType.INT8: "<i1", GGUFValueType.UINT16: "<u2",
    GGUFValueType.INT16: "<i2", GGUFValueType.UINT32: "<u4", GGUFValueType.INT32: "<i4",
    GGUFValueType.FLOAT32: "<f4", GGUFValueType.BOOL: "?", GGUFValueType.UINT64: "<u8",
    GGUFValueType.INT64: "<i8", GGUFValueType.FLOAT64: "<f8",
}
T = GGMLQuantizationType
DENSE = (T.F32, T.F16, T.BF16)


@dataclass(frozen=True)
class TensorInfo:
    name: str
    kind: GGMLQuantizationType
    shape: tuple[int, ...]  # numpy order (GGUF lists dimensions innermost first)
    offset: int  # from the start of the file


@dataclass
class GGUFFile:
    metadata: dict[str, Any]
    tensors: list[TensorInfo]


class _Cursor:
    """Little-endian reads from the mapped file (GGUF v2/v3)."""

    def __init__(self, buf: mmap.mmap | bytes) -> None:
        self.buf, self.pos = buf, 0

    def take(self, fmt: str) -> Any:
        (v,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += struct.calcsize(fmt)
        return v

    def string(self) -> str:
        n = self.take("<Q")
        s = bytes(self.buf[self.pos : self.pos + n]).decode("utf-8", errors="replace")
        self.pos += n
        return s

    def value(self, vtype: int) -> Any:
        """A metadata value as mx.load gives it: str, list, or an MLX array (0-d for scalars)."""
        if vtype == GGUFValueType.STRING:
            return self.string()
        if vtype == GGUFValueType.ARRAY:
            etype, n = self.take("<I"), self.take("<Q")
            if etype == GGUFValueType.STRING:
                return [self.string() for _ in range(n)]
            if etype == GGUFValueType.ARRAY:
                return [self.value(etype) for _ in range(n)]
            dt = np.dtype(_SCALAR[GGUFValueType(etype)])
            arr = np.frombuffer(self.buf, dt, n, self.pos).copy()
            self.pos += n * dt.itemsize
            return mx.array(arr.astype(np.float32) if dt.kind == "f" and dt.itemsize == 8 else arr)
        dt = np.dtype(_SCALAR[GGUFValueType(vtype)])
        v = np.frombuffer(self.buf, dt, 1, self.pos)[0]
        self.pos += dt.itemsize
        return mx.array(np.float32(v) if dt == np.float64 else v)


def read_header(path: Path) -> GGUFFile:
    """The metadata and tensor index of a GGUF file (no tensor data is read)."""
    with path.open("rb") as fh, mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        c = _Cursor(buf)
        if bytes(buf[:4]) != b"GGUF":
            raise UnsupportedModelError(f"{path}: not a GGUF file (no GGUF magic)")
        c.pos = 4
        version = c.take("<I")
        if version not in (2, 3):
            raise UnsupportedModelError(f"{path}: GGUF version {version}; supported: 2, 3")
        n_tensors, n_kv = c.take("<Q"), c.take("<Q")
        meta: dict[str, Any] = {}
        for _ in range(n_kv):
            key = c.string()
            meta[key] = c.value(c.take("<I"))
        infos = []
        for _ in range(n_tensors):
            name = c.string()
            dims = [c.take("<Q") for _ in range(c.take("<I"))]
            kind, offset = c.take("<I"), c.take("<Q")
            try:
                qtype = GGMLQuantizationType(kind)
            except ValueError:
                raise UnsupportedModelError(
                    f"{path}: tensor {name!r} has GGML type {kind}, unknown to the gguf package; "
                    f"supported: {', '.join(supported_types())}") from None
            infos.append((name, qtype, tuple(reversed(dims)), offset))
        align = int(meta.get("general.alignment", mx.array(32)).item())
        start = -(-c.pos // align) * align
    return GGUFFile(meta, [TensorInfo(n, k, s, start + o) for n, k, s, o in infos])


@cache
def supported_types() -> tuple[str, ...]:
    """The GGML types that load: the dense ones and those the gguf package dequantizes."""
    names = []
    for t in GGMLQuantizationType:
        if t in DENSE or t in _EXACT:
            names.append(t.name)
            continue
        block, size = GGML_QUANT_SIZES[t]
        try:
            gguf_quants.dequantize(np.zeros((1, size), np.uint8), t)
        except (NotImplementedError, ValueError, KeyError):
            continue
        if block > 1:  # a block-quantized type (the integer dense types are not weights)
            names.append(t.name)
    return tuple(names)


def read_tensors(path: Path, header: GGUFFile) -> dict[str, mx.array]:
    """The tensors of `header`'s file as mx.load would give them, for every type in
    supported_types(); logs how many of each type were kept and converted, and to what."""
    data = np.memmap(path, np.uint8, mode="r")
    out: dict[str, mx.array] = {}
    counts: dict[str, Counter[str]] = {"as_stored": Counter(), "lossless": Counter(),
                                        "requantized": Counter()}
    for info in header.tensors:
        how, became = _read_tensor(path, data, info, out)
        counts[how][f"{info.kind.name} -> {became}"] += 1
    log.info("gguf tensors read", path=str(path), **{k: dict(v) for k, v in counts.items()})
    return out


def _read_tensor(path: Path, data: np.memmap, info: TensorInfo,
                 out: dict[str, mx.array]) -> tuple[str, str]:
    """Put one tensor (a dense array or a weight/scales/biases triple) into `out`; returns
    how (as_stored, lossless or requantized) and what it became."""
    base = info.name[: -len(".weight")] if info.name.endswith(".weight") else info.name
    k = info.shape[-1]
    block, size = GGML_QUANT_SIZES[info.kind]
    rows = int(np.prod(info.shape[:-1], dtype=np.int64))
    raw = data[info.offset : info.offset + rows * (k // block) * size].reshape(rows, -1)
    lead = info.shape[:-1]
    if info.kind in DENSE:
        if info.kind == T.BF16:
            arr = mx.array(np.asarray(raw).view(np.uint16)).view(mx.bfloat16)
        else:
            arr = mx.array(np.asarray(raw).view(np.float32 if info.kind == T.F32 else np.float16))
        out[info.name] = arr.reshape(info.shape)
        return "as_stored", info.kind.name
    if k % GROUP:
        raise UnsupportedModelError(
            f"{path}: tensor {info.name!r} ({info.kind.name}) has rows of {k}, "
            f"not a multiple of {GROUP}")
    if info.kind == T.MXFP4 and len(info.shape) == 3:
        blocks = np.asarray(raw).reshape(-1, size)  # e (E8M0), qs[16] (codes j, j + 16)
        out[base + ".weight"] = _pack(_nibbles(blocks[:, 1:]).reshape(rows, k), 4).reshape(
            *lead, -1)
        out[base + ".scales"] = mx.array(np.ascontiguousarray(blocks[:, 0])).reshape(
            *lead, k // GROUP)
        return "lossless", "MLX mxfp4"
    exact = _EXACT.get(info.kind)
    if exact is not None:
        bits, decode = exact
        codes, scales, biases = decode(np.asarray(raw).reshape(-1, size))
        how = "lossless", f"MLX {bits}-bit g{GROUP}"
        w = _pack(codes.reshape(rows, k), bits)
        s = mx.array(scales.reshape(rows, k // GROUP).astype(np.float16, copy=False))
        b = mx.array(biases.reshape(rows, k // GROUP).astype(np.float16, copy=False))
    else:
        try:
            dense = gguf_quants.dequantize(np.asarray(raw), info.kind)
        except NotImplementedError:
            raise UnsupportedModelError(
                f"{path}: tensor {info.name!r} has type {info.kind.name}, which the gguf "
                f"package cannot dequantize; supported: {', '.join(supported_types())}"
            ) from None
        w, s, b = mx.quantize(mx.array(dense.reshape(rows, k)), group_size=GROUP, bits=8)
        s, b = s.astype(mx.float16), b.astype(mx.float16)
        how = "requantized", f"MLX 8-bit g{GROUP}"
    out[base + ".weight"] = w.reshape(*lead, -1)
    out[base + ".scales"] = s.reshape(*lead, -1)
    out[base + ".biases"] = b.reshape(*lead, -1)
    return how


def _pack(codes: np.ndarray, bits: int) -> mx.array:
    """uint8 codes [rows, K] -> MLX's uint32 words (element i of a word at bits * i)."""
    if bits == 4:
        codes = (codes[:, 0::2] | (codes[:, 1::2] << 4)).astype(np.uint8)
    return mx.array(np.ascontiguousarray(codes).view(np.uint32))


# --- the types whose 32-weight blocks are scale * code + bias, decoded to those three ----------
# Each takes blocks [n, bytes] and returns codes [n, weights per block] (uint8) and the
# scales and biases of its 32-weight groups [n, groups] (float16, or float32 to be rounded).

Decoded = tuple[np.ndarray, np.ndarray, np.ndarray]


def _f16(b: np.ndarray) -> np.ndarray:
    """Two bytes per block -> its float16 value [n, 1] (d or m; multiples of it by powers
    of two stay exact in float16)."""
    return np.ascontiguousarray(b).view(np.float16)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """16 bytes -> 32 codes: low nibbles are weights 0-15, high nibbles 16-31."""
    out = np.empty((qs.shape[0], 32), np.uint8)
    np.bitwise_and(qs, 0x0F, out=out[:, :16])
    np.right_shift(qs, 4, out=out[:, 16:])
    return out


def _high_bits(qh: np.ndarray) -> np.ndarray:
    """Q5_0/Q5_1's 32-bit qh: bit j is weight j's fifth bit."""
    word = np.ascontiguousarray(qh).view("<u4")
    return ((word >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8)


def _q4_0(b: np.ndarray) -> Decoded:  # d, qs[16]: d * (q - 8)
    d = _f16(b[:, :2])
    return _nibbles(b[:, 2:]), d, d * np.float16(-8)


def _q4_1(b: np.ndarray) -> Decoded:  # d, m, qs[16]: d * q + m
    return _nibbles(b[:, 4:]), _f16(b[:, :2]), _f16(b[:, 2:4])


def _q8_0(b: np.ndarray) -> Decoded:  # d, qs[32] int8: d * q
    d = _f16(b[:, :2])
    return b[:, 2:] ^ np.uint8(0x80), d, d * np.float16(-128)  # q + 128 as uint8


def _q5_0(b: np.ndarray) -> Decoded:  # d, qh, qs[16]: d * (q - 16)
    d = _f16(b[:, :2])
    return _nibbles(b[:, 6:]) | (_high_bits(b[:, 2:6]) << 4), d, d * np.float16(-16)


def _q5_1(b: np.ndarray) -> Decoded:  # d, m, qh, qs[16]: d * q + m
    return _nibbles(b[:, 8:]) | (_high_bits(b[:, 4:8]) << 4), _f16(b[:, :2]), _f16(b[:, 2:4])


def _k_scales(b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K: the 8 sub-blocks' scales d * sc and biases -dmin * m."""
    sc, m = gguf_quants.Q4_K.get_scale_min(np.ascontiguousarray(b[:, 4:16]))
    d, dmin = _f16(b[:, :2]).astype(np.float32), _f16(b[:, 2:4]).astype(np.float32)
    return d * sc.astype(np.float32), -(dmin * m.astype(np.float32))


def _k_nibbles(qs: np.ndarray) -> np.ndarray:
    """128 bytes -> 256 codes: per 64 weights, 32 low nibbles then 32 high ones."""
    qs = qs.reshape(-1, 4, 1, 32)
    return np.concatenate([qs & 0x0F, qs >> 4], axis=2).reshape(-1, 256)


def _q4_k(b: np.ndarray) -> Decoded:  # d, dmin, scales[12], qs[128]
    scales, biases = _k_scales(b)
    return _k_nibbles(b[:, 16:]), scales, biases


def _q5_k(b: np.ndarray) -> Decoded:  # d, dmin, scales[12], qh[32], qs[128]
    scales, biases = _k_scales(b)
    qh = b[:, 16:48].reshape(-1, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)
    return _k_nibbles(b[:, 48:]) | ((qh & 1).reshape(-1, 256) << 4), scales, biases


_EXACT: dict[GGMLQuantizationType, tuple[int, Callable[[np.ndarray], Decoded]]] = {
    T.Q4_0: (4, _q4_0), T.Q4_1: (4, _q4_1), T.Q4_K: (4, _q4_k),
    T.Q8_0: (8, _q8_0), T.Q5_0: (8, _q5_0), T.Q5_1: (8, _q5_1), T.Q5_K: (8, _q5_k),
}
