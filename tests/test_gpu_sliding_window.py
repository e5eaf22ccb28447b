"""Sliding-window layers' window rows on the GPU (skipped where MLX has no GPU, e.g. CI):
the tiny Gemma 4 preset (MLX 4-bit, window 64) served in bfloat16 on the CUDA kernels, with
pipelined and compiled decode steps (the GPU's defaults: a speculated row never writes a
page without its window row; compiled steps take the window tables as inputs). A sequence
far longer than its window recycles its rows and gives the tokens and logprobs of one
whose rows all stay; a long conversation continued from retained rows, or a branch of it,
equals cold (tests/test_sliding_window_kv.py on the CPU)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest
from engine_harness import EngineHarness

from slotserve.actors.admission import pages_for
from slotserve.kernels.attention import BLOCK
from slotserve.tools.synth import synth

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not mx.is_available(mx.gpu), reason="needs MLX with a GPU"),
]

NEW = 32
GREEDY = {"temperature": 0.0, "max_tokens": NEW, "ignore_eos": True, "logprobs": True}
SEEDED = {**GREEDY, "temperature": 0.8, "seed": 5}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = Path(tmp_path_factory.mktemp("tiny-gemma4-window"))
    synth("tiny-gemma4", path, "mlx4")
    return path


def long_prompt(h: EngineHarness, words: int, topic: str) -> list[int]:
    text = " ".join(f"{topic} {i}" for i in range(words))
    return h.engine.render_chat([{"role": "user", "content": text}])


def run(h: EngineHarness, prompts: list[list[int]], opts: dict[str, Any]) -> list[Any]:
    return [h.call(lambda p=p: h.engine.complete(p, **opts)) for p in prompts]


def test_recycled_rows_give_the_bits_of_kept_ones(checkpoint: Path) -> None:
    roomy = EngineHarness(checkpoint, device="gpu", max_slots=2, prefill_budget=48)
    try:
        prompt = long_prompt(roomy, 400, "river")
        branch = prompt[: 4 * BLOCK + 30] + prompt[10:50]
        adm = roomy.engine.admission
        assert adm is not None and adm.cache.pool.window == 64
        pool = adm.cache.pool
        budget = (pages_for(len(prompt) + NEW) + adm.floor_pages + 1) * pool.page_bytes
        kept = run(roomy, [prompt, branch], GREEDY) + run(roomy, [prompt], SEEDED)
    finally:
        roomy.close()
    assert len(prompt) > 6 * BLOCK
    tight = EngineHarness(checkpoint, device="gpu", max_slots=2, prefill_budget=48,
                          kv_budget_bytes=budget)
    try:
        got = run(tight, [prompt, branch], GREEDY) + run(tight, [prompt], SEEDED)
        windows = tight.engine.admission.cache.pool.windows  # type: ignore[union-attr]
        assert windows.ids < pages_for(len(prompt)) // 2
    finally:
        tight.close()
    for a, b in zip(kept, got, strict=True):
        assert a.error is None and b.error is None
        assert a.token_ids == b.token_ids
        assert [lp.logprob for lp in a.logprobs] == [lp.logprob for lp in b.logprobs]


def test_long_conversation_continued_from_retained_rows_equals_cold(checkpoint: Path) -> None:
    h = EngineHarness(checkpoint, device="gpu", max_slots=2, prefill_budget=48)
    try:
        engine = h.engine
        turn1 = long_prompt(h, 250, "mountain")
        first = h.call(lambda: engine.complete(turn1, **GREEDY))
        turn2 = turn1 + first.token_ids + turn1[30:90]
        branch = turn1[: 3 * BLOCK + 17] + turn1[40:70]
        cases = (("turn2", turn2, GREEDY), ("branch", branch, SEEDED))
        warm = {name: h.call(lambda ids=ids, o=o: engine.complete(ids, **o))
                for name, ids, o in cases}
        assert warm["turn2"].usage.reused_tokens >= len(turn1)
        assert warm["branch"].usage.reused_tokens >= 3 * BLOCK
        for name, ids, o in cases:
            engine.drop_retained()
            cold = h.call(lambda ids=ids, o=o: engine.complete(ids, **o))
            assert cold.usage.reused_tokens == 0
            assert warm[name].token_ids == cold.token_ids, name
    finally:
        h.close()
