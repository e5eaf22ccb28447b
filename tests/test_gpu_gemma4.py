"""Gemma 4 on the GPU (skipped where MLX has no GPU, e.g. CI): the tiny synthetic presets
(MLX 4-bit; per-layer inputs and shared K/V, then experts beside the MLP), served by the
engine in bfloat16. Their heads (64 sliding, 128 global) take slotserve's CUDA attention
kernels, each layer addressing the pool with its own head count, in plain and compiled
decode steps: batch and prefix-reuse invariance must hold there too."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import anyio
import mlx.core as mx
import pytest
from engine_harness import PROMPTS, EngineHarness
from engine_harness import alternating_options as options

from slotserve.model.layers import Backend, Batch
from slotserve.tools.synth import synth

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not mx.is_available(mx.gpu), reason="needs MLX with a GPU"),
]


@pytest.fixture(scope="module", params=["tiny-gemma4", "tiny-gemma4-moe"])
def harness(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Any:
    path = Path(tmp_path_factory.mktemp(request.param))
    synth(request.param, path, "mlx4")
    h = EngineHarness(path, device="gpu", max_slots=8, max_queue=32, prefill_budget=48)
    yield h
    h.close()


def ids(h: EngineHarness, i: int) -> list[int]:
    return h.engine.render_chat([{"role": "user", "content": PROMPTS[i]}])


def test_runs_on_gpu_kernels(harness: EngineHarness) -> None:
    loaded = harness.engine.loaded
    assert loaded is not None and loaded.device == "gpu" and loaded.config.family == "gemma4"
    assert {b.attn.backend for b in loaded.model.layers} == {Backend.CUDA}


def test_batch_and_prefix_invariance(harness: EngineHarness) -> None:
    engine = harness.engine
    solo = []
    for i in range(len(PROMPTS)):
        engine.drop_retained()
        solo.append(harness.call(lambda i=i: engine.complete(ids(harness, i), **options(i))))

    async def together() -> dict[int, Any]:
        out: dict[int, Any] = {}

        async def one(i: int, delay: float) -> None:
            await anyio.sleep(delay)
            out[i] = await engine.complete(ids(harness, i), **options(i))

        async with anyio.create_task_group() as tg:
            for i in range(len(PROMPTS)):
                tg.start_soon(one, i, 0.02 * (i % 3))
        return out

    engine.drop_retained()
    batched = harness.call(together)
    differ = [i for i, c in batched.items() if c.token_ids != solo[i].token_ids]
    assert not differ, f"prompts {differ} differ in a batch of {len(PROMPTS)}"
    for i in (0, 1):  # greedy, seeded: a continuation from retained pages equals it cold
        engine.drop_retained()
        first = harness.call(lambda i=i: engine.complete(ids(harness, i), **options(i)))
        convo = ids(harness, i) + first.token_ids + ids(harness, 5)
        warm = harness.call(lambda c=convo, i=i: engine.complete(c, **options(i)))
        engine.drop_retained()
        cold = harness.call(lambda c=convo, i=i: engine.complete(c, **options(i)))
        assert warm.usage.reused_tokens > 0 and cold.usage.reused_tokens == 0
        assert warm.token_ids == cold.token_ids, i


def test_model_rows_do_not_depend_on_batch_or_chunking(harness: EngineHarness) -> None:
    """The plain forward alone (no engine, no compiled steps): a prompt's last logits are
    the same prefilled whole or cut, and four sequences' rows in one step give each one's
    bits alone; past the sliding window (64) so both layer kinds read a window."""
    model = harness.engine.loaded.model
    prompt = [int(t) % 4000 + 10 for t in range(7, 7 + 150 * 13, 13)]

    def step(tokens: list[int], parts: list[Any], rows: list[int]) -> mx.array:
        """One forward, evaluated with its K/V writes: the CUDA kernels write the pool in
        place, which a later step's graph does not depend on (the engine evaluates each
        step's writes the same way, Batch.written)."""
        batch = Batch.build(parts)
        out = model(mx.array(tokens), batch, rows)
        mx.eval(out, batch.written())
        return out

    def logits(cuts: list[int]) -> mx.array:
        kv, start, out = model.new_kv(), 0, None
        for end in [*cuts, len(prompt)]:
            out = step(prompt[start:end], [(kv, start, end - start)], [end - start - 1])
            start = end
        return out[0]

    def run() -> tuple[list[bool], list[bool]]:  # on the MLX thread, which owns the arrays
        whole = logits([])
        split = [logits(c) for c in ([64], [32, 96, 128])]
        kvs = [model.new_kv() for _ in range(4)]
        for kv, n in zip(kvs[2:], (37, 130), strict=True):
            step(prompt[:n], [(kv, 0, n)], [n - 1])
        feeds = [(prompt[:64], 0), (prompt[:100], 0), ([9], 37), ([11], 130)]
        alone = [step(t, [(kv, s, len(t))], [len(t) - 1])[0]
                 for kv, (t, s) in zip(kvs, feeds, strict=True)]
        parts = [(kv, s, len(t)) for kv, (t, s) in zip(kvs, feeds, strict=True)]
        together = step([x for t, _ in feeds for x in t], parts, [63, 163, 164, 165])
        return ([bool(mx.array_equal(s, whole)) for s in split],
                [bool(mx.array_equal(together[i], alone[i])) for i in range(4)])

    chunked, batched = harness.call(lambda: harness.engine.mlx.run(run))
    assert all(chunked), chunked
    assert all(batched), batched
