"""The Gated DeltaNet math (slotserve.model.deltanet) against transformers' reference
functions, and the rule that makes it batch invariant: how a position is computed depends
on its absolute position alone, so aligned prefill chunks, mixed batches and decode rows
give every row the same bits as the sequence alone."""

from __future__ import annotations  # noqa: I001  (slotserve preloads OpenBLAS before MLX)

from pathlib import Path
from typing import Any

import slotserve  # noqa: F401
import mlx.core as mx
import numpy as np
import pytest

from slotserve.model import deltanet
from slotserve.model.layers import Batch
from slotserve.model.loader import load

from test_oracle_qwen3_5 import TEXT, randomize

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
qwen3_next = pytest.importorskip("transformers.models.qwen3_next.modeling_qwen3_next")


def _inputs(t: int, hk: int, hv: int, dk: int, dv: int, seed: int = 0) -> list[np.ndarray]:
    r = np.random.RandomState(seed)
    q, k = r.randn(1, t, hk, dk), r.randn(1, t, hk, dk)
    v = r.randn(1, t, hv, dv)
    g = -np.exp(r.uniform(-3, 1, (1, t, hv)))  # log decays, some near 0, some strong
    beta = 1 / (1 + np.exp(-r.randn(1, t, hv)))
    return [a.astype(np.float32) for a in (q, k, v, g, beta)]


def _ours(q: np.ndarray, k: np.ndarray, v: np.ndarray, g: np.ndarray,
          beta: np.ndarray, *, chunked: bool) -> tuple[np.ndarray, np.ndarray]:
    """Our rule on HF-shaped inputs: normed, scaled and head-repeated as GatedDeltaNet does."""
    hk, hv, dk, dv = q.shape[2], v.shape[2], q.shape[3], v.shape[3]
    qm, km = (deltanet.l2norm(mx.array(x[0])) for x in (q, k))
    qm = qm * dk**-0.5
    qm, km = mx.repeat(qm, hv // hk, axis=1), mx.repeat(km, hv // hk, axis=1)
    vm, gm, bm = mx.array(v[0]), mx.array(g[0]), mx.array(beta[0])
    s = mx.zeros((hv, dv, dk))
    if chunked:
        o, states = deltanet.chunked(s, qm, km, vm, gm, bm)
        s = states[-1]
    else:
        outs = []
        for t in range(q.shape[1]):
            o1, s1 = deltanet.recurrent_step(s[None], qm[t : t + 1], km[t : t + 1],
                                             vm[t : t + 1], gm[t : t + 1], bm[t : t + 1])
            outs.append(o1)
            s = s1[0]
        o = mx.concatenate(outs)
    return np.array(o), np.array(s.swapaxes(-1, -2))  # S as HF holds it: [H, dk, dv]


@pytest.mark.parametrize("chunked", [True, False])
def test_rule_matches_transformers(chunked: bool) -> None:
    q, k, v, g, beta = _inputs(2 * deltanet.CHUNK, hk=2, hv=4, dk=16, dv=8)
    ref_o, ref_s = qwen3_next.torch_chunk_gated_delta_rule(
        *(torch.tensor(x) for x in (q, k, v)), g=torch.tensor(g), beta=torch.tensor(beta),
        output_final_state=True, use_qk_l2norm_in_kernel=True)
    o, s = _ours(q, k, v, g, beta, chunked=chunked)
    np.testing.assert_allclose(o, ref_o[0].numpy(), atol=2e-5, rtol=1e-4)
    np.testing.assert_allclose(s, ref_s[0].numpy(), atol=2e-5, rtol=1e-4)


def test_conv_is_the_same_per_position_however_rows_are_split() -> None:
    r = np.random.RandomState(1)
    x = mx.array(r.randn(1, 9, 12).astype(np.float32))
    w = mx.array(r.randn(12, 4).astype(np.float32))
    win = mx.zeros((1, 3, 12))
    whole, _ = deltanet.causal_conv(win, x, w)
    a, win2 = deltanet.causal_conv(win, x[:, :5], w)
    b, _ = deltanet.causal_conv(win2, x[:, 5:], w)
    assert mx.array_equal(whole, mx.concatenate([a, b], axis=1))


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Any:
    hf = randomize(transformers.Qwen3_5ForCausalLM(transformers.Qwen3_5TextConfig(**TEXT)), 5)
    path: Path = tmp_path_factory.mktemp("qwen3_5_rule")
    hf.save_pretrained(path, safe_serialization=True)
    return load(path, device="cpu", with_tokenizer=False).model


PROMPT = [int(t) for t in np.random.RandomState(3).randint(0, 320, 150)]


def _run(model: Any, cuts: list[int], decode: int = 3) -> tuple[list[mx.array], Any]:
    """Prefill PROMPT in chunks ending at `cuts`, then decode greedily: every logit row."""
    kv, out, start = model.new_kv(), [], 0
    for end in [*cuts, len(PROMPT)]:
        out.append(model(mx.array(PROMPT[start:end]), Batch.build([(kv, start, end - start)]),
                         [end - start - 1])[0])
        start = end
    for _ in range(decode):
        tok = int(mx.argmax(out[-1]).item())
        out.append(model(mx.array([tok]), Batch.build([(kv, start, 1)]), [0])[0])
        start += 1
    return out, kv


def test_aligned_prefill_chunks_give_the_same_bits(model: Any) -> None:
    whole, _ = _run(model, [])
    for cuts in ([64], [32, 96, 128], [deltanet.CHUNK * 4]):
        split, _ = _run(model, cuts)
        assert mx.array_equal(split[len(cuts)], whole[0]), cuts  # the prompt's last row
        for a, b in zip(split[len(cuts) + 1 :], whole[1:], strict=True):
            assert mx.array_equal(a, b), cuts


def test_rows_in_a_mixed_batch_get_their_solo_bits(model: Any) -> None:
    """Two prefill chunks and two decode rows of four sequences in one step."""
    alone = []
    setups = [(PROMPT[:64], None), (PROMPT[:100], None), (PROMPT[:37], 0), (PROMPT[:130], 0)]
    kvs = []
    for tokens, decode in setups:
        kv = model.new_kv()
        if decode is not None:  # prefilled already, decode its next token in the step
            model(mx.array(tokens), Batch.build([(kv, 0, len(tokens))]), [len(tokens) - 1])
        kvs.append(kv)
    feeds = [(PROMPT[:64], 0), (PROMPT[:100], 0), ([9], 37), ([11], 130)]
    for kv, (tokens, start) in zip(kvs, feeds, strict=True):
        alone.append(model(mx.array(tokens), Batch.build([(kv, start, len(tokens))]),
                           [len(tokens) - 1])[0])
    parts = [(kv, start, len(tokens)) for kv, (tokens, start) in zip(kvs, feeds, strict=True)]
    ends, row = [], 0
    for _, _, n in parts:
        row += n
        ends.append(row - 1)
    together = model(mx.array([t for tokens, _ in feeds for t in tokens]), Batch.build(parts),
                     ends)
    for i in range(4):
        assert mx.array_equal(together[i], alone[i]), i


def test_decode_steps_take_the_last_steps_states_whole(model: Any) -> None:
    """A decode step's new states are rows of its arrays: the next step of the same
    sequences in the same order takes those arrays as they are (deltanet.stacked), another
    order stacks the rows again; every row gets its bits alone either way."""
    lens, feeds = [37, 64, 130], [5, 6, 7, 8]

    def prefilled() -> list[Any]:
        kvs = []
        for n in lens:
            kv = model.new_kv()
            model(mx.array(PROMPT[:n]), Batch.build([(kv, 0, n)]), [n - 1])
            kvs.append(kv)
        return kvs

    alone = []
    for kv, n in zip(prefilled(), lens, strict=True):
        alone.append([model(mx.array([t]), Batch.build([(kv, n + j, 1)]), [0])[0]
                      for j, t in enumerate(feeds)])
    kvs = prefilled()
    got: list[list[mx.array]] = [[] for _ in lens]
    for j, t in enumerate(feeds):
        order = [0, 1, 2] if j < len(feeds) - 1 else [2, 1, 0]  # the last step reordered
        states = [kvs[i].recurrent.at(0, lens[i] + j) for i in order]
        conv, ssm = deltanet.stacked(states)
        whole = conv is states[0].conv_ and ssm is states[0].ssm_
        assert whole == (0 < j < len(feeds) - 1), j  # after a step of the same rows in order
        out = model(mx.array([t] * len(lens)),
                    Batch.build([(kvs[i], lens[i] + j, 1) for i in order]), [0, 1, 2])
        for row, i in enumerate(order):
            got[i].append(out[row])
    for i in range(len(lens)):
        for j in range(len(feeds)):
            assert mx.array_equal(got[i][j], alone[i][j]), (i, j)


def test_canonical_states_are_marked_at_page_boundaries_and_the_last(model: Any) -> None:
    kv = model.new_kv()
    kv.recurrent.keep_marks = True
    n = 300
    tokens = (PROMPT * 2)[:n]
    model(mx.array(tokens), Batch.build([(kv, 0, n)]), [n - 1])
    # page boundaries, and 288: where the chunked form stopped (288..299 ran recurrently)
    assert sorted(kv.recurrent.marks) == [128, 256, 288]
    assert kv.recurrent.snapshot(128) is not None
    # a cold prefill of the first page ends in the very state marked there
    cold = model.new_kv()
    model(mx.array(tokens[:128]), Batch.build([(cold, 0, 128)]), [127])
    for layer, state in enumerate(kv.recurrent.snapshot(128) or []):
        assert mx.array_equal(state.ssm, cold.recurrent.at(layer, 128).ssm)
        assert mx.array_equal(state.conv, cold.recurrent.at(layer, 128).conv)
