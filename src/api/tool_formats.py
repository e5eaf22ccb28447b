"""Each model family's native tool-call syntax, one streaming parser for all of them, and the
grammar that forces a call in that syntax.

    syntax = syntax_for_template(engine.template.source)   # Hermes, Llama 3 JSON, Mistral...
    parser = CallParser(syntax)
    for event in parser.feed(delta_text): ...      # TextPiece / CallOpened / ArgumentsPiece /
    for event in parser.finish(): ...              # CallClosed, as the model writes them

Models write calls the way their chat template taught them, so the syntax is read from the
template (`syntax_for_template`); a template that says nothing about tools gets Hermes, which
`tools.tool_listing` then describes to the model. The parser turns a call's arguments into
`ArgumentsPiece`s while they are generated: once the call's name is read, each piece of the
arguments' JSON text is passed on as it arrives (the surfaces send them as OpenAI
`tool_calls[i].function.arguments` chunks, Responses `function_call_arguments.delta` and
Anthropic `input_json_delta`). A call's arguments are the JSON text the model wrote, so the
streamed pieces and a non-streamed answer (the same parser over the whole text) give the same
calls byte for byte. Gemma 4's calls (`<|tool_call>call:f{a:1}<tool_call|>`) are not JSON:
each one is sent whole when it closes. Three syntaxes have parsers of their own, with the same
events: pythonic calls (`[f(a=1)]`, `slotserve.api.pythonic`, which `parse_reply` here reads
whole), gpt-oss's harmony channels (`slotserve.api.harmony`) and Qwen3-Coder's XML
(`slotserve.api.qwen_xml`).

`call_grammar` is the Lark grammar (llguidance) of one or more calls of the given tools in the
syntax, each tool's arguments constrained by its JSON schema: with it a forced call is always
well-formed and valid against the schema. `no_call_grammar` is free text that never spells the
syntax's opener (tool_choice "none").
"""

from __future__ import annotations

import ast
import json
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

import regex
import structlog

from slotserve.api.tools import ToolCall, ToolChoice, new_call_id

log = structlog.get_logger("slotserve.api")


# ---- the syntaxes --------------------------------------------------------------------------

# A JSON call object up to its arguments: {"name": "f", "arguments": ...
_JSON_HEAD = regex.compile(
    r'\{\s*"name"\s*:\s*"(?P<name>[^"\\]{1,256})"\s*,\s*"(?:arguments|parameters)"\s*:\s*')
_JSON_TAIL = regex.compile(r"\s*\}")
_NO_TAIL = regex.compile(r"")


@dataclass(frozen=True)
class CallSyntax:
    """How one family writes tool calls.

    A *region* of calls starts at `opener` anywhere in the text, or at one of `at_start` when
    the reply begins with it; inside it, calls (`head` with the name, the arguments' JSON value,
    `tail`) follow one another, separated by any of `separators`, until `closer` (or the end of
    the reply when there is none). `arguments_key` and `wrap` say how `render` and the grammar
    write a call.
    """

    name: str
    opener: str | None
    closer: str | None = None
    at_start: tuple[str, ...] = ()
    head: regex.Pattern[str] = _JSON_HEAD
    tail: regex.Pattern[str] = _JSON_TAIL
    separators: str = " \n\t\r"
    arguments_key: str = "arguments"
    pythonic: bool = False
    # a region is parsed whole when it closes (its arguments are not JSON as written)
    whole: bool = False

    def render(self, calls: list[tuple[str, str]]) -> str:
        """(name, arguments JSON) pairs as the model writes them, for a past assistant turn."""
        if self.pythonic:
            return "[" + ", ".join(_pythonic_call(n, a) for n, a in calls) + "]"
        if self.name == "mistral_args":
            return "".join(f"[TOOL_CALLS]{n}[ARGS]{a}" for n, a in calls)
        if self.name == "gemma4":
            return "".join(f"<|tool_call>call:{n}{_gemma_value(_loads(a))}<tool_call|>"
                           for n, a in calls)
        if self.name == "qwen_xml":
            return "".join(_qwen_xml_call(n, a) for n, a in calls)
        if self.name == "harmony":  # one call per message, as gpt-oss's template writes it
            return "".join(f"<|start|>assistant to=functions.{n}<|channel|>commentary json"
                           f"<|message|>{a}<|call|>" for n, a in calls)
        objs = [f'{{"name": {json.dumps(n)}, "{self.arguments_key}": {a}}}' for n, a in calls]
        if self.name == "hermes":
            return "".join(f"{self.opener}\n{o}\n{self.closer}" for o in objs)
        if self.name == "mistral":
            return f"{self.opener}[{', '.join(objs)}]"
        return "; ".join(objs)  # llama3_json

    def example(self) -> str:
        """A call with placeholders, for a prompt that teaches the syntax."""
        return self.render([("NAME", "ARGS")]).replace('"NAME"', "<function name>").replace(
            "ARGS", "<arguments as a JSON object>")


HERMES = CallSyntax("hermes", "<tool_call>", "</tool_call>")
LLAMA3_JSON = CallSyntax("llama3_json", "<|python_tag|>", at_start=('{"name"',),
                         separators=" \n\t\r;", arguments_key="parameters")
MISTRAL = CallSyntax("mistral", "[TOOL_CALLS]", separators=" \n\t\r,[]")
MISTRAL_ARGS = CallSyntax("mistral_args", "[TOOL_CALLS]",
                          head=regex.compile(r"(?:\[TOOL_CALLS\])?(?P<name>[A-Za-z0-9_.\-]{1,256})"
                                             r"(?:\[CALL_ID\][A-Za-z0-9]*)?\[ARGS\]"),
                          tail=_NO_TAIL)
PYTHONIC = CallSyntax("pythonic", None, at_start=("[",), pythonic=True, whole=True)
GEMMA4 = CallSyntax("gemma4", "<|tool_call>", "<tool_call|>", whole=True)
# gpt-oss: calls are harmony messages to `functions.NAME`, read (with the reasoning and answer
# channels) by `slotserve.api.harmony`, not by CallParser
HARMONY = CallSyntax("harmony", "<|channel|>")
# Qwen3-Coder / Qwen3.5 / Qwen3.6: <tool_call><function=NAME><parameter=K>raw</parameter>...,
# read by `slotserve.api.qwen_xml` (values typed by the tool's schema), not by CallParser
QWEN_XML = CallSyntax("qwen_xml", "<tool_call>", "</tool_call>")
SYNTAXES = {s.name: s for s in (HERMES, LLAMA3_JSON, MISTRAL, MISTRAL_ARGS, PYTHONIC, GEMMA4,
                                HARMONY, QWEN_XML)}


def syntax_for_template(source: str | None) -> CallSyntax:
    """The syntax a chat template teaches its model (Hermes when it teaches none)."""
    text = source or ""
    if "<|channel|>" in text and "<|message|>" in text:
        return HARMONY
    if "<|tool_call>" in text:
        return GEMMA4
    if "[TOOL_CALLS]" in text:
        return MISTRAL_ARGS if "[ARGS]" in text else MISTRAL
    if "<tool_call>" in text and "<function=" in text and "<parameter=" in text:
        return QWEN_XML
    if "<tool_call>" in text:
        return HERMES
    if "[func_name1(" in text or "[func_name(" in text:  # Llama 3.2 / 4 pythonic
        return PYTHONIC
    if "<|python_tag|>" in text or ('"parameters"' in text and "<|eot_id|>" in text):
        return LLAMA3_JSON
    return HERMES


# ---- events --------------------------------------------------------------------------------


@dataclass(frozen=True)
class TextPiece:
    text: str


@dataclass(frozen=True)
class CallOpened:
    index: int  # the call's place among this reply's calls, from 0
    id: str
    name: str


@dataclass(frozen=True)
class ArgumentsPiece:
    index: int
    text: str


@dataclass(frozen=True)
class CallClosed:
    index: int
    call: ToolCall  # the whole call: its arguments are the pieces joined
    # the reply ended inside the call (max_tokens, a stop): its arguments are what was written
    cut: bool = False


CallEvent = TextPiece | CallOpened | ArgumentsPiece | CallClosed


# ---- the parser ----------------------------------------------------------------------------


def _partial_prefix(buf: str, marker: str) -> int:
    """Length of the longest suffix of `buf` that could still grow into `marker`."""
    for k in range(min(len(marker) - 1, len(buf)), 0, -1):
        if buf.endswith(marker[:k]):
            return k
    return 0


class StepParser(ABC):
    """The loop every streaming call parser shares: generated text is held in `buf` and the
    parser's state machine advanced (`_step`) until it can do no more with what is held.

    `cut` is set by `finish` when the reply ended inside a call (its arguments unfinished, or
    a call region given back as text because it never closed): such a reply's finish reason
    is the engine's (`length` at max_tokens), not `tool_calls`."""

    buf: str
    cut: bool = False

    def feed(self, text: str) -> list[Any]:
        self.buf += text
        return self._drain(final=False)

    def _drain(self, final: bool) -> list[Any]:
        """Events of every step the held text allows (final: the generation has ended)."""
        out: list[Any] = []
        while self._step(out, final):
            pass
        return out

    @abstractmethod
    def _step(self, out: list[Any], final: bool) -> bool:
        """Advance once, appending events to `out`; False when nothing more can be done."""


class CallParser(StepParser):
    """Generated text in, `CallEvent`s out, as early as the text allows.

    Text is passed through except what could still become the syntax's opener; a call's
    arguments are passed through as they are written. What inside a region is no call (text
    in the tags that is not a call object) is given back as text when the region ends.
    """

    def __init__(self, syntax: CallSyntax) -> None:
        self.syntax = syntax
        self.buf = ""
        self.state = "start" if syntax.at_start else "text"  # start|text|region|args|tail|raw
        self.calls: list[ToolCall] = []
        self.raw = ""  # the region's text while it is held (state raw)
        self._call: tuple[str, str] | None = None  # (id, name) of the call being written
        self._args: list[str] = []
        self._depth = 0
        self._in_str = False
        self._esc = False
        self._began = False
        self._string_args = False

    # ---- public ----------------------------------------------------------------------------

    def finish(self) -> list[CallEvent]:
        """End of generation: what is held is parsed or given back; an unfinished call ends
        with the arguments written so far."""
        out = self._drain(final=True)
        if self.state == "args":
            self._close(out, cut=True)
        elif self.state == "raw" or (self.state == "region" and self.buf.strip()):
            self._end_raw(out, self.raw + self.buf)
            # a region that should have closed, given back as text: the reply ended in it
            self.cut = self.cut or (bool(self.syntax.closer) and isinstance(out[-1], TextPiece))
        elif self.buf and self.state in ("text", "start"):
            out.append(TextPiece(self.buf))
        self.buf, self.state = "", "text"
        return out

    # ---- states ----------------------------------------------------------------------------

    def _step(self, out: list[CallEvent], final: bool) -> bool:
        """Advance once; False when nothing more can be done with the text held."""
        if self.state == "start":
            return self._start(final)
        if self.state == "text":
            return self._text(out)
        if self.state == "region":
            return self._region(out, final)
        if self.state == "args":
            return self._arguments(out)
        if self.state == "tail":
            return self._tail(final)
        return self._raw(out)

    def _start(self, final: bool) -> bool:
        head = self.buf.lstrip()
        if not head:
            return False
        for marker in self.syntax.at_start:
            if head.startswith(marker):
                self.buf, self.state = head, "region"
                return True
            if marker.startswith(head) and not final:
                return False  # could still become the marker
        self.state = "text"
        return True

    def _text(self, out: list[CallEvent]) -> bool:
        opener = self.syntax.opener
        i = self.buf.find(opener) if opener else -1
        if i < 0:
            keep = _partial_prefix(self.buf, opener) if opener else 0
            if len(self.buf) > keep:
                out.append(TextPiece(self.buf[: len(self.buf) - keep]))
                self.buf = self.buf[len(self.buf) - keep:]
            return False
        if i:
            out.append(TextPiece(self.buf[:i]))
        assert opener is not None
        # a Mistral [ARGS] call names the function right after the opener: the head reads it
        keep_opener = self.syntax.name == "mistral_args"
        self.buf = self.buf[i:] if keep_opener else self.buf[i + len(opener):]
        self.state, self.raw = "region", ("" if keep_opener else opener)
        return True

    def _region(self, out: list[CallEvent], final: bool) -> bool:
        syn = self.syntax
        skipped = len(self.buf) - len(self.buf.lstrip(syn.separators))
        self.raw += self.buf[:skipped]
        self.buf = self.buf[skipped:]
        if not self.buf:
            return False
        if not final and any(m and len(self.buf) < len(m) and m.startswith(self.buf)
                             for m in (syn.closer, syn.opener)):
            return False  # may still be the closer, or another opener
        if syn.closer and self.buf.startswith(syn.closer):
            self.buf, self.raw, self.state = self.buf[len(syn.closer):], "", "text"
            return True
        if syn.opener and self.buf.startswith(syn.opener) and syn.name != "mistral_args":
            self.raw += syn.opener
            self.buf = self.buf[len(syn.opener):]  # another opener inside the region
            return True
        if syn.whole:
            self.state = "raw"
            return True
        m = syn.head.match(self.buf, partial=True)
        if m is not None and m.partial and not final:
            return False
        if m is None or m.partial:
            self.state = "raw"
            return True
        call_id, name = new_call_id(), m.group("name")
        self._call = (call_id, name)
        out.append(CallOpened(len(self.calls), call_id, name))
        self.buf, self.raw = self.buf[m.end():], ""
        self._args, self._depth, self._in_str, self._esc = [], 0, False, False
        self._began = self._string_args = False
        self.state = "args"
        return True

    def _arguments(self, out: list[CallEvent]) -> bool:
        """Pass the arguments' JSON value on as it comes; the call closes where it ends."""
        if not self._began:
            self.buf = self.buf.lstrip()
            if not self.buf:
                return False
            self._began = True
            self._string_args = self.buf[0] == '"'
        closer = self.syntax.closer
        i, n = 0, len(self.buf)
        done = False
        while i < n:
            c = self.buf[i]
            if self._in_str:
                if self._esc:
                    self._esc = False
                elif c == "\\":
                    self._esc = True
                elif c == '"':
                    self._in_str = False
                    if self._depth == 0:  # a string value: the arguments as a JSON text
                        i += 1
                        done = True
                        break
                i += 1
                continue
            if closer and c == closer[0]:  # the region ends inside the value: stop there
                rest = self.buf[i:]
                if rest.startswith(closer):
                    done = True
                    break
                if closer.startswith(rest):
                    break  # wait: it may be the closer
            if c == '"':
                self._in_str = True
            elif c in "{[":
                self._depth += 1
            elif c in "}]":
                self._depth -= 1
                if self._depth <= 0:
                    i += 1
                    done = True
                    break
            i += 1
        piece, self.buf = self.buf[:i], self.buf[i:]
        if piece:
            self._args.append(piece)
            if not self._string_args:
                out.append(ArgumentsPiece(len(self.calls), piece))
        if done:
            self._close(out)
            self.state = "tail"
            return True
        return False

    def _close(self, out: list[CallEvent], cut: bool = False) -> None:
        assert self._call is not None
        call_id, name = self._call
        text = "".join(self._args).strip()
        index = len(self.calls)
        if self._string_args:  # "arguments": "{\"a\": 1}": the string holds the JSON
            try:
                decoded = json.loads(text)
            except ValueError:
                decoded = text
            text = decoded if isinstance(decoded, str) else text
            if text:
                out.append(ArgumentsPiece(index, text))
        call = ToolCall(name, text or "{}", call_id)
        if not text:
            out.append(ArgumentsPiece(index, "{}"))
        self.calls.append(call)
        self._call = None
        out.append(CallClosed(index, call, cut))
        self.cut = self.cut or cut

    def _tail(self, final: bool) -> bool:
        m = self.syntax.tail.match(self.buf, partial=True)
        if m is not None and m.partial and not final:
            return False
        if m is not None and not m.partial:
            self.buf = self.buf[m.end():]
        self.state = "region"
        return True

    def _raw(self, out: list[CallEvent]) -> bool:
        """A region that holds no call object: held until it closes, then parsed whole
        (pythonic calls, or a call object written some other way) or given back as text."""
        closer = self.syntax.closer
        if self.syntax.pythonic:
            end = _pythonic_end(self.buf)
            if end < 0:
                return False
            body, self.buf = self.buf[:end], self.buf[end:]
            self._end_raw(out, self.raw + body)
            self.raw, self.state = "", "text"
            return True
        if not closer:
            return False  # to the end of the reply
        j = self.buf.find(closer)
        if j < 0:
            return False
        body, self.buf = self.buf[:j], self.buf[j + len(closer):]
        self._end_raw(out, self.raw + body, closer)
        self.raw, self.state = "", "text"
        return True

    def _end_raw(self, out: list[CallEvent], text: str, closer: str = "") -> None:
        calls = self._whole(text)
        if not calls:
            out.append(TextPiece(text + closer))
            return
        for name, arguments in calls:
            index, call = len(self.calls), ToolCall(name, arguments)
            out += [CallOpened(index, call.id, name), ArgumentsPiece(index, arguments),
                    CallClosed(index, call)]
            self.calls.append(call)

    def _whole(self, text: str) -> list[tuple[str, str]]:
        """Calls in a held region's text, parsed at once; [] if it holds none."""
        syn = self.syntax
        body = text
        if syn.opener and body.startswith(syn.opener):
            body = body[len(syn.opener):]
        if syn.pythonic:
            return parse_pythonic(body.strip())
        if syn.name == "gemma4":
            return parse_gemma4(body)
        try:
            value = json.loads(body.strip())
        except (ValueError, RecursionError):
            return []
        items = value if isinstance(value, list) else [value]
        found = []
        for item in items:
            if not isinstance(item, dict) or not isinstance(item.get("name"), str):
                return []
            args = item.get("arguments", item.get("parameters", {}))
            if isinstance(args, str):
                found.append((item["name"], args))
                continue
            try:
                found.append((item["name"], json.dumps(args, ensure_ascii=False,
                                                       allow_nan=False)))
            except ValueError:
                return []
        return found


# ---- Gemma 4 calls ---------------------------------------------------------------------------

_QUOTE = '<|"|>'  # Gemma 4's string quote (one special token); the text inside is raw


def parse_gemma4(body: str) -> list[tuple[str, str]]:
    """`call:NAME{key:value,...}` (one region, between <|tool_call> and <tool_call|>) ->
    [(NAME, arguments JSON)]; [] if it is not one (see /work/coord/gemma4_tools.md)."""
    body = body.strip()
    if not body.startswith("call:") or "{" not in body:
        return []
    name, _, rest = body[5:].partition("{")
    try:
        value, end = _gemma_parse("{" + rest, 0)
    except (ValueError, IndexError):
        return []
    if not isinstance(value, dict) or rest[end - 1:].strip() or not name:
        return []
    return [(name, json.dumps(value, ensure_ascii=False, allow_nan=False))]


def _gemma_parse(text: str, i: int) -> tuple[Any, int]:
    """One value at text[i:] -> (value, index past it)."""
    if text.startswith(_QUOTE, i):
        j = text.index(_QUOTE, i + len(_QUOTE))
        return text[i + len(_QUOTE):j], j + len(_QUOTE)
    c = text[i]
    if c in "{[":
        close = "}" if c == "{" else "]"
        items: Any = {} if c == "{" else []
        i += 1
        while text[i] != close:
            if c == "{":
                k = text.index(":", i)
                key, i = text[i:k], k + 1
                items[key], i = _gemma_parse(text, i)
            else:
                v, i = _gemma_parse(text, i)
                items.append(v)
            if text[i] == ",":
                i += 1
            elif text[i] != close:
                raise ValueError(f"expected ',' or {close!r} at {i}")
        return items, i + 1
    j = i
    while j < len(text) and text[j] not in ",}]":
        j += 1
    word = text[i:j]
    literals = {"true": True, "false": False, "null": None}
    if word in literals:
        return literals[word], j
    return json.loads(word), j  # a number (ValueError otherwise)


def _gemma_value(value: Any) -> str:
    if isinstance(value, str):
        return f"{_QUOTE}{value}{_QUOTE}"
    if isinstance(value, dict):
        return "{" + ",".join(f"{k}:{_gemma_value(v)}" for k, v in value.items()) + "}"
    if isinstance(value, list):
        return "[" + ",".join(_gemma_value(v) for v in value) + "]"
    return json.dumps(value)


def _qwen_xml_call(name: str, arguments: str) -> str:
    args = _loads(arguments)
    params = "".join(
        f"<parameter={k}>\n{v if isinstance(v, str) else json.dumps(v)}\n</parameter>\n"
        for k, v in (args.items() if isinstance(args, dict) else ()))
    return f"<tool_call>\n<function={name}>\n{params}</function>\n</tool_call>"


def _loads(arguments: str) -> Any:
    try:
        return json.loads(arguments)
    except ValueError:
        return {}


# ---- pythonic calls ------------------------------------------------------------------------


def _pythonic_end(text: str) -> int:
    """Index just past the `]` that closes a pythonic call list, or -1 while it is open."""
    depth, quote, esc = 0, "", False
    for i, c in enumerate(text):
        if quote:
            if esc:
                esc = False
            elif c == "\\":
                esc = True
            elif c == quote:
                quote = ""
        elif c in "'\"":
            quote = c
        elif c in "([{":
            depth += 1
        elif c in ")]}":
            depth -= 1
            if depth == 0:
                return i + 1
    return -1


def parse_pythonic(text: str) -> list[tuple[str, str]]:
    """`[f(a=1, b="x"), g()]` -> [("f", '{"a": 1, "b": "x"}'), ("g", "{}")]; [] if it is not
    a list of calls with literal keyword arguments."""
    try:
        tree = ast.parse(text, mode="eval").body
    except (SyntaxError, ValueError, RecursionError):
        return []
    if not isinstance(tree, ast.List):
        return []
    calls = []
    for node in tree.elts:
        if not isinstance(node, ast.Call) or node.args:
            return []
        name = ast.unparse(node.func)
        try:
            args = {k.arg: ast.literal_eval(k.value) for k in node.keywords if k.arg}
            calls.append((name, json.dumps(args, ensure_ascii=False, allow_nan=False)))
        except (ValueError, TypeError, SyntaxError, RecursionError):
            return []
    return calls


def _pythonic_call(name: str, arguments: str) -> str:
    try:
        args = json.loads(arguments)
    except ValueError:
        args = {}
    if not isinstance(args, dict):
        args = {}
    return f"{name}(" + ", ".join(f"{k}={v!r}" for k, v in args.items()) + ")"


# ---- whole replies -------------------------------------------------------------------------


def split_calls(events: list[CallEvent]) -> tuple[str, list[ToolCall]]:
    """Events of a whole reply -> (its text, its calls)."""
    text = "".join(e.text for e in events if isinstance(e, TextPiece))
    return text, [e.call for e in events if isinstance(e, CallClosed)]


def partial_json(text: str) -> Any:
    """The value the start of a JSON text holds, for a call whose arguments were cut off:
    open containers closed, an unfinished last string, key or literal dropped
    (`{"a": 1, "b": "x` -> {"a": 1}), as Anthropic's SDK reads a streamed tool_use input
    (jiter's partial mode); {} if not even that parses."""
    closers: list[str] = []
    cuts: list[tuple[int, str]] = [(0, "")]  # (end, what closes the containers open there)
    in_str = esc = False
    for i, c in enumerate(text):
        if in_str:
            if esc:
                esc = False
            elif c == "\\":
                esc = True
            elif c == '"':
                in_str = False
                cuts.append((i + 1, "".join(reversed(closers))))
        elif c == '"':
            in_str = True
        elif c in "{[":
            closers.append("}" if c == "{" else "]")
            cuts.append((i + 1, "".join(reversed(closers))))
        elif c in "}]":
            if closers:
                closers.pop()
            cuts.append((i + 1, "".join(reversed(closers))))
        elif c == ",":
            cuts.append((i, "".join(reversed(closers))))
    if not in_str:
        cuts.append((len(text), "".join(reversed(closers))))
    for end, close in reversed(cuts):  # the longest start that parses
        try:
            return json.loads(text[:end] + close)
        except ValueError:
            continue
    return {}


def parse_reply(text: str, syntax: CallSyntax) -> tuple[str, list[ToolCall]]:
    """A whole reply at once: (text, calls), exactly what streaming it gives."""
    parser = CallParser(syntax)
    return split_calls(parser.feed(text) + parser.finish())


# ---- grammars ------------------------------------------------------------------------------


JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": ",
              "lenient": True}


def _lark_string(text: str) -> str:
    return json.dumps(text)


def _terminal(text: str, specials: dict[str, int]) -> str:
    """A literal of the syntax in Lark: a special token by its id, other text as a string."""
    if text in specials:
        return f"<[{specials[text]}]>"
    return _lark_string(text)


def call_grammar(syntax: CallSyntax, tools: list[dict[str, Any]], choice: ToolChoice,
                 parallel: bool, specials: dict[str, int]) -> str:
    """Lark for a reply that is only tool calls: one (or, with `parallel`, one or more) call
    of `tools` (just `choice.name` for a named choice), each tool's arguments valid against
    its parameters schema. `specials`: the vocabulary's special tokens by text."""
    fns = [t["function"] for t in tools]
    if choice.mode == "function":
        fns = [f for f in fns if f["name"] == choice.name]
    rules = []
    for i, fn in enumerate(fns):
        # JSON as models write it, no free whitespace (a small model can loop on newlines)
        schema = {**(fn.get("parameters") or {"type": "object"}), "x-guidance": JSON_STYLE}
        name = fn["name"]
        if syntax.whole:
            raise ValueError(f"forcing a tool call is not supported for {syntax.name} tool "
                             f"calls (tool_choice 'auto' and 'none' are)")
        if syntax.name == "mistral_args":
            head = _lark_string(f"{name}") + " " + _terminal("[ARGS]", specials)
            rules.append(f"fn_{i}: {head} args_{i}")
        else:
            head = f'{{"name": {json.dumps(name)}, "{syntax.arguments_key}": '
            rules.append(f"fn_{i}: {_lark_string(head)} args_{i} {_lark_string('}')}")
        rules.append(f"args_{i}: %json {json.dumps(schema)}")
    body = " | ".join(f"fn_{i}" for i in range(len(fns)))
    opener = _terminal(syntax.opener, specials) if syntax.opener else None
    if syntax.name == "hermes":
        call = f'{opener} "\\n" ({body}) "\\n" {_terminal(syntax.closer or "", specials)}'
        start = 'start: call ("\\n" call)*' if parallel else "start: call"
    elif syntax.name == "mistral":
        call = f"{body}"
        start = (f'start: {opener} "[" call (", " call)* "]"' if parallel
                 else f'start: {opener} "[" call "]"')
    elif syntax.name == "mistral_args":
        call = f"{opener} ({body})"
        start = "start: call+" if parallel else "start: call"
    else:  # llama3_json: the reply is the call object(s)
        call = f"{body}"
        start = 'start: call ("; " call)*' if parallel else "start: call"
    return "\n".join([start, f"call: {call}", *rules]) + "\n"


def no_call_grammar(syntax: CallSyntax) -> str | None:
    """Lark for free text that never writes the syntax's opener (None: nothing to forbid
    that text could spell, as for pythonic calls)."""
    marker = syntax.opener or (syntax.at_start[0] if syntax.at_start else None)
    if syntax.pythonic or not marker:
        return None
    esc = regex.escape(marker).replace("/", "\\/")
    return f"start: TEXT\nTEXT: /(?s:.*)/ & ~/(?s:.*{esc}.*)/\n"

