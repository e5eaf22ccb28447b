"""The one thread that runs all MLX work.

MLX state (default device and stream, caches) is not safe to drive from several
threads, and its streams belong to the thread that made them, so the event loop never
calls MLX itself: it submits callables to a one-worker executor and awaits the result.
One worker means one thread for the executor's whole life, and jobs run in the order
they were submitted.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import TypeVar

import structlog

T = TypeVar("T")

log = structlog.get_logger(__name__)

CLOSE_TIMEOUT_S = 30.0  # how long close() waits for the jobs already submitted


class MLXThread:
    """A one-worker executor for MLX calls: `run` for async callers, `call` for sync ones."""

    def __init__(self, name: str = "mlx") -> None:
        self._local = threading.local()  # `inside` is set on the worker thread only
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=name,
                                        initializer=self._enter)
        self._lock = threading.Lock()
        self._closed = False

    def _enter(self) -> None:
        self._local.inside = True

    def call(self, fn: Callable[[], T]) -> T:
        """Run fn on the MLX thread and block until it returns (for sync callers).

        Called from the MLX thread itself (a job that calls back in), fn runs inline: waiting
        for a queue that only this thread serves would never end.
        """
        if getattr(self._local, "inside", False):
            return fn()
        return self._pool.submit(fn).result()

    async def run(self, fn: Callable[[], T]) -> T:
        """Run fn on the MLX thread; the event loop keeps serving meanwhile."""
        return await asyncio.wrap_future(self._pool.submit(fn))

    def post(self, fn: Callable[[], None], then: Callable[[], None]) -> None:
        """Queue fn (it runs before any job submitted later) and, once it has run, call
        `then` on the calling event loop's thread. For loop code that must not wait."""
        loop = asyncio.get_running_loop()
        future = self._pool.submit(fn)

        def done(f: Future[None]) -> None:
            if f.exception() is not None:
                log.error("MLX job failed", error=repr(f.exception()))
            with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
                loop.call_soon_threadsafe(then)

        future.add_done_callback(done)

    def close(self) -> None:
        """Let the jobs already submitted finish (at most `CLOSE_TIMEOUT_S`), then stop the
        thread. Idempotent. A job still running after the timeout is left to end on its own
        (the interpreter waits for it at exit)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            last = self._pool.submit(lambda: None)  # jobs run in order: done means all done
            self._pool.shutdown(wait=False)
        try:
            last.result(timeout=CLOSE_TIMEOUT_S)
        except FutureTimeout:
            log.warning("MLX thread still busy at close", timeout_s=CLOSE_TIMEOUT_S)
