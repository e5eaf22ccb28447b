"""A thinking budget enforced: Anthropic's `thinking: {type: enabled, budget_tokens: N}` on a
`<think>` template ends the reasoning after N tokens (the row's mask allows only `</think>`
and the blank line there, `runtime.thinking`) so that the answer follows. The row constraint
on the bundled SmolLM2's vocabulary, and the tiny Qwen3 with Qwen3.5's template (its prompt
opens the block) through the real server, streamed and not."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from converted import tiny_hf_with_template
from vocabularies import smollm2

from slotserve.api.app import create_app
from slotserve.api.server import BackgroundServer
from slotserve.api.tool_formats import HERMES, no_call_grammar
from slotserve.engine import EngineConfig
from slotserve.runtime.grammar import Matcher, compile_lark
from slotserve.runtime.thinking import ThinkingLimit

RAMBLE = " the user asks about the weather and I should think about it for a while" * 3


def limit(budget: int, opened: bool, lark: str | None = None) -> ThinkingLimit:
    tok = smollm2()
    return ThinkingLimit(budget, tok.encode("</think>\n\n", add_special=False),
                         opened=opened, decode=tok.decode, vocab_size=tok.vocab_size,
                         inner=compile_lark(lark, tok) if lark else None)


def run(constraint: ThinkingLimit, text: str) -> tuple[str, Matcher | None]:
    """A reply that writes `text`'s tokens wherever the row allows them and the one allowed
    token where only one is (it stops at a token forbidden where nothing is forced): its
    text, and the matcher the row is left with."""
    tok = smollm2()
    matcher: Matcher | None = constraint.matcher()
    bits = np.zeros(((constraint.vocab_size + 31) // 32,), np.int32)
    wanted, out = tok.encode(text, add_special=False), []
    steps = len(wanted) + 8
    while len(out) < steps and wanted:
        token = wanted[0]
        if matcher is not None:
            matcher.fill_mask(bits)
            allowed = np.unpackbits(bits.view(np.uint8), bitorder="little")
            (choices,) = np.nonzero(allowed[:constraint.vocab_size])
            if not allowed[token]:
                if len(choices) != 1:
                    break
                token = int(choices[0])
            matcher.consume(token)
            matcher = matcher.current()
        if token == wanted[0]:
            wanted.pop(0)
        out.append(token)
    return tok.decode(out), matcher


@pytest.mark.parametrize("opened", [True, False])
def test_the_reasoning_ends_at_the_budget(opened: bool) -> None:
    """Past the budget only `</think>` and the blank line may follow, then the reply is
    free (the row unconstrained again); a block the model closes in time is left alone, and
    so is an answer with no block."""
    head = "" if opened else "<think>\n"
    text, after = run(limit(6, opened), head + RAMBLE)
    reasoning, close, rest = text.partition("</think>\n\n")
    assert close and rest, text
    # the budget counts what follows `<think>` (its newline too)
    assert len(smollm2().encode(reasoning.removeprefix("<think>"), add_special=False)) == 6
    assert RAMBLE.startswith(reasoning[len(head):] + rest) and after is None
    short = head + "Short.</think>\n\nSunny, 21 C, and no more reasoning is needed here."
    assert run(limit(6, opened), short) == (short, None)
    if not opened:
        assert run(limit(2, opened), "Sunny" + RAMBLE) == ("Sunny" + RAMBLE, None)


def test_budget_zero_and_the_inner_grammar() -> None:
    """A budget of 0 closes the block at once; the answer keeps the tool choice's grammar
    (tool_choice "none": no call opened)."""
    text, _ = run(limit(0, True), "Sunny.")
    assert text.startswith("</think>\n\nSunny")
    text, after = run(limit(3, True, no_call_grammar(HERMES)), "Hmm, let me see. No")
    reasoning, close, rest = text.partition("</think>\n\n")
    assert close and len(smollm2().encode(reasoning, add_special=False)) == 3
    assert after is not None and reasoning + rest == "Hmm, let me see. No"
    text, _ = run(limit(3, True, no_call_grammar(HERMES)), "Hmm.</think>\n\n<tool_call>")
    assert text.startswith("Hmm.</think>\n\n") and "<tool_call>" not in text
    assert not isinstance(after, type(limit(1, True).matcher()))


@pytest.fixture(scope="module")
def srv(tmp_path_factory: pytest.TempPathFactory) -> Iterator[BackgroundServer]:
    """The tiny Qwen3 with Qwen3.5's template, whose prompt opens a <think> block: greedy, it
    never closes the block itself."""
    model = tiny_hf_with_template("qwen3", "Qwen3.5-4B.jinja",
                                  Path(tmp_path_factory.mktemp("qwen3.5-think")))
    server = BackgroundServer(create_app(EngineConfig(model=model, max_slots=2, max_queue=8),
                                         keepalive_interval=0.2)).start()
    yield server
    server.stop()


def test_anthropic_budget_tokens_ends_the_reasoning(srv: BackgroundServer) -> None:
    """With a budget of 8 the thinking block holds at most 8 tokens and a text answer
    follows, streamed and not; without one the reasoning runs to max_tokens."""
    body: dict[str, Any] = {"model": "qwen3.5", "max_tokens": 24, "temperature": 0,
                            "messages": [{"role": "user", "content": "Weather in Oslo?"}]}
    url = srv.url + "/v1/messages"
    free = httpx.post(url, json=body, timeout=120).json()
    assert [b["type"] for b in free["content"]] == ["thinking"], free
    assert free["stop_reason"] == "max_tokens"
    budget = {**body, "thinking": {"type": "enabled", "budget_tokens": 8}}
    m = httpx.post(url, json=budget, timeout=120).json()
    assert [b["type"] for b in m["content"]] == ["thinking", "text"], m
    thought, answer = m["content"][0]["thinking"], m["content"][1]["text"]
    tok = srv.state.ready_engine().tokenizer
    assert 0 < len(tok.encode(thought, add_special=False)) <= 8 and answer.strip()
    assert free["content"][0]["thinking"].startswith(thought)  # the same start, cut short
    parts: dict[str, str] = {"thinking_delta": "", "text_delta": ""}
    with httpx.stream("POST", url, json={**budget, "stream": True}, timeout=120) as r:
        for line in r.iter_lines():
            ev = json.loads(line[6:]) if line.startswith("data: ") else {}
            if ev.get("type") == "content_block_delta":
                d = ev["delta"]
                parts[d["type"]] += d.get("thinking", d.get("text", ""))
    assert (parts["thinking_delta"], parts["text_delta"]) == (thought, answer)
