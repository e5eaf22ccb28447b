"""Qwen3-Coder's XML tool calls (the Qwen3-Coder, Qwen3.5 and Qwen3.6 templates), read as
they stream:

    <tool_call>
    <function=write_file>
    <parameter=path>
    src/app.py
    </parameter>
    <parameter=overwrite>
    true
    </parameter>
    </function>
    </tool_call>

A parameter's value is raw text (no quoting or escaping: code is written as it is), one newline
after the opening tag and one before the closing tag being the layout. Its type is the one the
tool's JSON schema gives the parameter: a string value is passed on as JSON string text while it
is written (a file's contents stream as the model writes them), any other (integer, number,
boolean, null, object, array) is converted when its closing tag comes. The arguments are
written as the JSON object `{"path": "src/app.py", "overwrite": true}`, piece by piece:
`CallOpened` at `<function=NAME>`, `ArgumentsPiece`s, `CallClosed` at `</function>`.
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
    _partial_prefix,
)
from slotserve.api.tools import ToolCall, new_call_id

OPEN, CLOSE = "<tool_call>", "</tool_call>"
FUNCTION, FUNCTION_END = "<function=", "</function>"
PARAMETER, PARAMETER_END = "<parameter=", "</parameter>"
_VALUE_ENDS = (PARAMETER_END, PARAMETER, FUNCTION_END)  # a missing </parameter> is forgiven
_NAME_LIMIT = 256


def _types(schema: dict[str, Any] | None) -> set[str]:
    """The JSON types a parameter's schema allows (empty: unknown)."""
    if not isinstance(schema, dict):
        return set()
    kind = schema.get("type")
    if isinstance(kind, str):
        return {kind}
    if isinstance(kind, list):
        return {k for k in kind if isinstance(k, str)}
    found: set[str] = set()
    for key in ("anyOf", "oneOf"):
        for sub in schema.get(key) or []:
            found |= _types(sub)
    if not found and "enum" in schema:
        names = {str: "string", bool: "boolean", int: "integer", float: "number",
                 type(None): "null"}
        found = {names.get(type(v), "object") for v in schema["enum"]}
    return found


def convert(text: str, types: set[str]) -> Any:
    """A held (not string-only) value's text as the schema's type says, the way vLLM's and
    llama.cpp's Qwen3-Coder parsers read it; text no allowed type reads is kept a string."""
    raw = text.strip()
    low = raw.lower()
    if "null" in types and low in ("null", "none"):
        return None
    if "boolean" in types and low in ("true", "false"):
        return low == "true"
    if "integer" in types:
        try:
            return int(raw)
        except ValueError:
            pass
    if "number" in types:
        try:
            number = float(raw)
            return int(number) if number.is_integer() and "." not in raw and "e" not in low \
                else number
        except ValueError:
            pass
    if types & {"object", "array"} or not types:
        try:
            return json.loads(raw)
        except ValueError:
            try:
                value = ast.literal_eval(raw)
                json.dumps(value, allow_nan=False)
                return value
            except (ValueError, SyntaxError, TypeError, RecursionError, MemoryError):
                pass
    return text


class QwenXmlParser(StepParser):
    """Generated text in, `CallEvent`s out (the same events `CallParser` gives).

    `tools`: the request's tools (OpenAI shape), whose parameter schemas type the values.
    """

    def __init__(self, tools: list[dict[str, Any]] | None) -> None:
        self.schemas: dict[str, dict[str, Any]] = {}
        for tool in tools or []:
            fn = tool.get("function", tool)
            if isinstance(fn, dict) and isinstance(fn.get("name"), str):
                props = (fn.get("parameters") or {}).get("properties") or {}
                self.schemas[fn["name"]] = props if isinstance(props, dict) else {}
        self.buf = ""
        self.state = "text"  # text | region | function | params | value | after
        self.calls: list[ToolCall] = []
        self.raw = ""  # the region's text while no call is open (given back if none comes)
        self._call: tuple[str, str] | None = None
        self._args: list[str] = []
        self._n_params = 0
        self._key = ""
        self._streamed = False  # the open value is a string passed on as it comes
        self._held: list[str] = []

    def finish(self) -> list[CallEvent]:
        out = self._drain(final=True)
        if self.state == "value":
            self._end_value(out, self.buf)
            self.buf = ""
        if self._call is not None:  # ended before </function>
            self._close(out, cut=True)
        elif self.state in ("region", "function") and (self.raw or self.buf):
            out.append(TextPiece(self.raw + self.buf))
            self.cut = True
        elif self.buf:
            out.append(TextPiece(self.buf))
        self.buf, self.raw, self.state = "", "", "text"
        return out

    # ---- states ----------------------------------------------------------------------------

    def _step(self, out: list[CallEvent], final: bool) -> bool:
        return getattr(self, f"_{self.state}")(out, final)

    def _text(self, out: list[CallEvent], final: bool) -> bool:
        i = self.buf.find(OPEN)
        if i < 0:
            keep = 0 if final else _partial_prefix(self.buf, OPEN)
            if len(self.buf) > keep:
                out.append(TextPiece(self.buf[: len(self.buf) - keep]))
                self.buf = self.buf[len(self.buf) - keep:]
            return False
        if i:
            out.append(TextPiece(self.buf[:i]))
        self.raw, self.buf, self.state = OPEN, self.buf[i + len(OPEN):], "region"
        return True

    def _region(self, out: list[CallEvent], final: bool) -> bool:
        """Inside <tool_call>, before a function: its name, or text given back at the close."""
        body = self.buf.lstrip()
        self.raw += self.buf[: len(self.buf) - len(body)]
        self.buf = body
        if not body:
            return False
        if body.startswith(FUNCTION):
            self.raw += FUNCTION
            self.buf, self.state = body[len(FUNCTION):], "function"
            return True
        if not final and FUNCTION.startswith(body):
            return False
        j = body.find(CLOSE)  # no function: the region is text (or a JSON call, Hermes-style)
        if j < 0:
            return False
        self._give_back(out, self.raw + body[:j] + CLOSE)
        self.buf, self.raw, self.state = body[j + len(CLOSE):], "", "text"
        return True

    def _give_back(self, out: list[CallEvent], region: str) -> None:
        try:
            obj = json.loads(region[len(OPEN):-len(CLOSE)])
        except ValueError:
            obj = None
        if isinstance(obj, dict) and isinstance(obj.get("name"), str) \
                and isinstance(obj.get("arguments", {}), dict):
            args = json.dumps(obj.get("arguments", {}), ensure_ascii=False)
            call = ToolCall(obj["name"], args)
            index = len(self.calls)
            self.calls.append(call)
            out += [CallOpened(index, call.id, call.name), ArgumentsPiece(index, args),
                    CallClosed(index, call)]
            return
        out.append(TextPiece(region))

    def _function(self, out: list[CallEvent], final: bool) -> bool:
        j = self.buf.find(">")
        if j < 0 or j > _NAME_LIMIT:
            if j > _NAME_LIMIT or len(self.buf) > _NAME_LIMIT:
                self.state = "region_text"
                return True
            return False
        name = self.buf[:j].strip()
        call_id = new_call_id()
        self._call, self._args, self._n_params = (call_id, name), [], 0
        out.append(CallOpened(len(self.calls), call_id, name))
        self.buf, self.raw, self.state = self.buf[j + 1:], "", "params"
        return True

    def _region_text(self, out: list[CallEvent], final: bool) -> bool:
        """A <function= that names nothing: the region is text, to its close."""
        j = self.buf.find(CLOSE)
        if j < 0:
            if final:
                self.state = "region"
            return False
        out.append(TextPiece(self.raw + self.buf[: j + len(CLOSE)]))
        self.buf, self.raw, self.state = self.buf[j + len(CLOSE):], "", "text"
        return True

    def _params(self, out: list[CallEvent], final: bool) -> bool:
        body = self.buf.lstrip()
        self.buf = body
        if not body:
            return False
        if body.startswith(PARAMETER):
            j = body.find(">")
            if j < 0:
                return False
            self._key = body[len(PARAMETER):j].strip()
            self.buf = body[j + 1:]
            self.state = "value_start"
            return True
        if body.startswith(FUNCTION_END):
            self.buf = body[len(FUNCTION_END):]
            self._close(out)
            self.state = "after"
            return True
        if body.startswith(CLOSE):  # </function> left out
            self._close(out)
            self.state = "after"
            return True
        if not final and any(m.startswith(body) for m in (PARAMETER, FUNCTION_END, CLOSE)):
            return False
        k = body.find("<", 1)  # stray text between parameters: skipped
        if k < 0:
            self.buf = ""
            return False
        self.buf = body[k:]
        return True

    def _value_start(self, out: list[CallEvent], final: bool) -> bool:
        if not self.buf and not final:
            return False
        if self.buf.startswith("\n"):
            self.buf = self.buf[1:]
        assert self._call is not None
        spec = self.schemas.get(self._call[1], {}).get(self._key)
        types = _types(spec)
        self._streamed = types == {"string"}
        self._held = []
        lead = "{" if self._n_params == 0 else ", "
        self._n_params += 1
        self._emit(out, f"{lead}{json.dumps(self._key, ensure_ascii=False)}: "
                        + ('"' if self._streamed else ""))
        self.state = "value"
        return True

    def _value(self, out: list[CallEvent], final: bool) -> bool:
        ends = [(j, m) for m in _VALUE_ENDS if (j := self.buf.find(m)) >= 0]
        if not ends:
            if final:
                return False
            keep = max(_partial_prefix(self.buf, m) for m in _VALUE_ENDS)
            # a last newline may be the layout before the closing tag: held too
            if len(self.buf) > keep and self.buf[len(self.buf) - keep - 1] == "\n":
                keep += 1
            if len(self.buf) > keep:
                self._piece(out, self.buf[: len(self.buf) - keep])
                self.buf = self.buf[len(self.buf) - keep:]
            return False
        j, marker = min(ends)
        self._end_value(out, self.buf[:j])
        self.buf = self.buf[j + len(PARAMETER_END):] if marker == PARAMETER_END else self.buf[j:]
        self.state = "params"
        return True

    def _after(self, out: list[CallEvent], final: bool) -> bool:
        """After </function>: the region's close, another function, or text."""
        body = self.buf.lstrip()
        if not body:
            self.buf = ""
            return False
        if body.startswith(CLOSE):
            self.buf, self.state = body[len(CLOSE):], "closed"
            return True
        if body.startswith(FUNCTION):
            self.raw, self.buf, self.state = "", body[len(FUNCTION):], "function"
            return True
        if not final and any(m.startswith(body) for m in (CLOSE, FUNCTION)):
            return False
        self.state = "text"
        return True

    def _closed(self, out: list[CallEvent], final: bool) -> bool:
        """After </tool_call>: white space before another <tool_call> is layout, dropped."""
        body = self.buf.lstrip()
        if not body:
            if final:
                self.buf = ""
            return False
        if body.startswith(OPEN) or (not final and OPEN.startswith(body)):
            if body.startswith(OPEN):
                self.buf, self.state = body, "text"
                return True
            return False
        self.state = "text"
        return True

    # ---- values ----------------------------------------------------------------------------

    def _piece(self, out: list[CallEvent], text: str) -> None:
        if self._streamed:
            self._emit(out, json.dumps(text, ensure_ascii=False)[1:-1])
        else:
            self._held.append(text)

    def _end_value(self, out: list[CallEvent], text: str) -> None:
        if text.endswith("\n"):
            text = text[:-1]
        if self._streamed:
            self._emit(out, json.dumps(text, ensure_ascii=False)[1:-1] + '"')
            return
        assert self._call is not None
        spec = self.schemas.get(self._call[1], {}).get(self._key)
        value = convert("".join(self._held) + text, _types(spec))
        self._emit(out, json.dumps(value, ensure_ascii=False))

    def _emit(self, out: list[CallEvent], piece: str) -> None:
        if piece:
            self._args.append(piece)
            out.append(ArgumentsPiece(len(self.calls), piece))

    def _close(self, out: list[CallEvent], cut: bool = False) -> None:
        assert self._call is not None
        self._emit(out, "}" if self._n_params else "{}")
        call_id, name = self._call
        call = ToolCall(name, "".join(self._args), call_id)
        index = len(self.calls)
        self.calls.append(call)
        self._call = None
        out.append(CallClosed(index, call, cut))
        self.cut = self.cut or cut


# ---- the forcing grammar -------------------------------------------------------------------


def _string_terminal(spec: dict[str, Any]) -> str:
    """A raw string value and the closing tag after it, as one terminal: the text within the
    schema's length bounds, never spelling the closing tag before its end (one terminal, so
    that the lexer ends the value at the first closing tag instead of reading it as text). A
    `pattern` or `format` is not enforced: the value is raw text, not a JSON string."""
    low = int(spec.get("minLength", 0))
    high = spec.get("maxLength")
    bounds = f"{{{low},{int(high)}}}" if high is not None else f"{{{low},}}"
    return (f"/(?s:.{bounds})\\n<\\/parameter>\\n/ & "
            f"~/(?s:.*<\\/parameter>.{{2,}})/")


def qwen_xml_call_grammar(tools: list[dict[str, Any]], choice_name: str | None,
                          parallel: bool) -> str:
    """Lark for a reply that is only calls in Qwen3-Coder's XML: one (or, with `parallel`, one
    or more) of `tools` (just `choice_name` when given), each with the schema's required
    parameters (and optionally its other ones) in the schema's order; a string parameter is raw
    text, any other is JSON valid against its schema (`%json`), an enum of strings one of its
    values."""
    fns = [t.get("function", t) for t in tools]
    if choice_name is not None:
        fns = [f for f in fns if f["name"] == choice_name]
    rules: list[str] = []
    terminals: list[str] = []
    alts = []
    for i, fn in enumerate(fns):
        params = fn.get("parameters") or {}
        props = params.get("properties") or {}
        required = set(params.get("required") or [])
        parts = []
        for k, (key, spec) in enumerate(props.items()):
            spec = spec if isinstance(spec, dict) else {}
            head = json.dumps(f"<parameter={key}>\n")
            tail = json.dumps("\n</parameter>\n")
            if _types(spec) == {"string"} and "enum" in spec:
                value = " | ".join(json.dumps(v) for v in spec["enum"])
                rules.append(f"v_{i}_{k}: {value}")
            elif _types(spec) == {"string"}:
                terminals.append(f"STR_{i}_{k}: {_string_terminal(spec)}")
                rules.append(f"p_{i}_{k}: {head} STR_{i}_{k}")
                parts.append(f"p_{i}_{k}" if key in required else f"p_{i}_{k}?")
                continue
            else:
                sub = {**spec, "x-guidance": {"whitespace_flexible": False, "lenient": True}}
                if "$defs" in params:
                    sub["$defs"] = params["$defs"]
                rules.append(f"v_{i}_{k}: %json {json.dumps(sub)}")
            rules.append(f"p_{i}_{k}: {head} v_{i}_{k} {tail}")
            parts.append(f"p_{i}_{k}" if key in required else f"p_{i}_{k}?")
        opener = json.dumps("<function=" + fn["name"] + ">\n")
        rules.append(f'fn_{i}: {opener} {" ".join(parts)} "</function>\\n"')
        alts.append(f"fn_{i}")
    call = f'call: "<tool_call>\\n" ({" | ".join(alts)}) "</tool_call>"'
    start = 'start: call ("\\n" call)*' if parallel else "start: call"
    return "\n".join([start, call, *rules, *terminals]) + "\n"
