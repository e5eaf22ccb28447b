"""Per-slot KV storage that grows with what is written.

Each slot owns one SlotKV: for every layer a keys and a values array of shape
[kv_heads, capacity, head_dim]. Capacity grows in steps of GROW_STEP positions (a
multiple of the attention block), so memory follows the tokens actually written
and never `max_slots x context` up front. Positions past `length` may hold stale
values from an earlier request; attention masks them by position.
"""

from __future__ import annotations

import mlx.core as mx

from slotserve.kernels.attention import BLOCK

GROW_STEP = 2 * BLOCK


class SlotKV:
    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, dtype: mx.Dtype) -> None:
        self.num_layers = num_layers
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self.capacity = 0
        self.keys: list[mx.array | None] = [None] * num_layers
        self.values: list[mx.array | None] = [None] * num_layers

    @property
    def bytes_per_position(self) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.dtype.size

    @property
    def nbytes(self) -> int:
        return self.capacity * self.bytes_per_position

    def reserve(self, end: int) -> None:
        """Make room for positions [0, end) before a step writes them."""
        if end <= self.capacity:
            return
        new_cap = -(-end // GROW_STEP) * GROW_STEP
        shape = (self.num_kv_heads, new_cap - self.capacity, self.head_dim)
        for i in range(self.num_layers):
            pad = mx.zeros(shape, dtype=self.dtype)
            k, v = self.keys[i], self.values[i]
            self.keys[i] = pad if k is None else mx.concatenate([k, pad], axis=1)
            self.values[i] = mx.zeros(shape, dtype=self.dtype) if v is None else mx.concatenate(
                [v, mx.zeros(shape, dtype=self.dtype)], axis=1
            )
        self.capacity = new_cap

    def write(self, layer: int, start: int, k: mx.array, v: mx.array) -> tuple[mx.array, mx.array]:
        """Store k/v ([kv_heads, T, head_dim]) at positions start.. and return the caches."""
        end = start + k.shape[1]
        keys, values = self.keys[layer], self.values[layer]
        assert keys is not None and values is not None and end <= self.capacity
        keys[:, start:end, :] = k
        values[:, start:end, :] = v
        self.keys[layer], self.values[layer] = keys, values
        return keys, values

    def release(self) -> None:
        """Drop the arrays (slot evicted)."""
        self.keys = [None] * self.num_layers
        self.values = [None] * self.num_layers
        self.capacity = 0
