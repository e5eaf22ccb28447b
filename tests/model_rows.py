"""The model-level invariance check several families' GPU tests share: a plain forward's
rows (no engine, no compiled steps) do not depend on where a prompt is cut into prefill
chunks, nor on which other sequences share the step. Call it on the thread that owns the
model's arrays (the engine's MLX thread)."""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from slotserve.model.layers import Batch

# 150 positions: past a 64-position sliding window and over one 128-position KV page
PROMPT = [int(t) % 4000 + 10 for t in range(7, 7 + 150 * 13, 13)]


def step(model: Any, tokens: list[int], parts: list[Any], rows: list[int]) -> mx.array:
    """One forward, evaluated with its K/V writes and state: on the GPU the CUDA kernels
    write the pool in place, which a later step's graph does not depend on (the engine
    evaluates each step's Batch.written the same way)."""
    batch = Batch.build(parts)
    out = model(mx.array(tokens), batch, rows)
    mx.eval(out, batch.written())
    return out


def last_logits(model: Any, cuts: list[int]) -> mx.array:
    """PROMPT's last logits, prefilled in chunks ending at `cuts` (then the rest)."""
    kv, start, out = model.new_kv(), 0, None
    for end in [*cuts, len(PROMPT)]:
        out = step(model, PROMPT[start:end], [(kv, start, end - start)], [end - start - 1])
        start = end
    return out[0]


def rows_invariance(model: Any, cuts: tuple[list[int], ...] = ([64], [32, 96, 128])
                    ) -> tuple[list[bool], list[bool]]:
    """(for each cut list: its last logits equal the whole prompt's; for each of four
    sequences: its rows in one step with the others equal its rows alone)."""
    whole = last_logits(model, [])
    chunked = [bool(mx.array_equal(last_logits(model, c), whole)) for c in cuts]
    kvs = [model.new_kv() for _ in range(4)]
    for kv, n in zip(kvs[2:], (37, 130), strict=True):
        step(model, PROMPT[:n], [(kv, 0, n)], [n - 1])
    feeds = [(PROMPT[:64], 0), (PROMPT[:100], 0), ([9], 37), ([11], 130)]
    alone = [step(model, t, [(kv, s, len(t))], [len(t) - 1])[0]
             for kv, (t, s) in zip(kvs, feeds, strict=True)]
    parts = [(kv, s, len(t)) for kv, (t, s) in zip(kvs, feeds, strict=True)]
    together = step(model, [x for t, _ in feeds for x in t], parts, [63, 163, 164, 165])
    return chunked, [bool(mx.array_equal(together[i], alone[i])) for i in range(4)]
