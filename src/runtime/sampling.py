"""Batch-invariant token sampling: one vectorized call per decode step, per-row parameters.

Every quantity that decides a row's token is computed with row-wise ops only (elementwise,
and max / sum / cumsum / sort / top-k along the vocabulary axis), and every batch-dependent
shortcut (greedy-only, no truncation, top-k prefix instead of a full sort) yields bit-identical
numbers for the rows it serves, so a request produces the same tokens whether it runs alone or
next to 63 other requests. Randomness is counter-based: the single uniform a row consumes is a
hash of ``(seed, position)``, never a shared generator stream. (Checked on MLX's CPU backend,
whose row reductions and sequential cumsums do not depend on the row count.)

Per-row pipeline, in order:

1. Penalties on the model logits, for tokens in the row's history:
   repetition penalty (HF / llama.cpp: positive logits divided, negative multiplied; history
   = prompt + generated tokens), then ``- frequency_penalty * count - presence_penalty *
   (count > 0)`` (OpenAI; counts over generated tokens only), then ``logit_bias`` (clamped
   to [-100, 100]). Bias is applied last so that -100 / +100 act as a ban / force.
   The result is the "processed logits" ``z``.
2. ``temperature == 0`` (or ``top_k == 1``): greedy, ``argmax(z)``, ties -> lowest token id.
3. Otherwise ``e = exp((z - max z) / temperature)`` (unnormalised probabilities, the top
   token has exactly 1.0; computed as a power of 2, ~2.5x cheaper than exp on MLX's CPU
   backend), then truncation in the order top_k, top_p, min_p:
   ranks follow a stable descending sort of ``e`` (ties -> lower token id first); top_k
   keeps the first k ranks; top_p keeps the shortest rank prefix, within the top_k set,
   whose mass reaches ``top_p`` of the top_k set's mass (top_k-renormalised, as vLLM / HF
   do); min_p keeps tokens with ``p >= min_p * p_max``.
4. Inverse-CDF draw over the kept tokens in token-id order: the first token whose running
   sum exceeds ``u * total``, with ``u`` the row's counter-based uniform.

Reported logprobs are ``log_softmax(z)``: after penalties and bias, before temperature and
truncation, i.e. what the (penalised) model thinks of the token, as OpenAI reports it.

Two ways to compute step 3's cutoffs, with the same numbers (a full descending sort's values
and sequential running sums are the prefix's; tests/test_device_sampling.py checks tokens):

- ``on_device=True`` (the pipelined runner's, i.e. the GPU's): every op is an MLX op on the
  device, the uniforms too (splitmix64 in uint64), and no value is read back before the
  step's tokens, so the runner can queue the next step on the lazy tokens. Rows that rank
  (top_k / top_p) get one full sort of their vocabulary: its width never depends on the
  batch, so neither do the device's scan and reduction shapes (MLX's CUDA scan picks its
  block size from the row length), and a nucleus of any width costs the same. On
  slotserve's CUDA kernels the truncation and the draw are one launch instead, with no
  sort (kernels.cuda.sample_draw: a radix select finds the cut ranks): the same rules,
  with masses summed as 40-bit fixed-point integers (exact, so a token can differ from
  these float sums only where their rounding decides it) and the uniform hashed in the
  launch.
- ``on_device=False`` (the CPU's unpipelined steps): a top-k prefix (a linear partition
  on the CPU) with host checks, and numpy's sort for wide nuclei: MLX's CPU sort is several
  times slower than numpy's, and an unpipelined step has nothing to overlap a sync with.
"""

from __future__ import annotations

import math
import secrets
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import cache
from types import MappingProxyType

import mlx.core as mx
import numpy as np
import structlog

from slotserve.kernels import cpu_sampler, cuda

log = structlog.get_logger("slotserve.sampling")

__all__ = [
    "KNOB_RANGES",
    "MAX_TOP_LOGPROBS",
    "MIN_TEMPERATURE",
    "REPETITION_PENALTY_RANGE",
    "KnobRange",
    "RowState",
    "SampleDraft",
    "SampleResult",
    "SamplingParams",
    "apply_penalties",
    "device_uniforms",
    "draft_rows",
    "sample_rows",
    "uniform_for",
]

MAX_TOP_LOGPROBS = 20
_BIAS_LIMIT = 100.0
_LOG2E = 1.4426950408889634
# Prefix length fetched with top-k for top_p-only rows; wider nuclei fall back to a full sort.
_TOP_P_PREFIX = 1024
# Second prefix, from a partition on the host, for nuclei wider than the first.
_TOP_P_WIDE = 8192
_U64 = (1 << 64) - 1
# Below this, 1 / temperature overflows float32 (the HTTP API sends such values as 0).
MIN_TEMPERATURE = 1e-30
_F32_TINY = float(np.finfo(np.float32).tiny)
# Logits are divided or multiplied by at most 100: |z| grows at most 100-fold, so penalised
# logits stay finite (and their differences too) for any logits a model produces.
REPETITION_PENALTY_RANGE = (0.01, 100.0)


@dataclass(frozen=True)
class KnobRange:
    """Where a float knob keeps every sampler step finite: within [lo, hi] (or (lo, hi]) both
    as a float and after the cast to float32, and either 0 or at least `floor`, below which
    float32 loses it (1 / temperature overflows; a subnormal top_p is 0 on a GPU)."""

    lo: float
    hi: float
    open_lo: bool = False
    floor: float = 0.0

    def contains(self, value: float) -> bool:
        """Whether the sampler can use `value` (a finite float; NaN is never contained)."""
        with np.errstate(over="ignore", under="ignore"):
            f32, lo32, hi32 = (np.float32(v) for v in (value, self.lo, self.hi))
        inside = (self.lo < value if self.open_lo else self.lo <= value) and value <= self.hi
        inside32 = (lo32 < f32 if self.open_lo else lo32 <= f32) and f32 <= hi32
        return bool(inside and inside32) and (value == 0 or abs(value) >= self.floor)

    def __str__(self) -> str:
        return f"{'(' if self.open_lo else '['}{self.lo:g}, {self.hi:g}]"


# OpenAI's ranges (and vLLM's for min_p / repetition_penalty), as the float32 sampler needs them.
KNOB_RANGES: Mapping[str, KnobRange] = MappingProxyType({
    "temperature": KnobRange(0.0, 2.0, floor=MIN_TEMPERATURE),
    "top_p": KnobRange(0.0, 1.0, open_lo=True, floor=_F32_TINY),  # GPUs flush subnormals to 0
    "min_p": KnobRange(0.0, 1.0),
    "repetition_penalty": KnobRange(*REPETITION_PENALTY_RANGE),
    "frequency_penalty": KnobRange(-2.0, 2.0),
    "presence_penalty": KnobRange(-2.0, 2.0),
})


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling knobs (OpenAI names and ranges, plus top_k / min_p / repetition)."""

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logit_bias: Mapping[int, float] | None = None
    seed: int | None = None

    def __post_init__(self) -> None:
        # Freeze a private copy so later caller mutation cannot desync RowState tables.
        if self.logit_bias is not None:
            object.__setattr__(self, "logit_bias", MappingProxyType(dict(self.logit_bias)))

    @property
    def greedy(self) -> bool:
        """top_k == 1 keeps only the argmax (ties -> lowest id), exactly what greedy does."""
        return self.temperature == 0 or self.top_k == 1

    @property
    def penalizes(self) -> bool:
        """Whether the row needs the history / bias gather-scatter at all."""
        return (
            self.repetition_penalty != 1.0
            or self.frequency_penalty != 0.0
            or self.presence_penalty != 0.0
            or bool(self.logit_bias)
        )

    def validate(self, vocab_size: int) -> None:
        """Refuse knobs the sampler cannot compute with (ValueError; `Engine.make_request`).

        These are the sampler's invariants, not the API's messages: each float knob inside
        its `KNOB_RANGES` entry as a float and after the cast to float32 (so no step can turn
        finite logits into NaN), top_k a count, logit_bias keyed by token ids of the
        vocabulary with finite values, the seed an integer. HTTP requests are checked against
        the same table by the API models first, with errors that name the field
        (`slotserve.api.schemas`); this guards the in-process callers.
        """
        for name, limits in KNOB_RANGES.items():
            value = _as_float(getattr(self, name))
            if value is None or not limits.contains(value):
                got = f", got {value:g}" if value is not None and math.isfinite(value) else ""
                raise ValueError(f"{name} must be a finite number in {limits}{got}")
        if not _is_int(self.top_k) or self.top_k < 0:
            raise ValueError("top_k must be an integer >= 0 (0 disables)")
        for token, bias in (self.logit_bias or {}).items():
            if not _is_int(token):
                raise ValueError("logit_bias keys must be integer token ids")
            if not 0 <= token < vocab_size:
                raise ValueError(f"logit_bias token id {token} is out of range [0, {vocab_size})")
            value = _as_float(bias)  # clamped to [-100, 100] when applied
            if value is None or not math.isfinite(value):
                raise ValueError(f"logit_bias[{token}] must be a finite number")
        if self.seed is not None and not _is_int(self.seed):
            raise ValueError("seed must be an integer")


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _as_float(value: object) -> float | None:
    """A real number as a float (inf past float's range); None for anything else."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    try:
        return float(value)
    except OverflowError:  # an int beyond any float
        return math.inf


class RowState:
    """Per-request sampler memory, owned by the slot: the seed in use and the token history.

    Only requests that use penalties or bias keep a table; it is a compact list of
    (token id, history flag, generated count) rather than a dense vocab-sized array, so a
    decode step gathers / scatters a few entries per row instead of building [N, V] tensors.
    """

    __slots__ = ("params", "seed", "num_generated", "_slot", "_ids", "_rep", "_add",
                 "_count", "_seen", "_n")

    def __init__(self, params: SamplingParams, prompt_tokens: Sequence[int] = ()) -> None:
        self.params = params
        # Chosen once at request start and recorded, so a run can be replayed with this seed.
        self.seed = (params.seed if params.seed is not None else secrets.randbits(63)) & _U64
        self.num_generated = 0
        self._slot: dict[int, int] = {}
        self._n = 0
        self._ids = np.zeros(0, np.int32)
        self._rep = np.zeros(0, np.float32)
        self._add = np.zeros(0, np.float32)
        self._count = np.zeros(0, np.int64)
        self._seen = np.zeros(0, bool)
        if not params.penalizes:
            return
        # Bulk build: long prompts must not cost a Python step per token.
        bias = params.logit_bias or {}
        bias_ids = np.fromiter(bias.keys(), np.int64, len(bias))
        prompt_ids = np.zeros(0, np.int64)
        if params.repetition_penalty != 1.0 and len(prompt_tokens):
            prompt_ids = np.unique(np.asarray(prompt_tokens, dtype=np.int64))
        ids = np.union1d(bias_ids, prompt_ids)
        n = len(ids)
        cap = max(16, n)
        self._n = n
        self._ids = np.zeros(cap, np.int32)
        self._ids[:n] = ids
        self._seen = np.zeros(cap, bool)
        self._seen[:n] = np.isin(ids, prompt_ids)
        self._count = np.zeros(cap, np.int64)
        self._rep = np.ones(cap, np.float32)
        self._rep[:n][self._seen[:n]] = params.repetition_penalty
        self._add = np.zeros(cap, np.float32)
        self._slot = dict(zip(ids.tolist(), range(n), strict=True))
        for token, value in bias.items():
            self._add[self._slot[int(token)]] = min(max(float(value), -_BIAS_LIMIT), _BIAS_LIMIT)

    def observe(self, token: int) -> None:
        """Record a generated token; call once per step, after sample_rows."""
        self.num_generated += 1
        p = self.params
        if not (p.repetition_penalty != 1.0 or p.frequency_penalty or p.presence_penalty):
            return
        j = self._entry(int(token))
        self._seen[j] = True
        self._count[j] += 1
        self._refresh(j)

    def generated_counts(self) -> dict[int, int]:
        """Generated-token counts as tracked for frequency / presence penalties."""
        return {int(t): int(c) for t, c in zip(self._ids[: self._n], self._count[: self._n],
                                               strict=True) if c}

    def _entry(self, token: int) -> int:
        j = self._slot.get(token)
        if j is not None:
            return j
        if self._n == len(self._ids):
            cap = max(16, 2 * self._n)
            self._ids = np.resize(self._ids, cap)
            self._rep = np.resize(self._rep, cap)
            self._add = np.resize(self._add, cap)
            self._count = np.resize(self._count, cap)
            self._seen = np.resize(self._seen, cap)
        j = self._n
        self._n += 1
        self._slot[token] = j
        self._ids[j] = token
        self._count[j] = 0
        self._seen[j] = False
        self._rep[j] = 1.0
        self._add[j] = 0.0
        return j

    def _refresh(self, j: int) -> None:
        # The additive term is folded in float64 and rounded once, so it is exact to f32.
        p = self.params
        count = int(self._count[j])
        bias = float((p.logit_bias or {}).get(int(self._ids[j]), 0.0))
        bias = min(max(bias, -_BIAS_LIMIT), _BIAS_LIMIT)
        self._add[j] = bias - p.frequency_penalty * count - p.presence_penalty * (count > 0)
        self._rep[j] = p.repetition_penalty if self._seen[j] else 1.0


@dataclass
class SampleResult:
    """Tokens for one step; logprobs are log_softmax of the penalised, unscaled logits."""

    tokens: list[int]
    logprobs: list[float] | None = None
    top_logprobs: list[list[tuple[int, float]]] | None = None


def _mix64(z: int) -> int:
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _U64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _U64
    return z ^ (z >> 31)


def uniform_for(seed: int, position: int) -> float:
    """Counter-based uniform in [0, 1): element ``position`` of a splitmix64 stream keyed by seed.

    24 bits, so the value is exact in float32 and strictly below 1.
    """
    h = _mix64((_mix64(seed & _U64) + (position + 1) * 0x9E3779B97F4A7C15) & _U64)
    return (h >> 40) / float(1 << 24)


def _mix64_mx(z: mx.array) -> mx.array:
    z = (z ^ (z >> 30)) * mx.array(np.uint64(0xBF58476D1CE4E5B9))
    z = (z ^ (z >> 27)) * mx.array(np.uint64(0x94D049BB133111EB))
    return z ^ (z >> 31)


def device_uniforms(seeds: Sequence[int], positions: Sequence[int]) -> mx.array:
    """``uniform_for`` of each (seed, position) as MLX ops, float32 [n], lazy.

    uint64 arithmetic wraps on every backend, which is the ``& _U64`` of the host version,
    so the values are bit-identical to it.
    """
    seed = mx.array(np.array([s & _U64 for s in seeds], np.uint64))
    pos = mx.array(np.array([(p + 1) & _U64 for p in positions], np.uint64))
    h = _mix64_mx(_mix64_mx(seed) + pos * mx.array(np.uint64(0x9E3779B97F4A7C15)))
    return (h >> 40).astype(mx.float32) * (1.0 / (1 << 24))


def apply_penalties(logits: mx.array, states: Sequence[RowState]) -> mx.array:
    """Penalised, biased float32 logits [N, V] (step 1); only history / bias entries change.

    Gathers the few affected entries per row, fixes them up and scatters them back, so no
    dense [N, V] penalty tensor is ever built.
    """
    z = logits.astype(mx.float32)
    width = max(s._n for s in states)
    if width == 0:
        return z
    n = len(states)
    ids = np.zeros((n, width), np.int32)
    rep = np.ones((n, width), np.float32)
    add = np.zeros((n, width), np.float32)
    for i, s in enumerate(states):
        k = s._n
        if k == 0:
            continue  # token 0 is rewritten with itself: rep 1, add 0
        ids[i, :k], rep[i, :k], add[i, :k] = s._ids[:k], s._rep[:k], s._add[:k]
        # Padding repeats entry 0, so duplicate scatter targets receive identical values.
        ids[i, k:], rep[i, k:], add[i, k:] = s._ids[0], s._rep[0], s._add[0]
    idx = mx.array(ids)
    r = mx.array(rep)
    g = mx.take_along_axis(z, idx, axis=-1)
    g = mx.where(g > 0, g / r, g * r) + mx.array(add)
    return mx.put_along_axis(z, idx, g, axis=-1)


def _desc(x: mx.array) -> mx.array:
    return -mx.sort(-x, axis=-1)


def _top_prefix(x: mx.array | np.ndarray, k: int) -> mx.array:
    """Each row's k largest values, descending: the native selection on the CPU
    (cpu_sampler), else MLX's topk and sort (numpy's partition and sort for host rows);
    the same numbers every way."""
    if isinstance(x, np.ndarray) or mx.default_device() == mx.cpu:
        top = cpu_sampler.top_values(x, k)
        if top is not None:
            return mx.array(top)
    if isinstance(x, np.ndarray):
        return mx.array(-np.sort(np.partition(-x, k - 1, axis=-1)[:, :k], axis=-1))
    return _desc(mx.topk(x, k, axis=-1))


def _cutoffs(
    prefix: mx.array, k_eff: np.ndarray, top_p: np.ndarray, total: mx.array, vocab: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Kept-rank count c and threshold e[c-1] from a descending prefix of each row's e.

    Returns (c, thr, resolved); unresolved rows have a nucleus longer than the prefix.
    Prefix cumsums are sequential, so a row gets identical numbers from any prefix length.
    """
    width = prefix.shape[-1]
    k = mx.array(k_eff.astype(np.int32))
    p = mx.array(top_p.astype(np.float32))
    inclusive = mx.cumsum(prefix, axis=-1)
    before = mx.cumsum(prefix, axis=-1, inclusive=False)
    mass_k = mx.take_along_axis(inclusive, mx.minimum(k, width)[:, None] - 1, axis=-1)[:, 0]
    mass = mx.where(k < vocab, mass_k, total)
    count = mx.sum(before < (p * mass)[:, None], axis=-1)
    p_on = p < 1.0
    c = mx.minimum(k, mx.where(p_on, count, vocab))
    resolved = mx.logical_not(p_on) | (count < width) | (k <= width)
    cut = mx.clip(c, 1, width) - 1
    thr = mx.take_along_axis(prefix, cut[:, None], axis=-1)[:, 0]
    mx.eval(c, thr, resolved)
    return np.array(c).astype(np.int64), np.array(thr), np.array(resolved)


def _rank_cutoffs(
    e: mx.array, total: mx.array, k_eff: np.ndarray, top_p: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Per-row (c, thr) for rank truncation, sorting as little of each row as possible.

    A top-k prefix serves top_k rows and most nuclei; rows whose nucleus is wider get a
    full sort (numpy's sort is ~4x faster than MLX's on CPU; values are identical).
    """
    n, vocab = e.shape
    c = np.full(n, vocab, np.int64)
    thr = np.zeros(n, np.float32)
    rows = np.nonzero((k_eff < vocab) | (top_p < 1.0))[0]
    p_only = k_eff[rows] >= vocab
    width = max(int(k_eff[rows][~p_only].max(initial=1)), _TOP_P_PREFIX if p_only.any() else 1)

    def take(x: mx.array, idx: np.ndarray) -> mx.array:
        return x if len(idx) == n else mx.take(x, mx.array(idx.astype(np.int32)), axis=0)

    if 4 * width < vocab:
        prefix = _top_prefix(take(e, rows), width)
        c_r, thr_r, ok = _cutoffs(prefix, k_eff[rows], top_p[rows], take(total, rows), vocab)
        c[rows[ok]], thr[rows[ok]] = c_r[ok], thr_r[ok]
        rows = rows[~ok]
    if len(rows):
        host = np.array(take(e, rows))
        # rows whose top_k fits the wider prefix (or is off): their top_k mass is in it
        fits = (k_eff[rows] >= vocab) | (k_eff[rows] <= _TOP_P_WIDE)
        if 4 * _TOP_P_WIDE < vocab and fits.any():
            # a wider prefix from a selection (cpu_sampler's, or numpy's partition) and a sort
            # of only its values: the full sort's first _TOP_P_WIDE ranks, far cheaper
            sub = rows[fits]
            prefix = _top_prefix(host[fits], _TOP_P_WIDE)
            c_r, thr_r, ok = _cutoffs(prefix, k_eff[sub], top_p[sub], take(total, sub), vocab)
            c[sub[ok]], thr[sub[ok]] = c_r[ok], thr_r[ok]
            left = np.ones(len(rows), bool)
            left[np.nonzero(fits)[0][ok]] = False
            rows, host = rows[left], host[left]
    if len(rows):
        full = mx.array(-np.sort(-host, axis=-1))
        c[rows], thr[rows], _ = _cutoffs(full, k_eff[rows], top_p[rows], take(total, rows), vocab)
    return c, thr


@dataclass
class Truncation:
    """Each row's top_k / top_p / min_p rule as numbers (_truncation): kept are the entries
    e >= lo; where a cut row (ranks below the vocabulary) has more than `ranks` entries >=
    tied, its threshold, only so many of those equal to tied are kept, lowest ids first (a
    stable sort's order), as make `ranks` in all."""

    lo: np.ndarray  # float32 [n]
    tied: np.ndarray  # float32 [n]
    ranks: np.ndarray  # int64 [n]: the kept-rank count c (the vocabulary: no cut)


def _truncation(
    e: mx.array,
    total: mx.array,
    k_eff: np.ndarray,
    top_p: np.ndarray,
    min_p: np.ndarray,
) -> Truncation | None:
    """The rows' truncation rule (Truncation), or None when no row truncates."""
    n, vocab = e.shape
    ranked = (k_eff < vocab) | (top_p < 1.0)
    if not ranked.any():
        if not (min_p > 0).any():
            return None
        return Truncation(min_p.astype(np.float32), np.full(n, -1.0, np.float32),
                          np.full(n, vocab, np.int64))
    c, thr = _rank_cutoffs(e, total, k_eff, top_p)
    cut = c < vocab
    # e >= 0 everywhere, so a 0 threshold keeps the whole row.
    thr = np.where(cut, thr, np.float32(0.0)).astype(np.float32)
    return Truncation(np.maximum(min_p, thr).astype(np.float32),
                      np.where(cut, thr, np.float32(-1.0)).astype(np.float32), c)


def _truncation_mask(
    e: mx.array,
    total: mx.array,
    k_eff: np.ndarray,
    top_p: np.ndarray,
    min_p: np.ndarray,
) -> mx.array | None:
    """Boolean keep mask for top_k / top_p / min_p (_truncation's rule), or None when no row
    truncates."""
    rule = _truncation(e, total, k_eff, top_p, min_p)
    if rule is None:
        return None
    keep = e >= mx.array(rule.lo)[:, None]
    c = rule.ranks
    cut = c < e.shape[1]
    if not cut.any():
        return keep
    # Tokens tied with the threshold: keep only the lowest ids, as a stable sort would.
    tied = mx.array(rule.tied)[:, None]
    n_gt, n_ge = mx.sum(e > tied, axis=-1), mx.sum(e >= tied, axis=-1)
    mx.eval(n_gt, n_ge)
    excess = cut & (np.array(n_ge) > c)
    if excess.any():
        need = mx.array(np.where(excess, c - np.array(n_gt), e.shape[1]).astype(np.int32))
        eq = e == mx.array(np.where(excess, rule.tied, np.float32(-1.0)))[:, None]
        rank = mx.cumsum(eq.astype(mx.int32), axis=-1)
        keep = keep & (mx.logical_not(eq) | (rank <= need[:, None]))
    return keep


def _sorted_cutoffs(
    ascending: mx.array, k_eff: np.ndarray, top_p: np.ndarray, total: mx.array
) -> tuple[mx.array, mx.array]:
    """`_cutoffs` over each row's whole vocabulary, sorted ascending, as lazy arrays.

    Reverse scans of the ascending sort are the descending sort's running sums, summed in
    the same order (from the largest value); the mass of the top_k set is the running sum
    before rank k, which is the inclusive sum at rank k - 1. Returns (c, thr) per row.
    """
    vocab = ascending.shape[-1]
    k = mx.array(k_eff.astype(np.int32))
    if not (top_p < 1.0).any():  # top_k alone: no running sums (c = k, whatever they say)
        return k, mx.take_along_axis(ascending, (vocab - k)[:, None], axis=-1)[:, 0]
    p = mx.array(top_p.astype(np.float32))
    before = mx.cumsum(ascending, axis=-1, reverse=True, inclusive=False)  # at V-1-rank
    at_k = (vocab - 1 - mx.minimum(k, vocab - 1))[:, None]
    mass = mx.where(k < vocab, mx.take_along_axis(before, at_k, axis=-1)[:, 0], total)
    count = mx.sum(before < (p * mass)[:, None], axis=-1).astype(mx.int32)
    c = mx.minimum(k, mx.where(p < 1.0, count, vocab))
    cut = vocab - mx.clip(c, 1, vocab)  # rank c - 1, counted from the end
    return c, mx.take_along_axis(ascending, cut[:, None], axis=-1)[:, 0]


def _device_truncation_mask(
    e: mx.array,
    total: mx.array,
    k_eff: np.ndarray,
    top_p: np.ndarray,
    min_p: np.ndarray,
) -> mx.array | None:
    """`_truncation_mask` in MLX ops alone: nothing is read back, so the mask stays lazy.

    Which rows rank is a matter of their own parameters (host values), never of the data;
    the tie fix-up runs for every row (a row without excess ties keeps its mask as it is).
    """
    n, vocab = e.shape
    ranked = (k_eff < vocab) | (top_p < 1.0)
    if not ranked.any():
        if not (min_p > 0).any():
            return None
        return e >= mx.array(min_p.astype(np.float32))[:, None]
    rows = np.nonzero(ranked)[0]
    e_r, total_r = e, total
    if len(rows) < n:
        idx = mx.array(rows.astype(np.int32))
        e_r, total_r = mx.take(e, idx, axis=0), mx.take(total, idx, axis=0)
    c, thr = _sorted_cutoffs(mx.sort(e_r, axis=-1), k_eff[rows], top_p[rows], total_r)
    if len(rows) < n:  # back to every row: the others cut nothing (c = vocab)
        at = np.full(n, len(rows), np.int32)
        at[rows] = np.arange(len(rows), dtype=np.int32)
        at_mx = mx.array(at)
        c = mx.concatenate([c, mx.array([vocab], mx.int32)])[at_mx]
        thr = mx.concatenate([thr, mx.zeros((1,), mx.float32)])[at_mx]
    cut = c < vocab
    # e >= 0 everywhere, so a 0 threshold keeps the whole row.
    thr = mx.where(cut, thr, 0.0)
    keep = e >= mx.maximum(mx.array(min_p.astype(np.float32)), thr)[:, None]
    # Tokens tied with the threshold: keep only the lowest ids, as a stable sort would.
    tied = mx.where(cut, thr, -1.0)[:, None]
    n_gt, n_ge = mx.sum(e > tied, axis=-1), mx.sum(e >= tied, axis=-1)
    excess = cut & (n_ge > c)
    need = mx.where(excess, c - n_gt, vocab)[:, None]
    eq = e == mx.where(excess, thr, -1.0)[:, None]
    rank = mx.cumsum(eq.astype(mx.int32), axis=-1)
    return keep & (mx.logical_not(eq) | (rank <= need))


def _draw(
    z: mx.array, row_max: mx.array, params: Sequence[SamplingParams], seeds: Sequence[int],
    draws: Sequence[int], on_device: bool = False,
) -> mx.array:
    """Inverse-CDF draw for non-greedy rows, each with the uniform of its (seed, draw
    position); returns token ids [n]."""
    n, vocab = z.shape
    scale = np.array([_LOG2E / p.temperature for p in params], np.float32)
    k_eff = np.array([p.top_k if 0 < p.top_k < vocab else vocab for p in params], np.int64)
    top_p = np.array([p.top_p for p in params], np.float32)
    min_p = np.array([p.min_p for p in params], np.float32)
    if on_device and cuda.enabled():  # one launch on slotserve's CUDA kernels
        return cuda.sample_draw(z, row_max, scale, k_eff, top_p, min_p, seeds, draws)
    if not on_device and mx.default_device() == mx.cpu:
        drawn = _host_draw(z, scale, k_eff, top_p, min_p, seeds, draws)
        if drawn is not None:
            return drawn
    uniforms = (device_uniforms(seeds, draws) if on_device else
                mx.array(np.array(list(map(uniform_for, seeds, draws)), np.float32)))
    e = _probabilities(z, row_max, mx.array(scale))
    total = mx.sum(e, axis=-1)
    mask = _device_truncation_mask if on_device else _truncation_mask
    keep = mask(e, total, k_eff, top_p, min_p)
    return _cdf_draw(e, keep, uniforms)


def _probabilities(z: mx.array, row_max: mx.array, scale: mx.array) -> mx.array:
    """Each row's unnormalized probabilities at its temperature (scale log2 e / T)."""
    return mx.power(2.0, (z - row_max[:, None]) * scale[:, None])


def _cdf_draw(e: mx.array, keep: mx.array | None, uniforms: mx.array) -> mx.array:
    """Each row's inverse-CDF draw over its kept probabilities at its uniform."""
    if keep is not None:
        e = e * keep
    cdf = mx.cumsum(e, axis=-1)
    mass = cdf[:, -1:]
    target = uniforms[:, None] * mass
    # First index whose running sum exceeds the target; the second count guards the case
    # where float rounding puts the target at the very top of the CDF.
    first = mx.sum(cdf <= target, axis=-1)
    last = mx.sum(cdf < mass, axis=-1)
    return mx.minimum(first, last)


@cache
def native_draw_agrees() -> bool:
    """Whether kernels.cpu_sampler's probabilities and draw give _probabilities' and
    _cdf_draw's bits on this machine (MLX's CPU power, the C library's powf, must give what
    its exp2f gives for the exponents here, <= 0; MLX's cumsum must be sequential): a probe
    of rows from peaked to flat (-inf entries included) at scales across the sampler's
    range, each drawn untruncated and under top_k / top_p / min_p rules (ties at a cut among
    them), and 262,144 exponents spread over [-160, 0] (uniformly and log-uniformly),
    checked once a process. Where it fails the host path keeps MLX's ops, with a warning."""
    rng = np.random.default_rng(20261204)
    spread = np.array([[8], [4], [1], [0.2], [0.01], [30]])
    z = (rng.standard_normal((6, 4096)) * spread).astype(np.float32)
    z[0, ::7] = -np.inf
    z[3, 1::2] = z[3, 0]  # half the row tied with its first entry
    scale = np.array([1.4426950, 0.72, 2.885, 144.27, 0.0144, 7.2], np.float32)
    u = rng.random(6).astype(np.float32)
    got = cpu_sampler.probabilities(z, scale)
    if got is None:
        return False
    exponents = np.concatenate([-rng.random((4, 32768)) * 160,
                                -np.exp2(rng.uniform(-30.0, 7.3, (4, 32768)))]).astype(np.float32)
    exponents[:, 0] = 0.0  # each row's max: at scale 1 the probabilities are 2^exponent
    ones = np.ones(8, np.float32)
    swept = cpu_sampler.probabilities(exponents, ones)
    assert swept is not None
    rules = [(np.full(6, 4096), np.ones(6, np.float32), np.zeros(6, np.float32)),
             (np.array([4096, 40, 1, 3000, 4096, 7]),
              np.array([0.9, 1.0, 1.0, 0.5, 0.95, 0.3], np.float32),
              np.array([0.0, 0.0, 0.2, 0.0, 0.01, 0.05], np.float32))]
    with mx.stream(mx.cpu):  # MLX's CPU ops, whatever the default device
        zm = mx.array(z)
        want = np.asarray(_probabilities(zm, mx.max(zm, axis=-1), mx.array(scale)))
        xm = mx.array(exponents)
        want_swept = np.asarray(_probabilities(xm, mx.max(xm, axis=-1), mx.array(ones)))
        e = mx.array(want)
        total = mx.sum(e, axis=-1)
        draws = []
        for k_eff, top_p, min_p in rules:
            rule = _truncation(e, total, k_eff, top_p, min_p)
            mask = _truncation_mask(e, total, k_eff, top_p, min_p)
            draws.append((rule, np.asarray(_cdf_draw(e, mask, mx.array(u)))))
    same = (np.array_equal(got.view(np.uint32), want.view(np.uint32))
            and np.array_equal(swept.view(np.uint32), want_swept.view(np.uint32))) and all(
        np.array_equal(_native_draw(want, u, rule), tokens) for rule, tokens in draws)
    if not same:
        log.warning("native sampler passes do not match MLX's CPU ops here; using MLX's")
    return same


def _host_draw(
    z: mx.array, scale: np.ndarray, k_eff: np.ndarray, top_p: np.ndarray, min_p: np.ndarray,
    seeds: Sequence[int], draws: Sequence[int],
) -> mx.array | None:
    """_draw's host path with its passes over the vocabulary in slotserve's native CPU
    kernels (kernels.cpu_sampler): the same probabilities, cutoffs and draws, so the same
    tokens, the truncation applied inside the draw instead of as a mask; None where they
    are not available or do not agree (native_draw_agrees)."""
    if not native_draw_agrees():
        return None
    e_host = cpu_sampler.probabilities(z, scale)
    assert e_host is not None  # (native_draw_agrees ran them)
    e = mx.array(e_host)
    rule = _truncation(e, mx.sum(e, axis=-1), k_eff, top_p, min_p)
    u = np.array(list(map(uniform_for, seeds, draws)), np.float32)
    tokens = _native_draw(e_host, u, rule)
    assert tokens is not None
    return mx.array(tokens)


def _native_draw(e: np.ndarray, u: np.ndarray, rule: Truncation | None) -> np.ndarray | None:
    """cpu_sampler.draw of e [n, v] at uniforms u under `rule` (None: untruncated)."""
    if rule is None:
        return cpu_sampler.draw(e, u)
    return cpu_sampler.draw(e, u, rule.lo, rule.tied, rule.ranks)


def sample_rows(
    logits: mx.array,
    params: Sequence[SamplingParams],
    states: Sequence[RowState],
    positions: Sequence[int] | None = None,
    *,
    logprobs: bool = False,
    top_logprobs: int = 0,
    on_device: bool = False,
) -> SampleResult:
    """Sample one token per row of ``logits`` [N, V]; row i uses params[i], states[i].

    ``positions[i]`` is the row's draw counter (default: tokens generated so far). States are
    not modified: call ``states[i].observe(token)`` once the token is committed.
    ``top_logprobs`` (<= 20) implies ``logprobs``. ``on_device``: see the module docstring
    (the same tokens either way).
    """
    return draft_rows(logits, params, states, positions, on_device=on_device).result(
        logprobs=logprobs, top_logprobs=top_logprobs)


@dataclass
class SampleDraft:
    """A step's tokens as a lazy array, before anything waits for the device.

    The runner can queue work that consumes ``tokens`` (the next decode step's forward)
    before ``result`` blocks on them.
    """

    tokens: mx.array  # int32 [N], lazy
    z: mx.array  # the processed logits, float32 [N, V]
    row_max: mx.array | None
    # (top count, lazy logprob arrays), built by `outputs` once
    _logprobs: tuple[int, list[mx.array]] | None = field(default=None, repr=False)

    def outputs(self, *, logprobs: bool = False, top_logprobs: int = 0) -> list[mx.array]:
        """The lazy arrays `result` reads: the tokens, then (if asked) each row's logprob,
        and its top ids and their logprobs. The pipelined runner starts them all on the
        device with the tokens, so reading the logprobs never waits for the next step."""
        if not 0 <= top_logprobs <= MAX_TOP_LOGPROBS:
            raise ValueError(
                f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {top_logprobs}")
        if not (logprobs or top_logprobs):
            return [self.tokens]
        key = min(top_logprobs, self.z.shape[1])
        if self._logprobs is None or self._logprobs[0] != key:
            z = self.z
            row_max = self.row_max if self.row_max is not None else mx.max(z, axis=-1)
            shifted = z - row_max[:, None]
            lse = mx.log(mx.sum(mx.power(2.0, shifted * _LOG2E), axis=-1, keepdims=True))
            outs = [mx.take_along_axis(shifted, self.tokens[:, None], -1) - lse]
            if key:
                top_ids = mx.argpartition(-z, key - 1, axis=-1)[:, :key]
                outs += [top_ids, mx.take_along_axis(shifted, top_ids, -1) - lse]
            self._logprobs = (key, outs)
        return [self.tokens, *self._logprobs[1]]

    def result(self, *, logprobs: bool = False, top_logprobs: int = 0) -> SampleResult:
        """Wait for the tokens (and logprobs if asked) and return them as Python values."""
        outs = self.outputs(logprobs=logprobs, top_logprobs=top_logprobs)
        mx.eval(*outs)
        result = SampleResult(tokens=np.array(outs[0]).tolist())
        if len(outs) == 1:
            return result
        result.logprobs = np.array(outs[1])[:, 0].astype(float).tolist()
        if len(outs) == 4:
            ids_np, vals_np = np.array(outs[2]), np.array(outs[3])
            result.top_logprobs = []
            for ids_row, vals_row in zip(ids_np, vals_np, strict=True):
                order = np.lexsort((ids_row, -vals_row))
                result.top_logprobs.append(
                    [(int(ids_row[j]), float(vals_row[j])) for j in order]
                )
        return result


def draft_rows(
    logits: mx.array,
    params: Sequence[SamplingParams],
    states: Sequence[RowState],
    positions: Sequence[int] | None = None,
    *,
    on_device: bool = False,
) -> SampleDraft:
    """Build (lazily) one token per row of ``logits``; see ``sample_rows``.

    With ``on_device`` nothing here waits for the device: the draft's tokens are one lazy
    graph from the logits (what the pipelined runner queues the next step on).
    """
    if logits.ndim != 2:
        raise ValueError(f"logits must be [N, V], got shape {logits.shape}")
    n, _ = logits.shape
    if not (len(params) == len(states) == n):
        raise ValueError(f"got {n} rows, {len(params)} params and {len(states)} states")
    if positions is None:
        positions = [s.num_generated for s in states]
    z = logits.astype(mx.float32)
    if any(s._n for s in states):
        z = apply_penalties(z, states)

    greedy = np.array([p.greedy for p in params], bool)
    arg = mx.argmax(z, axis=-1).astype(mx.int32) if greedy.any() else None
    row_max = mx.max(z, axis=-1) if not greedy.all() else None
    if arg is not None and greedy.all():
        return SampleDraft(arg, z, row_max)
    rows = np.nonzero(~greedy)[0]
    seeds, draws = [states[i].seed for i in rows], [positions[i] for i in rows]
    assert row_max is not None
    if len(rows) == n:
        drawn = _draw(z, row_max, list(params), seeds, draws, on_device)
        return SampleDraft(drawn.astype(mx.int32), z, row_max)
    sel = mx.array(rows.astype(np.int32))
    zs, ms = mx.take(z, sel, axis=0), mx.take(row_max, sel, axis=0)
    drawn = _draw(zs, ms, [params[i] for i in rows], seeds, draws,
                  on_device).astype(mx.int32)
    assert arg is not None
    # put each drawn token at its row; greedy rows keep their argmax
    scattered = mx.zeros((n,), mx.int32).at[sel].add(drawn)
    return SampleDraft(mx.where(mx.array(greedy), arg, scattered), z, row_max)
