"""MLX's affine-quantized matrix (codes, per-group scales and biases): the form quantized
weights take from the checkpoint readers to the matmul kernels."""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx


@dataclass
class QuantizedWeight:
    """An affine-quantized [out, in] matrix as MLX stores it."""

    weight: mx.array
    scales: mx.array
    biases: mx.array
    group_size: int
    bits: int

    @property
    def shape(self) -> tuple[int, int]:
        return (self.weight.shape[0], self.scales.shape[-1] * self.group_size)

    def dequantize(self, dtype: mx.Dtype | None) -> mx.array:
        """Dense weights; dtype None keeps MLX's result type (the scales' dtype)."""
        w = mx.dequantize(
            self.weight, self.scales, self.biases, group_size=self.group_size, bits=self.bits
        )
        return w if dtype is None else w.astype(dtype)

    def with_scales_in(self, dtype: mx.Dtype) -> QuantizedWeight:
        """The same codes with float32 scales and biases cast to `dtype`. MLX's affine
        matmuls return the promotion of the input's and the scales' dtypes: float32 scales
        (a checkpoint quantized from float32 weights) would make a bfloat16 model's
        activations float32. Other scales are kept: float16 ones (GGUF's block scales) are
        exact, and bfloat16 would round them."""
        if self.scales.dtype != mx.float32:
            return self
        return QuantizedWeight(self.weight, self.scales.astype(dtype), self.biases.astype(dtype),
                               self.group_size, self.bits)

    def take_rows(self, order: mx.array) -> QuantizedWeight:
        return QuantizedWeight(
            self.weight[order], self.scales[order], self.biases[order], self.group_size, self.bits
        )


@dataclass
class Mxfp4Weight:
    """An MXFP4 [..., out, in] matrix as MLX stores it (`mode="mxfp4"`): 4-bit E2M1 codes,
    eight to a uint32 (element i of a word in bits 4i..4i+3), one E8M0 power-of-two scale
    (uint8, bias 127) per 32 inputs, no biases. gpt-oss's released experts are in this
    format (`*_blocks` bytes are the same codes two to a byte, `*_scales` the same scales)."""

    weight: mx.array  # [..., out, in / 8] uint32
    scales: mx.array  # [..., out, in / 32] uint8
    group_size: int = 32
    bits: int = 4
    mode: str = "mxfp4"

    @staticmethod
    def from_blocks(blocks: mx.array, scales: mx.array) -> Mxfp4Weight:
        """The MXFP4 tensor of a `*_blocks` [..., out, in / 32, 16] uint8 tensor and its
        `*_scales` [..., out, in / 32]."""
        *lead, groups, nbytes = blocks.shape
        words = blocks.reshape(*lead, groups * nbytes).view(mx.uint32)
        return Mxfp4Weight(words, scales)

    def dequantize(self, dtype: mx.Dtype) -> mx.array:
        w = mx.dequantize(self.weight, self.scales, None, group_size=self.group_size,
                          bits=self.bits, mode=self.mode)
        return w.astype(dtype)

    def take(self, order: mx.array, axis: int) -> Mxfp4Weight:
        """Rows (an `out` axis, or the expert axis) in another order."""
        return Mxfp4Weight(mx.take(self.weight, order, axis=axis),
                           mx.take(self.scales, order, axis=axis))
