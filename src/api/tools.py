"""Tool calling: prompt instructions in, OpenAI `tool_calls` out.

Models write calls as Hermes/Qwen `<tool_call>{json}</tool_call>` blocks; when a call is forced
(tool_choice "required" or a named function) small models often write a bare JSON object
instead, so that is accepted too. Streaming and non-streaming share one parser, so both give the
same calls and the same content for the same generated text.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_FENCE = re.compile(r"^```[a-zA-Z]*\s*|\s*```$")


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass(frozen=True)
class ToolChoice:
    mode: str = "none"  # "none" | "auto" | "required" | "function"
    name: str | None = None

    @property
    def forced(self) -> bool:
        return self.mode in ("required", "function")


@dataclass
class ToolCall:
    name: str
    arguments: str  # a JSON text, as OpenAI sends it
    id: str = field(default_factory=new_call_id)

    def to_openai(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


# ---- prompt side -----------------------------------------------------------------------


def tool_instructions(tools: list[dict[str, Any]], choice: ToolChoice,
                      template_lists_tools: bool) -> str | None:
    """System text for what the chat template cannot say itself (tool list, forcing)."""
    parts: list[str] = []
    if not template_lists_tools:
        listing = "\n".join(json.dumps(t.get("function", t), ensure_ascii=False) for t in tools)
        parts.append(
            f"You can call these functions:\n{listing}\n\nTo call a function, reply with "
            f'{OPEN}{{"name": <function name>, "arguments": <JSON object>}}{CLOSE}'
        )
    if choice.mode == "required":
        parts.append("You must call one or more of the functions now; reply only with tool calls.")
    elif choice.mode == "function":
        parts.append(f"You must call the function {choice.name!r} now; reply only with the "
                     f"tool call.")
    return "\n\n".join(parts) or None


def with_system_text(messages: list[dict[str, Any]], text: str) -> list[dict[str, Any]]:
    """Append `text` to the leading system message, or add one."""
    if messages and messages[0].get("role") == "system":
        first = dict(messages[0])
        content = first.get("content")
        if isinstance(content, list):
            first["content"] = [*content, {"type": "text", "text": text}]
        else:
            first["content"] = f"{content}\n\n{text}" if content else text
        return [first, *messages[1:]]
    return [{"role": "system", "content": text}, *messages]


# ---- output side -----------------------------------------------------------------------


def call_from_json(text: str, default_name: str | None = None) -> list[ToolCall] | None:
    """Calls from one JSON value (an object or a list of objects); None if it is not one."""
    text = _FENCE.sub("", text.strip())
    try:
        value = json.loads(text)
    except (ValueError, RecursionError):
        return None
    items = value if isinstance(value, list) else [value]
    calls = [_call(v, default_name) for v in items]
    if not calls or any(c is None for c in calls):
        return None
    return [c for c in calls if c is not None]


def _call(obj: Any, default_name: str | None) -> ToolCall | None:
    if not isinstance(obj, dict):
        return None
    if isinstance(obj.get("function"), dict):  # already OpenAI-shaped
        obj = obj["function"]
    name = obj.get("name")
    args = obj.get("arguments", obj.get("parameters"))
    if not isinstance(name, str) or not name:
        if default_name is None:
            return None
        name, args = default_name, obj if args is None else args  # the object is the arguments
    if args is None:
        args = {}
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    try:
        return ToolCall(name, json.dumps(args, ensure_ascii=False, allow_nan=False))
    except ValueError:  # NaN or 1e400 (json.loads takes both): no JSON a client can parse
        return None


def _opener_prefix(buf: str) -> int:
    """Length of the longest suffix of buf that could still grow into OPEN."""
    for k in range(min(len(OPEN) - 1, len(buf)), 0, -1):
        if buf.endswith(OPEN[:k]):
            return k
    return 0


class ToolCallParser:
    """Feed generated text; get back text safe to show and completed tool calls.

    Text flows through until `<tool_call>` appears; the call is held until `</tool_call>`.
    When a call is forced and the reply starts like JSON, everything is held to the end and
    parsed as a bare call.
    """

    def __init__(self, choice: ToolChoice) -> None:
        self.choice = choice
        self.buf = ""
        self.state = "start" if choice.forced else "text"  # start | text | call | json
        self.calls = 0

    def feed(self, text: str) -> tuple[str, list[ToolCall]]:
        self.buf += text
        out: list[str] = []
        calls: list[ToolCall] = []
        while True:
            if self.state == "start":
                head = self.buf.lstrip()
                if not head:
                    break
                self.state = "json" if head[0] in "{[`" else "text"
            elif self.state == "json":
                break
            elif self.state == "text":
                i = self.buf.find(OPEN)
                if i < 0:
                    keep = _opener_prefix(self.buf)
                    out.append(self.buf[: len(self.buf) - keep])
                    self.buf = self.buf[len(self.buf) - keep:]
                    break
                out.append(self.buf[:i])
                self.buf, self.state = self.buf[i + len(OPEN):], "call"
            else:  # inside <tool_call>
                j = self.buf.find(CLOSE)
                if j < 0:
                    break
                body, self.buf, self.state = self.buf[:j], self.buf[j + len(CLOSE):], "text"
                parsed = call_from_json(body, self._default_name)
                if parsed is None:
                    out.append(OPEN + body + CLOSE)
                else:
                    calls.extend(parsed)
        self.calls += len(calls)
        return "".join(out), calls

    def finish(self) -> tuple[str, list[ToolCall]]:
        """End of generation: an unclosed call or a held bare-JSON reply is parsed now."""
        buf, state = self.buf, self.state
        self.buf, self.state = "", "text"
        parsed: list[ToolCall] | None = None
        if state == "call":
            parsed = call_from_json(buf, self._default_name)
            text = "" if parsed else OPEN + buf
        elif state == "json":
            parsed = call_from_json(buf, self._default_name)
            if parsed is None:  # JSON followed by more calls or text: try the Hermes parse
                self.state = "text"
                text, calls = self.feed(buf)
                tail, more = self.finish()
                return text + tail, calls + more
            text = ""
        else:
            text = buf
        calls = parsed or []
        self.calls += len(calls)
        return text, calls

    @property
    def _default_name(self) -> str | None:
        return self.choice.name if self.choice.mode == "function" else None


def parse_tool_calls(text: str, choice: ToolChoice) -> tuple[str, list[ToolCall]]:
    """The whole reply at once: (content text, calls), exactly as streaming would give."""
    parser = ToolCallParser(choice)
    a, calls = parser.feed(text)
    b, more = parser.finish()
    return a + b, calls + more
