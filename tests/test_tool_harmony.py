"""gpt-oss's harmony replies: channels (analysis -> reasoning, final -> answer) and calls
(`to=functions.NAME` on commentary) parsed as they stream, the syntax chosen from gpt-oss's
own chat template, and the forcing grammars checked by llguidance; then end to end on the
real server with a tiny random GptOssForCausalLM that has harmony's control tokens and
OpenAI's template: a forced call streams its arguments as argument deltas on all three
surfaces, and the streamed calls reassemble to the non-streamed ones."""

from __future__ import annotations

import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from grammar_check import lark_accepts
from hypothesis import given, settings
from hypothesis import strategies as st

from slotserve.api.app import create_app
from slotserve.api.generation import start_chat
from slotserve.api.harmony import (
    HarmonyParser,
    harmony_call_grammar,
    harmony_no_call_grammar,
    template_is_harmony,
)
from slotserve.api.reasoning import ReasoningPiece, Thinking
from slotserve.api.server import BackgroundServer
from slotserve.api.tool_formats import (
    HARMONY,
    ArgumentsPiece,
    CallClosed,
    CallOpened,
    TextPiece,
    syntax_for_template,
)
from slotserve.api.tools import ToolChoice
from slotserve.engine import EngineConfig
from slotserve.model.tokenizer import Tokenizer

TEMPLATES = Path(__file__).parent / "fixtures" / "agents" / "templates"
GPT_OSS_TEMPLATE = TEMPLATES / "openai-gpt-oss-120b.jinja"  # OpenAI's, as llama.cpp keeps it
HARMONY_TOKENS = ["<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>",
                  "<|return|>", "<|call|>"]

ARGS = '{"city": "Oslo", "note": "a <|end and } inside"}'
REPLIES: list[tuple[str, str, str, list[tuple[str, str]]]] = [
    # reply, reasoning, answer, calls
    ("<|channel|>analysis<|message|>User wants weather.<|end|><|start|>assistant<|channel|>"
     f"commentary to=functions.get_weather <|constrain|>json<|message|>{ARGS}",
     "User wants weather.", "", [("get_weather", ARGS)]),
    (f"<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>{ARGS}"
     "<|call|>", "", "", [("get_weather", ARGS)]),
    ("<|channel|>analysis<|message|>Think.<|end|><|start|>assistant<|channel|>final"
     "<|message|>It is sunny.<|return|>", "Think.", "It is sunny.", []),
    ("<|channel|>commentary<|message|>Checking.<|end|><|start|>assistant<|channel|>commentary "
     "to=functions.now <|constrain|>json<|message|>", "", "Checking.", [("now", "{}")]),
    ("Just text, no header.", "", "Just text, no header.", []),
    ("<|channel|>final<|message|>a < b, to= c <|start", "", "a < b, to= c <|start", []),
]


def events_of(text: str, cuts: list[int]) -> list[Any]:
    parser = HarmonyParser()
    bounds = sorted({min(c, len(text)) for c in cuts} | {0, len(text)})
    out: list[Any] = []
    for a, b in zip(bounds, bounds[1:], strict=False):
        out += parser.feed(text[a:b])
    return out + parser.finish()


def summary(events: list[Any]) -> tuple[str, str, list[tuple[str, str]]]:
    reasoning = "".join(e.text for e in events if isinstance(e, ReasoningPiece))
    answer = "".join(e.text for e in events if isinstance(e, TextPiece))
    calls = [(e.call.name, e.call.arguments) for e in events if isinstance(e, CallClosed)]
    return reasoning, answer, calls


@pytest.mark.parametrize("reply, reasoning, answer, calls", REPLIES)
def test_whole_replies(reply: str, reasoning: str, answer: str,
                       calls: list[tuple[str, str]]) -> None:
    assert summary(events_of(reply, [])) == (reasoning, answer, calls)


@settings(max_examples=150, deadline=None)
@given(st.sampled_from(REPLIES), st.lists(st.integers(0, 260), max_size=30))
def test_streaming_matches_whole_text(reply: tuple, cuts: list[int]) -> None:
    """However the text is chunked: the same reasoning, answer and calls as the whole; each
    call opens before its arguments, whose pieces join to its arguments."""
    text = reply[0]
    events = events_of(text, cuts)
    assert summary(events) == summary(events_of(text, []))
    pieces: dict[int, str] = {}
    opened: set[int] = set()
    for e in events:
        if isinstance(e, CallOpened):
            opened.add(e.index)
        elif isinstance(e, ArgumentsPiece):
            assert e.index in opened
            pieces[e.index] = pieces.get(e.index, "") + e.text
        elif isinstance(e, CallClosed):
            assert pieces[e.index] == e.call.arguments


def test_arguments_stream_as_written() -> None:
    parser = HarmonyParser()
    assert parser.feed("<|channel|>analysis<|mess") == []
    assert parser.feed("age|>Need the tool.<|e") == [ReasoningPiece("Need the tool.")]
    assert parser.feed("nd|><|start|>assistant<|channel|>commentary to=functions.f") == []
    opened = parser.feed(" <|constrain|>json<|message|>{\"a\": ")
    assert isinstance(opened[0], CallOpened) and opened[0].name == "f"
    assert opened[1:] == [ArgumentsPiece(0, '{"a": ')]
    assert parser.feed("1}") == [ArgumentsPiece(0, "1}")]
    (closed,) = parser.finish()
    assert isinstance(closed, CallClosed) and closed.call.arguments == '{"a": 1}'


def test_calls_off_gives_the_content_as_text() -> None:
    parser = HarmonyParser(calls=False)
    events = parser.feed("<|channel|>commentary to=functions.f<|message|>{}") + parser.finish()
    assert summary(events) == ("", "{}", [])


def test_render_reads_back() -> None:
    """A past call as `HARMONY.render` writes it (gpt-oss's template's form) parses back."""
    rendered = HARMONY.render([("get_weather", '{"city": "Oslo"}')])
    assert summary(events_of(rendered.removeprefix("<|start|>assistant"), [])) == (
        "", "", [("get_weather", '{"city": "Oslo"}')])


def test_syntax_of_gpt_oss_template() -> None:
    source = GPT_OSS_TEMPLATE.read_text()
    assert template_is_harmony(source) and syntax_for_template(source) is HARMONY


# ---- a harmony vocabulary --------------------------------------------------------------------


def write_harmony_tokenizer(out: Path) -> int:
    """SmolLM2's tokenizer plus harmony's control tokens (special, as in o200k_harmony), with
    gpt-oss's chat template; <|return|> and <|call|> end generation (generation_config, as
    gpt-oss ships it). Returns the vocabulary size."""
    from tokenizers import AddedToken
    from tokenizers import Tokenizer as HFTokenizer

    from slotserve.tools.synth import write_smollm2_tokenizer

    write_smollm2_tokenizer(out)
    tok = HFTokenizer.from_file(str(out / "tokenizer.json"))
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t in HARMONY_TOKENS])
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "chat_template": GPT_OSS_TEMPLATE.read_text(), "eos_token": "<|return|>",
        "add_bos_token": False}))
    ids = [tok.token_to_id(t) for t in ("<|return|>", "<|call|>")]
    (out / "generation_config.json").write_text(json.dumps({"eos_token_id": ids}))
    return tok.get_vocab_size(True)


@pytest.fixture(scope="module")
def harmony_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random GptOssForCausalLM (float experts) with the harmony tokenizer."""
    import torch
    import transformers

    out = Path(tmp_path_factory.mktemp("gpt-oss"))
    vocab = write_harmony_tokenizer(out)
    cfg = transformers.GptOssConfig(
        vocab_size=vocab, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=4,
        num_experts_per_tok=2, sliding_window=16, max_position_embeddings=4096,
        layer_types=["sliding_attention", "full_attention"], bos_token_id=None,
        eos_token_id=None, pad_token_id=None, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = transformers.GptOssForCausalLM(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(1.0 if "norm" in name else 0.0, 0.3 if "norm" in name else 0.08)
    model.to(torch.float32).save_pretrained(out, safe_serialization=True)
    return out


# (gpt-oss's template writes every tool's description: it fails on a tool without one)
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather of a city", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
    "required": ["city"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "add", "description": "a + b", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
        "required": ["a", "b"], "additionalProperties": False}}}]


def test_forcing_grammar_accepts_its_calls_only(harmony_dir: Path) -> None:
    tok = Tokenizer.from_hf_dir(harmony_dir)
    specials = dict(tok.special_tokens)

    accepts = partial(lark_accepts, tok, parse_special=True)

    lark = harmony_call_grammar(TOOLS, ToolChoice("required"), specials)
    good = ('<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>'
            '{"city": "Oslo"}')
    assert accepts(lark, good)
    assert accepts(lark, '<|channel|>commentary to=functions.add <|constrain|>json<|message|>'
                         '{"a": 1, "b": 2}')
    assert not accepts(lark, good.replace("Oslo", "Oslo and far beyond"))  # maxLength 12
    assert not accepts(lark, good.replace("get_weather", "get_time"))
    named = harmony_call_grammar(TOOLS, ToolChoice("function", "add"), specials)
    assert not accepts(named, good)
    # reasoning first, as gpt-oss does, within its bound (then <|end|> is forced)
    reasoned = harmony_call_grammar(TOOLS, ToolChoice("required"), specials, 16)
    thought = "<|channel|>analysis<|message|>The user wants Oslo.<|end|><|start|>assistant"
    assert accepts(reasoned, thought + good) and accepts(reasoned, good)
    assert not accepts(lark, thought + good)  # no bound given: straight to the call
    assert not accepts(reasoned, thought.replace("Oslo.", "Oslo. " + "More. " * 20) + good)
    none = harmony_no_call_grammar(specials)
    assert accepts(none, "<|channel|>analysis<|message|>Hm.<|end|><|start|>assistant"
                         "<|channel|>final<|message|>Sunny.")
    assert not accepts(none, good)


# ---- end to end --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def srv(harmony_dir: Path) -> Iterator[BackgroundServer]:
    server = BackgroundServer(create_app(EngineConfig(model=harmony_dir, max_slots=4,
                                                      max_queue=16),
                                         keepalive_interval=0.2)).start()
    yield server
    server.stop()


def test_forced_call_streams_on_all_three_surfaces(srv: BackgroundServer) -> None:
    """Chat Completions, Responses and Anthropic Messages, streamed and not, give the same
    call for the same greedy forced request; the streamed arguments come in several pieces,
    and the header tokens never reach the answer."""
    client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)
    ask = [{"role": "user", "content": "Weather in Oslo?"}]
    body: dict[str, Any] = dict(model="gpt-oss", messages=ask, tools=TOOLS, temperature=0,
                                max_tokens=64, tool_choice={"type": "function",
                                                            "function": {"name": "get_weather"}})
    r_tools = [{"type": "function", **t["function"]} for t in TOOLS]
    r_body: dict[str, Any] = dict(model="gpt-oss", input="Weather in Oslo?", tools=r_tools,
                                  temperature=0, max_output_tokens=64,
                                  tool_choice={"type": "function", "name": "get_weather"})
    a_tools = [{"name": t["function"]["name"], "description": t["function"]["description"],
                "input_schema": t["function"]["parameters"]} for t in TOOLS]
    a_body: dict[str, Any] = dict(model="gpt-oss", messages=ask, tools=a_tools, temperature=0,
                                  max_tokens=64,
                                  tool_choice={"type": "tool", "name": "get_weather"})

    def chat_whole() -> list[tuple[str, Any]]:
        r = client.chat.completions.create(**body)
        assert r.choices[0].finish_reason == "tool_calls"
        assert "<|" not in (r.choices[0].message.content or "")
        return [(c.function.name, json.loads(c.function.arguments))
                for c in r.choices[0].message.tool_calls]

    def chat_streamed() -> tuple[list[tuple[str, Any]], int]:
        calls: dict[int, list[str]] = {}
        pieces = 0
        for chunk in client.chat.completions.create(**body, stream=True):
            for tc in (chunk.choices[0].delta.tool_calls or []) if chunk.choices else []:
                entry = calls.setdefault(tc.index, ["", ""])
                entry[0] += tc.function.name or ""
                entry[1] += tc.function.arguments or ""
                pieces += bool(tc.function.arguments)
        return [(n, json.loads(a)) for n, a in calls.values()], pieces

    def responses_whole() -> list[tuple[str, Any]]:
        r = client.responses.create(**r_body)
        return [(o.name, json.loads(o.arguments)) for o in r.output if o.type == "function_call"]

    def responses_streamed() -> tuple[list[tuple[str, Any]], int]:
        pieces = 0
        with client.responses.stream(**r_body) as stream:
            for ev in stream:
                pieces += ev.type == "response.function_call_arguments.delta"
            final = stream.get_final_response()
        return [(o.name, json.loads(o.arguments)) for o in final.output
                if o.type == "function_call"], pieces

    def anthropic(stream: bool) -> tuple[list[tuple[str, Any]], int]:
        url = srv.url + "/v1/messages"
        if not stream:
            m = httpx.post(url, json=a_body, timeout=120).json()
            assert m["stop_reason"] == "tool_use"
            return [(b["name"], b["input"]) for b in m["content"] if b["type"] == "tool_use"], 0
        blocks: dict[int, list[str]] = {}
        pieces = 0
        with httpx.stream("POST", url, json={**a_body, "stream": True}, timeout=120) as r:
            for line in r.iter_lines():
                if not line.startswith("data: "):
                    continue
                ev = json.loads(line[6:])
                if ev["type"] == "content_block_start" and \
                        ev["content_block"]["type"] == "tool_use":
                    blocks[ev["index"]] = [ev["content_block"]["name"], ""]
                elif ev["type"] == "content_block_delta" and \
                        ev["delta"]["type"] == "input_json_delta":
                    blocks[ev["index"]][1] += ev["delta"]["partial_json"]
                    pieces += 1
        return [(n, json.loads(a)) for n, a in blocks.values()], pieces

    with ThreadPoolExecutor(6) as pool:
        jobs = [pool.submit(f) for f in (chat_whole, chat_streamed, responses_whole,
                                         responses_streamed)]
        jobs += [pool.submit(anthropic, False), pool.submit(anthropic, True)]
        (c_whole, (c_streamed, c_pieces), r_whole, (r_streamed, r_pieces),
         (a_whole, _), (a_streamed, a_pieces)) = [j.result() for j in jobs]
    assert len(c_whole) == 1 and c_whole[0][0] == "get_weather"
    assert isinstance(c_whole[0][1]["city"], str) and len(c_whole[0][1]["city"]) <= 12
    assert c_streamed == c_whole == r_whole == r_streamed == a_whole == a_streamed
    assert min(c_pieces, r_pieces, a_pieces) > 1


def test_none_writes_channels_not_markers(srv: BackgroundServer) -> None:
    """tool_choice "none": the grammar allows analysis and final messages only; sampled, the
    reply's channels split into reasoning and answer with no harmony marker left in either."""
    client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)
    for seed in range(3):
        r = client.chat.completions.create(
            model="gpt-oss", messages=[{"role": "user", "content": "Hi"}], tools=TOOLS,
            tool_choice="none", temperature=1.0, seed=seed, max_tokens=16)
        message = r.choices[0].message
        assert message.tool_calls is None
        reasoning = getattr(message, "reasoning_content", None) or ""
        for text in (message.content or "", reasoning):
            assert not any(t in text for t in HARMONY_TOKENS), (text, reasoning)


def test_reasoning_effort_reaches_the_prompt(srv: BackgroundServer) -> None:
    """A request's effort is gpt-oss's "Reasoning: ..." line (medium when none is asked)."""
    state = srv.state

    async def prompt(thinking: Thinking | None) -> str:
        async with srv.app.test_request_context("/v1/chat/completions", method="POST"):
            run = await start_chat(state, [{"role": "user", "content": "Hi"}], None,
                                   ToolChoice("none"), {"max_tokens": 1}, thinking=thinking)
            async for _ in run.stream:
                pass
            return run.engine.tokenizer.decode(run.prompt_ids)

    assert "Reasoning: high\n" in srv.call(prompt(Thinking(effort="high")))
    assert "Reasoning: low\n" in srv.call(prompt(Thinking(enabled=True, budget_tokens=1024)))
    assert "Reasoning: medium\n" in srv.call(prompt(None))


def test_thinking_budget_ends_the_analysis(srv: BackgroundServer) -> None:
    """Anthropic's thinking budget on gpt-oss: the analysis message holds at most that many
    tokens (the row is given <|end|> there), and the final answer follows; without one the
    random model's analysis runs to max_tokens."""
    a_tools = [{"name": t["function"]["name"], "description": t["function"]["description"],
                "input_schema": t["function"]["parameters"]} for t in TOOLS]
    body: dict[str, Any] = dict(model="gpt-oss", max_tokens=32, temperature=0, tools=a_tools,
                                tool_choice={"type": "none"},
                                messages=[{"role": "user", "content": "Weather in Oslo?"}])
    url = srv.url + "/v1/messages"
    free = httpx.post(url, json=body, timeout=120).json()
    assert free.get("type") == "message", free
    assert [b["type"] for b in free["content"]] == ["thinking"], free
    m = httpx.post(url, json={**body, "thinking": {"type": "enabled", "budget_tokens": 5}},
                   timeout=120).json()
    assert [b["type"] for b in m["content"]] == ["thinking", "text"], m
    thought = m["content"][0]["thinking"]
    tok = srv.state.ready_engine().tokenizer
    assert 0 < len(tok.encode(thought, add_special=False)) <= 5
    assert free["content"][0]["thinking"].startswith(thought) and m["content"][1]["text"]
