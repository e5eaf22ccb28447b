"""Runs one fused step (all slots' rows through one forward) on the MLX thread."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from math import inf

import mlx.core as mx

from slotserve.kernels.grammar import Matcher, apply_masks
from slotserve.kernels.sampling import RowState, SamplingParams, sample_rows
from slotserve.model.kv import SlotKV
from slotserve.model.layers import Batch


@dataclass
class RowWork:
    """One slot's part of a step: feed `tokens` at positions start.. of its KV."""

    slot_id: int
    kv: SlotKV
    start: int
    tokens: list[int]
    sample: bool  # the last fed token's logits choose the next token
    params: SamplingParams
    state: RowState
    draw: int  # counter for the seeded RNG: tokens generated so far
    logprobs: bool = False
    top_logprobs: int = 0
    epoch: int = 0  # the slot's request epoch when planned (opaque to the runner)
    grammar: Matcher | None = None  # constrained decoding: mask this row, then advance it


@dataclass
class Sampled:
    token: int
    logprob: float | None = None
    top_logprobs: list[tuple[int, float]] | None = None


@dataclass
class StepOutput:
    sampled: dict[int, Sampled] = field(default_factory=dict)
    rows: int = 0
    seconds: float = 0.0


class ModelRunner:
    """Owns the model; every method here runs on the MLX thread."""

    def __init__(self, model: object) -> None:
        self.model = model

    def step(self, work: list[RowWork]) -> StepOutput:
        t0 = time.perf_counter()
        batch = Batch.build([(w.kv, w.start, len(w.tokens)) for w in work])
        tokens = mx.array([t for w in work for t in w.tokens], dtype=mx.int32)
        logit_rows: list[int] = []
        sampled_work: list[RowWork] = []
        row = 0
        for w in work:
            row += len(w.tokens)
            if w.sample:
                logit_rows.append(row - 1)
                sampled_work.append(w)
        logits = self.model(tokens, batch, logit_rows)  # type: ignore[operator]
        pool = batch.pool
        kv_arrays = [*pool.keys, *pool.values] if pool is not None else []
        out = StepOutput(rows=row)
        if logits is None:
            mx.eval(kv_arrays)
        else:
            mx.eval(logits, kv_arrays)
            out.sampled = self._sample(logits, sampled_work)
        out.seconds = time.perf_counter() - t0
        return out

    @staticmethod
    def _sample(logits: mx.array, work: list[RowWork]) -> dict[int, Sampled]:
        want_lp = any(w.logprobs or w.top_logprobs for w in work)
        top = max((w.top_logprobs for w in work), default=0)
        constrained = [(i, w.grammar) for i, w in enumerate(work) if w.grammar is not None]
        if constrained:  # only these rows change; every other row keeps its exact logits
            logits = apply_masks(logits, [i for i, _ in constrained], [m for _, m in constrained])
        res = sample_rows(
            logits, [w.params for w in work], [w.state for w in work], [w.draw for w in work],
            logprobs=want_lp, top_logprobs=top,
        )
        out: dict[int, Sampled] = {}
        for i, w in enumerate(work):
            s = Sampled(res.tokens[i])
            if want_lp and (w.logprobs or w.top_logprobs) and res.logprobs is not None:
                s.logprob = res.logprobs[i]
                if w.top_logprobs and res.top_logprobs is not None:
                    s.top_logprobs = res.top_logprobs[i][: w.top_logprobs]
            out[w.slot_id] = s
        for i, m in constrained:
            m.consume(res.tokens[i])
            top_lps = out[work[i].slot_id].top_logprobs
            if top_lps:  # alternatives the grammar forbade have logprob -inf: not reported
                out[work[i].slot_id].top_logprobs = [(t, v) for t, v in top_lps if v > -inf]
        return out
