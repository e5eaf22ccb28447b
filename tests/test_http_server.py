"""The OpenAI-compatible server end to end: a real Hypercorn, the real bundled SmolLM2.

Two servers are shared by the module (loading takes seconds): `srv`, roomy, for correctness
tests, and `tiny` (2 slots, queue of 2) for overload. Graceful shutdown gets its own.
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
import requests
from engine_harness import wait_until
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from slotserve.api.app import create_app
from slotserve.api.server import BackgroundServer
from slotserve.engine import EngineConfig

FRANCE = [{"role": "user", "content": "What is the capital of France?"}]
KEEPALIVE = 0.2
MODEL = "default"


def start(**engine: Any) -> BackgroundServer:
    app = create_app(EngineConfig(**engine), keepalive_interval=KEEPALIVE)
    return BackgroundServer(app).start()


@pytest.fixture(scope="module")
def srv() -> Iterator[BackgroundServer]:
    server = start(max_slots=4, max_queue=16)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def tiny() -> Iterator[BackgroundServer]:
    server = start(max_slots=2, max_queue=2)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def client(srv: BackgroundServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def http(srv: BackgroundServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=srv.url, timeout=60) as c:
        yield c


def sse_lines(response: httpx.Response) -> list[str]:
    return [line for line in response.iter_lines() if line]


def sse_json(lines: list[str]) -> list[dict[str, Any]]:
    return [json.loads(x[6:]) for x in lines if x.startswith("data: {")]


def stream_text(chunks: list[dict[str, Any]]) -> str:
    return "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])


def busy_slots(base: str) -> int:
    return sum(s["busy"] for s in httpx.get(base + "/slots").json()["slots"])


def idle(server: BackgroundServer) -> bool:
    """No slot busy or still finishing a step, nothing queued (read from the engine itself)."""
    eng = server.state.engine
    return not eng.admission.queue and all(not s.busy and not s.in_flight for s in eng.slots)




# ---- basics --------------------------------------------------------------------------------


def test_health_models_metrics(srv: BackgroundServer, client: openai.OpenAI,
                               http: httpx.Client) -> None:
    assert http.get("/health").json() == {"status": "ok"}
    models = client.models.list().data
    assert [m.id for m in models] == [srv.state.model_id] == ["SmolLM2-135M-Instruct.Q4_1"]
    client.chat.completions.create(model=MODEL, messages=FRANCE, max_tokens=2)  # something to count
    text = http.get("/metrics").text
    for name in ("slotserve_requests_running", "slotserve_requests_queued",
                 "slotserve_slots_busy", "slotserve_kv_bytes_used", "slotserve_kv_bytes_budget",
                 "slotserve_prompt_tokens_total", "slotserve_generation_tokens_total",
                 "slotserve_prompt_tokens_reused_total",
                 "slotserve_time_to_first_token_seconds_bucket",
                 "slotserve_inter_token_latency_seconds_bucket",
                 'slotserve_requests_total{finish_reason="length"}', "slotserve_rejections_total"):
        assert name in text, name
    slots = http.get("/slots").json()["slots"]
    assert len(slots) == 4 and {"id", "busy", "resident_tokens"} <= set(slots[0])


def test_chat_paris_sync(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(model=MODEL, messages=FRANCE, temperature=0,
                                       max_tokens=16)
    assert "Paris" in r.choices[0].message.content
    assert r.choices[0].finish_reason == "stop" and r.object == "chat.completion"
    assert r.usage.prompt_tokens > 0 and r.usage.total_tokens == \
        r.usage.prompt_tokens + r.usage.completion_tokens


def test_stream_is_utf8_to_a_client_decoding_by_the_headers(srv: BackgroundServer) -> None:
    """Python requests decodes a text/* body without a charset as ISO-8859-1: the 0x85
    byte of Cyrillic х then reads as U+0085, which its iter_lines breaks a line at, and a
    data line's JSON ends inside a string (a Locust client hit it on sampled SmolLM2
    text). The stream names its charset, so the event lines arrive whole and decoded."""
    x = srv.state.engine.tokenizer.encode("х")
    assert len(x) == 1 and "х".encode() == b"\xd1\x85"
    body = {"messages": FRANCE, "max_tokens": 3, "temperature": 0, "stream": True,
            "logit_bias": {str(x[0]): 100}}
    with requests.post(srv.url + "/v1/chat/completions", json=body, stream=True,
                       timeout=60) as r:
        assert r.headers["content-type"] == "text/event-stream; charset=utf-8"
        lines = [line[6:] for line in r.iter_lines(decode_unicode=True)
                 if line.startswith("data: ") and line != "data: [DONE]"]
    text = "".join(choice["delta"].get("content") or ""
                   for event in map(json.loads, lines) for choice in event["choices"])
    assert text == "ххх"


@pytest.mark.parametrize("sampling", [{"temperature": 0}, {"temperature": 0.8, "seed": 1234}])
def test_stream_equals_non_stream(srv: BackgroundServer, sampling: dict[str, Any]) -> None:
    async def run() -> None:
        client = openai.AsyncOpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0)
        args = dict(messages=[{"role": "user", "content": "Tell me about the sea."}],
                    max_tokens=20, **sampling)
        whole = await client.chat.completions.create(model=MODEL, **args)
        parts, usage, reasons = [], None, []
        stream = await client.chat.completions.create(model=MODEL,
            **args, stream=True, stream_options={"include_usage": True})
        async for chunk in stream:
            if chunk.usage is not None:
                usage = chunk.usage
            for ch in chunk.choices:
                parts.append(ch.delta.content or "")
                reasons.append(ch.finish_reason)
        assert "".join(parts) == whole.choices[0].message.content
        assert reasons[-1] == whole.choices[0].finish_reason
        assert usage is not None and usage.completion_tokens == whole.usage.completion_tokens
        assert usage.prompt_tokens == whole.usage.prompt_tokens
        await client.close()

    asyncio.run(run())


def test_stop_strings_and_max_completion_tokens(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(model=MODEL, messages=FRANCE, temperature=0, max_tokens=16,
                                       stop=[" Paris", "zzz"])
    assert r.choices[0].message.content == "The capital of France is"
    assert r.choices[0].finish_reason == "stop"
    r = client.chat.completions.create(model=MODEL, messages=FRANCE, temperature=0, stop=" Paris",
                                       max_completion_tokens=3, stream=True)
    chunks = list(r)
    assert chunks[-1].choices[0].finish_reason == "length"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == "The capital of"


def test_logprobs_shape(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(model=MODEL, messages=FRANCE, temperature=0, max_tokens=6,
                                       logprobs=True, top_logprobs=3)
    entries = r.choices[0].logprobs.content
    assert len(entries) == r.usage.completion_tokens == 6
    for e in entries:
        assert isinstance(e.token, str) and e.logprob <= 0 and bytes(e.bytes).decode() == e.token
        assert len(e.top_logprobs) == 3 and e.top_logprobs[0].logprob >= e.top_logprobs[1].logprob
        assert e.logprob in [t.logprob for t in e.top_logprobs]
    assert "".join(e.token for e in entries) == r.choices[0].message.content
    stream = client.chat.completions.create(model=MODEL, messages=FRANCE, temperature=0,
                                            max_tokens=6, logprobs=True, top_logprobs=3,
                                            stream=True)
    streamed = [e for c in stream for ch in c.choices if ch.logprobs for e in ch.logprobs.content]
    assert [(e.token, e.logprob) for e in streamed] == [(e.token, e.logprob) for e in entries]


def test_completions(client: openai.OpenAI, srv: BackgroundServer) -> None:
    r = client.completions.create(model=MODEL, prompt="The capital of France is",
                                  temperature=0, max_tokens=6, logprobs=2)
    text = r.choices[0].text
    assert "Paris" in text and r.object == "text_completion"
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 6
    assert "".join(lp.tokens) == text and lp.text_offset[0] == 0
    ids = srv.state.engine.tokenizer.encode("The capital of France is")
    chunks = list(client.completions.create(model=MODEL, prompt=ids, temperature=0, max_tokens=6,
                                            stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == text
    assert chunks[-1].usage.completion_tokens == 6


def test_tool_calls(client: openai.OpenAI) -> None:
    tools = [{"type": "function", "function": {
        "name": "get_weather", "description": "Weather for a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]
    messages = [  # one worked example, so a 135M model follows the Hermes format
        {"role": "user", "content": "What is the weather in Paris?"},
        {"role": "assistant",
         "content": '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}'
                    '</tool_call>'},
        {"role": "tool", "content": "sunny, 21 C"},
        {"role": "assistant", "content": "It is sunny and 21 C in Paris."},
        {"role": "user", "content": "What is the weather in Berlin?"},
    ]
    r = client.chat.completions.create(model=MODEL, messages=messages, tools=tools, temperature=0,
                                       max_tokens=40, tool_choice="auto")
    call = r.choices[0].message.tool_calls[0]
    assert r.choices[0].finish_reason == "tool_calls" and call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Berlin"}
    assert call.id.startswith("call_")
    stream = client.chat.completions.create(model=MODEL,
        messages=messages, tools=tools, temperature=0, max_tokens=40, stream=True,
        tool_choice={"type": "function", "function": {"name": "get_weather"}})
    name, args, reason = "", "", None
    for chunk in stream:
        ch = chunk.choices[0]
        reason = ch.finish_reason or reason
        for tc in ch.delta.tool_calls or []:
            name += tc.function.name or ""
            args += tc.function.arguments or ""
    assert (name, json.loads(args), reason) == ("get_weather", {"city": "Berlin"}, "tool_calls")
    r = client.chat.completions.create(model=MODEL, messages=messages, tools=tools, temperature=0,
                                       max_tokens=8, tool_choice="none")
    assert r.choices[0].message.tool_calls is None


def test_stream_matches_in_process_engine(srv: BackgroundServer, http: httpx.Client) -> None:
    """The SSE text is byte for byte what `Engine.generate` yields for the same request."""
    messages = [{"role": "user", "content": "Write a short poem about rain."}]
    opts = {"max_tokens": 24, "temperature": 0.8, "seed": 7, "top_p": 0.9}

    async def in_process() -> tuple[str, int]:
        engine = srv.state.engine
        req = engine.make_request(engine.render_chat(messages), **opts)
        parts, n = [], 0
        async for d in engine.generate(req):
            parts.append(d.text)
            n += len(d.token_ids)
        return "".join(parts), n

    expected, n_tokens = srv.call(in_process())
    with http.stream("POST", "/v1/chat/completions",
                     json={"messages": messages, "stream": True, **opts,
                           "stream_options": {"include_usage": True}}) as r:
        chunks = sse_json(sse_lines(r))
    assert stream_text(chunks).encode() == expected.encode()
    assert chunks[-1]["usage"]["completion_tokens"] == n_tokens


# ---- bad input -----------------------------------------------------------------------------


@pytest.mark.parametrize("body, status, needle", [
    (b"{not json", 400, "malformed JSON"),
    (b'"just a string"', 400, "JSON object"),
    (b'{"model": "x"}', 400, "'messages' is required"),
    (b'{"messages": {"role": "user"}}', 400, "'messages'"),
    (b'{"messages": [{"role": "user", "content": 5}]}', 400, "messages[0].content"),
    (b'{"messages": [{"role": "user", "content": "hi"}], "temperature": "hot"}', 400,
     "temperature"),
    (b'{"messages": [{"role": "user", "content": "hi"}], "temperature": 7}', 400,
     "temperature"),
    (b'{"messages": [{"role": "user", "content": "hi"}], "logit_bias": {"999999": 5}}', 400,
     "logit_bias"),
    (b'{"messages": [{"role": "user", "content": "hi"}], "n": 2}', 400, "not supported"),
    (b'{"messages": [{"role": "user", "content": "hi"}], "response_format": '
     b'{"type": "json_schema", "json_schema": {"schema": {"type": "nonsense"}}}}', 400,
     "response_format"),
])
def test_bad_chat_requests(http: httpx.Client, body: bytes, status: int, needle: str) -> None:
    r = http.post("/v1/chat/completions", content=body,
                  headers={"Content-Type": "application/json"})
    assert r.status_code == status
    err = r.json()["error"]
    assert needle in json.dumps(err) and err["type"] == "invalid_request_error"


def test_too_long_prompt_names_both_numbers(http: httpx.Client, srv: BackgroundServer) -> None:
    ctx = srv.state.engine.context_length
    long = [{"role": "user", "content": "hello " * (ctx + 100)}]
    r = http.post("/v1/chat/completions", json={"messages": long, "max_tokens": 4})
    msg = r.json()["error"]["message"]
    assert r.status_code == 400 and str(ctx) in msg
    n_prompt = int(msg.split("prompt is ")[1].split()[0])
    assert n_prompt > ctx  # (a max_tokens past the context is cut to fit: test_agent_compat)


def test_http_level_errors(http: httpx.Client, srv: BackgroundServer) -> None:
    r = http.post("/v1/chat/completions", content=b"x" * (9 * 2**20))
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
    r = http.get("/v2/nothing")
    assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"
    r = http.get("/v1/chat/completions")
    assert r.status_code == 405 and r.json()["error"]["code"] == "method_not_allowed"
    r = http.post("/v1/completions", json={"prompt": "x", "echo": True})
    assert r.status_code == 400 and "echo" in r.json()["error"]["message"]
    r = http.post("/v1/completions", json={"prompt": [1, 10**9], "max_tokens": 1})
    assert r.status_code == 400 and "out of range" in r.json()["error"]["message"]


# ---- streaming lifecycle -------------------------------------------------------------------


def test_disconnect_frees_the_slot(srv: BackgroundServer) -> None:
    with httpx.Client(base_url=srv.url, timeout=30) as c, c.stream(
            "POST", "/v1/chat/completions",
            json={"messages": FRANCE, "max_tokens": 2000, "ignore_eos": True, "stream": True},
    ) as r:
        lines = r.iter_lines()
        seen = 0
        while seen < 4:
            seen += next(lines).startswith("data: {")
        assert busy_slots(srv.url) == 1
        r.close()  # the client goes away mid-stream
        # the engine cancels the request and frees the slot
        assert wait_until(lambda: busy_slots(srv.url) == 0, timeout=2.0)
    metrics = httpx.get(srv.url + "/metrics").text
    assert 'slotserve_requests_total{finish_reason="cancelled"}' in metrics


def test_overload_429_and_keepalive(tiny: BackgroundServer) -> None:
    """Fill both slots and the queue; a fifth request gets 429 + Retry-After, and the queued
    streams receive keepalive comments while they wait."""
    long = {"messages": FRANCE, "max_tokens": 2000, "ignore_eos": True, "stream": True}
    assert wait_until(lambda: idle(tiny), timeout=5.0)

    async def run() -> None:
        async with httpx.AsyncClient(base_url=tiny.url, timeout=30) as c:
            streams = []
            for _ in range(4):
                ctx = c.stream("POST", "/v1/chat/completions", json=long)
                streams.append((ctx, await ctx.__aenter__()))
            kv = (await c.get("/slots")).json()["kv"]
            assert (kv["running"], kv["queued"]) == (2, 2)
            r = await c.post("/v1/chat/completions", json={"messages": FRANCE, "max_tokens": 2})
            assert r.status_code == 429 and int(r.headers["Retry-After"]) >= 1
            assert r.json()["error"]["type"] == "rate_limit_exceeded"
            queued = streams[3][1]
            lines = []
            async for line in queued.aiter_lines():
                lines.append(line)
                if line == ": keepalive":
                    break
            assert not any('"content": "' in x and '"content": ""' not in x for x in lines)
            for ctx, _ in reversed(streams):
                await ctx.__aexit__(None, None, None)
        metrics = httpx.get(tiny.url + "/metrics").text
        assert 'slotserve_rejections_total{reason="queue_full"}' in metrics

    asyncio.run(run())
    # cancelled while running and while queued: everything is released
    assert wait_until(lambda: idle(tiny), timeout=3.0)
    kv = httpx.get(tiny.url + "/slots").json()["kv"]
    assert (kv["queued"], kv["running"], kv["busy"]) == (0, 0, 0)


def test_sixteen_concurrent_clients(tiny: BackgroundServer) -> None:
    async def one(client: openai.AsyncOpenAI, i: int) -> str:
        try:
            if i % 2:
                r = await client.chat.completions.create(model=MODEL, messages=FRANCE, max_tokens=8,
                                                         temperature=0)
                return "ok" if r.choices[0].message.content else "empty"
            stream = await client.chat.completions.create(
                model=MODEL, messages=FRANCE, max_tokens=8, temperature=0, stream=True)
            text = "".join([c.choices[0].delta.content or "" async for c in stream])
            return "ok" if text else "empty"
        except openai.RateLimitError as exc:
            assert int(exc.response.headers["retry-after"]) >= 1
            return "429"

    async def run() -> list[str]:
        client = openai.AsyncOpenAI(base_url=tiny.url + "/v1", api_key="x", max_retries=0)
        try:
            return await asyncio.gather(*(one(client, i) for i in range(16)))
        finally:
            await client.close()

    assert wait_until(lambda: idle(tiny), timeout=5.0)
    outcomes = asyncio.run(run())
    # both slots and both queue places are used; everything else is a clean 429
    assert set(outcomes) <= {"ok", "429"} and outcomes.count("ok") >= 4, outcomes
    assert wait_until(lambda: busy_slots(tiny.url) == 0, timeout=3.0)


def test_graceful_shutdown_ends_streams_cleanly() -> None:
    server = start(max_slots=2, max_queue=2)
    body = {"messages": FRANCE, "max_tokens": 24, "ignore_eos": True, "stream": True}
    try:
        with httpx.Client(base_url=server.url, timeout=30) as c, \
                c.stream("POST", "/v1/chat/completions", json=body) as r:
            lines = r.iter_lines()
            first = [next(lines) for _ in range(4)]  # role chunk and first content
            stopper = threading.Thread(target=server.stop)
            stopper.start()
            assert wait_until(lambda: server.state.status == "shutting_down", timeout=2.0)
            health = httpx.get(server.url + "/health")
            assert health.status_code == 503 and health.json()["status"] == "shutting_down"
            rest = [x for x in first + list(lines) if x]
        stopper.join(30)
        assert not stopper.is_alive() and server.error is None
    finally:
        server.stop()
    chunks = sse_json(rest)
    assert rest[-1] == "data: [DONE]"
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert len(stream_text(chunks)) > 0


# ---- fuzz ----------------------------------------------------------------------------------

# Numbers that pass a naive range check and break float32 arithmetic (1e-50 is 0 there, 1e308
# inf), or that no float holds (10**400); keys that int() takes but are no plain token id.
_hostile = st.sampled_from([1e-50, 1e-45, 1e-40, 5e-324, 1e-30, 1e308, -1e308, 10**400,
                            -(10**400), 2**64, 0.01, 100.0, 100.5])
_bad_ids = st.sampled_from(["1_000", " 1", "1 ", "\u0663", "\u0661\u0660", "\uff11", "+1",
                            "-1", "0x1", "1e3", "", "01", "99999999999999999999", "49152"])
_raw_hostile = st.sampled_from([  # JSON that json.dumps never writes
    b'{"messages": [{"role": "user", "content": "hi"}], "temperature": 1e400, "max_tokens": 2}',
    b'{"messages": [{"role": "user", "content": "hi"}], "top_p": -1e400, "max_tokens": 2}',
    b'{"prompt": "hi", "repetition_penalty": 1e-400, "max_tokens": 2, "logprobs": 2}',
    b'{"prompt": "hi", "logit_bias": {"5": 1e999}, "max_tokens": 2}',
    b'{"prompt": "hi", "frequency_penalty": Infinity, "max_tokens": 2}',
    b'{"prompt": "hi", "temperature": NaN, "max_tokens": 2}',
])
_scalar = (st.none() | st.booleans() | st.integers(-(2**70), 2**70)
           | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=12))
_json = st.recursive(_scalar, lambda inner: st.lists(inner, max_size=3)
                     | st.dictionaries(st.text(max_size=6), inner, max_size=3), max_leaves=8)
_message = st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "system", "assistant", "tool", "x"]) | _json},
    optional={"content": st.text(max_size=30) | _json, "name": _json, "tool_calls": _json})
_fields = {
    "model": st.sampled_from(["default", "SmolLM2-135M-Instruct.Q4_1", "nope"]) | _json,
    "messages": st.lists(_message, max_size=3) | _json,
    "prompt": st.text(max_size=30) | st.lists(st.integers(-5, 60_000), max_size=5) | _json,
    "stream": st.booleans() | _json, "stream_options": _json,
    "stop": st.text(max_size=4) | st.lists(st.text(max_size=4), max_size=3) | _json,
    "temperature": st.floats(-1, 3) | _hostile | _json,
    "top_p": st.floats(-0.5, 1.5) | _hostile | _json,
    "top_k": st.integers(-3, 100) | _hostile | _json, "min_p": st.floats(-1, 2) | _hostile | _json,
    "seed": st.integers() | _json, "frequency_penalty": st.floats(-3, 3) | _hostile | _json,
    "presence_penalty": _hostile | _json,
    "repetition_penalty": st.floats(-1, 3) | _hostile | _hostile | _json,
    "logit_bias": st.dictionaries(st.integers(-10, 60_000).map(str) | _bad_ids,
                                  st.floats(-200, 200) | _hostile, max_size=3) | _json,
    "logprobs": st.booleans() | st.integers(-1, 30) | _json,
    "top_logprobs": st.integers(-1, 30) | _json, "n": st.integers(0, 3) | _json,
    "tools": _json, "tool_choice": st.sampled_from(["auto", "none", "required"]) | _json,
    "response_format": st.just({"type": "json_object"}) | _json, "echo": _json,
    "ignore_eos": _json,
    "max_tokens": _json, "max_completion_tokens": _json,
}


def _bounded(body: dict[str, Any]) -> dict[str, Any]:
    """Whatever else is random, never let a valid request generate more than 2 tokens."""
    for key in ("max_tokens", "max_completion_tokens"):
        v = body.get(key)
        if v is None or (isinstance(v, int | float) and not isinstance(v, bool) and v > 2):
            body[key] = 2
    return body


_valid = {  # mostly valid requests, so the fuzz also exercises generation paths
    "model": st.sampled_from(["default", "SmolLM2-135M-Instruct.Q4_1"]),
    "stream": st.booleans(), "stream_options": st.fixed_dictionaries({"include_usage":
                                                                      st.booleans()}),
    "temperature": st.floats(0, 2), "top_p": st.floats(0.01, 1), "top_k": st.integers(0, 50),
    "min_p": st.floats(0, 1), "seed": st.integers(0, 2**64), "stop": st.text(max_size=3),
    "frequency_penalty": st.floats(-2, 2), "repetition_penalty": st.floats(0.5, 2),
    "logit_bias": st.dictionaries(st.integers(0, 49151).map(str), st.floats(-100, 100),
                                  max_size=2),
}
_chat_base = st.fixed_dictionaries(
    {"messages": st.lists(st.fixed_dictionaries({
        "role": st.sampled_from(["user", "system", "assistant"]),
        "content": st.text(max_size=40)}), min_size=1, max_size=2)},
    optional={**_valid, "logprobs": st.just(True), "top_logprobs": st.integers(0, 5)})
_completion_base = st.fixed_dictionaries(
    {"prompt": st.text(min_size=1, max_size=40) | st.lists(st.integers(0, 49151), min_size=1,
                                                            max_size=6)},
    optional={**_valid, "logprobs": st.integers(0, 5)})
_mutations = st.lists(st.sampled_from(sorted(_fields)), max_size=2, unique=True).flatmap(
    lambda keys: st.fixed_dictionaries({k: _fields[k] for k in keys}))
_requests = st.one_of(
    st.tuples(st.just("/v1/chat/completions"), _chat_base, _mutations),
    st.tuples(st.just("/v1/completions"), _completion_base, _mutations),
).map(lambda t: (t[0], _bounded({**t[1], **t[2]})))


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} in a response: not JSON")


def strict_json(text: str | bytes) -> Any:
    """json.loads without NaN / Infinity (which Python's json takes and writes by default)."""
    return json.loads(text, parse_constant=_no_constant)


_HI = [{"role": "user", "content": "hi"}]


@settings(max_examples=60, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(request=_requests, raw=st.none() | st.none() | st.none() | st.binary(max_size=40)
       | _raw_hostile)
@example(request=("/v1/chat/completions", {"messages": _HI, "max_tokens": 2, "logprobs": True,
                                           "repetition_penalty": 1e-50, "ignore_eos": True}),
         raw=None)
@example(request=("/v1/chat/completions", {"messages": _HI, "max_tokens": 2, "temperature": 0,
                                           "repetition_penalty": 1e-50, "ignore_eos": True,
                                           "response_format": {"type": "json_object"}}),
         raw=None)
@example(request=("/v1/completions", {"prompt": "hi", "max_tokens": 2, "logprobs": 3,
                                      "repetition_penalty": 1e308}), raw=None)
@example(request=("/v1/completions", {"prompt": "hi", "max_tokens": 2, "stream": True,
                                      "logprobs": 1, "top_p": 1e-50}), raw=None)
@example(request=("/v1/chat/completions", {"messages": _HI, "max_tokens": 2,
                                           "temperature": 10**400}), raw=None)
@example(request=("/v1/chat/completions", {"messages": _HI, "max_tokens": 2,
                                           "logit_bias": {"\u0663": 5, "1_000": 1, " 1": 2}}),
         raw=None)
def test_fuzz_never_5xx(http: httpx.Client, request: tuple[str, dict[str, Any]],
                        raw: bytes | None) -> None:
    """Nothing a client sends gets a 5xx, and every answer is strict JSON (no NaN)."""
    path, body = request
    content = raw if raw is not None else json.dumps(body).encode()
    with http.stream("POST", path, content=content,
                     headers={"Content-Type": "application/json"}) as r:
        data = r.read()
        assert r.status_code < 500, data[:500]
        if r.headers.get("content-type", "").startswith("text/event-stream"):
            assert data.rstrip().endswith(b"data: [DONE]")
            events = [line[6:] for line in data.decode().splitlines()
                      if line.startswith("data: ") and line != "data: [DONE]"]
            assert events and all(isinstance(strict_json(e), dict) for e in events)
        else:
            payload = strict_json(data)
            assert "error" in payload if r.status_code >= 400 else "choices" in payload


@pytest.mark.parametrize("extra, param", [
    ({"repetition_penalty": 1e-50}, "repetition_penalty"),  # 0 in float32: NaN logits
    ({"repetition_penalty": 1e308}, "repetition_penalty"),  # inf in float32
    ({"top_p": 1e-50}, "top_p"),
    ({"temperature": 10**400}, "temperature"),  # no float holds it
    ({"logit_bias": {"1_000": 1}}, "logit_bias"),  # int() takes these three
    ({"logit_bias": {" 1": 1}}, "logit_bias"),
    ({"logit_bias": {"\u0663": 1}}, "logit_bias"),
    ({"logit_bias": {"49152": 1}}, "logit_bias"),  # one past the vocabulary
])
def test_numbers_checked_as_the_sampler_uses_them(http: httpx.Client, extra: dict[str, Any],
                                                  param: str) -> None:
    for path, base in (("/v1/chat/completions", {"messages": _HI}), ("/v1/completions",
                                                                      {"prompt": "hi"})):
        r = http.post(path, json={**base, "max_tokens": 2, "logprobs": 1 if "prompt" in base
                                  else True, **extra,
                                  "response_format": {"type": "json_object"}})
        err = strict_json(r.content)["error"]
        assert r.status_code == 400 and err["param"] == param, (path, err)
    r = http.post("/v1/messages", content=b'{"max_tokens": 2, "temperature": 1e400, '
                  b'"messages": [{"role": "user", "content": "hi"}]}')
    assert r.status_code == 400 and strict_json(r.content)["type"] == "error"
