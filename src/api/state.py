"""The app's engine, owned by one background task from load to shutdown.

The engine's task group must be entered and left by the same task, and loading takes seconds,
so a dedicated task loads it (the server answers /health 503 meanwhile), keeps it open, and
closes it when asked: in-flight requests finish, queued ones end with an error. An engine that
fails to load, or fails while serving (its step loop crashed), sets `failed`: the server then
stops and `slotserve serve` exits non-zero, so that a process supervisor starts it afresh.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from collections.abc import Coroutine
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import structlog

from slotserve.api.errors import APIError
from slotserve.api.keys import APIKeys
from slotserve.api.metrics import Metrics
from slotserve.api.reasoning import template_thinks
from slotserve.api.response_store import ResponseStore
from slotserve.api.tool_formats import HERMES, CallSyntax, syntax_for_template
from slotserve.engine import Engine, EngineConfig
from slotserve.runtime.grammar import Grammar

log = structlog.get_logger("slotserve.api")

DEFAULT_ALIASES = ("default",)


@dataclass
class Settings:
    api_keys: APIKeys = field(default_factory=APIKeys)  # empty: no auth
    keepalive_interval: float = 15.0  # seconds between SSE comments while nothing is sent
    max_body_bytes: int = 8 * 2**20
    # seconds a request may wait in the queue before it is answered 429 + Retry-After
    # (None: no bound)
    queue_timeout: float | None = 600.0
    # refuse (404) a model name other than the served id and its aliases; off, any name is
    # this server's one model (agents send their own model names)
    strict_model_names: bool = False


def model_id_for(model: str | Path | None) -> str:
    """The name clients see: the model file's stem, or the model directory's name."""
    if model is None:
        try:
            from slotserve.model.loader import default_model_path

            model = default_model_path()
        except Exception:  # the load itself reports a missing model properly
            return "default"
    p = Path(model)
    return p.stem if p.suffix == ".gguf" else p.name


class AppState:
    def __init__(self, engine_config: EngineConfig, settings: Settings,
                 model_id: str | None = None) -> None:
        self.engine_config = engine_config
        self.settings = settings
        self.model_id = model_id or model_id_for(engine_config.model)
        self.engine: Engine | None = None
        self.metrics = Metrics(lambda: self.engine)
        self.load_error: BaseException | None = None
        self.failed = asyncio.Event()
        self.draining = False
        self.template_lists_tools = False
        self.template_renders_calls = False
        self.template_thinks = False  # the template writes <think> reasoning blocks
        self.call_syntax: CallSyntax = HERMES
        self.special_ids: dict[str, int] = {}  # the vocabulary's special tokens by text
        self.grammars: OrderedDict[str, Grammar] = OrderedDict()  # compiled tool grammars
        self.responses = ResponseStore()
        self._stop: asyncio.Event | None = None
        self._task: asyncio.Task[None] | None = None

    # ---- lifecycle -----------------------------------------------------------------------

    def start(self) -> None:
        if self._task is not None:
            return
        self.engine = Engine(self.engine_config)
        self._stop = asyncio.Event()
        self._task = asyncio.create_task(self._run(self.engine, self._stop), name="engine")

    async def _run(self, engine: Engine, stop: asyncio.Event) -> None:
        try:
            async with engine:
                assert engine.template is not None
                self.learn_template(engine)
                log.info("serving", model=self.model_id)
                await _first(stop.wait(), engine.wait_failed())
                if engine.failure is not None:  # the server stops: see `failed`
                    log.error("engine failed: stopping", reason=engine.failure)
                    self.failed.set()
                else:
                    log.info("shutting down: finishing in-flight requests",
                             running=engine.kv_summary()["running"])
        except Exception as exc:
            self.load_error = exc
            log.error("engine failed", error=str(exc), exc_info=exc)
            self.failed.set()

    def learn_template(self, engine: Engine) -> None:
        """What the chat template says of tools: whether it lists them and renders past
        calls, and the call syntax it teaches (`tool_formats.syntax_for_template`)."""
        assert engine.template is not None
        source = engine.template.source
        self.template_lists_tools = "tools" in source
        self.template_renders_calls = "tool_calls" in source
        self.template_thinks = template_thinks(source)
        self.call_syntax = syntax_for_template(None if engine.template.is_default else source)
        self.special_ids = dict(engine.tokenizer.special_tokens)
        log.info("tool calls", syntax=self.call_syntax.name)

    async def drain(self) -> None:
        """Stop taking requests, let running ones finish, close the engine (idempotent)."""
        self.draining = True
        task = self._task
        if task is None or self._stop is None:
            return
        engine = self.engine
        loading = engine is not None and not engine.ready and not task.done()
        if loading:
            task.cancel()  # nothing in flight to wait for
        self._stop.set()
        await asyncio.wait({task})
        if loading and engine is not None and engine.mlx is not None:
            await asyncio.to_thread(engine.mlx.close)  # let the half-done load finish and exit

    # ---- per request -----------------------------------------------------------------------

    @property
    def failure(self) -> str | None:
        """Why the engine failed (to load, or while serving), or None."""
        if self.load_error is not None:
            return str(self.load_error)
        return self.engine.failure if self.engine is not None else None

    @property
    def status(self) -> str:
        eng = self.engine
        if self.failure is not None:
            return "failed"
        if self.draining or (eng is not None and eng.closing):
            return "shutting_down"
        if eng is None or not eng.ready:
            return "loading"
        return "ok"

    def ready_engine(self) -> Engine:
        """The engine if it takes requests now, else a 503 that says why."""
        status = self.status
        if status == "ok":
            assert self.engine is not None
            return self.engine
        self.metrics.reject(status)
        raise self.unavailable()

    def unavailable(self) -> APIError:
        """The 503 for a server that takes no requests now (loading, stopping or failed)."""
        status = self.status
        message = {"loading": "the model is still loading; retry shortly",
                   "shutting_down": "the server is shutting down",
                   "failed": f"the engine failed: {self.failure}"}.get(
                       status, "the server takes no requests now")
        headers = {"Retry-After": "2"} if status == "loading" else None
        return APIError(503, message, type="server_error", code=status, headers=headers)

    def knows_model(self, name: str | None) -> bool:
        if not self.settings.strict_model_names:
            return True
        if name is None or name in DEFAULT_ALIASES or name == self.model_id:
            return True
        path = self.engine.loaded.path if self.engine and self.engine.loaded else None
        return path is not None and name in (path.name, str(path))


async def _first(*waits: Coroutine[Any, Any, object]) -> None:
    """Wait until the first of `waits` returns; the others are cancelled."""
    tasks = {asyncio.ensure_future(w) for w in waits}
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for t in tasks:
            t.cancel()
