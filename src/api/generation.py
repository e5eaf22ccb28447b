"""Run one chat or completion request on the engine and answer it as JSON or as SSE.

The request is submitted before any response byte is sent, so a full queue or a prompt that
does not fit is a proper 429/400, never a broken stream. What costs nothing to know is checked
first: a full queue is a 429 before the prompt is rendered, tokenized or its grammar compiled.

The request is cancelled (and the engine frees its slot) as soon as the client goes away:
`disconnect.ClientWatch` tells the request's `ClientLink`, whose callback cancels the engine
request in the same tick, whether the handler is still waiting or already streaming. A request
still waiting for a slot after `Settings.queue_timeout` is taken out of the queue and answered
429 with Retry-After (in a stream, an error event).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import weakref
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass
from typing import Any

from quart import Response, g, has_request_context, request

from slotserve.actors.admission import (
    AdmissionError,
    BudgetExceededError,
    ContextOverflowError,
    OverloadedError,
)
from slotserve.actors.messages import Delta, TokenLogprob
from slotserve.actors.session import Session
from slotserve.api.disconnect import ClientLink, client_link
from slotserve.api.errors import APIError, bad_request, error_body, json_response
from slotserve.api.limits import chat_texts, refuse_unfit
from slotserve.api.responses import LogprobFormatter, ResponseIds
from slotserve.api.schemas import (
    ChatRequest,
    CompletionRequest,
    check_vocabulary,
    out_of_vocabulary,
)
from slotserve.api.sse import DONE, HEADERS, KEEPALIVE, event, with_keepalive
from slotserve.api.state import AppState
from slotserve.api.tools import (
    ToolCall,
    ToolCallParser,
    ToolChoice,
    tool_instructions,
    with_system_text,
)
from slotserve.engine import Engine, EngineClosedError
from slotserve.runtime.grammar import Grammar, compile_response_format

# ---- admission -----------------------------------------------------------------------------


def tenant() -> str | None:
    """The cache namespace of this request: the API key it authenticated with (`g.api_key`,
    the key's index, set by the app's auth), None without a configured key (one namespace
    for every caller)."""
    key = g.get("api_key")
    return None if key is None else f"api-key-{key}"


def this_client() -> ClientLink | None:
    """The current request's link to its client (None outside a request, or for an app that
    runs without the ClientWatch middleware)."""
    return client_link(request.scope) if has_request_context() else None


def client_gone() -> APIError:
    """The answer to a request whose client has left. Nobody reads it (ClientWatch drops it):
    its status, nginx's 499, is for the request log."""
    return APIError(499, "the client closed the connection", code="client_closed_request")


def overloaded(state: AppState, retry_after: int, reason: str = "queue full",
               code: str = "queue_full") -> APIError:
    state.metrics.reject(code)
    return APIError(429, f"server overloaded ({reason}); retry after {retry_after} s",
                    type="rate_limit_exceeded", code=code,
                    headers={"Retry-After": str(retry_after)})


def refuse_if_queue_full(state: AppState, engine: Engine) -> None:
    """The 429 of a full queue, known for free: checked before the prompt is rendered,
    tokenized or its grammar compiled, so that an overloaded server refuses cheaply."""
    if engine.would_queue_overflow():
        raise overloaded(state, engine.retry_after())


def submit(state: AppState, engine: Engine, prompt_ids: list[int],
           options: dict[str, Any], param: str) -> Session:
    """Build and admit a request; every refusal becomes the matching HTTP error.

    The request reuses KV only of requests with its API key (and `cache_salt`), under the
    engine's cache_scope."""
    link = this_client()
    if link is not None and link.gone:  # left while the prompt was prepared: run nothing
        raise client_gone()
    options = {**options, "cache_namespace": tenant()}
    ctx = engine.context_length
    if len(prompt_ids) >= ctx:
        state.metrics.reject("context_length_exceeded")
        raise APIError(400, f"the prompt is {len(prompt_ids)} tokens, but the model's context "
                       f"length is {ctx} tokens", param=param, code="context_length_exceeded")
    check_vocabulary(options, engine.tokenizer.vocab_size)
    try:
        request = engine.make_request(prompt_ids, **options)
    except ValueError as exc:  # the request models checked the options: a prompt of no tokens
        raise bad_request(str(exc)) from None
    try:
        return engine.submit(request)
    except OverloadedError as exc:
        raise overloaded(state, exc.retry_after) from None
    except ContextOverflowError as exc:
        state.metrics.reject("context_length_exceeded")
        raise APIError(400, str(exc), param="max_tokens",
                       code="context_length_exceeded") from None
    except BudgetExceededError as exc:
        state.metrics.reject("kv_budget_exceeded")
        raise APIError(400, str(exc), param="max_tokens", code="kv_budget_exceeded") from None
    except AdmissionError as exc:
        raise bad_request(str(exc)) from None
    except EngineClosedError:  # stopping, or failed since the request came in
        state.metrics.reject(state.status)
        raise state.unavailable() from None


async def compile_grammar(engine: Engine, options: dict[str, Any]) -> dict[str, Any]:
    """Compile a `response_format` off the event loop (the first one also builds the grammar
    tokenizer, a fraction of a second); a schema that cannot be honoured is a 400."""
    fmt = options.get("response_format")
    if fmt is None or isinstance(fmt, Grammar):
        return options
    try:
        grammar = await asyncio.to_thread(compile_response_format, fmt, engine.tokenizer)
    except ValueError as exc:
        raise bad_request(str(exc), "response_format", "invalid_response_format") from None
    return {**options, "response_format": grammar}


@dataclass
class Ended(Delta):
    """A final delta the API wrote in place of the engine's: the request ended for a reason of
    the API's own (its wait in the queue ran out), answered as `failure`."""

    failure: APIError | None = None


class QueueDeadline:
    """Ends a request that is still queued (no slot yet) after `seconds`: it is withdrawn
    from the queue, and its final delta becomes a 429 with Retry-After. A request that has
    started (or was preempted after starting) is never timed out."""

    def __init__(self, state: AppState, engine: Engine, session: Session,
                 seconds: float) -> None:
        self.state, self.engine, self.session = state, engine, session
        self.seconds = seconds
        self.expired = False
        self.retry_after = 1
        self._timer = asyncio.get_running_loop().call_later(seconds, self._expire)

    def _expire(self) -> None:
        if self.session.slot is not None or self.session.finished:
            return
        self.expired = True
        self.retry_after = self.engine.retry_after()
        self.engine.cancel(self.session)  # out of the queue; its final delta says cancelled

    def ended(self, final: Delta) -> Ended:
        failure = overloaded(self.state, self.retry_after,
                             f"no slot within the queue timeout of {self.seconds:g} s",
                             code="queue_timeout")
        return Ended(finish_reason="error", error=failure.message, usage=final.usage,
                     failure=failure)

    def cancel(self) -> None:
        self._timer.cancel()


async def deltas(engine: Engine, session: Session,
                 deadline: QueueDeadline | None = None) -> AsyncGenerator[Delta, None]:
    """The session's deltas up to the final one; closing early cancels the request."""
    finished = False
    try:
        async with session.client:
            async for d in session.client:
                finished = d.finish_reason is not None
                if finished and deadline is not None and deadline.expired:
                    d = deadline.ended(d)
                yield d
                if finished:
                    return
        finished = True
        yield Delta(finish_reason="error", error="the request ended without a result")
    finally:
        if deadline is not None:
            deadline.cancel()
        if not finished:
            engine.cancel(session)


def open_stream(state: AppState, engine: Engine,
                session: Session) -> AsyncGenerator[Delta, None]:
    """The request's deltas, metered. The request is cancelled when its client goes away
    (at once, see ClientLink), when the stream is closed early, and when it is dropped unread
    (client gone before the body started), so its slot is never left waiting for a reader."""
    timeout = state.settings.queue_timeout
    deadline = None
    if timeout is not None and session.slot is None and not session.finished:
        deadline = QueueDeadline(state, engine, session, timeout)
    stream = state.metrics.observe(deltas(engine, session, deadline))
    guard = weakref.finalize(stream, engine.cancel, session)  # a no-op once it has finished
    guard.atexit = False
    link = this_client()
    if link is not None:
        link.on_gone(functools.partial(engine.cancel, session))
    return stream


# How the engine words the errors that are not a server fault: a grammar its matcher could not
# follow (the slot's "constrained decoding failed: ..."), and a failed engine (Engine._fail).
GRAMMAR_FAILED = "constrained decoding failed"
ENGINE_FAILED = "the engine failed"


def engine_failure(final: Delta) -> APIError:
    """The HTTP error for a request that ended without a result (neither stop nor length)."""
    if isinstance(final, Ended) and final.failure is not None:
        return final.failure
    if final.finish_reason == "cancelled":  # only a client that left cancels over HTTP
        return client_gone()
    message = final.error or f"generation ended: {final.finish_reason}"
    if message.startswith(GRAMMAR_FAILED):  # the caller's schema, not a server fault
        return APIError(400, message, param="response_format", code="response_format_failed")
    if message.startswith(ENGINE_FAILED):
        return APIError(503, message, type="server_error", code="failed")
    if "shutting down" in message:
        return APIError(503, message, type="server_error", code="shutting_down")
    return APIError(500, message, type="server_error", code="generation_failed")


def stream_response(body: AsyncIterator[bytes]) -> Response:
    response = Response(body, content_type="text/event-stream", headers=HEADERS)
    response.timeout = None  # generation may legitimately take minutes
    return response


# ---- chat ----------------------------------------------------------------------------------


@dataclass
class ChatRun:
    """A chat request admitted to the engine: its deltas, and the parser for its tool calls."""

    engine: Engine
    session: Session
    stream: AsyncGenerator[Delta, None]
    parser: ToolCallParser | None
    prompt_tokens: int


async def start_chat(state: AppState, messages: list[dict[str, Any]],
                     tools: list[dict[str, Any]] | None, choice: ToolChoice,
                     options: dict[str, Any], prefill: str = "") -> ChatRun:
    """Render (tool instructions included), compile any grammar, and submit a chat request.

    `prefill`: text the assistant's reply starts with (already written; not generated).
    """
    engine = state.ready_engine()
    refuse_if_queue_full(state, engine)
    source = engine.template.source if engine.template is not None else None
    await refuse_unfit(state, engine, chat_texts(messages, prefill, source), "messages")
    tools = tools if choice.mode != "none" else None
    if tools and choice.mode == "function":
        tools = [t for t in tools if t["function"]["name"] == choice.name]
    if tools:
        note = tool_instructions(tools, choice, state.template_lists_tools)
        if note:
            messages = with_system_text(messages, note)

    try:  # user text is text: only the template writes control tokens
        ids = await asyncio.to_thread(engine.render_chat, messages, tools, prefill=prefill)
    except ValueError as exc:  # TemplateError: the template rejected these messages
        raise bad_request(str(exc), "messages") from None
    options = await compile_grammar(engine, options)
    session = submit(state, engine, ids, options, "messages")
    stream = open_stream(state, engine, session)
    return ChatRun(engine, session, stream, ToolCallParser(choice) if tools else None, len(ids))


async def chat(state: AppState, req: ChatRequest) -> Response:
    run = await start_chat(state, req.messages, req.tools, req.tool_choice, req.options)
    engine, stream, parser = run.engine, run.stream, run.parser
    fmt = LogprobFormatter(engine.tokenizer)
    rid = ResponseIds(state.model_id)
    if req.stream:
        return stream_response(_chat_events(state, req, stream, fmt, rid, parser))
    text, lps, final = await _collect(stream)
    calls: list[ToolCall] = []
    if parser is not None:
        a, calls = parser.feed(text)
        b, more = parser.finish()
        text, calls = a + b, calls + more
    message: dict[str, Any] = {"role": "assistant", "content": text}
    reason = final.finish_reason
    if calls:
        message["content"] = text if text.strip() else None
        message["tool_calls"] = [c.to_openai() for c in calls]
        reason = "tool_calls"
    choice_obj = {"index": 0, "message": message, "finish_reason": reason,
                  "logprobs": {"content": fmt.chat(lps, req.top_logprobs)}
                  if req.logprobs else None}
    return json_response(rid.chat(choice_obj, final.usage))


async def _collect(stream: AsyncGenerator[Delta, None]) -> tuple[str, list[TokenLogprob], Delta]:
    parts: list[str] = []
    lps: list[TokenLogprob] = []
    final = Delta(finish_reason="error", error="no result")
    async with contextlib.aclosing(stream):
        async for d in stream:
            parts.append(d.text)
            lps.extend(d.logprobs)
            if d.finish_reason is not None:
                final = d
    if final.finish_reason not in ("stop", "length"):
        raise engine_failure(final)
    return "".join(parts), lps, final


async def _chat_events(state: AppState, req: ChatRequest, stream: AsyncGenerator[Delta, None],
                       fmt: LogprobFormatter, ids: ResponseIds,
                       parser: ToolCallParser | None) -> AsyncIterator[bytes]:
    pending: list[TokenLogprob] = []  # logprobs ride on the next chunk that carries text
    n_calls = 0

    def lps() -> list[dict[str, Any]] | None:
        if not req.logprobs:
            return None
        out = fmt.chat(pending, req.top_logprobs)
        pending.clear()
        return out

    def emit(text: str, calls: list[ToolCall]) -> list[bytes]:
        nonlocal n_calls
        out = [event(ids.chat_chunk({"content": text}, logprobs=lps()))] if text else []
        for call in calls:
            head = {"index": n_calls, "id": call.id, "type": "function",
                    "function": {"name": call.name, "arguments": ""}}
            args = {"index": n_calls, "function": {"arguments": call.arguments}}
            out += [event(ids.chat_chunk({"tool_calls": [head]})),
                    event(ids.chat_chunk({"tool_calls": [args]}))]
            n_calls += 1
        return out

    yield event(ids.chat_chunk({"role": "assistant", "content": ""}))
    end: dict[str, Delta] = {}
    async with contextlib.aclosing(_until_final(state, stream, pending, end)) as deltas:
        async for d in deltas:
            if d is None:
                yield KEEPALIVE
                continue
            text, calls = parser.feed(d.text) if parser else (d.text, [])
            for chunk in emit(text, calls):
                yield chunk
    final = end.get("final")
    if final is None or final.finish_reason not in ("stop", "length"):
        yield _error_event(final)
        yield DONE
        return
    if parser is not None:
        for chunk in emit(*parser.finish()):
            yield chunk
    reason = "tool_calls" if n_calls else final.finish_reason
    yield event(ids.chat_chunk({}, finish_reason=reason, logprobs=lps()))
    if req.include_usage:
        yield event(ids.usage_chunk(final.usage, "chat.completion.chunk"))
    yield DONE


async def _until_final(state: AppState, stream: AsyncGenerator[Delta, None],
                       pending: list[TokenLogprob],
                       end: dict[str, Delta]) -> AsyncIterator[Delta | None]:
    """Text deltas of a stream (None for a keepalive tick), its logprobs gathered in
    `pending`; the final delta (finish reason, usage) is left in end["final"]."""
    async with contextlib.aclosing(with_keepalive(stream, state.settings.keepalive_interval)) \
            as items:
        async for d in items:
            if d is None:
                yield None
                continue
            pending.extend(d.logprobs)
            if d.finish_reason is not None:
                end["final"] = d
                return
            yield d


def _error_event(final: Delta | None) -> bytes:
    err = engine_failure(final or Delta(finish_reason="error", error="stream ended early"))
    return event(error_body(err.message, type=err.type, param=err.param, code=err.code))


# ---- completions ---------------------------------------------------------------------------


async def completion(state: AppState, req: CompletionRequest) -> Response:
    engine = state.ready_engine()
    refuse_if_queue_full(state, engine)
    tok = engine.tokenizer
    await refuse_unfit(state, engine, req.prompt, "prompt")
    if isinstance(req.prompt, str):  # text; token ids are the way to send control tokens
        ids = await asyncio.to_thread(tok.encode, req.prompt)
    else:
        bad = next((t for t in req.prompt if not 0 <= t < tok.vocab_size), None)
        if bad is not None:
            raise out_of_vocabulary("prompt", bad, tok.vocab_size)
        ids = list(req.prompt)
    options = await compile_grammar(engine, req.options)
    session = submit(state, engine, ids, options, "prompt")
    stream = open_stream(state, engine, session)
    fmt = LogprobFormatter(tok)
    rid = ResponseIds(state.model_id, prefix="cmpl")
    top = req.logprobs
    if req.stream:
        return stream_response(_completion_events(state, req, stream, fmt, rid))
    text, lps, final = await _collect(stream)
    choice = {"index": 0, "text": text, "finish_reason": final.finish_reason,
              "logprobs": None if top is None else fmt.completion(lps, top, 0)}
    return json_response(rid.completion(choice, final.usage))


async def _completion_events(state: AppState, req: CompletionRequest,
                             stream: AsyncGenerator[Delta, None], fmt: LogprobFormatter,
                             rid: ResponseIds) -> AsyncIterator[bytes]:
    offset = 0
    pending: list[TokenLogprob] = []
    top = req.logprobs

    def chunk(text: str, reason: str | None = None) -> bytes:
        nonlocal offset
        lp = None
        if top is not None:
            lp = fmt.completion(pending, top, offset)
            pending.clear()
        offset += len(text)
        return event(rid.completion_chunk(text, reason, lp))

    end: dict[str, Delta] = {}
    async with contextlib.aclosing(_until_final(state, stream, pending, end)) as deltas:
        async for d in deltas:
            if d is None:
                yield KEEPALIVE
            elif d.text:
                yield chunk(d.text)
    final = end.get("final")
    if final is None or final.finish_reason not in ("stop", "length"):
        yield _error_event(final)
        yield DONE
        return
    yield chunk("", final.finish_reason)
    if req.include_usage:
        yield event(rid.usage_chunk(final.usage, "text_completion"))
    yield DONE
