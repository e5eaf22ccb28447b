"""OpenAI chat and text completion bodies: completions, chunks, usage and logprobs, built from
engine output (the Responses API is `responses_api`)."""

from __future__ import annotations

import hashlib
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from slotserve.actors.messages import TokenLogprob, Usage

LOGPROB_FLOOR = -9999.0  # what OpenAI reports for a token of probability 0 (logprob -inf)


def logprob(value: float) -> float:
    """A logprob for JSON: -inf (a token the grammar forbade) is OpenAI's -9999.0. NaN stays
    NaN, so the strict serializer refuses it: it would be a bug, not a probability."""
    return LOGPROB_FLOOR if value < LOGPROB_FLOOR else value


def usage_dict(u: Usage | None) -> dict[str, Any]:
    u = u or Usage()
    return {"prompt_tokens": u.prompt_tokens, "completion_tokens": u.completion_tokens,
            "total_tokens": u.prompt_tokens + u.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": u.reused_tokens}}


class LogprobFormatter:
    """Token ids -> the token text and bytes OpenAI's logprob entries carry."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer

    def _text(self, token: int) -> tuple[str, list[int]]:
        raw = self.tokenizer.token_bytes(token)
        return raw.decode("utf-8", errors="replace"), list(raw)

    def chat(self, lps: list[TokenLogprob], top: int) -> list[dict[str, Any]]:
        """Entries of `choices[].logprobs.content`."""
        out = []
        for lp in lps:
            text, raw = self._text(lp.token)
            alts = []
            for tok, value in (lp.top or [])[:top]:
                t, b = self._text(tok)
                alts.append({"token": t, "logprob": logprob(value), "bytes": b})
            out.append({"token": text, "logprob": logprob(lp.logprob), "bytes": raw,
                        "top_logprobs": alts})
        return out

    def completion(self, lps: list[TokenLogprob], top: int, offset: int) -> dict[str, Any]:
        """The legacy `choices[].logprobs` object; offsets count characters from `offset`."""
        tokens, values, tops, offsets = [], [], [], []
        for lp in lps:
            text, _ = self._text(lp.token)
            tokens.append(text)
            values.append(logprob(lp.logprob))
            tops.append({self._text(t)[0]: logprob(v) for t, v in (lp.top or [])[:top]}
                        if top else None)
            offsets.append(offset)
            offset += len(text)
        return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops,
                "text_offset": offsets}


def system_fingerprint(model: str) -> str:
    """OpenAI's `system_fingerprint`: what answers with the same seed share, here the served
    model and the slotserve version."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        release = version("slotserve")
    except PackageNotFoundError:
        release = "dev"
    return "fp_" + hashlib.sha256(f"{model}|{release}".encode()).hexdigest()[:10]


@dataclass
class ResponseIds:
    """What every chunk of one response repeats."""

    model: str
    prefix: str = "chatcmpl"
    id: str = ""
    fingerprint: str = field(default="", init=False)
    created: int = field(default_factory=lambda: int(time.time()))

    def __post_init__(self) -> None:
        self.id = self.id or f"{self.prefix}-{uuid.uuid4().hex[:24]}"
        self.fingerprint = system_fingerprint(self.model)

    def chat(self, choice: dict[str, Any], usage: Usage | None = None) -> dict[str, Any]:
        return {"id": self.id, "object": "chat.completion", "created": self.created,
                "model": self.model, "system_fingerprint": self.fingerprint, "choices": [choice],
                "usage": usage_dict(usage)}

    def chat_chunk(self, delta: dict[str, Any], finish_reason: str | None = None,
                   logprobs: list[dict[str, Any]] | None = None) -> dict[str, Any]:
        choice = {"index": 0, "delta": delta, "finish_reason": finish_reason,
                  "logprobs": None if logprobs is None else {"content": logprobs}}
        return {"id": self.id, "object": "chat.completion.chunk", "created": self.created,
                "model": self.model, "system_fingerprint": self.fingerprint, "choices": [choice]}

    def completion(self, choice: dict[str, Any], usage: Usage | None = None) -> dict[str, Any]:
        return {"id": self.id, "object": "text_completion", "created": self.created,
                "model": self.model, "system_fingerprint": self.fingerprint, "choices": [choice],
                "usage": usage_dict(usage)}

    def completion_chunk(self, text: str, finish_reason: str | None = None,
                         logprobs: dict[str, Any] | None = None) -> dict[str, Any]:
        choice = {"index": 0, "text": text, "finish_reason": finish_reason, "logprobs": logprobs}
        return {"id": self.id, "object": "text_completion", "created": self.created,
                "model": self.model, "system_fingerprint": self.fingerprint, "choices": [choice]}

    def usage_chunk(self, usage: Usage | None, object: str) -> dict[str, Any]:
        return {"id": self.id, "object": object, "created": self.created, "model": self.model,
                "system_fingerprint": self.fingerprint, "choices": [],
                "usage": usage_dict(usage)}
