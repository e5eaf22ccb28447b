"""HTTP layer pieces that need no model: request parsing, tool-call parsing, SSE keepalive, auth."""

from __future__ import annotations

import asyncio
import json

import pytest

from slotserve.api.app import create_app
from slotserve.api.errors import APIError
from slotserve.api.schemas import check_response_format, parse_body, parse_chat, parse_completion
from slotserve.api.server import startup_banner
from slotserve.api.sse import with_keepalive
from slotserve.api.tools import ToolChoice, with_system_text
from slotserve.engine import EngineConfig

USER = [{"role": "user", "content": "hi"}]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {}}}]


def api_error(fn, *args):  # type: ignore[no-untyped-def]
    with pytest.raises(APIError) as info:
        fn(*args)
    return info.value


# ---- request parsing -----------------------------------------------------------------------


@pytest.mark.parametrize("raw, needle", [
    (b"", "empty"), (b"{", "malformed JSON"), (b"[1]", "JSON object"),
    (b'{"temperature": NaN}', "malformed JSON"), (b'{"a": "\\ud800"}', "surrogate"),
    (b"[" * 100_000, "malformed JSON"),
])
def test_parse_body_rejects(raw: bytes, needle: str) -> None:
    err = api_error(parse_body, raw)
    assert err.status == 400 and needle in err.message


@pytest.mark.parametrize("body, param", [
    ({}, "messages"),
    ({"messages": "hi"}, "messages"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
    ({"messages": [{"role": [], "content": "x"}]}, "messages[0].role"),
    ({"messages": [{"role": {"a": 1}, "content": "x"}]}, "messages[0].role"),
    ({"messages": [{"role": "user"}]}, "messages[0].content"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
     "messages[0].content[0]"),
    ({"messages": USER, "temperature": "hot"}, "temperature"),
    ({"messages": USER, "max_tokens": 0}, "max_tokens"),
    ({"messages": USER, "max_completion_tokens": 1.5}, "max_completion_tokens"),
    ({"messages": USER, "stop": [1]}, "stop"),
    ({"messages": USER, "n": 2}, "n"),
    ({"messages": USER, "logit_bias": {"x": 1}}, "logit_bias"),
    # int() takes these, a token id is plain ASCII digits
    ({"messages": USER, "logit_bias": {"1_000": 1}}, "logit_bias"),
    ({"messages": USER, "logit_bias": {" 1": 1}}, "logit_bias"),
    ({"messages": USER, "logit_bias": {"1\n": 1}}, "logit_bias"),
    ({"messages": USER, "logit_bias": {"\u0663": 1}}, "logit_bias"),
    ({"messages": USER, "logit_bias": {"\uff11": 1}}, "logit_bias"),
    ({"messages": USER, "logit_bias": {"-1": 1}}, "logit_bias"),
    ({"messages": USER, "logit_bias": {"5": float("inf")}}, "logit_bias"),
    ({"messages": USER, "temperature": float("inf")}, "temperature"),  # JSON's 1e400
    ({"messages": USER, "repetition_penalty": 10**400}, "repetition_penalty"),  # no float
    ({"messages": USER, "top_logprobs": 3}, "top_logprobs"),
    ({"messages": USER, "stream": "yes"}, "stream"),
    ({"messages": USER, "tools": {}}, "tools"),
    ({"messages": USER, "tool_choice": "required"}, "tool_choice"),
    ({"messages": USER, "tools": TOOLS, "tool_choice": {"function": {"name": "nope"}}},
     "tool_choice"),
    ({"messages": USER, "response_format": {"type": "json_schema"}}, "response_format"),
])
def test_parse_chat_names_the_field(body: dict, param: str) -> None:
    err = api_error(parse_chat, body)
    assert err.status == 400 and err.param == param, err.message


def test_parse_chat_caps_messages() -> None:
    from slotserve.api.limits import MAX_MESSAGES

    parse_chat({"messages": USER * MAX_MESSAGES})
    err = api_error(parse_chat, {"messages": USER * (MAX_MESSAGES + 1)})
    assert err.status == 400 and (err.param, err.code) == ("messages", "array_above_max_length")


def test_parse_chat_options() -> None:
    req = parse_chat({
        "messages": [{"role": "developer", "content": [{"type": "text", "text": "a"},
                                                       {"type": "text", "text": "b"}]},
                     {"role": "assistant", "content": None,
                      "tool_calls": [{"id": "c1", "type": "function",
                                      "function": {"name": "f", "arguments": "{}"}}]},
                     {"role": "tool", "content": "ok", "tool_call_id": "c1"}],
        "max_tokens": 5, "max_completion_tokens": 7, "stop": "x", "top_k": -1, "seed": 3,
        "logit_bias": {"42": -100}, "logprobs": True, "top_logprobs": 2,
        "stream": True, "stream_options": {"include_usage": True},
        "response_format": {"type": "text"}, "tools": TOOLS,
        "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
    })
    assert req.messages[0] == {"role": "system", "content": "a\nb"}
    assert req.messages[1]["content"] == "" and req.messages[1]["tool_calls"][0]["id"] == "c1"
    assert req.options == {"max_tokens": 7, "stop": ["x"], "top_k": 0, "seed": 3,
                           "logit_bias": {42: -100.0}, "ignore_eos": False, "logprobs": True,
                           "top_logprobs": 2}
    assert req.stream and req.include_usage
    assert req.tool_choice == ToolChoice("function", "get_weather")


def test_denormal_temperature_is_greedy() -> None:
    assert parse_chat({"messages": USER, "temperature": 1e-300}).options["temperature"] == 0.0
    assert parse_chat({"messages": USER, "temperature": 1e-6}).options["temperature"] == 1e-6


def test_response_format_switch() -> None:
    assert check_response_format(None) is None
    assert check_response_format({"type": "json_object"}) == {"type": "json_object"}
    err = api_error(check_response_format, {"type": "yaml"})
    assert "response_format" in err.message


@pytest.mark.parametrize("prompt, expect", [
    ("hello", "hello"), (["hello"], "hello"), ([1, 2, 3], [1, 2, 3]), ([[4, 5]], [4, 5]),
])
def test_completion_prompts(prompt: object, expect: object) -> None:
    assert parse_completion({"prompt": prompt}).prompt == expect


@pytest.mark.parametrize("body, param", [
    ({}, "prompt"), ({"prompt": ""}, "prompt"), ({"prompt": ["a", "b"]}, "prompt"),
    ({"prompt": [1, "a"]}, "prompt"), ({"prompt": "x", "echo": True}, "echo"),
    ({"prompt": "x", "logprobs": 99}, "logprobs"), ({"prompt": "x", "best_of": 2}, "best_of"),
])
def test_parse_completion_rejects(body: dict, param: str) -> None:
    assert api_error(parse_completion, body).param == param


# ---- tool calls (the parsers: tests/test_tool_formats.py) -------------------------------


def test_with_system_text() -> None:
    assert with_system_text(USER, "T")[0] == {"role": "system", "content": "T"}
    merged = with_system_text([{"role": "system", "content": "S"}, *USER], "T")
    assert merged[0]["content"] == "S\n\nT" and len(merged) == 2


# ---- SSE keepalive -------------------------------------------------------------------------


def test_keepalive_ticks_and_loses_nothing() -> None:
    async def slow() -> object:
        for i in range(3):
            await asyncio.sleep(0.05)
            yield i

    async def run() -> list[object]:
        return [x async for x in with_keepalive(slow(), 0.01)]

    items = asyncio.run(run())
    assert [x for x in items if x is not None] == [0, 1, 2]
    assert items.count(None) >= 3


def test_keepalive_close_closes_source() -> None:
    closed = asyncio.Event()

    async def endless() -> object:
        try:
            while True:
                await asyncio.sleep(10)
                yield 1
        finally:
            closed.set()

    async def run() -> None:
        it = with_keepalive(endless(), 0.01)
        assert await anext(it) is None
        await it.aclose()
        assert closed.is_set()

    asyncio.run(run())


# ---- app without a model -------------------------------------------------------------------


def test_auth_and_health_without_engine() -> None:
    app = create_app(EngineConfig(), api_key="s3cret", model_id="m")

    async def run() -> None:
        client = app.test_client()
        r = await client.get("/health")  # open, and 503: nothing loaded
        assert r.status_code == 503 and (await r.get_json())["status"] == "loading"
        r = await client.get("/v1/models")
        assert r.status_code == 401
        assert (await r.get_json())["error"]["code"] == "invalid_api_key"
        r = await client.get("/v1/models", headers={"Authorization": "Bearer wrong"})
        assert r.status_code == 401
        r = await client.get("/v1/models", headers={"Authorization": "Bearer s3cret"})
        assert r.status_code == 200 and (await r.get_json())["data"][0]["id"] == "m"
        r = await client.post("/v1/chat/completions", json={"messages": USER},
                              headers={"Authorization": "Bearer s3cret"})
        assert r.status_code == 503 and r.headers["Retry-After"]

    asyncio.run(run())


def test_banner_has_url_and_curl() -> None:
    text = startup_banner("0.0.0.0", 8123, api_keys="sk-banner-key", model="SmolLM2")
    assert "http://localhost:8123" in text and "curl" in text and "Bearer <key>" in text
    assert "auth: 1 API key" in text
    assert "sk-banner-key" not in text  # the key itself is never printed
    assert "no API key" in startup_banner("0.0.0.0", 8123)


def test_json_text_never_holds_a_raw_line_separator() -> None:
    """U+0085 / U+2028 / U+2029 are escaped: splitlines-based SSE readers (requests'
    iter_lines) would cut a data line at them; the JSON still decodes to the same text."""
    from slotserve.api.errors import dumps

    payload = {"delta": {"content": "a\u2028b\u2029c\x85d \u00e9"}}
    text = dumps(payload)
    assert len(("data: " + text).splitlines()) == 1
    assert json.loads(text) == payload and "\u00e9" in text
