"""A hybrid Gated DeltaNet model (tiny qwen3_5) served by the engine: batch invariance,
determinism, isolation from a cancelled peer, the recurrent state's budget floor, and
prefix reuse through state snapshots (a continuation from a snapshot gives the tokens of
the same prompt prefilled cold).

prefill_budget 24 is below the DeltaNet's sub-chunk (32): the Batcher then cuts every
prefill chunk at the next multiple of 32, so the prompts below run many aligned chunks
beside each other's decode rows.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import anyio
import pytest
from engine_harness import PROMPTS as ALL_PROMPTS
from engine_harness import EngineHarness, alone, together, wait_until
from engine_harness import alternating_options as options

from slotserve.kernels.attention import BLOCK
from slotserve.model import deltanet
from slotserve.tools.synth import write_smollm2_tokenizer

PROMPTS = ALL_PROMPTS[:5]


def _lines(n: int) -> str:
    return " ".join(f"Line {i}: the river runs past stone {i * 7 % 13} and tree {i % 5}."
                    for i in range(n))


LONG = _lines(26)  # ~360 tokens: a history long enough for a snapshot at 256


def make_tiny_qwen3_5(path: Path, seed: int = 0) -> Path:
    import torch
    import transformers

    path.mkdir(parents=True, exist_ok=True)
    vocab = write_smollm2_tokenizer(path)
    cfg = transformers.Qwen3_5TextConfig(
        vocab_size=vocab, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, linear_num_key_heads=2,
        linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
        max_position_embeddings=4096, rms_norm_eps=1e-6, tie_word_embeddings=True)
    model = transformers.Qwen3_5ForCausalLM(cfg)
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("A_log") or name.endswith("dt_bias"):
                continue
            p.normal_(0.0, 0.3 if "norm" in name else 0.08)
    model.to(torch.float32).save_pretrained(path, safe_serialization=True)
    return path


@pytest.fixture(scope="module")
def harness(tmp_path_factory: pytest.TempPathFactory) -> Any:
    path = make_tiny_qwen3_5(Path(tmp_path_factory.mktemp("qwen3_5_engine")))
    h = EngineHarness(path, max_slots=4, max_queue=16, prefill_budget=24)
    yield h
    h.close()


def _ids(engine: Any, text: str) -> list[int]:
    return engine.render_chat([{"role": "user", "content": text}])


def test_batch_invariance(harness: EngineHarness) -> None:
    engine = harness.engine

    def ids(i: int) -> list[int]:
        return _ids(engine, PROMPTS[i])

    solo = alone(harness, ids, len(PROMPTS))
    # 5 requests on 4 slots: one waits for a slot
    batched = together(harness, ids, len(PROMPTS), lambda i: 0.05 * i)
    for i, c in batched.items():
        assert c.token_ids == solo[i].token_ids, f"prompt {i} differs in a batch"


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


def test_state_floor_is_charged_per_busy_slot_and_released(harness: EngineHarness) -> None:
    engine = harness.engine
    adm = engine.admission
    kv = engine.slots[0].kv
    assert isinstance(kv, deltanet.HybridKV)
    assert adm.floor_pages == -(-kv.state_bytes // adm.page_bytes) > 0
    assert adm.page_bytes == BLOCK * kv.pool.bytes_per_position  # attention layers alone
    harness.call(lambda: engine.complete(_ids(engine, PROMPTS[2]), max_tokens=4))
    assert wait_until(lambda: not any(s.busy for s in engine.slots), 60)
    assert adm.committed_pages == 0  # no floor left behind, no page held
    assert all(not any(v) for s in engine.slots for v in s.kv.recurrent.versions)


def test_continuation_from_a_snapshot_equals_cold(harness: EngineHarness) -> None:
    engine = harness.engine
    engine.drop_retained()
    first = [{"role": "user", "content": LONG}]
    turn1 = harness.call(lambda: engine.complete(engine.render_chat(first), max_tokens=8,
                                                 temperature=0.0, ignore_eos=True))
    convo = [*first, {"role": "assistant", "content": turn1.text},
             {"role": "user", "content": "And the stones?"}]
    prompt = engine.render_chat(convo)
    warm = harness.call(lambda: engine.complete(prompt, max_tokens=16, temperature=0.0,
                                                ignore_eos=True))
    n1 = len(engine.render_chat(first))
    # resumed where turn 1's chunked prefill stopped (its last whole sub-chunk), from the
    # state turn 1 left with its last page
    assert warm.usage.reused_tokens == (n1 // deltanet.CHUNK) * deltanet.CHUNK > 2 * BLOCK
    engine.drop_retained()
    cold = harness.call(lambda: engine.complete(prompt, max_tokens=16, temperature=0.0,
                                                ignore_eos=True))
    assert cold.usage.reused_tokens == 0
    assert warm.token_ids == cold.token_ids


def _settled(engine: Any) -> bool:
    """No request runs and no settle pass waits (slotserve.actors.settle)."""
    adm = engine.admission
    return not any(s.busy for s in engine.slots) and not adm.settles


def test_a_follow_up_resumes_past_the_previous_turns_generated_tokens(
        harness: EngineHarness) -> None:
    """A finished turn's generated tokens get a settle pass (prefilled again, off the
    critical path): the follow-up resumes past them, at the ledger's last whole sub-chunk,
    and gives the tokens of the same prompt prefilled cold; a repeat of the first prompt
    still resumes where its own prefill stopped."""
    engine = harness.engine
    adm = engine.admission
    engine.drop_retained()
    prompt = _ids(engine, LONG)
    n = len(prompt)
    done = adm.settles.done
    turn1 = harness.call(lambda: engine.complete(prompt, max_tokens=40, temperature=0.0,
                                                 ignore_eos=True))
    assert wait_until(lambda: _settled(engine), 120)
    assert adm.settles.done == done + 1
    settled = (n + 39) // deltanet.CHUNK * deltanet.CHUNK  # the ledger: prompt + 39 fed
    assert settled >= n // deltanet.CHUNK * deltanet.CHUNK + deltanet.CHUNK
    again = harness.call(lambda: engine.complete(prompt, max_tokens=2, temperature=0.0))
    assert again.usage.reused_tokens == n // deltanet.CHUNK * deltanet.CHUNK
    follow = prompt + turn1.token_ids + _ids(engine, "And the stones?")
    warm = harness.call(lambda: engine.complete(follow, max_tokens=16, temperature=0.0,
                                                ignore_eos=True))
    assert warm.usage.reused_tokens == settled
    assert wait_until(lambda: _settled(engine), 120)
    engine.drop_retained()
    cold = harness.call(lambda: engine.complete(follow, max_tokens=16, temperature=0.0,
                                                ignore_eos=True))
    assert cold.usage.reused_tokens == 0
    assert warm.token_ids == cold.token_ids


def check_preempted_resume(h: EngineHarness, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two requests that cross into a second page on a budget that holds only one more
    page: the younger (longer prompt) crosses first and takes it, the older one then needs
    one, so the younger steps back mid-decode, resumes (its decoded positions recomputed in
    the recurrent form, as its decode steps ran them) and finishes with exactly the tokens
    and logprobs it produces alone. (The GPU twin, tests/test_gpu_hybrid.py, runs this too.)

    Nothing here depends on the machine's speed: both requests are submitted in one turn of
    the event loop (arrival order 0, 1; the engine places both before its first step) and
    each step decodes one token a row, so which one crosses first is fixed by the lengths:
    the younger needs BLOCK - len(prompt 1) decoded tokens, 10+ fewer than the older, more
    than the steps its longer prefill takes. Admission's suspend is watched, so the test
    fails unless exactly the younger stepped back, with tokens decoded and tokens left."""
    engine = h.engine
    adm = engine.admission
    prompts = [_ids(engine, _lines(4)), _ids(engine, _lines(5))]
    assert BLOCK - 48 < len(prompts[0]) < len(prompts[1]) - 10 < BLOCK - 20, \
        [len(p) for p in prompts]
    # (logprobs: the logits' bits, which a token can hide, must match too)
    opts = [{**options(1), "max_tokens": BLOCK + 12 - len(prompts[0]),  # seeded
             "logprobs": True},
            {**options(0), "max_tokens": BLOCK + 40 - len(prompts[1]),  # greedy
             "logprobs": True}]
    alone = []
    for p, o in zip(prompts, opts, strict=True):
        engine.drop_retained()
        alone.append(h.call(lambda p=p, o=o: engine.complete(p, **o)))
    assert wait_until(lambda: _settled(engine), 120)
    engine.drop_retained()
    adm.budget_pages = 2 * adm.floor_pages + 3
    stepped_back: list[tuple[int, int]] = []  # (request, tokens it had generated)
    suspend = adm.suspend

    def watched(slot: Any, request: Any, progress: Any, *rest: Any) -> None:
        if not request.background:
            stepped_back.append((prompts.index(request.prompt_ids), progress.generated))
        suspend(slot, request, progress, *rest)

    monkeypatch.setattr(adm, "suspend", watched)

    async def both_at_once() -> list[Any]:
        out: list[Any] = [None] * len(prompts)

        async def one(i: int) -> None:
            out[i] = await engine.complete(prompts[i], **opts[i])

        async with anyio.create_task_group() as tg:
            for i in range(len(prompts)):  # one loop turn, no clock between: 0 is older
                tg.start_soon(one, i)
        return out

    both = h.call(both_at_once)
    assert len(stepped_back) == 1 and stepped_back[0][0] == 1, \
        f"want the younger request to step back once, got (request, generated) {stepped_back}"
    assert 0 < stepped_back[0][1] < opts[1]["max_tokens"], stepped_back
    for i, (a, b) in enumerate(zip(alone, both, strict=True)):
        assert b.finish_reason == "length", (i, b.error)
        assert b.token_ids == a.token_ids, f"request {i} changed under preemption"
        assert [lp.logprob for lp in b.logprobs] == [lp.logprob for lp in a.logprobs]


def test_a_preempted_request_resumes_with_its_own_tokens(
        tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    path = make_tiny_qwen3_5(Path(tmp_path_factory.mktemp("qwen3_5_preempt")))
    h = EngineHarness(path, max_slots=2, max_queue=8, prefill_budget=24, kv_reserve_tokens=0)
    try:
        check_preempted_resume(h, monkeypatch)
    finally:
        h.close()
