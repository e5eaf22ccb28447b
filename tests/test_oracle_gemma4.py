"""Gemma 4 family against transformers' Gemma4ForCausalLM on tiny random checkpoints.

Two variants of the real config class: a dense one shaped like the E2B/E4B models in
miniature (per-layer inputs, the last layers reading shared K/V, double-wide MLPs there)
and a MoE one shaped like the 26B-A4B (experts beside the dense MLP, global layers with
fewer, wider heads whose values are the keys' projection). Both have global layers wider
than the sliding ones, proportional RoPE on them, windows far shorter than the prompt, a
layer scalar and capped logits, so each of those shows up in the logits or greedy tokens.
"""

from __future__ import annotations  # noqa: I001  (slotserve preloads OpenBLAS before MLX)

import json
from pathlib import Path
from typing import Any

import slotserve  # noqa: F401
import mlx.core as mx
import numpy as np
import pytest

from slotserve.kernels.attention import BLOCK
from slotserve.model import layers
from slotserve.model.layers import Batch
from slotserve.runtime.plain import greedy_tokens

from model_checks import assert_mixed_decode_matches_solo, hf_greedy
from slotserve.model.errors import UnsupportedModelError
from slotserve.model.loader import load

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

PROMPT_LEN = 40
NEW_TOKENS = 32
S, F = "sliding_attention", "full_attention"
VARIANTS: dict[str, dict[str, Any]] = {
    # E2B in miniature: per-layer inputs, 2 of 6 layers on shared K/V (double-wide MLP)
    "dense": dict(
        num_hidden_layers=6, layer_types=[S, S, F] * 2, num_key_value_heads=1, head_dim=16,
        global_head_dim=32, sliding_window=8, num_kv_shared_layers=2,
        hidden_size_per_layer_input=8, vocab_size_per_layer_input=512,
        use_double_wide_mlp=True,
    ),
    # 26B-A4B in miniature: experts beside the MLP, k = v on the global layers (fewer heads)
    "moe": dict(
        num_hidden_layers=4, layer_types=[S, F, S, F], num_key_value_heads=2, head_dim=16,
        global_head_dim=32, num_global_key_value_heads=1, attention_k_eq_v=True,
        sliding_window=12, enable_moe_block=True, num_experts=8, top_k_experts=2,
        moe_intermediate_size=32, hidden_size_per_layer_input=0,
    ),
}


def _hf_model(variant: str) -> Any:
    cfg = transformers.Gemma4TextConfig(
        vocab_size=512, hidden_size=64, intermediate_size=96, num_attention_heads=4,
        max_position_embeddings=256, rms_norm_eps=1e-6, final_logit_softcapping=30.0,
        rope_parameters={S: {"rope_type": "default", "rope_theta": 5_000.0},
                         F: {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                             "rope_theta": 100_000.0}},
        **VARIANTS[variant],
    )
    torch.manual_seed(0)
    model = transformers.Gemma4ForCausalLM(cfg).to(torch.float32).eval()
    with torch.no_grad():  # HF inits norms and scalars to one; random ones show a skipped one
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith(("scale", "layer_scalar")):
                p.copy_(1.0 + 0.3 * torch.randn_like(p))
            else:
                p.normal_(0.0, 0.08)
        for name, b in model.named_buffers():
            if name.endswith("layer_scalar"):
                b.copy_(1.0 + 0.3 * torch.randn_like(b))
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def pair(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Any:
    hf = _hf_model(request.param)
    path = Path(tmp_path_factory.mktemp(f"gemma4-{request.param}"))
    hf.save_pretrained(path)
    ours = load(path, device="cpu", with_tokenizer=False)
    assert ours.config.family == "gemma4"
    prompt = np.random.default_rng(1).integers(3, 512, PROMPT_LEN).tolist()
    return hf, ours.model, prompt, path


def test_config_and_pool_follow_the_checkpoint(pair: Any) -> None:
    hf, model, _, _ = pair
    c, h = model.config, hf.config
    assert c.layer_types == list(h.layer_types)
    assert c.sliding_window == h.sliding_window
    assert c.rope_theta == h.rope_parameters[F]["rope_theta"]
    assert c.rope_local_theta == h.rope_parameters[S]["rope_theta"]
    full = h.layer_types.index(F)
    assert (c.global_head_dim, c.global_kv_heads) == (
        h.per_layer_config[full].head_dim, h.per_layer_config[full].num_key_value_heads)
    # the pool holds the layers that write K/V, each its own shape; bytes/token follow
    owners = [i for i, m in enumerate(h.kv_sharing_modes) if m != "reuse"]
    shapes = [(c.kv_heads_of(i), c.head_dim_of(i)) for i in owners]
    pool = model.new_kv().pool
    assert pool.shapes == shapes
    # per token the global layers; the sliding ones keep window rows (a floor per slot)
    sliding = [c.is_sliding(i) for i in owners]
    assert pool.windowed == frozenset(j for j, s in enumerate(sliding) if s)
    assert pool.bytes_per_position == 2 * 4 * sum(
        a * b for (a, b), s in zip(shapes, sliding, strict=True) if not s)
    assert pool.window_bytes == BLOCK * 2 * 4 * sum(
        a * b for (a, b), s in zip(shapes, sliding, strict=True) if s)


def test_logits_match_all_positions(pair: Any) -> None:
    hf, model, prompt, _ = pair
    with torch.no_grad():
        want = hf(torch.tensor([prompt])).logits[0].numpy()
    n = len(prompt)
    got = model(mx.array(prompt), Batch.build([(model.new_kv(), 0, n)]), list(range(n)))
    diff = np.abs(np.array(got) - want).max()
    assert diff <= 1e-3, diff
    # the same positions in two chunks (the second starts inside the window)
    kv, cut = model.new_kv(), 17
    model(mx.array(prompt[:cut]), Batch.build([(kv, 0, cut)]), [cut - 1])
    tail = model(mx.array(prompt[cut:]), Batch.build([(kv, cut, n - cut)]), list(range(n - cut)))
    diff = np.abs(np.array(tail) - want[cut:]).max()
    assert diff <= 1e-3, diff


def test_greedy_tokens_match(pair: Any) -> None:
    hf, model, prompt, _ = pair
    want = hf_greedy(hf, prompt, NEW_TOKENS)
    assert len(want) == NEW_TOKENS
    assert greedy_tokens(model, prompt, NEW_TOKENS) == want


@pytest.fixture
def row_floor(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every matmul padded to 128 rows, as the start-up probe would for these tiny shapes
    (OpenBLAS takes other kernels for small row x column products)."""
    monkeypatch.setattr(layers, "LINEAR_ROW_FLOOR", 128)


@pytest.mark.usefixtures("row_floor")
def test_batch_and_prefix_invariance(pair: Any) -> None:
    """A decode row keeps its bits beside other slots' rows, and prefill and decode give a
    position the same bits (shared-K/V and experts included)."""
    _, model, prompt, _ = pair
    assert_mixed_decode_matches_solo(model, prompt, [11, 222, 333])
    n, m = len(prompt), len(prompt) - 6
    chunk = model(mx.array(prompt), Batch.build([(model.new_kv(), 0, n)]), [n - 1])
    kv = model.new_kv()
    model(mx.array(prompt[:m]), Batch.build([(kv, 0, m)]), [m - 1])
    for pos in range(m, n):
        step = model(mx.array(prompt[pos : pos + 1]), Batch.build([(kv, pos, 1)]), [0])
    assert mx.array_equal(chunk[0], step[0])


def test_multimodal_checkpoint_loads_its_text_decoder(pair: Any, tmp_path: Path) -> None:
    """Gemma4ForConditionalGeneration's names (model.language_model.*, a vision tower)
    load as the same text model; the towers are left out."""
    from safetensors.numpy import load_file, save_file

    hf, model, prompt, path = pair
    raw = load_file(str(path / "model.safetensors"))
    nested = {k.replace("model.", "model.language_model.", 1): v for k, v in raw.items()}
    nested["model.vision_tower.encoder.layers.0.mlp.gate_proj.linear.weight"] = np.zeros(
        (4, 4), np.float32)
    save_file(nested, str(tmp_path / "model.safetensors"))
    text = json.loads((path / "config.json").read_text())
    cfg = {"architectures": ["Gemma4ForConditionalGeneration"], "model_type": "gemma4",
           "text_config": text, "tie_word_embeddings": True}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    other = load(tmp_path, device="cpu", with_tokenizer=False).model
    n = len(prompt)
    a = model(mx.array(prompt), Batch.build([(model.new_kv(), 0, n)]), [n - 1])
    b = other(mx.array(prompt), Batch.build([(other.new_kv(), 0, n)]), [n - 1])
    assert mx.array_equal(a, b)


def test_unsupported_configs_fail_at_load(pair: Any, tmp_path: Path) -> None:
    _, _, _, path = pair
    for key, value in (("use_bidirectional_attention", "all"), ("attention_bias", True)):
        cfg = json.loads((path / "config.json").read_text())
        cfg[key] = value
        (tmp_path / "config.json").write_text(json.dumps(cfg))
        (tmp_path / "model.safetensors").write_bytes((path / "model.safetensors").read_bytes())
        with pytest.raises(UnsupportedModelError, match=key):
            load(tmp_path, device="cpu", with_tokenizer=False)


def test_mlx_ops_attention_matches(pair: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """The MLX-ops attention (the GPU's path for these head sizes): each layer's own view of
    the step's tables (decode groups, prefill blocks, write rows) reads the right K/V."""
    hf, _, prompt, path = pair
    monkeypatch.setattr(layers, "native_attention_for", lambda dtype, head_dim: False)
    model = load(path, device="cpu", with_tokenizer=False, probe_rows=None).model
    assert {b.attn.backend for b in model.layers} == {layers.Backend.MLX}
    with torch.no_grad():
        want = hf(torch.tensor([prompt])).logits[0].numpy()
    n = len(prompt)
    got = model(mx.array(prompt), Batch.build([(model.new_kv(), 0, n)]), list(range(n)))
    assert np.abs(np.array(got) - want).max() <= 1e-3
    seqs = [prompt[:5], prompt[:23], prompt]
    kvs = [model.new_kv() for _ in seqs]
    for kv, s in zip(kvs, seqs, strict=True):
        model(mx.array(s[:-1]), Batch.build([(kv, 0, len(s) - 1)]), [])
    parts = [(kv, len(s) - 1, 1) for kv, s in zip(kvs, seqs, strict=True)]
    together = np.array(model(mx.array([s[-1] for s in seqs]), Batch.build(parts), [0, 1, 2]))
    for i, s in enumerate(seqs):
        assert np.abs(together[i] - want[len(s) - 1]).max() <= 1e-3, i
