"""Shared test set-up: import slotserve first so OpenBLAS is loaded before MLX."""

from __future__ import annotations

import ctypes

import pytest

import slotserve  # noqa: F401
from slotserve.kernels import native

# Every instruction set this CPU runs: an AVX-512 machine also tests the AVX2 kernels.
NATIVE_ARCHS = native.runnable_archs() if native.library() is not None else []


@pytest.fixture(params=NATIVE_ARCHS or [pytest.param(None, marks=pytest.mark.skip(
    reason="no C compiler: the native kernels are not built"))])
def lib(request: pytest.FixtureRequest) -> ctypes.CDLL:
    """slotserve's native CPU kernels, built for each target this CPU can run."""
    built = native.library(request.param)
    assert built is not None, f"native kernels for {request.param} did not load"
    return built
