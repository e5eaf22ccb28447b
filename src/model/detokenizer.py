"""Streaming text out of token ids: whole UTF-8 characters only, stop strings held back.

Byte-level tokens often split one character (emoji, CJK) over several tokens, so decoding token by
token would emit U+FFFD. Working on raw token bytes with an incremental UTF-8 decoder emits each
character once it is complete.
"""

from __future__ import annotations

import codecs
from collections.abc import Iterable
from typing import Protocol


class _TokenBytes(Protocol):
    special_ids: frozenset[int]
    shown_ids: frozenset[int]  # special tokens kept even when special ones are skipped

    def token_bytes(self, i: int) -> bytes: ...


class IncrementalDetokenizer:
    """Feed generated ids one at a time; get back only the newly completed text.

    The concatenation of all deltas plus ``flush()`` equals the byte-exact decode of the ids.
    (For SentencePiece models with a space prefix, ``Tokenizer.decode`` also strips the one
    leading space; here it is kept, since mid-conversation it is real text.)

    Why not ``tokenizers.decoders.DecodeStream``: on the same ids it gives the same text (the
    bundled SmolLM2, a SentencePiece vocabulary, and llama.cpp's Llama 2/3, Qwen2, Phi-3 and
    GPT-2 vocabularies when cached; ``tests/test_tokenizer.py``) except in four cases, each of
    which changes what a client sees:

    - a token that ends mid-character (a space and the first bytes of a CJK character): its
      complete characters are shown here at once, while DecodeStream holds the whole token
      until the character completes, so a stop string would be found a token later (usage
      and finish would change);
    - the end of a stream cut mid-character: ``flush`` gives U+FFFD here, DecodeStream has no
      flush and keeps those bytes;
    - SentencePiece with a "▁" prefix: DecodeStream strips the first token's space;
    - byte-fallback tokens that are not valid UTF-8 as a run: only the invalid bytes become
      U+FFFD here, HF's ByteFallback decoder turns every byte of the run into U+FFFD.

    Added tokens that are not special stream as spelled: a user-defined "▁▁" shows as "▁▁",
    where HF's decoders (and so DecodeStream) read two spaces. The comparison leaves those out;
    the real vocabularies above have no such token with a "▁" in it.
    """

    def __init__(self, tokenizer: _TokenBytes, skip_special: bool = False) -> None:
        self._tokenizer = tokenizer
        self._skip = (tokenizer.special_ids - tokenizer.shown_ids) if skip_special else frozenset()
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def add(self, token_id: int) -> str:
        if token_id in self._skip:
            return ""
        return self._decoder.decode(self._tokenizer.token_bytes(token_id))

    def flush(self) -> str:
        """End of stream: any dangling partial character becomes U+FFFD."""
        return self._decoder.decode(b"", final=True)


class StopMatcher:
    """Finds stop strings in streamed text without ever emitting part of one.

    ``feed`` returns text that is safe to show; a suffix that could still grow into a stop string
    is held back until it either completes (stop) or cannot (released on a later feed/flush).
    """

    def __init__(self, stop_strings: Iterable[str]) -> None:
        self.stop_strings = tuple(dict.fromkeys(s for s in stop_strings if s))
        self.stopped = False
        self.matched: str | None = None
        self._pending = ""

    def feed(self, delta: str) -> tuple[str, bool]:
        """Returns ``(text_to_emit, stopped)``; after a stop, further input is dropped."""
        if self.stopped:
            return "", True
        buf = self._pending + delta
        hit: tuple[int, int, str] | None = None
        for s in self.stop_strings:
            i = buf.find(s)
            if i >= 0 and (hit is None or (i, len(s)) < hit[:2]):
                hit = (i, len(s), s)
        if hit is not None:
            self.stopped, self.matched, self._pending = True, hit[2], ""
            return buf[: hit[0]], True
        hold = self._partial_suffix(buf)
        self._pending = buf[len(buf) - hold:] if hold else ""
        return buf[: len(buf) - hold], False

    def flush(self) -> str:
        """End of stream: held-back text was not a stop after all, so release it."""
        out, self._pending = ("" if self.stopped else self._pending), ""
        return out

    def _partial_suffix(self, buf: str) -> int:
        """Length of the longest suffix of ``buf`` that is a proper prefix of a stop string."""
        best = 0
        for s in self.stop_strings:
            for k in range(min(len(s) - 1, len(buf)), best, -1):
                if buf.endswith(s[:k]):
                    best = k
                    break
        return best
