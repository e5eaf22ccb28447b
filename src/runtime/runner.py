"""Runs one fused step (all slots' rows through one forward) on the MLX thread.

With `speculate` on (EngineConfig.speculate; the default on a GPU) the steps are
pipelined: as soon as a step's tokens exist as a lazy array, before anything waits for
the device, the runner queues the next decode step's forward on top of them (every
decoding row fed the token it is sampling). Python then builds that graph while the
device still computes the current step, and the device goes on to the next step while
the event loop hands out tokens and the batcher plans. When the real plan comes, rows
that match the speculation (same slot KV, position and token) take its logits; the rest
(new prompts, changed rows) run in a forward of their own. Sampling always happens with
the real plan (the slots' sampler state is final by then). A row's logits do not depend
on its batch (the invariance rules), so the outputs are the same bits either way; a
speculated row the plan drops (the slot finished) only wrote K/V past its ledger, which
positions are masked and rewritten before anyone reads them.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from math import inf

import mlx.core as mx
import structlog

from slotserve.model.kv import SlotKV
from slotserve.model.layers import Batch
from slotserve.runtime.compiled import CompiledDecode
from slotserve.runtime.grammar import Matcher, apply_masks
from slotserve.runtime.sampling import RowState, SamplingParams, draft_rows

log = structlog.get_logger("slotserve.runner")


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
class Speculation:
    """The queued forward of a next decode step: slot id -> (kv, position, token)."""

    rows: dict[int, tuple[SlotKV, int, int]]
    logits: mx.array  # [len(rows), vocab], rows in the order of `rows`


@dataclass
class StepOutput:
    sampled: dict[int, Sampled] = field(default_factory=dict)
    rows: int = 0
    seconds: float = 0.0


class ModelRunner:
    """Owns the model; every method here runs on the MLX thread."""

    def __init__(self, model: object, speculate: bool = False, compiled: bool = False,
                 device_sampling: bool | None = None) -> None:
        self.model = model
        self.speculate = speculate
        # sample in MLX ops alone (runtime.sampling, on_device): nothing read back before
        # the tokens, so a sampled step pipelines as a greedy one does. None: when pipelined
        self.device_sampling = speculate if device_sampling is None else device_sampling
        # decode steps on the GPU kernels through mx.compile (runtime.compiled)
        self.compiled = CompiledDecode(model) if compiled else None
        self._spec: Speculation | None = None
        self.spec_rows = 0  # rows whose logits came from a speculation (stats, tests)
        # the GPU attention's form for steps with prompt rows (Batch.build's merge; None:
        # the launch rule): the warm-up pins it to compile both forms
        self.attention_merge: bool | None = None

    def close(self) -> None:
        """Drop the queued speculation and the compiled traces (engine shutdown)."""
        self._spec = None
        if self.compiled is not None:
            self.compiled.clear()

    def forget_speculation(self) -> None:
        """Drop the queued next step (its rows' KV is going away: the start-up warm-up)."""
        self._spec = None

    def _forward(self, parts: list[tuple[SlotKV, int, int, bool]], tokens_in: mx.array,
                 reserve: bool = True) -> tuple[mx.array | None, list[mx.array]]:
        """Queue the forward of (kv, start, length, sample) parts fed `tokens_in`; logits
        of the sampling parts' last rows, in order, and what the step must evaluate for its
        K/V writes (Batch.written)."""
        batch = Batch.build([(kv, start, length) for kv, start, length, _ in parts],
                            reserve=reserve, merge=self.attention_merge)
        logit_rows: list[int] = []
        row = 0
        for _, _, length, sample in parts:
            row += length
            if sample:
                logit_rows.append(row - 1)
        logits = (self.compiled.run(tokens_in, batch, logit_rows)
                  if self.compiled is not None else None)
        if logits is None:
            logits = self.model(tokens_in, batch, logit_rows)  # type: ignore[operator]
        return logits, batch.written()

    def step(self, work: list[RowWork]) -> StepOutput:
        t0 = time.perf_counter()
        spec, self._spec = self._spec, None
        spec_index = {sid: i for i, sid in enumerate(spec.rows)} if spec is not None else {}
        fresh: list[RowWork] = []
        from_spec: dict[int, int] = {}  # slot id -> row of spec.logits
        for w in work:
            hit = spec.rows.get(w.slot_id) if spec is not None else None
            if (hit is not None and w.sample and len(w.tokens) == 1 and hit[0] is w.kv
                    and hit[1:] == (w.start, w.tokens[0])):
                from_spec[w.slot_id] = spec_index[w.slot_id]
                continue
            fresh.append(w)
        logits, kv_arrays = None, []
        if fresh:
            tokens_in = mx.array([t for w in fresh for t in w.tokens], dtype=mx.int32)
            logits, kv_arrays = self._forward(
                [(w.kv, w.start, len(w.tokens), w.sample) for w in fresh], tokens_in)
        sampled_work = [w for w in work if w.sample]
        if from_spec:
            assert spec is not None
            self.spec_rows += len(from_spec)
            fresh_rows = iter(range(spec.logits.shape[0],
                                    spec.logits.shape[0] + len(sampled_work) - len(from_spec)))
            order = [from_spec[w.slot_id] if w.slot_id in from_spec else next(fresh_rows)
                     for w in sampled_work]
            logits = spec.logits if logits is None else mx.concatenate([spec.logits, logits])
            if order != list(range(logits.shape[0])):  # steady decode: already in order
                logits = logits[mx.array(order, dtype=mx.int32)]
            if not fresh:  # (a fresh forward's list has them, and its own K/V writes)
                kv_arrays = work[0].kv.pool.arrays()
        out = StepOutput(rows=sum(len(w.tokens) for w in work))
        if logits is None:
            mx.eval(kv_arrays)
        else:
            out.sampled = self._sample(logits, sampled_work, kv_arrays)
        out.seconds = time.perf_counter() - t0
        return out

    def _speculate(self, work: list[RowWork], tokens: mx.array) -> list[int]:
        """Queue the next decode step's forward, fed the (lazy) tokens being sampled now.

        Only rows whose next position already has a page (no allocation on a guess); any
        failure just means no speculation (the real step runs everything). Returns the
        indices into `work` of the speculated rows (their tokens are filled in later).
        """
        picked = [i for i, w in enumerate(work) if w.start + len(w.tokens) < w.kv.capacity
                  and w.kv.writes_window(w.start + len(w.tokens) + 1)]
        if not picked:
            return []
        if len(picked) < len(work):
            tokens = tokens[mx.array(picked, dtype=mx.int32)]
        try:
            logits, kv_arrays = self._forward(
                [(work[i].kv, work[i].start + len(work[i].tokens), 1, True) for i in picked],
                tokens, reserve=False)
            assert logits is not None
            mx.async_eval(logits, *kv_arrays)
        except Exception:  # a slot evicted under us: nothing to speculate on
            log.debug("speculation skipped", exc_info=True)
            return []
        self._spec = Speculation({}, logits)
        return picked

    def _sample(self, logits: mx.array, work: list[RowWork],
                kv_arrays: list[mx.array]) -> dict[int, Sampled]:
        want_lp = any(w.logprobs or w.top_logprobs for w in work)
        top = max((w.top_logprobs for w in work), default=0)
        constrained = [(i, w.grammar) for i, w in enumerate(work) if w.grammar is not None]
        if constrained:  # only these rows change; every other row keeps its exact logits
            logits = apply_masks(logits, [i for i, _ in constrained], [m for _, m in constrained])
        draft = draft_rows(logits, [w.params for w in work], [w.state for w in work],
                           [w.draw for w in work], on_device=self.device_sampling)
        # the device starts on this step now (its logprobs too: read after the next step
        # is queued, they must not wait for it)
        mx.async_eval(*draft.outputs(logprobs=want_lp, top_logprobs=top), *kv_arrays)
        speculated = self._speculate(work, draft.tokens) if self.speculate else []
        res = draft.result(logprobs=want_lp, top_logprobs=top)
        if self._spec is not None:
            self._spec.rows = {
                work[i].slot_id: (work[i].kv, work[i].start + len(work[i].tokens), res.tokens[i])
                for i in speculated}
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
