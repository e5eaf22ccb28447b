"""What coding agents send, accepted (real server, SmolLM2): Claude Code's Messages request
(mid-conversation system, thinking / context_management / output_config, a max_tokens past
the context, server tools, its per-request billing-header line), count_tokens, cached tokens
in the usage, either auth header on every route, CORS preflight, HEAD /, any model name unless
--strict-model-names, system_fingerprint, and one access-log line per request."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import structlog

from slotserve.api.app import create_app
from slotserve.api.server import BackgroundServer
from slotserve.engine import EngineConfig

KEY = "agent-key"
TOOLS = [{"name": "get_weather", "description": "Weather for a city",
          "input_schema": {"type": "object", "properties": {"city": {"type": "string"}},
                           "required": ["city"]}},
         {"type": "web_search_20250305", "name": "web_search", "max_uses": 5}]


def billing(n: int) -> dict[str, Any]:
    return {"type": "text", "text": f"x-anthropic-billing-header: cc_version=2.1.197.{n}; "
                                    f"cc_entrypoint=cli; cch={n:05d};"}


def claude_code_body(n: int, **extra: Any) -> dict[str, Any]:
    """Claude Code 2.1's request shape: a fresh billing line every request."""
    return {
        "model": "claude-opus-4-8", "max_tokens": 64000, "stream": True,
        "system": [billing(n), {"type": "text", "text": "You are Claude Code.",
                                "cache_control": {"type": "ephemeral"}}],
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "What is 2 + 2?"}]},
            {"role": "assistant", "content": [
                {"type": "thinking", "thinking": "Simple.", "signature": "sig"},
                {"type": "text", "text": "4."}]},
            {"role": "system", "content": "The user prefers short answers."},
            {"role": "user", "content": [{"type": "text", "text": "And 3 + 3?"}]}],
        "tools": TOOLS, "thinking": {"type": "adaptive"},
        "context_management": {"edits": [{"type": "clear_thinking_20251015"}]},
        "output_config": {"effort": "high"}, "temperature": 0, **extra}


@pytest.fixture(scope="module")
def srv() -> Iterator[BackgroundServer]:
    server = BackgroundServer(create_app(EngineConfig(max_slots=2, max_queue=8), api_key=KEY,
                                         keepalive_interval=0.2)).start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def http(srv: BackgroundServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=srv.url, timeout=120, headers={"x-api-key": KEY}) as c:
        yield c


def stream_events(http: httpx.Client, path: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    with http.stream("POST", path, json=body) as r:
        assert r.status_code == 200, r.read()
        return [json.loads(x[6:]) for x in r.iter_lines() if x.startswith("data: ")]


def test_claude_code_request_and_billing_line(http: httpx.Client) -> None:
    """Claude Code's default request runs (max_tokens 64000 is cut to what fits); the billing
    line, different every request, is kept out of the prompt, so the next request reuses the
    whole cached prompt; usage says so in cache_read_input_tokens, and count_tokens counts the
    same prompt."""
    first = stream_events(http, "/v1/messages?beta=true", claude_code_body(1, max_tokens=64000))
    assert [e["type"] for e in first][:1] == ["message_start"]
    assert first[-1]["type"] == "message_stop"
    usage = first[-2]["usage"]
    prompt = usage["input_tokens"] + usage["cache_read_input_tokens"]
    second = stream_events(http, "/v1/messages?beta=true", claude_code_body(2, max_tokens=3))
    again = second[-2]["usage"]
    assert again["input_tokens"] + again["cache_read_input_tokens"] == prompt
    assert again["cache_read_input_tokens"] >= prompt - 1
    assert second[0]["message"]["usage"]["cache_read_input_tokens"] == \
        again["cache_read_input_tokens"]
    body = claude_code_body(3)
    del body["max_tokens"], body["stream"]
    counted = http.post("/v1/messages/count_tokens", json=body)
    assert counted.status_code == 200 and counted.json() == {"input_tokens": prompt}


def test_tool_result_blocks_and_non_streamed_usage(http: httpx.Client) -> None:
    body = {"model": "any", "max_tokens": 2, "temperature": 0, "tools": TOOLS[:1], "messages": [
        {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1",
                                           "name": "get_weather", "input": {"city": "Oslo"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1",
                                      "content": [{"type": "text", "text": "rain, 8 C"}]}]}]}
    r = http.post("/v1/messages", json=body)
    assert r.status_code == 200, r.text
    usage = r.json()["usage"]
    assert set(usage) >= {"input_tokens", "cache_read_input_tokens", "output_tokens"}
    counted = http.post("/v1/messages/count_tokens", json={**body, "max_tokens": None})
    assert counted.json()["input_tokens"] == usage["input_tokens"] + \
        usage["cache_read_input_tokens"]


def test_chat_max_tokens_clamped_and_fingerprint(srv: BackgroundServer) -> None:
    r = httpx.post(srv.url + "/v1/chat/completions", timeout=120,
                   headers={"Authorization": f"Bearer {KEY}"},
                   json={"model": "gpt-4o", "max_tokens": 10**6, "temperature": 0,
                         "messages": [{"role": "user", "content": "Say OK."}],
                         "stop": ["."], "tools": [{"type": "web_search"}]})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["system_fingerprint"].startswith("fp_")
    assert body["choices"][0]["finish_reason"] in ("stop", "length")


def test_either_key_header_cors_and_root(srv: BackgroundServer) -> None:
    base = srv.url
    ok = httpx.get(base + "/v1/models", headers={"x-api-key": KEY})
    assert ok.status_code == 200 and ok.json()["data"][0]["id"] == srv.state.model_id
    assert httpx.get(base + "/v1/models").status_code == 401
    r = httpx.post(base + "/v1/messages/count_tokens", headers={"Authorization": f"Bearer {KEY}"},
                   json={"messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 200 and r.json()["input_tokens"] > 0
    pre = httpx.request("OPTIONS", base + "/v1/chat/completions", headers={
        "Origin": "http://localhost:3000", "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization, content-type"})
    assert pre.status_code == 204
    assert pre.headers["Access-Control-Allow-Origin"] == "*"
    assert "POST" in pre.headers["Access-Control-Allow-Methods"]
    assert pre.headers["Access-Control-Allow-Headers"] == "authorization, content-type"
    assert httpx.head(base + "/").status_code == 200


def test_one_access_log_line_per_request(srv: BackgroundServer) -> None:
    with structlog.testing.capture_logs() as logs:
        for path in ("/health", "/v1/models", "/nope"):
            httpx.get(srv.url + path, headers={"x-api-key": KEY})
    lines = [(e["path"], e["status"]) for e in logs if e.get("event") == "request"]
    assert lines == [("/health", 200), ("/v1/models", 200), ("/nope", 404)]


def test_strict_model_names() -> None:
    """Any name is the served model; with strict names only the served id (and 'default')
    is, and others are a 404 naming what is served (checked before the engine is needed)."""
    async def status(app: Any, name: str) -> int:
        client = app.test_client()
        r = await client.post("/v1/chat/completions", json={
            "model": name, "messages": [{"role": "user", "content": "hi"}]})
        return r.status_code

    lenient = create_app(EngineConfig(), model_id="served")
    strict = create_app(EngineConfig(), model_id="served", strict_model_names=True)
    assert asyncio.run(status(lenient, "gpt-4o")) == 503  # past the name; nothing loaded
    assert asyncio.run(status(strict, "gpt-4o")) == 404
    assert asyncio.run(status(strict, "served")) == 503
