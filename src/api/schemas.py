"""The request bodies of both surfaces as pydantic models; a mistake is a 400 naming the field.

One model per body: `ChatCompletionBody` (POST /v1/chat/completions), `CompletionBody`
(/v1/completions) and `MessagesBody` (Anthropic's /v1/messages). Each declares every field the
server reads, its JSON type and its limits, and is the OpenAPI document's schema of that body
(`openapi_document`, served at GET /openapi.json). The rules:

- JSON's own types only (strict): "1" is no number and true no integer, but 1.0 is the integer 1
  (some clients write every number as a float). Unknown fields are ignored (OpenAI clients send
  many).
- Float knobs are checked as the float32 sampler uses them, from the sampler's own table
  (`runtime.sampling.KNOB_RANGES`, which `SamplingParams.validate` also guards): finite, in
  range as a float and after the cast, and not below the smallest value float32 keeps.
- The cheap-refusal caps are limits of the models: at most `MAX_MESSAGES` messages (counted
  before any message is looked at), `MAX_STOP` stop strings, `MAX_TOP_LOGPROBS` alternatives.

A `ValidationError` becomes one `APIError` (`request_error`): its first error's location is the
`param` ('messages[0].role'; a field the engine takes whole, such as 'logit_bias', names just
that field), and its text comes from `_MESSAGES`, the one table of what a client is told. The
Anthropic body names its fields Anthropic's way (messages.0.role, no quotes).

`parse_chat` and `parse_completion` (and `anthropic.parse_messages`) then turn a valid body into
what the handlers take: chat-template messages, the tool choice and `Engine.make_request`
keywords. The body's JSON itself is read by `parse_body`: strict JSON (no NaN), no lone
surrogates.
"""

from __future__ import annotations

import functools
import json
import re
from dataclasses import dataclass, field
from typing import Annotated, Any, ClassVar, Literal, NotRequired, TypeVar

import numpy as np
import structlog
from annotated_types import Ge, Le, MaxLen, MinLen
from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    PlainValidator,
    StringConstraints,
    ValidationError,
    ValidationInfo,
    WithJsonSchema,
    WrapValidator,
    field_validator,
    model_validator,
    with_config,
)
from pydantic.json_schema import models_json_schema
from pydantic.types import AllowInfNan
from pydantic_core import PydanticCustomError
from typing_extensions import TypedDict  # pydantic takes typing's only from Python 3.12

from slotserve.api.errors import APIError, bad_request
from slotserve.api.limits import MAX_MESSAGES
from slotserve.api.reasoning import EFFORTS, Thinking
from slotserve.api.tools import ToolChoice
from slotserve.runtime.sampling import KNOB_RANGES, MAX_TOP_LOGPROBS, MIN_TEMPERATURE, KnobRange

log = structlog.get_logger("slotserve.api")

MAX_STOP = 16
MAX_CACHE_SALT = 1024  # characters
_TOKEN_ID = r"^[0-9]{1,10}$"  # ASCII digits only (int() takes " 1", "1_000", "٣")


# ---- what a client is told -----------------------------------------------------------------

# Error type (pydantic's own, or one raised below) -> message. `{name}` is the field as the
# client wrote it, `{kind}` the JSON type it sent, `{value}` a short repr of the value; the other
# fields come from the error's context. Every min_length below is 1 ("must not be empty").
_MESSAGES: dict[str, str] = {
    "missing": "{name} is required",
    "bool_type": "{name} must be a boolean, got {kind}",
    "int_type": "{name} must be an integer, got {kind}",
    "float_type": "{name} must be a number, got {kind}",
    "finite_number": "{name} must be a finite number, got {value}",
    "string_type": "{name} must be a string, got {kind}",
    "dict_type": "{name} must be an object, got {kind}",
    "model_type": "{name} must be an object, got {kind}",
    "list_type": "{name} must be an array, got {kind}",
    "literal_error": "{name} must be {expected}, got {value}",
    "greater_than_equal": "{name} must be >= {ge}, got {value}",
    "less_than_equal": "{name} must be <= {le}, got {value}",
    "too_short": "{name} must not be empty",
    "too_long": "{name} holds {actual_length} items; at most {max_length} are allowed",
    "string_too_short": "{name} must not be empty",
    "string_too_long": "{name} must be at most {max_length} characters long",
    "one_of": "{name} must be {expected}",
    "knob_range": "{name} must be in {range}, got {value}{note}",
    "string_pattern_mismatch": "{name} keys must be token ids in plain decimal digits, got "
                               "{value}",  # the one pattern here: logit_bias's keys
    "token_range": "{name} token id {token} is out of range [0, {vocab_size})",
    "text_or_list": "{name} must be a string or an array of strings, got {kind}",
    "text_or_parts": "{name} must be a string or an array of text parts, got {kind}",
    "text_or_blocks": "{name} must be a string or an array of text blocks, got {kind}",
    "content_or_blocks": "{name} must be a string or an array of content blocks, got {kind}",
    "part_type": "{name}: content parts of type {part} are not supported (text only)",
    "block_type": "{name}: content blocks of type {block} are not supported in {role} messages "
                  "(supported: {allowed})",
    "content_required": "{name} is required for role {role}",
    "calls_on_assistant": "{name} must be an array on an assistant message",
    "required_for": "{name} is required when {when}",
    "requires": "{name} requires {other}",
    "no_tools": "{name} is {choice} but no 'tools' were given",
    "unknown_tool": "{name} names the function {tool}, which is not in 'tools'",
    "empty": "{name} is empty",
    "prompt_type": "{name} must be a non-empty string or an array of token ids",
    "n_unsupported": "{name} = {value} is not supported: this server returns one choice per "
                     "request (send {value} requests instead)",
    "not_supported": "{name} is not supported",
    "best_of_unsupported": "{name} > 1 is not supported",
    "batched_prompt": "batched prompts are not supported: send one prompt per request",
    "item_object": "{name} must be an object (an input item)",
    "item_string": "{name} must be a string",
    "item_role": "{name} must be 'user', 'assistant', 'system' or 'developer'",
    "item_parts": "{name} must be a string or an array of text parts",
}
_CODES = {"too_long": "array_above_max_length", "n_unsupported": "unsupported",
          "not_supported": "unsupported", "best_of_unsupported": "unsupported",
          "batched_prompt": "unsupported"}
# Fields the engine takes whole: an error inside one names the field itself as the param.
_WHOLE = frozenset({"logit_bias", "prompt", "response_format", "stop", "stream_options",
                    "tool_choice"})


def _fail(kind: str, *at: str | int, **ctx: Any) -> PydanticCustomError:
    """The error of type `kind` for the value being validated; `at` locates it further
    inside that value (an element a validator of the whole found at fault)."""
    return PydanticCustomError(kind, _MESSAGES[kind], {**ctx, "at": at} if at else ctx)


def request_error(exc: ValidationError, anthropic: bool = False) -> APIError:
    """The 400 for a body that failed validation: its first error, named the surface's way."""
    err = exc.errors(include_url=False)[0]
    kind, value = err["type"], err.get("input")
    ctx = dict(err.get("ctx") or {})
    loc = tuple(err["loc"])
    if loc[-1:] == ("[key]",):  # a bad key of an object: the object is the field at fault
        loc = loc[:-2]
    loc += tuple(ctx.pop("at", ()))
    if kind == "float_type" and isinstance(value, int) and not isinstance(value, bool):
        kind = "finite_number"  # an integer past any float (10**400)
    return _error(kind, loc, value, ctx, anthropic, err.get("msg", ""))


def _error(kind: str, loc: tuple[str | int, ...], value: Any, ctx: dict[str, Any],
           anthropic: bool, fallback: str = "") -> APIError:
    path = _path(loc, anthropic)
    name = path if anthropic else f"'{path}'"
    template = _MESSAGES.get(kind)
    if template is None:  # a pydantic error no model here should raise: its own words
        message = f"{name}: {fallback}"
    else:
        message = template.format(name=name, kind=_kind(value), value=short_repr(value), **ctx)
    param = str(loc[0]) if loc and loc[0] in _WHOLE else path or None
    return APIError(400, message, param=param, code=_CODES.get(kind))


def _path(loc: tuple[str | int, ...], anthropic: bool) -> str:
    """('messages', 0, 'role') -> messages[0].role (OpenAI) or messages.0.role (Anthropic);
    an object's key that is no identifier (a token id) is written in brackets."""
    out = ""
    for part in loc:
        if anthropic:
            out += f".{part}" if out else str(part)
        elif isinstance(part, int) or not part.isidentifier():
            out += f"[{part}]"
        else:
            out += f".{part}" if out else part
    return out


def _kind(value: Any) -> str:
    names = {dict: "an object", list: "an array", str: "a string", bool: "a boolean",
             int: "an integer", float: "a number", type(None): "null"}
    return names.get(type(value), type(value).__name__)


def short_repr(value: object) -> str:
    """A value for an error message: a scalar's repr cut to ~40 characters (never the whole of
    a huge input, never an exception for an int past Python's digit limit); a container by its
    kind (its repr could be megabytes, or nested past the recursion limit)."""
    if isinstance(value, dict | list | tuple):
        return _kind(value)
    if isinstance(value, str) and len(value) > 40:
        return f"{value[:20]!r}...({len(value)} characters)"
    try:
        text = repr(value)
    except ValueError:  # an int past Python's 4,300-digit str limit
        return "an integer of over 4300 digits"
    return text if len(text) <= 40 else f"{text[:20]}...({len(text)} characters)"


M = TypeVar("M", bound="Wire")


def validated(model: type[M], body: dict[str, Any]) -> M:
    """`body` as a `model`, or the APIError (400) of its first mistake."""
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        raise request_error(exc, model.anthropic) from None


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


# ---- field types ---------------------------------------------------------------------------


class Wire(BaseModel):
    """A request body or a part of one: JSON's own types only, unknown fields ignored."""

    model_config = ConfigDict(strict=True, extra="ignore")
    anthropic: ClassVar[bool] = False  # name fields Anthropic's way in errors


def _integral_float(value: Any) -> Any:
    """1.0 is the integer 1; 1.5 stays a float, which the strict int check refuses."""
    return int(value) if isinstance(value, float) and value.is_integer() else value


def _integer(*limits: Any) -> Any:
    """A JSON integer within `limits` (annotated_types bounds, kept in the int's own schema so
    the JSON Schema says minimum / maximum)."""
    return Annotated[int, *limits, BeforeValidator(_integral_float)]


Integer = _integer()
PositiveInt = _integer(Ge(1))
LogprobCount = _integer(Ge(0), Le(MAX_TOP_LOGPROBS))
Number = Annotated[float, AllowInfNan(False)]  # 1e400 (inf) and 10**400 have no finite float


def _range_note(limits: KnobRange, value: float) -> str:
    """Why a value inside the knob's bounds as written is still refused (float32 loses it)."""
    inside = (limits.lo < value if limits.open_lo else limits.lo <= value) and value <= limits.hi
    if not inside:
        return ""
    if abs(value) < limits.floor:
        return f" (below {limits.floor:g}, the least the float32 sampler takes)"
    with np.errstate(over="ignore", under="ignore"):
        return f" ({float(np.float32(value)):g} in float32)"


def _greedy_when_tiny(value: float) -> float:
    """A temperature whose 1 / t float32 cannot hold is greedy anyway: it is sent as 0."""
    return 0.0 if 0.0 < value < MIN_TEMPERATURE else value


def _knob(name: str, *before_check: AfterValidator) -> Any:
    """The type of the float knob `name`: a finite number within `KNOB_RANGES[name]`."""
    limits = KNOB_RANGES[name]

    def check(value: float) -> float:
        if not limits.contains(value):
            raise _fail("knob_range", range=str(limits), note=_range_note(limits, value))
        return value

    bounds = {"exclusiveMinimum" if limits.open_lo else "minimum": limits.lo,
              "maximum": limits.hi}
    return Annotated[float, AllowInfNan(False), *before_check, AfterValidator(check),
                     WithJsonSchema({"type": "number", **bounds})]


Temperature = _knob("temperature", AfterValidator(_greedy_when_tiny))
TopP = _knob("top_p")
MinP = _knob("min_p")
RepetitionPenalty = _knob("repetition_penalty")
FrequencyPenalty = _knob("frequency_penalty")
PresencePenalty = _knob("presence_penalty")


def _int_keys(bias: dict[str, float]) -> dict[int, float]:
    return {int(k): v for k, v in bias.items()}


TokenId = Annotated[str, StringConstraints(pattern=_TOKEN_ID)]
LogitBias = Annotated[dict[TokenId, Number], AfterValidator(_int_keys)]
CacheSalt = Annotated[str, MinLen(1), MaxLen(MAX_CACHE_SALT)]  # as in vLLM


def _strings(value: Any) -> Any:
    """`stop`: one string is a list of one."""
    if isinstance(value, str):
        return [value]
    if not isinstance(value, list):
        raise _fail("text_or_list")
    return value


Stop = Annotated[list[str], MaxLen(MAX_STOP),
                 BeforeValidator(_strings, json_schema_input_type=str | Annotated[
                     list[str], MaxLen(MAX_STOP)])]


def _one_of(expected: str) -> WrapValidator:
    """Replace a union's errors (one per member) by one that lists what is accepted."""
    def validate(value: Any, handler: Any) -> Any:
        try:
            return handler(value)
        except ValidationError:
            raise _fail("one_of", expected=expected) from None

    return WrapValidator(validate)


# ---- shared parts ----------------------------------------------------------------------------


class StreamOptions(Wire):
    include_usage: bool | None = None


class JsonSchemaSpec(Wire):
    name: str | None = None
    schema_: dict[str, Any] = Field(default_factory=dict, alias="schema")
    strict: bool | None = None


class ResponseFormat(Wire):
    """`response_format`. Only its shape is checked here; the schema is compiled when the
    request is made, and one llguidance cannot honour is refused then (a 400 too)."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaSpec | None = Field(None, validate_default=True)

    @model_validator(mode="before")
    @classmethod
    def _schema_only_for_its_type(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("type") != "json_schema":
            return {k: data[k] for k in ("type",) if k in data}  # the rest is ignored
        return data

    @field_validator("json_schema")
    @classmethod
    def _needs_schema(cls, spec: JsonSchemaSpec | None,
                      info: ValidationInfo) -> JsonSchemaSpec | None:
        if spec is None and info.data.get("type") == "json_schema":
            raise _fail("required_for", when="'type' is 'json_schema'")
        return spec

    def option(self) -> dict[str, Any] | None:
        """The engine's `response_format` option (None: plain text)."""
        if self.type == "text":
            return None
        spec = self.json_schema
        if self.type == "json_object" or spec is None:
            return {"type": "json_object"}
        return {"type": "json_schema", "json_schema": {
            "name": spec.name, "schema": spec.schema_, "strict": spec.strict}}


# ---- OpenAI --------------------------------------------------------------------------------

# The elements of arrays only the body size bounds (content parts, tools, past tool calls, and
# Anthropic's blocks) are TypedDicts, validated in pydantic-core without a model object each:
# an 8 MiB body of 300,000-600,000 tiny elements takes 0.1-0.7 s to check, about what json.loads
# of it takes (and the hand-written checks before these models); as models it took 3-5 s.
_ELEMENT = ConfigDict(strict=True, extra="ignore")


@with_config(_ELEMENT)
class TextPart(TypedDict):
    type: NotRequired[Literal["text"]]
    text: str


def _text_as_part(value: Any) -> Any:
    """Message content: a string is one text part."""
    if isinstance(value, str):
        return [{"type": "text", "text": value}]
    if value is not None and not isinstance(value, list):
        raise _fail("text_or_parts")
    return value


@with_config(_ELEMENT)
class PastFunction(TypedDict):
    name: str
    arguments: NotRequired[Annotated[str | dict[str, Any],
                                     _one_of("a JSON string or an object")]]


@with_config(_ELEMENT)
class PastToolCall(TypedDict):
    """A tool call the assistant made earlier in the conversation."""

    id: NotRequired[Annotated[Any, WithJsonSchema({"type": "string"})]]  # kept if a string
    function: PastFunction


def _template_call(call: PastToolCall) -> dict[str, Any]:
    fn = call["function"]
    out: dict[str, Any] = {"type": "function", "function": {
        "name": fn["name"], "arguments": fn.get("arguments", "{}")}}
    if isinstance(call.get("id"), str):
        out["id"] = call["id"]
    return out


class ChatMessage(Wire):
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: Annotated[list[TextPart] | None, BeforeValidator(
        _text_as_part, json_schema_input_type=str | list[TextPart] | None)] = Field(
            None, validate_default=True)
    name: str | None = None
    tool_call_id: str | None = None
    tool_calls: list[PastToolCall] | None = None
    # an assistant turn's reasoning as this server sent it (chat's reasoning_content), for a
    # template that writes it back (Qwen3.5's within a tool loop; gpt-oss's as `thinking`)
    reasoning_content: str | None = None

    @model_validator(mode="before")
    @classmethod
    def _text_parts_only(cls, data: Any) -> Any:
        """A part of another type is refused as a whole (images and audio are not read)."""
        content = data.get("content") if isinstance(data, dict) else None
        for j, part in enumerate(content if isinstance(content, list) else ()):
            if isinstance(part, dict) and part.get("type", "text") != "text":
                raise _fail("part_type", "content", j, part=short_repr(part.get("type")))
        return data

    @field_validator("content")
    @classmethod
    def _content_required(cls, content: list[TextPart] | None,
                          info: ValidationInfo) -> list[TextPart] | None:
        role = info.data.get("role")
        if content is None and role is not None and role not in ("assistant", "tool"):
            raise _fail("content_required", role=repr(role))
        return content

    @field_validator("tool_calls")
    @classmethod
    def _calls_on_assistant(cls, calls: list[PastToolCall] | None,
                            info: ValidationInfo) -> list[PastToolCall] | None:
        role = info.data.get("role")
        if calls is not None and role is not None and role != "assistant":
            raise _fail("calls_on_assistant")
        return calls

    def template_message(self) -> dict[str, Any]:
        """The message as the chat template takes it (the developer role is system's)."""
        out: dict[str, Any] = {"role": "system" if self.role == "developer" else self.role,
                               "content": "\n".join(p["text"] for p in self.content or [])}
        if self.name is not None:
            out["name"] = self.name
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        if self.tool_calls is not None:
            out["tool_calls"] = [_template_call(c) for c in self.tool_calls]
        if self.reasoning_content and self.role == "assistant":
            out["reasoning_content"] = self.reasoning_content
        return out


@with_config(_ELEMENT)
class FunctionDef(TypedDict):
    name: Annotated[str, MinLen(1)]
    description: NotRequired[str | None]
    parameters: NotRequired[dict[str, Any] | None]


@with_config(_ELEMENT)
class Tool(TypedDict):
    type: NotRequired[Literal["function"]]
    function: FunctionDef


def _known_tools(kinds: tuple[str, ...]) -> BeforeValidator:
    """Drop tools of types this server does not run (web_search, namespace, computer use, a
    hosted MCP server...) with a log line: agents send them whatever the server; the model
    is told only of the tools it can call. A tool with no type is of the first kind."""
    def keep(value: Any) -> Any:
        if not isinstance(value, list):
            return value
        kept = []
        for tool in value:
            kind = tool.get("type", kinds[0]) if isinstance(tool, dict) else kinds[0]
            if kind in kinds:
                kept.append(tool)
            else:
                log.info("tool ignored", type=short_repr(kind),
                         why=f"only {', '.join(kinds)} tools are served")
        return kept

    return BeforeValidator(keep)


def _openai_tool(tool: Tool) -> dict[str, Any]:
    """The tool as the tool code takes it (unset description and parameters left out)."""
    fn = tool["function"]
    return {"type": "function", "function": {
        k: fn[k] for k in ("name", "description", "parameters") if fn.get(k) is not None}}


class NamedFunction(Wire):
    name: str


class NamedToolChoice(Wire):
    function: NamedFunction


OpenAIToolChoice = Annotated[
    Literal["none", "auto", "required"] | NamedToolChoice,
    _one_of("'none', 'auto', 'required' or {'type': 'function', 'function': {'name': ...}}")]


class _OpenAIBody(Wire):
    """What both OpenAI routes take: the model, streaming, and the sampling and length
    options (`Engine.make_request` keywords)."""

    model: str | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    n: Integer | None = None
    max_tokens: PositiveInt | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    min_p: MinP | None = None
    frequency_penalty: FrequencyPenalty | None = None
    presence_penalty: PresencePenalty | None = None
    repetition_penalty: RepetitionPenalty | None = None
    top_k: _integer(Ge(-1)) | None = None  # -1 (vLLM) and 0 both mean "off"
    seed: Integer | None = None
    logit_bias: LogitBias | None = None
    stop: Stop | None = None
    ignore_eos: bool | None = None
    response_format: ResponseFormat | None = None
    cache_salt: CacheSalt | None = None  # requests with different salts never share KV

    @field_validator("n")
    @classmethod
    def _one_choice(cls, n: int | None) -> int | None:
        if n is not None and n != 1:
            raise _fail("n_unsupported")
        return n

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def options(self, max_tokens: int | None) -> dict[str, Any]:
        """The sampling and length options, as `Engine.make_request` keywords."""
        opts: dict[str, Any] = {} if max_tokens is None else {"max_tokens": max_tokens}
        for key in KNOB_RANGES:
            value = getattr(self, key)
            if value is not None:
                opts[key] = value
        if self.top_k is not None:
            opts["top_k"] = max(self.top_k, 0)
        if self.seed is not None:
            opts["seed"] = self.seed
        if self.logit_bias:
            opts["logit_bias"] = self.logit_bias
        if self.stop:
            opts["stop"] = self.stop
        opts["ignore_eos"] = bool(self.ignore_eos)
        fmt = self.response_format.option() if self.response_format is not None else None
        if fmt is not None:
            opts["response_format"] = fmt
        if self.cache_salt is not None:
            opts["cache_salt"] = self.cache_salt
        return opts


class ChatCompletionBody(_OpenAIBody):
    """POST /v1/chat/completions."""

    messages: Annotated[list[ChatMessage], MinLen(1), MaxLen(MAX_MESSAGES)]
    max_completion_tokens: PositiveInt | None = None  # wins over max_tokens
    logprobs: bool | None = None
    top_logprobs: LogprobCount | None = None
    tools: Annotated[list[Tool], _known_tools(("function",))] | None = None
    tool_choice: OpenAIToolChoice | None = None
    parallel_tool_calls: bool | None = None
    # passed to a chat template that has a reasoning switch (reasoning.template_options)
    reasoning_effort: Literal[EFFORTS] | None = None  # type: ignore[valid-type]

    @field_validator("top_logprobs")
    @classmethod
    def _needs_logprobs(cls, top: int | None, info: ValidationInfo) -> int | None:
        if top and "logprobs" in info.data and not info.data["logprobs"]:
            raise _fail("requires", other="'logprobs': true")
        return top

    @field_validator("tool_choice")
    @classmethod
    def _choice_in_tools(cls, choice: Any, info: ValidationInfo) -> Any:
        if "tools" not in info.data:  # the tools' own error is the one reported
            return choice
        names = {t["function"]["name"] for t in info.data["tools"] or []}
        if choice == "required" and not names:
            raise _fail("no_tools", choice="'required'")
        if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
            raise _fail("unknown_tool", tool=short_repr(choice.function.name))
        return choice

    def request(self) -> ChatRequest:
        tools = [_openai_tool(t) for t in self.tools or []] or None
        choice = self.tool_choice
        if choice is None:
            tool_choice = ToolChoice("auto" if tools else "none")
        elif isinstance(choice, NamedToolChoice):
            tool_choice = ToolChoice("function", choice.function.name)
        else:
            tool_choice = ToolChoice(choice if tools else "none")
        top = self.top_logprobs or 0
        logprobs = bool(self.logprobs)
        max_tokens = self.max_completion_tokens or self.max_tokens
        options = {**self.options(max_tokens), "logprobs": logprobs, "top_logprobs": top}
        return ChatRequest(
            messages=[m.template_message() for m in self.messages], model=self.model,
            stream=bool(self.stream), include_usage=self.include_usage, tools=tools,
            tool_choice=tool_choice, logprobs=logprobs, top_logprobs=top, options=options,
            parallel_tool_calls=self.parallel_tool_calls is not False,
            thinking=Thinking.openai(self.reasoning_effort))


def _prompt(value: Any) -> str | list[int]:
    """A non-empty text or token-id list; a batch of one is that one prompt."""
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], str | list):
        value = value[0]
    if isinstance(value, str):
        if not value:
            raise _fail("empty")
        return value
    if isinstance(value, list) and value and all(
            isinstance(t, int) and not isinstance(t, bool) for t in value):
        return value
    if isinstance(value, list) and len(value) > 1 and all(
            isinstance(p, str | list) for p in value):
        raise _fail("batched_prompt")
    raise _fail("prompt_type")


Prompt = Annotated[str | list[int], PlainValidator(
    _prompt, json_schema_input_type=Annotated[str, MinLen(1)] | Annotated[list[int], MinLen(1)])]


def _falsy(value: Any) -> Any:
    if value:
        raise _fail("not_supported")
    return value


class CompletionBody(_OpenAIBody):
    """POST /v1/completions (the legacy text completion)."""

    prompt: Prompt
    echo: bool | None = None
    suffix: Annotated[Any, AfterValidator(_falsy),
                      WithJsonSchema({"type": "string", "maxLength": 0})] = None
    best_of: Integer | None = None
    logprobs: LogprobCount | None = None  # alternatives per token

    @field_validator("echo")
    @classmethod
    def _no_echo(cls, echo: bool | None) -> bool | None:
        if echo:
            raise _fail("not_supported")
        return echo

    @field_validator("best_of")
    @classmethod
    def _one_of_one(cls, best_of: int | None) -> int | None:
        if best_of not in (None, 1):
            raise _fail("best_of_unsupported")
        return best_of

    def request(self) -> CompletionRequest:
        options = self.options(self.max_tokens)
        if self.logprobs is not None:
            options.update(logprobs=True, top_logprobs=self.logprobs)
        return CompletionRequest(prompt=self.prompt, model=self.model, stream=bool(self.stream),
                                 include_usage=self.include_usage, logprobs=self.logprobs,
                                 options=options)


@dataclass
class ChatRequest:
    messages: list[dict[str, Any]]  # as the chat template takes them
    model: str | None = None
    stream: bool = False
    include_usage: bool = False
    tools: list[dict[str, Any]] | None = None
    tool_choice: ToolChoice = field(default_factory=ToolChoice)
    logprobs: bool = False
    top_logprobs: int = 0
    options: dict[str, Any] = field(default_factory=dict)  # Engine.make_request keywords
    parallel_tool_calls: bool = True
    thinking: Thinking | None = None


@dataclass
class CompletionRequest:
    prompt: str | list[int]
    model: str | None = None
    stream: bool = False
    include_usage: bool = False
    logprobs: int | None = None  # None: no logprobs; k: the chosen token plus k alternatives
    options: dict[str, Any] = field(default_factory=dict)


def parse_chat(body: dict[str, Any]) -> ChatRequest:
    return validated(ChatCompletionBody, body).request()


def parse_completion(body: dict[str, Any]) -> CompletionRequest:
    return validated(CompletionBody, body).request()


class _FormatOnly(Wire):
    response_format: ResponseFormat | None = None


def check_response_format(value: Any) -> dict[str, Any] | None:
    """A `response_format` value -> the engine's `response_format` option (None: plain text)."""
    fmt = validated(_FormatOnly, {"response_format": value}).response_format
    return None if fmt is None else fmt.option()


def check_vocabulary(options: dict[str, Any], vocab_size: int) -> None:
    """Refuse `logit_bias` ids past the vocabulary, which only the loaded model knows."""
    bad = next((t for t in options.get("logit_bias") or () if t >= vocab_size), None)
    if bad is not None:
        raise _error("token_range", ("logit_bias",), bad,
                     {"token": bad, "vocab_size": vocab_size}, anthropic=False)


def out_of_vocabulary(param: str, token: int, vocab_size: int) -> APIError:
    """The 400 for a token id (of a prompt) that the vocabulary does not have."""
    return _error("token_range", (param,), token, {"token": token, "vocab_size": vocab_size},
                  anthropic=False)


# ---- Anthropic -----------------------------------------------------------------------------


@with_config(_ELEMENT)
class TextBlock(TypedDict):
    type: Literal["text"]
    text: str


def _as_text_blocks(value: Any) -> Any:
    """A system prompt or tool result: a string is one text block."""
    if isinstance(value, str):
        return [{"type": "text", "text": value}]
    if not isinstance(value, list):
        raise _fail("text_or_blocks")
    return value


Text = Annotated[list[TextBlock], BeforeValidator(
    _as_text_blocks, json_schema_input_type=str | list[TextBlock])]


def joined(blocks: list[TextBlock]) -> str:
    return "\n".join(b["text"] for b in blocks)


@with_config(_ELEMENT)
class ToolUseBlock(TypedDict):
    type: Literal["tool_use"]
    id: str
    name: str
    input: NotRequired[dict[str, Any]]  # {} when left out


@with_config(_ELEMENT)
class ToolResultBlock(TypedDict):
    type: Literal["tool_result"]
    tool_use_id: str
    content: NotRequired[Text]  # "" when left out
    # any truthy value marks an error, as before these models (Anthropic sends a boolean)
    is_error: NotRequired[Annotated[Any, WithJsonSchema({"type": "boolean"})]]


@with_config(_ELEMENT)
class ThinkingBlock(TypedDict):
    """Reasoning an assistant turn showed (thinking) or hid (redacted_thinking): sent back by
    clients with the history; a shown one is the turn's reasoning_content (written back by a
    template that keeps reasoning, dropped by the others)."""

    type: Literal["thinking", "redacted_thinking"]
    thinking: NotRequired[str]


Block = Annotated[TextBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock,
                  Field(discriminator="type")]
_BLOCKS_OF = {"user": ("text", "tool_result"),
              "assistant": ("text", "tool_use", "thinking", "redacted_thinking"),
              "system": ("text",)}


def _as_blocks(value: Any) -> Any:
    """Message content: a string is one text block."""
    if isinstance(value, str):
        return [{"type": "text", "text": value}]
    if not isinstance(value, list):
        raise _fail("content_or_blocks")
    return value


class AnthropicMessage(Wire):
    # "system": a system message inside the conversation (Claude Code's beta
    # mid-conversation-system), rendered in place
    role: Literal["user", "assistant", "system"]
    content: Annotated[list[Block], BeforeValidator(
        _as_blocks, json_schema_input_type=str | list[Block])]

    @model_validator(mode="before")
    @classmethod
    def _blocks_of_role(cls, data: Any) -> Any:
        """A user sends text and tool results, the assistant text and tool calls."""
        if not isinstance(data, dict) or not isinstance(data.get("content"), list):
            return data
        role = data.get("role")
        allowed = _BLOCKS_OF.get(role) if isinstance(role, str) else None
        for j, block in enumerate(data["content"] if allowed else ()):
            kind = block.get("type") if isinstance(block, dict) else None
            if kind not in allowed:
                raise _fail("block_type", "content", j, block=short_repr(kind),
                            role=role, allowed=", ".join(allowed))
        return data


@with_config(_ELEMENT)
class AnthropicTool(TypedDict):
    type: NotRequired[Literal["custom"]]  # client tools only
    name: Annotated[str, MinLen(1)]
    description: NotRequired[str | None]
    input_schema: dict[str, Any]


def _anthropic_tool(tool: AnthropicTool) -> dict[str, Any]:
    """The OpenAI shape the shared tool code takes."""
    fn: dict[str, Any] = {"name": tool["name"], "parameters": tool["input_schema"]}
    if tool.get("description") is not None:
        fn["description"] = tool["description"]
    return {"type": "function", "function": fn}


class AnthropicToolChoice(Wire):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None  # the tool, for type "tool"
    disable_parallel_tool_use: bool | None = None  # at most one call (forced: exactly one)

    @model_validator(mode="before")
    @classmethod
    def _name_only_for_tool(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("type") != "tool":  # the rest is ignored
            return {k: data[k] for k in ("type", "disable_parallel_tool_use") if k in data}
        return data


class MessagesBody(Wire):
    """POST /v1/messages (Anthropic's Messages API)."""

    anthropic = True
    model: str | None = None
    max_tokens: PositiveInt
    messages: Annotated[list[AnthropicMessage], MinLen(1), MaxLen(MAX_MESSAGES)]
    system: Text | None = None
    stream: bool = False
    temperature: Temperature | None = None
    top_p: TopP | None = None
    top_k: _integer(Ge(0)) | None = None
    stop_sequences: Annotated[list[str], MaxLen(MAX_STOP)] | None = None
    tools: Annotated[list[AnthropicTool], _known_tools(("custom",))] | None = None
    tool_choice: AnthropicToolChoice | None = None
    cache_salt: CacheSalt | None = None
    # extended thinking: passed to a chat template that has a reasoning switch
    # (reasoning.template_options), else ignored with a log line; server-side context editing
    # and output settings (effort): accepted and ignored with a log line
    thinking: Any = None
    context_management: Any = None
    output_config: Any = None

    @model_validator(mode="after")
    def _log_ignored(self) -> MessagesBody:
        for key in ("context_management", "output_config"):
            value = getattr(self, key)
            if value is not None:
                log.info("request field ignored", field=key, value=short_repr(value))
        return self

    @field_validator("tool_choice")
    @classmethod
    def _choice_in_tools(cls, choice: AnthropicToolChoice | None,
                         info: ValidationInfo) -> AnthropicToolChoice | None:
        if choice is None or "tools" not in info.data:
            return choice
        names = {t["name"] for t in info.data["tools"] or []}
        if choice.type in ("any", "tool") and not names:
            raise _fail("no_tools", choice=repr(choice.type))
        if choice.type == "tool" and choice.name not in names:
            raise _fail("unknown_tool", tool=short_repr(choice.name))
        return choice

    def openai_tools(self) -> list[dict[str, Any]] | None:
        """The tools in the OpenAI shape the shared tool code takes (None: no tools)."""
        return [_anthropic_tool(t) for t in self.tools or []] or None

    def tool_choice_for(self, tools: list[dict[str, Any]] | None) -> ToolChoice:
        choice = self.tool_choice
        if choice is None or choice.type == "auto":
            return ToolChoice("auto" if tools else "none")
        if choice.type == "none":
            return ToolChoice("none")
        if choice.type == "any":
            return ToolChoice("required")
        return ToolChoice("function", choice.name)

    def options(self) -> dict[str, Any]:
        opts: dict[str, Any] = {"max_tokens": self.max_tokens}
        for key in ("temperature", "top_p", "top_k"):
            value = getattr(self, key)
            if value is not None:
                opts[key] = value
        if self.stop_sequences:
            opts["stop"] = self.stop_sequences
        if self.cache_salt is not None:
            opts["cache_salt"] = self.cache_salt
        return opts


class CountTokensBody(MessagesBody):
    """POST /v1/messages/count_tokens: a Messages body without max_tokens."""

    max_tokens: PositiveInt | None = None  # type: ignore[assignment]


# ---- the Responses API ---------------------------------------------------------------------


@with_config(_ELEMENT)
class ResponsesFunctionTool(TypedDict):
    type: Literal["function"]
    name: Annotated[str, MinLen(1)]
    description: NotRequired[str | None]
    parameters: NotRequired[dict[str, Any] | None]
    strict: NotRequired[bool | None]


class NamedResponsesChoice(Wire):
    type: Literal["function"]
    name: str


ResponsesToolChoice = Annotated[
    Literal["none", "auto", "required"] | NamedResponsesChoice,
    _one_of("'none', 'auto', 'required' or {'type': 'function', 'name': ...}")]


class ResponsesTextFormat(Wire):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None

    def option(self) -> dict[str, Any] | None:
        """The engine's `response_format` option (None: plain text)."""
        if self.type == "text":
            return None
        if self.type == "json_object":
            return {"type": "json_object"}
        if self.schema_ is None:
            raise _fail("required_for", "schema", when="'type' is 'json_schema'")
        return {"type": "json_schema", "json_schema": {
            "name": self.name, "schema": self.schema_, "strict": self.strict}}


class ResponsesText(Wire):
    format: ResponsesTextFormat | None = None


_INPUT_TEXT_PARTS = ("input_text", "output_text", "text", "refusal")


def _item_text(content: Any, where: tuple[str | int, ...]) -> str:
    """A message's or output's content (a string, or text parts) as text."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise _fail("item_parts", *where)
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in _INPUT_TEXT_PARTS:
            raise _fail("part_type", *where, j, part=short_repr(kind))
        text = part.get("text", part.get("refusal"))
        if not isinstance(text, str):
            raise _fail("item_string", *where, j, "text")
        texts.append(text)
    return "\n".join(texts)


def _item_str(item: dict[str, Any], key: str, i: int) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise _fail("missing" if value is None else "item_string", i, key)
    return value


def response_items(items: str | list[Any]) -> list[dict[str, Any]]:
    """Responses `input` -> chat-template messages: messages (developer is system), function
    calls (on the assistant message they follow) and their outputs (tool messages); a
    reasoning item's text is the next assistant turn's reasoning_content (for a template that
    writes it back; an encrypted one, which no server but OpenAI's reads, carries nothing), and
    item types that hold no text for this model (web search results, images) are left out
    with a log line."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    out: list[dict[str, Any]] = []
    reasoning = ""  # a reasoning item's text, for the assistant turn that follows it
    for i, item in enumerate(items):
        if not isinstance(item, dict):
            raise _fail("item_object", i)
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise _fail("item_role", i, "role")
            text = _item_text(item.get("content"), (i, "content"))
            out.append({"role": "system" if role == "developer" else role, "content": text})
            if role == "assistant" and reasoning:
                out[-1]["reasoning_content"] = reasoning
            if role != "assistant" or reasoning:
                reasoning = ""
        elif kind == "function_call":
            call = {"id": _item_str(item, "call_id", i), "type": "function", "function": {
                "name": _item_str(item, "name", i),
                "arguments": item.get("arguments") if isinstance(item.get("arguments"), str)
                else "{}"}}
            last = out[-1] if out else None
            if last is None or last["role"] != "assistant":
                last = {"role": "assistant", "content": ""}
                out.append(last)
            if reasoning:
                last["reasoning_content"], reasoning = reasoning, ""
            last.setdefault("tool_calls", []).append(call)
        elif kind == "function_call_output":
            out.append({"role": "tool", "tool_call_id": _item_str(item, "call_id", i),
                        "content": _item_text(item.get("output", ""), (i, "output"))})
        elif kind == "reasoning":  # its text (as this server writes it) goes with the next turn
            reasoning = "".join(p.get("text", "") for p in item.get("content") or []
                                if isinstance(p, dict) and p.get("type") == "reasoning_text"
                                and isinstance(p.get("text"), str))
        else:
            log.info("input item ignored", type=short_repr(kind),
                     why="only message, function_call, function_call_output and reasoning "
                         "items are read")
    return out


def _items(value: Any) -> Any:
    if isinstance(value, str):
        if not value:
            raise _fail("empty")
        return value
    if not isinstance(value, list):
        raise _fail("text_or_list")
    return response_items(value)


ResponseInput = Annotated[Any, PlainValidator(_items, json_schema_input_type=str | list[
    dict[str, Any]])]


class ResponsesBody(Wire):
    """POST /v1/responses (OpenAI's Responses API)."""

    model: str | None = None
    input: ResponseInput
    instructions: str | None = None
    tools: Annotated[list[ResponsesFunctionTool], _known_tools(("function",))] | None = None
    tool_choice: ResponsesToolChoice | None = None
    parallel_tool_calls: bool | None = None
    max_output_tokens: PositiveInt | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    stream: bool | None = None
    store: bool | None = None
    previous_response_id: str | None = None
    text: ResponsesText | None = None
    # read and answered back as given; no local model here reasons in a hidden channel
    reasoning: dict[str, Any] | None = None
    include: list[str] | None = None
    prompt_cache_key: str | None = None  # prefix reuse is automatic here
    metadata: dict[str, Any] | None = None
    user: str | None = None
    cache_salt: CacheSalt | None = None

    @field_validator("tool_choice")
    @classmethod
    def _choice_in_tools(cls, choice: Any, info: ValidationInfo) -> Any:
        if "tools" not in info.data:
            return choice
        names = {t["name"] for t in info.data["tools"] or []}
        if choice == "required" and not names:
            raise _fail("no_tools", choice="'required'")
        if isinstance(choice, NamedResponsesChoice) and choice.name not in names:
            raise _fail("unknown_tool", tool=short_repr(choice.name))
        return choice

    def request(self) -> ResponsesRequest:
        tools = [{"type": "function", "function": {
            k: t[k] for k in ("name", "description", "parameters") if t.get(k) is not None}}
            for t in self.tools or []] or None
        choice = self.tool_choice
        if isinstance(choice, NamedResponsesChoice):
            tool_choice = ToolChoice("function", choice.name)
        elif choice is None:
            tool_choice = ToolChoice("auto" if tools else "none")
        else:
            tool_choice = ToolChoice(choice if tools else "none")
        opts: dict[str, Any] = {}
        if self.max_output_tokens is not None:
            opts["max_tokens"] = self.max_output_tokens
        for key in ("temperature", "top_p", "cache_salt"):
            if getattr(self, key) is not None:
                opts[key] = getattr(self, key)
        fmt = self.text.format if self.text is not None else None
        if fmt is not None:
            try:
                option = fmt.option()
            except PydanticCustomError as exc:
                ctx = {k: v for k, v in (exc.context or {}).items() if k != "at"}
                raise _error(exc.type, ("text", "format", "schema"), None, ctx,
                             False) from None
            if option is not None:
                opts["response_format"] = option
        items = self.input if isinstance(self.input, list) else response_items(self.input)
        return ResponsesRequest(
            items=items, instructions=self.instructions, model=self.model,
            stream=bool(self.stream), store=self.store is not False,
            previous_response_id=self.previous_response_id, tools=tools,
            tool_choice=tool_choice, parallel_tool_calls=self.parallel_tool_calls is not False,
            options=opts, thinking=Thinking.openai((self.reasoning or {}).get("effort")),
            echo={
                "instructions": self.instructions, "tools": list(self.tools or []),
                "tool_choice": choice.model_dump() if isinstance(choice, Wire)
                else (choice or "auto"),
                "parallel_tool_calls": self.parallel_tool_calls is not False,
                "max_output_tokens": self.max_output_tokens,
                "temperature": 1.0 if self.temperature is None else self.temperature,
                "top_p": 1.0 if self.top_p is None else self.top_p,
                "text": {"format": fmt.model_dump(by_alias=True, exclude_none=True)
                         if fmt is not None else {"type": "text"}},
                "reasoning": self.reasoning or {"effort": None, "summary": None},
                "metadata": self.metadata or {}, "user": self.user,
                "store": self.store is not False,
                "previous_response_id": self.previous_response_id,
                "prompt_cache_key": self.prompt_cache_key})


@dataclass
class ResponsesRequest:
    items: list[dict[str, Any]]  # the new input, as chat-template messages
    instructions: str | None = None
    model: str | None = None
    stream: bool = False
    store: bool = True
    previous_response_id: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: ToolChoice = field(default_factory=ToolChoice)
    parallel_tool_calls: bool = True
    options: dict[str, Any] = field(default_factory=dict)
    echo: dict[str, Any] = field(default_factory=dict)  # request fields the response repeats
    thinking: Thinking | None = None


def parse_responses(body: dict[str, Any]) -> ResponsesRequest:
    return validated(ResponsesBody, body).request()


# ---- the OpenAPI document ------------------------------------------------------------------

ROUTES: dict[str, tuple[type[Wire], str]] = {
    "/v1/chat/completions": (ChatCompletionBody, "Create a chat completion (OpenAI)"),
    "/v1/completions": (CompletionBody, "Create a text completion (OpenAI, legacy)"),
    "/v1/messages": (MessagesBody, "Create a message (Anthropic)"),
    "/v1/responses": (ResponsesBody, "Create a response (OpenAI Responses API)"),
}


@functools.cache
def openapi_document() -> dict[str, Any]:
    """OpenAPI 3.1 for the generation routes, their request bodies from the models above."""
    refs, defs = models_json_schema([(model, "validation") for model, _ in ROUTES.values()],
                                    ref_template="#/components/schemas/{model}")
    paths = {}
    for path, (model, summary) in ROUTES.items():
        paths[path] = {"post": {
            "summary": summary,
            "operationId": model.__name__,
            "requestBody": {"required": True, "content": {
                "application/json": {"schema": refs[(model, "validation")]}}},
            "responses": {
                "200": {"description": "The answer: a JSON object, or server-sent events "
                                       "with \"stream\": true."},
                "400": {"description": "The request is invalid; the error names the field."},
            }}}
    return {"openapi": "3.1.0", "info": {"title": "slotserve", "version": "v1"},
            "paths": paths, "components": {"schemas": defs.get("$defs", {})}}
