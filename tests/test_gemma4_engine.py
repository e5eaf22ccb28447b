"""Gemma 4 through the engine: batch and prefix-reuse invariance, determinism, isolation and
the KV budget's charge, on one tiny random checkpoint that has every Gemma 4 part at once
(sliding window 16, global layers with fewer, wider heads and k = v, the last two layers on
shared K/V, per-layer inputs, experts beside the dense MLP)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import anyio
import pytest
from converted import llama_cpp_tree
from engine_harness import PROMPTS as ALL_PROMPTS
from engine_harness import EngineHarness, alone, alternating_options, together

from slotserve.actors.admission import window_rows
from slotserve.kernels.attention import BLOCK
from slotserve.tools.synth import write_gemma4_tokenizer

PROMPTS = ALL_PROMPTS[:4]
S, F = "sliding_attention", "full_attention"


def options(i: int) -> dict[str, Any]:
    """The engine tests' options (greedy for even i, seeded for odd), 16 tokens."""
    return {**alternating_options(i), "max_tokens": 16}


def gemma4_template() -> str:
    """Google's Gemma 4 chat template, as llama.cpp's source tree keeps it."""
    return (llama_cpp_tree() / "models" / "templates" / "google-gemma-4-31B-it.jinja").read_text()


def make_tiny_gemma4(path: Path, seed: int = 0, template: str | None = None) -> Path:
    """A Gemma4ForCausalLM checkpoint of width 64 with SmolLM2's tokenizer plus Gemma 4's
    control tokens and Google's Gemma 4 chat template (or `template`)."""
    import torch
    import transformers

    path.mkdir(parents=True, exist_ok=True)
    vocab = write_gemma4_tokenizer(path, gemma4_template() if template is None else template)
    cfg = transformers.Gemma4TextConfig(
        vocab_size=vocab, vocab_size_per_layer_input=vocab, hidden_size=64,
        intermediate_size=96, num_hidden_layers=6, layer_types=[S, S, F] * 2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, global_head_dim=32,
        num_global_key_value_heads=1, attention_k_eq_v=True, sliding_window=16,
        num_kv_shared_layers=2, hidden_size_per_layer_input=8, enable_moe_block=True,
        num_experts=8, top_k_experts=2, moe_intermediate_size=32,
        max_position_embeddings=2048, rms_norm_eps=1e-6, final_logit_softcapping=30.0,
        tie_word_embeddings=True)
    model = transformers.Gemma4ForCausalLM(cfg)
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("scale"):
                p.copy_(1.0 + 0.3 * torch.randn_like(p))
            else:
                p.normal_(0.0, 0.08)
    model.to(torch.float32).save_pretrained(path, safe_serialization=True)
    return path


@pytest.fixture(scope="module")
def harness(tmp_path_factory: pytest.TempPathFactory) -> Any:
    path = make_tiny_gemma4(Path(tmp_path_factory.mktemp("gemma4")))
    h = EngineHarness(path, max_slots=3, max_queue=16, prefill_budget=24)
    yield h
    h.close()


def ids(harness: EngineHarness, i: int) -> list[int]:
    return harness.engine.render_chat([{"role": "user", "content": PROMPTS[i]}])


@pytest.fixture(scope="module")
def solo(harness: EngineHarness) -> list[Any]:
    return alone(harness, lambda i: ids(harness, i), len(PROMPTS), options)


def test_kv_budget_charges_only_layers_that_write_kv(harness: EngineHarness) -> None:
    """Three sliding layers of 2 x 16 and one global of 1 x 32 write K/V; the two shared
    layers read theirs: a page costs BLOCK positions of the global layer, K and V, f32; the
    sliding ones are a floor per busy slot, the window rows their window reaches."""
    engine = harness.engine
    assert engine.loaded is not None and engine.admission is not None
    assert engine.loaded.config.family == "gemma4"
    adm = engine.admission
    assert adm.page_bytes == BLOCK * 2 * 4 * (1 * 32)
    pool = adm.cache.pool
    assert pool.window_bytes == BLOCK * 2 * 4 * (3 * (2 * 16))
    rows = window_rows(16, engine.config.prefill_budget)
    assert adm.floor_pages == -(-rows * pool.window_bytes // adm.page_bytes)


def test_batch_and_prefix_invariance(harness: EngineHarness, solo: list[Any]) -> None:
    engine = harness.engine
    # 4 requests on 3 slots: some wait for a freed slot
    for i, c in together(harness, lambda i: ids(harness, i), len(PROMPTS),
                         lambda i: 0.05 * i, options=options).items():
        assert c.token_ids == solo[i].token_ids, f"prompt {i} differs in a batch"

    # prefix reuse: continue prompt 0's conversation from its retained pages, then cold
    convo = [{"role": "user", "content": PROMPTS[0]},
             {"role": "assistant", "content": solo[0].text},
             {"role": "user", "content": "Again."}]
    warm = harness.call(lambda: engine.complete(engine.render_chat(convo), **options(0)))
    assert warm.usage.reused_tokens > 20
    engine.drop_retained()
    cold = harness.call(lambda: engine.complete(engine.render_chat(convo), **options(0)))
    assert cold.usage.reused_tokens == 0
    assert warm.token_ids == cold.token_ids


def test_determinism(harness: EngineHarness, solo: list[Any]) -> None:
    engine = harness.engine
    engine.drop_retained()
    again = harness.call(lambda: engine.complete(ids(harness, 1), **options(1)))
    assert again.token_ids == solo[1].token_ids and again.text == solo[1].text


def test_isolation_from_a_cancelled_peer(harness: EngineHarness, solo: list[Any]) -> None:
    """Request 0 keeps its tokens while a peer beside it is cancelled mid-stream."""
    engine = harness.engine

    async def scenario() -> Any:
        result: dict[str, Any] = {}

        async def victim() -> None:
            result["c"] = await engine.complete(ids(harness, 0), **options(0))

        async def cancelled_peer() -> None:
            with anyio.move_on_after(0.3):
                async for _ in engine.chat([{"role": "user", "content": ALL_PROMPTS[6]}],
                                           max_tokens=200, ignore_eos=True):
                    pass

        async with anyio.create_task_group() as tg:
            tg.start_soon(victim)
            tg.start_soon(cancelled_peer)
        return result["c"]

    engine.drop_retained()
    assert harness.call(scenario).token_ids == solo[0].token_ids
