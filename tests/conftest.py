"""Shared test set-up: import slotserve first so OpenBLAS is loaded before MLX."""

from __future__ import annotations

import ctypes
from collections.abc import Iterator

import pytest
import structlog

import slotserve  # noqa: F401
from slotserve.kernels import native


@pytest.fixture(autouse=True)
def _default_logging() -> Iterator[None]:
    """Each test starts from structlog's defaults: a test that starts a server or the CLI in
    this process configures logging (level warning, say), and a later test's capture_logs
    would then miss the info lines it checks for."""
    structlog.reset_defaults()
    yield
    structlog.reset_defaults()


# Every instruction set this CPU runs: an AVX-512 machine also tests the AVX2 kernels.
NATIVE_ARCHS = native.runnable_archs() if native.library() is not None else []


@pytest.fixture(params=NATIVE_ARCHS or [pytest.param(None, marks=pytest.mark.skip(
    reason="no C compiler: the native kernels are not built"))])
def lib(request: pytest.FixtureRequest) -> ctypes.CDLL:
    """slotserve's native CPU kernels, built for each target this CPU can run."""
    built = native.library(request.param)
    assert built is not None, f"native kernels for {request.param} did not load"
    return built
