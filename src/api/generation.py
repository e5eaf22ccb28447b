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
import json
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
from slotserve.api.completion_bodies import LogprobFormatter, ResponseIds
from slotserve.api.disconnect import ClientLink, client_link
from slotserve.api.errors import APIError, bad_request, error_body, json_response
from slotserve.api.gemma4_grammar import gemma4_call_grammar
from slotserve.api.harmony import ANALYSIS as HARMONY_ANALYSIS
from slotserve.api.harmony import END as HARMONY_END
from slotserve.api.harmony import HarmonyParser, harmony_call_grammar, harmony_no_call_grammar
from slotserve.api.limits import chat_texts, refuse_unfit
from slotserve.api.pythonic import PythonicParser, pythonic_call_grammar
from slotserve.api.qwen_xml import QwenXmlParser, qwen_xml_call_grammar
from slotserve.api.reasoning import (
    ReasoningPiece,
    ReasoningSplitter,
    Thinking,
    closed_first,
    prompt_opens_thinking,
    template_options,
)
from slotserve.api.schemas import (
    ChatRequest,
    CompletionRequest,
    check_vocabulary,
    out_of_vocabulary,
)
from slotserve.api.sse import DONE, HEADERS, KEEPALIVE, event, with_keepalive
from slotserve.api.state import AppState
from slotserve.api.tool_formats import (
    GEMMA4,
    HARMONY,
    PYTHONIC,
    QWEN_XML,
    ArgumentsPiece,
    CallEvent,
    CallOpened,
    CallParser,
    CallSyntax,
    TextPiece,
    call_grammar,
    no_call_grammar,
    split_calls,
)
from slotserve.api.tools import ToolChoice, tool_listing, with_system_text
from slotserve.engine import Engine, EngineClosedError
from slotserve.runtime.grammar import Grammar, compile_lark, compile_response_format
from slotserve.runtime.thinking import CLOSE as THINK_CLOSE
from slotserve.runtime.thinking import ThinkingLimit

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
    """An SSE answer. The charset is named: without it a client that decodes by the
    headers (Python requests' iter_lines) reads text/* as ISO-8859-1, and a UTF-8
    continuation byte 0x85 (the second byte of Cyrillic х, of Å) becomes U+0085, a line
    break to str.splitlines, which cuts a data line inside its JSON string."""
    response = Response(body, content_type="text/event-stream; charset=utf-8",
                        headers=HEADERS)
    response.timeout = None  # generation may legitimately take minutes
    return response


# ---- chat ----------------------------------------------------------------------------------


@dataclass
class ChatRun:
    """A chat request admitted to the engine: its deltas, and the parser for its tool calls."""

    engine: Engine
    session: Session
    stream: AsyncGenerator[Delta, None]
    parser: CallParser | QwenXmlParser | PythonicParser | None
    prompt_ids: list[int]
    splitter: ReasoningSplitter | None = None  # for a template that writes <think> blocks
    harmony: HarmonyParser | None = None  # gpt-oss: channels and calls in one parser

    @property
    def prompt_tokens(self) -> int:
        return len(self.prompt_ids)

    def events(self, text: str) -> list[ReplyEvent]:
        """Generated text -> reasoning, text and tool-call events (tool calls are read from
        the answer text, and only when tools are on)."""
        if self.harmony is not None:
            return list(self.harmony.feed(text))
        pieces = self.splitter.feed(text) if self.splitter is not None else [TextPiece(text)]
        return self._calls(pieces)

    def finish(self, final: Delta) -> list[ReplyEvent]:
        """The events of what is still held once the engine's final delta came: a harmony
        message open at a stop (its <|call|> or <|return|> is a stop token, not text) ended
        there, one open at max_tokens was cut."""
        if self.harmony is not None:
            return list(self.harmony.finish(stopped=final.finish_reason == "stop"))
        out = self._calls(self.splitter.finish()) if self.splitter is not None else []
        return out + (self.parser.finish() if self.parser is not None else [])

    @property
    def cut(self) -> bool:
        """Whether the reply ended inside a tool call (read after `finish`)."""
        parser = self.harmony if self.harmony is not None else self.parser
        return parser is not None and parser.cut

    def finish_reason(self, final: Delta, calls: bool) -> str:
        """`tool_calls` for a reply whose calls all closed; the engine's reason (`length`
        at max_tokens) for one with none, or that ended inside a call: a client must not
        run a call whose arguments were cut off."""
        reason = final.finish_reason
        assert reason is not None
        return "tool_calls" if calls and not self.cut else reason

    def _calls(self, pieces: list[TextPiece | ReasoningPiece]) -> list[ReplyEvent]:
        out: list[ReplyEvent] = []
        for p in pieces:
            if isinstance(p, ReasoningPiece) or self.parser is None:
                if p.text:
                    out.append(p)
            else:
                out += self.parser.feed(p.text)
        return out


ReplyEvent = CallEvent | ReasoningPiece


def reasoning_of(events: list[ReplyEvent]) -> str:
    return "".join(e.text for e in events if isinstance(e, ReasoningPiece))


def inline_past_calls(messages: list[dict[str, Any]],
                      syntax: CallSyntax) -> list[dict[str, Any]]:
    """For a template that does not render `tool_calls`: past calls written into the
    assistant's text in the model's own syntax, as it would have written them."""
    out = []
    for m in messages:
        calls = m.get("tool_calls")
        if not calls:
            out.append(m)
            continue
        pairs = []
        for c in calls:
            args = c["function"].get("arguments", "{}")
            pairs.append((c["function"]["name"],
                          args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)))
        m = {k: v for k, v in m.items() if k != "tool_calls"}
        m["content"] = (m.get("content") or "") + syntax.render(pairs)
        out.append(m)
    return out


def engine_source(engine: Engine) -> str | None:
    """The chat template's source (None without one)."""
    return engine.template.source if engine.template is not None else None


def harmony_thinking(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """gpt-oss's template writes a past call's analysis from the message's `thinking` (and
    refuses a call message with both content and thinking): an assistant call message's
    reasoning_content becomes its thinking when it has no content."""
    out = []
    for m in messages:
        reasoning = m.get("reasoning_content")
        if m.get("tool_calls") and reasoning and not m.get("content"):
            m = {**{k: v for k, v in m.items() if k != "reasoning_content"}, "thinking": reasoning}
        out.append(m)
    return out


def chat_prompt(state: AppState, engine: Engine, messages: list[dict[str, Any]],
                tools: list[dict[str, Any]] | None, prefill: str = "",
                template_args: dict[str, Any] | None = None) -> list[int]:
    """The prompt ids of a chat. It depends on the messages and tools only, never on the tool
    choice (see `slotserve.api.tools`); `template_args` are the template's own switches
    (`reasoning.template_options`)."""
    syntax = state.call_syntax
    if syntax is HARMONY:
        messages = harmony_thinking(messages)
    if not state.template_renders_calls:
        messages = inline_past_calls(messages, syntax)
    if tools and not state.template_lists_tools:
        messages = with_system_text(messages, tool_listing(tools, syntax.example()))
    return engine.render_chat(messages, tools, prefill=prefill, **(template_args or {}))


def tool_lark(state: AppState, tools: list[dict[str, Any]] | None, choice: ToolChoice,
              parallel: bool, thinking_open: bool = False, max_tokens: int | None = None,
              budget: int | None = None) -> str | None:
    """The grammar (Lark) that makes the tool choice hold: a forced choice allows only calls
    (of the named tool), "none" forbids the call syntax; "auto" (or no tools) is free (None).
    `thinking_open`: the prompt ends inside a <think> block, which a forced reply closes
    first. gpt-oss may reason before a forced call, for up to a quarter of `max_tokens`
    (the rest is the call's) and no more than the thinking `budget`."""
    if not tools or choice.mode == "auto":
        return None
    syntax = state.call_syntax
    if syntax is HARMONY:
        analysis = min((max_tokens or FORCED_ANALYSIS_TOKENS * 4) // 4, FORCED_ANALYSIS_TOKENS)
        if budget is not None:
            analysis = min(analysis, budget)
        lark = (harmony_call_grammar(tools, choice, state.special_ids, analysis)
                if choice.forced else harmony_no_call_grammar(state.special_ids))
    elif syntax is QWEN_XML and choice.forced:
        lark = qwen_xml_call_grammar(tools, choice.name if choice.mode == "function" else None,
                                     parallel)
    elif syntax in (PYTHONIC, GEMMA4) and choice.forced:
        forcing = pythonic_call_grammar if syntax is PYTHONIC else functools.partial(
            gemma4_call_grammar, specials=state.special_ids)
        try:
            lark = forcing(tools, choice.name if choice.mode == "function" else None, parallel)
        except ValueError as exc:
            raise bad_request(str(exc), "tool_choice", "unsupported_tool_choice") from None
    elif choice.forced:
        if syntax.whole:  # no grammar of its (not JSON) arguments: refused, never unforced
            raise bad_request(f"tool_choice {choice.mode!r} cannot be enforced for this "
                              f"model's tool-call syntax ({syntax.name}); 'auto' and 'none' "
                              f"are supported", "tool_choice", "unsupported_tool_choice")
        lark = call_grammar(syntax, tools, choice, parallel, state.special_ids)
    else:
        lark = no_call_grammar(syntax)
        if lark is None:
            return None
    if thinking_open and choice.forced and syntax is not HARMONY:
        lark = closed_first(lark, state.special_ids)
    return lark


async def compiled_lark(state: AppState, engine: Engine, lark: str) -> Grammar:
    """A tool (or reasoning budget) grammar, compiled off the event loop once and kept:
    agents send the same tools every turn."""
    cached = state.grammars.get(lark)
    if cached is not None:
        state.grammars.move_to_end(lark)
        return cached
    try:
        grammar = await asyncio.to_thread(compile_lark, lark, engine.tokenizer, "tool schema")
    except ValueError as exc:
        raise bad_request(str(exc), "tools", "invalid_tool_schema") from None
    state.grammars[lark] = grammar
    while len(state.grammars) > GRAMMAR_CACHE:
        state.grammars.popitem(last=False)
    return grammar


GRAMMAR_CACHE = 64  # compiled tool grammars kept (agents send the same tools every turn)
# the most gpt-oss may reason before a forced call (a quarter of max_tokens when less)
FORCED_ANALYSIS_TOKENS = 2048


async def start_chat(state: AppState, messages: list[dict[str, Any]],
                     tools: list[dict[str, Any]] | None, choice: ToolChoice,
                     options: dict[str, Any], prefill: str = "",
                     parallel_calls: bool = True, thinking: Thinking | None = None) -> ChatRun:
    """Render (tools listed whatever the choice), compile any grammar, and submit a chat.

    `prefill`: text the assistant's reply starts with (already written; not generated).
    """
    engine = state.ready_engine()
    refuse_if_queue_full(state, engine)
    source = engine_source(engine)
    await refuse_unfit(state, engine, chat_texts(messages, prefill, source), "messages")
    try:  # user text is text: only the template writes control tokens
        ids = await asyncio.to_thread(chat_prompt, state, engine, messages, tools, prefill,
                                      template_options(source, thinking))
    except ValueError as exc:  # TemplateError: the template rejected these messages
        raise bad_request(str(exc), "messages") from None
    thinking_open = state.template_thinks and prompt_opens_thinking(
        engine.tokenizer.decode(ids[-8:]))
    options = clamp_max_tokens(engine, ids, options)
    budget = thinking.budget_tokens if thinking is not None and thinking.enabled else None
    lark = tool_lark(state, tools, choice, parallel_calls, thinking_open,
                     options.get("max_tokens"), budget)
    if lark is not None:
        options = {**options, "response_format": await compiled_lark(state, engine, lark)}
    fmt = options.get("response_format")
    # a forced call closes the reasoning at once, and a JSON response_format leaves no room
    # for any: nothing to budget then
    structured = isinstance(fmt, dict) and fmt.get("type") not in (None, "text")
    thinks = state.template_thinks or state.call_syntax is HARMONY
    if budget is not None and thinks and not structured \
            and not (lark is not None and choice.forced):
        inner = fmt if isinstance(fmt, Grammar) else None
        options = {**options, "response_format": thinking_limit(
            state, engine, budget, thinking_open, inner)}
    options = await compile_grammar(engine, options)
    session = submit(state, engine, ids, options, "messages")
    stream = open_stream(state, engine, session)
    calls = bool(tools) and choice.mode != "none"
    if state.call_syntax is HARMONY:
        return ChatRun(engine, session, stream, None, ids, harmony=HarmonyParser(calls))
    parser: CallParser | QwenXmlParser | PythonicParser | None = None
    if calls and state.call_syntax is QWEN_XML:
        parser = QwenXmlParser(tools)
    elif calls and state.call_syntax is PYTHONIC:
        parser = PythonicParser()
    elif calls:
        parser = CallParser(state.call_syntax)
    splitter = None
    if state.template_thinks:  # the template may have opened the block in the prompt
        splitter = ReasoningSplitter(thinking_open)
    return ChatRun(engine, session, stream, parser, ids, splitter)


def thinking_limit(state: AppState, engine: Engine, budget: int, opened: bool,
                   inner: Grammar | None) -> ThinkingLimit:
    """The row constraint that ends the reasoning after `budget` tokens (Anthropic's
    `thinking.budget_tokens`): a `<think>` block's `</think>` and the blank line forced there,
    as the template writes them (gpt-oss: its analysis message's <|end|>, after which it
    writes its answer's header itself), then the answer (under the tool choice's grammar,
    `inner`, if any)."""
    tok = engine.tokenizer
    if state.call_syntax is HARMONY:
        return ThinkingLimit(budget, [state.special_ids[HARMONY_END]], opened=False,
                             decode=tok.decode, vocab_size=tok.vocab_size, inner=inner,
                             opener=HARMONY_ANALYSIS, closer=HARMONY_END)
    close = tok.encode(f"{THINK_CLOSE}\n\n", add_special=False, parse_special=True)
    return ThinkingLimit(budget, close, opened=opened, decode=tok.decode,
                         vocab_size=tok.vocab_size, inner=inner)


def clamp_max_tokens(engine: Engine, ids: list[int], options: dict[str, Any]) -> dict[str, Any]:
    """`max_tokens` past what the context has room for is cut to fit: agents ask for their
    own model's output limit (Claude Code 32,000 or 64,000); the reply then ends with
    `length` where the context ends, as it would have anyway."""
    room = engine.context_length - len(ids)
    asked = options.get("max_tokens")
    if asked is not None and room >= 1 and asked > room:
        return {**options, "max_tokens": room}
    return options


async def chat(state: AppState, req: ChatRequest) -> Response:
    run = await start_chat(state, req.messages, req.tools, req.tool_choice, req.options,
                           parallel_calls=req.parallel_tool_calls, thinking=req.thinking)
    engine, stream = run.engine, run.stream
    fmt = LogprobFormatter(engine.tokenizer)
    rid = ResponseIds(state.model_id)
    if req.stream:
        return stream_response(_chat_events(state, req, run, fmt, rid))
    text, lps, final = await _collect(stream)
    events = run.events(text) + run.finish(final)
    text, calls = split_calls([e for e in events if not isinstance(e, ReasoningPiece)])
    message: dict[str, Any] = {"role": "assistant", "content": text}
    if reasoning_of(events):
        message["reasoning_content"] = reasoning_of(events)
    if calls:
        message["content"] = text if text.strip() else None
        message["tool_calls"] = [c.to_openai() for c in calls]
    reason = run.finish_reason(final, bool(calls))
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


async def _chat_events(state: AppState, req: ChatRequest, run: ChatRun,
                       fmt: LogprobFormatter, ids: ResponseIds) -> AsyncIterator[bytes]:
    pending: list[TokenLogprob] = []  # logprobs ride on the next chunk that carries text
    n_calls = 0

    def lps() -> list[dict[str, Any]] | None:
        if not req.logprobs:
            return None
        out = fmt.chat(pending, req.top_logprobs)
        pending.clear()
        return out

    def emit(events: list[ReplyEvent]) -> list[bytes]:
        """Text as content chunks (reasoning as reasoning_content chunks); a call's name, then
        its arguments as they were written."""
        nonlocal n_calls
        out = []
        for e in events:
            if isinstance(e, ReasoningPiece):
                out.append(event(ids.chat_chunk({"reasoning_content": e.text})))
            elif isinstance(e, TextPiece) and e.text:
                out.append(event(ids.chat_chunk({"content": e.text}, logprobs=lps())))
            elif isinstance(e, CallOpened):
                n_calls += 1
                out.append(event(ids.chat_chunk({"tool_calls": [{
                    "index": e.index, "id": e.id, "type": "function",
                    "function": {"name": e.name, "arguments": ""}}]})))
            elif isinstance(e, ArgumentsPiece) and e.text:
                out.append(event(ids.chat_chunk({"tool_calls": [{
                    "index": e.index, "function": {"arguments": e.text}}]})))
        return out

    yield event(ids.chat_chunk({"role": "assistant", "content": ""}))
    end: dict[str, Delta] = {}
    async with contextlib.aclosing(_until_final(state, run.stream, pending, end)) as deltas:
        async for d in deltas:
            if d is None:
                yield KEEPALIVE
                continue
            for chunk in emit(run.events(d.text)):
                yield chunk
    final = end.get("final")
    if final is None or final.finish_reason not in ("stop", "length"):
        yield _error_event(final)
        yield DONE
        return
    for chunk in emit(run.finish(final)):
        yield chunk
    reason = run.finish_reason(final, n_calls > 0)
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
    options = await compile_grammar(engine, clamp_max_tokens(engine, ids, req.options))
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
