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

    def take_rows(self, order: mx.array) -> QuantizedWeight:
        return QuantizedWeight(
            self.weight[order], self.scales[order], self.biases[order], self.group_size, self.bits
        )
