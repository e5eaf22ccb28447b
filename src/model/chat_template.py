"""Render a model's Jinja chat template the way HF transformers does.

Templates come from untrusted model files, so they run in Jinja's immutable sandbox. Globals and
filters mirror transformers (``raise_exception``, ``strftime_now``, a non-escaping ``tojson``) so
templates written for HF render identically here.

User text is text: only the template writes control tokens. `ChatTemplate.render_guarded` hands
the template every user-supplied string with each special token's string in it (and a piece of
one at either end, which could join a neighbour into one) swapped for a placeholder, and says
where the placeholders ended up; `Tokenizer.encode_template` then encodes what they stand for as
plain text.
"""

from __future__ import annotations

import copy
import json
import re
import secrets
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from functools import lru_cache
from typing import TYPE_CHECKING, Any

import jinja2
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

if TYPE_CHECKING:
    from slotserve.model.tokenizer import Tokenizer

# Used when a model ships no template: ChatML (<|im_start|>role\n...<|im_end|>), with tools listed
# in a system turn and assistant tool calls written as Hermes-style <tool_call> JSON blocks.
DEFAULT_CHATML_TEMPLATE = r"""
{%- if tools %}
    {{- '<|im_start|>system\nYou may call these tools:\n' }}
    {%- for tool in tools %}
        {{- (tool | tojson) + '\n' }}
    {%- endfor %}
    {{- '<|im_end|>\n' }}
{%- endif %}
{%- for message in messages %}
    {{- '<|im_start|>' + message['role'] + '\n' + message['content'] }}
    {%- for call in message.get('tool_calls') or [] %}
        {{- '\n<tool_call>\n' }}
        {{- (call.function if call.function is defined else call) | tojson }}
        {{- '\n</tool_call>' }}
    {%- endfor %}
    {{- '<|im_end|>\n' }}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
{%- endif %}"""

# What a family's native template must render at load (ChatTemplate.require_native): a tool,
# a call of it and its result, in OpenAI's message shapes.
_TOOL_SPEC = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}]
_TOOL_CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": "", "tool_calls": [{"id": "call_0", "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
    {"role": "tool", "tool_call_id": "call_0", "content": '{"celsius": 21}'},
]

# Templates that look at a part's "type" iterate content lists themselves; others get a string.
_WANTS_PARTS = re.compile(r"""\[\s*['"]type['"]\s*\]|\.type\b""")


class TemplateError(ValueError):
    """The chat template failed to compile or render; the message says why."""


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    """Like transformers' tojson: plain json.dumps, no HTML escaping, optional indent."""
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


def _flatten(content: Any) -> Any:
    """Join text parts into one string; keep the list if it has non-text parts."""
    if not isinstance(content, list):
        return content
    if any(not isinstance(p, Mapping) or p.get("type", "text") != "text" for p in content):
        return content
    return "\n".join(str(p.get("text", "")) for p in content)


def _prepare(message: Mapping[str, Any], keep_parts: bool) -> dict[str, Any]:
    """Normalise OpenAI-shaped messages into what HF templates expect."""
    msg = copy.deepcopy(dict(message))
    if msg.get("content") is None:
        msg["content"] = ""
    elif not keep_parts:
        msg["content"] = _flatten(msg["content"])
    for call in msg.get("tool_calls") or []:
        fn = call.get("function") if isinstance(call, dict) else None
        if isinstance(fn, dict) and isinstance(fn.get("arguments"), str):
            try:  # HF templates expect arguments as a dict, OpenAI sends a JSON string
                parsed = json.loads(fn["arguments"])
            except ValueError:
                continue
            if isinstance(parsed, dict):
                fn["arguments"] = parsed
    return msg


@dataclass(frozen=True)
class Rendered:
    """A rendered prompt whose user text spells no control token.

    ``text`` is the template's output, user strings in it with their special-token strings
    swapped for placeholders; ``holes`` are the placeholders' spans in ``text``, each with the
    user text it stands for (see `Tokenizer.encode_template`). No holes: ``text`` is exactly what
    `ChatTemplate.render` gives.
    """

    text: str
    holes: tuple[tuple[int, int, str], ...] = ()

    @property
    def plain(self) -> str:
        """The prompt as the model reads it, placeholders filled."""
        parts, pos = [], 0
        for start, end, plain in self.holes:
            parts += [self.text[pos:start], plain]
            pos = end
        return "".join([*parts, self.text[pos:]])


class _Markers:
    """The special-token strings of one vocabulary, and the pieces of them that a user string
    may start or end with (two such strings side by side could spell a token together)."""

    def __init__(self, specials: frozenset[str]) -> None:
        ordered = sorted((t for t in specials if t), key=len, reverse=True)  # longest match
        self.find = re.compile("|".join(map(re.escape, ordered))) if ordered else None
        self.heads = {t[k:] for t in ordered for k in range(1, len(t))}  # proper suffixes
        self.tails = {t[:k] for t in ordered for k in range(1, len(t))}  # proper prefixes
        self.longest = max(map(len, ordered), default=0)
        self.chars = frozenset(t[0] for t in ordered) | frozenset(t[-1] for t in ordered)


@lru_cache(maxsize=8)
def _markers(specials: frozenset[str]) -> _Markers:
    return _Markers(specials)


class _Guard:
    """Swaps what user strings hold of special tokens for placeholders of one render.

    A placeholder is ``~<nonce>~<n>~``: ASCII digits and tildes, which no template filter
    (trim, upper, escape, tojson) changes, with a random nonce, so no user text spells one.
    """

    def __init__(self, markers: _Markers) -> None:
        self.m = markers
        self.nonce = f"{secrets.randbelow(10**16):016d}"
        self.pieces: list[str] = []
        self._index: dict[str, int] = {}

    def _hole(self, piece: str) -> str:
        n = self._index.get(piece)
        if n is None:
            n = self._index[piece] = len(self.pieces)
            self.pieces.append(piece)
        return f"~{self.nonce}~{n}~"

    def text(self, s: str) -> str:
        m = self.m
        if m.find is None or not s or m.chars.isdisjoint(s):
            return s
        head = next((s[:k] for k in range(min(m.longest, len(s)), 0, -1) if s[:k] in m.heads), "")
        rest = s[len(head):]
        tail = next((rest[-k:] for k in range(min(m.longest, len(rest)), 0, -1)
                     if rest[-k:] in m.tails), "")
        body = rest[:len(rest) - len(tail)]
        body = m.find.sub(lambda x: self._hole(x.group()), body)
        return "".join([self._hole(head) if head else "", body,
                        self._hole(tail) if tail else ""])

    def value(self, v: Any) -> Any:
        """``v`` with every string in it (dict keys too) guarded."""
        if isinstance(v, str):
            return self.text(v)
        if isinstance(v, Mapping):
            return {self.value(k): self.value(x) for k, x in v.items()}
        if isinstance(v, list | tuple):
            return [self.value(x) for x in v]
        return v

    def holes(self, text: str) -> tuple[tuple[int, int, str], ...]:
        if not self.pieces:
            return ()
        found = re.finditer(rf"~{self.nonce}~(\d+)~", text)
        return tuple((x.start(), x.end(), self.pieces[int(x.group(1))]) for x in found
                     if int(x.group(1)) < len(self.pieces))


class ChatTemplate:
    """A compiled chat template plus the BOS/EOS strings templates refer to."""

    def __init__(self, template_str: str | None, bos_token: str = "", eos_token: str = "") -> None:
        self.is_default = not template_str
        self.source = template_str or DEFAULT_CHATML_TEMPLATE
        self.bos_token, self.eos_token = bos_token, eos_token
        self._keep_parts = bool(_WANTS_PARTS.search(self.source))
        try:
            self._template = _environment().from_string(self.source)
        except jinja2.TemplateError as e:
            raise TemplateError(f"chat template does not compile: {e}") from e

    @classmethod
    def for_tokenizer(cls, tokenizer: Tokenizer, family: str = "",
                      markers: Sequence[str] = ()) -> ChatTemplate:
        """Template of the model behind ``tokenizer``, or ChatML when it has none.

        ``markers``: control tokens the `family`'s own templates write (its turn and tool
        tokens). With them, no ChatML fallback: a checkpoint without a template, or whose
        template never writes them or fails on a conversation with tools and tool results,
        is refused here, at load, rather than prompting its model in another format."""
        def text(i: int | None) -> str:
            return (tokenizer.id_to_token(i) or "") if i is not None else ""

        template = cls(tokenizer.chat_template, text(tokenizer.bos_id), text(tokenizer.eos_id))
        if markers:
            template.require_native(family, markers)
        return template

    def require_native(self, family: str, markers: Sequence[str]) -> None:
        """Raise TemplateError unless this is a `family` template: shipped with the model,
        writing each of `markers`, rendering a tool call and its result."""
        if self.is_default:
            raise TemplateError(f"this {family} checkpoint ships no chat template (looked in "
                                "tokenizer_config.json, chat_template.jinja/.json, GGUF "
                                f"metadata); a {family} model needs its own, refusing to "
                                "fall back to ChatML")
        missing = [m for m in markers if m not in self.source]
        if missing:
            raise TemplateError(f"the chat template is not a {family} template: it never "
                                f"writes {missing} (a {family} template writes {list(markers)})")
        try:
            self.render(_TOOL_CONVERSATION, _TOOL_SPEC)
        except TemplateError as e:
            raise TemplateError(f"the {family} chat template fails on a conversation with a "
                                f"tool, a call and its result: {e}") from e

    def render(self, messages: Sequence[Mapping[str, Any]],
               tools: Sequence[Mapping[str, Any]] | None = None,
               add_generation_prompt: bool = True, **extra: Any) -> str:
        """Prompt text for ``messages``; raises TemplateError instead of Jinja/TypeErrors.

        The text holds user strings as they are: encoding it with special tokens parsed lets
        users write control tokens. Prompts for the model come from `render_guarded`.
        """
        return self._render(messages, tools, add_generation_prompt, extra, None)

    def render_guarded(self, messages: Sequence[Mapping[str, Any]],
                       tools: Sequence[Mapping[str, Any]] | None = None,
                       add_generation_prompt: bool = True, *, specials: Collection[str],
                       suffix: str = "", **extra: Any) -> Rendered:
        """Prompt for ``messages`` in which no user string can spell a control token.

        ``specials``: the vocabulary's special-token strings. Every string in ``messages``,
        ``tools`` and ``extra`` (content, tool calls and results, names, tool definitions) is
        user text, and so is ``suffix``, text the reply starts with, put after the template's
        output. Encode with ``Tokenizer.encode_template(r.text, r.holes)``.
        """
        guard = _Guard(_markers(frozenset(specials)))
        text = self._render(messages, tools, add_generation_prompt, extra, guard)
        text += guard.text(suffix)
        return Rendered(text, guard.holes(text))

    def _render(self, messages: Sequence[Mapping[str, Any]],
                tools: Sequence[Mapping[str, Any]] | None, add_generation_prompt: bool,
                extra: Mapping[str, Any], guard: _Guard | None) -> str:
        try:
            prepared = [_prepare(m, self._keep_parts) for m in messages]
            if guard is not None:  # after _prepare: JSON arguments are parsed by then
                prepared = [guard.value(m) for m in prepared]
                tools = guard.value(tools)
                extra = guard.value(extra)
            context = {"bos_token": self.bos_token, "eos_token": self.eos_token, **extra}
            return self._template.render(messages=prepared, tools=tools,
                                         add_generation_prompt=add_generation_prompt, **context)
        except jinja2.TemplateError as e:
            raise TemplateError(f"chat template error: {e}") from e
        except (TypeError, KeyError, AttributeError, IndexError, ValueError) as e:
            raise TemplateError(f"chat template failed on these messages: "
                                f"{type(e).__name__}: {e}") from e
