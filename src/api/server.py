"""Serve the app with Hypercorn: graceful shutdown, log setup, the CLI entry and its banner.

Shutdown order matters: Hypercorn gives open connections only a short grace period, so the
engine drains first (in-flight streams run to their end or get a clean error chunk) and only
then does Hypercorn close the listeners. An engine that fails while serving stops the server
the same way, at once (a failed engine has nothing left to finish), and `serve` then raises
`EngineFailedError`: `slotserve serve` exits 1 so that its supervisor starts it afresh.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Coroutine
from typing import Any, TypeVar

import structlog
from hypercorn.asyncio import serve as hypercorn_serve
from hypercorn.config import Config
from quart import Quart

from slotserve import settings
from slotserve.actors import state_snapshots
from slotserve.api.app import app_state, create_app
from slotserve.api.keys import ENV, APIKeyError, APIKeys, as_api_keys, load_api_keys
from slotserve.api.state import AppState, model_id_for
from slotserve.engine import EngineConfig, EngineFailedError
from slotserve.logs import configure_logging

T = TypeVar("T")

log = structlog.get_logger("slotserve.server")

DEFAULT_QUEUE_TIMEOUT = 600.0  # seconds a request may wait for a slot (--queue-timeout)


def hypercorn_config(host: str, port: int, fd: int | None = None,
                     graceful_timeout: float = 10.0) -> Config:
    cfg = Config()
    if fd is not None:
        cfg.bind = [f"fd://{fd}"]
    else:
        cfg.bind = [f"[{host}]:{port}" if ":" in host else f"{host}:{port}"]
    cfg.graceful_timeout = graceful_timeout
    cfg.accesslog = None  # the app logs each request itself
    return cfg


async def serve(app: Quart, *, host: str = "127.0.0.1", port: int = 8000, fd: int | None = None,
                shutdown_event: asyncio.Event | None = None,
                stop_on_failure: bool = True) -> None:
    """Serve until `shutdown_event` is set (or SIGINT/SIGTERM when none is given), or until the
    engine fails (to load, or while serving), unless `stop_on_failure` is off: the server then
    answers 503 with the reason (/health included) until it is told to stop.

    `fd`: an already bound listening socket to serve on (tests bind port 0 this way).
    Raises the engine's load error if the model could not be loaded, and EngineFailedError if
    the engine failed while serving.
    """
    state = app_state(app)
    stop = shutdown_event or _signal_event()

    async def trigger() -> None:
        waits = {asyncio.ensure_future(stop.wait())}
        if stop_on_failure:
            waits.add(asyncio.ensure_future(state.failed.wait()))
        try:
            await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for w in waits:
                w.cancel()
        log.info("stopping: draining in-flight requests")
        await state.drain()

    await hypercorn_serve(app, hypercorn_config(host, port, fd), shutdown_trigger=trigger)
    if state.load_error is not None:
        raise state.load_error
    if state.failure is not None:
        raise EngineFailedError(f"the engine failed: {state.failure}")


def _signal_event() -> asyncio.Event:
    """Set on the first SIGINT/SIGTERM; a second one gets the default (immediate) behaviour."""
    event = asyncio.Event()
    loop = asyncio.get_running_loop()
    signals = (signal.SIGINT, signal.SIGTERM)

    def first(*_: object) -> None:
        log.info("signal received: draining (send it again to stop at once)")
        for sig in signals:
            loop.remove_signal_handler(sig)
        event.set()

    if sys.platform == "win32":  # asyncio has no signal handlers there: Ctrl+C stops at once
        return event
    for sig in signals:
        with contextlib.suppress(RuntimeError, ValueError):  # not on the main thread
            loop.add_signal_handler(sig, first)
    return event


async def run_server(host: str, port: int, engine_config: EngineConfig,
                     api_key: str | APIKeys | None = None, log_format: str = "console",
                     log_level: str = "info", **app_options: Any) -> None:
    """The `slotserve serve` entry: configure logs, build the app, serve until a signal.

    `app_options`: create_app's keywords (keepalive_interval, max_body_bytes, model_id,
    queue_timeout, strict_model_names).
    """
    configure_logging(log_format, log_level)
    app = create_app(engine_config, api_key, **app_options)
    await serve(app, host=host, port=port)


def main(args: argparse.Namespace) -> int:
    """`slotserve serve` with the CLI's parsed arguments; blocks until SIGINT/SIGTERM.

    Returns 0 after a signal, 1 if the engine failed to load or failed while serving (or the
    port is taken), and 2 at once, with a message on stderr, if a key source is given but
    unusable.
    """
    try:
        keys = load_api_keys(getattr(args, "api_key", None), getattr(args, "api_key_file", None),
                             os.environ)
    except APIKeyError as exc:
        sys.stderr.write(f"slotserve serve: error: {exc}\n")
        return 2
    for warning in keys.warnings:
        sys.stderr.write(f"slotserve serve: warning: {warning}\n")
    cfg = EngineConfig(model=args.model, device=getattr(args, "device", "auto"),
                       max_slots=args.max_slots, max_queue=args.max_queue,
                       kv_budget_bytes=settings.parse_bytes(getattr(args, "kv_budget", None)),
                       prefill_budget=getattr(args, "prefill_budget", None),
                       kv_reserve_tokens=getattr(args, "kv_reserve_tokens", None),
                       state_snapshot_pages=getattr(args, "state_snapshot_pages",
                                                    state_snapshots.DEFAULT_INTERVAL),
                       settle_passes=not getattr(args, "no_settle_passes", False),
                       default_max_tokens=getattr(args, "default_max_tokens", None),
                       allow_batch_variance=getattr(args, "allow_batch_variance", False),
                       cache_scope=getattr(args, "cache_scope", "key"))
    sys.stdout.write(startup_banner(args.host, args.port, keys, model_id_for(args.model)) + "\n")
    sys.stdout.flush()
    try:
        asyncio.run(run_server(args.host, args.port, cfg, keys,
                               getattr(args, "log_format", "console"),
                               getattr(args, "log_level", "info"),
                               queue_timeout=queue_timeout(getattr(args, "queue_timeout", None)),
                               strict_model_names=getattr(args, "strict_model_names", False)))
    except Exception as exc:  # no model, a failed engine, a taken port: exit 1, for a supervisor
        log.error("server stopped", error=f"{type(exc).__name__}: {exc}")
        return 1
    return 0


def queue_timeout(seconds: float | None) -> float | None:
    """`--queue-timeout` as the app takes it: None (not given) is the default 600 s, 0 or less
    is no bound."""
    if seconds is None:
        return DEFAULT_QUEUE_TIMEOUT
    return seconds if seconds > 0 else None


def startup_banner(host: str, port: int, api_keys: APIKeys | str | None = None,
                   model: str | None = None) -> str:
    """What the CLI prints at start: where to reach the server, its auth, a request to try.

    The auth line says how many keys and from where, never a key (the curl example has a
    `<key>` placeholder).
    """
    shown = "localhost" if host in ("0.0.0.0", "::", "") else host
    shown = f"[{shown}]" if ":" in shown else shown
    base = f"http://{shown}:{port}"
    keys = as_api_keys(api_keys)
    auth = " \\\n       -H 'Authorization: Bearer <key>'" if keys else ""
    access = (f"auth: {keys.describe()}; send one as <key> below (or as 'x-api-key: <key>')"
              if keys
              else f"auth: {keys.describe()} (see --api-key-file or ${ENV})")
    name = f" serving {model}" if model else ""
    return (
        f"slotserve{name} on {base} (OpenAI API at {base}/v1; health at {base}/health)\n"
        f"{access}\n"
        f"try:\n"
        f"  curl {base}/v1/chat/completions -H 'Content-Type: application/json'{auth} \\\n"
        f"       -d '{{\"messages\": [{{\"role\": \"user\", \"content\": \"Hello!\"}}]}}'"
    )


class BackgroundServer:
    """The app served on its own thread and event loop (tests, notebooks, benchmarks).

        with BackgroundServer(create_app(EngineConfig(max_slots=4))).start() as srv:
            httpx.get(srv.url + "/health")
    """

    def __init__(self, app: Quart, host: str = "127.0.0.1", port: int = 0,
                 stop_on_failure: bool = True) -> None:
        self.app = app
        self.stop_on_failure = stop_on_failure  # off: a failed engine is served as 503s
        self._sock: socket.socket | None = socket.create_server((host, port))
        self.host, self.port = host, self._sock.getsockname()[1]
        self.loop: asyncio.AbstractEventLoop | None = None
        self.error: BaseException | None = None
        self._stop: asyncio.Event | None = None
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def state(self) -> AppState:
        return app_state(self.app)

    def start(self, timeout: float = 180.0) -> BackgroundServer:
        """Start serving and wait until the engine is ready (or raise why it is not)."""
        assert self._sock is not None, "a BackgroundServer starts once"
        fd = self._sock.detach()
        self._sock = None
        started = threading.Event()

        async def main() -> None:
            self.loop, self._stop = asyncio.get_running_loop(), asyncio.Event()
            started.set()
            await serve(self.app, fd=fd, shutdown_event=self._stop,
                        stop_on_failure=self.stop_on_failure)

        def run() -> None:
            try:
                asyncio.run(main())
            except BaseException as exc:  # reported by start() / stop()
                self.error = exc
                started.set()

        self._thread = threading.Thread(target=run, name=f"slotserve-{self.port}", daemon=True)
        self._thread.start()
        started.wait(timeout)
        deadline = time.monotonic() + timeout
        while self.state.status != "ok":
            if self.error is not None or self.state.status == "failed":
                self.stop()
                raise RuntimeError(f"server failed to start: {self.error or self.state.failure}")
            if time.monotonic() > deadline:
                self.stop()
                raise TimeoutError(f"server not ready after {timeout} s")
            time.sleep(0.05)
        return self

    def call(self, coro: Coroutine[Any, Any, T], timeout: float = 120.0) -> T:
        """Run a coroutine on the server's loop (e.g. against its engine) and return its result."""
        assert self.loop is not None
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def stop(self, timeout: float = 60.0) -> None:
        """Drain and stop; returns once the server thread has exited."""
        if self.loop is not None and self._stop is not None and not self.loop.is_closed():
            with contextlib.suppress(RuntimeError):  # the loop already finished
                self.loop.call_soon_threadsafe(self._stop.set)
        if self._thread is not None:
            self._thread.join(timeout)

    def __enter__(self) -> BackgroundServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
