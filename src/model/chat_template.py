"""Render a model's Jinja chat template the way HF transformers does.

Templates come from untrusted model files, so they run in Jinja's immutable sandbox. Globals and
filters mirror transformers (``raise_exception``, ``strftime_now``, a non-escaping ``tojson``) so
templates written for HF render identically here.
"""

from __future__ import annotations

import copy
import json
import re
from collections.abc import Mapping, Sequence
from datetime import datetime
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
    def for_tokenizer(cls, tokenizer: Tokenizer) -> ChatTemplate:
        """Template of the model behind ``tokenizer``, or ChatML when it has none."""
        def text(i: int | None) -> str:
            return (tokenizer.id_to_token(i) or "") if i is not None else ""

        return cls(tokenizer.chat_template, text(tokenizer.bos_id), text(tokenizer.eos_id))

    def render(self, messages: Sequence[Mapping[str, Any]],
               tools: Sequence[Mapping[str, Any]] | None = None,
               add_generation_prompt: bool = True, **extra: Any) -> str:
        """Prompt text for ``messages``; raises TemplateError instead of Jinja/TypeErrors."""
        context = {"bos_token": self.bos_token, "eos_token": self.eos_token, **extra}
        try:
            prepared = [_prepare(m, self._keep_parts) for m in messages]
            return self._template.render(messages=prepared, tools=tools,
                                         add_generation_prompt=add_generation_prompt, **context)
        except jinja2.TemplateError as e:
            raise TemplateError(f"chat template error: {e}") from e
        except (TypeError, KeyError, AttributeError, IndexError, ValueError) as e:
            raise TemplateError(f"chat template failed on these messages: "
                                f"{type(e).__name__}: {e}") from e
