"""runtime.compiled's block-table padding (the compiled steps themselves run on a GPU only:
tests/test_gpu.py checks their bits through CompiledDecode.same_bits, a padded step)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from slotserve.runtime.compiled import padded_width


def test_block_tables_pad_to_a_power_of_two_with_unread_zeros() -> None:
    for width, bucket in [(1, 1), (2, 2), (3, 4), (4, 4), (5, 8), (100, 128), (256, 256)]:
        tables = mx.array(np.arange(3 * width * 2, dtype=np.int32).reshape(3, width, 2) + 1)
        padded = np.array(padded_width(tables))
        assert padded.shape == (3, bucket, 2)
        assert np.array_equal(padded[:, :width], np.array(tables))
        assert not padded[:, width:].any()
