"""Constrained decoding (response_format) on the real SmolLM2: in process and over HTTP.

JSON out must parse (json_object) and match the schema (json_schema); a constrained row must
leave the rows beside it in the same fused step byte-identical; a bad schema is a clear error.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
from collections.abc import Iterator
from typing import Any

import httpx
import llguidance
import mlx.core as mx
import numpy as np
import openai
import pytest
import vocabularies
from engine_harness import EngineHarness

from slotserve.api.app import create_app
from slotserve.api.server import BackgroundServer
from slotserve.engine import Completion, EngineConfig
from slotserve.model.tokenizer import Tokenizer
from slotserve.runtime.grammar import apply_masks, compile_response_format, ll_tokenizer

PERSON_Q = [{"role": "user", "content": "Invent a person. Reply in JSON with name and age."}]
PERSON_SCHEMA = {"type": "object", "required": ["name", "age"],
                 "properties": {"name": {"type": "string"}, "age": {"type": "integer"}}}
JSON_SCHEMA = {"type": "json_schema",
               "json_schema": {"name": "person", "schema": PERSON_SCHEMA, "strict": True}}
FREE_Q = [{"role": "user", "content": "Tell me about the sea."}]
FREE_OPTS: dict[str, Any] = {"temperature": 0.8, "seed": 11, "top_p": 0.95, "max_tokens": 12}


def check_person(text: str) -> None:
    value = json.loads(text)
    assert isinstance(value, dict) and set(value) >= {"name", "age"}, text
    assert isinstance(value["name"], str)
    assert isinstance(value["age"], int) and not isinstance(value["age"], bool)


@pytest.fixture(scope="module")
def harness() -> Iterator[EngineHarness]:
    h = EngineHarness(max_slots=4, max_queue=8)
    yield h
    h.close()


def run(h: EngineHarness, messages: list[dict[str, Any]], **options: Any) -> Completion:
    return h.call(lambda: h.engine.chat_complete(messages, **options))


@pytest.fixture(scope="module")
def solo_schema(harness: EngineHarness) -> Completion:
    harness.engine.drop_retained()
    return run(harness, PERSON_Q, response_format=JSON_SCHEMA, temperature=0, max_tokens=30)


@pytest.fixture(scope="module")
def solo_free(harness: EngineHarness) -> Completion:
    harness.engine.drop_retained()
    return run(harness, FREE_Q, **FREE_OPTS)


# ---- in process ----------------------------------------------------------------------------


def test_json_object_is_an_object(harness: EngineHarness) -> None:
    c = run(harness, PERSON_Q, response_format={"type": "json_object"}, temperature=0.7,
            seed=5, max_tokens=30)
    assert c.finish_reason == "stop" and c.error is None, c
    assert isinstance(json.loads(c.text), dict)


def test_json_schema_matches(solo_schema: Completion) -> None:
    assert solo_schema.finish_reason == "stop" and solo_schema.error is None, solo_schema
    check_person(solo_schema.text)


def test_neighbours_are_untouched(harness: EngineHarness, solo_schema: Completion,
                                  solo_free: Completion) -> None:
    """A constrained and an unconstrained request decoded in the same steps: each gives exactly
    what it gives alone."""
    engine = harness.engine
    shared: list[int] = []

    runner = engine.batcher.runner
    plain_step = runner.step

    def step(work: list[Any]) -> Any:  # watch the fused steps (runs on the MLX thread)
        kinds = {w.grammar is not None for w in work if w.sample}
        if kinds == {True, False}:
            shared.append(len(work))
        return plain_step(work)

    async def both() -> tuple[Completion, Completion]:
        engine.drop_retained()
        return await asyncio.gather(
            engine.chat_complete(PERSON_Q, response_format=JSON_SCHEMA, temperature=0,
                                 max_tokens=30),
            engine.chat_complete(FREE_Q, **FREE_OPTS))

    runner.step = step  # type: ignore[method-assign]
    try:
        constrained, free = harness.call(both)
    finally:
        del runner.step  # the class's method again
    assert len(shared) >= 5  # they really shared steps
    assert free.token_ids == solo_free.token_ids and free.text == solo_free.text
    assert constrained.token_ids == solo_schema.token_ids


def test_masks_touch_only_their_rows(harness: EngineHarness) -> None:
    grammar = compile_response_format({"type": "json_object"}, harness.engine.tokenizer)
    assert grammar is not None
    vocab = harness.engine.tokenizer.vocab_size
    logits = mx.array(np.random.default_rng(0).standard_normal((3, vocab + 7), np.float32))
    out = np.array(apply_masks(logits, [1], [grammar.matcher()]))
    before = np.array(logits)
    assert out[0].tobytes() == before[0].tobytes() and out[2].tobytes() == before[2].tobytes()
    allowed = np.nonzero(np.isfinite(out[1]))[0]
    assert 0 < len(allowed) < 10 and (out[1][allowed] == before[1][allowed]).all()
    assert all(harness.engine.tokenizer.decode([int(t)]).startswith("{") for t in allowed)


# schemas whose every instance is infinite: the forced text ({"a": {"a": ..., [[[...) has no end.
# llguidance validates them and computes their forced text only as far as its parser limits go;
# the first step of a request then failed with "Too many items" (a 500 mid-generation). They are
# refused when the request is made (Grammar._first_step).
ENDLESS = [
    {"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]},
    {"type": "array", "items": {"$ref": "#"}, "minItems": 1},
    {"$defs": {"n": {"type": "object", "properties": {"next": {"$ref": "#/$defs/n"}},
                     "required": ["next"]}}, "$ref": "#/$defs/n"},
]
# a number, or an endless object: it fails only once generation takes the object branch
ENDLESS_BRANCH = {"$defs": ENDLESS[2]["$defs"],
                  "anyOf": [{"type": "integer"}, {"$ref": "#/$defs/n"}]}


@pytest.mark.parametrize("fmt, needle", [
    ({"type": "json_schema", "json_schema": {"schema": {"type": "wat"}}}, "wat"),
    ({"type": "json_schema", "json_schema": {"schema": {"$ref": "#/nope"}}}, "nope"),
    ({"type": "yaml"}, "yaml"),
    *[({"type": "json_schema", "json_schema": {"schema": schema}}, "cannot be followed")
      for schema in ENDLESS],
])
def test_bad_schema_is_refused(harness: EngineHarness, fmt: dict[str, Any], needle: str) -> None:
    engine = harness.engine
    with pytest.raises(ValueError, match="response_format") as info:
        engine.make_request(engine.render_chat(PERSON_Q), max_tokens=4, response_format=fmt)
    assert needle in str(info.value)


# ---- llguidance's vocabulary ----------------------------------------------------------------
# ll_tokenizer is llguidance's own tokenizer read from tokenizer.json (what
# llguidance.hf.from_tokenizer builds). These compare it with the vocabulary slotserve built by
# hand before: TokenizerWrapper over Tokenizer.token_bytes, our encoder for forced text.

GRAMMARS: list[tuple[str, str]] = [  # (name, "json:<response_format>" or a llguidance grammar)
    ("json_object", json.dumps({"type": "json_object"})),
    ("person", json.dumps(JSON_SCHEMA)),
    ("enum_pattern", json.dumps({"type": "json_schema", "json_schema": {"schema": {
        "type": "object", "required": ["code", "ok", "tags"],
        "properties": {"code": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{3}$"},
                       "ok": {"type": "boolean"}, "x": {"type": "number"},
                       "tags": {"type": "array", "items": {"enum": ["a", "😀 b", "日本"]}}}}}})),
]
LL_GRAMMARS = [("regex", r"(yes|no|maybe) [0-9]+ [a-zé😀]{1,5}"),
               ("lark", 'start: "red" | "green" | "blue" | "日本語"')]


class _ByteVocab:
    """The hand-built vocabulary for llguidance's TokenizerWrapper (the old path)."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tokenizer = tokenizer
        self.eos_token_id = tokenizer.eos_id
        self.bos_token_id = tokenizer.bos_id
        self.tokens = tokenizer.all_token_bytes()
        self.special_token_ids = sorted(tokenizer.special_ids)

    def __call__(self, text: str | bytes) -> list[int]:
        if isinstance(text, bytes):
            text = text.decode("utf-8", errors="replace")
        return self._tokenizer.encode(text, add_special=False)


def _byte_vocab_tokenizer(tok: Tokenizer) -> llguidance.LLTokenizer:
    return llguidance.LLTokenizer(llguidance.TokenizerWrapper(_ByteVocab(tok)),
                                  n_vocab=tok.vocab_size, eos_token=sorted(tok.stop_ids))


def _sources(tok: Tokenizer) -> list[tuple[str, str]]:
    out = []
    for name, fmt in GRAMMARS:
        grammar = compile_response_format(json.loads(fmt), tok)
        assert grammar is not None
        out.append((name, grammar.source))
    return out + [(kind, llguidance.grammar_from(kind, g)) for kind, g in LL_GRAMMARS]  # type: ignore[arg-type]


def _mask(m: llguidance.LLMatcher, vocab: int) -> np.ndarray:
    bits = np.zeros(((vocab + 31) // 32,), np.int32)
    m.unsafe_compute_mask_ptr(bits.ctypes.data, bits.nbytes)
    return np.unpackbits(bits.view(np.uint8), bitorder="little").astype(bool)[:vocab]


def test_llguidance_vocabulary_is_the_token_bytes() -> None:
    """On the bundled tokenizer llguidance reads the same bytes, specials and stops."""
    tok = vocabularies.smollm2()
    lt = ll_tokenizer(tok)
    assert lt is ll_tokenizer(tok)  # built once
    assert lt.vocab_size == tok.vocab_size and sorted(lt.eos_tokens) == sorted(tok.stop_ids)
    assert [lt.decode_bytes([i]) for i in range(tok.vocab_size)] == tok.all_token_bytes()
    assert {i for i in range(tok.vocab_size) if lt.is_special_token(i)} == tok.special_ids
    if importlib.util.find_spec("transformers") is not None:  # the same as hf.from_tokenizer
        import llguidance.hf
        from tokenizers import Tokenizer as HFTokenizer
        from transformers import PreTrainedTokenizerFast

        hf = PreTrainedTokenizerFast(
            tokenizer_object=HFTokenizer.from_str(tok.to_hf_tokenizer_json()))
        ref = llguidance.hf.from_tokenizer(hf, n_vocab=tok.vocab_size,
                                           eos_token=sorted(tok.stop_ids))
        for i in range(tok.vocab_size):
            assert ref.decode_bytes([i]) == lt.decode_bytes([i])
            assert ref.is_special_token(i) == lt.is_special_token(i)


def test_llguidance_vocabulary_gives_the_same_masks() -> None:
    """Random walks through each grammar: at every step both vocabularies allow the same
    tokens (bundled SmolLM2; byte-level llama.cpp vocabularies too when cached)."""
    names = ["smollm2", *(n for n in vocabularies.llama_cpp_vocabs()
                          if n in ("llama-bpe", "qwen2"))]
    for name in names:
        tok = vocabularies.by_name(name)
        ours, theirs = ll_tokenizer(tok), _byte_vocab_tokenizer(tok)
        rng = np.random.default_rng(0)
        steps = 0
        for grammar, source in _sources(tok):
            for _ in range(4):
                a = llguidance.LLMatcher(ours, source, log_level=0)
                b = llguidance.LLMatcher(theirs, source, log_level=0)
                for _ in range(60):
                    if a.is_stopped():
                        break
                    ma, mb = _mask(a, tok.vocab_size), _mask(b, tok.vocab_size)
                    assert (ma == mb).all(), (name, grammar, np.nonzero(ma != mb)[0][:8])
                    steps += 1
                    token = int(rng.choice(np.nonzero(ma)[0]))
                    assert a.consume_token(token) and b.consume_token(token), (name, grammar)
                assert not a.is_error() and not b.is_error()
        assert steps > 100, name


@pytest.mark.parametrize("name", ["spm-prefix", *(n for n in vocabularies.llama_cpp_vocabs()
                                                  if n == "llama-spm")])
def test_llguidance_vocabulary_on_sentencepiece_with_a_space_prefix(name: str) -> None:
    """Where SentencePiece adds its "▁" prefix, our encoder tokenized llguidance's forced text
    wrong ("{" as "▁{"): the hand-built vocabulary let a JSON object start with a space or put
    the matcher in error. llguidance's own tokenizer allows exactly the tokens that start with
    "{", and a walk through the grammar ends in JSON."""
    tok = vocabularies.by_name(name)
    grammar = compile_response_format({"type": "json_object"}, tok)
    assert grammar is not None
    old = llguidance.LLMatcher(_byte_vocab_tokenizer(tok), grammar.source, log_level=0)
    first = np.nonzero(_mask(old, tok.vocab_size))[0]
    assert old.is_error() or any(not tok.token_bytes(int(i)).startswith(b"{") for i in first)

    row = np.zeros(((tok.vocab_size + 31) // 32,), np.int32)
    grammar.matcher().fill_mask(row)
    first = np.nonzero(np.unpackbits(row.view(np.uint8), bitorder="little"))[0]
    assert len(first) and all(tok.token_bytes(int(i)).startswith(b"{") for i in first)

    small = {"type": "object", "required": ["a"], "additionalProperties": False,
             "properties": {"a": {"enum": ["x", "hello world", "é😀"]}}}
    grammar = compile_response_format(
        {"type": "json_schema", "json_schema": {"schema": small, "strict": True}}, tok)
    assert grammar is not None
    rng = np.random.default_rng(1)
    for _ in range(5):
        m, out = grammar.matcher(), b""
        for _ in range(100):
            if m.stopped:
                break
            m.fill_mask(row)
            allowed = np.nonzero(np.unpackbits(row.view(np.uint8), bitorder="little"))[0]
            stop = [int(i) for i in allowed if int(i) in grammar.stop_ids]
            token = stop[0] if stop else int(rng.choice(allowed))
            assert m.consume(token) and m.error is None
            out += b"" if token in grammar.stop_ids else tok.token_bytes(token)
        assert m.stopped
        assert json.loads(out.decode())["a"] in small["properties"]["a"]["enum"], out


# ---- over HTTP, with the official client ---------------------------------------------------


@pytest.fixture(scope="module")
def client() -> Iterator[openai.OpenAI]:
    server = BackgroundServer(create_app(EngineConfig(max_slots=2, max_queue=4))).start()
    yield openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    server.stop()


def test_http_json_object(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(model="default", messages=PERSON_Q, temperature=0,
                                       max_tokens=30, response_format={"type": "json_object"})
    assert r.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(r.choices[0].message.content), dict)


def test_http_json_schema_stream_and_not(client: openai.OpenAI) -> None:
    args: dict[str, Any] = dict(model="default", messages=PERSON_Q, temperature=0, max_tokens=30,
                                response_format=JSON_SCHEMA)
    r = client.chat.completions.create(**args)
    text = r.choices[0].message.content
    check_person(text)
    chunks = list(client.chat.completions.create(**args, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == text
    assert chunks[-1].choices[0].finish_reason == "stop"


@pytest.mark.parametrize("fmt, needle", [
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "wat"}}}, "wat"),
    ({"type": "json_schema", "json_schema": {"name": "x", "strict": True, "schema": {
        "type": "object", "properties": {"a": {"type": "string", "format": "nope"}}}}}, "nope"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": [1]}}, "schema"),
    ({"type": "json_schema"}, "json_schema"),
    ({"type": "yaml"}, "yaml"),
    *[({"type": "json_schema", "json_schema": {"name": "x", "schema": schema}},
       "cannot be followed") for schema in ENDLESS],
])
def test_http_bad_schema_400(client: openai.OpenAI, fmt: dict[str, Any], needle: str) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="default", messages=PERSON_Q, max_tokens=4,
                                       response_format=fmt)  # type: ignore[arg-type]
    err = info.value.body
    assert info.value.status_code == 400 and err["param"] == "response_format"
    assert needle in err["message"]


@pytest.mark.parametrize("stream", [False, True])
def test_http_grammar_failing_mid_generation_is_a_400(client: openai.OpenAI,
                                                      stream: bool) -> None:
    """A grammar that passes the checks and then fails while generating (here: the bias makes
    the reply take the endless branch) ends its request with a 400 that names
    response_format, or an error event in a stream: the caller's schema, never a 500."""
    tok = vocabularies.smollm2()
    bias = {str(t): 100 for text in ("{", '{"') for t in tok.encode(text, add_special=False)}
    args: dict[str, Any] = dict(
        model="default", messages=PERSON_Q, temperature=0, max_tokens=30, logit_bias=bias,
        response_format={"type": "json_schema",
                         "json_schema": {"name": "x", "schema": ENDLESS_BRANCH}})
    if not stream:
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(**args)
        err = info.value.body
        assert err["code"] == "response_format_failed" and err["param"] == "response_format"
        assert "Too many items" in err["message"] and "<state>" not in err["message"]
        return
    with httpx.stream("POST", str(client.base_url) + "chat/completions",
                      json={**args, "stream": True}, timeout=60) as r:
        assert r.status_code == 200
        events = [json.loads(line[6:]) for line in r.iter_lines()
                  if line.startswith("data: {")]
    err = events[-1]["error"]
    assert err["code"] == "response_format_failed" and err["param"] == "response_format"


def test_matcher_errors_say_what_they_can() -> None:
    """A parser limit reached mid-generation is said (it is about the grammar, not the
    parser's state); a rejected token is not detailed, even one that spells a limit's words."""
    tok = vocabularies.smollm2()
    fmt = {"type": "json_schema", "json_schema": {"schema": ENDLESS_BRANCH}}
    m = compile_response_format(fmt, tok).matcher()
    bits = np.zeros(((m.vocab_size + 31) // 32,), np.int32)
    for token in [t for text in ("{", '"') for t in tok.encode(text, add_special=False)]:
        m.fill_mask(bits)
        m.consume(token)
    m.fill_mask(bits)
    assert m.error is not None and m.error.startswith("the grammar is too costly to follow")
    assert "Too many items" in m.error and "<state>" not in m.error
    m = compile_response_format({"type": "json_object"}, tok).matcher()
    m.consume(tok.encode(" fuel (limit", add_special=False)[0])
    assert m.error == "a sampled token does not satisfy the grammar"
