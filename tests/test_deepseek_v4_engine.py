"""A tiny DeepSeek-V4 served by the engine: batch invariance (prefill chunks beside decode
rows of other slots), determinism, isolation from a cancelled peer, the per-slot state's
budget floor beside pages that hold compressed entries only, and prefix reuse through the
one prefix cache with state snapshots: a continuation resumed from a page-boundary
snapshot, and a follow-up turn resumed from the previous turn's last state (past its
generated tokens), each give the tokens of the same prompt prefilled cold; a preempted
request resumes with the tokens it gives alone.

prefill_budget 22 cuts the prompts into many chunks at positions that are no multiple of
either compress rate (4 and 16), so windows close across chunk boundaries.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import anyio
import pytest
from engine_harness import PROMPTS as ALL_PROMPTS
from engine_harness import EngineHarness, alone, preempted_like_alone, together, wait_until
from engine_harness import alternating_options as options

from slotserve.kernels.attention import BLOCK
from slotserve.model.families import deepseek_v4
from slotserve.tools.synth import write_smollm2_tokenizer

PROMPTS = ALL_PROMPTS[:5]
# ~360 tokens: a history long enough for a snapshot at 256
LONG = " ".join(f"Line {i}: the river runs past stone {i * 7 % 13} and tree {i % 5}."
                for i in range(26))


def make_tiny_deepseek_v4(path: Path, seed: int = 0) -> Path:
    import transformers
    from test_deepseek_v4 import CONFIG, randomize

    path.mkdir(parents=True, exist_ok=True)
    vocab = write_smollm2_tokenizer(path)
    cfg = transformers.DeepseekV4Config(**{**CONFIG, "vocab_size": vocab,
                                           "tie_word_embeddings": True})
    randomize(transformers.DeepseekV4ForCausalLM(cfg), seed).save_pretrained(
        path, safe_serialization=True)
    return path


@pytest.fixture(scope="module")
def harness(tmp_path_factory: pytest.TempPathFactory) -> Any:
    path = make_tiny_deepseek_v4(Path(tmp_path_factory.mktemp("deepseek_v4_engine")))
    h = EngineHarness(path, max_slots=4, max_queue=16, prefill_budget=22)
    yield h
    h.close()


def _ids(engine: Any, text: str) -> list[int]:
    return engine.render_chat([{"role": "user", "content": text}])


def test_batch_invariance_and_determinism(harness: EngineHarness) -> None:
    engine = harness.engine

    def ids(i: int) -> list[int]:
        return _ids(engine, PROMPTS[i])

    solo = alone(harness, ids, len(PROMPTS))
    # 7 requests on 4 slots; 0 and 1 twice
    batched = together(harness, ids, len(PROMPTS), lambda i: 0.05 * i, len(PROMPTS) + 2)
    for i, c in batched.items():
        assert c.token_ids == solo[i % len(PROMPTS)].token_ids, f"request {i} differs"


def test_a_cancelled_peer_changes_nothing(harness: EngineHarness) -> None:
    engine = harness.engine
    engine.drop_retained()
    want = harness.call(lambda: engine.complete(_ids(engine, PROMPTS[0]), **options(0)))

    async def with_peer() -> Any:
        async with anyio.create_task_group() as tg:
            async def peer() -> None:
                stream = engine.chat([{"role": "user", "content": LONG}], max_tokens=64,
                                     ignore_eos=True)
                async for _ in stream:  # leave after a few tokens: cancelled mid-flight
                    break

            tg.start_soon(peer)
            got = await engine.complete(_ids(engine, PROMPTS[0]), **options(0))
        return got

    engine.drop_retained()
    assert harness.call(with_peer).token_ids == want.token_ids


def test_pages_hold_compressed_entries_and_the_state_is_a_floor(
        harness: EngineHarness) -> None:
    engine = harness.engine
    adm = engine.admission
    kv = engine.slots[0].kv
    assert isinstance(kv, deepseek_v4.CompressedKV)
    # a page: 32 CSA entries of (kv 32 + indexer key 16) in each of two CSA layers, and 8
    # HCA entries of 32; the sliding-only layer has none; 4-byte floats
    assert adm.page_bytes == (2 * 32 * 48 + 8 * 32) * 4
    uncompressed = 4 * BLOCK * 32 * 4  # 4 layers of one K=V head of 32 per position
    assert adm.page_bytes < uncompressed / 2
    assert adm.floor_pages == -(-kv.state_bytes // adm.page_bytes) > 0
    harness.call(lambda: engine.complete(_ids(engine, PROMPTS[2]), max_tokens=4))
    assert wait_until(lambda: not any(s.busy for s in engine.slots), 60)
    assert adm.committed_pages == 0  # no floor left behind, no page held
    assert all(not any(v) for s in engine.slots for v in s.kv.recurrent.versions)


def test_continuation_from_a_snapshot_equals_cold(harness: EngineHarness) -> None:
    engine = harness.engine
    engine.drop_retained()
    first = [{"role": "user", "content": LONG}]
    n1 = len(engine.render_chat(first))
    assert n1 > 2 * BLOCK
    harness.call(lambda: engine.complete(engine.render_chat(first)[: 2 * BLOCK + 5],
                                         max_tokens=1, temperature=0.0))
    prompt = engine.render_chat(first)
    warm = harness.call(lambda: engine.complete(prompt, max_tokens=16, temperature=0.0,
                                                ignore_eos=True))
    assert warm.usage.reused_tokens >= 2 * BLOCK  # from a snapshot at a page boundary
    engine.drop_retained()
    cold = harness.call(lambda: engine.complete(prompt, max_tokens=16, temperature=0.0,
                                                ignore_eos=True))
    assert cold.usage.reused_tokens == 0
    assert warm.token_ids == cold.token_ids


def test_a_follow_up_resumes_past_the_generated_tokens(harness: EngineHarness) -> None:
    """Every state is canonical, so a finished turn's last state (with its tail page) is
    where the next turn resumes: past the tokens it generated, no settle pass needed."""
    engine = harness.engine
    engine.drop_retained()
    prompt = _ids(engine, PROMPTS[2])
    turn1 = harness.call(lambda: engine.complete(prompt, max_tokens=40, temperature=0.0,
                                                 ignore_eos=True))
    follow = prompt + turn1.token_ids + _ids(engine, "And the stones?")
    warm = harness.call(lambda: engine.complete(follow, max_tokens=16, temperature=0.0,
                                                ignore_eos=True))
    assert warm.usage.reused_tokens == len(prompt) + len(turn1.token_ids) - 1
    engine.drop_retained()
    cold = harness.call(lambda: engine.complete(follow, max_tokens=16, temperature=0.0,
                                                ignore_eos=True))
    assert cold.usage.reused_tokens == 0
    assert warm.token_ids == cold.token_ids


def test_a_preempted_request_resumes_with_its_own_tokens(
        tmp_path_factory: pytest.TempPathFactory) -> None:
    """Three requests that each cross into a second page on a budget that holds only one
    more page: the youngest steps back, resumes from its cached prefix (every state is
    canonical: its decoded positions recompute to the same bits) and finishes with exactly
    the tokens it produces alone."""
    path = make_tiny_deepseek_v4(Path(tmp_path_factory.mktemp("deepseek_v4_preempt")))
    h = EngineHarness(path, max_slots=3, max_queue=8, prefill_budget=22, kv_reserve_tokens=0)
    try:
        engine = h.engine
        adm = engine.admission
        words = LONG.split()
        prompts = []
        for i in range(3):  # just under a page each, different from the first token on
            ids = _ids(engine, f"{i} " + " ".join(words[i * 5:]))
            prompts.append(ids[: BLOCK - 12 - i])
        # answers long enough that all three still run when the later ones cross (the
        # prompts prefill one after another, each answer starting as its prompt is in)
        opts = [{**options(i), "max_tokens": 48} for i in range(3)]
        alone = []
        for p, o in zip(prompts, opts, strict=True):
            engine.drop_retained()
            alone.append(h.call(lambda p=p, o=o: engine.complete(p, **o)))
        engine.drop_retained()
        adm.budget_pages = 3 * adm.floor_pages + 4

        preempted_like_alone(h, lambda i: engine.complete(prompts[i], **opts[i]), alone)
    finally:
        h.close()
