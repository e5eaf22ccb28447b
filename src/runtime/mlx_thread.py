"""The one thread that runs all MLX work.

MLX state (default device and stream, caches) is not safe to drive from several
threads, so the event loop never calls MLX itself: it submits callables here and
awaits the result. A single long-lived thread with its own queue, not a pool.
"""

from __future__ import annotations

import asyncio
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, TypeVar

T = TypeVar("T")

_STOP = object()


class MLXThread:
    def __init__(self, name: str = "slotserve-mlx") -> None:
        self._jobs: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            if job is _STOP:
                return
            fn, fut = job
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                fut.set_result(fn())
            except BaseException as exc:  # delivered to the awaiting caller
                fut.set_exception(exc)

    def submit(self, fn: Callable[[], T]) -> Future[T]:
        fut: Future[T] = Future()
        self._jobs.put((fn, fut))
        return fut

    def call(self, fn: Callable[[], T]) -> T:
        """Run fn on the MLX thread and block until it returns (for sync callers)."""
        if threading.current_thread() is self._thread:
            return fn()
        return self.submit(fn).result()

    async def run(self, fn: Callable[[], T]) -> T:
        """Run fn on the MLX thread; the event loop keeps serving meanwhile."""
        return await asyncio.wrap_future(self.submit(fn))

    def close(self) -> None:
        self._jobs.put(_STOP)
        self._thread.join(timeout=30)

    @property
    def ident(self) -> int | None:
        return self._thread.ident
