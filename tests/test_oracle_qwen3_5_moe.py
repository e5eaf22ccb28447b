"""Qwen3.5-MoE and Qwen3-Next against Hugging Face transformers on tiny random checkpoints.

Both are qwen3_5's hybrid layers with routed experts plus a gated shared expert. Qwen3-Next
stores its DeltaNet in-projections grouped per key head (`in_proj_qkvz`, `in_proj_ba`),
which the reader reorders, and keeps one layer dense here (`mlp_only_layers`), so a wrong
reorder or a wrong sparse-layer rule diverges at once. The 40-token prompt puts 8 experts x
top-2 over 80 (row, expert) pairs, so prefill takes the experts' grouped path.
"""

from __future__ import annotations  # noqa: I001  (slotserve preloads OpenBLAS before MLX)

from pathlib import Path
from typing import Any

import slotserve  # noqa: F401
import mlx.core as mx
import numpy as np
import pytest

from slotserve.model.layers import Batch
from slotserve.runtime.plain import greedy_tokens

from model_checks import assert_mixed_decode_matches_solo, hf_greedy
from slotserve.model.loader import load
from test_oracle_qwen3_5 import TEXT, randomize

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

PROMPT = [int(t) for t in np.random.RandomState(11).randint(0, 320, 40)]
NEW_TOKENS = 32
MOE = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
           shared_expert_intermediate_size=48)


def _build(family: str) -> Any:
    text = {k: v for k, v in TEXT.items() if k != "intermediate_size"}
    if family == "qwen3_5_moe":
        cfg = transformers.Qwen3_5MoeTextConfig(**text, **MOE)
        return transformers.Qwen3_5MoeForCausalLM(cfg)
    cfg = transformers.Qwen3NextConfig(**text, **MOE, intermediate_size=96, mlp_only_layers=[1],
                                       norm_topk_prob=False)
    return transformers.Qwen3NextForCausalLM(cfg)


@pytest.fixture(scope="module", params=["qwen3_5_moe", "qwen3_next"])
def checkpoint(request: pytest.FixtureRequest,
               tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path, Any]:
    hf = randomize(_build(request.param), 2)
    path = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(path, safe_serialization=True)
    return request.param, path, hf


def test_prefill_logits_and_greedy_decode_match_hf(checkpoint: tuple[str, Path, Any]) -> None:
    family, path, hf = checkpoint
    loaded = load(path, device="cpu", with_tokenizer=False)
    assert loaded.config.family == family
    model, n = loaded.model, len(PROMPT)
    ours = model(mx.array(PROMPT), Batch.build([(model.new_kv(), 0, n)]), list(range(n)))
    with torch.no_grad():
        ref = hf(torch.tensor([PROMPT])).logits[0].float().numpy()
    diff = np.abs(np.array(ours) - ref).max()
    assert diff <= 1e-3, f"max |logit diff| = {diff}"
    assert greedy_tokens(model, PROMPT, NEW_TOKENS) == hf_greedy(hf, PROMPT, NEW_TOKENS)


def test_mixed_decode_is_batch_invariant(checkpoint: tuple[str, Path, Any]) -> None:
    model = load(checkpoint[1], device="cpu", with_tokenizer=False).model
    assert_mixed_decode_matches_solo(model, PROMPT, [5, 77, 190])
