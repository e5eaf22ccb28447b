"""Batch and prefix-reuse invariance on the GPU (skipped where MLX has no GPU, e.g. CI).

Tiny synthetic checkpoints (`slotserve.tools.synth`, MLX 4-bit) of a dense and an MoE
shape, served by the real engine on the GPU: quantized weights stay quantized and
compute runs in bfloat16, so this is the GPU's own kernels under the standing rules.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import anyio
import mlx.core as mx
import pytest
from engine_harness import PROMPTS, EngineHarness
from engine_harness import alternating_options as options

from slotserve.kernels.attention import BLOCK
from slotserve.tools.synth import synth

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not mx.is_available(mx.gpu), reason="needs MLX with a GPU"),
]



# (checkpoint, prefill budget): 2,048-token prefill steps run the 4-bit matmul's wide
# launches (kernels.cuda.launch.q4_gemm: gate+up from 12 row blocks of 128), 48-token ones
# never do
@pytest.fixture(scope="module", params=[("tiny-llama", 48), ("tiny-moe", 48),
                                        ("tiny-llama", 2048)],
                ids=["tiny-llama", "tiny-moe", "tiny-llama-wide-prefill"])
def harness(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Any:
    preset, budget = request.param
    path = Path(tmp_path_factory.mktemp(preset))
    synth(preset, path, "mlx4")
    h = EngineHarness(path, device="gpu", max_slots=8, max_queue=32, prefill_budget=budget)
    yield h
    h.close()


def ids(h: EngineHarness, i: int) -> list[int]:
    return h.engine.render_chat([{"role": "user", "content": PROMPTS[i]}])


def test_runs_on_gpu(harness: EngineHarness) -> None:
    loaded = harness.engine.loaded
    assert loaded is not None and loaded.device == "gpu"
    assert loaded.model.dtype == mx.bfloat16


def test_batch_invariance(harness: EngineHarness) -> None:
    """Each request alone and cold, then all 8 together with staggered arrivals."""
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


def test_prefix_reuse_invariance(harness: EngineHarness) -> None:
    engine = harness.engine
    for i in (0, 1):  # greedy, seeded
        engine.drop_retained()
        first = harness.call(lambda i=i: engine.complete(ids(harness, i), **options(i)))
        convo = ids(harness, i) + first.token_ids + ids(harness, 5)
        warm = harness.call(lambda c=convo, i=i: engine.complete(c, **options(i)))
        assert warm.usage.reused_tokens > 0, "the continuation should reuse the retained prefix"
        engine.drop_retained()
        cold = harness.call(lambda c=convo, i=i: engine.complete(c, **options(i)))
        assert cold.usage.reused_tokens == 0
        assert warm.token_ids == cold.token_ids


def test_a_new_chat_shares_a_held_prefix(harness: EngineHarness) -> None:
    """A new chat whose system prompt another conversation holds starts from that
    conversation's KV pages (shared; written by the CUDA kernels) and gives cold's tokens."""
    engine = harness.engine
    system = " ".join(PROMPTS) * 4  # several KV pages

    def chat(i: int) -> list[int]:
        return engine.render_chat([{"role": "system", "content": system},
                                   {"role": "user", "content": PROMPTS[i]}])

    assert len(chat(2)) > 2 * BLOCK
    engine.drop_retained()
    harness.call(lambda: engine.complete(chat(0), **options(0)))
    warm = harness.call(lambda: engine.complete(chat(2), **options(2)))
    assert warm.usage.reused_tokens >= 2 * BLOCK, warm.usage
    engine.drop_retained()
    cold = harness.call(lambda: engine.complete(chat(2), **options(2)))
    assert cold.usage.reused_tokens == 0
    assert warm.token_ids == cold.token_ids


def test_decode_steps_run_compiled_and_give_the_plain_forwards_bits(harness: EngineHarness) -> None:
    """The engine's decode steps above went through runtime.compiled, and compiled steps
    give the plain forward's bits: the logits and the K/V they write, three steps on."""
    engine = harness.engine
    assert engine.batcher is not None and engine.loaded is not None and engine.mlx is not None
    compiled = engine.batcher.runner.compiled
    if compiled is None:  # the engine's start-up check (CompiledDecode.same_bits) said no
        assert engine.loaded.config.family != "llama", "llama's compiled steps should match"
        pytest.skip("compiled steps round differently for this family here (MLX's fused "
                    "elementwise kernels): the engine runs its decode steps plain")
    assert compiled.traced > 0
    engine.drop_retained()
    assert engine.mlx.call(lambda: compiled.same_bits(rows=3, steps=3))


def test_long_contexts_keep_their_bits(harness: EngineHarness) -> None:
    """Contexts past one attention split (kernels.cuda.launch.SPLIT_BLOCKS key blocks): the
    same tokens alone, batched with each other, and resumed from a cached prefix, so the
    split rows' combine does not depend on the batch or on prefill against decode."""
    engine = harness.engine
    vocab = engine.tokenizer.vocab_size
    prompts = [[(7 * i + 13 * j) % (vocab - 200) + 100 for j in range(n)]
               for i, n in enumerate((2500, 3100))]
    opts = [options(0), options(1)]
    alone = []
    for p, o in zip(prompts, opts, strict=True):
        engine.drop_retained()
        alone.append(harness.call(lambda p=p, o=o: engine.complete(p, **o)).token_ids)

    async def together() -> list[Any]:
        out: list[Any] = [None, None]

        async def one(i: int) -> None:
            out[i] = await engine.complete(prompts[i], **opts[i])

        async with anyio.create_task_group() as tg:
            for i in range(2):
                tg.start_soon(one, i)
        return out

    engine.drop_retained()
    assert [c.token_ids for c in harness.call(together)] == alone
    engine.drop_retained()
    harness.call(lambda: engine.complete(prompts[1][:2200], **opts[1]))  # its prefix cached
    warm = harness.call(lambda: engine.complete(prompts[1], **opts[1]))
    assert warm.usage.reused_tokens >= 2048 and warm.token_ids == alone[1]


def test_prefill_attention_forms_give_the_same_tokens(harness: EngineHarness) -> None:
    """A long prompt's prefill steps with the attention splits folded in a block a tile and
    in a block a split (ModelRunner.attention_merge pinned each way, then the launch rule):
    the same tokens, and the same again resumed from its cached prefix (decode steps take
    the split form)."""
    engine = harness.engine
    runner = engine.batcher.runner
    vocab = engine.tokenizer.vocab_size
    prompt = [(11 * j + 5) % (vocab - 200) + 100 for j in range(2300)]
    got = []
    try:
        for merge in (True, False, None):
            runner.attention_merge = merge
            engine.drop_retained()
            got.append(harness.call(lambda: engine.complete(prompt, **options(0))).token_ids)
    finally:
        runner.attention_merge = None
    assert got[0] == got[1] == got[2]
    runner.attention_merge = True
    try:
        warm = harness.call(lambda: engine.complete(prompt + got[0][:5], **options(0)))
    finally:
        runner.attention_merge = None
    assert warm.usage.reused_tokens >= 2048
    assert warm.token_ids[: len(got[0]) - 5] == got[0][5:]
