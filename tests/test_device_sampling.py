"""The device sampler (runtime.sampling, on_device): the host path's tokens, batch
invariance, and no value read back before the step's tokens, down to the runner."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import mlx.core as mx
import numpy as np
import pytest
from test_sampling import _history_state, _random_logits, _random_params

from slotserve.runtime.runner import ModelRunner, RowWork
from slotserve.runtime.sampling import (
    RowState,
    SamplingParams,
    device_uniforms,
    draft_rows,
    sample_rows,
    uniform_for,
)


def test_device_uniforms_are_uniform_for() -> None:
    rng = np.random.default_rng(0)
    seeds = [int(s) for s in rng.integers(0, 2**63, 300)] + [0, 2**64 - 1, (-5) & (2**64 - 1)]
    positions = [int(p) for p in rng.integers(0, 2**40, 300)] + [0, 2**63, 7]
    got = np.array(device_uniforms(seeds, positions)).tolist()
    assert got == [uniform_for(s, p) for s, p in zip(seeds, positions, strict=True)]


@pytest.mark.parametrize("vocab", [1001, 49152])
def test_device_path_gives_the_host_paths_tokens(vocab: int) -> None:
    """Same tokens and logprobs, for every knob mix, peaked and flat (wide nucleus) rows:
    the host path's top-k prefix, partition and numpy fallbacks all end in these numbers."""
    rng = np.random.default_rng(vocab + 1)
    for trial in range(12 if vocab < 10000 else 4):
        logits = _random_logits(rng, 16, vocab)
        if trial % 2:
            logits[:8] *= 0.05  # nearly flat: nuclei of most of the vocabulary
        params = [_random_params(rng, vocab) for _ in range(16)]
        states = [_history_state(rng, p, vocab) for p in params]
        positions = rng.integers(0, 10_000, 16).tolist()
        host = sample_rows(mx.array(logits), params, states, positions, top_logprobs=2)
        dev = sample_rows(mx.array(logits), params, states, positions, top_logprobs=2,
                          on_device=True)
        assert dev.tokens == host.tokens, [p for p, a, b in
                                           zip(params, dev.tokens, host.tokens, strict=True)
                                           if a != b]
        assert dev.logprobs == host.logprobs and dev.top_logprobs == host.top_logprobs
    # top_k alone (no running sums on the device), ties included
    logits = np.round(_random_logits(rng, 4, vocab))
    params = [SamplingParams(top_k=k, temperature=0.9, seed=k) for k in (2, 5, 40, vocab - 1)]
    states = [RowState(p) for p in params]
    for pos in range(3):
        assert sample_rows(mx.array(logits), params, states, [pos] * 4, on_device=True).tokens \
            == sample_rows(mx.array(logits), params, states, [pos] * 4).tokens


def test_sampled_row_alone_equals_batched_with_other_params() -> None:
    """Each sampled row draws the same tokens, step after step, alone and in batches of
    other sizes, orders and knobs (greedy rows, other truncations, penalties, other seeds)."""
    rng = np.random.default_rng(21)
    vocab = 4096
    targets = [SamplingParams(temperature=0.7, top_p=0.9, seed=1),
               SamplingParams(temperature=0.7, top_k=40, seed=2),
               SamplingParams(temperature=1.1, min_p=0.05, repetition_penalty=1.2,
                              frequency_penalty=0.5, logit_bias={7: 3.0}, seed=3),
               SamplingParams(temperature=0.9, top_k=300, top_p=0.8, presence_penalty=0.4,
                              seed=4)]
    prompt = rng.integers(0, vocab, 30).tolist()
    for step in range(6):
        logits = _random_logits(rng, 64, vocab)
        others = [_random_params(rng, vocab) for _ in range(64)]
        for j, target in enumerate(targets):
            state = RowState(target, prompt)
            for t in rng.integers(0, vocab, step):
                state.observe(int(t))
            alone = sample_rows(mx.array(logits[j : j + 1]), [target], [state], [step],
                                on_device=True).tokens[0]
            for size in (2, 9, 64):
                at = int(rng.integers(0, size))
                rows = rng.choice(np.delete(np.arange(64), j), size - 1, replace=False)
                batch = np.insert(logits[rows], at, logits[j], axis=0)
                params = [others[r] for r in rows]
                params.insert(at, target)
                states = [_history_state(rng, p, vocab) for p in params]
                states[at] = state
                positions = rng.integers(0, 1000, size).tolist()
                positions[at] = step
                got = sample_rows(mx.array(batch), params, states, positions, on_device=True)
                assert got.tokens[at] == alone, (step, target, size)


PARAMS = [SamplingParams(temperature=0.7, top_p=0.9, seed=1), SamplingParams(temperature=0.0),
          SamplingParams(temperature=0.7, top_k=40, seed=3, repetition_penalty=1.2,
                         logit_bias={3: 2.0}),
          SamplingParams(temperature=1.0, min_p=0.1, top_p=0.5, top_k=2000, seed=4)]


def _read_back(fn: Callable[[mx.array], mx.array]) -> str | None:
    """Trace `fn` under mx.compile: evaluating (or reading to the host) any array it has
    built is refused while tracing, so a trace that completes read nothing back."""
    try:
        mx.compile(fn)(mx.zeros((len(PARAMS), 3000)))
    except ValueError as exc:
        return str(exc)
    return None


def test_device_draft_reads_nothing_back() -> None:
    states = [RowState(p, [1, 2, 3, 3]) for p in PARAMS]
    assert _read_back(lambda z: mx.array(np.array(z))) is not None  # the check can fail
    assert _read_back(lambda z: draft_rows(z, PARAMS, states, [4, 5, 6, 7]).tokens)  # host
    assert _read_back(lambda z: draft_rows(z, PARAMS, states, [4, 5, 6, 7],
                                           on_device=True).tokens) is None
    assert _read_back(lambda z: mx.concatenate(draft_rows(
        z, PARAMS, states, [4, 5, 6, 7], on_device=True).outputs(
            logprobs=True, top_logprobs=3)[1:3], axis=-1)) is None


@pytest.fixture(scope="module")
def model() -> Any:
    from slotserve.model.loader import load

    return load(None, device="cpu", with_tokenizer=False, probe_rows=None).model


def _steps(runner: ModelRunner, model: Any, steps: int,
           events: list[str] | None = None) -> Iterator[dict[int, int]]:
    """Prefill three prompts, then decode `steps` steps with PARAMS[:3]: tokens per step."""
    prompts = [[1, 2, 3, 4, 5], [9, 8, 7], list(range(20, 31))]
    kvs = [model.new_kv() for _ in prompts]
    states = [RowState(p, prompt) for p, prompt in zip(PARAMS, prompts, strict=False)]
    feed, start = prompts, [0, 0, 0]
    try:
        for _ in range(steps):
            if events is not None:
                events.append("step")
            work = [RowWork(i, kvs[i], start[i], feed[i], True, PARAMS[i], states[i],
                            states[i].num_generated) for i in range(3)]
            out = runner.step(work)
            tokens = {i: out.sampled[i].token for i in range(3)}
            for i in range(3):
                states[i].observe(tokens[i])
                start[i] += len(feed[i])
            feed = [[tokens[i]] for i in range(3)]
            yield tokens
    finally:
        for kv in kvs:
            kv.release()


def _windows(runner: ModelRunner, model: Any, monkeypatch: pytest.MonkeyPatch,
             ) -> tuple[list[dict[int, int]], list[list[str]]]:
    """Five steps' tokens, and per step what happened from the sampler's start (the step's
    logits are built) on: host reads (mx.eval, numpy conversions of MLX arrays) and the
    queueing of the next step's forward."""
    events: list[str] = []
    sample, speculate, evaluate, to_numpy = runner._sample, runner._speculate, mx.eval, np.array

    def record(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if name != "read" or isinstance(args[0], mx.array):
                events.append(name)
            return fn(*args, **kwargs)
        return wrapper

    monkeypatch.setattr(runner, "_sample", record("sample", sample))
    monkeypatch.setattr(runner, "_speculate", record("speculate", speculate))
    monkeypatch.setattr(mx, "eval", record("eval", evaluate))
    monkeypatch.setattr(np, "array", record("read", to_numpy))
    try:
        tokens = list(_steps(runner, model, 5, events))
    finally:
        monkeypatch.undo()
    steps = [step.split() for step in " ".join(events).split("step")[1:]]
    return tokens, [done[done.index("sample") + 1 :] for done in steps]


def _reads_first(window: list[str]) -> bool:
    assert "speculate" in window and "eval" in window, window  # the tokens are read
    return min(window.index(e) for e in ("eval", "read") if e in window) < window.index(
        "speculate")


def test_pipelined_sampled_step_queues_the_next_before_reading(
        model: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """From the step's logits to the queueing of the next step's forward (the sampler's part
    of the step) nothing is evaluated or read to the host: the device runs on while the host
    waits for the tokens. (The CPU's own forward evaluates as it goes; a GPU's does not.)
    The tokens are the plain runner's; the host-sampling runner reads first (the check can
    fail)."""
    plain = list(_steps(ModelRunner(model), model, 5))
    runner = ModelRunner(model, speculate=True)
    assert runner.device_sampling
    tokens, windows = _windows(runner, model, monkeypatch)
    assert tokens == plain and runner.spec_rows > 0
    assert len(windows) == 5 and not any(map(_reads_first, windows)), windows
    host = ModelRunner(model, speculate=True, device_sampling=False)
    tokens, windows = _windows(host, model, monkeypatch)
    assert tokens == plain and all(map(_reads_first, windows)), windows


@pytest.mark.gpu
@pytest.mark.skipif(not mx.is_available(mx.gpu), reason="needs MLX with a GPU")
def test_gpu_sampled_rows_alone_equal_batched() -> None:
    """On the GPU's own sort, scans and reductions, at a Llama-3 vocabulary: each sampled row
    (top_p, top_k, min_p, penalties; peaked rows and the flat rows of random weights) draws
    the same token alone and in batches of 2, 9 and 64 rows of other knobs, in MLX ops alone."""
    rng = np.random.default_rng(5)
    vocab = 128256
    logits = _random_logits(rng, 64, vocab)
    logits[32:] *= 0.02  # random weights: nearly flat, nuclei of most of the vocabulary
    params = [_random_params(rng, vocab) for _ in range(64)]
    params[:4] = [SamplingParams(temperature=0.7, top_p=0.9, seed=1),
                  SamplingParams(temperature=0.7, top_k=40, seed=2),
                  SamplingParams(temperature=1.0, min_p=0.05, seed=3),
                  SamplingParams(temperature=0.8, top_p=0.95, repetition_penalty=1.3, seed=4)]
    params[32:36] = params[:4]
    states = [_history_state(rng, p, vocab) for p in params]
    positions = rng.integers(0, 1000, 64).tolist()
    with mx.stream(mx.gpu):
        full = mx.array(logits).astype(mx.bfloat16)
        batched = sample_rows(full, params, states, positions, on_device=True).tokens
        for i in [0, 1, 2, 3, 32, 33, 34, 35, *rng.integers(4, 64, 6).tolist()]:
            alone = sample_rows(full[i : i + 1], params[i : i + 1], states[i : i + 1],
                                positions[i : i + 1], on_device=True).tokens
            assert alone == [batched[i]], (i, params[i])
            for size in (2, 9):
                rows = [i, *rng.choice(np.delete(np.arange(64), i), size - 1,
                                       replace=False).tolist()]
                got = sample_rows(full[mx.array(rows)], [params[r] for r in rows],
                                  [states[r] for r in rows], [positions[r] for r in rows],
                                  on_device=True).tokens
                assert got[0] == batched[i], (i, size, params[i])
