"""Constrained decoding with llguidance: `response_format` -> grammar -> per-row token masks.

    grammar = compile_response_format({"type": "json_object"}, tokenizer)   # ValueError if bad
    matcher = grammar.matcher()               # one per request, owned by its slot
    logits = apply_masks(logits, rows, [matcher, ...])    # in the fused step, before sampling
    matcher.consume(token)                    # after sampling

The llguidance tokenizer (the vocabulary as bytes plus a token trie) is llguidance's own, read
from the tokenizer's `tokenizer.json` as `llguidance.hf.from_tokenizer` does (without its
transformers wrapper). It costs from a fraction of a second to a few seconds to build, so it is
built once per slotserve tokenizer and cached. A grammar is compiled and checked when the
request is made (a bad schema is refused before anything runs): llguidance validates it, and a
copy takes the first step a request will take (mask, the forced token, mask), so a grammar
whose forced text has no end (a required property that contains itself) is refused with the
parser's reason instead of failing on its first token; each request then starts from a copy of
the compiled matcher.

Masks only ever touch the constrained rows: those rows are gathered, disallowed tokens set to
-inf, and scattered back, so every other row's logits keep their exact bits.
"""

from __future__ import annotations

import json
import threading
import weakref
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import mlx.core as mx
import numpy as np
import structlog

if TYPE_CHECKING:  # llguidance is imported when the first grammar is compiled
    import llguidance

__all__ = ["Grammar", "Matcher", "apply_masks", "compile_lark", "compile_response_format",
           "ll_tokenizer"]

log = structlog.get_logger("slotserve.grammar")

# JSON as models write it ({"a": 1, "b": 2}), with no free whitespace: a small model left free
# to add newlines or spaces between tokens can loop on them until max_tokens.
_JSON_OPTIONS: dict[str, Any] = {"whitespace_flexible": False, "item_separator": ", ",
                                 "key_separator": ": "}
_ANY_OBJECT = {"type": "object"}

_cache: weakref.WeakKeyDictionary[Any, llguidance.LLTokenizer] = (
    weakref.WeakKeyDictionary()
)
_cache_lock = threading.Lock()


_MAX_ERROR = 500  # characters of an llguidance message that a response may carry


def public_error(message: str) -> str:
    """An llguidance error as a response may show it: its message without the parser state and
    grammar dump it appends (`<state>...`, `<grammar>...`), and not unboundedly long."""
    cut = min((i for i in (message.find("<state>"), message.find("<grammar>")) if i >= 0),
              default=len(message))
    text = message[:cut].strip() or "the grammar failed"
    return text if len(text) <= _MAX_ERROR else text[:_MAX_ERROR] + "..."


# How llguidance words a parser or lexer limit reached ("Too many items (limit 50000; ...)",
# "... fuel ...", "too many states"); its stop reason says only InternalError. A rejected token's
# message quotes the token, so it is told apart first.
_LIMIT_MARKERS = ("Too many items", "fuel", "(limit", "too many states")


def parser_limit(message: str) -> bool:
    """Whether an llguidance error is a limit the grammar made the parser reach (about the
    grammar, so a response may say it), not a token it rejected."""
    return ("doesn't satisfy the grammar" not in message
            and any(marker in message for marker in _LIMIT_MARKERS))


def ll_tokenizer(tokenizer: Any) -> llguidance.LLTokenizer:
    """The llguidance tokenizer for a slotserve Tokenizer, built once and cached.

    llguidance reads the HF `tokenizer.json` itself, so it knows the pre-tokenizer and the
    decoder. On the bundled SmolLM2 (and Llama 3 and Qwen2 vocabularies) its token bytes,
    special tokens and masks are those of the vocabulary slotserve built by hand from
    `Tokenizer.token_bytes`; on SentencePiece with a "▁" space prefix it also tokenizes the
    grammar's forced text right, where the hand-built one, tokenizing "{" as "▁{", let a JSON
    object start with a space or put the matcher in error (tests/test_structured.py). Every
    stop token ends a grammar.
    """
    with _cache_lock:
        cached = _cache.get(tokenizer)
        if cached is None:
            eos = sorted(tokenizer.stop_ids) or tokenizer.eos_id
            import llguidance

            cached = llguidance.LLTokenizer(tokenizer.to_hf_tokenizer_json(),
                                            n_vocab=tokenizer.vocab_size, eos_token=eos)
            _cache[tokenizer] = cached
            log.info("grammar tokenizer built", vocab=cached.vocab_size, eos=cached.eos_tokens)
        return cached


class Grammar:
    """A compiled, validated grammar for one tokenizer; `matcher()` starts a fresh match."""

    def __init__(self, kind: str, source: str, lltok: llguidance.LLTokenizer,
                 param: str = "response_format") -> None:
        self.kind = kind
        self.source = source
        import llguidance

        self._proto = llguidance.LLMatcher(lltok, source, log_level=0)
        if self._proto.is_error():
            raise ValueError(f"{param}: invalid {kind}: "
                             f"{public_error(self._proto.get_error())}")
        # the tokens the grammar allows once it is complete; they end the request
        self.stop_ids = frozenset(lltok.eos_tokens)
        self.vocab_size = lltok.vocab_size
        problem = self._first_step()
        if problem is not None:
            hint = ("; the text it forces has no end (does a required property or item "
                    "contain itself?)" if "Too many items" in problem else "")
            raise ValueError(f"{param}: the {kind} cannot be followed: {problem}{hint}")

    def _first_step(self) -> str | None:
        """Why a request could not take its first constrained step, or None.

        On a copy: the first mask, the first token the grammar forces (if any) and the mask
        after it, as a step does. llguidance computes the text a grammar forces as far as its
        parser limits let it, so a grammar whose forced text never ends (`{"a": {"a": ...` of a
        required property that refers to its own object) passes validation and then fails at
        its first token with "Too many items"; here it is refused before anything runs.
        """
        probe = self._proto.deep_copy()
        bits = np.zeros(((self.vocab_size + 31) // 32,), np.int32)
        probe.unsafe_compute_mask_ptr(bits.ctypes.data, bits.nbytes)
        forced = self._proto.deep_copy().compute_ff_tokens()
        if forced and not probe.is_error():
            probe.consume_token(forced[0])
            if not probe.is_error():
                probe.unsafe_compute_mask_ptr(bits.ctypes.data, bits.nbytes)
        return public_error(probe.get_error()) if probe.is_error() else None

    def matcher(self) -> Matcher:
        return Matcher(self._proto.deep_copy(), self.stop_ids, self.vocab_size)


class Matcher:
    """One request's position in its grammar. Used on the MLX thread during a step and by the
    request's slot between steps, never both at once."""

    __slots__ = ("_m", "stop_ids", "vocab_size")

    def __init__(self, matcher: llguidance.LLMatcher, stop_ids: frozenset[int],
                 vocab_size: int) -> None:
        self._m = matcher
        self.stop_ids = stop_ids
        self.vocab_size = vocab_size

    def fill_mask(self, row: np.ndarray) -> None:
        """Write the allowed-token bitmask (int32 words, bit i of word j = token 32j+i)."""
        self._m.unsafe_compute_mask_ptr(row.ctypes.data, row.nbytes)

    def consume(self, token: int) -> bool:
        ok = self._m.consume_token(token)
        if not ok:  # the parser's state goes to the log, never into a response
            log.warning("grammar rejected a token", token=token, detail=self._m.get_error())
        return ok

    @property
    def stopped(self) -> bool:
        """Complete: nothing but a stop token may follow (also true in the error state)."""
        return self._m.is_stopped()

    def current(self) -> Matcher | None:
        """The matcher the row goes on with after a token (a thinking budget that has done its
        part hands back the request's own grammar: `runtime.thinking`)."""
        return self

    @property
    def error(self) -> str | None:
        """Why the match failed, as a response may say it. A parser limit reached (the
        grammar is too costly to follow from here) is said with llguidance's message, which
        is about the grammar; anything else gets no detail (the sampler only picks allowed
        tokens): llguidance's message, parser state and grammar go to the log (see
        `consume`)."""
        if not self._m.is_error():
            return None
        message = public_error(self._m.get_error())
        if parser_limit(message):
            return f"the grammar is too costly to follow here ({message})"
        return "a sampled token does not satisfy the grammar"


def compile_response_format(fmt: Mapping[str, Any] | None, tokenizer: Any) -> Grammar | None:
    """An OpenAI `response_format` -> a Grammar (None for plain text); ValueError names the
    problem."""
    if fmt is None:
        return None
    if not isinstance(fmt, Mapping):
        raise ValueError("response_format must be an object")
    kind = fmt.get("type")
    if kind in (None, "text"):
        return None
    if kind == "json_object":
        schema: Any = _ANY_OBJECT
        options = dict(_JSON_OPTIONS)
    elif kind == "json_schema":
        spec = fmt.get("json_schema")
        if not isinstance(spec, Mapping):
            raise ValueError("response_format.json_schema must be an object holding 'schema'")
        schema = spec.get("schema", {})
        if not isinstance(schema, Mapping | bool):
            raise ValueError("response_format.json_schema.schema must be a JSON Schema object")
        strict = spec.get("strict")
        if strict is not None and not isinstance(strict, bool):
            raise ValueError("response_format.json_schema.strict must be a boolean")
        # strict: every keyword must be honoured (unknown ones are an error); otherwise best
        # effort, ignoring keywords llguidance does not implement
        options = {**_JSON_OPTIONS, "lenient": not strict}
    else:
        raise ValueError(f"response_format.type must be 'text', 'json_object' or "
                         f"'json_schema', got {kind!r}")
    try:
        text = json.dumps(schema)
        import llguidance

        source = llguidance.LLMatcher.grammar_from_json_schema(
            text, overrides=options)  # type: ignore[arg-type]
    except (ValueError, TypeError, RecursionError) as exc:
        raise ValueError(f"response_format: invalid {kind}: {public_error(str(exc))}") from None
    return Grammar(kind, source, ll_tokenizer(tokenizer))


def compile_lark(lark: str, tokenizer: Any, kind: str = "grammar",
                 param: str = "tools") -> Grammar:
    """A Lark grammar (llguidance's dialect: `%json {schema}` embeds a JSON schema, `<[id]>`
    is a special token) -> a Grammar; ValueError names `param` and the problem. Tool calls
    are forced with these (`api.tool_formats.call_grammar`)."""
    import llguidance

    return Grammar(kind, llguidance.LLMatcher.grammar_from_lark(lark), ll_tokenizer(tokenizer),
                   param)


def apply_masks(logits: mx.array, rows: Sequence[int],
                matchers: Sequence[Matcher]) -> mx.array:
    """Set the tokens each matcher forbids to -inf in its row of `logits` [N, V].

    Only the listed rows are gathered, masked and scattered back; the others are untouched. A
    row whose grammar allows nothing within the vocabulary (should not happen) may only stop.
    """
    vocab = logits.shape[1]
    words = (matchers[0].vocab_size + 31) // 32  # llguidance wants exactly its own size
    bits = np.zeros((len(rows), words), np.int32)
    for i, m in enumerate(matchers):
        m.fill_mask(bits[i])
    allowed = np.unpackbits(bits.view(np.uint8), axis=1, bitorder="little").astype(bool)
    if allowed.shape[1] < vocab:  # padded lm_head: tokens the tokenizer lacks stay forbidden
        allowed = np.pad(allowed, ((0, 0), (0, vocab - allowed.shape[1])))
    allowed = allowed[:, :vocab]
    for i in np.nonzero(~allowed.any(axis=1))[0]:
        allowed[i, [t for t in matchers[i].stop_ids if t < vocab]] = True
    sel = mx.array(np.asarray(rows, np.int32))
    masked = mx.where(mx.array(allowed), mx.take(logits, sel, axis=0),
                      mx.array(-np.inf, dtype=logits.dtype))
    out = mx.array(logits)
    out[sel] = masked
    return out
