"""Start-up warm-up: the kernels a step uses are compiled before the first request waits.

On a GPU, the first use of a kernel configuration costs a compile: MLX JIT-compiles its
gather / scatter and fused (mx.compile) kernels and slotserve's own `mx.fast.cuda_kernel`
launches (NVRTC; cached on disk under MLX_PTX_CACHE_DIR, but loaded and instantiated per
process), and `CompiledDecode` traces each decode shape. Unwarmed, all of that lands on
the first requests' steps (issue 18 measured a first 8-stream batch at 17.7 s against
1.4 s warm). `warm_up` runs a few real steps through the runner at load instead, on KV
of its own that it releases after: a prefill of several segments and one of more than a
KV page, one as wide as the engine's prefill budget and longer than one attention split
(its own launches: the 4-bit matmul's widest, and each row's attention in splits: folded
in a block a tile, then a short continuation of it a block a split, then decode, the
launch's rope form), then decode steps at the row counts whose kernels differ (the
fused-norm launches of 1-4 rows, more rows, a batch of 8, and one row count in each of the
4-bit matmul's wider launch bands) until each is compiled, every step sampling with a mix
of the sampler's knobs (greedy, top_p, top_k, min_p, penalties, bias, logprobs) so the
device sampler's kernels are compiled too.

The tokens it produces are thrown away and nothing it leaves behind changes a request's
bits: the pages go back to the pool, and traces are the same computation as the plain
forward (`CompiledDecode.same_bits`).
"""

from __future__ import annotations

import time
from typing import Any

import structlog

from slotserve.kernels.attention import BLOCK
from slotserve.kernels.cuda.launch import ATTENTION_TILE, SPLIT_BLOCKS
from slotserve.runtime.runner import ModelRunner, RowWork
from slotserve.runtime.sampling import MAX_TOP_LOGPROBS, RowState, SamplingParams

log = structlog.get_logger("slotserve.warmup")

# one of each way a row samples (runtime.sampling); rows cycle through them
KNOBS = (
    SamplingParams(temperature=0.0),
    SamplingParams(temperature=0.7, top_p=0.9, seed=1),
    SamplingParams(temperature=0.7, top_k=40, seed=2),
    SamplingParams(temperature=1.0, min_p=0.05, repetition_penalty=1.1, frequency_penalty=0.2,
                   presence_penalty=0.1, logit_bias={0: -1.0}, seed=3),
)
# q4_matmul's fused norm is per row count up to 4; 24 and 40 rows take its launch shapes
# of 17-32 rows and of more (launch.Q4_SHAPES), which a batch growing past 16 streams meets
DECODE_ROWS = (1, 2, 3, 4, 5, 8, 24, 40)
DECODE_STEPS = 3  # CompiledDecode traces a shape's second step in a row; the third replays
# a prompt whose last rows attend past one split of key blocks (launch.attention_splits):
# without it the first long prompt compiled the split launches live (4.3 s on an H100)
LONG_PROMPT = SPLIT_BLOCKS * BLOCK + BLOCK // 2
# the long prompt's continuation: a prefill step of two attention tiles at its context
CONTINUATION = 2 * ATTENTION_TILE + 1


def warm_up(runner: ModelRunner, model: Any, max_rows: int,
            prefill_rows: int = 0) -> dict[str, Any]:
    """Run the warm-up steps (on the MLX thread); returns what it ran, for the log.
    prefill_rows (the engine's prefill budget; 0: none): then one prompt of that many tokens
    or LONG_PROMPT, whichever is longer, prefilled in one step and decoded: the widest step
    traffic makes (q4_gemm's launches, from launch.GEMM_ROWS rows on) and rows whose
    attention is split, which the short prompts do not meet."""
    t0 = time.perf_counter()
    steps = 0
    vocab = model.config.vocab_size
    traced = runner.compiled.traced if runner.compiled is not None else 0
    # several prompt segments in one prefill step, and one prompt longer than a KV page
    prompts = [[(7 * i + j) % vocab for j in range(5 + 3 * i)] for i in range(3)]
    prompts.append([(11 * j + 1) % vocab for j in range(BLOCK + 9)])
    steps += _run(runner, model, prompts, decode=1)
    if prefill_rows:
        # within the model's context: one too short for a split never meets those launches
        long_rows = min(max(prefill_rows, LONG_PROMPT),
                        model.config.max_position - DECODE_STEPS - CONTINUATION)
        long_prompt = [(5 * j + 3) % vocab for j in range(long_rows)]
        # the prompt's splits folded in a block a tile, its continuation's a block a split
        steps += _run(runner, model, [long_prompt], decode=DECODE_STEPS, merge=True,
                      continuation=CONTINUATION)
    for rows in sorted({r for r in DECODE_ROWS if r <= max_rows} | {1}):
        steps += _run(runner, model, [[(3 * i + j) % vocab for j in range(4 + i)]
                                      for i in range(rows)], decode=DECODE_STEPS)
    runner.forget_speculation()  # its rows' KV is released
    info = {"steps": steps, "seconds": round(time.perf_counter() - t0, 3),
            "traced": (runner.compiled.traced - traced) if runner.compiled is not None else 0}
    log.info("warmed up", **info)
    return info


def _run(runner: ModelRunner, model: Any, prompts: list[list[int]], decode: int,
         merge: bool | None = None, continuation: int = 0) -> int:
    """Prefill `prompts` in one step (its attention form pinned to `merge`: see
    ModelRunner.attention_merge), then `continuation` more tokens of each in one step of
    the launch rule's form (none: no such step), then `decode` decode steps of all of them."""
    kvs = [model.new_kv() for _ in prompts]
    params = [KNOBS[i % len(KNOBS)] for i in range(len(prompts))]
    states = [RowState(p, prompt) for p, prompt in zip(params, prompts, strict=True)]
    vocab = model.config.vocab_size
    feeds = [prompts]
    if continuation:
        feeds.append([[(9 * j + 2) % vocab for j in range(continuation)] for _ in prompts])
    start, feed = [0] * len(prompts), prompts
    try:
        for step in range(len(feeds) + decode):
            if step < len(feeds):
                feed = feeds[step]
            runner.attention_merge = merge if step == 0 else None
            work = [RowWork(i, kvs[i], start[i], feed[i], True, params[i], states[i],
                            states[i].num_generated, logprobs=step == 1,
                            top_logprobs=min(2 * i, MAX_TOP_LOGPROBS) if step == 1
                            else 0)
                    for i in range(len(prompts))]
            out = runner.step(work)
            feed = []  # the next decode step feeds the tokens just sampled
            for i, w in enumerate(work):
                token = out.sampled[w.slot_id].token
                states[i].observe(token)
                start[i] += len(w.tokens)
                feed.append([token])
    finally:
        runner.attention_merge = None
        for kv in kvs:
            kv.release()
    return len(feeds) + decode
