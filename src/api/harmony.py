"""gpt-oss's harmony replies: channels and tool calls, read as they stream.

A harmony reply is a run of messages. The prompt ends with `<|start|>assistant`, so the first
message's header follows at once; each later one opens with `<|start|>assistant`:

    <|channel|>analysis<|message|>The user wants the weather.<|end|>
    <|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json
        <|message|>{"city": "Oslo"}<|call|>            (one line: wrapped here)
    <|start|>assistant<|channel|>final<|message|>It is sunny.<|return|>

The header (between the message's start and `<|message|>`) names the channel and, for a tool
call, the recipient (`to=functions.NAME`, before or after the channel). `HarmonyParser` turns
the reply into the events the three surfaces already send: analysis text as `ReasoningPiece`s
(reasoning_content, reasoning items, thinking blocks), final text (and commentary addressed to
no one, a preamble the user may see) as `TextPiece`s, and a call as `CallOpened` once its
header is read, its JSON arguments as `ArgumentsPiece`s as they are written, `CallClosed` at
`<|call|>` (a stop token, so the reply ends there) or the end of the reply. These markers
are special tokens; the tokenizer keeps them in the generated text (`Tokenizer.shown_ids`).

`harmony_call_grammar` forces one call (a commentary message to a listed function, its
arguments valid against the tool's schema); `harmony_no_call_grammar` allows messages on the
analysis and final channels only (tool_choice "none").
"""

from __future__ import annotations

import json
from typing import Any

import regex

from slotserve.api.reasoning import ReasoningPiece
from slotserve.api.tool_formats import (
    JSON_STYLE,
    ArgumentsPiece,
    CallClosed,
    CallOpened,
    StepParser,
    TextPiece,
)
from slotserve.api.tools import ToolCall, ToolChoice, new_call_id

START, END, MESSAGE, CHANNEL, CONSTRAIN = (
    "<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>")
CALL, RETURN = "<|call|>", "<|return|>"
ANALYSIS = CHANNEL + "analysis" + MESSAGE  # how a reply's reasoning message starts
# what ends a message's content (<|call|> and <|return|> are stop tokens: seen only when a
# whole past reply is parsed; a message cut short by the end of the reply ends there too)
_CONTENT_ENDS = (END, CALL, RETURN, START)
_CHANNEL = regex.compile(r"<\|channel\|>\s*(?P<channel>[A-Za-z_]+)")
_RECIPIENT = regex.compile(r"\bto=(?P<to>[^\s<]+)")
_HEADER_LIMIT = 512  # a "header" longer than this is text the model wrote without one

HarmonyEvent = TextPiece | ReasoningPiece | CallOpened | ArgumentsPiece | CallClosed


def _held(buf: str, markers: tuple[str, ...]) -> int:
    """Length of the longest suffix of `buf` that could still grow into one of `markers`."""
    best = 0
    for marker in markers:
        for k in range(min(len(marker) - 1, len(buf)), best, -1):
            if buf.endswith(marker[:k]):
                best = k
                break
    return best


class HarmonyParser(StepParser):
    """Harmony reply text in, reasoning / text / call events out, as early as the text allows.

    `calls`: whether messages to a recipient are tool calls (tools were given and the choice
    is not "none"); without, their content is passed on as text.
    """

    def __init__(self, calls: bool = True) -> None:
        self.allow_calls = calls
        self.buf = ""
        self.state = "header"  # header | content | between
        self.channel = "final"
        self.calls: list[ToolCall] = []
        self._call: tuple[str, str] | None = None  # (id, name) of the call being written
        self._args: list[str] = []

    def finish(self, stopped: bool = False) -> list[HarmonyEvent]:
        """End of the reply: a header left open is given back as text; a call being written
        ends with the arguments written so far. `stopped`: the reply ended on a stop token
        (<|call|>, <|return|>: they end the open message, and are no text); otherwise an
        open message was cut off."""
        out = self._drain(final=True)
        if self.state == "header" and self.buf:
            out.append(TextPiece(self.buf))
            self.cut = not stopped  # a message's header, unfinished (a call's, may be)
        elif self.state == "content":
            if self.buf:
                self._content(out, self.buf)
            self._end_message(out, cut=not stopped)
        self.buf, self.state = "", "between"
        return out

    # ---- states ----------------------------------------------------------------------------

    def _step(self, out: list[HarmonyEvent], final: bool) -> bool:
        if self.state == "header":
            return self._header(out, final)
        if self.state == "content":
            return self._message(out)
        return self._between(out, final)

    def _header(self, out: list[HarmonyEvent], final: bool) -> bool:
        i = self.buf.find(MESSAGE)
        if i < 0:
            if final or len(self.buf) > _HEADER_LIMIT or not self._may_be_header(self.buf):
                if self.buf and not final:  # no header: the model wrote plain text
                    self.state, self.channel = "content", "final"
                    return True
            return False
        header, self.buf = self.buf[:i], self.buf[i + len(MESSAGE):]
        m = _CHANNEL.search(header)
        self.channel = m.group("channel") if m else "final"
        to = _RECIPIENT.search(header)
        self.state = "content"
        if to is not None and self.allow_calls:
            name = to.group("to")
            name = name.removeprefix("functions.")
            call_id = new_call_id()
            self._call, self._args = (call_id, name), []
            out.append(CallOpened(len(self.calls), call_id, name))
        return True

    @staticmethod
    def _may_be_header(buf: str) -> bool:
        """Whether `buf` can still be (the start of) a message header: the role, a recipient,
        the channel and a constraint, no free text."""
        head = buf.lstrip()
        if not head:
            return True
        if head.startswith(START):
            head = head[len(START):]
        if head.startswith("assistant"):
            head = head[len("assistant"):]
        elif "assistant".startswith(head):
            return True
        head = head.lstrip()
        return not head or any(head.startswith(p) or p.startswith(head)
                               for p in (CHANNEL, "to=", CONSTRAIN))

    def _message(self, out: list[HarmonyEvent]) -> bool:
        ends = [j for j in (self.buf.find(m) for m in _CONTENT_ENDS) if j >= 0]
        if not ends:
            keep = _held(self.buf, _CONTENT_ENDS)
            if len(self.buf) > keep:
                self._content(out, self.buf[: len(self.buf) - keep])
                self.buf = self.buf[len(self.buf) - keep:]
            return False
        j = min(ends)
        if j:
            self._content(out, self.buf[:j])
        rest = self.buf[j:]
        marker = next(m for m in _CONTENT_ENDS if rest.startswith(m))
        # a new message's <|start|> is kept: the header reads from it
        self.buf = rest if marker == START else rest[len(marker):]
        self._end_message(out)
        self.state = "header" if marker == START else "between"
        return True

    def _between(self, out: list[HarmonyEvent], final: bool) -> bool:
        """After a message: the next one starts at <|start|>; anything else is text."""
        i = self.buf.find(START)
        if i < 0:
            keep = 0 if final else _held(self.buf, (START,))
            text = self.buf[: len(self.buf) - keep]
            if text.strip():
                out.append(TextPiece(text))
            self.buf = self.buf[len(self.buf) - keep:]
            return False
        if self.buf[:i].strip():
            out.append(TextPiece(self.buf[:i]))
        self.buf, self.state = self.buf[i:], "header"
        return True

    # ---- content ---------------------------------------------------------------------------

    def _content(self, out: list[HarmonyEvent], text: str) -> None:
        if self._call is not None:
            self._args.append(text)
            out.append(ArgumentsPiece(len(self.calls), text))
        elif self.channel == "analysis":
            out.append(ReasoningPiece(text))
        else:  # final, or commentary to no one (a preamble the user sees)
            out.append(TextPiece(text))

    def _end_message(self, out: list[HarmonyEvent], cut: bool = False) -> None:
        """A message ended; a call's closes (`cut`: by the end of the reply, before its
        <|call|>)."""
        if self._call is None:
            return
        call_id, name = self._call
        arguments = "".join(self._args)
        index = len(self.calls)
        if not arguments.strip():
            arguments = "{}"
            out.append(ArgumentsPiece(index, arguments))
        call = ToolCall(name, arguments, call_id)
        self.calls.append(call)
        self._call = None
        out.append(CallClosed(index, call, cut))
        self.cut = self.cut or cut


def template_is_harmony(source: str | None) -> bool:
    """Whether a chat template writes harmony messages (gpt-oss's)."""
    return bool(source) and CHANNEL in (source or "") and MESSAGE in (source or "")


# ---- grammars ------------------------------------------------------------------------------


def _token(text: str, specials: dict[str, int]) -> str:
    if text not in specials:
        raise ValueError(f"the vocabulary has no {text} token, which harmony calls need")
    return f"<[{specials[text]}]>"


def harmony_call_grammar(tools: list[dict[str, Any]], choice: ToolChoice,
                         specials: dict[str, int], analysis_tokens: int = 0) -> str:
    """Lark for a reply that is one call: a commentary message to one of `tools` (just
    `choice.name` for a named choice), its arguments valid against the tool's schema; the
    stop token <|call|> ends it. With `analysis_tokens`, the model may reason first in an
    analysis message of at most that many tokens, as gpt-oss does before a call (straight to
    the call skips the reasoning it was trained to write; the bound leaves the call room in
    max_tokens, the grammar forcing <|end|> there). One call per reply: harmony ends the
    reply at a call."""
    fns = [t["function"] for t in tools]
    if choice.mode == "function":
        fns = [f for f in fns if f["name"] == choice.name]
    channel, message = _token(CHANNEL, specials), _token(MESSAGE, specials)
    constrain = _token(CONSTRAIN, specials)
    rules = ["start: " + ("analysis? call" if analysis_tokens > 0 else "call"),
             "call: " + " | ".join(f"fn_{i}" for i in range(len(fns)))]
    if analysis_tokens > 0:
        rules += [f'analysis: {channel} "analysis" {message} reasoning {_token(END, specials)} '
                  f'{_token(START, specials)} "assistant"',
                  f"reasoning[max_tokens={analysis_tokens}]: TEXT", "TEXT: /(?s:.*)/"]
    for i, fn in enumerate(fns):
        schema = {**(fn.get("parameters") or {"type": "object"}), "x-guidance": JSON_STYLE}
        to = json.dumps(f"commentary to=functions.{fn['name']} ")
        rules.append(f'fn_{i}: {channel} {to} {constrain} "json" {message} args_{i}')
        rules.append(f"args_{i}: %json {json.dumps(schema)}")
    return "\n".join(rules) + "\n"


def harmony_no_call_grammar(specials: dict[str, int]) -> str:
    """Lark for a reply without calls: an optional analysis message, then the final one
    (its end is the stop token <|return|>)."""
    ch, msg = _token(CHANNEL, specials), _token(MESSAGE, specials)
    return "\n".join([
        f'start: analysis? {ch} "final" {msg} TEXT',
        f'analysis: {ch} "analysis" {msg} TEXT {_token(END, specials)} '
        f'{_token(START, specials)} "assistant"',
        "TEXT: /(?s:.*)/",
    ]) + "\n"
