"""One check the forcing-grammar tests share: does llguidance's matcher for a Lark grammar
take a text's tokens to an accepting state?"""

from __future__ import annotations

from typing import Any

import llguidance

from slotserve.runtime.grammar import ll_tokenizer


def lark_accepts(tok: Any, lark: str, text: str, parse_special: bool = False) -> bool:
    """Every token of `text` (encoded without BOS; `parse_special` reads special-token
    strings as those tokens) is allowed in turn, and the grammar accepts where it ends."""
    m = llguidance.LLMatcher(ll_tokenizer(tok), llguidance.LLMatcher.grammar_from_lark(lark),
                             log_level=0)
    assert not m.is_error(), m.get_error()
    ids = tok.encode(text, add_special=False, parse_special=True) if parse_special \
        else tok.encode(text, add_special=False)
    return m.validate_tokens(ids) == len(ids) and m.consume_tokens(ids) and m.is_accepting()
