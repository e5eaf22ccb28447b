"""Pythonic tool calls (Llama 3.2 / 4) read as they stream: a call opens at `NAME(`, a plain
string argument's text goes out as it is written, other values as each ends; however the text
is chunked, the same text and calls as the whole reply, and the same calls as reading the
whole list with `ast` (tool_formats.parse_pythonic) where that reads one."""

from __future__ import annotations

import json
from functools import partial
from typing import Any

import pytest
from grammar_check import lark_accepts
from hypothesis import given, settings
from hypothesis import strategies as st

from slotserve.api.pythonic import PythonicParser
from slotserve.api.tool_formats import (
    PYTHONIC,
    ArgumentsPiece,
    CallClosed,
    CallOpened,
    TextPiece,
    parse_pythonic,
)

REPLIES: list[tuple[str, str, list[tuple[str, Any]]]] = [
    ('[get_weather(city="Oslo", days=[1, 2]), now()] done', " done",
     [("get_weather", {"city": "Oslo", "days": [1, 2]}), ("now", {})]),
    ("[write(path='a.py', text='x = \"1\"\\n\\tok\\x41\\u00e9\\\\', mode=None, force=True,"
     " n=-2.5, opts={'a': (1, 2)})]",
     "", [("write", {"path": "a.py", "text": 'x = "1"\n\tokAé\\', "mode": None, "force": True,
                     "n": -2.5, "opts": {"a": [1, 2]}})]),
    ('[f(s="""tri"ple""", e="", t=r"\\d")]', "", [("f", {"s": 'tri"ple', "e": "", "t": "\\d"})]),
    ("[tools.search(q='a, b) c')]", "", [("tools.search", {"q": "a, b) c"})]),
    ("[not a call", "[not a call", []),
    ("[1, 2] is a list", "[1, 2] is a list", []),
    ("Sure: [f(a=1)]", "Sure: [f(a=1)]", []),
    ("[f(a=1), g(b=", "", [("f", {"a": 1}), ("g", {"b": None})]),
    ('[f(a="cut', "", [("f", {"a": "cut"})]),
]


def events_of(text: str, cuts: list[int]) -> list[Any]:
    parser = PythonicParser()
    bounds = sorted({min(c, len(text)) for c in cuts} | {0, len(text)})
    out: list[Any] = []
    for a, b in zip(bounds, bounds[1:], strict=False):
        out += parser.feed(text[a:b])
    return out + parser.finish()


def summary(events: list[Any]) -> tuple[str, list[tuple[str, Any]]]:
    return ("".join(e.text for e in events if isinstance(e, TextPiece)),
            [(e.call.name, json.loads(e.call.arguments)) for e in events
             if isinstance(e, CallClosed)])


@pytest.mark.parametrize("reply, text, calls", REPLIES)
def test_whole_replies(reply: str, text: str, calls: list[tuple[str, Any]]) -> None:
    assert summary(events_of(reply, [])) == (text, calls)
    whole = parse_pythonic(reply[: reply.rfind("]") + 1]) if reply.startswith("[") else []
    if whole:  # where ast reads the list, it reads the same calls
        assert [(n, json.loads(a)) for n, a in whole] == calls


@settings(max_examples=200, deadline=None)
@given(st.sampled_from(REPLIES), st.lists(st.integers(0, 120), max_size=40))
def test_streaming_matches_whole_text(reply: tuple, cuts: list[int]) -> None:
    events = events_of(reply[0], cuts)
    assert summary(events) == summary(events_of(reply[0], []))
    pieces: dict[int, str] = {}
    for e in events:
        if isinstance(e, ArgumentsPiece):
            pieces[e.index] = pieces.get(e.index, "") + e.text
        elif isinstance(e, CallClosed):
            assert pieces[e.index] == e.call.arguments


def test_strings_stream_as_written() -> None:
    parser = PythonicParser()
    assert parser.feed("[wri") == []
    opened = parser.feed('te(path="src/')
    assert isinstance(opened[0], CallOpened) and opened[0].name == "write"
    assert "".join(e.text for e in opened[1:]) == '{"path": "src/'
    assert parser.feed('app.py\\') == [ArgumentsPiece(0, "app.py")]  # the escape is held
    assert parser.feed('n", n=3') == [ArgumentsPiece(0, '\\n"'), ArgumentsPiece(0, ', "n": ')]
    events = parser.feed(")]") + parser.finish()
    assert events[:2] == [ArgumentsPiece(0, "3"), ArgumentsPiece(0, "}")]
    assert json.loads(events[2].call.arguments) == {"path": "src/app.py\n", "n": 3}


def test_render_reads_back() -> None:
    calls = [("get_weather", '{"city": "Oslo"}'), ("g", "{}")]
    assert summary(events_of(PYTHONIC.render(calls), [])) == (
        "", [("get_weather", {"city": "Oslo"}), ("g", {})])


def test_forcing_grammar_accepts_its_calls_only() -> None:
    """The forcing grammar takes a call of a listed tool whose arguments are valid, written as
    Python reads them (True, None, JSON-style strings), and the streamed parser reads it."""
    from vocabularies import smollm2

    from slotserve.api.pythonic import pythonic_call_grammar

    tools = [{"type": "function", "function": {"name": "write", "parameters": {
        "type": "object", "required": ["path"], "properties": {
            "path": {"type": "string", "maxLength": 12}, "force": {"type": "boolean"},
            "n": {"type": "integer"}, "mode": {"enum": ["a", "b"]}}}}},
        {"type": "function", "function": {"name": "now", "parameters": {
            "type": "object", "properties": {"tz": {"type": "string"}}}}}]
    tok = smollm2()

    accepts = partial(lark_accepts, tok)

    lark = pythonic_call_grammar(tools, None, True)
    good = '[write(path="a \\"b\\".py", force=True, mode="b"), now()]'
    assert accepts(lark, good) and accepts(lark, '[now(tz="UTC")]')
    assert summary(events_of(good, []))[1] == [
        ("write", {"path": 'a "b".py', "force": True, "mode": "b"}), ("now", {})]
    assert not accepts(lark, '[write(force=True)]')  # path is required
    assert not accepts(lark, '[write(path="a", force=true)]')  # JSON's true is not Python's
    assert not accepts(lark, '[write(path="far too long a path")]')  # maxLength
    assert not accepts(pythonic_call_grammar(tools, "now", False), '[write(path="a")]')
    with pytest.raises(ValueError, match="'opts'"):
        pythonic_call_grammar([{"type": "function", "function": {"name": "f", "parameters": {
            "type": "object", "properties": {"opts": {"type": "object"}}}}}], None, False)


# a ChatML template that teaches pythonic calls the way Llama 3.2 / 4's do (their marker text)
PYTHONIC_TEMPLATE = """{%- if tools %}<|im_start|>system
You may call functions. Reply with [func_name1(params_name1=params_value1, ...), func_name2()]
{% for t in tools %}{{ t | tojson }}
{% endfor %}<|im_end|>
{% endif %}{%- for m in messages %}<|im_start|>{{ m['role'] }}
{{ m['content'] }}<|im_end|>
{% endfor %}{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""


def test_forced_pythonic_call_end_to_end(tmp_path: Any) -> None:
    """A tiny random Qwen3 whose template teaches pythonic calls: a forced call is a
    schema-valid call, streamed (argument pieces) and not, the same."""
    import shutil

    import openai
    from converted import tiny_hf

    from slotserve.api.app import create_app
    from slotserve.api.server import BackgroundServer
    from slotserve.engine import EngineConfig

    model = tmp_path / "m"
    shutil.copytree(tiny_hf("qwen3"), model)
    cfg = json.loads((model / "tokenizer_config.json").read_text())
    (model / "tokenizer_config.json").write_text(json.dumps({**cfg,
                                                             "chat_template": PYTHONIC_TEMPLATE}))
    tools = [{"type": "function", "function": {"name": "resize", "parameters": {
        "type": "object", "required": ["rows", "wide"], "properties": {
            "rows": {"type": "integer", "minimum": 1, "maximum": 99},
            "wide": {"type": "boolean"}, "name": {"type": "string", "maxLength": 8}}}}}]
    body: dict[str, Any] = dict(model="m", messages=[{"role": "user", "content": "Resize."}],
                                tools=tools, tool_choice="required", temperature=0,
                                max_tokens=48, parallel_tool_calls=False)
    with BackgroundServer(create_app(EngineConfig(model=model, max_slots=2))).start() as srv:
        assert srv.state.call_syntax is PYTHONIC
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)
        r = client.chat.completions.create(**body)
        assert r.choices[0].finish_reason == "tool_calls", r
        ((call),) = r.choices[0].message.tool_calls
        pieces = [tc.function.arguments for chunk in client.chat.completions.create(
            **body, stream=True) for tc in (chunk.choices[0].delta.tool_calls or [])
            if chunk.choices and tc.function.arguments]
    args = json.loads(call.function.arguments)
    assert call.function.name == "resize" and "".join(pieces) == call.function.arguments
    assert type(args["rows"]) is int and 1 <= args["rows"] <= 99
    assert isinstance(args["wide"], bool) and len(pieces) > 1
    assert set(args) <= {"rows", "wide", "name"}
