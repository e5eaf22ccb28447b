"""Gemma 3 family against transformers' Gemma3ForCausalLM on tiny random checkpoints.

The window (8-12 tokens) is far shorter than the 40-token prompt, so the sliding
layers' off-by-one, the two RoPE tables and the cache/mask handling at decode all
show up in the logits or the greedy tokens.
"""

from __future__ import annotations  # noqa: I001  (slotserve preloads OpenBLAS before MLX)

from pathlib import Path
from typing import Any

import slotserve  # noqa: F401
import mlx.core as mx
import numpy as np
import pytest

from slotserve.model import layers
from slotserve.model.layers import Batch
from slotserve.runtime.plain import greedy_tokens

from model_checks import assert_mixed_decode_matches_solo
from slotserve.model.loader import load

ROW_FLOOR = 16  # matmul rows the model-level invariance checks pad to

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

PROMPT_LEN = 40
NEW_TOKENS = 32
VARIANTS: dict[str, dict[str, Any]] = {
    # linear rope scaling on the global layers, logit softcap, MQA, window 8
    "scaled": dict(
        num_hidden_layers=6, num_key_value_heads=1, head_dim=32, sliding_window=8,
        layer_types=["sliding_attention", "sliding_attention", "full_attention"] * 2,
        rope_scaling={"rope_type": "linear", "factor": 4.0}, rope_theta=50_000.0,
        rope_local_base_freq=5_000.0, final_logit_softcapping=30.0, query_pre_attn_scalar=24,
    ),
    # gemma-3-270m's shape in miniature: default pattern (5 sliding, 1 global), GQA
    "plain": dict(
        num_hidden_layers=6, num_key_value_heads=2, head_dim=16, sliding_window=12,
        query_pre_attn_scalar=16,
    ),
}


def _hf_model(variant: str) -> Any:
    cfg = transformers.Gemma3TextConfig(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_attention_heads=4,
        max_position_embeddings=256, rms_norm_eps=1e-6, **VARIANTS[variant],
    )
    torch.manual_seed(0)
    model = transformers.Gemma3ForCausalLM(cfg).eval()
    with torch.no_grad():  # HF zero-inits norms; random ones exercise the (1 + w) form
        for name, p in model.named_parameters():
            p.normal_(0.0, 0.3 if "norm" in name else 0.08)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def pair(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Any:
    hf = _hf_model(request.param)
    path = Path(tmp_path_factory.mktemp(f"gemma3-{request.param}"))
    hf.save_pretrained(path)
    ours = load(path, device="cpu", with_tokenizer=False)
    assert ours.config.family == "gemma3"
    prompt = np.random.default_rng(1).integers(3, 512, PROMPT_LEN).tolist()
    return hf, ours.model, prompt


def test_config_parsed_from_transformers5_json(pair: Any) -> None:
    hf, model, _ = pair
    c, h = model.config, hf.config
    assert c.layer_types == list(h.layer_types)
    assert c.sliding_window == h.sliding_window
    assert c.rope_theta == h.rope_parameters["full_attention"]["rope_theta"]
    assert c.rope_local_theta == h.rope_parameters["sliding_attention"]["rope_theta"]
    assert c.attn_scale == h.query_pre_attn_scalar**-0.5
    assert c.final_logit_softcapping == h.final_logit_softcapping
    assert {"sliding_attention", "full_attention"} <= set(c.layer_types)


def test_logits_match_all_positions(pair: Any) -> None:
    hf, model, prompt = pair
    with torch.no_grad():
        want = hf(torch.tensor([prompt])).logits[0].numpy()
    n = len(prompt)
    got = model(mx.array(prompt), Batch.build([(model.new_kv(), 0, n)]), list(range(n)))
    diff = np.abs(np.array(got) - want).max()
    assert diff <= 1e-3, diff
    # the same positions reached in two chunks (second chunk starts inside the window)
    kv, cut = model.new_kv(), 17
    model(mx.array(prompt[:cut]), Batch.build([(kv, 0, cut)]), [cut - 1])
    tail = model(mx.array(prompt[cut:]), Batch.build([(kv, cut, n - cut)]), list(range(n - cut)))
    diff = np.abs(np.array(tail) - want[cut:]).max()
    assert diff <= 1e-3, diff


def test_greedy_tokens_match(pair: Any) -> None:
    hf, model, prompt = pair
    with torch.no_grad():
        out = hf.generate(
            torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False,
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
        )
    want = out[0, len(prompt):].tolist()
    assert len(want) == NEW_TOKENS
    assert greedy(model, prompt, NEW_TOKENS) == want


greedy = greedy_tokens


@pytest.fixture
def row_floor(monkeypatch: pytest.MonkeyPatch) -> None:
    """A row floor as the start-up invariance probe would set it for these shapes.

    OpenBLAS takes a small-matrix kernel (other bits) while rows x out-features stays
    under ~1152; with 64-wide outputs that means under 19 rows, so 16 is not enough here.
    """
    monkeypatch.setattr(layers, "LINEAR_ROW_FLOOR", 2 * ROW_FLOOR)


@pytest.mark.usefixtures("row_floor")
def test_batch_and_prefix_invariance(pair: Any) -> None:
    """Sliding-window rows keep their bits in a mixed decode batch and across chunkings."""
    _, model, prompt = pair
    assert_mixed_decode_matches_solo(model, prompt, [11, 222, 333])
    n, m = len(prompt), len(prompt) - 6
    chunk = model(mx.array(prompt), Batch.build([(model.new_kv(), 0, n)]), [n - 1])
    kv = model.new_kv()
    model(mx.array(prompt[:m]), Batch.build([(kv, 0, m)]), [m - 1])
    for pos in range(m, n):
        step = model(mx.array(prompt[pos : pos + 1]), Batch.build([(kv, pos, 1)]), [0])
    assert mx.array_equal(chunk[0], step[0])


def test_chunk_without_logit_rows_still_fills_kv(pair: Any) -> None:
    """An intermediate prefill chunk returns no logits but the next chunk sees its K/V."""
    _, model, prompt = pair
    n, cut = len(prompt), 20
    whole = model(mx.array(prompt), Batch.build([(model.new_kv(), 0, n)]), [n - 1])
    kv = model.new_kv()
    assert model(mx.array(prompt[:cut]), Batch.build([(kv, 0, cut)]), []) is None
    tail = model(mx.array(prompt[cut:]), Batch.build([(kv, cut, n - cut)]), [n - cut - 1])
    assert np.abs(np.array(tail) - np.array(whole)).max() <= 1e-5
