"""Pythonic tool calls (Llama 3.2 / 4) read as they stream: a call opens at `NAME(`, a plain
string argument's text goes out as it is written, other values as each ends; however the text
is chunked, the same text and calls as the whole reply, and the same calls as reading the
whole list with `ast` (tool_formats.parse_pythonic) where that reads one."""

from __future__ import annotations

import json
from typing import Any

import pytest
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
