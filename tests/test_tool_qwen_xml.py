"""Qwen3-Coder's XML tool calls: parsed as they stream (string values passed on as written,
other values typed by the tool's schema), the syntax chosen from the Qwen3-Coder and Qwen3.5
templates, the forcing grammar checked by llguidance; then end to end on the real server with a
tiny random Qwen3 checkpoint that ships the Qwen3-Coder template: a forced call is schema-valid
and its streamed pieces reassemble to the non-streamed call."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path
from typing import Any

import openai
import pytest
from converted import tiny_hf, tiny_hf_with_template
from grammar_check import lark_accepts
from hypothesis import given, settings
from hypothesis import strategies as st
from vocabularies import smollm2

from slotserve.api.app import create_app
from slotserve.api.qwen_xml import QwenXmlParser, convert, qwen_xml_call_grammar
from slotserve.api.server import BackgroundServer
from slotserve.api.tool_formats import (
    QWEN_XML,
    ArgumentsPiece,
    CallClosed,
    CallOpened,
    TextPiece,
    syntax_for_template,
)
from slotserve.engine import EngineConfig

TEMPLATES = Path(__file__).parent / "fixtures" / "agents" / "templates"


def fn(name: str, properties: dict[str, Any], required: list[str] | None = None) -> dict:
    return {"type": "function", "function": {
        "name": name, "description": f"The {name} tool", "parameters": {
            "type": "object", "properties": properties,
            "required": list(properties) if required is None else required}}}


TOOLS = [
    fn("write_file", {"path": {"type": "string"}, "content": {"type": "string"},
                      "overwrite": {"type": "boolean"}, "mode": {"type": ["integer", "null"]}},
       required=["path", "content"]),
    fn("search", {"query": {"type": "string", "maxLength": 12}, "limit": {"type": "integer"},
                  "filters": {"type": "object"}, "tags": {"type": "array"},
                  "score": {"type": "number"}}),
]
CODE = 'def f(x):\n    return "</para" + x  # a { and a "quote"\n'
REPLIES: list[tuple[str, str, list[tuple[str, dict]]]] = [
    (f"I will write it.\n<tool_call>\n<function=write_file>\n<parameter=path>\nsrc/app.py\n"
     f"</parameter>\n<parameter=content>\n{CODE}\n</parameter>\n<parameter=overwrite>\ntrue\n"
     f"</parameter>\n<parameter=mode>\nnull\n</parameter>\n</function>\n</tool_call>",
     "I will write it.\n",
     [("write_file", {"path": "src/app.py", "content": CODE, "overwrite": True, "mode": None})]),
    ("<tool_call>\n<function=search>\n<parameter=query>\n123\n</parameter>\n<parameter=limit>\n"
     "5\n</parameter>\n<parameter=filters>\n{\"lang\": \"py\"}\n</parameter>\n"
     "<parameter=tags>\n['a', 'b']\n</parameter>\n<parameter=score>\n0.5\n</parameter>\n"
     "</function>\n</tool_call>\n<tool_call>\n<function=noargs>\n</function>\n</tool_call>",
     "", [("search", {"query": "123", "limit": 5, "filters": {"lang": "py"},
                      "tags": ["a", "b"], "score": 0.5}), ("noargs", {})]),
    # a missing </parameter>, and an unfinished call at the end of the reply
    ("<tool_call>\n<function=search>\n<parameter=query>\nx\n<parameter=limit>\n7\n</function>"
     "\n</tool_call><tool_call>\n<function=write_file>\n<parameter=path>\na.py",
     "", [("search", {"query": "x", "limit": 7}), ("write_file", {"path": "a.py"})]),
    ("a <tool_call>not a call</tool_call> b", "a <tool_call>not a call</tool_call> b", []),
    ('<tool_call>\n{"name": "search", "arguments": {"query": "q"}}\n</tool_call>', "",
     [("search", {"query": "q"})]),
]


def events_of(text: str, cuts: list[int]) -> list[Any]:
    parser = QwenXmlParser(TOOLS)
    bounds = sorted({min(c, len(text)) for c in cuts} | {0, len(text)})
    out: list[Any] = []
    for a, b in zip(bounds, bounds[1:], strict=False):
        out += parser.feed(text[a:b])
    return out + parser.finish()


def summary(events: list[Any]) -> tuple[str, list[tuple[str, dict]]]:
    text = "".join(e.text for e in events if isinstance(e, TextPiece))
    return text, [(e.call.name, json.loads(e.call.arguments)) for e in events
                  if isinstance(e, CallClosed)]


@pytest.mark.parametrize("reply, text, calls", REPLIES)
def test_whole_replies(reply: str, text: str, calls: list[tuple[str, dict]]) -> None:
    assert summary(events_of(reply, [])) == (text, calls)


@settings(max_examples=150, deadline=None)
@given(st.sampled_from(REPLIES), st.lists(st.integers(0, 400), max_size=40))
def test_streaming_matches_whole_text(reply: tuple, cuts: list[int]) -> None:
    events = events_of(reply[0], cuts)
    whole = events_of(reply[0], [])
    assert summary(events) == summary(whole)
    pieces: dict[int, str] = {}
    for e in events:
        if isinstance(e, ArgumentsPiece):
            pieces[e.index] = pieces.get(e.index, "") + e.text
        elif isinstance(e, CallClosed):
            assert pieces[e.index] == e.call.arguments
    assert [e.call.arguments for e in events if isinstance(e, CallClosed)] == \
        [e.call.arguments for e in whole if isinstance(e, CallClosed)]


def test_string_values_stream_as_written() -> None:
    parser = QwenXmlParser(TOOLS)
    opened = parser.feed("<tool_call>\n<function=write_file>\n<parameter=content>\nline 1\nli")
    assert isinstance(opened[0], CallOpened) and opened[0].name == "write_file"
    assert "".join(e.text for e in opened[1:]) == '{"content": "line 1\\nli'
    assert parser.feed("ne 2\n</para") == [ArgumentsPiece(0, "ne 2")]  # the layout held
    assert parser.feed("meter>\n<parameter=overwrite>\nfal") == [
        ArgumentsPiece(0, '"'), ArgumentsPiece(0, ', "overwrite": ')]
    assert parser.feed("se\n</parameter>") == [ArgumentsPiece(0, "false")]
    events = parser.feed("\n</function>\n</tool_call>") + parser.finish()
    assert events[0] == ArgumentsPiece(0, "}")
    assert json.loads(events[1].call.arguments) == {"content": "line 1\nline 2",
                                                    "overwrite": False}


def test_values_typed_by_schema() -> None:
    assert convert("42", {"integer"}) == 42 and convert("4.5", {"number"}) == 4.5
    assert convert("True", {"boolean"}) is True and convert("none", {"null", "string"}) is None
    assert convert("42", {"string"}) == "42" and convert("abc", {"integer"}) == "abc"
    assert convert('{"a": [1]}', {"object"}) == {"a": [1]}
    assert convert("{'a': None}", {"object"}) == {"a": None}
    assert convert("[1, 2]", set()) == [1, 2] and convert("plain words", set()) == "plain words"


@pytest.mark.parametrize("name", ["Qwen3-Coder.jinja", "Qwen3.5-4B.jinja"])
def test_syntax_of_released_templates(name: str) -> None:
    assert syntax_for_template((TEMPLATES / name).read_text()) is QWEN_XML


def test_render_reads_back() -> None:
    calls = [("write_file", '{"path": "a.py", "content": "x = 1\\n", "overwrite": true}')]
    assert summary(events_of(QWEN_XML.render(calls), [])) == (
        "", [("write_file", {"path": "a.py", "content": "x = 1\n", "overwrite": True})])


def test_forcing_grammar_accepts_its_calls_only() -> None:
    tok = smollm2()

    accepts = partial(lark_accepts, tok)

    lark = qwen_xml_call_grammar(TOOLS, None, False)
    good = QWEN_XML.render([("write_file", json.dumps({"path": "a.py", "content": CODE,
                                                        "overwrite": True}))])
    assert accepts(lark, good), lark
    assert accepts(lark, QWEN_XML.render([("search", json.dumps(
        {"query": "q", "limit": 2, "filters": {}, "tags": [1], "score": 1.5}))]))
    assert not accepts(lark, good.replace("write_file", "delete_file"))
    assert not accepts(lark, good.replace("\ntrue\n", "\nyes\n"))  # a boolean
    assert not accepts(lark, QWEN_XML.render([("write_file", '{"path": "a.py"}')]))  # required
    assert not accepts(lark, QWEN_XML.render([("search", json.dumps(
        {"query": "far too long a query", "limit": 2, "filters": {}, "tags": [],
         "score": 1}))]))  # maxLength 12
    assert not accepts(qwen_xml_call_grammar(TOOLS, "search", False), good)


# ---- end to end --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def srv(tmp_path_factory: pytest.TempPathFactory) -> Iterator[BackgroundServer]:
    """A tiny random Qwen3 checkpoint that ships the Qwen3-Coder template (SmolLM2's tokenizer
    has its <|im_start|>/<|im_end|> turns)."""
    model = Path(tmp_path_factory.mktemp("qwen3-coder")) / "m"
    shutil.copytree(tiny_hf("qwen3"), model)
    cfg_path = model / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["chat_template"] = (TEMPLATES / "Qwen3-Coder.jinja").read_text()
    cfg_path.write_text(json.dumps(cfg))
    server = BackgroundServer(create_app(EngineConfig(model=model, max_slots=4, max_queue=16),
                                         keepalive_interval=0.2)).start()
    yield server
    server.stop()


# bounded values: a random model's forced call ends within a few dozen tokens
E2E_TOOLS = [fn("search", {"query": {"type": "string", "maxLength": 12},
                           "limit": {"type": "integer", "minimum": 0, "maximum": 99},
                           "exact": {"type": "boolean"}}), TOOLS[0]]


def test_forced_calls_stream_and_reassemble(srv: BackgroundServer) -> None:
    """Greedy forced calls, streamed and not, are the same; sampled ones are schema-valid
    (the integer an int in bounds, the string within maxLength, the boolean a bool)."""
    client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)
    body: dict[str, Any] = dict(
        model="qwen3-coder", messages=[{"role": "user", "content": "Search for mlx."}],
        tools=E2E_TOOLS, temperature=0, max_tokens=64, parallel_tool_calls=False,
        tool_choice={"type": "function", "function": {"name": "search"}})

    def whole(seed: int | None = None) -> list[tuple[str, Any]]:
        extra = {} if seed is None else {"temperature": 1.0, "seed": seed}
        r = client.chat.completions.create(**{**body, **extra})
        assert r.choices[0].finish_reason == "tool_calls", r
        return [(c.function.name, json.loads(c.function.arguments))
                for c in r.choices[0].message.tool_calls]

    def streamed() -> tuple[list[tuple[str, Any]], int]:
        calls: dict[int, list[str]] = {}
        pieces = 0
        for chunk in client.chat.completions.create(**body, stream=True):
            for tc in (chunk.choices[0].delta.tool_calls or []) if chunk.choices else []:
                entry = calls.setdefault(tc.index, ["", ""])
                entry[0] += tc.function.name or ""
                entry[1] += tc.function.arguments or ""
                pieces += bool(tc.function.arguments)
        return [(n, json.loads(a)) for n, a in calls.values()], pieces

    with ThreadPoolExecutor(4) as pool:
        jobs = [pool.submit(whole), pool.submit(streamed), pool.submit(whole, 1),
                pool.submit(whole, 2)]
        greedy, (stream_calls, pieces), *sampled = [j.result() for j in jobs]
    assert greedy == stream_calls and pieces > 1
    for calls in [greedy, *sampled]:
        ((name, args),) = calls
        assert name == "search" and set(args) == {"query", "limit", "exact"}
        assert isinstance(args["query"], str) and len(args["query"]) <= 12
        assert type(args["limit"]) is int and 0 <= args["limit"] <= 99
        assert isinstance(args["exact"], bool)


@pytest.fixture(scope="module")
def thinking_srv(tmp_path_factory: pytest.TempPathFactory) -> Iterator[BackgroundServer]:
    """The tiny Qwen3 with Qwen3.5's template, whose prompt opens a <think> block."""
    model = tiny_hf_with_template("qwen3", "Qwen3.5-4B.jinja",
                                  Path(tmp_path_factory.mktemp("qwen3.5")))
    server = BackgroundServer(create_app(EngineConfig(model=model, max_slots=2, max_queue=8),
                                         keepalive_interval=0.2)).start()
    yield server
    server.stop()


def test_forced_call_after_an_open_think_block(thinking_srv: BackgroundServer) -> None:
    """Qwen3.5's prompt ends inside <think>: a forced call closes the block first, so the call
    is the answer's (a tool call, no reasoning), streamed and not."""
    client = openai.OpenAI(base_url=thinking_srv.url + "/v1", api_key="unused", max_retries=0)
    body: dict[str, Any] = dict(
        model="qwen3.5", messages=[{"role": "user", "content": "Search for mlx."}],
        # the bounded tool only: a random model's unbounded string runs to max_tokens, and
        # a call cut there ends with `length`
        tools=E2E_TOOLS[:1], temperature=0, max_tokens=64, tool_choice="required",
        parallel_tool_calls=False)
    r = client.chat.completions.create(**body)
    message = r.choices[0].message
    assert r.choices[0].finish_reason == "tool_calls", message
    assert not getattr(message, "reasoning_content", None)
    ((call),) = message.tool_calls
    reasoning, streamed = "", ""
    for chunk in client.chat.completions.create(**body, stream=True):
        delta = chunk.choices[0].delta if chunk.choices else None
        reasoning += (getattr(delta, "reasoning_content", None) or "") if delta else ""
        for tc in (delta.tool_calls or []) if delta else []:
            streamed += tc.function.arguments or ""
    assert not reasoning and json.loads(streamed) == json.loads(call.function.arguments)
