"""Reasoning text of thinking models, kept apart from the answer.

Models whose chat template uses `<think>` (Qwen3, DeepSeek R1, QwQ...) write their reasoning
between `<think>` and `</think>` at the start of the reply, or the template opens the block
itself at the end of the prompt. `ReasoningSplitter` turns the reply into `ReasoningPiece`s
and `TextPiece`s as it streams (a marker split over deltas is held until it is whole); the
surfaces send reasoning as `reasoning_content` (chat), a reasoning item (Responses) and a
`thinking` block (Anthropic), never inside the answer text. Tool calls are read from the
answer text only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import structlog

from slotserve.api.tool_formats import TextPiece

log = structlog.get_logger("slotserve.api")

OPEN, CLOSE = "<think>", "</think>"


@dataclass(frozen=True)
class ReasoningPiece:
    text: str


def template_thinks(source: str | None) -> bool:
    """Whether a chat template writes reasoning blocks."""
    return bool(source) and CLOSE in (source or "")


def prompt_opens_thinking(prompt_tail: str) -> bool:
    """Whether the prompt (its last characters) ends inside an open `<think>` block."""
    tail = prompt_tail.rstrip()
    return tail.endswith(OPEN)


def closed_first(lark: str, specials: dict[str, int]) -> str:
    """A forced call's grammar for a prompt that ends inside an open `<think>` block (Qwen3.5's
    template opens one): the block is closed at once, then the calls, so that they are read as
    the answer, not as reasoning (and a short max_tokens is not spent reasoning)."""
    first, _, rest = lark.partition("\n")
    assert first.startswith("start:"), first
    close = f"<[{specials[CLOSE]}]>" if CLOSE in specials else '"</think>"'
    return f'start: {close} "\\n\\n" calls\ncalls:{first[len("start:"):]}\n{rest}'


def _held(buf: str, marker: str) -> int:
    for k in range(min(len(marker) - 1, len(buf)), 0, -1):
        if buf.endswith(marker[:k]):
            return k
    return 0


class ReasoningSplitter:
    """Reply text in; reasoning and answer pieces out, in order."""

    def __init__(self, inside: bool = False) -> None:
        # start | lead | reasoning | gap | text
        self.state = "lead" if inside else "start"
        self.buf = ""

    def feed(self, text: str) -> list[TextPiece | ReasoningPiece]:
        self.buf += text
        out: list[TextPiece | ReasoningPiece] = []
        while True:
            if self.state == "start":
                head = self.buf.lstrip()
                if not head:
                    return out
                if head.startswith(OPEN):
                    self.buf, self.state = head[len(OPEN):], "lead"
                    continue
                if OPEN.startswith(head):
                    return out  # may still be the opener
                self.state = "text"
                continue
            if self.state == "lead":  # the newline after <think>
                self.buf = self.buf.lstrip("\n")
                if not self.buf:
                    return out
                self.state = "reasoning"
                continue
            if self.state == "reasoning":
                i = self.buf.find(CLOSE)
                if i < 0:
                    keep = _held(self.buf, CLOSE)
                    if len(self.buf) > keep:
                        out.append(ReasoningPiece(self.buf[:len(self.buf) - keep]))
                        self.buf = self.buf[len(self.buf) - keep:]
                    return out
                if i:
                    out.append(ReasoningPiece(self.buf[:i]))
                self.buf, self.state = self.buf[i + len(CLOSE):], "gap"
                continue
            if self.state == "gap":  # the newlines between the block and the answer
                self.buf = self.buf.lstrip("\n")
                if not self.buf:
                    return out
                self.state = "text"
                continue
            if self.buf:
                out.append(TextPiece(self.buf))
                self.buf = ""
            return out

    def finish(self) -> list[TextPiece | ReasoningPiece]:
        buf, self.buf = self.buf, ""
        if not buf or self.state == "gap":
            return []
        inside = self.state in ("lead", "reasoning")
        return [ReasoningPiece(buf) if inside else TextPiece(buf)]


# ---- how much to think -------------------------------------------------------------------

EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh")
# gpt-oss's template knows three levels ("Reasoning: low" in its system message)
_HARMONY_EFFORT = {"none": "low", "minimal": "low", "low": "low", "medium": "medium",
                   "high": "high", "xhigh": "high"}


@dataclass(frozen=True)
class Thinking:
    """What a request asks of the model's reasoning: OpenAI's `reasoning_effort` (chat) or
    `reasoning.effort` (Responses), Anthropic's `thinking` ({type: enabled, budget_tokens} /
    disabled / adaptive)."""

    effort: str | None = None
    enabled: bool | None = None  # Anthropic: enabled / disabled (adaptive: None)
    budget_tokens: int | None = None

    @classmethod
    def anthropic(cls, thinking: Any) -> Thinking | None:
        if not isinstance(thinking, dict):
            return None
        kind = thinking.get("type")
        budget = thinking.get("budget_tokens")
        budget = budget if isinstance(budget, int) and not isinstance(budget, bool) else None
        if kind == "enabled":
            return cls(enabled=True, budget_tokens=budget)
        if kind == "disabled":
            return cls(enabled=False)
        return None  # adaptive: the model's own default

    @classmethod
    def openai(cls, effort: Any) -> Thinking | None:
        return cls(effort=effort) if isinstance(effort, str) and effort in EFFORTS else None


def template_options(source: str | None, thinking: Thinking | None) -> dict[str, Any]:
    """The chat template's own reasoning switches for `thinking`: gpt-oss's `reasoning_effort`
    (low / medium / high), Qwen3's and Qwen3.5's `enable_thinking`. A template with neither
    gets nothing, and the request's setting is ignored with a log line. A thinking budget is
    enforced in the row (`runtime.thinking`) for `<think>` templates and gpt-oss's analysis
    channel, whose template also takes it as a level."""
    if thinking is None:
        return {}
    text = source or ""
    if thinking.budget_tokens is not None and not template_thinks(source) \
            and "reasoning_effort" not in text:
        log.info("thinking budget not enforced: the chat template writes no reasoning",
                 budget_tokens=thinking.budget_tokens)
    if "reasoning_effort" in text:
        effort = thinking.effort
        if effort is None and thinking.enabled is not None:
            effort = "low" if not thinking.enabled else _budget_effort(thinking.budget_tokens)
        return {"reasoning_effort": _HARMONY_EFFORT[effort]} if effort else {}
    if "enable_thinking" in text:
        on = thinking.enabled
        if on is None and thinking.effort is not None:
            on = thinking.effort not in ("none", "minimal")
        return {} if on is None else {"enable_thinking": on}
    log.info("reasoning setting ignored: the chat template has no reasoning switch",
             effort=thinking.effort, thinking_enabled=thinking.enabled)
    return {}


def _budget_effort(budget: int | None) -> str:
    """An Anthropic thinking budget as gpt-oss's levels (Claude Code asks 31,999 for "think
    harder" turns, 4,000 for "think")."""
    if budget is None:
        return "medium"
    return "low" if budget <= 4096 else "medium" if budget <= 16384 else "high"
