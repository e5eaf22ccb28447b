"""Request bodies -> validated engine options; every mistake is a 400 naming the field.

Only the shape is checked here (types, required fields, unsupported features). Value ranges of
the sampling knobs are the engine's to judge: `Engine.make_request` raises ValueError with a
message that already names the knob.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from typing import Any

from slotserve.api.errors import APIError, bad_request
from slotserve.api.limits import check_message_count
from slotserve.api.tools import ToolChoice
from slotserve.runtime.sampling import short_repr

MAX_STOP = 16
MAX_CACHE_SALT = 1024  # characters
MAX_TOP_LOGPROBS = 20
ROLES = {"system", "user", "assistant", "tool", "developer"}
TINY_TEMPERATURE = 1e-30
_TOKEN_ID = re.compile(r"[0-9]{1,10}")  # ASCII digits only; the vocabulary check is the engine's
FLOAT_KNOBS = ("temperature", "top_p", "min_p", "frequency_penalty", "presence_penalty",
               "repetition_penalty")


@dataclass
class ChatRequest:
    messages: list[dict[str, Any]]
    model: str | None = None
    stream: bool = False
    include_usage: bool = False
    tools: list[dict[str, Any]] | None = None
    tool_choice: ToolChoice = field(default_factory=ToolChoice)
    logprobs: bool = False
    top_logprobs: int = 0
    options: dict[str, Any] = field(default_factory=dict)  # Engine.make_request keywords


@dataclass
class CompletionRequest:
    prompt: str | list[int]
    model: str | None = None
    stream: bool = False
    include_usage: bool = False
    logprobs: int | None = None  # None: no logprobs; k: the chosen token plus k alternatives
    options: dict[str, Any] = field(default_factory=dict)


# ---- the body ----------------------------------------------------------------------------


def parse_body(raw: bytes) -> dict[str, Any]:
    """Bytes -> a JSON object, refusing what the engine could not take (NaN, lone surrogates)."""
    if not raw.strip():
        raise bad_request("the request body is empty; expected a JSON object")
    try:
        body = json.loads(raw, parse_constant=_no_constant)
    except RecursionError:
        raise bad_request("malformed JSON: nested too deeply") from None
    except ValueError as exc:
        raise bad_request(f"malformed JSON: {exc}") from None
    if not isinstance(body, dict):
        raise bad_request(f"the request body must be a JSON object, not {_kind(body)}")
    if json.detect_encoding(raw) == "utf-8" and not _maybe_surrogate(raw):
        # the round trip below costs as much as the parse (0.1 s for 8 MB of small values)
        return body
    try:
        json.dumps(body, ensure_ascii=False).encode()
    except UnicodeEncodeError:
        raise bad_request("the request contains invalid Unicode (a lone surrogate)") from None
    except (ValueError, RecursionError):
        raise bad_request("the request body is nested too deeply") from None
    return body


# In a UTF-8 body, a surrogate gets into a str only through a \uD800-\uDFFF escape or its
# UTF-8 bytes (which json.loads decodes with "surrogatepass"): neither, no lone surrogate.
_MAYBE_SURROGATE = re.compile(rb"\\u[dD][89abAB]|\xed[\xa0-\xbf]")


def _maybe_surrogate(raw: bytes) -> bool:
    # `in` is a memchr-speed scan (1 ms per MB); the regex only runs where it could match
    return (b"\\u" in raw or b"\xed" in raw) and _MAYBE_SURROGATE.search(raw) is not None


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def _kind(value: Any) -> str:
    names = {dict: "an object", list: "an array", str: "a string", bool: "a boolean",
             int: "an integer", float: "a number", type(None): "null"}
    return names.get(type(value), type(value).__name__)


# ---- field readers -------------------------------------------------------------------------


def _bool(body: dict[str, Any], key: str, default: bool = False) -> bool:
    value = body.get(key)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise bad_request(f"'{key}' must be a boolean, got {_kind(value)}", key)
    return value


def _int(body: dict[str, Any], key: str, lo: int | None = None,
         hi: int | None = None) -> int | None:
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise bad_request(f"'{key}' must be an integer, got {_kind(value)}", key)
    if (lo is not None and value < lo) or (hi is not None and value > hi):
        bounds = f">= {lo}" if hi is None else f"between {lo} and {hi}"
        raise bad_request(f"'{key}' must be {bounds}, got {value}", key)
    return value


def _number(body: dict[str, Any], key: str) -> float | None:
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise bad_request(f"'{key}' must be a number, got {_kind(value)}", key)
    return finite(value, f"'{key}'", key)


def finite(value: int | float, name: str, param: str) -> float:
    """A JSON number as a float, refusing what has no finite float (1e400, 10**400)."""
    try:
        out = float(value)
    except OverflowError:
        out = math.inf
    if not math.isfinite(out):
        raise bad_request(f"{name} must be a finite number, got {short_repr(value)}", param)
    return out


def _str(body: dict[str, Any], key: str) -> str | None:
    value = body.get(key)
    if value is not None and not isinstance(value, str):
        raise bad_request(f"'{key}' must be a string, got {_kind(value)}", key)
    return value


def _object(value: Any, name: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise bad_request(f"'{name}' must be an object, got {_kind(value)}", name)
    return value


# ---- shared options ------------------------------------------------------------------------


def check_response_format(value: Any) -> dict[str, Any] | None:
    """`response_format` -> the engine's `response_format` option (None: plain text).

    Only the shape is checked here; the schema itself is compiled when the request is made, and
    one llguidance cannot honour is refused then, also with a 400 naming response_format.
    """
    if value is None:
        return None
    fmt = _object(value, "response_format")
    kind = fmt.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind == "json_schema":
        spec = fmt.get("json_schema")
        if not isinstance(spec, dict):
            raise bad_request("'response_format.json_schema' must be an object: {'name': ..., "
                              "'schema': {...}, 'strict': ...}", "response_format")
        schema = spec.get("schema", {})
        if not isinstance(schema, dict):
            raise bad_request(f"'response_format.json_schema.schema' must be a JSON Schema "
                              f"object, got {_kind(schema)}", "response_format")
        for key, types, what in (("name", str, "a string"), ("strict", bool, "a boolean")):
            if spec.get(key) is not None and not isinstance(spec[key], types):
                raise bad_request(f"'response_format.json_schema.{key}' must be {what}",
                                  "response_format")
        return {"type": "json_schema", "json_schema": {
            "name": spec.get("name"), "schema": schema, "strict": spec.get("strict")}}
    raise bad_request(f"'response_format.type' must be 'text', 'json_object' or 'json_schema', "
                      f"got {kind!r}", "response_format")


def _stop(body: dict[str, Any]) -> list[str] | None:
    value = body.get("stop")
    if value is None:
        return None
    if isinstance(value, str):
        return [value]
    if not isinstance(value, list) or not all(isinstance(s, str) for s in value):
        raise bad_request("'stop' must be a string or an array of strings", "stop")
    if len(value) > MAX_STOP:
        raise bad_request(f"'stop' may hold at most {MAX_STOP} strings, got {len(value)}", "stop")
    return value


def _logit_bias(body: dict[str, Any]) -> dict[int, float] | None:
    value = body.get("logit_bias")
    if value is None:
        return None
    bias = _object(value, "logit_bias")
    out: dict[int, float] = {}
    for key, b in bias.items():
        if not _TOKEN_ID.fullmatch(key):  # not int(): it takes " 1", "1_000" and "٣"
            raise bad_request(f"'logit_bias' keys must be token ids in plain decimal digits, "
                              f"got {short_repr(key)}", "logit_bias")
        if isinstance(b, bool) or not isinstance(b, int | float):
            raise bad_request(f"'logit_bias[{key}]' must be a number, got {_kind(b)}",
                              "logit_bias")
        out[int(key)] = finite(b, f"'logit_bias[{key}]'", "logit_bias")
    return out


def _options(body: dict[str, Any], max_tokens_keys: tuple[str, ...]) -> dict[str, Any]:
    """Sampling and length options shared by both endpoints, as make_request keywords."""
    n = _int(body, "n")
    if n is not None and n != 1:
        raise APIError(400, f"'n' = {n} is not supported: this server returns one choice per "
                       f"request (send {n} requests instead)", param="n", code="unsupported")
    opts: dict[str, Any] = {}
    for key in max_tokens_keys:  # later keys win (max_completion_tokens over max_tokens)
        value = _int(body, key, lo=1)
        if value is not None:
            opts["max_tokens"] = value
    for key in FLOAT_KNOBS:
        value = _number(body, key)
        if value is not None:
            opts[key] = value
    if 0.0 < opts.get("temperature", 1.0) < TINY_TEMPERATURE:
        opts["temperature"] = 0.0  # 1/t would overflow the sampler's float32 scale: argmax anyway
    top_k = _int(body, "top_k", lo=-1)
    if top_k is not None:
        opts["top_k"] = max(top_k, 0)  # -1 (vLLM) and 0 both mean "off"
    seed = _int(body, "seed")
    if seed is not None:
        opts["seed"] = seed
    bias = _logit_bias(body)
    if bias:
        opts["logit_bias"] = bias
    stop = _stop(body)
    if stop:
        opts["stop"] = stop
    opts["ignore_eos"] = _bool(body, "ignore_eos")
    fmt = check_response_format(body.get("response_format"))
    if fmt is not None:
        opts["response_format"] = fmt
    opts.update(cache_salt(body))
    return opts


def cache_salt(body: dict[str, Any]) -> dict[str, str]:
    """`cache_salt` (as in vLLM): requests with different salts never share prefix KV."""
    salt = _str(body, "cache_salt")
    if salt is None:
        return {}
    if not 0 < len(salt) <= MAX_CACHE_SALT:
        raise bad_request(f"'cache_salt' must be a non-empty string of at most "
                          f"{MAX_CACHE_SALT} characters", "cache_salt")
    return {"cache_salt": salt}


def _streaming(body: dict[str, Any]) -> tuple[bool, bool]:
    stream = _bool(body, "stream")
    so = body.get("stream_options")
    include_usage = False
    if so is not None:
        include_usage = _bool(_object(so, "stream_options"), "include_usage")
    return stream, include_usage


# ---- chat ----------------------------------------------------------------------------------


def parse_chat(body: dict[str, Any]) -> ChatRequest:
    if "messages" not in body:
        raise bad_request("'messages' is required", "messages")
    messages = body["messages"]
    if not isinstance(messages, list) or not messages:
        raise bad_request("'messages' must be a non-empty array of message objects", "messages")
    check_message_count(len(messages))
    stream, include_usage = _streaming(body)
    logprobs = _bool(body, "logprobs")
    top = _int(body, "top_logprobs", lo=0, hi=MAX_TOP_LOGPROBS) or 0
    if top and not logprobs:
        raise bad_request("'top_logprobs' requires 'logprobs': true", "top_logprobs")
    tools = _tools(body.get("tools"))
    options = _options(body, ("max_tokens", "max_completion_tokens"))
    options.update(logprobs=logprobs, top_logprobs=top)
    return ChatRequest(
        messages=[_message(m, i) for i, m in enumerate(messages)], model=_str(body, "model"),
        stream=stream, include_usage=include_usage, tools=tools,
        tool_choice=_tool_choice(body.get("tool_choice"), tools), logprobs=logprobs,
        top_logprobs=top, options=options,
    )


def _message(m: Any, i: int) -> dict[str, Any]:
    where = f"messages[{i}]"
    if not isinstance(m, dict):
        raise bad_request(f"'{where}' must be an object, got {_kind(m)}", where)
    role = m.get("role")
    if not isinstance(role, str) or role not in ROLES:  # a list or object is no role either
        raise bad_request(f"'{where}.role' must be one of {sorted(ROLES)}, got {role!r}",
                          f"{where}.role")
    out: dict[str, Any] = {"role": "system" if role == "developer" else role}
    content = m.get("content")
    if content is None:
        if role not in ("assistant", "tool"):
            raise bad_request(f"'{where}.content' is required for role {role!r}",
                              f"{where}.content")
        content = ""
    out["content"] = _content(content, f"{where}.content")
    for key in ("name", "tool_call_id"):
        value = m.get(key)
        if value is not None:
            if not isinstance(value, str):
                raise bad_request(f"'{where}.{key}' must be a string", f"{where}.{key}")
            out[key] = value
    calls = m.get("tool_calls")
    if calls is not None:
        if role != "assistant" or not isinstance(calls, list):
            raise bad_request(f"'{where}.tool_calls' must be an array on an assistant message",
                              f"{where}.tool_calls")
        out["tool_calls"] = [_past_call(c, f"{where}.tool_calls[{j}]")
                             for j, c in enumerate(calls)]
    return out


def _content(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request(f"'{where}' must be a string or an array of text parts, "
                          f"got {_kind(content)}", where)
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type", "text") if isinstance(part, dict) else None
        if isinstance(part, dict) and kind != "text":
            raise bad_request(f"'{where}[{j}]': content parts of type {kind!r} are not "
                              f"supported (text only)", f"{where}[{j}]")
        if not isinstance(part, dict) or not isinstance(part.get("text"), str):
            raise bad_request(f"'{where}[{j}]' must be {{'type': 'text', 'text': <string>}}",
                              f"{where}[{j}]")
        texts.append(part["text"])
    return "\n".join(texts)


def _past_call(call: Any, where: str) -> dict[str, Any]:
    """A tool call the assistant made earlier in the conversation."""
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise bad_request(f"'{where}' must be {{'type': 'function', 'function': "
                          f"{{'name': ..., 'arguments': ...}}}}", where)
    args = fn.get("arguments", "{}")
    if not isinstance(args, str | dict):
        raise bad_request(f"'{where}.function.arguments' must be a JSON string",
                          f"{where}.function.arguments")
    out = {"type": "function", "function": {"name": fn["name"], "arguments": args}}
    if isinstance(call.get("id"), str):
        out["id"] = call["id"]
    return out


def _tools(value: Any) -> list[dict[str, Any]] | None:
    if value is None:
        return None
    if not isinstance(value, list):
        raise bad_request(f"'tools' must be an array, got {_kind(value)}", "tools")
    tools = []
    for i, tool in enumerate(value):
        where = f"tools[{i}]"
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type", "function") != "function" \
                or not isinstance(fn, dict):
            raise bad_request(f"'{where}' must be {{'type': 'function', 'function': {{...}}}}",
                              where)
        name = fn.get("name")
        if not isinstance(name, str) or not name:
            raise bad_request(f"'{where}.function.name' must be a non-empty string",
                              f"{where}.function.name")
        clean: dict[str, Any] = {"name": name}
        if fn.get("description") is not None:
            if not isinstance(fn["description"], str):
                raise bad_request(f"'{where}.function.description' must be a string",
                                  f"{where}.function.description")
            clean["description"] = fn["description"]
        if fn.get("parameters") is not None:
            clean["parameters"] = _object(fn["parameters"], f"{where}.function.parameters")
        tools.append({"type": "function", "function": clean})
    return tools or None


def _tool_choice(value: Any, tools: list[dict[str, Any]] | None) -> ToolChoice:
    if value is None:
        return ToolChoice("auto" if tools else "none")
    if value in ("none", "auto", "required"):
        if value == "required" and not tools:
            raise bad_request("'tool_choice' is 'required' but no 'tools' were given",
                              "tool_choice")
        return ToolChoice(value if tools else "none")
    fn = value.get("function") if isinstance(value, dict) else None
    name = fn.get("name") if isinstance(fn, dict) else None
    if not isinstance(name, str):
        raise bad_request("'tool_choice' must be 'none', 'auto', 'required' or "
                          "{'type': 'function', 'function': {'name': ...}}", "tool_choice")
    if not any(t["function"]["name"] == name for t in tools or []):
        raise bad_request(f"'tool_choice' names the function {name!r}, which is not in 'tools'",
                          "tool_choice")
    return ToolChoice("function", name)


# ---- completions ---------------------------------------------------------------------------


def parse_completion(body: dict[str, Any]) -> CompletionRequest:
    if "prompt" not in body:
        raise bad_request("'prompt' is required", "prompt")
    if _bool(body, "echo"):
        raise APIError(400, "'echo' is not supported", param="echo", code="unsupported")
    if body.get("suffix"):
        raise APIError(400, "'suffix' is not supported", param="suffix", code="unsupported")
    best_of = _int(body, "best_of")
    if best_of not in (None, 1):
        raise APIError(400, "'best_of' > 1 is not supported", param="best_of",
                       code="unsupported")
    stream, include_usage = _streaming(body)
    logprobs = _int(body, "logprobs", lo=0, hi=MAX_TOP_LOGPROBS)
    options = _options(body, ("max_tokens",))
    if logprobs is not None:
        options.update(logprobs=True, top_logprobs=logprobs)
    return CompletionRequest(prompt=_prompt(body["prompt"]), model=_str(body, "model"),
                             stream=stream, include_usage=include_usage, logprobs=logprobs,
                             options=options)


def _prompt(value: Any) -> str | list[int]:
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], str | list):
        value = value[0]  # a batch of one
    if isinstance(value, str):
        if not value:
            raise bad_request("'prompt' is empty", "prompt")
        return value
    if isinstance(value, list) and value and all(
            isinstance(t, int) and not isinstance(t, bool) for t in value):
        return value
    if isinstance(value, list) and len(value) > 1 and all(
            isinstance(p, str | list) for p in value):
        raise APIError(400, "batched prompts are not supported: send one prompt per request",
                       param="prompt", code="unsupported")
    raise bad_request("'prompt' must be a non-empty string or an array of token ids", "prompt")
