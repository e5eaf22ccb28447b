"""Forced Gemma 4 tool calls: the grammar (`api.gemma4_grammar`) takes a call in Gemma 4's
own syntax whose arguments satisfy the tool's schema and refuses anything else (checked by
llguidance on SmolLM2's vocabulary with Gemma 4's control tokens), and through the real server
on a tiny Gemma 4 checkpoint a forced call is always well-formed and schema-valid, streamed and
not, on all three surfaces."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from grammar_check import lark_accepts
from test_gemma4_engine import make_tiny_gemma4

from slotserve.api.app import create_app
from slotserve.api.gemma4_grammar import gemma4_call_grammar
from slotserve.api.server import BackgroundServer
from slotserve.api.tool_formats import GEMMA4, parse_reply
from slotserve.engine import EngineConfig
from slotserve.model.tokenizer import Tokenizer
from slotserve.tools.synth import write_gemma4_tokenizer

Q = '<|"|>'


def fn(name: str, properties: dict[str, Any], required: list[str]) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name, "parameters": {
        "type": "object", "properties": properties, "required": required}}}


TOOLS = [
    fn("get_weather", {"city": {"type": "string", "maxLength": 12},
                       "days": {"type": "integer", "minimum": 1, "maximum": 7},
                       "unit": {"enum": ["C", "F"]}}, ["city"]),
    fn("search", {"query": {"type": "string"}, "exact": {"type": "boolean"},
                  "tags": {"type": "array", "items": {"type": "string"}},
                  "filters": {"type": "object"}}, ["query", "exact"]),
    fn("now", {}, []),
]


@pytest.fixture(scope="module")
def tok(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    path = Path(tmp_path_factory.mktemp("g4tok"))
    write_gemma4_tokenizer(path)
    return Tokenizer.from_hf_dir(path)


def accepts(tok: Tokenizer, lark: str, text: str) -> bool:
    return lark_accepts(tok, lark, text, parse_special=True)


def call(body: str) -> str:
    return f"<|tool_call>call:{body}<tool_call|>"


GOOD = [call(f"get_weather{{city:{Q}Oslo{Q}}}"),
        call(f"get_weather{{city:{Q}Oslo, Norway{Q},days:3,unit:{Q}F{Q}}}"),
        call(f"get_weather{{city:{Q}Oslo{Q},unit:{Q}C{Q}}}"),
        call(f"search{{query:{Q}a {{x}}: [y]{Q},exact:false,tags:[{Q}p{Q},{Q}q{Q}],"
             f"filters:{{lang:{Q}py{Q},max:3,deep:{{ok:true}}}}}}"),
        call("now{}")]
BAD = [call(f"get_weather{{town:{Q}Oslo{Q}}}"),          # not a parameter
       call("get_weather{}"),                             # required city missing
       call(f"get_weather{{city:{Q}Oslo{Q},days:9}}"),     # days above its maximum
       call(f"get_weather{{city:{Q}A very long city{Q}}}"),  # past maxLength
       call(f"get_weather{{city:{Q}Oslo{Q},unit:{Q}K{Q}}}"),  # not in the enum
       call(f"get_weather{{days:3,city:{Q}Oslo{Q}}}"),     # out of the schema's order
       call(f"search{{query:{Q}a{Q},exact:maybe}}"),       # not a boolean
       call('get_weather{city:"Oslo"}'),                 # a JSON string, not Gemma's
       call(f"get_time{{city:{Q}Oslo{Q}}}"),               # no such tool
       "Sure: " + call("now{}")]                          # text before the call


def test_grammar_takes_schema_valid_gemma4_calls_only(tok: Tokenizer) -> None:
    lark = gemma4_call_grammar(TOOLS, None, True, dict(tok.special_tokens))
    for text in GOOD:
        assert accepts(tok, lark, text), text
        _, (parsed,) = parse_reply(text, GEMMA4)  # and the parser reads it back
        assert isinstance(json.loads(parsed.arguments), dict)
    assert accepts(tok, lark, GOOD[0] + GOOD[4])  # parallel calls
    for text in BAD:
        assert not accepts(tok, lark, text), text
    single = gemma4_call_grammar(TOOLS, "now", False, dict(tok.special_tokens))
    assert accepts(tok, single, GOOD[4]) and not accepts(tok, single, GOOD[0])
    assert not accepts(tok, single, GOOD[4] + GOOD[4])
    with pytest.raises(ValueError, match="special tokens"):
        gemma4_call_grammar(TOOLS, None, False, {})


@pytest.fixture(scope="module")
def srv(tmp_path_factory: pytest.TempPathFactory) -> Iterator[BackgroundServer]:
    model = make_tiny_gemma4(Path(tmp_path_factory.mktemp("gemma4-tools")))
    server = BackgroundServer(create_app(EngineConfig(model=model, max_slots=4, max_queue=16),
                                         keepalive_interval=0.2)).start()
    yield server
    server.stop()


def valid(name: str, args: dict[str, Any]) -> bool:
    """The get_weather arguments against its schema (the keywords it uses)."""
    return (name == "get_weather" and isinstance(args.get("city"), str)
            and len(args["city"]) <= 12 and set(args) <= {"city", "days", "unit"}
            and (not isinstance(args.get("days"), bool) and 1 <= args.get("days", 1) <= 7)
            and args.get("unit", "C") in ("C", "F"))


def test_forced_calls_on_a_gemma4_model(srv: BackgroundServer) -> None:
    """A named forced call (chat, greedy) is one well-formed call whose streamed and whole
    forms agree, as Anthropic's `tool` choice gives it; sampled ones are schema-valid."""
    client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)
    body: dict[str, Any] = dict(
        model="gemma4", messages=[{"role": "user", "content": "Weather in Oslo?"}],
        tools=TOOLS[:1], temperature=0, max_tokens=64, parallel_tool_calls=False,
        tool_choice={"type": "function", "function": {"name": "get_weather"}})
    r = client.chat.completions.create(**body)
    assert r.choices[0].finish_reason == "tool_calls", r
    (whole,) = r.choices[0].message.tool_calls
    args = json.loads(whole.function.arguments)
    assert valid(whole.function.name, args), whole
    streamed: dict[int, list[str]] = {}
    for chunk in client.chat.completions.create(**body, stream=True):
        for tc in (chunk.choices[0].delta.tool_calls or []) if chunk.choices else []:
            entry = streamed.setdefault(tc.index, ["", ""])
            entry[0] += tc.function.name or ""
            entry[1] += tc.function.arguments or ""
    assert [(n, json.loads(a)) for n, a in streamed.values()] == [("get_weather", args)]
    m = httpx.post(srv.url + "/v1/messages", timeout=120, json={
        "model": "gemma4", "max_tokens": 64, "temperature": 0, "messages": body["messages"],
        "tools": [{"name": "get_weather", "input_schema": TOOLS[0]["function"]["parameters"]}],
        "tool_choice": {"type": "tool", "name": "get_weather"}}).json()
    assert m["stop_reason"] == "tool_use", m
    assert [(b["name"], b["input"]) for b in m["content"] if b["type"] == "tool_use"] == \
        [("get_weather", args)]
    for seed in range(3):
        r = client.chat.completions.create(**{**body, "temperature": 1.0, "seed": seed})
        (c,) = r.choices[0].message.tool_calls
        assert r.choices[0].finish_reason == "tool_calls"
        assert valid(c.function.name, json.loads(c.function.arguments)), c
