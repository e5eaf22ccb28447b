"""Pythonic tool calls (Llama 3.2 / Llama 4's `[get_weather(city="Oslo", days=[1, 2]), now()]`),
read as they stream.

A reply that starts with `[NAME(` is a list of calls with keyword arguments whose values are
Python literals. The arguments go out as the JSON object they stand for, piece by piece:
`CallOpened` once `NAME(` is read; `{"city": ` once the keyword is; a plain quoted string's
text as JSON string text while it is written (escapes decoded as Python reads them); any other
value (numbers, True/False/None, lists, dicts, a prefixed or triple-quoted string) when it
ends, converted with `ast.literal_eval`; `}` and `CallClosed` at `)`. What follows the list's
`]` is text. A reply that does not start so is text, as is a list that turns out to hold no
call (`[1, 2]`).
"""

from __future__ import annotations

import ast
import json
from typing import Any

from slotserve.api.tool_formats import (
    ArgumentsPiece,
    CallClosed,
    CallEvent,
    CallOpened,
    StepParser,
    TextPiece,
)
from slotserve.api.tools import ToolCall, new_call_id

_NAME_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_.")
_WS = " \t\r\n"
_ESCAPE_LEN = {"x": 3, "u": 5, "U": 9}  # characters after the backslash, letter included


def _escape_end(text: str, i: int) -> int:
    """Index past the escape sequence at text[i] == "\\", or -1 while it may be incomplete."""
    if i + 1 >= len(text):
        return -1
    c = text[i + 1]
    if c in _ESCAPE_LEN:
        end = i + 1 + _ESCAPE_LEN[c]
        return end if end <= len(text) else -1
    if c == "N":
        j = text.find("}", i)
        return j + 1 if j >= 0 else -1
    if c in "01234567":
        j = i + 1
        while j < len(text) and j < i + 4 and text[j] in "01234567":
            j += 1
        return j if j < len(text) or j == i + 4 else -1
    return i + 2


def _decode(piece: str, quote: str) -> str:
    """A piece of a plain quoted string's body (whole escapes only) as the text it spells."""
    if "\\" not in piece:
        return piece
    try:
        value = ast.literal_eval(quote + piece + quote)
    except (ValueError, SyntaxError):
        return piece
    return value if isinstance(value, str) else piece


def _literal(text: str) -> Any:
    """A held value's Python literal as JSON-able data (its text as a string if it is none)."""
    try:
        value = ast.literal_eval(text.strip())
        json.dumps(value, allow_nan=False)
        return value
    except (ValueError, SyntaxError, TypeError, RecursionError, MemoryError):
        return text.strip()


class PythonicParser(StepParser):
    """Generated text in, `CallEvent`s out (the events `CallParser` gives)."""

    def __init__(self) -> None:
        self.buf = ""
        # start | name | args | key | value | string | after_string | between | skip | text
        self.state = "start"
        self.calls: list[ToolCall] = []
        self.held = ""  # the reply's text while it may still be a call list
        self._call: tuple[str, str] | None = None
        self._args: list[str] = []
        self._n = 0  # arguments written in the open call
        self._key = ""
        self._value = ""  # a held value's text
        self._depth = 0
        self._quote = ""
        self._esc = False
        self._str_quote = ""  # the open streamed string's quote
        self._awaiting = False  # a keyword written, its value not yet begun

    def finish(self) -> list[CallEvent]:
        out = self._drain(final=True)
        # ended inside the list, before its "]": a call (or a name) left unfinished
        self.cut = self._call is not None or (self.state == "name"
                                              and bool(self.held or self.calls))
        if self.state in ("start", "name") and self._call is None and not self.calls:
            if self.held + self.buf:
                out.append(TextPiece(self.held + self.buf))
        elif self.state == "text" and self.buf:
            out.append(TextPiece(self.buf))
        elif self._call is not None:
            if self.state == "value" and self._value.strip():
                self._end_value(out)
            elif self.state in ("string", "after_string"):
                if self.state == "string":
                    self._emit(out, json.dumps(_decode(self.buf, self._str_quote))[1:-1])
                self._emit(out, '"')
            self._close(out, cut=True)
        self.buf, self.held, self.state = "", "", "text"
        return out

    def _step(self, out: list[CallEvent], final: bool) -> bool:
        return bool(getattr(self, f"_on_{self.state}")(out, final))

    # ---- the list and its calls ----------------------------------------------------------

    def _on_start(self, out: list[CallEvent], final: bool) -> bool:
        head = self.buf.lstrip()
        if not head:
            return False
        if not head.startswith("["):
            self.state = "text"
            return True
        self.held += self.buf[: len(self.buf) - len(head)] + "["
        self.buf, self.state = head[1:], "name"
        return True

    def _on_name(self, out: list[CallEvent], final: bool) -> bool:
        """A call's name up to its "(": only then is the list known to be calls."""
        body = self.buf.lstrip(_WS)
        j = 0
        while j < len(body) and body[j] in _NAME_CHARS:
            j += 1
        if j == len(body):
            return False  # the name may go on
        name = body[:j]
        if body[j] != "(" or not name or name[0].isdigit():
            if self._call is None and not self.calls:  # not a call list: text
                self.buf, self.held, self.state = self.held + self.buf, "", "text"
            else:
                self._skip_rest(out)
            return True
        call_id = new_call_id()
        self._call, self._args, self._n = (call_id, name), [], 0
        out.append(CallOpened(len(self.calls), call_id, name))
        self.buf, self.held, self.state = body[j + 1:], "", "args"
        return True

    def _on_args(self, out: list[CallEvent], final: bool) -> bool:
        body = self.buf.lstrip(_WS + ",")
        self.buf = body
        if not body:
            return False
        if body[0] == ")":
            self._close(out)
            self.buf, self.state = body[1:], "between"
            return True
        self.state = "key"
        return True

    def _on_key(self, out: list[CallEvent], final: bool) -> bool:
        j = self.buf.find("=")
        if j < 0:
            if len(self.buf) > 256 or any(c in self.buf for c in ",)("):
                self._skip_rest(out)
                return True
            return False
        key = self.buf[:j].strip()
        if not key.isidentifier() or self.buf[j + 1: j + 2] == "=":
            self._skip_rest(out)
            return True
        self._key = key
        lead = "{" if self._n == 0 else ", "
        self._n += 1
        self._emit(out, f"{lead}{json.dumps(key)}: ")
        self._awaiting = True
        self.buf = self.buf[j + 1:].lstrip(_WS)
        self._value, self._depth, self._quote, self._esc = "", 0, "", False
        self.state = "value"
        return True

    def _on_value(self, out: list[CallEvent], final: bool) -> bool:
        if not self._value:
            self.buf = self.buf.lstrip(_WS)
            if not self.buf:
                return False
            q = self.buf[0]
            if q in "'\"":  # a plain string streams; a triple-quoted one is held
                if len(self.buf) < 3 and not final:
                    return False
                if not self.buf.startswith(q * 3):
                    self._str_quote, self.buf = q, self.buf[1:]
                    self._emit(out, '"')
                    self._awaiting = False
                    self.state = "string"
                    return True
        i = self._scan(final, ",)")
        if i < 0:
            return False
        self._value += self.buf[:i]
        self.buf = self.buf[i:]
        self._end_value(out)
        self.state = "args"
        return True

    def _scan(self, final: bool, ends: str) -> int:
        """Index in buf of the first of `ends` outside brackets and strings (a held value's
        end, or with ends "" a bracket that closes one more than it opened: -2 - its index);
        -1 while there is none. What was scanned past is moved from buf to _value."""
        i, n = 0, len(self.buf)
        while i < n:
            c = self.buf[i]
            if self._quote:
                if self._esc:
                    self._esc = False
                elif c == "\\":
                    self._esc = True
                elif self.buf.startswith(self._quote, i):
                    i += len(self._quote)
                    self._quote = ""
                    continue
                elif self._quote[0] == c and not final and n - i < len(self._quote):
                    break  # may be the closing triple quote
                i += 1
                continue
            if c in "'\"":
                if n - i < 3 and not final and self.buf[i:] == c * (n - i):
                    break  # may open a triple-quoted string
                self._quote = c * 3 if self.buf.startswith(c * 3, i) else c
                i += len(self._quote)
                continue
            if c in "([{":
                self._depth += 1
            elif c in ")]}" and self._depth > 0:
                self._depth -= 1
            elif c in ends and self._depth == 0:
                return i
            elif c in ")]}" and not ends:
                return -2 - i
            i += 1
        self._value += self.buf[:i]
        self.buf = self.buf[i:]
        return -1

    def _on_string(self, out: list[CallEvent], final: bool) -> bool:
        """A plain quoted string's body, passed on as JSON string text as it comes."""
        i, n = 0, len(self.buf)
        while i < n:
            c = self.buf[i]
            if c == "\\":
                end = _escape_end(self.buf, i)
                if end < 0:
                    break
                i = end
                continue
            if c == self._str_quote:
                self._emit(out, json.dumps(_decode(self.buf[:i], self._str_quote))[1:-1] + '"')
                self.buf, self.state = self.buf[i + 1:], "after_string"
                return True
            i += 1
        if i:
            self._emit(out, json.dumps(_decode(self.buf[:i], self._str_quote))[1:-1])
            self.buf = self.buf[i:]
        return False

    def _on_after_string(self, out: list[CallEvent], final: bool) -> bool:
        """After a streamed string: its argument ends at the next "," or ")"."""
        j = min((k for k in (self.buf.find(","), self.buf.find(")")) if k >= 0), default=-1)
        if j < 0:
            self.buf = ""
            return False
        self.buf, self.state = self.buf[j:], "args"
        return True

    def _on_between(self, out: list[CallEvent], final: bool) -> bool:
        body = self.buf.lstrip(_WS)
        self.buf = body
        if not body:
            return False
        if body[0] == ",":
            self.buf, self.state = body[1:], "name"
            return True
        if body[0] == "]":
            self.buf, self.state = body[1:], "text"
            return True
        self._skip_rest(out)
        return True

    def _on_text(self, out: list[CallEvent], final: bool) -> bool:
        if self.buf:
            out.append(TextPiece(self.buf))
            self.buf = ""
        return False

    def _on_skip(self, out: list[CallEvent], final: bool) -> bool:
        """A list broken after a call was opened: the open call is closed and the rest of the
        list skipped (to its "]"), the text after it kept."""
        i = self._scan(final, "")
        self._value = ""
        if i == -1:
            if final:
                self.buf = ""
            return False
        self.buf, self.state = self.buf[-2 - i + 1:], "text"
        return True

    def _skip_rest(self, out: list[CallEvent]) -> None:
        inside = self._call is not None
        self._close(out)
        self._depth = 1 if inside else 0  # inside the call's parentheses, or the list's
        self._quote, self._esc, self._value = "", False, ""
        self.state = "skip"

    # ---- values and calls ------------------------------------------------------------------

    def _end_value(self, out: list[CallEvent]) -> None:
        self._emit(out, json.dumps(_literal(self._value), ensure_ascii=False))
        self._value, self._awaiting = "", False

    def _emit(self, out: list[CallEvent], piece: str) -> None:
        if piece and self._call is not None:
            self._args.append(piece)
            out.append(ArgumentsPiece(len(self.calls), piece))

    def _close(self, out: list[CallEvent], cut: bool = False) -> None:
        if self._call is None:
            return
        if self._awaiting:  # cut off after a keyword: the arguments stay a JSON object
            self._emit(out, "null")
            self._awaiting = False
        self._emit(out, "}" if self._n else "{}")
        call_id, name = self._call
        call = ToolCall(name, "".join(self._args), call_id)
        index = len(self.calls)
        self.calls.append(call)
        self._call = None
        out.append(CallClosed(index, call, cut))


# ---- the forcing grammar -------------------------------------------------------------------


def _json_safe(schema: Any) -> bool:
    """Whether every value `schema` allows is written the same in JSON and Python (no
    true/false/null inside, and a type is given): then `%json` writes a Python literal."""
    if not isinstance(schema, dict):
        return False
    kind = schema.get("type")
    if "enum" in schema:
        return all(isinstance(v, str | int | float) and not isinstance(v, bool)
                   for v in schema["enum"])
    if kind in ("string", "integer", "number"):
        return True
    if kind == "object":
        props = schema.get("properties") or {}
        return (schema.get("additionalProperties") is False
                and all(_json_safe(p) for p in props.values()))
    if kind == "array":
        return _json_safe(schema.get("items"))
    return False


def _value_rule(spec: Any) -> str | None:
    """Lark for one argument's Python literal, or None when it cannot be written here."""
    if isinstance(spec, dict) and spec.get("type") == "boolean":
        return '"True" | "False"'
    if isinstance(spec, dict) and spec.get("type") == "null":
        return '"None"'
    if _json_safe(spec):
        sub = {**spec, "x-guidance": {"whitespace_flexible": False, "item_separator": ", ",
                                      "key_separator": ": ", "lenient": True}}
        return f"%json {json.dumps(sub)}"
    return None


def pythonic_call_grammar(tools: list[dict[str, Any]], choice_name: str | None,
                          parallel: bool) -> str:
    """Lark for a reply that is only a pythonic call list: `[NAME(key=value, ...)]` of one
    of `tools` (just `choice_name` when given), the required arguments in the schema's order,
    then the optional ones (each may be left out); strings, numbers and enums as JSON writes
    them (which Python reads alike), booleans True/False, None. ValueError for a parameter
    whose values Python and JSON write differently (true/false/null inside an object or
    array, or no type)."""
    fns = [t.get("function", t) for t in tools]
    if choice_name is not None:
        fns = [f for f in fns if f["name"] == choice_name]
    rules = []
    for i, fn in enumerate(fns):
        params = fn.get("parameters") or {}
        props = params.get("properties") or {}
        required = [k for k in props if k in set(params.get("required") or [])]
        optional = [k for k in props if k not in required]
        items = []
        for k, key in enumerate(required + optional):
            value = _value_rule(props[key])
            if value is None:
                raise ValueError(f"forcing a pythonic call of {fn['name']!r}: its parameter "
                                 f"{key!r} has values Python and JSON write differently "
                                 "(booleans or null inside an object or array, or no type)")
            rules.append(f"v_{i}_{k}: {value}")
            items.append((key in required, f'"{key}=" v_{i}_{k}'))
        # required ones joined by ", ", then each optional one as (", " item)?; with none
        # required, the optional ones from the first (a subset that starts with it)
        req = [item for is_req, item in items if is_req]
        opt = [f'(", " {item})?' for is_req, item in items if not is_req]
        if req:
            body = " ".join([req[0], *(f'", " {r}' for r in req[1:]), *opt])
        elif opt:
            first = next(item for is_req, item in items if not is_req)
            body = f"({' '.join([first, *opt[1:]])})?"
        else:
            body = ""
        opener = json.dumps(fn["name"] + "(")
        rules.append(f'fn_{i}: {opener} {body} ")"')
    call = "call: " + " | ".join(f"fn_{i}" for i in range(len(fns)))
    start = 'start: "[" call (", " call)* "]"' if parallel else 'start: "[" call "]"'
    return "\n".join([start, call, *rules]) + "\n"
