"""OpenAI's Responses API (`POST /v1/responses`) over the same engine as the chat routes.

The request's input items become chat-template messages (`schemas.response_items`), after
the conversation of its `previous_response_id` (`response_store`) and under its
`instructions`; tools, the tool choice (a grammar when forced) and the tool-call syntax are
the chat route's (`generation.start_chat`). The answer is a response object whose output is a
message item for the text and a function_call item per call; streamed, it is the event
sequence the official SDK's `client.responses.stream` and Codex read:

    response.created, response.in_progress,
    reasoning:   response.output_item.added, response.reasoning_text.delta...,
                 response.reasoning_text.done, response.output_item.done
    per message: response.output_item.added, response.content_part.added,
                 response.output_text.delta..., response.output_text.done,
                 response.content_part.done, response.output_item.done
    per call:    response.output_item.added, response.function_call_arguments.delta...
                 (as the model writes them), response.function_call_arguments.done,
                 response.output_item.done
    response.completed (or response.incomplete at max_output_tokens; response.failed)

each event named in an `event:` line and carrying its `sequence_number`. While nothing is
generated yet (queued, or a long prefill) the stream repeats response.in_progress every
keepalive interval: Codex drops a stream that sends no event for 300 s.
"""

from __future__ import annotations

import contextlib
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from quart import Response

from slotserve.actors.messages import Delta, Usage
from slotserve.api.errors import APIError, dumps, json_response
from slotserve.api.generation import (
    ChatRun,
    ReplyEvent,
    engine_failure,
    start_chat,
    stream_response,
    tenant,
)
from slotserve.api.reasoning import ReasoningPiece
from slotserve.api.response_store import MAX_RESPONSES
from slotserve.api.schemas import ResponsesRequest
from slotserve.api.sse import with_keepalive
from slotserve.api.state import AppState
from slotserve.api.tool_formats import (
    ArgumentsPiece,
    CallClosed,
    CallOpened,
    TextPiece,
)

PATH = "/v1/responses"


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:24]}"


def usage_of(u: Usage | None) -> dict[str, Any]:
    u = u or Usage()
    return {"input_tokens": u.prompt_tokens,
            "input_tokens_details": {"cached_tokens": u.reused_tokens},
            "output_tokens": u.completion_tokens,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": u.prompt_tokens + u.completion_tokens}


def with_instructions(instructions: str | None,
                      conversation: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The instructions and the conversation's leading system (and developer) messages as
    one system message first, as every chat template takes it; later ones stay in place."""
    lead = 0
    while lead < len(conversation) and conversation[lead]["role"] == "system":
        lead += 1
    texts = [t for t in [instructions, *(m["content"] for m in conversation[:lead])] if t]
    head = [{"role": "system", "content": "\n\n".join(texts)}] if texts else []
    return head + conversation[lead:]


class Output:
    """Text and call events -> output items, and the stream events that build them.

    A message item opens at the first text that is not only whitespace (whitespace before a
    call is dropped); a call closes an open message and is one function_call item.
    """

    def __init__(self) -> None:
        self.items: list[dict[str, Any]] = []
        self.pending = ""
        self._message: int | None = None  # index of the open message item
        self._thinking: int | None = None  # index of the open reasoning item
        self._parts: dict[int, list[str]] = {}
        self.calls = 0

    def feed(self, events: list[ReplyEvent]) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        for e in events:
            if isinstance(e, ReasoningPiece):
                out += self._reasoning(e.text)
                continue
            out += self._close_reasoning()
            if isinstance(e, TextPiece):
                out += self._text(e.text)
            elif isinstance(e, CallOpened):
                out += self._close_message()
                self.pending = ""
                item = {"type": "function_call", "id": _id("fc"), "call_id": e.id,
                        "name": e.name, "arguments": "", "status": "in_progress"}
                self.items.append(item)
                self._parts[len(self.items) - 1] = []
                self.calls += 1
                out.append({"type": "response.output_item.added",
                            "output_index": len(self.items) - 1, "item": dict(item)})
            elif isinstance(e, ArgumentsPiece) and e.text:
                index = len(self.items) - 1
                self._parts[index].append(e.text)
                out.append({"type": "response.function_call_arguments.delta",
                            "item_id": self.items[index]["id"], "output_index": index,
                            "delta": e.text})
            elif isinstance(e, CallClosed):
                index = len(self.items) - 1
                item = self.items[index]
                item.update(arguments="".join(self._parts[index]),
                            status="incomplete" if e.cut else "completed")
                out += [{"type": "response.function_call_arguments.done",
                         "item_id": item["id"], "output_index": index, "name": item["name"],
                         "arguments": item["arguments"]},
                        {"type": "response.output_item.done", "output_index": index,
                         "item": dict(item)}]
        return out

    def _reasoning(self, text: str) -> list[dict[str, Any]]:
        """Reasoning text: one reasoning item (its content the text) before the answer."""
        out: list[dict[str, Any]] = []
        if self._thinking is None:
            out += self._close_message()
            item = {"type": "reasoning", "id": _id("rs"), "summary": [], "content": [],
                    "status": "in_progress"}
            self.items.append(item)
            self._thinking = len(self.items) - 1
            self._parts[self._thinking] = []
            out.append({"type": "response.output_item.added",
                        "output_index": self._thinking, "item": dict(item)})
        index = self._thinking
        self._parts[index].append(text)
        return out + [{"type": "response.reasoning_text.delta",
                       "item_id": self.items[index]["id"], "output_index": index,
                       "content_index": 0, "delta": text}]

    def _close_reasoning(self) -> list[dict[str, Any]]:
        index = self._thinking
        if index is None:
            return []
        self._thinking = None
        item = self.items[index]
        text = "".join(self._parts[index])
        item.update(content=[{"type": "reasoning_text", "text": text}], status="completed")
        return [{"type": "response.reasoning_text.done", "item_id": item["id"],
                 "output_index": index, "content_index": 0, "text": text},
                {"type": "response.output_item.done", "output_index": index,
                 "item": dict(item)}]

    def finish(self) -> list[dict[str, Any]]:
        """End of the reply: close the open item; a reply of no answer item at all (empty,
        or only whitespace) gets one message."""
        out: list[dict[str, Any]] = self._close_reasoning()
        if not any(i["type"] != "reasoning" for i in self.items):
            text, self.pending = self.pending, ""
            out += self._open_message()
            if text:
                out += self._delta(text)
        return out + self._close_message()

    @property
    def text(self) -> str:
        return "".join("".join(self._parts[i]) for i, item in enumerate(self.items)
                       if item["type"] == "message")

    def _text(self, text: str) -> list[dict[str, Any]]:
        if not text:
            return []
        out: list[dict[str, Any]] = []
        if self._message is None:
            self.pending += text
            if not self.pending.strip():
                return []
            text, self.pending = self.pending, ""
            out += self._open_message()
        return out + self._delta(text)

    def _open_message(self) -> list[dict[str, Any]]:
        item = {"type": "message", "id": _id("msg"), "status": "in_progress",
                "role": "assistant", "content": []}
        self.items.append(item)
        index = self._message = len(self.items) - 1
        self._parts[index] = []
        return [{"type": "response.output_item.added", "output_index": index,
                 "item": {**item, "content": []}},
                {"type": "response.content_part.added", "item_id": item["id"],
                 "output_index": index, "content_index": 0,
                 "part": {"type": "output_text", "text": "", "annotations": [],
                          "logprobs": []}}]

    def _delta(self, text: str) -> list[dict[str, Any]]:
        index = self._message
        assert index is not None
        self._parts[index].append(text)
        return [{"type": "response.output_text.delta", "item_id": self.items[index]["id"],
                 "output_index": index, "content_index": 0, "delta": text, "logprobs": []}]

    def _close_message(self) -> list[dict[str, Any]]:
        index = self._message
        if index is None:
            return []
        self._message = None
        item = self.items[index]
        text = "".join(self._parts[index])
        part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
        item.update(content=[part], status="completed")
        return [{"type": "response.output_text.done", "item_id": item["id"],
                 "output_index": index, "content_index": 0, "text": text, "logprobs": []},
                {"type": "response.content_part.done", "item_id": item["id"],
                 "output_index": index, "content_index": 0, "part": dict(part)},
                {"type": "response.output_item.done", "output_index": index,
                 "item": dict(item)}]

    def as_messages(self) -> list[dict[str, Any]]:
        """The output as the chat messages a later turn continues from."""
        message: dict[str, Any] = {"role": "assistant", "content": self.text}
        calls = [{"id": i["call_id"], "type": "function",
                  "function": {"name": i["name"], "arguments": i["arguments"]}}
                 for i in self.items if i["type"] == "function_call"]
        if calls:
            message["tool_calls"] = calls
        return [message]


class Reply:
    """One response being made: its id, its request, the conversation it continues."""

    def __init__(self, state: AppState, req: ResponsesRequest, run: ChatRun,
                 conversation: list[dict[str, Any]]) -> None:
        self.state, self.req, self.run = state, req, run
        self.conversation = conversation
        self.id = _id("resp")
        self.created = int(time.time())
        self.output = Output()
        self.tenant = tenant()

    def body(self, status: str, final: Delta | None = None,
             error: APIError | None = None) -> dict[str, Any]:
        incomplete = ({"reason": "max_output_tokens"} if status == "incomplete" else None)
        return {"id": self.id, "object": "response", "created_at": self.created,
                "status": status, "error": None if error is None else {
                    "code": error.code or "server_error", "message": error.message},
                "incomplete_details": incomplete, "model": self.state.model_id,
                "output": [dict(i) for i in self.output.items] if final is not None else [],
                "usage": usage_of(final.usage) if final is not None else None,
                **self.req.echo}

    def status(self, final: Delta) -> str:
        """`incomplete` at max_output_tokens, unless the reply's calls all closed (a
        reply of tool calls is complete: the agent runs them, as chat's `tool_calls`)."""
        reason = self.run.finish_reason(final, self.output.calls > 0)
        return "incomplete" if reason == "length" else "completed"

    def keep(self) -> None:
        if self.req.store:
            self.state.responses.put(self.tenant, self.id,
                                     self.conversation + self.output.as_messages())


async def create(state: AppState, req: ResponsesRequest) -> Response:
    history: list[dict[str, Any]] = []
    if req.previous_response_id is not None:
        found = state.responses.get(tenant(), req.previous_response_id)
        if found is None:
            raise APIError(400, f"previous response {req.previous_response_id!r} not found: "
                           f"this server keeps the last {MAX_RESPONSES} stored responses in "
                           f"memory while it runs (never those made with store: false); "
                           f"send the whole conversation as input instead",
                           param="previous_response_id", code="previous_response_not_found")
        history = found
    conversation = history + req.items
    run = await start_chat(state, with_instructions(req.instructions, conversation),
                           req.tools, req.tool_choice, req.options,
                           parallel_calls=req.parallel_tool_calls, thinking=req.thinking)
    reply = Reply(state, req, run, conversation)
    if req.stream:
        return stream_response(_events(reply))
    final: Delta | None = None
    parts: list[str] = []
    async with contextlib.aclosing(run.stream) as stream:
        async for d in stream:
            if d.finish_reason is not None:
                final = d
                break
            parts.append(d.text)
    if final is None or final.finish_reason not in ("stop", "length"):
        raise engine_failure(final or Delta(finish_reason="error", error="no result"))
    reply.output.feed(run.events("".join(parts)) + run.finish(final))
    reply.output.finish()
    reply.keep()
    return json_response(reply.body(reply.status(final), final))


def _sse(payload: dict[str, Any]) -> bytes:
    return f"event: {payload['type']}\ndata: ".encode() + dumps(payload).encode() + b"\n\n"


async def _events(reply: Reply) -> AsyncIterator[bytes]:
    seq = 0

    def send(payload: dict[str, Any]) -> bytes:
        nonlocal seq
        payload = {**payload, "sequence_number": seq}
        seq += 1
        return _sse(payload)

    snapshot = reply.body("in_progress")
    yield send({"type": "response.created", "response": snapshot})
    yield send({"type": "response.in_progress", "response": snapshot})
    final: Delta | None = None
    run = reply.run
    async with contextlib.aclosing(with_keepalive(
            run.stream, reply.state.settings.keepalive_interval)) as items:
        async for d in items:
            if d is None:  # a heartbeat clients count (Codex ends a stream idle for 300 s,
                # and SSE comments are no events to it): the response is still in progress
                yield send({"type": "response.in_progress", "response": snapshot})
                continue
            if d.finish_reason is not None:
                final = d
                break
            for ev in reply.output.feed(run.events(d.text)):
                yield send(ev)
    if final is None or final.finish_reason not in ("stop", "length"):
        err = engine_failure(final or Delta(finish_reason="error", error="stream ended early"))
        yield send({"type": "response.failed", "response": reply.body("failed", final, err)})
        return
    for ev in reply.output.feed(run.finish(final)) + reply.output.finish():
        yield send(ev)
    reply.keep()
    status = reply.status(final)
    kind = "response.completed" if status == "completed" else "response.incomplete"
    yield send({"type": kind, "response": reply.body(status, final)})
