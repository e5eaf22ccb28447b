"""How much to think: OpenAI's `reasoning_effort` (chat) and `reasoning.effort` (Responses),
Anthropic's `thinking`, read from each body and passed to the chat template's own switch
(gpt-oss's `reasoning_effort`, Qwen3.5's `enable_thinking`), rendered by the released
templates; a template without a switch gets nothing. And an assistant turn's past reasoning
written back where the template keeps it."""

from __future__ import annotations

from pathlib import Path

import pytest

from slotserve.api.anthropic import chat_messages, parse_messages
from slotserve.api.errors import APIError
from slotserve.api.generation import harmony_thinking
from slotserve.api.reasoning import Thinking, template_options
from slotserve.api.schemas import ChatCompletionBody, parse_responses, validated
from slotserve.model.chat_template import ChatTemplate

TEMPLATES = Path(__file__).parent / "fixtures" / "agents" / "templates"
GPT_OSS = (TEMPLATES / "openai-gpt-oss-120b.jinja").read_text()
QWEN3_5 = (TEMPLATES / "Qwen3.5-4B.jinja").read_text()
ASK = [{"role": "user", "content": "Hi"}]


def test_each_surface_reads_its_field() -> None:
    chat = validated(ChatCompletionBody, {"messages": ASK, "reasoning_effort": "high"})
    assert chat.request().thinking == Thinking(effort="high")
    with pytest.raises(APIError, match="reasoning_effort"):
        validated(ChatCompletionBody, {"messages": ASK, "reasoning_effort": "huge"})
    assert parse_responses({"input": "x", "reasoning": {"effort": "low", "summary": "auto"}}
                           ).thinking == Thinking(effort="low")
    assert parse_responses({"input": "x", "reasoning": {"summary": "auto"}}).thinking is None
    body = {"max_tokens": 8, "messages": ASK}
    assert parse_messages({**body, "thinking": {"type": "enabled", "budget_tokens": 2048}}
                          ).thinking == Thinking(enabled=True, budget_tokens=2048)
    assert parse_messages({**body, "thinking": {"type": "disabled"}}).thinking == \
        Thinking(enabled=False)
    assert parse_messages({**body, "thinking": {"type": "adaptive"}}).thinking is None


@pytest.mark.parametrize("thinking, level", [
    (Thinking(effort="high"), "high"), (Thinking(effort="minimal"), "low"),
    (Thinking(enabled=False), "low"), (Thinking(enabled=True, budget_tokens=31999), "high"),
    (Thinking(enabled=True, budget_tokens=4000), "low"), (None, "medium")])
def test_gpt_oss_reasoning_level(thinking: Thinking | None, level: str) -> None:
    """gpt-oss's template writes the level into its system message (medium by default)."""
    options = template_options(GPT_OSS, thinking)
    text = ChatTemplate(GPT_OSS).render(ASK, add_generation_prompt=True, **options)
    assert f"Reasoning: {level}\n" in text


@pytest.mark.parametrize("thinking, closed", [
    (Thinking(effort="none"), True), (Thinking(enabled=False), True),
    (Thinking(effort="high"), False), (Thinking(enabled=True), False), (None, False)])
def test_qwen3_5_enable_thinking(thinking: Thinking | None, closed: bool) -> None:
    """Qwen3.5's template opens a <think> block unless thinking is off, when it writes an
    empty one (the model answers at once)."""
    text = ChatTemplate(QWEN3_5).render(ASK, add_generation_prompt=True,
                                        **template_options(QWEN3_5, thinking))
    assert text.endswith("<think>\n\n</think>\n\n") == closed
    assert text.endswith("<think>\n") != closed


def test_a_template_without_a_switch_gets_nothing() -> None:
    assert template_options("{{ messages[0]['content'] }}", Thinking(effort="high")) == {}


# ---- past reasoning, written back ------------------------------------------------------------

LOOP = [{"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": "", "reasoning_content": "Need the tool.",
         "tool_calls": [{"id": "c1", "type": "function",
                         "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]
WEATHER = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]


def test_reasoning_content_reaches_the_templates() -> None:
    """An assistant turn's reasoning_content is kept by the chat body and written back by the
    templates that keep reasoning within a tool loop: Qwen3.5's <think> block, gpt-oss's
    analysis message (its `thinking`)."""
    messages = validated(ChatCompletionBody, {"messages": LOOP}).request().messages
    assert messages[1]["reasoning_content"] == "Need the tool."
    qwen = ChatTemplate(QWEN3_5).render(messages, tools=WEATHER, add_generation_prompt=True)
    assert "<think>\nNeed the tool.\n</think>\n\n<tool_call>" in qwen
    oss = ChatTemplate(GPT_OSS).render(harmony_thinking(messages), tools=WEATHER,
                                       add_generation_prompt=True)
    assert ("<|start|>assistant<|channel|>analysis<|message|>Need the tool.<|end|>"
            "<|start|>assistant to=functions.get_weather") in oss


def test_reasoning_items_and_thinking_blocks_become_reasoning_content() -> None:
    """A Responses reasoning item (as this server writes it) and an Anthropic thinking block
    are the reasoning_content of the assistant turn they belong to."""
    items = parse_responses({"input": [
        {"type": "message", "role": "user", "content": "Weather in Oslo?"},
        {"type": "reasoning", "id": "rs_1", "summary": [],
         "content": [{"type": "reasoning_text", "text": "Need the tool."}]},
        {"type": "function_call", "call_id": "c1", "name": "get_weather",
         "arguments": '{"city": "Oslo"}'},
        {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
        {"type": "reasoning", "id": "rs_2", "summary": [], "encrypted_content": "opaque"},
        {"type": "message", "role": "assistant", "content": "Sunny."}]}).items
    assert items[1]["reasoning_content"] == "Need the tool." and items[1]["tool_calls"]
    assert "reasoning_content" not in items[3]
    req = parse_messages({"max_tokens": 8, "messages": [
        {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": [
            {"type": "thinking", "thinking": "Need the tool.", "signature": "s"},
            {"type": "tool_use", "id": "c1", "name": "get_weather", "input": {"city": "Oslo"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "c1",
                                      "content": "sunny"}]}]})
    messages, _ = chat_messages(req)
    assert messages[1]["reasoning_content"] == "Need the tool." and messages[1]["tool_calls"]
