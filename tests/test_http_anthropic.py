"""Anthropic Messages API (`POST /v1/messages`) with raw httpx against the real server."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from slotserve.api.anthropic import chat_messages, parse_messages
from slotserve.api.app import create_app
from slotserve.api.generation import inline_past_calls
from slotserve.api.server import BackgroundServer
from slotserve.api.tool_formats import HERMES
from slotserve.engine import EngineConfig

FRANCE = [{"role": "user", "content": "What is the capital of France?"}]
BASE = {"model": "default", "temperature": 0, "messages": FRANCE}
TOOLS = [{"name": "get_weather", "description": "Weather for a city",
          "input_schema": {"type": "object", "properties": {"city": {"type": "string"}},
                           "required": ["city"]}}]
WEATHER = [  # one worked example, so a 135M model follows the Hermes tool-call format
    {"role": "user", "content": "What is the weather in Paris?"},
    {"role": "assistant", "content": [
        {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}}]},
    {"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny, 21 C"}]},
    {"role": "assistant", "content": "It is sunny and 21 C in Paris."},
    {"role": "user", "content": "What is the weather in Berlin?"},
]


@pytest.fixture(scope="module")
def http() -> Iterator[httpx.Client]:
    server = BackgroundServer(create_app(EngineConfig(max_slots=2, max_queue=4),
                                         keepalive_interval=0.2)).start()
    with httpx.Client(base_url=server.url, timeout=120) as c:
        yield c
    server.stop()


def post(http: httpx.Client, **body: Any) -> dict[str, Any]:
    r = http.post("/v1/messages", json=body)
    assert r.status_code == 200, r.text
    return r.json()


def events(http: httpx.Client, **body: Any) -> list[tuple[str, dict[str, Any]]]:
    """(event name, data) pairs of a streamed answer; pings are dropped."""
    with http.stream("POST", "/v1/messages", json={**body, "stream": True}) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        lines = [x for x in r.iter_lines() if x]
    out = []
    for name, data in zip(lines[::2], lines[1::2], strict=True):
        assert name.startswith("event: ") and data.startswith("data: ")
        payload = json.loads(data[6:])
        assert payload["type"] == name[7:]
        if payload["type"] != "ping":
            out.append((name[7:], payload))
    return out


def fold(evs: list[tuple[str, dict[str, Any]]]) -> dict[str, Any]:
    """Rebuild the message a stream describes, checking the event order on the way."""
    kinds = [k for k, _ in evs]
    assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"]
    msg = evs[0][1]["message"]
    parts: dict[int, list[str]] = {}
    open_block = None
    for kind, ev in evs[1:-2]:
        if kind == "content_block_start":
            assert open_block is None and ev["index"] == len(msg["content"])
            open_block = ev["index"]
            msg["content"].append(ev["content_block"])
            parts[open_block] = []
        elif kind == "content_block_delta":
            assert ev["index"] == open_block
            d = ev["delta"]
            parts[open_block].append(d["text"] if d["type"] == "text_delta" else d["partial_json"])
        else:
            assert kind == "content_block_stop" and ev["index"] == open_block
            block = msg["content"][open_block]
            if block["type"] == "text":
                block["text"] = "".join(parts[open_block])
            else:
                block["input"] = json.loads("".join(parts[open_block]))
            open_block = None
    assert open_block is None
    delta = evs[-2][1]
    msg.update(delta["delta"])
    msg["usage"]["output_tokens"] = delta["usage"]["output_tokens"]
    return msg


# ---- with the model ------------------------------------------------------------------------


def test_text_stream_and_not(http: httpx.Client) -> None:
    m = post(http, **BASE, max_tokens=16)
    assert m["type"] == "message" and m["role"] == "assistant" and m["id"].startswith("msg_")
    assert m["stop_reason"] == "end_turn" and m["stop_sequence"] is None
    assert [b["type"] for b in m["content"]] == ["text"] and "Paris" in m["content"][0]["text"]
    assert m["usage"]["input_tokens"] > 0 and 0 < m["usage"]["output_tokens"] <= 16
    streamed = fold(events(http, **BASE, max_tokens=16))
    assert {k: v for k, v in streamed.items() if k not in ("id", "usage")} == \
        {k: v for k, v in m.items() if k not in ("id", "usage")}

    def prompt(usage: dict[str, int]) -> int:  # the repeat reads its prompt from the cache
        return usage["input_tokens"] + usage["cache_read_input_tokens"]

    assert prompt(streamed["usage"]) == prompt(m["usage"])
    assert streamed["usage"]["output_tokens"] == m["usage"]["output_tokens"]


def test_stop_sequence_and_max_tokens(http: httpx.Client) -> None:
    m = post(http, **BASE, max_tokens=16, stop_sequences=[" Paris", "zzz"],
             system=[{"type": "text", "text": "Answer in one sentence."}])
    assert (m["stop_reason"], m["stop_sequence"]) == ("stop_sequence", " Paris")
    assert m["content"][0]["text"] == "The capital of France is"
    s = fold(events(http, **BASE, max_tokens=3))
    assert (s["stop_reason"], s["usage"]["output_tokens"]) == ("max_tokens", 3)
    assert s["content"][0]["text"] == "The capital of"


def test_tool_use_stream_and_not(http: httpx.Client) -> None:
    body = {**BASE, "messages": WEATHER, "tools": TOOLS, "max_tokens": 40}
    m = post(http, **body)
    assert m["stop_reason"] == "tool_use"
    use = m["content"][-1]
    assert (use["type"], use["name"], use["input"]) == ("tool_use", "get_weather",
                                                        {"city": "Berlin"})
    assert use["id"].startswith("toolu_")
    evs = events(http, **body, tool_choice={"type": "tool", "name": "get_weather"})
    deltas = [ev["delta"]["type"] for k, ev in evs if k == "content_block_delta"]
    assert "input_json_delta" in deltas
    s = fold(evs)
    assert s["stop_reason"] == "tool_use"
    assert [(b["type"], b.get("name"), b.get("input")) for b in s["content"]] == \
        [("tool_use", "get_weather", {"city": "Berlin"})]


@pytest.mark.parametrize("body, status, kind, needle", [
    ({"messages": FRANCE}, 400, "invalid_request_error", "max_tokens"),
    ({"max_tokens": 0, "messages": FRANCE}, 400, "invalid_request_error", "max_tokens"),
    ({"max_tokens": 4, "messages": []}, 400, "invalid_request_error", "messages"),
    ({"max_tokens": 4, "messages": [{"role": "robot", "content": "x"}]}, 400,
     "invalid_request_error", "role"),
    ({"max_tokens": 4, "messages": [{"role": "user", "content": [{"type": "image"}]}]}, 400,
     "invalid_request_error", "image"),
    ({"max_tokens": 4, "messages": FRANCE, "tools": TOOLS,
      "tool_choice": {"type": "tool", "name": "nope"}}, 400, "invalid_request_error", "nope"),
    ({"max_tokens": 4, "messages": FRANCE, "temperature": 9}, 400, "invalid_request_error",
     "temperature"),
])
def test_errors(http: httpx.Client, body: dict[str, Any], status: int, kind: str,
                needle: str) -> None:
    r = http.post("/v1/messages", json=body)
    assert r.status_code == status
    err = r.json()
    assert err["type"] == "error" and err["error"]["type"] == kind
    assert needle in err["error"]["message"]


def test_framework_errors_are_anthropic_shaped(http: httpx.Client) -> None:
    r = http.post("/v1/messages", content=b"{nope", headers={"Content-Type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    r = http.get("/v1/messages")
    assert r.status_code == 405 and r.json()["type"] == "error"


# ---- no model needed -----------------------------------------------------------------------


def test_auth_with_x_api_key_and_503_while_loading() -> None:
    app = create_app(EngineConfig(), api_key="s3cret", model_id="m")
    body = {"max_tokens": 4, "messages": FRANCE}

    async def run() -> None:
        client = app.test_client()
        r = await client.post("/v1/messages", json=body)
        assert r.status_code == 401
        assert (await r.get_json())["error"]["type"] == "authentication_error"
        r = await client.post("/v1/messages", json=body, headers={"x-api-key": "wrong"})
        assert r.status_code == 401
        for headers in ({"x-api-key": "s3cret"}, {"Authorization": "Bearer s3cret"}):
            r = await client.post("/v1/messages", json=body, headers=headers)
            err = await r.get_json()
            assert r.status_code == 503 and err["type"] == "error" and r.headers["Retry-After"]

    asyncio.run(run())


def test_conversation_conversion() -> None:
    req = parse_messages({"max_tokens": 5, "system": "Be terse.", "tools": TOOLS,
                          "messages": [*WEATHER, {"role": "assistant", "content": "It is"}]})
    msgs, prefill = chat_messages(req)
    assert prefill == "It is"
    assert [m["role"] for m in msgs] == ["system", "user", "assistant", "tool", "assistant",
                                         "user"]
    assert msgs[2]["tool_calls"][0]["function"] == {"name": "get_weather",
                                                    "arguments": '{"city": "Paris"}'}
    assert msgs[3] == {"role": "tool", "tool_call_id": "toolu_1", "content": "sunny, 21 C"}
    inline = inline_past_calls(msgs, HERMES)  # for a template that renders no tool_calls
    assert inline[2] == {"role": "assistant", "content": '<tool_call>\n{"name": "get_weather", '
                         '"arguments": {"city": "Paris"}}\n</tool_call>'}
    assert req.tools is not None and req.tools[0]["function"]["parameters"]["required"] == \
        ["city"]
    assert req.options == {"max_tokens": 5}
