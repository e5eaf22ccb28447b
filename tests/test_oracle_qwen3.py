"""Qwen3 dense against Hugging Face transformers on a tiny random checkpoint.

The config uses head_dim 32 with hidden 64 and 4 heads, so a family that derived
head_dim from hidden/heads, or skipped the q/k norms, would diverge at once.
"""

from __future__ import annotations  # noqa: I001  (slotserve preloads OpenBLAS before MLX)

from pathlib import Path
from typing import Any

import slotserve  # noqa: F401
import mlx.core as mx
import numpy as np
import pytest

from slotserve.kernels import native

from slotserve.model.layers import Batch
from slotserve.runtime.plain import greedy_tokens

from model_checks import hf_greedy
from slotserve.model.loader import load

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

PROMPT = [7, 300, 41, 12, 99, 250, 3, 3, 180, 64, 27, 311, 5, 140, 77, 201, 18, 260, 90, 33,
          1, 222, 145, 60]
NEW_TOKENS = 32


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    cfg = transformers.Qwen3Config(
        vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, rms_norm_eps=1e-6,
        rope_theta=1_000_000.0, max_position_embeddings=512, tie_word_embeddings=False,
        initializer_range=0.08, bos_token_id=None, eos_token_id=None, pad_token_id=None,
    )
    torch.manual_seed(0)
    hf = transformers.Qwen3ForCausalLM(cfg).to(torch.float32).eval()
    with torch.no_grad():  # non-trivial norm weights, so a skipped norm would show
        for name, p in hf.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.3 * torch.randn_like(p))
    path = tmp_path_factory.mktemp("qwen3")
    hf.save_pretrained(path, safe_serialization=True)
    return path, hf


def _hf_logits(hf: Any, tokens: list[int]) -> np.ndarray:
    with torch.no_grad():
        return hf(torch.tensor([tokens])).logits[0].float().numpy()




def test_config_and_prefill_logits_match_hf(checkpoint: tuple[Path, Any]) -> None:
    path, hf = checkpoint
    loaded = load(path, device="cpu", with_tokenizer=False)
    assert loaded.config.family == "qwen3" and loaded.config.head_dim == 32
    model = loaded.model
    # with the native kernels, the q/k head norms run inside block.c
    assert model.runs_on_host() == (native.library() is not None)
    kv = model.new_kv()
    n = len(PROMPT)
    ours = model(mx.array(PROMPT), Batch.build([(kv, 0, n)]), logit_rows=list(range(n)))
    diff = np.abs(np.array(ours) - _hf_logits(hf, PROMPT)).max()
    assert diff <= 1e-3, f"max |logit diff| = {diff}"


def test_greedy_decode_matches_hf_generate(checkpoint: tuple[Path, Any]) -> None:
    path, hf = checkpoint
    model = load(path, device="cpu", with_tokenizer=False).model
    assert greedy_tokens(model, PROMPT, NEW_TOKENS) == hf_greedy(hf, PROMPT, NEW_TOKENS)
