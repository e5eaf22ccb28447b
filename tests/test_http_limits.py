"""Cheap refusals first (issue 27, part 3): what cannot fit is refused before it is tokenized.

The token floor (`slotserve.api.limits.TokenFloor`) must never overstate (a prompt that fits is
never refused), and an 8 MB prompt must be refused without stalling a concurrent stream.
"""

from __future__ import annotations

import asyncio
import json
import random
import statistics
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import models, normalizers, pre_tokenizers

from slotserve.api.app import create_app
from slotserve.api.limits import MAX_MESSAGES, TokenFloor, chat_texts, token_floor
from slotserve.api.server import BackgroundServer
from slotserve.engine import EngineConfig
from slotserve.model.loader import default_model_path, read_checkpoint
from slotserve.model.tokenizer import Tokenizer

HI = [{"role": "user", "content": "hi"}]
BIG = 8_000_000  # characters of the "8 MB prompt", under the 8 MiB body limit


@pytest.fixture(scope="module")
def gguf_meta() -> dict[str, Any]:
    return read_checkpoint(default_model_path())[2]


@pytest.fixture(scope="module")
def tok(gguf_meta: dict[str, Any]) -> Tokenizer:
    return Tokenizer.from_gguf_metadata(gguf_meta, "smollm2.gguf")


# ---- the bound -----------------------------------------------------------------------------

_alphabet = st.sampled_from([
    " ", "  ", "\n", "\t", "\r\n", "\u3000", "\u00a0", "a", "Z", "hello", " world", "#",
    "=", "-", "0", "7", "é", "e\u0301", "\u212a", "\u1100\u1161\u11a8", "😀", "日本",
    "<|im_start|>", "<|im_end|>", "<", "|", "'s", "\x00", "\u200b", "\x06", "\x1d",
    "\U00040000",
])
_texts = st.lists(st.lists(_alphabet, max_size=60).map("".join)
                  | st.text(max_size=200), min_size=1, max_size=4)


def _runs(text: str) -> str:
    """A text with its pieces repeated into long runs (whitespace runs tokenize densest)."""
    rng = random.Random(len(text))
    return "".join(c * rng.choice([1, 3, 80, 500]) for c in text[:40])


def _floor_holds(tok: Tokenizer, floor: TokenFloor, texts: list[str]) -> None:
    joined = "".join(texts)
    n = len(tok.encode(joined, add_special=False))
    assert floor.at_least(texts) <= n, (texts, n)


@settings(max_examples=300, deadline=None)
@given(texts=_texts)
def test_floor_never_overstates(tok: Tokenizer, texts: list[str]) -> None:
    floor = token_floor(tok)
    assert floor.weights is not None and floor.longest == 81  # "\n" and 80 spaces
    _floor_holds(tok, floor, texts)
    _floor_holds(tok, floor, [_runs(t) for t in texts])


@pytest.mark.parametrize("text", [
    " " * 100_000, "\n" * 100_000, ("\n" + " " * 80) * 2000, "#" * 100_000, "\t" * 50_000,
    "😀" * 30_000, "<|im_start|>" * 20_000, " \t\n\r" * 20_000, "hello world " * 10_000,
    "".join(random.Random(0).choice("abc \n\t#=-😀é") for _ in range(100_000)),
])
def test_floor_on_long_runs(tok: Tokenizer, text: str) -> None:
    floor = token_floor(tok)
    n = len(tok.encode(text, add_special=False))
    assert floor.at_least([text]) <= n
    assert floor.at_least([text]) >= n / 81  # and it is a real bound, not 0


def test_floor_with_nfc(gguf_meta: dict[str, Any]) -> None:
    """qwen2's pre-tokenizer comes with NFC, which composes several characters into one."""
    nfc = Tokenizer.from_gguf_metadata({**gguf_meta, "tokenizer.ggml.pre": "qwen2"}, "q.gguf")
    floor = TokenFloor(nfc)
    assert floor.nfc and floor.weights is not None
    for text in ["\u212a" * 30_000, "\u1100\u1161\u11a8" * 10_000, "e\u0301" * 30_000,
                 "K" * 30_000, "\u1ec7" * 10_000, "e\u0323\u0302" * 10_000]:
        assert floor.at_least([text]) <= len(nfc.encode(text, add_special=False)), text[:4]


def _spm() -> Tokenizer:
    """A SentencePiece-style vocabulary: "▁" for spaces, byte fallback, and a user-defined
    token of spaces, as Gemma has."""
    pieces = ["▁t", "he", "▁the", "▁hello", "▁world", "▁▁▁▁▁▁▁▁"]
    chars = list("▁abcdefghijklmnopqrstuvwxyz")
    bytes_ = [f"<0x{b:02X}>" for b in range(256)]
    special = ["<unk>", "<s>", "</s>", "▁▁▁▁"]
    tokens = special + bytes_ + pieces + chars
    meta = {
        "tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": [2, 3, 3, 4] + [6] * 256 + [1] * (len(pieces) + len(chars)),
        "tokenizer.ggml.scores": [0.0] * (len(special) + 256)
        + [-float(i) for i in range(len(pieces))] + [-100.0 - i for i in range(len(chars))],
        "tokenizer.ggml.bos_token_id": 1, "tokenizer.ggml.eos_token_id": 2,
        "tokenizer.ggml.unknown_token_id": 0, "tokenizer.ggml.add_bos_token": True,
    }
    return Tokenizer.from_gguf_metadata(meta, "spm.gguf")


@settings(max_examples=150, deadline=None)
@given(texts=_texts)
def test_floor_sentencepiece(texts: list[str]) -> None:
    spm = _spm()
    floor = token_floor(spm)
    assert floor.weights is not None and not floor.nfc
    _floor_holds(spm, floor, texts)
    _floor_holds(spm, floor, [_runs(t) for t in texts])


def _hf(pre: Any = None, normalizer: Any = None) -> Any:
    hf = HFTokenizer(models.BPE({"a": 0, "b": 1, "ab": 2}, [("a", "b")]))
    if pre is not None:
        hf.pre_tokenizer = pre
    if normalizer is not None:
        hf.normalizer = normalizer
    return hf


@pytest.mark.parametrize("hf", [
    _hf(pre=pre_tokenizers.WhitespaceSplit()),  # drops whitespace: a run of it costs nothing
    _hf(pre=pre_tokenizers.BertPreTokenizer()),
    _hf(normalizer=normalizers.StripAccents()),  # drops combining marks
    _hf(normalizer=normalizers.Sequence([normalizers.NFKC(), normalizers.Lowercase()])),
    _hf(normalizer=normalizers.Replace("  ", " ")),
], ids=["whitespace-split", "bert", "strip-accents", "nfkc", "collapse-spaces"])
def test_no_floor_where_text_can_vanish(hf: Any) -> None:
    t = Tokenizer(hf, bos_id=None, eos_id=None)
    floor = TokenFloor(t)
    assert floor.weights is None and floor.at_least(["a" * 10**6]) == 0


def test_no_floor_with_stripping_added_tokens() -> None:
    from tokenizers import AddedToken

    hf = _hf()
    hf.add_special_tokens([AddedToken("<mask>", lstrip=True)])
    assert TokenFloor(Tokenizer(hf, bos_id=None, eos_id=None)).weights is None


def test_chat_texts_count_what_templates_keep() -> None:
    msgs = [{"role": "system", "content": "  be brief \n"},
            {"role": "assistant", "content": "<think>" + "x" * 1000 + "</think>\n\nshort"},
            {"role": "user", "content": "\n" * 10_000 + "hi"},
            {"role": "assistant", "content": None, "tool_calls": []}]
    assert chat_texts(msgs, "prefill ") == ["be brief", "short", "hi", "prefill "]
    trims = "{{ m['content'] | trim }}"
    assert chat_texts(msgs, template=trims)[1] == "<think>" + "x" * 1000 + "</think>\n\nshort"
    plain = chat_texts(msgs, template="{{ m['content'] }}")
    assert plain[:3] == [m["content"] for m in msgs[:3]]


# ---- against a real server -----------------------------------------------------------------


@pytest.fixture(scope="module")
def srv() -> Iterator[BackgroundServer]:
    server = BackgroundServer(create_app(EngineConfig(max_slots=2, max_queue=4),
                                         keepalive_interval=0.2)).start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def http(srv: BackgroundServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=srv.url, timeout=60) as c:
        yield c


def _big_chat(n: int = BIG) -> bytes:
    text = ("hello world " * (n // 12 + 1))[:n]
    return json.dumps({"messages": [{"role": "user", "content": text}],
                       "max_tokens": 4}).encode()


def test_cheap_refusals(http: httpx.Client, srv: BackgroundServer) -> None:
    ctx = srv.state.engine.context_length
    r = http.post("/v1/chat/completions", content=_big_chat(),
                  headers={"Content-Type": "application/json"})
    err = r.json()["error"]
    assert r.status_code == 400 and err["code"] == "context_length_exceeded", err
    assert err["param"] == "messages" and f"context length is {ctx}" in err["message"]
    assert "at least" in err["message"]
    # whitespace runs tokenize densest (81 bytes a token at most): 8 MB of them cannot fit
    # either, and SmolLM2's template keeps them all (no trim)
    spaces = [{"role": "user", "content": " " * (BIG - 400_000) + "\n\t" * 100_000}]
    r = http.post("/v1/chat/completions", json={"messages": spaces, "max_tokens": 1})
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    r = http.post("/v1/completions", json={"prompt": "hello world " * 200_000, "max_tokens": 1})
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    r = http.post("/v1/completions", json={"prompt": [1] * (ctx + 1) + [10**9]})
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    r = http.post("/v1/chat/completions", json={"messages": HI * (MAX_MESSAGES + 1)})
    err = r.json()["error"]
    assert r.status_code == 400 and err["code"] == "array_above_max_length", err
    assert err["param"] == "messages" and str(MAX_MESSAGES) in err["message"]
    r = http.post("/v1/chat/completions", content=b"x" * (9 * 2**20))
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
    metrics = http.get("/metrics").text
    assert 'slotserve_rejections_total{reason="context_length_exceeded"}' in metrics


def test_cheap_refusals_anthropic(http: httpx.Client) -> None:
    text = "hello world " * 600_000
    r = http.post("/v1/messages", json={"max_tokens": 4,
                                        "messages": [{"role": "user", "content": text}]})
    body = r.json()
    assert r.status_code == 400 and body["type"] == "error", body
    assert body["error"]["type"] == "invalid_request_error"
    assert "context length" in body["error"]["message"]
    r = http.post("/v1/messages", json={"max_tokens": 4, "messages": HI * (MAX_MESSAGES + 1)})
    assert r.status_code == 400 and r.json()["type"] == "error"
    r = http.post("/v1/messages", content=b"x" * (9 * 2**20))
    assert r.status_code == 413 and r.json()["error"]["type"] == "request_too_large"


def test_refusal_does_not_stall_a_stream(srv: BackgroundServer) -> None:
    """While an 8 MB prompt is refused, a stream's worst gap between tokens stays under twice
    its worst gap in the second before (plus 0.1 s). The best of three refusals counts: a
    loaded 2-core machine may hiccup during one, a stall (4-5 s before the cheap refusal)
    shows in every one."""
    big = _big_chat()
    body = {"messages": [{"role": "user", "content": "Tell me a long story."}],
            "max_tokens": 6000, "ignore_eos": True, "stream": True, "temperature": 0}
    trials = 3

    async def run() -> tuple[list[float], float, list[tuple[float, float, int]]]:
        async with httpx.AsyncClient(base_url=srv.url, timeout=60) as c:
            arrivals: list[float] = []
            refusals: list[tuple[float, float, int]] = []
            start = 0.0

            async def refuse() -> None:
                for _ in range(trials):
                    t0 = time.perf_counter()
                    r = await c.post("/v1/chat/completions", content=big,
                                     headers={"Content-Type": "application/json"})
                    assert r.json()["error"]["code"] == "context_length_exceeded", r.text[:300]
                    refusals.append((t0, time.perf_counter(), r.status_code))
                    await asyncio.sleep(0.3)

            task = None
            async with c.stream("POST", "/v1/chat/completions", json=body) as r:
                async for line in r.aiter_lines():
                    if not line.startswith("data: {") or '"content": ""' in line:
                        continue
                    arrivals.append(time.perf_counter())
                    if len(arrivals) == 20:  # warmed up
                        start = arrivals[-1]
                    if task is None and start and arrivals[-1] > start + 1.0:
                        task = asyncio.create_task(refuse())
                    if task is not None and task.done():
                        break
            assert task is not None, "the stream ended before the refusals began"
            await task
            return arrivals, start, refusals

    arrivals, start, refusals = asyncio.run(run())
    assert [code for *_, code in refusals] == [400] * trials
    gaps = [(b, b - a) for a, b in zip(arrivals, arrivals[1:], strict=False)]
    baseline = max(g for t, g in gaps if start < t <= refusals[0][0])
    worst = [max((g for t, g in gaps if t0 <= t <= t1 + 0.1), default=0.0)
             for t0, t1, _ in refusals]
    took = [t1 - t0 for t0, t1, _ in refusals]
    print(f"worst gap: {baseline:.3f} s in the second before; "
          f"{', '.join(f'{w:.3f}' for w in worst)} s while refusing (refusals took "
          f"{', '.join(f'{t:.3f}' for t in took)} s); median gap "
          f"{statistics.median(g for _, g in gaps):.4f} s")
    assert min(worst) < 2 * baseline + 0.1, (worst, baseline)


# ---- the queue: full is refused first, a wait is bounded --------------------------------------

LONG_STREAM = {"messages": HI, "max_tokens": 4000, "ignore_eos": True, "stream": True}


async def _hold(c: httpx.AsyncClient, n: int) -> list[Any]:
    """Open `n` long streams and wait for their response headers (each admitted or queued)."""
    held = []
    for _ in range(n):
        ctx = c.stream("POST", "/v1/chat/completions", json=LONG_STREAM)
        r = await ctx.__aenter__()
        assert r.status_code == 200
        held.append(ctx)
    return held


async def _release(held: list[Any]) -> None:
    for ctx in reversed(held):
        await ctx.__aexit__(None, None, None)


def test_queue_full_is_refused_before_rendering(monkeypatch: pytest.MonkeyPatch) -> None:
    """With the queue full, a 429 (with Retry-After) comes before the prompt is rendered,
    tokenized or its grammar compiled, on every generation route."""
    from slotserve.api import generation

    server = BackgroundServer(create_app(EngineConfig(max_slots=1, max_queue=1))).start()
    engine = server.state.engine
    assert engine is not None
    work: list[str] = []

    def counted(name: str, fn: Any) -> Any:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            work.append(name)
            return fn(*args, **kwargs)
        return wrapper

    try:
        async def run() -> None:
            async with httpx.AsyncClient(base_url=server.url, timeout=60) as c:
                held = await _hold(c, 2)  # one running, one queued: the queue is full
                assert (await c.get("/slots")).json()["kv"]["queued"] == 1
                monkeypatch.setattr(engine, "render_chat", counted("render", engine.render_chat))
                monkeypatch.setattr(engine.tokenizer, "encode",
                                    counted("tokenize", engine.tokenizer.encode))
                monkeypatch.setattr(generation, "compile_response_format",
                                    counted("grammar", generation.compile_response_format))
                fmt = {"type": "json_object"}
                for path, body in (
                        ("/v1/chat/completions", {"messages": HI, "response_format": fmt}),
                        ("/v1/completions", {"prompt": "Hello", "response_format": fmt}),
                        ("/v1/messages", {"model": "default", "max_tokens": 4,
                                          "messages": HI})):
                    r = await c.post(path, json=body)
                    assert r.status_code == 429, (path, r.text)
                    assert int(r.headers["Retry-After"]) >= 1
                assert work == []
                await _release(held)
                # with room again the same request does that work (so the counting works)
                r = await c.post("/v1/chat/completions",
                                 json={"messages": HI, "response_format": fmt, "max_tokens": 2})
                assert r.status_code == 200, r.text
                assert "render" in work and "grammar" in work

        asyncio.run(run())
        metrics = httpx.get(server.url + "/metrics").text
        assert 'slotserve_rejections_total{reason="queue_full"} 3.0' in metrics
    finally:
        server.stop()


def test_queue_timeout() -> None:
    """A request still waiting for a slot after the queue timeout is taken out of the queue
    and answered 429 with Retry-After (a stream: an error event); the running one goes on."""
    server = BackgroundServer(create_app(EngineConfig(max_slots=1, max_queue=4),
                                         queue_timeout=0.5)).start()
    engine = server.state.engine
    assert engine is not None

    async def run() -> None:
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as c:
            held = await _hold(c, 1)  # the only slot
            started = time.monotonic()
            plain, streamed = await asyncio.gather(
                c.post("/v1/chat/completions", json={"messages": HI, "max_tokens": 4}),
                c.post("/v1/chat/completions", json={**LONG_STREAM, "max_tokens": 4}))
            waited = time.monotonic() - started
            assert 0.5 <= waited < 10, waited
            assert plain.status_code == 429, plain.text
            err = plain.json()["error"]
            assert err["code"] == "queue_timeout" and "queue timeout" in err["message"]
            assert int(plain.headers["Retry-After"]) >= 1
            assert streamed.status_code == 200
            events = [json.loads(x[6:]) for x in streamed.text.splitlines()
                      if x.startswith("data: {")]
            assert events[-1]["error"]["code"] == "queue_timeout", events[-1]
            assert not any(e.get("choices") and e["choices"][0]["delta"].get("content")
                           for e in events)
            assert not engine.admission.queue
            assert sum(s.busy for s in engine.slots) == 1  # the running stream goes on
            await _release(held)

    try:
        asyncio.run(run())
        metrics = httpx.get(server.url + "/metrics").text
        assert 'slotserve_rejections_total{reason="queue_timeout"} 2.0' in metrics
    finally:
        server.stop()
