"""Qwen3-MoE against Hugging Face transformers on a tiny random checkpoint.

Layer 1 is listed in mlp_only_layers, so the checkpoint mixes sparse and dense
layers; the MoE decode path must also be batch invariant (bit-identical logits
for a row alone or among other sequences' rows).
"""

from __future__ import annotations  # noqa: I001  (slotserve preloads OpenBLAS before MLX)

import json
import shutil
from pathlib import Path
from typing import Any

import slotserve  # noqa: F401
import mlx.core as mx
import numpy as np
import pytest

from slotserve.model import layers
from slotserve.model.layers import Batch
from slotserve.model.moe import GROUP_MIN_PAIRS, SparseMoE
from slotserve.runtime.plain import greedy_tokens

from model_checks import hf_greedy
from slotserve.model.loader import load

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

# 36 rows x top-2 = 72 (row, expert) pairs: prefill takes the grouped expert path
# (GROUP_MIN_PAIRS), single-row decode the plain one; HF checks both.
PROMPT = [11, 200, 35, 8, 371, 90, 144, 3, 260, 57, 19, 301, 6, 128, 75, 222, 40, 333, 97, 2,
          150, 64, 12, 280, 31, 9, 188, 47, 120, 7, 350, 66, 18, 240, 95, 5]
NEW_TOKENS = 32
EXPERTS = 8


def _save(path: Path, norm_topk: bool, tie: bool) -> Any:
    cfg = transformers.Qwen3MoeConfig(
        vocab_size=384, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
        num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        num_experts=EXPERTS, num_experts_per_tok=2, norm_topk_prob=norm_topk,
        decoder_sparse_step=1, mlp_only_layers=[1], rms_norm_eps=1e-6, rope_theta=1_000_000.0,
        max_position_embeddings=512, tie_word_embeddings=tie, initializer_range=0.08,
        bos_token_id=None, eos_token_id=None, pad_token_id=None,
    )
    torch.manual_seed(1)
    hf = transformers.Qwen3MoeForCausalLM(cfg).to(torch.float32).eval()
    with torch.no_grad():  # non-trivial norm weights, so a skipped norm would show
        for name, p in hf.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.3 * torch.randn_like(p))
    hf.save_pretrained(path, safe_serialization=True)
    return hf


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    path = tmp_path_factory.mktemp("qwen3_moe")
    return path, _save(path, norm_topk=True, tie=True)


def _logits(model: Any, tokens: list[int]) -> np.ndarray:
    kv = model.new_kv()
    n = len(tokens)
    out = model(mx.array(tokens), Batch.build([(kv, 0, n)]), logit_rows=list(range(n)))
    return np.array(out)


def _hf_logits(hf: Any, tokens: list[int]) -> np.ndarray:
    with torch.no_grad():
        return hf(torch.tensor([tokens])).logits[0].float().numpy()


def test_config_and_prefill_logits_match_hf(checkpoint: tuple[Path, Any]) -> None:
    path, hf = checkpoint
    loaded = load(path, device="cpu", with_tokenizer=False)
    c = loaded.config
    assert (c.family, c.num_experts, c.experts_per_token, c.mlp_only_layers) == (
        "qwen3_moe", EXPERTS, 2, [1]
    )
    assert [isinstance(b.mlp, SparseMoE) for b in loaded.model.layers] == [True, False, True]
    diff = np.abs(_logits(loaded.model, PROMPT) - _hf_logits(hf, PROMPT)).max()
    assert diff <= 1e-3, f"max |logit diff| = {diff}"


def test_unnormalized_topk_untied_matches_hf(tmp_path: Path) -> None:
    hf = _save(tmp_path, norm_topk=False, tie=False)
    loaded = load(tmp_path, device="cpu", with_tokenizer=False)
    assert not loaded.config.norm_topk_prob and not loaded.config.tie_embeddings
    diff = np.abs(_logits(loaded.model, PROMPT) - _hf_logits(hf, PROMPT)).max()
    assert diff <= 1e-3, f"max |logit diff| = {diff}"


def test_greedy_decode_matches_hf_generate(checkpoint: tuple[Path, Any]) -> None:
    path, hf = checkpoint
    model = load(path, device="cpu", with_tokenizer=False).model
    assert greedy_tokens(model, PROMPT, NEW_TOKENS) == hf_greedy(hf, PROMPT, NEW_TOKENS)


@pytest.mark.usefixtures("row_floor")
def test_decode_rows_are_batch_invariant(checkpoint: tuple[Path, Any]) -> None:
    model = load(checkpoint[0], device="cpu", with_tokenizer=False).model
    prompts = [PROMPT[:9], PROMPT[5:22], PROMPT[::-1]]
    solo, batched, nxt = [], [], []
    for p in prompts:
        for kvs in (solo, batched):
            kv = model.new_kv()
            logits = model(mx.array(p), Batch.build([(kv, 0, len(p))]), logit_rows=[len(p) - 1])
            kvs.append(kv)
        nxt.append(int(mx.argmax(logits[0]).item()))
    pos = [len(p) for p in prompts]
    for _ in range(3):  # a few steps, so the rows also read batch-written KV
        alone = [
            model(mx.array([t]), Batch.build([(kv, p, 1)]), logit_rows=[0])
            for t, kv, p in zip(nxt, solo, pos, strict=True)
        ]
        together = model(
            mx.array(nxt), Batch.build(list(zip(batched, pos, [1, 1, 1], strict=True))),
            logit_rows=[0, 1, 2],
        )
        for i in range(3):
            assert mx.array_equal(alone[i][0], together[i]), f"row {i} differs in a batch"
        nxt = [int(t) for t in mx.argmax(together, axis=-1).tolist()]
        pos = [p + 1 for p in pos]


@pytest.fixture
def row_floor(monkeypatch: pytest.MonkeyPatch) -> None:
    """Pad every matmul to 128 rows, as the engine's start-up probe would for this model.

    OpenBLAS picks small-matrix kernels up to ~75 rows for the toy model's tiny
    matrices, so without the floor a dense Linear, not the MoE, would break invariance.
    """
    monkeypatch.setattr(layers, "LINEAR_ROW_FLOOR", 128)


def test_expert_paths_give_each_row_its_solo_bits(checkpoint: tuple[Path, Any]) -> None:
    model = load(checkpoint[0], device="cpu", with_tokenizer=False).model
    moe = model.layers[0].mlp
    x = model.embed_tokens(mx.array(PROMPT))
    experts, _ = moe.route(x)
    assert experts.size >= GROUP_MIN_PAIRS and moe.can_group
    grouped = moe.grouped_swiglu(x, experts)
    plain = moe.swiglu(x[:, None, None, :], experts)[:, :, 0, :]
    alone = mx.concatenate([
        moe.swiglu(x[i : i + 1, None, None, :], experts[i : i + 1])[:, :, 0, :]
        for i in range(len(PROMPT))
    ])
    assert mx.array_equal(grouped, plain) and mx.array_equal(plain, alone)


@pytest.mark.usefixtures("row_floor")
def test_decode_row_beside_a_prefill_chunk_is_invariant(checkpoint: tuple[Path, Any]) -> None:
    """The chunk's 72 (row, expert) pairs go the grouped way, the lone row the plain way."""
    model = load(checkpoint[0], device="cpu", with_tokenizer=False).model
    first = PROMPT[:12]
    kv_alone, kv_mixed = model.new_kv(), model.new_kv()
    for kv in (kv_alone, kv_mixed):
        model(mx.array(first), Batch.build([(kv, 0, len(first))]), logit_rows=[len(first) - 1])
    tok = PROMPT[12]
    alone = model(mx.array([tok]), Batch.build([(kv_alone, len(first), 1)]), logit_rows=[0])
    chunk = PROMPT[::-1]
    chunk_alone = model(
        mx.array(chunk), Batch.build([(model.new_kv(), 0, len(chunk))]),
        logit_rows=[len(chunk) - 1],
    )
    mixed = model(
        mx.array([*chunk, tok]),
        Batch.build([(model.new_kv(), 0, len(chunk)), (kv_mixed, len(first), 1)]),
        logit_rows=[len(chunk) - 1, len(chunk)],
    )
    assert mx.array_equal(mixed[0], chunk_alone[0])
    assert mx.array_equal(mixed[1], alone[0])


def _rewrite_experts(src: Path, dst: Path, layout: str) -> None:
    """Copy the checkpoint with its experts in transformers' fused or mlx-lm's layout."""
    from safetensors.numpy import load_file, save_file

    shutil.copy(src / "config.json", dst / "config.json")
    raw = load_file(str(src / "model.safetensors"))
    n_layers = json.loads((src / "config.json").read_text())["num_hidden_layers"]
    for i in range(n_layers):
        p = f"model.layers.{i}.mlp"
        if f"{p}.experts.0.gate_proj.weight" not in raw:
            continue
        stacked = {
            proj: np.stack([raw.pop(f"{p}.experts.{e}.{proj}.weight") for e in range(EXPERTS)])
            for proj in ("gate_proj", "up_proj", "down_proj")
        }
        if layout == "fused":
            raw[f"{p}.experts.gate_up_proj"] = np.concatenate(
                [stacked["gate_proj"], stacked["up_proj"]], axis=1
            )
            raw[f"{p}.experts.down_proj"] = stacked["down_proj"]
        else:
            for proj, t in stacked.items():
                raw[f"{p}.switch_mlp.{proj}.weight"] = t
    save_file(raw, str(dst / "model.safetensors"))


@pytest.mark.parametrize("layout", ["fused", "switch_mlp"])
def test_other_expert_layouts_load_identically(
    checkpoint: tuple[Path, Any], tmp_path: Path, layout: str
) -> None:
    _rewrite_experts(checkpoint[0], tmp_path, layout)
    ref = _logits(load(checkpoint[0], device="cpu", with_tokenizer=False).model, PROMPT)
    got = _logits(load(tmp_path, device="cpu", with_tokenizer=False).model, PROMPT)
    assert np.array_equal(ref, got)
