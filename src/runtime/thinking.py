"""A thinking budget, enforced in the row: once a reply has reasoned for `budget` tokens, the
row's mask allows only the end-of-thinking marker's tokens (`</think>` and the blank line, or
gpt-oss's `<|end|>` that ends its analysis message), one a step, so the reasoning ends there
and the answer follows.

    limit = ThinkingLimit(1024, close_ids, opened=True, decode=tokenizer.decode,
                          vocab_size=tokenizer.vocab_size, inner=grammar_or_None)
    engine.make_request(ids, response_format=limit)   # each slot takes limit.matcher()

It constrains the row the way a grammar does (it *is* the request's grammar, wrapping the
request's own one, if any), so nothing outside the row changes: the fused step masks it and
the row's sampler picks the only allowed token. Where the marker is, is read from the text
(the model may spell `</think>` in other tokens than the forced ones). While the reply is not
reasoning, the inner grammar alone decides (no inner: every token is allowed); once the
reasoning has ended, the slot drops the limit (`current`), so the rest of the reply is as
unconstrained as it would have been.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from slotserve.runtime.grammar import Grammar, Matcher

OPEN, CLOSE = "<think>", "</think>"
_WINDOW = 8  # tokens of text kept to find the close marker the model writes itself


class ThinkingLimit(Grammar):
    """What a request asks: reason for at most `budget` tokens. `close`: the tokens forced at
    the budget (`</think>\\n\\n`); `opened`: the prompt ends inside the block (Qwen3.5), else
    the reply may open it itself (Qwen3; gpt-oss's analysis message). `opener` / `closer`:
    the block's markers as text. A Grammar as far as the request is concerned: its
    `matcher()` constrains the row."""

    def __init__(self, budget: int, close: Sequence[int], *, opened: bool,
                 decode: Callable[[list[int]], str], vocab_size: int,
                 inner: Grammar | None = None, opener: str = OPEN,
                 closer: str = CLOSE) -> None:
        if budget < 0:
            raise ValueError(f"the thinking budget must be at least 0, got {budget}")
        if not close:
            raise ValueError("the end-of-thinking marker has no tokens")
        self.kind, self.source = "thinking budget", inner.source if inner else ""
        self.budget, self.close, self.opened = budget, tuple(close), opened
        self.decode, self.inner = decode, inner
        self.opener, self.closer = opener, closer
        self.stop_ids = inner.stop_ids if inner is not None else frozenset()
        self.vocab_size = inner.vocab_size if inner is not None else vocab_size

    def matcher(self) -> ThinkingMatcher:
        return ThinkingMatcher(self, self.inner.matcher() if self.inner is not None else None)


class ThinkingMatcher(Matcher):
    """One reply's place: before the block (it may open one), inside it (counting), forcing
    the marker, or done."""

    __slots__ = ("limit", "inner", "phase", "count", "forced", "text", "window")

    def __init__(self, limit: ThinkingLimit, inner: Matcher | None) -> None:
        self.limit, self.inner = limit, inner
        self.stop_ids, self.vocab_size = limit.stop_ids, limit.vocab_size
        self.phase = "inside" if limit.opened else "before"  # before|inside|forcing|done
        self.count = 0  # reasoning tokens written
        self.forced: list[int] = []
        self.text = ""  # the reply so far, while it may still open the block
        self.window: list[int] = []  # the last tokens of the reasoning
        if self.phase == "inside" and limit.budget == 0:
            self.phase, self.forced = "forcing", list(limit.close)

    def fill_mask(self, row: np.ndarray) -> None:
        if self.phase == "forcing":
            row[:] = 0
            token = self.forced[0]
            row.view(np.uint32)[token // 32] = np.uint32(1) << np.uint32(token % 32)
        elif self.inner is not None:
            self.inner.fill_mask(row)
        else:
            row[:] = -1  # every token

    def consume(self, token: int) -> bool:
        ok = self.inner.consume(token) if self.inner is not None else True
        if self.phase == "forcing":
            self.forced.pop(0)
            if not self.forced:
                self.phase = "done"
        elif self.phase == "before":
            self.text += self.limit.decode([token])
            head, opener = self.text.lstrip(), self.limit.opener
            if head.startswith(opener):
                self.phase = "inside"
                self._reasoned(token, head[len(opener):])
            elif not opener.startswith(head):
                self.phase = "done"  # an answer with no reasoning
        elif self.phase == "inside":
            self._reasoned(token)
        return ok

    def _reasoned(self, token: int, since: str | None = None) -> None:
        """A token inside the block: the model's own close ends it; at the budget, the marker
        is forced from the next step on."""
        self.window = (self.window + [token])[-_WINDOW:]
        if since is not None:  # the token that opened the block: what follows `<think>`
            self.window = []
            if self.limit.closer in since:
                self.phase = "done"
                return
        elif self.limit.closer in self.limit.decode(self.window):
            self.phase = "done"
            return
        if since is None:
            self.count += 1
        if self.count >= self.limit.budget:
            self.phase, self.forced = "forcing", list(self.limit.close)

    @property
    def stopped(self) -> bool:
        return self.phase != "forcing" and self.inner is not None and self.inner.stopped

    @property
    def error(self) -> str | None:
        return self.inner.error if self.inner is not None else None

    def current(self) -> Matcher | None:
        """The matcher the row goes on with: the inner grammar's (None: unconstrained) once
        the reasoning is over, this one until then."""
        return self if self.phase != "done" else self.inner
