"""Reasoning of thinking models (`<think>` templates) kept out of the answer: the splitter
however the text is chunked, and the reasoning as each surface sends it (chat
reasoning_content, a Responses reasoning item, an Anthropic thinking block), tool calls read
from the answer only."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from slotserve.api.anthropic import Blocks
from slotserve.api.reasoning import (
    ReasoningPiece,
    ReasoningSplitter,
    prompt_opens_thinking,
    template_thinks,
)
from slotserve.api.responses_api import Output
from slotserve.api.tool_formats import HERMES, CallParser, TextPiece

REPLY = "<think>\nThe user wants the weather.\n</think>\n\nLet me check."


def split(text: str, cuts: list[int], inside: bool = False) -> tuple[str, str]:
    s = ReasoningSplitter(inside)
    bounds = sorted({min(c, len(text)) for c in cuts} | {0, len(text)})
    pieces = []
    for a, b in zip(bounds, bounds[1:], strict=False):
        pieces += s.feed(text[a:b])
    pieces += s.finish()
    return ("".join(p.text for p in pieces if isinstance(p, ReasoningPiece)),
            "".join(p.text for p in pieces if isinstance(p, TextPiece)))


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(0, 70), max_size=12))
def test_splitter_any_chunking(cuts: list[int]) -> None:
    assert split(REPLY, cuts) == ("The user wants the weather.\n", "Let me check.")
    assert split("The user wants it.</think>Done.", cuts, inside=True) == \
        ("The user wants it.", "Done.")
    assert split("No reasoning <think> here.", cuts) == ("", "No reasoning <think> here.")
    assert split("<think>cut off at max_tokens", cuts) == ("cut off at max_tokens", "")


def test_template_and_prompt() -> None:
    assert template_thinks("{{ '<think>\\n' + reasoning + '\\n</think>' }}")
    assert not template_thinks("<|im_start|>{{ message.content }}")
    assert prompt_opens_thinking("<|im_start|>assistant\n<think>\n")
    assert not prompt_opens_thinking("<|im_start|>assistant\n")


def test_surfaces() -> None:
    s = ReasoningSplitter()
    parser = CallParser(HERMES)
    events = []
    for p in s.feed("<think>Need a tool.</think>\n<tool_call>\n{\"name\": \"f\", "
                    "\"arguments\": {\"a\": 1}}\n</tool_call>") + s.finish():
        events += [p] if isinstance(p, ReasoningPiece) else parser.feed(p.text)
    events += parser.finish()
    out = Output()
    kinds = [e["type"] for e in out.feed(events) + out.finish()]
    assert kinds[:3] == ["response.output_item.added", "response.reasoning_text.delta",
                         "response.reasoning_text.done"]
    assert [i["type"] for i in out.items] == ["reasoning", "function_call"]
    assert out.items[0]["content"] == [{"type": "reasoning_text", "text": "Need a tool."}]
    blocks = Blocks()
    evs = list(blocks.thinking("Need a tool.")) + list(blocks.text("It is sunny.")) + \
        list(blocks.finish())
    starts = [e["content_block"]["type"] for k, e in evs if k == "content_block_start"]
    assert starts == ["thinking", "text"]
    assert ("content_block_delta", {"type": "content_block_delta", "index": 0, "delta": {
        "type": "thinking_delta", "thinking": "Need a tool."}}) in evs
