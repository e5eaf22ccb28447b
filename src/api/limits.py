"""Cheap refusals: requests too big to ever fit, refused before anything is tokenized.

Tokenizing costs ~0.5 s per MB of text, so an 8 MB prompt that cannot fit the context must be
refused from what is cheap to know: the body size (413, before the body is even read), the
number of messages (`MAX_MESSAGES`), and a lower bound on the prompt's token count from its
UTF-8 bytes alone (`TokenFloor`): a text whose bound reaches the context length cannot fit.

The bound: every byte of the text ends up in some token (or vanishes), and a token covers at
most as many bytes as its own bytes (`Tokenizer.token_bytes`) hold. Let longest[v] be the
length of the longest token whose bytes contain the byte value v (at least 4, so an
unknown-token that covers one character also fits the rule), and give a byte value that no
token contains weight 0 (a byte-level BPE drops it: SmolLM2 has no token for "\x06"). A token
that covers the bytes b1..bk contains each of their values, so k <= longest[bi] for each, and
the weights 1 / longest[bi] of its bytes sum to at most 1. Hence: tokens >= sum over the text's
bytes of 1 / longest[byte]. Spaces get no exception: a run of spaces is as cheap as the longest
token of spaces (64 in SmolLM2, and 81 for a newline followed by spaces), and that is the
weight they get.

The bound holds only where tokenization keeps every byte of the text, so `TokenFloor` reads
the tokenizer's pipeline and gives no bound (None) for anything that can drop or fuse text:
normalizers other than SentencePiece's "▁" replacement, a prefix and NFC; pre-tokenizers that
remove what they split on (BERT's whitespace split); added tokens that swallow the whitespace
around them (lstrip / rstrip); models other than BPE, and a BPE that fuses unknown characters
into one token. NFC composes at most 3 bytes into 1 (Hangul jamo, the Kelvin sign), so text
that is not ASCII gets the plain bound bytes / (3 x the longest token) there.

Chat prompts are rendered by a template, which may trim the whitespace around a message's
content (`| trim`, `.strip()`) or drop the reasoning (`<think>...</think>`) of earlier assistant
turns. Where its source says it may, the bound counts each message's content stripped, and
only the part of an assistant message after its last `</think>`, so a prompt that fits is never
refused; a template that does neither (ChatML, SmolLM2's) has all of the content counted.
"""

from __future__ import annotations

import asyncio
import json
import threading
import weakref
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
import structlog

from slotserve.api.errors import APIError

log = structlog.get_logger("slotserve.api")

MAX_MESSAGES = 2048  # as OpenAI's chat completions; the request models' cap, checked first
MIN_LONGEST = 4  # bytes of the longest UTF-8 character: what an unknown-token may cover
NFC_SHRINK = 3  # NFC maps at most 3 bytes of UTF-8 to 1 (U+212A -> "K", jamo -> syllable)
_SPACE_MARK = "▁".encode()  # SentencePiece's space: token "▁a" covers the text " a"
_KEEPING_NORMALIZERS = {"Prepend", "NFC", "Sequence"}
_KEEPING_PRE_TOKENIZERS = {"ByteLevel", "Metaspace", "Split", "Digits", "Punctuation",
                           "UnicodeScripts", "Sequence"}


class TokenFloor:
    """A lower bound on the number of tokens a text becomes, from its bytes alone."""

    def __init__(self, tokenizer: Any) -> None:
        spec = json.loads(tokenizer.to_hf_tokenizer_json())
        why = _drops_text(spec)
        self.nfc = _has(spec.get("normalizer"), "NFC")
        self.weights: np.ndarray | None = None
        self.longest = 0
        if why is not None:
            log.info("no cheap prompt-length bound for this tokenizer", reason=why)
            return
        tokens = tokenizer.all_token_bytes()
        variants = tokens + [t.replace(_SPACE_MARK, b" ") for t in tokens if _SPACE_MARK in t]
        lengths = np.array([len(t) for t in variants], np.int64)
        values = np.frombuffer(b"".join(variants), np.uint8)
        longest = np.zeros(256, np.int64)
        np.maximum.at(longest, values, np.repeat(lengths, lengths))
        self.longest = max(int(longest.max()), MIN_LONGEST)
        # a byte in no token at all vanishes (SmolLM2 has no token for "\x06"): weight 0
        self.weights = np.where(longest > 0, 1.0 / np.maximum(longest, MIN_LONGEST), 0.0)

    def at_least(self, texts: Iterable[str]) -> int:
        """Tokens the concatenation of `texts` (with anything between them) has at least."""
        if self.weights is None:
            return 0
        total = 0.0
        for text in texts:
            if not text:
                continue
            if self.nfc and not text.isascii():
                total += len(text.encode("utf-8", "surrogatepass")) / (NFC_SHRINK * self.longest)
                continue
            data = np.frombuffer(text.encode("utf-8", "surrogatepass"), np.uint8)
            total += float(np.bincount(data, minlength=256) @ self.weights)
            if self.nfc:
                total -= 1.0  # its last character may compose with what follows it
        return max(0, int(total * (1 - 1e-9)))  # float sums round: never overstate


def _has(node: Any, kind: str) -> bool:
    """Whether a normalizer / pre-tokenizer spec is or contains one of type `kind`."""
    if not isinstance(node, dict):
        return False
    if node.get("type") == kind:
        return True
    parts = node.get("normalizers") or node.get("pretokenizers") or []
    return any(_has(p, kind) for p in parts)


def _steps(node: Any) -> list[dict[str, Any]]:
    if node is None:
        return []
    if node.get("type") == "Sequence":
        parts = node.get("normalizers") or node.get("pretokenizers") or []
        return [s for p in parts for s in _steps(p)]
    return [node]


def _drops_text(spec: dict[str, Any]) -> str | None:
    """Why this tokenizer may turn many bytes into one token (None: it keeps every byte)."""
    for step in _steps(spec.get("normalizer")):
        kind = step.get("type")
        space = step.get("pattern") == {"String": " "} and step.get("content") == "▁"
        if kind not in _KEEPING_NORMALIZERS and not (kind == "Replace" and space):
            return f"normalizer {kind}"
    for step in _steps(spec.get("pre_tokenizer")):
        kind = step.get("type")
        if kind not in _KEEPING_PRE_TOKENIZERS or step.get("behavior") == "Removed":
            return f"pre-tokenizer {kind} ({step.get('behavior')})"
    if any(t.get("lstrip") or t.get("rstrip") for t in spec.get("added_tokens") or []):
        return "added tokens that strip whitespace"
    model = spec.get("model") or {}
    if model.get("type") != "BPE":
        return f"model {model.get('type')}"
    if _has(spec.get("pre_tokenizer"), "ByteLevel"):
        return None  # the text is bytes, each one a symbol or dropped (weight 0)
    vocab = model.get("vocab") or {}
    if model.get("byte_fallback") and all(f"<0x{b:02X}>" in vocab for b in range(256)):
        return None  # a character not in the vocabulary becomes its bytes' tokens
    if model.get("unk_token") is None:
        return "characters not in the vocabulary vanish"  # and their bytes are in other tokens
    if model.get("fuse_unk"):
        return "unknown characters fuse into one token"
    return None  # an unknown character is one unknown-token (MIN_LONGEST covers it)


_floors: weakref.WeakKeyDictionary[Any, TokenFloor] = weakref.WeakKeyDictionary()
_floors_lock = threading.Lock()
_warming: weakref.WeakSet[Any] = weakref.WeakSet()


def token_floor(tokenizer: Any) -> TokenFloor:
    """The TokenFloor of a tokenizer, built once (~0.1 s) and cached."""
    with _floors_lock:
        floor = _floors.get(tokenizer)
        if floor is None:
            floor = _floors[tokenizer] = TokenFloor(tokenizer)
        return floor


def warm(tokenizer: Any) -> None:
    """Start building the tokenizer's TokenFloor in the background (on the first request), so
    that the first large prompt does not build it while other streams wait for the GIL."""
    with _floors_lock:
        if tokenizer in _floors or tokenizer in _warming:
            return
        _warming.add(tokenizer)
    threading.Thread(target=token_floor, args=(tokenizer,), name="token-floor",
                     daemon=True).start()


def chat_texts(messages: Iterable[dict[str, Any]], prefill: str = "",
               template: str | None = None) -> list[str]:
    """The parts of chat messages that the template renders whatever it does with them (see
    the module docstring); `template`: its source (None: assume it trims and drops)."""
    trims = template is None or "trim" in template or "strip" in template
    drops = template is None or "</think>" in template
    out = []
    for m in messages:
        content = m.get("content")
        if not isinstance(content, str):
            continue
        if drops and m.get("role") == "assistant":
            content = content.rpartition("</think>")[2]
        out.append(content.strip() if trims else content)
    out.append(prefill)  # written after the template's text as it is
    return out


def check_prompt_fits(tokenizer: Any, context_length: int, texts: list[str],
                      param: str) -> None:
    """Refuse, with the same error as a counted prompt, texts that cannot fit the context."""
    if sum(map(len, texts)) < context_length:
        return  # the bound is at most bytes / 4 <= characters: it cannot reach the context
    at_least = token_floor(tokenizer).at_least(texts)
    if at_least >= context_length:
        raise APIError(400, f"the prompt has at least {at_least} tokens, but the model's "
                       f"context length is {context_length} tokens", param=param,
                       code="context_length_exceeded")


async def refuse_unfit(state: Any, engine: Any, prompt: str | Sequence[str] | Sequence[int],
                       param: str) -> None:
    """Refuse a prompt (a text, the texts of `chat_texts`, or token ids) that cannot fit the
    engine's context, before it is tokenized (or its ids are checked one by one)."""
    ctx = engine.context_length
    warm(engine.tokenizer)
    try:
        if isinstance(prompt, str):
            prompt = [prompt]
        if prompt and not isinstance(prompt[0], str):
            if len(prompt) >= ctx:
                raise APIError(400, f"the prompt is {len(prompt)} tokens, but the model's "
                               f"context length is {ctx} tokens", param=param,
                               code="context_length_exceeded")
            return
        texts = list(prompt)
        if sum(map(len, texts)) >= ctx:  # off the event loop: the first builds the table
            await asyncio.to_thread(check_prompt_fits, engine.tokenizer, ctx, texts, param)
    except APIError:
        state.metrics.reject("context_length_exceeded")
        raise
