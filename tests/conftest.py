"""Shared test set-up: import slotserve first so OpenBLAS is loaded before MLX."""

from __future__ import annotations

import contextlib
import ctypes
from collections.abc import Callable, Iterator

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


def _openmp_pause() -> Callable[[int], int] | None:
    """libgomp's omp_pause_resource_all (the runtime the native kernels and torch share);
    None without libgomp, or one older than OpenMP 5.0's pause (GCC 10)."""
    with contextlib.suppress(OSError, AttributeError):
        return ctypes.CDLL("libgomp.so.1").omp_pause_resource_all
    return None


_OMP_PAUSE = _openmp_pause()


@pytest.fixture(autouse=True)
def _no_openmp_pool_left_on_the_main_thread() -> Iterator[None]:
    """Before and after each test, the OpenMP workers the test thread started are let go.

    A test that runs OpenMP code on the main thread (a native kernel called directly, a
    transformers oracle in torch) leaves a docked team there. Once the process has more
    OpenMP threads than CPUs, libgomp stops its workers spinning between parallel regions,
    and every engine after that (its kernels run on its MLX thread's own team) decodes
    about 2.5x slower on a 2-core machine: the suite spent minutes waiting on futexes.
    Both ends: after a test, so the next module's fixtures (set up before this one: an
    engine's load and invariance probe) start unthrottled; before it, for a team those
    fixtures left.
    """
    if _OMP_PAUSE is not None:
        _OMP_PAUSE(1)  # omp_pause_soft: the threads exit, nothing else
    yield
    if _OMP_PAUSE is not None:
        _OMP_PAUSE(1)


# Every instruction set this CPU runs: an AVX-512 machine also tests the AVX2 kernels.
NATIVE_ARCHS = native.runnable_archs() if native.library() is not None else []


@pytest.fixture(params=NATIVE_ARCHS or [pytest.param(None, marks=pytest.mark.skip(
    reason="no C compiler: the native kernels are not built"))])
def lib(request: pytest.FixtureRequest) -> ctypes.CDLL:
    """slotserve's native CPU kernels, built for each target this CPU can run."""
    built = native.library(request.param)
    assert built is not None, f"native kernels for {request.param} did not load"
    return built
