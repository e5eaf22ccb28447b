"""The in-process engine: load a model, then stream generations from many tasks.

    async with Engine.load(max_slots=8) as engine:
        async for delta in engine.chat([{"role": "user", "content": "Hi"}]):
            print(delta.text, end="")

Inside: one Batcher actor, one Slot actor per KV slot, one Session actor per
request, all on the event loop and talking only through their mailboxes (actors.base);
the Batcher's stepping loop is the one task; MLX runs on a single dedicated thread.
"""

from __future__ import annotations

import asyncio
import itertools
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import anyio
import mlx.core as mx
import psutil
import structlog

from slotserve import settings
from slotserve.actors import state_snapshots
from slotserve.actors.admission import (
    CACHE_SCOPES,
    DEFAULT_RESERVE_TOKENS,
    Admission,
    namespace_for,
)
from slotserve.actors.base import try_tell
from slotserve.actors.batcher import Batcher
from slotserve.actors.kv_cache import KVCache
from slotserve.actors.messages import (
    Assign,
    Delta,
    GenerationRequest,
    Progress,
    StepFailed,
    TokenLogprob,
    Usage,
)
from slotserve.actors.session import Session
from slotserve.actors.slot import Slot
from slotserve.model import parallel
from slotserve.model.chat_template import ChatTemplate
from slotserve.model.families import family as model_family
from slotserve.model.loader import LoadedModel, load, pick_device
from slotserve.runtime.grammar import Grammar, compile_response_format
from slotserve.runtime.mlx_thread import MLXThread
from slotserve.runtime.runner import ModelRunner
from slotserve.runtime.sampling import SamplingParams
from slotserve.runtime.warmup import warm_up

log = structlog.get_logger("slotserve.engine")


class EngineClosedError(RuntimeError):
    """The engine is shutting down and takes no new requests."""


class EngineFailedError(EngineClosedError):
    """The engine's step loop crashed: it takes no requests and must be started afresh."""


@dataclass
class EngineConfig:
    model: str | Path | None = None  # None: the bundled SmolLM2
    device: str = "auto"
    max_slots: int = 8
    max_queue: int = 64
    kv_budget_bytes: int | None = None  # None: default_kv_budget (device- or RAM-sized)
    # tokens per tick, decode rows included (None: default_prefill_budget for the device)
    prefill_budget: int | None = None
    # pages promised to a request beyond its prompt when it is placed (admission grows it
    # page by page after that)
    kv_reserve_tokens: int | None = None  # None: two pages (256 tokens)
    # pages between the recurrent-state snapshots the prefix cache keeps for a model with
    # Gated DeltaNet layers (qwen3_5*): how far back a follow-up turn resumes, at most
    state_snapshot_pages: int = state_snapshots.DEFAULT_INTERVAL
    # for those models: prefill a finished turn's generated tokens again off the critical
    # path (actors.settle), so the next turn resumes past them
    settle_passes: bool = True
    default_max_tokens: int | None = None  # None: up to the context length
    shutdown_deadline: float = 30.0
    # pipeline the decode steps: queue the next step on the lazy tokens of this one
    # (runtime.runner). None: on for a GPU, where Python builds the next graph while the
    # device computes; off for the CPU, whose own kernels run eagerly (nothing to overlap)
    speculate: bool | None = None
    # decode steps through mx.compile (runtime.compiled): the graph traced once per shape,
    # not built by Python every step. None: on for a GPU (it applies to the CUDA kernels'
    # steps only); SLOTSERVE_COMPILE=0 turns it off
    compile_decode: bool | None = None
    # run a few steps of every kind at start-up (runtime.warmup), so the first requests do
    # not wait for kernel compiles. None: on for a GPU (the CPU compiles nothing at run time)
    warm_up: bool | None = None
    # serve even when the start-up probe finds that a CPU step's rows depend on their batch
    # (only the MLX-ops fallback, without the native kernels, can fail it): outputs then
    # differ between alone and batched. Off: such an engine refuses to start.
    allow_batch_variance: bool = False
    # ranks the model is split over (model.parallel; one process each, this one rank 0).
    # None: as many as the launcher started (MLX_WORLD_SIZE / MLX_HOSTFILE), else 1
    tensor_parallel: int | None = None
    # how far prefix reuse (the one prefix cache) reaches: "key" within a request's
    # cache_namespace (the HTTP API key; the in-process default is one namespace), "global"
    # across every request, "none" never across requests. cache_salt splits it further.
    cache_scope: str = "key"


@dataclass
class Completion:
    text: str
    finish_reason: str
    usage: Usage
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    ttft: float | None = None
    error: str | None = None


class BatchVarianceError(RuntimeError):
    """The engine refused to start: its CPU step would not be batch-invariant here."""


GPU_MARGIN = 0.10  # of device memory, kept free for activations and the allocator's cache
GPU_MARGIN_MIN = 4 * 2**30


# default_prefill_budget: a tick's tokens on a CPU and on a GPU
CPU_PREFILL_BUDGET = 256
GPU_PREFILL_BUDGET = 1024


def default_prefill_budget(device: str) -> int:
    """The prefill budget when none is given: 256 tokens a tick on a CPU (each tick's
    decode rows wait for its prefill), 1,024 on a GPU, where the 4-bit matmul needs wide
    chunks. Llama-3-8B shape on an H100 (2026-12-06, one engine each, bench --long): 256
    prefilled a 1k prompt at 5,017 tok/s and a 16k one at 5,130 (its decode at 16k 175
    tok/s); 1,024 at 9,127 and 7,510 (213)."""
    return GPU_PREFILL_BUDGET if device == "gpu" else CPU_PREFILL_BUDGET


def default_kv_budget(device: str = "cpu", info: dict[str, Any] | None = None,
                      cached: int = 0, active: int = 0) -> int:
    """The KV budget when none is given.

    CPU: 30 % of host RAM, at most 16 GiB (the weights and the OS live there too). GPU: the
    device memory still free with the weights loaded (`info` is mx.device_info(); MLX's own
    cache of freed buffers counts as free), less a margin for activations and allocator
    slack: GPU_MARGIN of the device, at least GPU_MARGIN_MIN. Without a free-memory reading
    the total less what MLX holds stands in for it.
    """
    if device == "gpu" and info:
        total = int(info.get("total_memory") or info.get("memory_size") or 0)
        free = info.get("free_memory")
        left = int(free) + cached if free is not None else total - active
        if total > 0:
            return max(left - max(int(total * GPU_MARGIN), GPU_MARGIN_MIN), 2**30)
    return int(min(psutil.virtual_memory().total * 0.3, 16 * 2**30))


def gpu_cache_limit(info: dict[str, Any]) -> int:
    """The most MLX may keep of freed device buffers for reuse on a GPU: half the margin
    default_kv_budget leaves free (7 GiB of an H200's 141).

    Unbounded, MLX's cache keeps a buffer of every size a step frees (a long prompt's
    prefill chunks and decode steps at a growing context free a new size each) up to 95 %
    of the device, and past its memory limit each allocation that misses the cache
    releases cached buffers. On the H200 a 16k-context row then decoded at 6.2-6.7 ms a
    step (the host building steps, the device waiting) after sampled 128-stream batches,
    against 5.0-5.3 ms fresh, and at 5.5 ms after mx.clear_cache(); bounded, it decoded
    at 5.0-5.1 ms in every case, and the cache stays inside the margin with the KV pool at
    its budget."""
    total = int(info.get("total_memory") or info.get("memory_size") or 0)
    return max(int(total * GPU_MARGIN), GPU_MARGIN_MIN) // 2


def _device_memory() -> tuple[dict[str, Any], int, int]:
    """(device info, MLX cache bytes, MLX active bytes): MLX thread only."""
    return dict(mx.device_info()), mx.get_cache_memory(), mx.get_active_memory()


class Engine:
    def __init__(self, config: EngineConfig) -> None:
        if config.cache_scope not in CACHE_SCOPES:
            raise ValueError(f"cache_scope must be one of {', '.join(CACHE_SCOPES)}, "
                             f"not {config.cache_scope!r}")
        self.config = config
        self.mlx: MLXThread | None = None
        self.loaded: LoadedModel | None = None
        self.template: ChatTemplate | None = None
        self.batcher: Batcher | None = None
        self.slots: list[Slot] = []
        self.admission: Admission | None = None
        self.sessions: dict[str, Session] = {}
        self.ready = False
        self.closing = False
        # why the engine failed (its step loop crashed), None while it is healthy; a failed
        # engine takes no requests and is only shut down (see `_supervise`)
        self.failure: str | None = None
        self._failed: anyio.Event | None = None
        self._tg: anyio.abc.TaskGroup | None = None
        self._host_task: asyncio.Task[None] | None = None
        self._ids = itertools.count()
        self.started_at = time.time()
        self.progress: Callable[[int, int], None] | None = None  # load progress callback

    @classmethod
    def load(cls, model: str | Path | None = None, **kwargs: Any) -> Engine:
        """Configure an engine; `async with` loads the model and starts the actors."""
        return cls(EngineConfig(model=model, **kwargs))

    # ---- lifecycle -------------------------------------------------------------

    async def __aenter__(self) -> Engine:
        if self.config.prefill_budget is None:
            self.config = replace(self.config, prefill_budget=default_prefill_budget(
                pick_device(self.config.device)))
        self.mlx = MLXThread()
        try:
            return await self._start()
        except BaseException:
            # what the failed start took is given back (a template refused, a load error):
            # a process that goes on (a test, a supervisor that retries) keeps no idle MLX
            # thread whose OpenMP team would slow the next engine's kernels
            with anyio.CancelScope(shield=True):
                await self._release()
            raise

    async def _start(self) -> Engine:
        cfg = self.config
        prefill_budget = cfg.prefill_budget
        assert prefill_budget is not None
        rows = max(prefill_budget, cfg.max_slots, 256)
        ranks = parallel.launched_size() if cfg.tensor_parallel is None else cfg.tensor_parallel
        if ranks > 1:  # rank 0's part, its forwards sent to the other ranks first
            self.loaded = await self.mlx.run(
                lambda: parallel.load_driver(cfg.model, cfg.device, ranks, rows, self.progress))
        else:
            self.loaded = await self.mlx.run(
                lambda: load(cfg.model, device=cfg.device, probe_rows=rows,
                             progress=self.progress))
        lm = self.loaded
        report = lm.invariance
        if (report is not None and not report.invariant and lm.device == "cpu"
                and not cfg.allow_batch_variance):
            raise BatchVarianceError(
                "batch invariance does not hold on this CPU: " + "; ".join(report.failures)
                + ". Build slotserve's native kernels (a C compiler: `make setup` installs one;"
                " unset SLOTSERVE_NATIVE=0), or pass --allow-batch-variance to serve outputs"
                " that differ between alone and batched.")
        family = model_family(lm.config.family)
        self.template = ChatTemplate.for_tokenizer(lm.tokenizer, family.name,
                                                   family.template_markers)
        speculate = lm.device == "gpu" if cfg.speculate is None else cfg.speculate
        compiled = (lm.device == "gpu" and settings.current().compile
                    if cfg.compile_decode is None else cfg.compile_decode)
        if ranks > 1:  # every rank runs exactly the forwards rank 0 sends, plain
            speculate = compiled = False
        runner = ModelRunner(lm.model, speculate=speculate, compiled=compiled)
        if runner.compiled is not None:
            same = await self.mlx.run(runner.compiled.same_bits)
            log.info("compiled decode steps", on=same,
                     why="same bits as the plain forward" if same
                     else "compiled steps round differently here: plain forward only")
            if not same:
                runner.compiled = None
        if lm.device == "gpu" if cfg.warm_up is None else cfg.warm_up:
            # compile the kernels (and decode traces) steps use now, not on live traffic
            await self.mlx.run(lambda: warm_up(runner, lm.model, cfg.max_slots,
                                                   prefill_budget))
        self.batcher = Batcher(runner, self.mlx, prefill_budget)
        for i in range(cfg.max_slots):
            self.slots.append(Slot(i, lm.model.new_kv(), self.batcher))
        bpt = self.slots[0].kv.bytes_per_position
        if lm.device == "gpu":
            info, _, _ = await self.mlx.run(_device_memory)
            limit = gpu_cache_limit(info)
            await self.mlx.run(lambda: mx.set_cache_limit(limit))
            log.info("allocator cache bounded", cache_limit=limit)
        budget = cfg.kv_budget_bytes
        if not budget:
            info, cached, active = await self.mlx.run(_device_memory)
            budget = default_kv_budget(lm.device, info, cached, active)
        self.admission = Admission(
            self.slots, KVCache(self.slots[0].kv.pool, self.mlx.post), max_queue=cfg.max_queue,
            kv_budget=budget,
            context_length=lm.config.max_position,
            reserve_tokens=DEFAULT_RESERVE_TOKENS if cfg.kv_reserve_tokens is None
            else cfg.kv_reserve_tokens,
            state_interval=cfg.state_snapshot_pages,
            settle_align=getattr(lm.model, "prefill_align", 0) if cfg.settle_passes else 0,
            step_tokens=prefill_budget,
        )
        for slot in self.slots:
            slot.placement = self.admission
            slot.kv.managed = True
        self._stop = anyio.Event()
        self._failed = anyio.Event()
        started = anyio.Event()
        self._host_task = asyncio.get_running_loop().create_task(self._host(started))
        await started.wait()
        self.ready = self.failure is None  # the step loop may have crashed at once
        log.info("engine ready", slots=cfg.max_slots, kv_budget=self.admission.kv_budget,
                 bytes_per_token=bpt, context=lm.config.max_position, device=lm.device)
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.shutdown()

    async def _host(self, started: anyio.Event) -> None:
        """Own the actors' task group in one long-lived task, whoever starts or stops us."""
        assert self.batcher is not None
        async with anyio.create_task_group() as tg:
            self._tg = tg
            tg.start_soon(self._supervise, self.batcher)
            started.set()
            await self._stop.wait()
            tg.cancel_scope.cancel()
        self._tg = None

    async def _supervise(self, batcher: Batcher) -> None:
        """Run the Batcher's stepping loop, the one long-lived actor task; if it ever ends,
        the engine fails.

        Every other actor handles messages in loop callbacks that contain their own errors
        (actors.base), and a step's errors fail only that step's requests (Batcher._step). An
        exception that escapes `Batcher.run` is outside both: a bug in the Batcher's own
        bookkeeping. It is not restarted: a restarted loop would start from offers and
        awaited answers that may be lost or half-updated (slots left waiting for a step that
        will never answer, or answered twice), and from a runner whose pipelined forward may
        refer to KV that no step finished writing. The only state known to be right is a
        fresh process; a model load costs seconds, so the engine fails every request
        (`_fail`), /health says why, and `slotserve serve` exits non-zero for its supervisor
        to start it again.
        """
        try:
            await batcher.run()
        except Exception as exc:
            log.exception("the step loop crashed; the engine takes no more requests")
            self._fail(f"the step loop crashed ({type(exc).__name__}: {exc})")
        else:  # run() loops for ever: returning is as wrong as raising
            log.error("the step loop ended; the engine takes no more requests")
            self._fail("the step loop ended")

    def _fail(self, reason: str) -> None:
        """Mark the engine failed and end every request with an error that says why: the
        queued ones at once, the running ones through their slots (a StepFailed, as for a
        failed step: the slot finishes its request and frees itself)."""
        if self.failure is not None:
            return
        self.failure = reason
        self.ready = False
        self.closing = True  # submit refuses from here on
        error = f"the engine failed: {reason}"
        adm = self.admission
        if adm is not None:
            for w in list(adm.queue):
                adm.queue.remove(w)
                sess = self.sessions.get(w.request.request_id)
                if sess is not None:
                    sess.fail("error", error)
        for s in self.slots:
            if s.busy:  # untold (a full mailbox): that slot's request is failed at shutdown
                try_tell(s, StepFailed(s.epoch, error), "could not fail a slot's request",
                         slot=s.id)
        if self._failed is not None:
            self._failed.set()

    async def wait_failed(self) -> str:
        """Wait until the engine fails (never, if it stays healthy); returns why."""
        assert self._failed is not None, "the engine is not started"
        await self._failed.wait()
        assert self.failure is not None
        return self.failure

    def would_queue_overflow(self) -> bool:
        """Whether a request submitted now would find the queue full (a 429): readable before
        anything costly (rendering, tokenizing, grammar compilation) is done for it."""
        adm = self.admission
        return adm is not None and len(adm.queue) >= adm.max_queue

    def retry_after(self) -> int:
        """Seconds a refused or timed-out client should wait, from the observed finish rate."""
        return self.admission.retry_after() if self.admission is not None else 1

    async def shutdown(self, deadline: float | None = None) -> None:
        """Stop admitting; let in-flight requests finish until the deadline, then end them.

        Each slot is cancelled with `Slot.cancel`, which ends its request even when the
        Cancel cannot be told: one slot that cannot take a message never stops the others'
        shutdown nor the exit, and its client still gets its final delta."""
        if self._tg is None:
            return
        self.closing = True
        self.ready = False
        adm = self.admission
        assert adm is not None
        for w in list(adm.queue):
            adm.queue.remove(w)
            sess = self.sessions.get(w.request.request_id)
            if sess is not None:
                sess.fail("error", "server shutting down")
        adm.settles = None  # no more settle passes; the running ones stop now
        for s in self.slots:
            if s.request is not None and s.request.background:
                s.cancel(s.epoch, "cancelled")
        limit = self.config.shutdown_deadline if deadline is None else deadline
        if self.failure is not None:  # nothing is stepping: waiting would only delay the exit
            limit = 0.0
        with anyio.move_on_after(limit):
            while any(s.busy for s in self.slots):
                await anyio.sleep(0.02)
        for s in self.slots:
            if s.busy:
                s.cancel(s.epoch, "shutdown")
        with anyio.move_on_after(2.0):
            while self.sessions:
                await anyio.sleep(0.02)
        await self._release()

    async def _release(self) -> None:
        """Stop the actors' host task, then close the runner, stop the other ranks and end
        the MLX thread: what a shutdown, or a start that failed part way, leaves behind."""
        if self._host_task is not None:
            self._stop.set()
            await self._host_task
        if self.mlx is not None:
            if self.batcher is not None:
                await self.mlx.run(self.batcher.runner.close)
            if isinstance(self.loaded.model if self.loaded else None, parallel.Driver):
                await self.mlx.run(self.loaded.model.close)  # the other ranks stop
            self.mlx.close()

    # ---- requests --------------------------------------------------------------

    @property
    def tokenizer(self) -> Any:
        assert self.loaded is not None
        return self.loaded.tokenizer

    @property
    def context_length(self) -> int:
        assert self.loaded is not None
        return self.loaded.config.max_position

    def make_request(self, prompt_ids: list[int], *, max_tokens: int | None = None,
                     stop: list[str] | None = None, logprobs: bool = False,
                     top_logprobs: int = 0, ignore_eos: bool = False,
                     response_format: dict[str, Any] | Grammar | None = None,
                     cache_namespace: str | None = None, cache_salt: str | None = None,
                     **sampling: Any) -> GenerationRequest:
        """Validate options and build a request (raises ValueError on bad input).

        `response_format` ({"type": "json_object"} or {"type": "json_schema", "json_schema":
        {"schema": ...}}, or a Grammar compiled beforehand) constrains the output.
        `cache_namespace` (the tenant: the HTTP server passes its API key's id; default one
        namespace for all) and `cache_salt`: the request reuses KV computed for another only
        when both are equal (under `cache_scope` "key"; "global" ignores the namespace,
        "none" reuses nothing).
        """
        namespace = namespace_for(self.config.cache_scope, cache_namespace, cache_salt)
        params = SamplingParams(**sampling)
        params.validate(self.tokenizer.vocab_size)
        if max_tokens is None:
            cap = self.config.default_max_tokens or self.context_length
            max_tokens = max(1, min(cap, self.context_length - len(prompt_ids)))
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {max_tokens}")
        if not prompt_ids:
            raise ValueError("the prompt is empty")
        grammar = response_format if isinstance(response_format, Grammar) \
            else compile_response_format(response_format, self.tokenizer)
        stop_ids = frozenset() if ignore_eos else self.tokenizer.stop_ids
        if grammar is not None:  # a complete grammar allows only its stop tokens: they end it
            stop_ids |= grammar.stop_ids
        return GenerationRequest(
            request_id=f"req-{next(self._ids)}-{uuid.uuid4().hex[:8]}",
            prompt_ids=list(prompt_ids), max_tokens=max_tokens, params=params,
            stop=list(stop or []),
            stop_ids=stop_ids, logprobs=logprobs or top_logprobs > 0,
            top_logprobs=top_logprobs, grammar=grammar, cache_namespace=namespace,
        )

    def submit(self, request: GenerationRequest) -> Session:
        """Admit or queue a request; raises OverloadedError or AdmissionError at once, and
        EngineFailedError (failed) or EngineClosedError (stopping) when it takes none."""
        if self.failure is not None:
            raise EngineFailedError(f"the engine failed: {self.failure}")
        if self.closing or self._tg is None:
            raise EngineClosedError("the engine is shutting down")
        adm = self.admission
        assert adm is not None and self._tg is not None
        session = Session(request, self.tokenizer, on_closed=self._session_closed)

        def place(slot: Slot, reused: int, progress: Progress | None) -> None:
            epoch = slot.reserve()
            session.bind(slot, epoch)
            slot.tell(Assign(request, session, reused, progress))

        # raises before anything is started for this request; a placement that raises
        # fails it through its session (a server error), as a failed step does
        adm.submit(request, place, fail=lambda error: session.fail("error", error))
        if not session.finished:
            self.sessions[request.request_id] = session
        return session

    def _session_closed(self, session: Session) -> None:
        self.sessions.pop(session.request.request_id, None)
        if self.admission is not None:  # queued, or preempted and waiting to resume
            self.admission.withdraw(session.request.request_id)

    def cancel(self, session: Session) -> None:
        """Cancel a request wherever it is (queued or running)."""
        adm = self.admission
        assert adm is not None
        if adm.withdraw(session.request.request_id):  # queued, or preempted and waiting
            session.fail("cancelled", None)
            return
        session.cancel()

    async def generate(self, request: GenerationRequest) -> AsyncIterator[Delta]:
        """Stream a request's Deltas; leaving the loop early cancels the request."""
        session = self.submit(request)
        finished = False
        try:
            async with session.client:
                async for delta in session.client:
                    if delta.finish_reason is not None:
                        finished = True
                    yield delta
                    if finished:
                        return
        finally:
            if not finished:
                self.cancel(session)

    # ---- conveniences ----------------------------------------------------------

    def render_chat(self, messages: list[dict[str, Any]], tools: list[Any] | None = None,
                    *, prefill: str = "", **extra: Any) -> list[int]:
        """Prompt ids of a chat; `prefill` is text the reply starts with (already written).

        User text is text: only the chat template writes control tokens; a "<|im_end|>" in any
        message, tool or prefill is encoded as the characters it spells.
        """
        assert self.template is not None
        tok = self.tokenizer
        rendered = self.template.render_guarded(messages, tools=tools, add_generation_prompt=True,
                                                specials=tok.special_tokens, suffix=prefill,
                                                **extra)
        return tok.encode_template(rendered.text, rendered.holes, add_special=True)

    async def chat(self, messages: list[dict[str, Any]], *, tools: list[Any] | None = None,
                   **options: Any) -> AsyncIterator[Delta]:
        ids = self.render_chat(messages, tools)
        async for d in self.generate(self.make_request(ids, **options)):
            yield d

    async def complete(self, prompt: str | list[int], **options: Any) -> Completion:
        """Generate to the end and return the whole completion.

        A str prompt is text (special-token strings in it are not control tokens); a list of
        token ids is taken as it is, the one way to send control tokens."""
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        return await self.collect(self.generate(self.make_request(ids, **options)))

    async def chat_complete(self, messages: list[dict[str, Any]], **options: Any) -> Completion:
        return await self.collect(self.chat(messages, **options))

    @staticmethod
    async def collect(stream: AsyncIterator[Delta]) -> Completion:
        parts: list[str] = []
        ids: list[int] = []
        lps: list[TokenLogprob] = []
        last = Delta()
        async for d in stream:
            parts.append(d.text)
            ids.extend(d.token_ids)
            lps.extend(d.logprobs)
            last = d
        return Completion("".join(parts), last.finish_reason or "error",
                          last.usage or Usage(), ids, lps, last.ttft, last.error)

    # ---- introspection -----------------------------------------------------------

    def drop_retained(self) -> int:
        """Evict every KV page no running request holds (forces cold prefills); returns the
        bytes freed."""
        return self.admission.drop_idle() if self.admission is not None else 0

    def slot_states(self) -> list[dict[str, Any]]:
        return [
            {"id": s.id, "busy": s.busy, "waiting_for_client": s.waiting_for_client,
             "waiting_for_pages": s.waiting_for_pages, "resident_tokens": len(s.ledger),
             "kv_bytes": s.kv.nbytes, "generated": s.generated,
             "idle_seconds": None if s.busy or not s.last_used
             else round(time.monotonic() - s.last_used, 3)}
            for s in self.slots
        ]

    def kv_summary(self) -> dict[str, Any]:
        """Where the KV budget goes: bytes (used = resident pages, busy = committed to running
        requests), pages by state, and preemptions and evictions by reason; for a model with
        sliding-window layers, their rows (held by running requests, idle)."""
        adm = self.admission
        assert adm is not None
        cache = adm.cache
        pages = {"budget": adm.budget_pages, "resident": cache.resident, "held": cache.held,
                 "idle": len(cache.idle), "shared": cache.shared,
                 "promised": sum(adm.promised.values())}
        summary: dict[str, Any] = {
            "used": adm.used_bytes, "busy": adm.busy_bytes, "budget": adm.kv_budget,
            "queued": len(adm.queue), "running": sum(s.busy for s in self.slots),
            "page_bytes": adm.page_bytes, "pages": pages,
            "preemptions": dict(adm.preemptions), "evictions": dict(cache.evictions)}
        if cache.windows is not None:  # sliding-window layers' rows (kv.Windows)
            summary["window_rows"] = {
                "row_bytes": cache.pool.window_bytes, "floor_pages": adm.floor_pages,
                "held": cache.windows.used - len(cache.idle_windows),
                "idle": len(cache.idle_windows)}
        return summary
