"""The MLX thread: every job on one thread, in order, and a clean close."""

from __future__ import annotations

import threading
import time

import anyio
import mlx.core as mx
import pytest

from slotserve.runtime.mlx_thread import MLXThread


def test_every_job_runs_on_one_thread_in_order() -> None:
    mlx = MLXThread()
    seen: list[tuple[int, int]] = []

    def job(i: int) -> int:
        seen.append((threading.get_ident(), i))
        return i * i

    async def main() -> list[int]:
        out: list[int] = []
        async with anyio.create_task_group() as tg:
            for i in range(20):
                async def one(i: int = i) -> None:
                    out.append(await mlx.run(lambda: job(i)))
                tg.start_soon(one)
        return out

    try:
        squares = anyio.run(main)
        assert sorted(squares) == [i * i for i in range(20)]
        assert len({ident for ident, _ in seen}) == 1
        assert seen[0][0] != threading.get_ident()
        assert [i for _, i in seen] == sorted(i for _, i in seen)  # submitted in order
        assert mlx.call(threading.get_ident) == seen[0][0]
    finally:
        mlx.close()


def test_mlx_work_and_errors_reach_the_caller() -> None:
    mlx = MLXThread()
    try:
        # a lazy array built by one job is evaluated by a later one: MLX streams belong to
        # the thread that made them, so this only works because both run on the same thread
        lazy = mlx.call(lambda: mx.arange(6, dtype=mx.float32) * 2)
        assert mlx.call(lambda: lazy.sum().item()) == 30.0
        with pytest.raises(ZeroDivisionError):
            mlx.call(lambda: 1 / 0)

        async def failing() -> None:
            await mlx.run(lambda: [][1])

        with pytest.raises(IndexError):
            anyio.run(failing)
        # a job that calls back in runs inline instead of waiting on itself
        assert mlx.call(lambda: mlx.call(threading.get_ident)) == mlx.call(threading.get_ident)
    finally:
        mlx.close()


def test_close_waits_for_submitted_jobs_and_is_idempotent() -> None:
    mlx = MLXThread()
    done: list[bool] = []
    started = threading.Event()

    def slow() -> None:
        started.set()
        time.sleep(0.2)
        done.append(True)

    worker = threading.Thread(target=lambda: mlx.call(slow))
    worker.start()
    started.wait(5)
    mlx.close()
    assert done == [True]
    mlx.close()
    worker.join(5)
    with pytest.raises(RuntimeError):
        mlx.call(lambda: None)
