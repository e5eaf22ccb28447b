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

from slotserve.api.tool_formats import TextPiece

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
