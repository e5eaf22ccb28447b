"""Tool calls end to end on the real server and SmolLM2: a forced choice is always a
well-formed call valid against its tool's schema (a grammar, not a prompt instruction), the
prompt is the same whatever the tool choice, "none" writes no call, and the streamed calls of
all three surfaces reassemble to the non-streamed ones."""

from __future__ import annotations

import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import jiter
import openai
import pytest

from slotserve.api.app import create_app
from slotserve.api.generation import start_chat
from slotserve.api.server import BackgroundServer
from slotserve.api.tools import ToolChoice
from slotserve.engine import EngineConfig


def fn(name: str, description: str, properties: dict[str, Any]) -> dict[str, Any]:
    return {"type": "function", "function": {
        "name": name, "description": description, "parameters": {
            "type": "object", "properties": properties, "required": list(properties),
            "additionalProperties": False}}}


TOOLS = [fn("get_weather", "Weather for a city", {"city": {"type": "string", "maxLength": 16}}),
         fn("add", "Add two integers", {"a": {"type": "integer"}, "b": {"type": "integer"}}),
         fn("set_mode", "Set the mode", {"mode": {"enum": ["fast", "slow"]}})]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK = [{"role": "user", "content": "What is the weather in Berlin, and what is 2 + 3?"}]


def valid(name: str, arguments: str) -> bool:
    """The arguments against the tool's schema (the few keywords these schemas use)."""
    schema = SCHEMAS[name]
    args = json.loads(arguments)
    if not isinstance(args, dict) or set(args) != set(schema["required"]):
        return False
    for key, spec in schema["properties"].items():
        value = args[key]
        if "enum" in spec and value not in spec["enum"]:
            return False
        if spec.get("type") == "string" and not (isinstance(value, str)
                                                 and len(value) <= spec["maxLength"]):
            return False
        if spec.get("type") == "integer" and (not isinstance(value, int)
                                              or isinstance(value, bool)):
            return False
    return True


@pytest.fixture(scope="module")
def srv() -> Iterator[BackgroundServer]:
    server = BackgroundServer(create_app(EngineConfig(max_slots=6, max_queue=16),
                                         keepalive_interval=0.2)).start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def client(srv: BackgroundServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)


def test_forced_calls_are_well_formed_and_schema_valid(client: openai.OpenAI) -> None:
    """Sampled (temperature 1) forced requests over 3 tools, run together: every answer is
    one call of an allowed tool whose arguments satisfy that tool's schema."""
    choices: list[Any] = ["required"] + [
        {"type": "function", "function": {"name": t["function"]["name"]}} for t in TOOLS]

    def ask(i: int) -> tuple[Any, Any]:
        r = client.chat.completions.create(
            model="m", messages=ASK, tools=TOOLS, tool_choice=choices[i], temperature=1.0,
            seed=i, max_tokens=48, parallel_tool_calls=False)
        return choices[i], r.choices[0]

    with ThreadPoolExecutor(len(choices)) as pool:
        answers = list(pool.map(ask, range(len(choices))))
    for choice, answer in answers:
        assert answer.finish_reason == "tool_calls", answer
        (call,) = answer.message.tool_calls
        if choice != "required":
            assert call.function.name == choice["function"]["name"]
        assert valid(call.function.name, call.function.arguments), call


def test_prompt_is_the_same_whatever_the_tool_choice(srv: BackgroundServer) -> None:
    """The request path renders the same prompt tokens for every tool choice, so an agent's
    cached prefix survives a change of tool choice."""
    state = srv.state

    async def prompt(choice: ToolChoice) -> list[int]:
        async with srv.app.test_request_context("/v1/chat/completions", method="POST"):
            run = await start_chat(state, ASK, TOOLS, choice, {"max_tokens": 1})
            async for _ in run.stream:
                pass
            return run.prompt_ids

    prompts = [srv.call(prompt(c)) for c in (
        ToolChoice("auto"), ToolChoice("required"), ToolChoice("none"),
        ToolChoice("function", "set_mode"))]
    assert all(p == prompts[0] for p in prompts[1:])


EXAMPLE = [  # a worked example: the model calls a tool next unless it is stopped
    {"role": "user", "content": "What is the weather in Paris?"},
    {"role": "assistant", "tool_calls": [{"id": "call_1", "type": "function", "function": {
        "name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"},
    {"role": "assistant", "content": "It is sunny and 21 C in Paris."},
    {"role": "user", "content": "What is the weather in Berlin?"},
]


def test_none_writes_no_call(client: openai.OpenAI) -> None:
    auto = client.chat.completions.create(model="m", messages=EXAMPLE, tools=TOOLS,
                                          temperature=0, max_tokens=24)
    assert auto.choices[0].message.tool_calls, auto  # free, it calls
    none = client.chat.completions.create(model="m", messages=EXAMPLE, tools=TOOLS,
                                          temperature=0, max_tokens=8, tool_choice="none")
    message = none.choices[0].message
    assert message.tool_calls is None and "<tool_call>" not in (message.content or "")


def chat_stream(client: openai.OpenAI, body: dict[str, Any]) -> tuple[list[tuple[str, str]], int]:
    calls: dict[int, list[str]] = {}
    pieces = 0
    for chunk in client.chat.completions.create(**body, stream=True):
        for tc in chunk.choices[0].delta.tool_calls or [] if chunk.choices else []:
            entry = calls.setdefault(tc.index, ["", ""])
            entry[0] += tc.function.name or ""
            entry[1] += tc.function.arguments or ""
            pieces += bool(tc.function.arguments)
    return [(n, a) for n, a in (calls[i] for i in sorted(calls))], pieces


def anthropic_stream(url: str, body: dict[str, Any]) -> tuple[list[tuple[str, str]], int]:
    blocks: dict[int, list[str]] = {}
    pieces = 0
    with httpx.stream("POST", url, json={**body, "stream": True}, timeout=120) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            ev = json.loads(line[6:])
            if ev["type"] == "content_block_start" and ev["content_block"]["type"] == "tool_use":
                blocks[ev["index"]] = [ev["content_block"]["name"], ""]
            elif ev["type"] == "content_block_delta" and ev["delta"]["type"] == "input_json_delta":
                blocks[ev["index"]][1] += ev["delta"]["partial_json"]
                pieces += 1
    return [(n, a) for n, a in (blocks[i] for i in sorted(blocks))], pieces


def test_streamed_calls_reassemble_to_the_whole(srv: BackgroundServer,
                                                client: openai.OpenAI) -> None:
    """Chat Completions and Anthropic Messages, streamed and not, give the same calls for the
    same greedy request; the streamed arguments come in several pieces."""
    body = dict(model="m", messages=ASK, tools=TOOLS, temperature=0, max_tokens=36,
                tool_choice={"type": "function", "function": {"name": "get_weather"}})
    anthropic_tools = [{"name": t["function"]["name"], "input_schema": t["function"]["parameters"],
                        "description": t["function"]["description"]} for t in TOOLS]
    a_body = dict(model="claude", messages=ASK, tools=anthropic_tools, temperature=0,
                  max_tokens=36, tool_choice={"type": "tool", "name": "get_weather"})
    url = srv.url + "/v1/messages"

    def whole_chat() -> list[tuple[str, str]]:
        r = client.chat.completions.create(**body)
        return [(c.function.name, c.function.arguments) for c in r.choices[0].message.tool_calls]

    def whole_anthropic() -> list[tuple[str, str]]:
        m = httpx.post(url, json=a_body, timeout=120).json()
        return [(b["name"], json.dumps(b["input"])) for b in m["content"]
                if b["type"] == "tool_use"]

    with ThreadPoolExecutor(4) as pool:
        jobs = [pool.submit(whole_chat), pool.submit(chat_stream, client, body),
                pool.submit(whole_anthropic), pool.submit(anthropic_stream, url, a_body)]
        chat_whole, (chat_streamed, chat_pieces), a_whole, (a_streamed, a_pieces) = [
            j.result() for j in jobs]
    assert chat_whole == chat_streamed and len(chat_whole) == 1 and chat_pieces > 1
    assert [(n, json.loads(a)) for n, a in a_streamed] == \
        [(n, json.loads(a)) for n, a in a_whole] == \
        [(n, json.loads(a)) for n, a in chat_whole] and a_pieces > 1


def test_a_call_cut_by_max_tokens_ends_with_length(srv: BackgroundServer,
                                                   client: openai.OpenAI) -> None:
    """A forced call that max_tokens cuts inside its arguments ends with `length` on every
    surface, streamed and not (Anthropic `max_tokens`, Responses `incomplete` with the call
    item incomplete): a client must not run a call whose arguments were cut off."""
    prefix = '<tool_call>\n{"name": "get_weather", "arguments": {"'
    limit = len(srv.state.ready_engine().tokenizer.encode(prefix, add_special=False)) + 2
    force = {"type": "function", "function": {"name": "get_weather"}}
    body = dict(model="m", messages=ASK, tools=TOOLS, temperature=0, max_tokens=limit,
                tool_choice=force)
    a_body = dict(model="claude", messages=ASK, temperature=0, max_tokens=limit,
                  tools=[{"name": "get_weather", "input_schema": SCHEMAS["get_weather"]}],
                  tool_choice={"type": "tool", "name": "get_weather"})
    r_body = dict(model="m", input=ASK[0]["content"], temperature=0, max_output_tokens=limit,
                  tools=[{"type": "function", "name": "get_weather",
                          "parameters": SCHEMAS["get_weather"]}],
                  tool_choice={"type": "function", "name": "get_weather"})

    def chat_whole() -> tuple[str, str]:
        c = client.chat.completions.create(**body).choices[0]
        (call,) = c.message.tool_calls
        return c.finish_reason, call.function.arguments

    def chat_streamed() -> tuple[str, str]:
        reasons, args = [], ""
        for chunk in client.chat.completions.create(**body, stream=True):
            for ch in chunk.choices:
                reasons += [ch.finish_reason] if ch.finish_reason else []
                args += "".join(tc.function.arguments or "" for tc in ch.delta.tool_calls or [])
        return reasons[-1], args

    def anthropic_whole() -> tuple[str, dict[str, Any]]:
        m = httpx.post(srv.url + "/v1/messages", json=a_body, timeout=120).json()
        (use,) = [b for b in m["content"] if b["type"] == "tool_use"]
        return m["stop_reason"], use["input"]

    def anthropic_streamed() -> tuple[str, str]:
        reason, partial = "", ""
        with httpx.stream("POST", srv.url + "/v1/messages", json={**a_body, "stream": True},
                          timeout=120) as r:
            for line in r.iter_lines():
                ev = json.loads(line[6:]) if line.startswith("data: ") else {}
                if ev.get("type") == "message_delta":
                    reason = ev["delta"]["stop_reason"]
                elif ev.get("type") == "content_block_delta":
                    partial += ev["delta"].get("partial_json", "")
        return reason, partial

    def responses_whole() -> tuple[str, str, str]:
        r = client.responses.create(**r_body)
        (call,) = r.output
        return r.status, r.incomplete_details.reason, call.status

    def responses_streamed() -> tuple[str, str]:
        with client.responses.stream(**r_body) as stream:
            kinds = [ev.type for ev in stream]
        r = stream.get_final_response() if "response.completed" in kinds else None
        return kinds[-1], r.status if r is not None else "incomplete"

    jobs = [chat_whole, chat_streamed, anthropic_whole, anthropic_streamed, responses_whole,
            responses_streamed]
    with ThreadPoolExecutor(len(jobs)) as pool:
        (cw, cs, aw, as_, rw, rs) = [j.result() for j in [pool.submit(f) for f in jobs]]
    assert cw[0] == cs[0] == "length" and cw[1] == cs[1] and cw[1].startswith('{"'), (cw, cs)
    with pytest.raises(ValueError):
        json.loads(cw[1])  # cut inside the arguments
    assert aw[0] == as_[0] == "max_tokens" and as_[1] == cw[1], (aw, as_)
    # the non-streamed input is what Anthropic's SDK folds the streamed pieces into
    assert aw[1] == jiter.from_json(as_[1].encode(), partial_mode=True), (aw, as_)
    assert rw == ("incomplete", "max_output_tokens", "incomplete")
    assert rs[0] == "response.incomplete"
