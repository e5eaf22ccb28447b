"""Batch and prefix-reuse invariance through the engine for qwen3_moe and gemma3.

Tiny random checkpoints: the MoE routes rows to different experts inside one
fused step, and gemma3's sliding-window layers (window 16) bite on these prompts.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import anyio
import pytest
from engine_harness import PROMPTS as ALL_PROMPTS
from engine_harness import EngineHarness
from engine_harness import alternating_options as options
from tiny_models import make_tiny

PROMPTS = ALL_PROMPTS[:6]


@pytest.fixture(scope="module", params=["qwen3_moe", "gemma3"])
def harness(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Any:
    path = make_tiny(request.param, Path(tmp_path_factory.mktemp(request.param)))
    h = EngineHarness(path, max_slots=4, max_queue=16, prefill_budget=24)
    yield h
    h.close()


def test_batch_and_prefix_invariance(harness: EngineHarness) -> None:
    engine = harness.engine

    def ids(i: int) -> list[int]:
        return engine.render_chat([{"role": "user", "content": PROMPTS[i]}])

    solo = []
    for i in range(len(PROMPTS)):
        engine.drop_retained()
        solo.append(harness.call(lambda i=i: engine.complete(ids(i), **options(i))))

    async def together() -> dict[int, Any]:
        out: dict[int, Any] = {}

        async def one(i: int, delay: float) -> None:
            await anyio.sleep(delay)
            out[i] = await engine.complete(ids(i), **options(i))

        async with anyio.create_task_group() as tg:
            for i in range(len(PROMPTS)):  # 6 requests on 4 slots: some wait for a freed slot
                tg.start_soon(one, i, 0.05 * i)
        return out

    engine.drop_retained()
    batched = harness.call(together)
    for i, c in batched.items():
        assert c.token_ids == solo[i].token_ids, f"prompt {i} differs in a batch"

    # prefix reuse: continue prompt 0's conversation from its retained slot, then cold
    convo = [{"role": "user", "content": PROMPTS[0]},
             {"role": "assistant", "content": solo[0].text},
             {"role": "user", "content": "Again."}]
    warm = harness.call(lambda: engine.complete(engine.render_chat(convo), **options(0)))
    engine.drop_retained()
    cold = harness.call(lambda: engine.complete(engine.render_chat(convo), **options(0)))
    assert cold.usage.reused_tokens == 0
    assert warm.token_ids == cold.token_ids
