"""Shared test set-up: import slotserve first so OpenBLAS is loaded before MLX."""

import slotserve  # noqa: F401
