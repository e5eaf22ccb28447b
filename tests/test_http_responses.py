"""The Responses API (`POST /v1/responses`) with the official openai SDK against the real
Hypercorn server and the bundled SmolLM2: text, forced function calls (streamed as written),
previous_response_id, text.format, Codex's first request, and the errors."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from slotserve.api.app import create_app
from slotserve.api.server import BackgroundServer
from slotserve.engine import EngineConfig

WEATHER_TOOL = {"type": "function", "name": "get_weather", "description": "Weather for a city",
                "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                               "required": ["city"], "additionalProperties": False}}
ASK = "What is the weather in Berlin?"


@pytest.fixture(scope="module")
def srv() -> Iterator[BackgroundServer]:
    server = BackgroundServer(create_app(EngineConfig(max_slots=2, max_queue=8),
                                         keepalive_interval=0.2)).start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def client(srv: BackgroundServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)


def test_text_stream_and_not(client: openai.OpenAI) -> None:
    """Any model name is served; instructions and developer items reach the prompt; the
    stream helper folds the events into the same response the plain call returns."""
    args: dict[str, Any] = dict(
        model="gpt-5-codex", instructions="You are a helpful assistant.", temperature=0,
        max_output_tokens=8, input=[
            {"role": "developer", "content": "Answer in one sentence."},
            {"type": "message", "role": "user",
             "content": [{"type": "input_text", "text": "What is the capital of France?"}]}])
    r = client.responses.create(**args)
    assert r.object == "response" and r.status in ("completed", "incomplete")
    assert "Paris" in r.output_text and r.output[0].type == "message"
    assert r.usage.input_tokens > 0 and r.usage.output_tokens > 0
    kinds = []
    with client.responses.stream(**args) as stream:
        for ev in stream:
            if not (ev.type == "response.in_progress" and ev.type in kinds):
                kinds.append(ev.type)  # later ones are heartbeats
        if r.status == "completed":
            final = stream.get_final_response()
            assert final.output_text == r.output_text
    assert kinds[:5] == ["response.created", "response.in_progress",
                         "response.output_item.added", "response.content_part.added",
                         "response.output_text.delta"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done",
                          "response.output_item.done", f"response.{r.status}"]


def test_forced_call_streams_arguments_and_continues(client: openai.OpenAI) -> None:
    """tool_choice "required" gives a schema-valid call; its arguments arrive in several
    deltas that join to the non-streamed arguments; the call's output continues the
    conversation through previous_response_id, reusing the cached prompt."""
    args: dict[str, Any] = dict(model="m", input=ASK, tools=[WEATHER_TOOL], temperature=0,
                                tool_choice="required", parallel_tool_calls=False,
                                max_output_tokens=40)
    r = client.responses.create(**args)
    (call,) = r.output
    assert call.type == "function_call" and call.name == "get_weather"
    assert set(json.loads(call.arguments)) == {"city"} and call.call_id.startswith("call_")
    deltas = []
    with client.responses.stream(**args) as stream:
        for ev in stream:
            if ev.type == "response.function_call_arguments.delta":
                deltas.append(ev.delta)
        final = stream.get_final_response()
    assert len(deltas) > 1 and "".join(deltas) == call.arguments
    assert final.output[0].arguments == call.arguments and final.output[0].name == call.name
    nxt = client.responses.create(
        model="m", previous_response_id=r.id, tools=[WEATHER_TOOL], tool_choice="none",
        max_output_tokens=3, temperature=0,
        input=[{"type": "function_call_output", "call_id": call.call_id,
                "output": "sunny, 21 C"}])
    assert nxt.output[0].type == "message"
    assert nxt.usage.input_tokens_details.cached_tokens >= r.usage.input_tokens - 1


def test_store_false_and_unknown_previous_response(client: openai.OpenAI) -> None:
    r = client.responses.create(model="m", input="Hi", max_output_tokens=2, store=False)
    for rid in (r.id, "resp_nope"):
        with pytest.raises(openai.BadRequestError) as info:
            client.responses.create(model="m", input="Hi", previous_response_id=rid,
                                    max_output_tokens=2)
        err = info.value.body
        assert err["code"] == "previous_response_not_found" and rid in err["message"]
        assert err["param"] == "previous_response_id"


def test_text_format_json_schema(client: openai.OpenAI) -> None:
    schema = {"type": "object", "properties": {"capital": {"type": "string", "maxLength": 12}},
              "required": ["capital"], "additionalProperties": False}
    r = client.responses.create(
        model="m", input="What is the capital of France? Answer in JSON.", temperature=0,
        max_output_tokens=24,
        text={"format": {"type": "json_schema", "name": "answer", "schema": schema,
                         "strict": True}})
    assert set(json.loads(r.output_text)) == {"capital"}


def test_codex_first_request(srv: BackgroundServer) -> None:
    """Codex CLI's first request as it sends it (stream, reasoning summary, encrypted
    reasoning asked for, store false, prompt_cache_key, function / namespace / web_search
    tools): answered as a stream that ends in response.completed or response.incomplete."""
    body = {
        "model": "gpt-5-codex", "instructions": "You are Codex, a coding agent.",
        "input": [
            {"type": "message", "role": "developer",
             "content": [{"type": "input_text", "text": "<permissions>none</permissions>"}]},
            {"type": "message", "role": "developer",
             "content": [{"type": "input_text", "text": "Be brief."}]},
            {"type": "message", "role": "user",
             "content": [{"type": "input_text", "text": "<environment_context/>"}]},
            {"type": "message", "role": "user",
             "content": [{"type": "input_text", "text": "Say hi."}]}],
        "tools": [{"type": "function", "name": "shell", "description": "Run a command",
                   "strict": False, "parameters": {
                       "type": "object", "properties": {"command": {
                           "type": "array", "items": {"type": "string"}}},
                       "required": ["command"]}},
                  {"type": "namespace", "name": "mcp", "tools": []},
                  {"type": "web_search"}],
        "tool_choice": "auto", "parallel_tool_calls": False,
        "reasoning": {"effort": "medium", "summary": "auto"}, "store": False,
        "stream": True, "include": ["reasoning.encrypted_content"],
        "prompt_cache_key": "0199c7b0-codex-session", "max_output_tokens": 2}
    with httpx.stream("POST", srv.url + "/v1/responses", json=body, timeout=120) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        lines = [x for x in r.iter_lines() if x and not x.startswith(":")]
    events = [json.loads(x[6:]) for x in lines if x.startswith("data: ")]
    names = [x[7:] for x in lines if x.startswith("event: ")]
    assert names == [e["type"] for e in events]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    last = events[-1]
    assert last["type"] in ("response.completed", "response.incomplete")
    assert [t["name"] for t in last["response"]["tools"]] == ["shell"]
    usage = last["response"]["usage"]
    assert usage["input_tokens"] > 0 and "cached_tokens" in usage["input_tokens_details"]


@pytest.mark.parametrize("body, needle", [
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
     "input_image"),
    ({"input": [{"role": "robot", "content": "x"}]}, "input[0].role"),
    ({"input": [{"type": "function_call_output", "output": "x"}]}, "input[0].call_id"),
    ({"input": "hi", "tools": [WEATHER_TOOL], "tool_choice": {"type": "function",
                                                             "name": "nope"}}, "nope"),
    ({"input": "hi", "text": {"format": {"type": "json_schema", "name": "x"}}}, "schema"),
    ({}, "input"),
])
def test_bad_requests(srv: BackgroundServer, body: dict[str, Any], needle: str) -> None:
    r = httpx.post(srv.url + "/v1/responses", json=body, timeout=30)
    assert r.status_code == 400, r.text
    assert needle in r.json()["error"]["message"] + str(r.json()["error"]["param"])
