"""What a request's prompt shares with earlier ones, as the router can see it without a tokenizer.

A replica reuses KV for the longest token prefix it still holds (slotserve's one prefix cache,
docs/architecture.md). The router has no tokenizer and no chat template, so it keys prefixes
by what the client sent, one hash chain per request:

    root  = H(endpoint family, model, tenant, cache_salt, system/instructions, tools)
    key_0 = H(root, canonical(item_0)),  key_i = H(key_{i-1}, canonical(item_i))

where the items are the chat/Anthropic messages or Responses input items in order, and for
`/v1/completions` blocks of the prompt (256 characters, or 64 token ids). `canonical` is JSON
with sorted keys and no spaces, so a client that re-sends its history with other whitespace or
key order still matches. Two requests reach the same key exactly when they share everything
before it, the way the replica's own page keys chain (blake2b, as vLLM and nano-vllm do), just
at message instead of token granularity. The router records every key of a request it routed
under that replica; a later request walks its own chain from the longest prefix down.

Tenants never match each other: the root holds a hash of the caller's credential (the
replica's default `--cache-scope key` shares KV only within one API key) and the request's
`cache_salt`. A continuation's history also holds the previous *answer*, which the replica
generated and so holds as KV too: an assistant message right after the matched prefix counts
as matched (`Chain.matched_chars`). That makes a second turn match nearly all of its prompt,
where a shared system prompt alone matches only its own share (SGLang's router weighs a match
by the same ratio, against its `--cache-threshold`).

A conversation key given by the client (`prompt_cache_key`, `user`, Anthropic's
`metadata.user_id`) is a second, sticky signal (`Chain.conversation`).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Any

TEXT_BLOCK = 256  # characters of a completions prompt per chain link
TOKEN_BLOCK = 64  # token ids of a completions prompt per chain link


def canonical(value: Any) -> bytes:
    """The JSON of `value` with sorted keys and no insignificant whitespace."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False,
                      default=str).encode()


def _h(*parts: bytes) -> bytes:
    d = hashlib.blake2b(digest_size=16)
    for p in parts:
        d.update(len(p).to_bytes(8, "little"))
        d.update(p)
    return d.digest()


@dataclass
class Chain:
    """A request's prefix keys, longest last, and what each one covers of the prompt."""

    keys: list[bytes] = field(default_factory=list)
    # characters of canonical prompt covered up to and including link i
    ends: list[int] = field(default_factory=list)
    total: int = 0
    # credit for link i's match: the characters of an assistant item right after it
    answer_after: list[int] = field(default_factory=list)
    conversation: bytes | None = None

    def matched_chars(self, index: int) -> int:
        """Characters of the prompt a replica holding link `index` already has as KV."""
        return self.ends[index] + self.answer_after[index]


def tenant_of(headers: Any) -> bytes:
    """A digest of the caller's credential: requests of different keys never share a chain."""
    auth = headers.get("Authorization", "") or ""
    api_key = headers.get("x-api-key", "") or ""
    return _h(auth.encode(), api_key.encode())


def chain_for(path: str, body: dict[str, Any], tenant: bytes) -> Chain:
    """The prefix chain of one generation request (empty for paths with no prompt)."""
    family, system, items = _prompt_parts(path, body)
    if family is None:
        return Chain()
    root = _h(b"slotserve-route-1", family.encode(), canonical(body.get("model")), tenant,
              canonical(body.get("cache_salt")), canonical(system),
              canonical(body.get("tools")))
    chain = Chain()
    key, end = root, len(canonical(system))
    sizes: list[int] = []
    for item in items:
        data = item if isinstance(item, bytes) else canonical(item)
        key = _h(key, data)
        end += len(data)
        chain.keys.append(key)
        chain.ends.append(end)
        sizes.append(len(data))
    chain.total = end
    chain.answer_after = [
        sizes[i + 1] if i + 1 < len(items) and _is_answer(items[i + 1]) else 0
        for i in range(len(items))]
    conv = _conversation_key(body)
    if conv is not None:
        chain.conversation = _h(b"conversation", family.encode(), canonical(body.get("model")),
                                tenant, canonical(body.get("cache_salt")), conv.encode())
    return chain


def _is_answer(item: Any) -> bool:
    return isinstance(item, dict) and item.get("role") == "assistant"


def _prompt_parts(path: str, body: dict[str, Any]) -> tuple[str | None, Any, list[Any]]:
    """(family, system part, the ordered items) of a request body."""
    if path == "/v1/chat/completions":
        msgs = body.get("messages")
        return ("chat", None, list(msgs)) if isinstance(msgs, list) else (None, None, [])
    if path in ("/v1/messages", "/v1/messages/count_tokens"):
        msgs = body.get("messages")
        if not isinstance(msgs, list):
            return None, None, []
        return "messages", body.get("system"), list(msgs)
    if path == "/v1/responses":
        inp = body.get("input")
        items: list[Any] = ([{"role": "user", "content": inp}] if isinstance(inp, str)
                            else list(inp) if isinstance(inp, list) else [])
        return "responses", body.get("instructions"), items
    if path == "/v1/completions":
        prompt = body.get("prompt")
        if isinstance(prompt, str):
            return "completions", None, [prompt[i:i + TEXT_BLOCK].encode()
                                         for i in range(0, len(prompt), TEXT_BLOCK)]
        if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
            return "completions-ids", None, [canonical(prompt[i:i + TOKEN_BLOCK])
                                             for i in range(0, len(prompt), TOKEN_BLOCK)]
    return None, None, []


def _conversation_key(body: dict[str, Any]) -> str | None:
    for name in ("prompt_cache_key", "user"):
        value = body.get(name)
        if isinstance(value, str) and value:
            return f"{name}:{value}"
    meta = body.get("metadata")
    if isinstance(meta, dict) and isinstance(meta.get("user_id"), str) and meta["user_id"]:
        return f"user_id:{meta['user_id']}"
    return None
