"""The Gated DeltaNet hybrid (tiny synthetic Qwen3.5-MoE, MLX 4-bit) on the GPU: bfloat16
compute, the DeltaNet's plain MLX ops on the device, under the standing rules (skipped
where MLX has no GPU, e.g. CI): a row's bits do not depend on its batch or on how its
prompt was chunked at aligned positions, a continuation from a state snapshot (also one a
settle pass left past the previous turn's reply) gives the tokens of the same prompt
prefilled cold, and a preempted request resumes with its own tokens and logprobs.

    python -m pytest -q -m gpu tests/test_gpu_hybrid.py
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest
from engine_harness import PROMPTS, EngineHarness, alone, together, wait_until
from model_rows import rows_invariance
from test_hybrid_engine import LONG, _settled, check_preempted_resume

from slotserve.kernels.attention import BLOCK
from slotserve.model import deltanet
from slotserve.tools.synth import synth

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not mx.is_available(mx.gpu), reason="needs MLX with a GPU"),
]


@pytest.fixture(scope="module")
def harness(tmp_path_factory: pytest.TempPathFactory) -> Any:
    path = Path(tmp_path_factory.mktemp("tiny-qwen3.5-moe"))
    synth("tiny-qwen3.5-moe", path, "mlx4")
    h = EngineHarness(path, device="gpu", max_slots=8, max_queue=32, prefill_budget=48)
    yield h
    h.close()


def test_runs_on_gpu(harness: EngineHarness) -> None:
    loaded = harness.engine.loaded
    assert loaded is not None and loaded.device == "gpu"
    assert loaded.config.family == "qwen3_5_moe" and loaded.model.dtype == mx.bfloat16


def test_model_rows_do_not_depend_on_batch_or_chunking(harness: EngineHarness) -> None:
    model = harness.engine.loaded.model
    chunked, batched = harness.call(
        lambda: harness.engine.mlx.run(lambda: rows_invariance(model)))
    assert all(chunked), chunked
    assert all(batched), batched


def test_batch_invariance(harness: EngineHarness) -> None:
    engine = harness.engine

    def ids(i: int) -> list[int]:
        return engine.render_chat([{"role": "user", "content": PROMPTS[i]}])

    solo = alone(harness, ids, len(PROMPTS))
    for i, c in together(harness, ids, len(PROMPTS), lambda i: 0.02 * i).items():
        assert c.token_ids == solo[i].token_ids, f"prompt {i} differs in a batch"


def test_continuation_from_a_snapshot_equals_cold(harness: EngineHarness) -> None:
    engine = harness.engine
    engine.drop_retained()
    first = [{"role": "user", "content": LONG}]
    turn1 = harness.call(lambda: engine.complete(engine.render_chat(first), max_tokens=8,
                                                 temperature=0.0, ignore_eos=True))
    prompt = engine.render_chat([*first, {"role": "assistant", "content": turn1.text},
                                 {"role": "user", "content": "And the stones?"}])
    warm = harness.call(lambda: engine.complete(prompt, max_tokens=16, temperature=0.0,
                                                ignore_eos=True))
    assert warm.usage.reused_tokens >= 2 * BLOCK
    engine.drop_retained()
    cold = harness.call(lambda: engine.complete(prompt, max_tokens=16, temperature=0.0,
                                                ignore_eos=True))
    assert cold.usage.reused_tokens == 0 and warm.token_ids == cold.token_ids


def test_a_settled_follow_up_equals_cold(harness: EngineHarness) -> None:
    """The previous turn's generated tokens settled (prefilled again after it finished):
    the follow-up resumes past them and gives the tokens of the same prompt cold."""
    engine = harness.engine
    engine.drop_retained()
    prompt = engine.render_chat([{"role": "user", "content": LONG}])
    turn1 = harness.call(lambda: engine.complete(prompt, max_tokens=40, temperature=0.0,
                                                 ignore_eos=True))
    assert wait_until(lambda: _settled(engine), 120)
    follow = prompt + turn1.token_ids + engine.render_chat(
        [{"role": "user", "content": "And the stones?"}])
    warm = harness.call(lambda: engine.complete(follow, max_tokens=16, temperature=0.0,
                                                ignore_eos=True))
    assert warm.usage.reused_tokens == (len(prompt) + 39) // deltanet.CHUNK * deltanet.CHUNK
    assert wait_until(lambda: _settled(engine), 120)
    engine.drop_retained()
    cold = harness.call(lambda: engine.complete(follow, max_tokens=16, temperature=0.0,
                                                ignore_eos=True))
    assert cold.usage.reused_tokens == 0 and warm.token_ids == cold.token_ids


def test_a_preempted_request_resumes_with_its_own_tokens(
        tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    """tests/test_hybrid_engine.py's preemption case on the GPU (its check_preempted_resume,
    one body for both): the younger request steps back mid-decode for a page and resumes
    with the tokens and logprobs it gives alone; which request crosses into its second page
    first is fixed by the prompts' lengths, not by the device's speed."""
    path = Path(tmp_path_factory.mktemp("tiny-qwen3.5-moe-preempt"))
    synth("tiny-qwen3.5-moe", path, "mlx4")
    h = EngineHarness(path, device="gpu", max_slots=2, max_queue=8, prefill_budget=48,
                      kv_reserve_tokens=0)
    try:
        check_preempted_resume(h, monkeypatch)
    finally:
        h.close()
