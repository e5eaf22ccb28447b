"""Anthropic's Messages API (`POST /v1/messages`) over the same engine as the OpenAI routes.

Requests become the same chat-template messages, tool instructions and engine options as
`/v1/chat/completions`; tool calls are found by the same parser (`slotserve.api.tools`). Answers
are Anthropic-shaped: a message with text / tool_use content blocks, or the SSE event sequence
message_start, content_block_start / _delta / _stop per block, message_delta, message_stop.
Errors, before a stream starts or inside it, are `{"type": "error", "error": {type, message}}`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from typing import Any

from quart import Response

from slotserve.actors.messages import Delta
from slotserve.api.errors import APIError, bad_request, dumps
from slotserve.api.generation import (
    ChatRun,
    ReplyEvent,
    chat_prompt,
    engine_failure,
    engine_source,
    start_chat,
    stream_response,
)
from slotserve.api.reasoning import ReasoningPiece, Thinking, template_options
from slotserve.api.schemas import (
    AnthropicMessage,
    CountTokensBody,
    MessagesBody,
    TextBlock,
    joined,
    validated,
)
from slotserve.api.sse import with_keepalive
from slotserve.api.state import AppState
from slotserve.api.tool_formats import (
    ArgumentsPiece,
    CallClosed,
    CallOpened,
    TextPiece,
    partial_json,
)
from slotserve.api.tools import ToolChoice

PATH = "/v1/messages"
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error",
               403: "permission_error", 404: "not_found_error", 405: "invalid_request_error",
               413: "request_too_large", 429: "rate_limit_error", 500: "api_error",
               503: "overloaded_error", 529: "overloaded_error"}
PING = b'event: ping\ndata: {"type": "ping"}\n\n'


def is_anthropic_path(path: str) -> bool:
    return path == PATH or path.startswith(PATH + "/")


# ---- errors --------------------------------------------------------------------------------


def error_payload(status: int, message: str) -> dict[str, Any]:
    kind = ERROR_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": message}}


def error_response(status: int, message: str, headers: dict[str, str] | None = None) -> Response:
    return Response(dumps(error_payload(status, message)), status=status, headers=headers,
                    content_type="application/json")


def api_error_response(exc: APIError) -> Response:
    """An error raised by the shared request code, in Anthropic's shape and status."""
    return error_response(exc.status, exc.message, exc.headers)


def sse(kind: str, payload: dict[str, Any]) -> bytes:
    return f"event: {kind}\ndata: ".encode() + dumps(payload).encode() + b"\n\n"


# ---- the request ---------------------------------------------------------------------------


@dataclass
class MessagesRequest:
    messages: list[AnthropicMessage]  # validated; converted once the engine is up
    max_tokens: int | None  # None only for count_tokens
    model: str | None = None
    system: str | None = None
    stream: bool = False
    tools: list[dict[str, Any]] | None = None  # OpenAI-shaped, for the shared tool code
    tool_choice: ToolChoice = field(default_factory=ToolChoice)
    options: dict[str, Any] = field(default_factory=dict)
    thinking: Thinking | None = None  # `thinking`, for a template with a reasoning switch
    parallel_calls: bool = True  # tool_choice.disable_parallel_tool_use not set


# Claude Code starts its system prompt with a line that changes on every request
# ("x-anthropic-billing-header: cc_version=...; cch=...;"): it is for Anthropic's billing, says
# nothing to the model, and would make every request's prompt differ from its first tokens, so
# no cached prefix would ever be reused. It is left out of the prompt.
BILLING_HEADER = "x-anthropic-billing-header:"


def system_text(blocks: list[TextBlock]) -> str:
    """The system blocks as one text, without Claude Code's billing-header lines."""
    text = joined(blocks)
    if BILLING_HEADER not in text:
        return text
    return "\n".join(line for line in text.split("\n")
                     if not line.lstrip().startswith(BILLING_HEADER)).strip("\n")


def parse_messages(body: dict[str, Any], count: bool = False) -> MessagesRequest:
    """A request body (see `schemas.MessagesBody`; `CountTokensBody` for count_tokens) ->
    the request; a mistake is a 400."""
    b = validated(CountTokensBody if count else MessagesBody, body)
    tools = b.openai_tools()
    return MessagesRequest(messages=b.messages, max_tokens=b.max_tokens, model=b.model,
                           system=None if b.system is None else system_text(b.system),
                           stream=b.stream, tools=tools, tool_choice=b.tool_choice_for(tools),
                           options=b.options(), thinking=Thinking.anthropic(b.thinking),
                           parallel_calls=not (b.tool_choice is not None
                                               and b.tool_choice.disable_parallel_tool_use))


def chat_messages(req: MessagesRequest) -> tuple[list[dict[str, Any]], str]:
    """Anthropic messages -> chat-template messages, and the assistant prefill (the text of a
    final assistant message, which the reply continues).

    tool_result blocks become `tool` messages; tool_use blocks become `tool_calls` (written
    into the text for a template that does not render those: `generation.chat_prompt`);
    an assistant turn's thinking blocks its reasoning_content.
    """
    out: list[dict[str, Any]] = []
    if req.system:
        out.append({"role": "system", "content": req.system})
    prefill = ""
    last = len(req.messages) - 1
    for i, m in enumerate(req.messages):
        if m.role == "system":  # mid-conversation system: in place
            out.append({"role": "system", "content": system_text(
                [b for b in m.content if b["type"] == "text"])})  # type: ignore[misc]
            continue
        texts: list[str] = []
        calls: list[dict[str, Any]] = []
        thought: list[str] = []  # thinking blocks: the turn's reasoning, for templates keeping it
        for block in m.content:
            if block["type"] == "text":
                texts.append(block["text"])
            elif block["type"] == "thinking" and m.role == "assistant":
                thought.append(block.get("thinking") or "")
            elif block["type"] == "tool_result":
                text = joined(block.get("content", []))
                out.append({"role": "tool", "tool_call_id": block["tool_use_id"],
                            "content": f"Error: {text}" if block.get("is_error") else text})
            elif block["type"] == "tool_use":
                calls.append({"id": block["id"], "type": "function", "function": {
                    "name": block["name"],
                    "arguments": json.dumps(block.get("input", {}), ensure_ascii=False)}})
        text = "".join(texts) if m.role == "assistant" else "\n".join(texts)
        if m.role == "assistant" and i == last and not calls:
            prefill = text
            continue
        if texts or calls or m.role == "assistant":
            msg: dict[str, Any] = {"role": m.role, "content": text}
            if calls:
                msg["tool_calls"] = calls
            if "".join(thought).strip():
                msg["reasoning_content"] = "".join(thought)
            out.append(msg)
    return out, prefill


# ---- the answer ----------------------------------------------------------------------------


def _message_id() -> str:
    return f"msg_{uuid.uuid4().hex[:24]}"


def _tool_use_id(call_id: str) -> str:
    return "toolu_" + call_id.removeprefix("call_")


class Blocks:
    """Generated text and tool calls -> content-block events, shared by both answer modes.

    A text block opens at the first text that is not only whitespace (whitespace before a tool
    call is dropped); a tool call closes any open text block and is one tool_use block.
    """

    def __init__(self) -> None:
        self.index = -1
        self.open = False
        self.kind = ""  # the open block's type
        self.pending = ""
        self.calls = 0

    def text(self, text: str) -> Iterator[tuple[str, dict[str, Any]]]:
        if not text:
            return
        if self.open and self.kind == "thinking":  # the answer follows the reasoning
            yield from self.close()
        if not self.open:
            self.pending += text
            if not self.pending.strip():
                return
            text, self.pending = self.pending, ""
            yield from self._start({"type": "text", "text": ""})
        yield "content_block_delta", {"type": "content_block_delta", "index": self.index,
                                      "delta": {"type": "text_delta", "text": text}}

    def thinking(self, text: str) -> Iterator[tuple[str, dict[str, Any]]]:
        """Reasoning: one thinking block, before the answer's blocks."""
        if not text:
            return
        if not (self.open and self.kind == "thinking"):
            yield from self.close()
            yield from self._start({"type": "thinking", "thinking": "", "signature": ""})
        yield "content_block_delta", {"type": "content_block_delta", "index": self.index,
                                      "delta": {"type": "thinking_delta", "thinking": text}}

    def open_call(self, call: CallOpened) -> Iterator[tuple[str, dict[str, Any]]]:
        """A tool_use block; its input follows as the model writes it (`arguments`)."""
        yield from self.close()
        self.pending = ""
        self.calls += 1
        yield from self._start({"type": "tool_use", "id": _tool_use_id(call.id),
                                "name": call.name, "input": {}})

    def arguments(self, piece: ArgumentsPiece) -> Iterator[tuple[str, dict[str, Any]]]:
        if piece.text:
            yield "content_block_delta", {"type": "content_block_delta", "index": self.index,
                                          "delta": {"type": "input_json_delta",
                                                    "partial_json": piece.text}}

    def finish(self) -> Iterator[tuple[str, dict[str, Any]]]:
        """End: close the open block; a reply with no block at all gets one text block."""
        if self.index < 0:
            yield from self._start({"type": "text", "text": ""})
            if self.pending:
                yield "content_block_delta", {
                    "type": "content_block_delta", "index": self.index,
                    "delta": {"type": "text_delta", "text": self.pending}}
        yield from self.close()

    def close(self) -> Iterator[tuple[str, dict[str, Any]]]:
        if self.open:
            self.open = False
            yield "content_block_stop", {"type": "content_block_stop", "index": self.index}

    def _start(self, block: dict[str, Any]) -> Iterator[tuple[str, dict[str, Any]]]:
        self.index += 1
        self.open = True
        self.kind = block["type"]
        yield "content_block_start", {"type": "content_block_start", "index": self.index,
                                      "content_block": block}


class Answer:
    """One reply being built: block events from deltas, then the stop reason."""

    def __init__(self, run: ChatRun) -> None:
        self.run = run
        self.blocks = Blocks()

    def feed(self, text: str) -> list[tuple[str, dict[str, Any]]]:
        return self._emit(self.run.events(text))

    def finish(self, final: Delta) -> list[tuple[str, dict[str, Any]]]:
        return self._emit(self.run.finish(final)) + list(self.blocks.finish())

    def _emit(self, events: list[ReplyEvent]) -> list[tuple[str, dict[str, Any]]]:
        out: list[tuple[str, dict[str, Any]]] = []
        for e in events:
            if isinstance(e, ReasoningPiece):
                out += self.blocks.thinking(e.text)
            elif isinstance(e, TextPiece):
                out += self.blocks.text(e.text)
            elif isinstance(e, CallOpened):
                out += self.blocks.open_call(e)
            elif isinstance(e, ArgumentsPiece):
                out += self.blocks.arguments(e)
            elif isinstance(e, CallClosed):
                out += self.blocks.close()
        return out

    def stop(self, final: Delta) -> tuple[str, str | None]:
        """(stop_reason, stop_sequence) for a reply that ended with stop or length:
        `tool_use` only when every call closed (one cut by max_tokens is `max_tokens`)."""
        reason = self.run.finish_reason(final, self.blocks.calls > 0)
        if reason == "tool_calls":
            return "tool_use", None
        if reason == "length":
            return "max_tokens", None
        stops = self.run.session.stops
        if stops is not None and stops.matched is not None:
            return "stop_sequence", stops.matched
        return "end_turn", None


def _usage(run: ChatRun, final: Delta | None) -> dict[str, int]:
    """Anthropic's usage: input_tokens are the prompt tokens computed afresh, and
    cache_read_input_tokens those reused from the prefix cache (their sum is the prompt)."""
    done = final.usage.completion_tokens if final is not None and final.usage else 0
    reused = final.usage.reused_tokens if final is not None and final.usage \
        else run.session.reused
    return {"input_tokens": run.prompt_tokens - reused, "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": reused, "output_tokens": done}


async def count_tokens(state: AppState, req: MessagesRequest) -> Response:
    """POST /v1/messages/count_tokens: the prompt's tokens as /v1/messages would render it
    (system, tools and the tool-call syntax included)."""
    engine = state.ready_engine()
    msgs, prefill = chat_messages(req)
    try:
        ids = await asyncio.to_thread(chat_prompt, state, engine, msgs, req.tools, prefill,
                                      template_options(engine_source(engine), req.thinking))
    except ValueError as exc:
        raise bad_request(str(exc), "messages") from None
    return Response(dumps({"input_tokens": len(ids)}), content_type="application/json")


async def messages(state: AppState, req: MessagesRequest) -> Response:
    msgs, prefill = chat_messages(req)
    run = await start_chat(state, msgs, req.tools, req.tool_choice, req.options, prefill,
                           parallel_calls=req.parallel_calls, thinking=req.thinking)
    ids = (_message_id(), state.model_id)
    if req.stream:
        return stream_response(_events(state, run, *ids))
    answer = Answer(run)
    content: list[dict[str, Any]] = []
    final: Delta | None = None
    text_of: dict[int, list[str]] = {}
    async with contextlib.aclosing(run.stream) as stream:
        async for d in stream:
            if d.finish_reason is not None:
                final = d
                break
            _apply(answer.feed(d.text), content, text_of)
    if final is None or final.finish_reason not in ("stop", "length"):
        err = engine_failure(final or Delta(finish_reason="error", error="no result"))
        return error_response(err.status, err.message, err.headers)
    _apply(answer.finish(final), content, text_of)
    reason, sequence = answer.stop(final)
    return Response(dumps({
        "id": ids[0], "type": "message", "role": "assistant", "model": ids[1],
        "content": content, "stop_reason": reason, "stop_sequence": sequence,
        "usage": _usage(run, final)}), content_type="application/json")


def _apply(events: list[tuple[str, dict[str, Any]]], content: list[dict[str, Any]],
           text_of: dict[int, list[str]]) -> None:
    """Fold block events into the non-streaming content list."""
    for kind, ev in events:
        if kind == "content_block_start":
            content.append(dict(ev["content_block"]))
            text_of[ev["index"]] = []
        elif kind == "content_block_delta":
            delta = ev["delta"]
            text_of[ev["index"]].append(delta.get("text", delta.get(
                "partial_json", delta.get("thinking", ""))))
        elif kind == "content_block_stop":
            block, text = content[ev["index"]], "".join(text_of[ev["index"]])
            if block["type"] == "text":
                block["text"] = text
            elif block["type"] == "thinking":
                block["thinking"] = text
            else:  # a call cut by max_tokens: what its written part holds
                block["input"] = partial_json(text) if text else {}


async def _events(state: AppState, run: ChatRun, msg_id: str,
                  model: str) -> AsyncIterator[bytes]:
    answer = Answer(run)
    started = False

    def start() -> bytes:
        """message_start, sent with the first token (or keepalive), once the slot has said
        how much of the prompt it found cached."""
        return sse("message_start", {"type": "message_start", "message": {
            "id": msg_id, "type": "message", "role": "assistant", "model": model,
            "content": [], "stop_reason": None, "stop_sequence": None,
            "usage": {**_usage(run, None), "output_tokens": 0}}})

    final: Delta | None = None
    async with contextlib.aclosing(with_keepalive(run.stream,
                                                  state.settings.keepalive_interval)) as items:
        async for d in items:
            if not started:
                started = True
                yield start()
            if d is None:
                yield PING
                continue
            if d.finish_reason is not None:
                final = d
                break
            for kind, ev in answer.feed(d.text):
                yield sse(kind, ev)
    if not started:
        yield start()
    if final is None or final.finish_reason not in ("stop", "length"):
        err = engine_failure(final or Delta(finish_reason="error", error="stream ended early"))
        yield sse("error", error_payload(err.status, err.message))
        return
    for kind, ev in answer.finish(final):
        yield sse(kind, ev)
    reason, sequence = answer.stop(final)
    usage = _usage(run, final)
    yield sse("message_delta", {"type": "message_delta",
                                "delta": {"stop_reason": reason, "stop_sequence": sequence},
                                "usage": usage})
    yield sse("message_stop", {"type": "message_stop"})
