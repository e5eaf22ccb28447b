"""The coding agents' recorded requests replayed against the real server (SmolLM2), so the suite
covers OpenCode, Codex CLI and Claude Code without node: each fixture in tests/fixtures/agents/
holds one agent's requests as `make e2e` recorded them (loadtests/agents_e2e.py --record; long
texts cut, no secrets; see loadtests/agents_record.py). Every request is sent again, as
recorded but with its output-token limit cut to a few tokens (or set, where the agent sends
none), and the answer must have the
recorded status and its protocol's shape: a Chat Completions chunk stream ending in [DONE],
the Responses event sequence (created ... completed), Anthropic's message_start ... message_stop
with every content block opened and closed; the same first and last events as recorded (the
text in between is the model's and may differ)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from slotserve.api.app import create_app
from slotserve.api.server import BackgroundServer
from slotserve.engine import EngineConfig

FIXTURES = Path(__file__).parent / "fixtures" / "agents"
AGENTS = sorted(p.stem for p in FIXTURES.glob("*.json"))
REPLAY_TOKENS = 6
# a recorded stream's last event -> what the replay's may end with (Responses ends incomplete
# when the cut output-token limit is reached)
ENDS = {"[DONE]": {"[DONE]"}, "message_stop": {"message_stop"},
        "response.completed": {"response.completed", "response.incomplete"},
        "response.incomplete": {"response.completed", "response.incomplete"}}
TOKEN_FIELDS = ("max_tokens", "max_completion_tokens", "max_output_tokens")


@pytest.fixture(scope="module")
def srv() -> Iterator[BackgroundServer]:
    server = BackgroundServer(create_app(EngineConfig(max_slots=2, max_queue=8),
                                         keepalive_interval=0.5)).start()
    yield server
    server.stop()


def events(text: str) -> list[Any]:
    """The JSON of each `data:` line ("[DONE]" as the string)."""
    out: list[Any] = []
    for line in text.splitlines():
        if line.startswith("data: "):
            data = line[6:]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


def kind(ev: Any) -> str:
    return ev if isinstance(ev, str) else ev.get("type") or ev.get("object") or "data"


def check_chat_stream(evs: list[Any]) -> None:
    assert evs[-1] == "[DONE]"
    chunks = [e for e in evs[:-1] if e.get("choices")]
    assert chunks and all(e["object"] == "chat.completion.chunk" for e in chunks)
    assert chunks[0]["choices"][0]["delta"].get("role") == "assistant"
    assert chunks[-1]["choices"][0]["finish_reason"] in ("stop", "length", "tool_calls")
    for e in chunks:
        for tc in e["choices"][0]["delta"].get("tool_calls") or []:
            assert isinstance(tc["index"], int)


def check_responses_stream(evs: list[Any]) -> None:
    kinds = [kind(e) for e in evs]
    assert kinds[0] == "response.created" and kinds[-1] in ("response.completed",
                                                           "response.incomplete")
    numbers = [e["sequence_number"] for e in evs]
    assert numbers == sorted(numbers) and len(set(numbers)) == len(numbers)
    added = [e["output_index"] for e in evs if kind(e) == "response.output_item.added"]
    done = [e["output_index"] for e in evs if kind(e) == "response.output_item.done"]
    assert added == done
    final = evs[-1]["response"]
    assert len(final["output"]) == len(added) and final["usage"]["input_tokens"] > 0
    assert "cached_tokens" in final["usage"]["input_tokens_details"]


def check_messages_stream(evs: list[Any]) -> None:
    kinds = [kind(e) for e in evs if kind(e) != "ping"]
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert kinds[-2] == "message_delta"
    delta = next(e for e in evs if kind(e) == "message_delta")
    assert delta["delta"]["stop_reason"] in ("end_turn", "max_tokens", "tool_use",
                                             "stop_sequence")
    opened = [e["index"] for e in evs if kind(e) == "content_block_start"]
    closed = [e["index"] for e in evs if kind(e) == "content_block_stop"]
    assert opened == closed == list(range(len(opened)))
    usage = evs[0]["message"]["usage"]
    assert {"input_tokens", "cache_read_input_tokens"} <= set(usage)


STREAM_CHECKS = {"/v1/chat/completions": check_chat_stream, "/v1/responses": check_responses_stream,
                 "/v1/messages": check_messages_stream}


def check_whole(path: str, body: dict[str, Any]) -> None:
    if path.endswith("/count_tokens"):
        assert isinstance(body["input_tokens"], int) and body["input_tokens"] > 0
    elif path == "/v1/messages":
        assert body["type"] == "message" and body["role"] == "assistant"
        assert body["stop_reason"] in ("end_turn", "max_tokens", "tool_use", "stop_sequence")
    elif path == "/v1/responses":
        assert body["object"] == "response" and body["status"] in ("completed", "incomplete")
    elif path == "/v1/chat/completions":
        assert body["object"] == "chat.completion" and body["choices"][0]["message"]


# the field each route's limit goes in when a recorded request sets none (Codex sends no
# max_output_tokens: the reply would run to its end or the context's)
LIMIT_FIELD = {"/v1/chat/completions": "max_tokens", "/v1/responses": "max_output_tokens",
               "/v1/messages": "max_tokens"}


def cut_tokens(path: str, body: Any) -> Any:
    """The request with its output-token limit cut to REPLAY_TOKENS (set where it has none)."""
    if not isinstance(body, dict):
        return body
    out = {k: (min(v, REPLAY_TOKENS) if k in TOKEN_FIELDS and isinstance(v, int) else v)
           for k, v in body.items()}
    if path in LIMIT_FIELD and not any(k in out for k in TOKEN_FIELDS):
        out[LIMIT_FIELD[path]] = REPLAY_TOKENS
    return out


@pytest.mark.skipif(not AGENTS, reason="no recorded agent fixtures")
@pytest.mark.parametrize("agent", AGENTS)
def test_recorded_requests_replay(srv: BackgroundServer, agent: str) -> None:
    record = json.loads((FIXTURES / f"{agent}.json").read_text())
    exchanges = record["exchanges"]
    generation = [x for x in exchanges if x["request"]["path"].split("?")[0] in STREAM_CHECKS]
    assert generation, f"{agent}: no generation request recorded"
    with httpx.Client(base_url=srv.url, timeout=600) as client:
        for x in exchanges:
            req, want = x["request"], x["response"]
            body = cut_tokens(req["path"].split("?")[0], req["body"])
            r = client.request(req["method"], req["path"], headers=req["headers"],
                               content=None if body is None else json.dumps(body))
            assert r.status_code == want["status"], (req["path"], r.text[:300])
            path = req["path"].split("?")[0]
            if r.status_code != 200 or req["method"] != "POST":
                continue
            if "text/event-stream" in r.headers.get("content-type", ""):
                evs = events(r.text)
                STREAM_CHECKS[path](evs)
                recorded = want.get("events") or []
                if recorded:
                    assert kind(evs[0]) == recorded[0], (path, recorded[:3])
                if recorded and recorded[-1] in ENDS:  # (an agent may stop reading early)
                    assert kind(evs[-1]) in ENDS[recorded[-1]], (path, recorded[-3:])
            else:
                check_whole(path, r.json())
