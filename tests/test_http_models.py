"""The pydantic request models: their 400s (param and text), their limits, the OpenAPI document.

No model is loaded: the models check everything a body can get wrong before the engine sees it,
except what only the loaded vocabulary knows (`check_vocabulary`).
"""

from __future__ import annotations

import asyncio
import json
import math

import pytest

from slotserve.api.anthropic import parse_messages
from slotserve.api.app import create_app
from slotserve.api.errors import APIError
from slotserve.api.limits import MAX_MESSAGES
from slotserve.api.schemas import (
    check_vocabulary,
    parse_chat,
    parse_completion,
    short_repr,
)
from slotserve.engine import EngineConfig
from slotserve.runtime.sampling import KNOB_RANGES, SamplingParams

USER = [{"role": "user", "content": "hi"}]


def api_error(fn, *args):  # type: ignore[no-untyped-def]
    with pytest.raises(APIError) as info:
        fn(*args)
    return info.value


@pytest.mark.parametrize("body, param, message", [
    ({"model": "x"}, "messages", "'messages' is required"),
    ({"messages": USER, "stream": "yes"}, "stream", "'stream' must be a boolean, got a string"),
    ({"messages": USER, "max_tokens": 1.5}, "max_tokens",
     "'max_tokens' must be an integer, got a number"),
    ({"messages": USER, "max_tokens": True}, "max_tokens",
     "'max_tokens' must be an integer, got a boolean"),
    ({"messages": USER, "temperature": "1"}, "temperature",
     "'temperature' must be a number, got a string"),
    ({"messages": USER, "temperature": 10**400}, "temperature",
     "'temperature' must be a finite number, got 10000000000000000000...(401 characters)"),
    ({"messages": USER, "temperature": 7}, "temperature", "'temperature' must be in [0, 2], got 7"),
    ({"messages": USER, "top_p": 1e-40}, "top_p", "'top_p' must be in (0, 1], got 1e-40 (below "
     "1.17549e-38, the least the float32 sampler takes)"),
    ({"messages": USER, "logit_bias": {"5": "x"}}, "logit_bias",
     "'logit_bias[5]' must be a number, got a string"),
    ({"messages": USER, "logit_bias": {" 1": 1}}, "logit_bias",
     "'logit_bias' keys must be token ids in plain decimal digits, got ' 1'"),
    ({"messages": USER, "n": 2}, "n", "'n' = 2 is not supported: this server returns one choice "
     "per request (send 2 requests instead)"),
    ({"messages": USER, "top_logprobs": 3}, "top_logprobs",
     "'top_logprobs' requires 'logprobs': true"),
    ({"messages": USER, "stop": ["a"] * 17}, "stop", "'stop' holds 17 items; at most 16 are "
     "allowed"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
     "messages[0].content[0]", "'messages[0].content[0]': content parts of type 'image_url' are "
     "not supported (text only)"),
    ({"messages": [{"role": "system"}]}, "messages[0].content",
     "'messages[0].content' is required for role 'system'"),
    ({"messages": [{"role": "user", "content": "x", "tool_calls": []}]},
     "messages[0].tool_calls", "'messages[0].tool_calls' must be an array on an assistant message"),
    ({"messages": USER, "tools": [{"function": {"name": ""}}]}, "tools[0].function.name",
     "'tools[0].function.name' must not be empty"),
    ({"messages": USER, "tool_choice": "required"}, "tool_choice",
     "'tool_choice' is 'required' but no 'tools' were given"),
    ({"messages": USER, "tool_choice": "sometimes"}, "tool_choice", "'tool_choice' must be "
     "'none', 'auto', 'required' or {'type': 'function', 'function': {'name': ...}}"),
    ({"messages": USER, "response_format": {"type": "yaml"}}, "response_format",
     "'response_format.type' must be 'text', 'json_object' or 'json_schema', got 'yaml'"),
    ({"messages": USER, "response_format": {"type": "json_schema"}}, "response_format",
     "'response_format.json_schema' is required when 'type' is 'json_schema'"),
    ({"messages": USER, "cache_salt": "x" * 1025}, "cache_salt",
     "'cache_salt' must be at most 1024 characters long"),
    ({"messages": USER, "stream_options": {"include_usage": 1}}, "stream_options",
     "'stream_options.include_usage' must be a boolean, got an integer"),
])
def test_chat_errors_name_the_field(body: dict, param: str, message: str) -> None:
    err = api_error(parse_chat, body)
    assert (err.status, err.param, err.message) == (400, param, message)


def test_unsupported_features_have_their_code() -> None:
    for fn, body in ((parse_chat, {"messages": USER, "n": 3}),
                     (parse_completion, {"prompt": "x", "echo": True}),
                     (parse_completion, {"prompt": "x", "suffix": "y"}),
                     (parse_completion, {"prompt": "x", "best_of": 2}),
                     (parse_completion, {"prompt": ["a", "b"]})):
        assert api_error(fn, body).code == "unsupported", body
    assert parse_completion({"prompt": "x", "echo": False, "suffix": "", "best_of": 1}).prompt \
        == "x"


def test_message_cap_is_checked_before_the_messages() -> None:
    """2,049 broken messages: the count is the error, none of them was looked at."""
    err = api_error(parse_chat, {"messages": [5] * (MAX_MESSAGES + 1)})
    assert (err.param, err.code) == ("messages", "array_above_max_length")
    assert f"{MAX_MESSAGES + 1} items; at most {MAX_MESSAGES}" in err.message
    err = api_error(parse_messages, {"max_tokens": 1, "messages": [5] * (MAX_MESSAGES + 1)})
    assert err.code == "array_above_max_length"


def test_unknown_fields_are_ignored() -> None:
    req = parse_chat({"messages": [{"role": "user", "content": "hi", "extra": 1}], "user": 5,
                      "metadata": [], "prediction": "x", "service_tier": None})
    assert req.messages == [{"role": "user", "content": "hi"}]
    assert parse_messages({"max_tokens": 1, "messages": USER, "metadata": {"user_id": 1},
                           "thinking": "x"}).max_tokens == 1


@pytest.mark.parametrize("name", sorted(KNOB_RANGES))
def test_knobs_are_checked_from_the_sampler_table(name: str) -> None:
    """Both ends of each knob's range pass the API and the sampler; just past them, both refuse
    (the API naming the field)."""
    limits = KNOB_RANGES[name]
    lo = limits.floor if limits.open_lo else limits.lo  # top_p: float32's smallest normal
    for value in (lo, limits.hi):
        opts = parse_chat({"messages": USER, name: value}).options
        assert opts[name] == value
        SamplingParams(**{name: value}).validate(100)
    for value in (math.nextafter(lo, -math.inf), limits.hi * 1.01 + 0.01):
        assert api_error(parse_chat, {"messages": USER, name: value}).param == name
        with pytest.raises(ValueError, match=name):
            SamplingParams(**{name: value}).validate(100)


def test_vocabulary_check_names_logit_bias() -> None:
    opts = parse_chat({"messages": USER, "logit_bias": {"99": 1, "100": -1}}).options
    err = api_error(check_vocabulary, opts, 100)
    assert (err.param, err.message) == ("logit_bias", "'logit_bias' token id 100 is out of range "
                                                      "[0, 100)")
    check_vocabulary(opts, 101)


@pytest.mark.parametrize("body, message", [
    ({"messages": USER}, "max_tokens is required"),
    ({"max_tokens": 0, "messages": USER}, "max_tokens must be >= 1, got 0"),
    ({"max_tokens": 1, "messages": [{"role": "robot", "content": "x"}]},
     "messages.0.role must be 'user', 'assistant' or 'system', got 'robot'"),
    ({"max_tokens": 1, "messages": [{"role": "assistant", "content": [
        {"type": "tool_result", "tool_use_id": "t"}]}]},
     "messages.0.content.0: content blocks of type 'tool_result' are not supported in assistant "
     "messages (supported: text, tool_use, thinking, "
     "redacted_thinking)"),
    ({"max_tokens": 1, "messages": USER, "tool_choice": {"type": "any"}},
     "tool_choice is 'any' but no 'tools' were given"),
    ({"max_tokens": 1, "messages": USER, "system": 5},
     "system must be a string or an array of text blocks, got an integer"),
    ({"max_tokens": 1, "messages": USER, "stream": None}, "stream must be a boolean, got null"),
])
def test_anthropic_errors_name_the_field_its_way(body: dict, message: str) -> None:
    err = api_error(parse_messages, body)
    assert (err.status, err.message) == (400, message)


def test_short_repr_never_echoes_a_huge_input() -> None:
    assert short_repr("x" * 10**6) == "'xxxxxxxxxxxxxxxxxxxx'...(1000000 characters)"
    assert short_repr(10**5000) == "an integer of over 4300 digits"
    assert short_repr([[]] * 10**6) == "an array"
    assert short_repr(1e-50) == "1e-50"


def test_openapi_document_names_the_routes() -> None:
    app = create_app(EngineConfig(), model_id="m")

    async def get() -> tuple[int, bytes]:
        r = await app.test_client().get("/openapi.json")
        return r.status_code, await r.get_data()

    status, raw = asyncio.run(get())
    assert status == 200
    doc = json.loads(raw)
    assert doc["openapi"].startswith("3.1")
    assert set(doc["paths"]) == {"/v1/chat/completions", "/v1/completions", "/v1/messages",
                                 "/v1/responses"}
    schemas = doc["components"]["schemas"]
    for path, op in doc["paths"].items():
        ref = op["post"]["requestBody"]["content"]["application/json"]["schema"]["$ref"]
        assert ref.startswith("#/components/schemas/") and ref.rsplit("/", 1)[1] in schemas, path
    chat = schemas["ChatCompletionBody"]
    assert "messages" in chat["required"]
    assert chat["properties"]["messages"]["maxItems"] == MAX_MESSAGES
    temperature = chat["properties"]["temperature"]["anyOf"][0]
    assert (temperature["minimum"], temperature["maximum"]) == (0.0, 2.0)
    assert schemas["MessagesBody"]["required"] == ["max_tokens", "messages"]
    every_ref = {m for m in json.dumps(doc).split('"$ref": "')[1:]}
    assert all(r.split('"')[0].rsplit("/", 1)[1] in schemas for r in every_ref)
