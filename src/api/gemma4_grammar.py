"""The grammar that forces a Gemma 4 tool call: `<|tool_call>call:NAME{key:value,...}<tool_call|>`,
each value written as Gemma 4 writes it (strings between `<|"|>` quote tokens, keys bare,
numbers, true/false/null and lists as in JSON) and valid against the tool's schema.

Gemma 4's arguments are not JSON, so llguidance's `%json` cannot write them: the schema is
turned into Lark here, keyword by keyword. Numbers are the one value both write alike, so
`integer` / `number` (with their bounds) are still `%json`. What a schema says about a string
beyond its length and enum (`pattern`, `format`) is not enforced; a keyword this does not know
leaves its value free (any Gemma 4 value), as llguidance's lenient mode does. The quote must be
one special token of the vocabulary (a string's text is then any text: it cannot spell the
quote), else forcing is refused.
"""

from __future__ import annotations

import json
from typing import Any

QUOTE, OPEN, CLOSE = '<|"|>', "<|tool_call>", "<tool_call|>"

# any Gemma 4 value (a schema that says nothing, or what this does not know)
_GENERIC = [
    'gv: gstr | GNUM | "true" | "false" | "null" | gobj | garr',
    "gstr: q GTEXT? q",
    'gobj: "{" (GKEY ":" gv ("," GKEY ":" gv)*)? "}"',
    'garr: "[" (gv ("," gv)*)? "]"',
    "GKEY: /[A-Za-z_][A-Za-z0-9_.\\-]*/",
    "GNUM: /-?(0|[1-9][0-9]*)(\\.[0-9]+)?([eE][+-]?[0-9]+)?/",
    "GTEXT: /(?s:.+)/",
]
_NUMBER_KEYS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf")


class _Rules:
    """The rules a schema needs, named as they are made."""

    def __init__(self) -> None:
        self.lines: list[str] = []
        self.n = 0

    def add(self, body: str) -> str:
        self.n += 1
        name = f"r{self.n}"
        self.lines.append(f"{name}: {body}")
        return name

    def terminal(self, regex: str) -> str:
        self.n += 1
        name = f"T{self.n}"
        self.lines.append(f"{name}: /{regex}/")
        return name


def _literal(value: Any) -> str:
    """A JSON value as Gemma 4 writes it, in Lark."""
    if isinstance(value, str):
        return f"q {json.dumps(value)} q" if value else "q q"
    if isinstance(value, dict):
        items = [f"{json.dumps(f'{k}:')} {_literal(v)}" for k, v in value.items()]
        return '"{" ' + ' "," '.join(items) + ' "}"' if items else '"{}"'
    if isinstance(value, list):
        items = [_literal(v) for v in value]
        return '"[" ' + ' "," '.join(items) + ' "]"' if items else '"[]"'
    return json.dumps(json.dumps(value))


def _value(schema: Any, rules: _Rules) -> str:
    """Lark for one value valid against `schema`."""
    if not isinstance(schema, dict) or not schema:
        return "gv"
    if "const" in schema:
        return _literal(schema["const"])
    if "enum" in schema:
        return "(" + " | ".join(_literal(v) for v in schema["enum"]) + ")"
    for key in ("anyOf", "oneOf"):
        if isinstance(schema.get(key), list) and schema[key]:
            return "(" + " | ".join(_value(s, rules) for s in schema[key]) + ")"
    kind = schema.get("type")
    if isinstance(kind, list):
        return "(" + " | ".join(_value({**schema, "type": k}, rules) for k in kind) + ")"
    if kind == "string":
        low, high = schema.get("minLength", 0), schema.get("maxLength")
        if high is None and not low:
            return "q GTEXT? q"
        text = rules.terminal(f"(?s:.{{{max(low, 1)},{'' if high is None else high}}})")
        return f"q {text} q" if low else f"q {text}? q"
    if kind in ("integer", "number"):
        bounds = {k: schema[k] for k in _NUMBER_KEYS if k in schema}
        return f"%json {json.dumps({'type': kind, **bounds})}"
    if kind == "boolean":
        return '("true" | "false")'
    if kind == "null":
        return '"null"'
    if kind == "array":
        item = _value(schema.get("items"), rules)
        if schema.get("minItems", 0) >= 1:
            return rules.add(f'"[" {item} ("," {item})* "]"')
        return rules.add(f'"[" ({item} ("," {item})*)? "]"')
    if kind == "object" or "properties" in schema:
        return _object(schema, rules)
    return "gv"


def _object(schema: dict[str, Any], rules: _Rules) -> str:
    """`{key:value,...}`: the required properties in the schema's order, then each optional
    one, which may be left out (a subset in that order); no properties: any object."""
    props = schema.get("properties") or {}
    if not isinstance(props, dict) or not props:
        return "gobj"
    required = set(schema.get("required") or [])
    items = [(k in required, f"{json.dumps(f'{k}:')} {_value(v, rules)}")
             for k, v in props.items()]
    req = [item for is_req, item in items if is_req]
    opt = [item for is_req, item in items if not is_req]
    if req:
        body = " ".join([req[0], *(f'"," {r}' for r in req[1:]),
                         *(f'("," {o})?' for o in opt)])
    else:  # a subset of the optional ones, in order: the first present one leads
        alts = [" ".join([o, *(f'("," {p})?' for p in opt[i + 1:])])
                for i, o in enumerate(opt)]
        body = "(" + " | ".join(alts) + ")?"
    return rules.add(f'"{{" {body} "}}"')


def gemma4_call_grammar(tools: list[dict[str, Any]], choice_name: str | None, parallel: bool,
                        specials: dict[str, int]) -> str:
    """Lark for a reply that is only Gemma 4 tool calls: one (or, with `parallel`, one or
    more) call of `tools` (just `choice_name` when given), its arguments valid against the
    tool's parameters schema. ValueError when the vocabulary has no quote token."""
    missing = [t for t in (QUOTE, OPEN, CLOSE) if t not in specials]
    if missing:
        raise ValueError(f"forcing a Gemma 4 tool call needs the special tokens {missing} in "
                         f"the vocabulary")
    fns = [t.get("function", t) for t in tools]
    if choice_name is not None:
        fns = [f for f in fns if f["name"] == choice_name]
    rules = _Rules()
    calls = []
    for fn in fns:
        params = fn.get("parameters") or {"type": "object"}
        args = _object(params, rules) if isinstance(params, dict) else "gobj"
        calls.append(f"{json.dumps('call:' + fn['name'])} {args}")
    lines = [f"start: call{'+' if parallel else ''}",
             f"call: <[{specials[OPEN]}]> ({' | '.join(calls)}) <[{specials[CLOSE]}]>",
             f"q: <[{specials[QUOTE]}]>", *rules.lines, *_GENERIC]
    return "\n".join(lines) + "\n"
