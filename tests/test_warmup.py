"""The start-up warm-up (runtime.warmup) on the real SmolLM2: it runs every kind of step,
gives its pages back, and leaves nothing that changes the next request's tokens."""

from __future__ import annotations

from typing import Any

import pytest

from slotserve.kernels.attention import BLOCK
from slotserve.kernels.cuda.launch import SPLIT_BLOCKS
from slotserve.runtime.runner import ModelRunner, RowWork
from slotserve.runtime.sampling import RowState, SamplingParams
from slotserve.runtime.warmup import (
    CONTINUATION,
    DECODE_ROWS,
    DECODE_STEPS,
    LONG_PROMPT,
    _run,
    warm_up,
)


@pytest.fixture(scope="module")
def model() -> Any:
    from slotserve.model.loader import load

    return load(None, device="cpu", with_tokenizer=False, probe_rows=None).model


def _tokens(runner: ModelRunner, model: Any) -> list[int]:
    """A seeded top_p request's first six tokens (prefill, then decode steps)."""
    p = SamplingParams(temperature=0.8, top_p=0.9, seed=5)
    prompt = [1, 5, 9, 200, 31, 77, 4]
    kv, state = model.new_kv(), RowState(p, prompt)
    feed, start, out = prompt, 0, []
    try:
        for _ in range(6):
            res = runner.step([RowWork(0, kv, start, feed, True, p, state,
                                       state.num_generated)])
            token = res.sampled[0].token
            state.observe(token)
            start += len(feed)
            feed = [token]
            out.append(token)
    finally:
        kv.release()
    return out


def test_warm_up_leaves_nothing_behind(model: Any) -> None:
    """Pipelined, as on a GPU: the device sampler, and a speculation it must drop."""
    before = _tokens(ModelRunner(model), model)
    runner = ModelRunner(model, speculate=True)
    info = warm_up(runner, model, max_rows=8)
    warmed = [r for r in DECODE_ROWS if r <= 8]  # 24 and 40 rows: more than its slots
    assert len(warmed) == 6
    assert info["steps"] == 2 + len(warmed) * (1 + DECODE_STEPS)
    pool = model.kv_pool
    assert pool.free_count == pool.ids  # every page it took is back
    assert runner._spec is None  # no queued step on released KV
    assert _tokens(runner, model) == before


def test_warm_up_respects_the_slot_count(model: Any) -> None:
    info = warm_up(ModelRunner(model), model, max_rows=2)
    assert info["steps"] == 2 + 2 * (1 + DECODE_STEPS)


def test_warm_up_prefills_a_prompt_as_wide_as_the_budget_and_past_a_split(model: Any) -> None:
    """The widest prefill step and rows whose attention is split have launches of their
    own on a GPU (q4_gemm; the attention's splits folded in a block a tile, a block a split
    and its combine, the decode step's rope form): one prompt of max(prefill_rows,
    LONG_PROMPT) tokens, prefilled in one step with the folding form pinned, a continuation
    of CONTINUATION tokens in the launch rule's form, then decoded; its KV released after."""
    assert LONG_PROMPT > SPLIT_BLOCKS * BLOCK  # its last rows attend past one split
    runner = ModelRunner(model)
    prefills: list[tuple[int, bool | None]] = []
    step = runner.step

    def counting(work: list[RowWork]) -> Any:
        prefills.append((max(len(w.tokens) for w in work), runner.attention_merge))
        return step(work)

    runner.step = counting  # type: ignore[method-assign]
    info = warm_up(runner, model, max_rows=1, prefill_rows=300)
    assert info["steps"] == 2 + (2 + DECODE_STEPS) + (1 + DECODE_STEPS)
    at = prefills.index((LONG_PROMPT, True))
    assert prefills[at + 1] == (CONTINUATION, None)
    assert all(m is None for _, m in prefills[at + 1 :])
    assert runner.attention_merge is None
    pool = model.kv_pool
    assert pool.free_count == pool.ids
    prefills.clear()
    warm_up(runner, model, max_rows=1, prefill_rows=LONG_PROMPT + 100)
    assert (LONG_PROMPT + 100, True) in prefills


def test_a_warm_up_step_of_many_rows_stays_within_top_logprobs(model: Any) -> None:
    """Row i asks for 2i top logprobs, capped at the API's 20: a GPU warmed up its first
    unstaged decode row count (33 rows on the H200 8B, before every launch staged K/V), past
    the cap, and died there."""
    prompts = [[(3 * i + j) % 1000 for j in range(4 + i)] for i in range(12)]
    assert _run(ModelRunner(model), model, prompts, decode=1) == 2
    pool = model.kv_pool
    assert pool.free_count == pool.ids
