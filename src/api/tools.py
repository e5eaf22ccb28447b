"""Tool calling's shared parts: the tool choice, a call, and what the prompt says of the tools.

The prompt depends on the tools only, never on `tool_choice`: a forced call is made by the
grammar (`tool_formats.call_grammar`), not by an instruction, so an agent that changes its tool
choice between turns keeps its cached prompt prefix. A template that lists tools itself gets
them as they are; for one that does not (`tool_listing`), the tools and the call syntax are
described in the system message. How calls are written and read per family is
`slotserve.api.tool_formats`.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any


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


def tool_listing(tools: list[dict[str, Any]], example: str) -> str:
    """System text listing the tools, for a chat template that does not list them itself;
    `example` is a call in the model's syntax."""
    listing = "\n".join(json.dumps(t.get("function", t), ensure_ascii=False) for t in tools)
    return (f"You can call these functions:\n{listing}\n\nTo call a function, reply with "
            f"{example}")


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
