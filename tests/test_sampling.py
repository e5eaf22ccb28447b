"""Sampler tests: exactness against numpy references and batch invariance, no mocks."""

from __future__ import annotations

import math

import mlx.core as mx
import numpy as np
import pytest

from slotserve.runtime.sampling import (
    RowState,
    SamplingParams,
    apply_penalties,
    sample_rows,
    uniform_for,
)


def _states(params: list[SamplingParams], prompts: list[list[int]] | None = None) -> list:
    prompts = prompts or [[] for _ in params]
    return [RowState(p, prompt) for p, prompt in zip(params, prompts, strict=True)]


def _log_softmax(z: np.ndarray) -> np.ndarray:
    z = z.astype(np.float64)
    m = z.max(axis=-1, keepdims=True)
    return z - m - np.log(np.exp(z - m).sum(axis=-1, keepdims=True))


def _draws(logits: np.ndarray, params: SamplingParams, count: int, rows: int = 64) -> np.ndarray:
    """Many draws of one distribution: distinct positions of one seed, batched."""
    z = mx.array(np.tile(logits.astype(np.float32), (rows, 1)))
    states = _states([params] * rows)
    out: list[int] = []
    for start in range(0, count, rows):
        positions = list(range(start, start + rows))
        out += sample_rows(z, [params] * rows, states, positions).tokens
    return np.array(out[:count])


def _chi_square(counts: np.ndarray, probs: np.ndarray) -> float:
    expected = probs * counts.sum()
    live = expected > 0
    assert counts[~live].sum() == 0, "sampled a token with zero probability"
    return float((((counts - expected) ** 2)[live] / expected[live]).sum())


def _reference_token(z: np.ndarray, p: SamplingParams, u: float) -> int:
    """Slow float64 statement of the documented semantics, for one row."""
    if p.temperature == 0 or p.top_k == 1:
        return int(np.argmax(z))
    vocab = len(z)
    e = np.exp((z.astype(np.float64) - z.max()) / p.temperature)
    order = np.argsort(-e, kind="stable")
    ranked = e[order]
    k = p.top_k if 0 < p.top_k < vocab else vocab
    c = k
    if p.top_p < 1.0:
        before = np.concatenate([[0.0], np.cumsum(ranked)[:-1]])
        c = min(k, int((before[:k] < p.top_p * ranked[:k].sum()).sum()))
    keep = np.zeros(vocab, bool)
    keep[order[:c]] = True
    keep &= e >= p.min_p
    probs = np.where(keep, e, 0.0)
    cdf = np.cumsum(probs / probs.sum())
    return int(min(np.searchsorted(cdf, u, side="right"), np.flatnonzero(keep)[-1]))


def _random_params(rng: np.random.Generator, vocab: int) -> SamplingParams:
    kind = rng.integers(0, 8)
    bias = None
    if rng.random() < 0.3:
        bias = {int(t): float(rng.uniform(-5, 5)) for t in rng.integers(0, vocab, 4)}
    return SamplingParams(
        temperature=0.0 if kind == 0 else float(rng.uniform(0.2, 2.0)),
        top_k=int(rng.choice([0, 0, 1, 5, 50, vocab // 3 + 7])),
        top_p=float(rng.choice([1.0, 1.0, 0.5, 0.9, 0.97])),
        min_p=float(rng.choice([0.0, 0.0, 0.05, 0.3])),
        repetition_penalty=float(rng.choice([1.0, 1.0, 1.3, 0.8])),
        frequency_penalty=float(rng.choice([0.0, 0.0, 0.7, -0.4])),
        presence_penalty=float(rng.choice([0.0, 0.0, 0.5])),
        logit_bias=bias,
        seed=int(rng.integers(0, 2**63)),
    )


def _random_logits(rng: np.random.Generator, rows: int, vocab: int) -> np.ndarray:
    """Peaked (LLM-like), flat and coarsely quantised (tie-heavy) rows: every path gets used."""
    scale = rng.choice([0.3, 1.0, 3.0, 6.0], size=(rows, 1))
    logits = rng.standard_normal((rows, vocab)) * scale
    quantised = rng.random(rows) < 0.3
    logits[quantised] = np.round(logits[quantised])
    return logits.astype(np.float32)


def _history_state(rng: np.random.Generator, p: SamplingParams, vocab: int) -> RowState:
    state = RowState(p, rng.integers(0, vocab, 20).tolist())
    for t in rng.integers(0, vocab, int(rng.integers(0, 12))):
        state.observe(int(t))
    return state


def test_greedy_is_argmax_with_lowest_index_ties() -> None:
    rng = np.random.default_rng(1)
    logits = rng.standard_normal((8, 1000)).astype(np.float32)
    logits[3, [10, 500, 900]] = 50.0
    params = [SamplingParams(temperature=0.0)] * 8
    tokens = sample_rows(mx.array(logits), params, _states(params)).tokens
    assert tokens == np.argmax(logits, axis=-1).tolist()
    assert tokens[3] == 10


def test_top_k_one_and_tiny_top_p_are_greedy() -> None:
    rng = np.random.default_rng(2)
    logits = rng.standard_normal((16, 500)).astype(np.float32)
    logits[0, [7, 8]] = 9.0
    expected = np.argmax(logits, axis=-1).tolist()
    for p in (SamplingParams(top_k=1, temperature=1.5, seed=3),
              SamplingParams(top_p=1e-6, temperature=1.5, seed=3)):
        params = [p] * 16
        for pos in range(5):
            assert sample_rows(mx.array(logits), params, _states(params), [pos] * 16).tokens \
                == expected


def test_same_seed_same_tokens_and_seed_recorded() -> None:
    rng = np.random.default_rng(3)
    logits = mx.array(rng.standard_normal((4, 300)).astype(np.float32))
    params = [SamplingParams(temperature=1.0, top_p=0.9, seed=s) for s in (1, 2, 3, 4)]
    runs = [[sample_rows(logits, params, _states(params), [pos] * 4).tokens for pos in range(30)]
            for _ in range(2)]
    assert runs[0] == runs[1]
    assert len({tuple(step) for step in runs[0]}) > 20  # positions advance the stream

    unseeded = SamplingParams(temperature=1.0)
    state = RowState(unseeded)
    replay = RowState(SamplingParams(temperature=1.0, seed=state.seed))
    a = [sample_rows(logits[:1], [unseeded], [state], [i]).tokens for i in range(20)]
    b = [sample_rows(logits[:1], [replay.params], [replay], [i]).tokens for i in range(20)]
    assert a == b


def test_uniform_for_is_uniform_and_below_one() -> None:
    u = np.array([uniform_for(12345, i) for i in range(20000)])
    assert u.min() >= 0.0 and u.max() < 1.0
    assert abs(u.mean() - 0.5) < 0.01
    counts, _ = np.histogram(u, bins=10, range=(0, 1))
    assert _chi_square(counts, np.full(10, 0.1)) < 30
    assert uniform_for(1, 5) != uniform_for(2, 5) != uniform_for(1, 6)


@pytest.mark.parametrize("vocab", [1001, 4096, 49152])
def test_row_alone_equals_row_in_batch(vocab: int) -> None:
    rng = np.random.default_rng(vocab)
    trials = 40 if vocab < 10000 else 8
    for _ in range(trials):
        logits = _random_logits(rng, 16, vocab)
        params = [_random_params(rng, vocab) for _ in range(16)]
        states = [_history_state(rng, p, vocab) for p in params]
        positions = rng.integers(0, 10_000, 16).tolist()
        batch = sample_rows(mx.array(logits), params, states, positions,
                            logprobs=True, top_logprobs=3)
        for i in range(16):
            alone = sample_rows(mx.array(logits[i : i + 1]), params[i : i + 1],
                                states[i : i + 1], positions[i : i + 1],
                                logprobs=True, top_logprobs=3)
            assert alone.tokens[0] == batch.tokens[i], (i, params[i])
            assert alone.logprobs[0] == batch.logprobs[i]
            assert alone.top_logprobs[0] == batch.top_logprobs[i]


def test_wide_nucleus_fallback_is_batch_invariant() -> None:
    """Flat rows whose nucleus exceeds the top-k prefix take the full-sort path."""
    rng = np.random.default_rng(7)
    vocab = 49152
    logits = (rng.standard_normal((6, vocab)) * 0.5).astype(np.float32)
    params = [SamplingParams(temperature=1.0, top_p=0.95, seed=i) for i in range(3)]
    params += [SamplingParams(temperature=0.8, top_k=40, seed=9),
               SamplingParams(temperature=0.0), SamplingParams(min_p=0.2, seed=4)]
    states = _states(params)
    batch = sample_rows(mx.array(logits), params, states, [11] * 6).tokens
    for i in range(6):
        assert sample_rows(mx.array(logits[i : i + 1]), params[i : i + 1], states[i : i + 1],
                           [11]).tokens == [batch[i]]


def test_matches_float64_reference_semantics() -> None:
    rng = np.random.default_rng(8)
    vocab = 777
    mismatches = 0
    for _ in range(25):
        logits = _random_logits(rng, 16, vocab)
        params = [_random_params(rng, vocab) for _ in range(16)]
        params = [SamplingParams(temperature=p.temperature, top_k=p.top_k, top_p=p.top_p,
                                 min_p=p.min_p, seed=p.seed) for p in params]
        positions = rng.integers(0, 1000, 16).tolist()
        got = sample_rows(mx.array(logits), params, _states(params), positions).tokens
        for i, p in enumerate(params):
            want = _reference_token(logits[i], p, uniform_for(p.seed, positions[i]))
            mismatches += got[i] != want
    assert mismatches == 0


@pytest.mark.parametrize("temperature", [0.5, 1.0, 1.7])
def test_temperature_distribution(temperature: float) -> None:
    logits = np.array([2.0, 1.5, 1.0, 0.3, 0.0, -0.5, -1.0, -3.0], np.float32)
    draws = _draws(logits, SamplingParams(temperature=temperature, seed=5), 12800)
    probs = np.exp(_log_softmax(logits / temperature))
    # df = 7: P(chi2 > 29) ~ 1.4e-4
    assert _chi_square(np.bincount(draws, minlength=8), probs) < 29


def test_top_k_top_p_min_p_distributions() -> None:
    logits = np.log(np.array([0.4, 0.25, 0.15, 0.1, 0.05, 0.03, 0.02], np.float64))
    logits = logits.astype(np.float32)

    def check(params: SamplingParams, kept: list[int]) -> None:
        base = np.exp(_log_softmax(logits / params.temperature))
        probs = np.zeros(7)
        probs[kept] = base[kept] / base[kept].sum()
        counts = np.bincount(_draws(logits, params, 6400), minlength=7)
        assert set(np.flatnonzero(counts)) == set(kept)
        assert _chi_square(counts, probs) < 25

    check(SamplingParams(top_k=3, seed=1), [0, 1, 2])
    # Nucleus: 0.4 + 0.25 = 0.65 < 0.7, so token 2 completes it.
    check(SamplingParams(top_p=0.7, seed=2), [0, 1, 2])
    # top_p over the top_k-renormalised mass: 0.4 / 0.65 = 0.615 >= 0.6 keeps one token.
    check(SamplingParams(top_k=2, top_p=0.6, seed=3), [0])
    # min_p relative to the max: 0.4 * 0.2 = 0.08 keeps 0.4 .. 0.1.
    check(SamplingParams(min_p=0.2, seed=4), [0, 1, 2, 3])
    # min_p on temperature-scaled probabilities: at T=0.5 ratios square, (0.15/0.4)^2 < 0.2.
    check(SamplingParams(min_p=0.2, temperature=0.5, seed=4), [0, 1])


def test_top_k_ties_keep_lowest_ids() -> None:
    logits = np.zeros(10, np.float32)
    draws = _draws(logits, SamplingParams(top_k=3, seed=1), 640)
    assert set(draws.tolist()) == {0, 1, 2}
    logits[[4, 6]] = 1.0
    draws = _draws(logits, SamplingParams(top_k=3, seed=1), 640)
    assert set(draws.tolist()) == {4, 6, 0}


def _reference_penalties(z: np.ndarray, p: SamplingParams, prompt: list[int],
                         generated: list[int]) -> np.ndarray:
    out = z.astype(np.float64).copy()
    for t in set(prompt) | set(generated):
        out[t] = out[t] / p.repetition_penalty if out[t] > 0 else out[t] * p.repetition_penalty
    counts = np.bincount(generated, minlength=len(z)).astype(np.float64)
    out -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0)
    for t, b in (p.logit_bias or {}).items():
        out[t] += min(max(b, -100.0), 100.0)
    return out


def test_penalties_match_numpy_reference() -> None:
    rng = np.random.default_rng(11)
    vocab = 20
    params = [
        SamplingParams(repetition_penalty=1.3),
        SamplingParams(frequency_penalty=0.6, presence_penalty=0.4),
        SamplingParams(repetition_penalty=0.7, frequency_penalty=-0.3, presence_penalty=1.1,
                       logit_bias={0: 3.5, 5: -250.0, 19: 101.0}),
        SamplingParams(logit_bias={2: -1.0}),
        SamplingParams(),
    ]
    prompts = [rng.integers(0, vocab, 8).tolist() for _ in params]
    generated = [rng.integers(0, vocab, 10).tolist() for _ in params]
    states = _states(params, prompts)
    for state, gen in zip(states, generated, strict=True):
        for t in gen:
            state.observe(t)
    logits = (rng.standard_normal((len(params), vocab)) * 4).astype(np.float32)
    got = np.array(apply_penalties(mx.array(logits), states))
    for i, p in enumerate(params):
        want = _reference_penalties(logits[i], p, prompts[i], generated[i])
        np.testing.assert_allclose(got[i], want, rtol=0, atol=1e-5)
    assert np.array_equal(got[4], logits[4])  # no penalties: bit-identical

    # The sampler sees exactly these logits: greedy picks and full logprobs agree.
    greedy = [SamplingParams(temperature=0.0, repetition_penalty=p.repetition_penalty,
                             frequency_penalty=p.frequency_penalty,
                             presence_penalty=p.presence_penalty, logit_bias=p.logit_bias)
              for p in params]
    gstates = _states(greedy, prompts)
    for state, gen in zip(gstates, generated, strict=True):
        for t in gen:
            state.observe(t)
    res = sample_rows(mx.array(logits), greedy, gstates, top_logprobs=20)
    for i, p in enumerate(params):
        want = _reference_penalties(logits[i], p, prompts[i], generated[i])
        assert res.tokens[i] == int(np.argmax(want))
        lp = dict(res.top_logprobs[i])
        np.testing.assert_allclose([lp[t] for t in range(vocab)], _log_softmax(want),
                                   rtol=0, atol=1e-5)


def test_repetition_uses_prompt_but_frequency_only_generated() -> None:
    p = SamplingParams(repetition_penalty=2.0, frequency_penalty=1.0, presence_penalty=0.5)
    state = RowState(p, [3, 3, 4])
    state.observe(4)
    state.observe(4)
    state.observe(9)
    assert state.generated_counts() == {4: 2, 9: 1}
    assert state.num_generated == 3
    z = np.array(apply_penalties(mx.array(np.full((1, 12), 2.0, np.float32)), [state]))[0]
    assert z[3] == pytest.approx(1.0)  # prompt only: repetition penalty, no counts
    assert z[4] == pytest.approx(1.0 - 2.0 - 0.5)
    assert z[9] == pytest.approx(1.0 - 1.0 - 0.5)
    assert z[0] == 2.0


def test_logit_bias_bans_and_forces() -> None:
    logits = np.array([0.0, 1.0, 5.0, 0.5, -1.0, 2.0, 0.0, -2.0], np.float32)
    banned = _draws(logits, SamplingParams(logit_bias={2: -100.0}, seed=1), 2560)
    assert 2 not in set(banned.tolist())
    forced = _draws(logits, SamplingParams(logit_bias={7: 100.0}, seed=2, temperature=2.0), 640)
    assert set(forced.tolist()) == {7}


def test_logprobs_match_numpy_log_softmax() -> None:
    rng = np.random.default_rng(13)
    logits = (rng.standard_normal((6, 5000)) * 3).astype(np.float32)
    params = [SamplingParams(temperature=t, top_p=0.9, seed=i)
              for i, t in enumerate([0.0, 0.3, 1.0, 1.0, 1.9, 0.0])]
    res = sample_rows(mx.array(logits), params, _states(params), logprobs=True,
                      top_logprobs=5)
    ref = _log_softmax(logits)
    for i in range(6):
        assert res.logprobs[i] == pytest.approx(ref[i, res.tokens[i]], abs=1e-5)
        top = np.argsort(-ref[i], kind="stable")[:5]
        assert [t for t, _ in res.top_logprobs[i]] == top.tolist()
        np.testing.assert_allclose([v for _, v in res.top_logprobs[i]], ref[i, top], atol=1e-5)
    plain = sample_rows(mx.array(logits), params, _states(params))
    assert plain.logprobs is None and plain.top_logprobs is None
    assert plain.tokens == res.tokens


def test_extreme_valid_knobs_stay_finite() -> None:
    """The edges validate accepts keep every token and logprob finite, even for large logits."""
    rng = np.random.default_rng(5)
    logits = (rng.standard_normal((8, 3000)) * 40).astype(np.float32)
    knobs = [{"repetition_penalty": 0.01}, {"repetition_penalty": 100.0},
             {"repetition_penalty": 0.01, "temperature": 1e-30},
             {"repetition_penalty": 100.0, "top_p": 1e-30, "temperature": 2.0},
             {"frequency_penalty": 2.0, "presence_penalty": -2.0, "min_p": 1e-30},
             {"temperature": 1e-30, "logit_bias": {5: 1e300}},
             {"top_p": 1e-30, "top_k": 3, "logit_bias": {7: -1e300}},
             {"repetition_penalty": 0.01, "logit_bias": {9: 100.0}, "temperature": 2.0}]
    params = [SamplingParams(seed=i, **k) for i, k in enumerate(knobs)]
    for p in params:
        p.validate(3000)
    states = [RowState(p, prompt_tokens=list(range(0, 3000, 3))) for p in params]
    for s in states:
        for t in range(1, 3000, 7):
            s.observe(t)
    res = sample_rows(mx.array(logits), params, states, logprobs=True, top_logprobs=5)
    assert all(0 <= t < 3000 for t in res.tokens)
    assert all(math.isfinite(v) for v in res.logprobs)
    assert all(math.isfinite(v) for row in res.top_logprobs for _, v in row)


def test_positions_default_to_generated_count_and_states_untouched() -> None:
    logits = mx.array(np.random.default_rng(4).standard_normal((1, 200)).astype(np.float32))
    p = SamplingParams(seed=77)
    state = RowState(p)
    first = sample_rows(logits, [p], [state]).tokens
    assert state.num_generated == 0
    assert sample_rows(logits, [p], [state], [0]).tokens == first
    state.observe(first[0])
    assert sample_rows(logits, [p], [state]).tokens == sample_rows(logits, [p], [state],
                                                                   [1]).tokens


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": 2.5}, "temperature"),
        ({"temperature": math.nan}, "temperature"),
        ({"top_k": -1}, "top_k"),
        ({"top_k": 2.5}, "top_k"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.01}, "top_p"),
        ({"min_p": -0.01}, "min_p"),
        ({"min_p": 1.5}, "min_p"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        # pass "> 0" and break float32: 0 there (NaN logits), inf, or no float at all
        ({"repetition_penalty": 1e-50}, "repetition_penalty"),
        ({"repetition_penalty": 1e308}, "repetition_penalty"),
        ({"repetition_penalty": 10**400}, "repetition_penalty"),
        ({"repetition_penalty": 0.0099}, "repetition_penalty"),
        ({"repetition_penalty": 100.5}, "repetition_penalty"),
        ({"top_p": 1e-50}, "top_p"),
        ({"top_p": 1e-40}, "top_p"),  # subnormal in float32: GPUs flush it to 0
        ({"temperature": 1e-45}, "temperature"),
        ({"temperature": 10**400}, "temperature"),
        ({"min_p": math.inf}, "min_p"),
        ({"frequency_penalty": 2.5}, "frequency_penalty"),
        ({"presence_penalty": -3.0}, "presence_penalty"),
        ({"logit_bias": {100: 1.0}}, "out of range"),
        ({"logit_bias": {-1: 1.0}}, "out of range"),
        ({"logit_bias": {"5": 1.0}}, "integer token ids"),
        ({"logit_bias": {5: math.inf}}, "finite"),
        ({"seed": 1.5}, "seed"),
    ],
)
def test_validate_rejects(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs).validate(vocab_size=100)


def test_validate_accepts_edges() -> None:
    for kwargs in ({}, {"temperature": 0.0}, {"temperature": 2}, {"top_p": 1.0, "min_p": 1.0},
                   {"logit_bias": {0: -100, 99: 150.0}}, {"seed": -5}, {"top_k": 1000},
                   {"repetition_penalty": 0.01}, {"repetition_penalty": 100},
                   {"temperature": 1e-30}, {"top_p": 1e-30}, {"min_p": 1e-50},
                   {"frequency_penalty": -2, "presence_penalty": 2}):
        SamplingParams(**kwargs).validate(vocab_size=100)


def test_bad_shapes_rejected() -> None:
    p = SamplingParams()
    with pytest.raises(ValueError):
        sample_rows(mx.zeros((2, 10)), [p], [RowState(p)])
    with pytest.raises(ValueError):
        sample_rows(mx.zeros((10,)), [p], [RowState(p)])


def test_masked_logits_are_never_sampled() -> None:
    """Grammar masks arrive as -inf logits; no path may pick a masked token."""
    rng = np.random.default_rng(17)
    vocab = 3000
    allowed = [5, 17, 2999, 1234, 800]
    logits = np.full((8, vocab), -np.inf, np.float32)
    logits[:, allowed] = rng.standard_normal((8, len(allowed))).astype(np.float32)
    params = [SamplingParams(temperature=0.0), SamplingParams(top_k=100, seed=1),
              SamplingParams(top_p=0.999, seed=2), SamplingParams(min_p=0.01, seed=3),
              SamplingParams(temperature=2.0, seed=4),
              SamplingParams(logit_bias={0: 100.0}, frequency_penalty=1.0, seed=5),
              SamplingParams(top_k=2000, top_p=0.95, seed=6), SamplingParams(seed=7)]
    states = _states(params)
    for pos in range(40):
        res = sample_rows(mx.array(logits), params, states, [pos] * 8, logprobs=True)
        assert set(res.tokens) <= set(allowed)
        assert all(math.isfinite(lp) for lp in res.logprobs)


def test_half_precision_logits() -> None:
    logits = np.random.default_rng(19).standard_normal((3, 400)).astype(np.float32)
    params = [SamplingParams(temperature=0.0), SamplingParams(top_p=0.8, seed=1),
              SamplingParams(top_k=10, seed=2)]
    half = mx.array(logits).astype(mx.bfloat16)
    res = sample_rows(half, params, _states(params))
    ref = sample_rows(half.astype(mx.float32), params, _states(params))
    assert res.tokens == ref.tokens
