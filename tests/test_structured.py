"""Constrained decoding (response_format) on the real SmolLM2: in process and over HTTP.

JSON out must parse (json_object) and match the schema (json_schema); a constrained row must
leave the rows beside it in the same fused step byte-identical; a bad schema is a clear error.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from typing import Any

import mlx.core as mx
import numpy as np
import openai
import pytest
from engine_harness import EngineHarness

from slotserve.api.app import create_app
from slotserve.api.server import BackgroundServer
from slotserve.engine import Completion, EngineConfig
from slotserve.runtime.grammar import apply_masks, compile_response_format

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


@pytest.mark.parametrize("fmt, needle", [
    ({"type": "json_schema", "json_schema": {"schema": {"type": "wat"}}}, "wat"),
    ({"type": "json_schema", "json_schema": {"schema": {"$ref": "#/nope"}}}, "nope"),
    ({"type": "yaml"}, "yaml"),
])
def test_bad_schema_is_refused(harness: EngineHarness, fmt: dict[str, Any], needle: str) -> None:
    engine = harness.engine
    with pytest.raises(ValueError, match="response_format") as info:
        engine.make_request(engine.render_chat(PERSON_Q), max_tokens=4, response_format=fmt)
    assert needle in str(info.value)


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
])
def test_http_bad_schema_400(client: openai.OpenAI, fmt: dict[str, Any], needle: str) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="default", messages=PERSON_Q, max_tokens=4,
                                       response_format=fmt)  # type: ignore[arg-type]
    err = info.value.body
    assert info.value.status_code == 400 and err["param"] == "response_format"
    assert needle in err["message"]
