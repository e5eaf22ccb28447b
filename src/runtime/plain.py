"""A bare single-sequence greedy loop over the model code, no actors.

It is the reference the engine is compared with: the N=1 baseline of the benchmark
and the decoder the oracle tests run against Hugging Face `generate`.
"""

from __future__ import annotations

import time
from typing import Any

import mlx.core as mx

from slotserve.model.layers import Batch


def greedy_tokens(model: Any, prompt: list[int], steps: int) -> list[int]:
    """Prefill the prompt, then decode `steps` tokens one call at a time (argmax)."""
    return greedy_timed(model, prompt, steps)[0]


def greedy_timed(model: Any, prompt: list[int], steps: int) -> tuple[list[int], float]:
    """(tokens, decode tokens/s measured after the prefill)."""
    kv, n = model.new_kv(), len(prompt)
    logits = model(mx.array(prompt), Batch.build([(kv, 0, n)]), [n - 1])
    out: list[int] = [int(mx.argmax(logits[0]).item())]
    t0 = time.perf_counter()
    for pos in range(n, n + steps - 1):
        logits = model(mx.array(out[-1:]), Batch.build([(kv, pos, 1)]), [0])
        out.append(int(mx.argmax(logits[0]).item()))
    dt = time.perf_counter() - t0
    return out, (steps - 1) / dt if steps > 1 and dt > 0 else float("nan")
