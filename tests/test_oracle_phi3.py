"""Phi-3 / Phi-4 (Phi3ForCausalLM) against transformers on tiny random checkpoints.

`longrope`: Phi-4-mini's shape in miniature, a partial rotation (0.75 of each head) with
LongRoPE short and long factors that differ per frequency and an original context of 32
positions: a 20-token prompt decoded for 32 tokens runs on the short factors, then crosses
into the long ones at position 32, as transformers' Phi3ForCausalLM does when stepped with
its cache (`generate` also drops the cache there and recomputes the whole sequence with
the long factors; slotserve's RoPE is a per-position table, so keys before the switch keep
the short ones, see layers.LongRope). `windowed`:
Phi-3-mini-4k's config (no rope scaling, a sliding window on every layer, window 8).
The fused qkv_proj / gate_up_proj split in the wrong order, a partial rotation done over
the whole head or a missing attention factor each change the logits at once.
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

from converted import tiny_hf
from mlx4_checks import assert_mlx4_matches
from model_checks import hf_greedy
from slotserve.model.loader import load

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

NEW_TOKENS = 32
ORIGINAL_CONTEXT = 32
VARIANTS: dict[str, tuple[dict[str, Any], int]] = {  # config, prompt length
    "longrope": (dict(
        partial_rotary_factor=0.75, original_max_position_embeddings=ORIGINAL_CONTEXT,
        rope_scaling={"rope_type": "longrope",
                      "short_factor": [1.0, 1.3, 1.1, 2.0, 1.7, 3.0],
                      "long_factor": [2.0, 4.5, 3.3, 8.0, 6.1, 16.0]}), 20),
    "windowed": (dict(sliding_window=8, original_max_position_embeddings=256), 40),
}


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def pair(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Any:
    extra, prompt_len = VARIANTS[request.param]
    cfg = transformers.Phi3Config(
        vocab_size=384, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        rms_norm_eps=1e-5, tie_word_embeddings=False, bos_token_id=None, eos_token_id=None,
        pad_token_id=None, **extra,
    )
    torch.manual_seed(0)
    hf = transformers.Phi3ForCausalLM(cfg).to(torch.float32).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            mean, std = (1.0, 0.3) if "norm" in name else (0.0, 0.08)
            p.normal_(mean, std)
    path = Path(tmp_path_factory.mktemp(f"phi3-{request.param}"))
    hf.save_pretrained(path, safe_serialization=True)
    prompt = np.random.default_rng(1).integers(3, 384, prompt_len).tolist()
    return request.param, hf, load(path, device="cpu", with_tokenizer=False).model, prompt


def test_config_and_logits_match_hf(pair: Any) -> None:
    variant, hf, model, prompt = pair
    c = model.config
    assert c.family == "phi3"
    if variant == "longrope":
        assert (c.rotary_dim, c.original_max_position_embeddings) == (12, ORIGINAL_CONTEXT)
        assert c.rope()["factor"] == 256 / ORIGINAL_CONTEXT
    else:
        assert [c.window(i) for i in range(c.num_layers)] == [8, 8, 8] and c.rope() is None
    n = len(prompt)
    ours = model(mx.array(prompt), Batch.build([(model.new_kv(), 0, n)]), list(range(n)))
    with torch.no_grad():
        want = hf(torch.tensor([prompt])).logits[0].numpy()
    diff = np.abs(np.array(ours) - want).max()
    assert diff <= 1e-3, f"max |logit diff| = {diff}"


def hf_stepped_greedy(hf: Any, prompt: list[int], steps: int) -> list[int]:
    """Greedy tokens from transformers' forward stepped one token at a time on its cache."""
    out: list[int] = []
    with torch.no_grad():
        step = hf(torch.tensor([prompt]), use_cache=True)
        for i in range(steps):
            out.append(int(step.logits[0, -1].argmax()))
            step = hf(torch.tensor([out[-1:]]), cache=step.past_key_values,
                      use_cache=True, position_ids=torch.tensor([[len(prompt) + i]]))
    return out


def test_greedy_decode_matches_hf(pair: Any) -> None:
    """32 tokens; for `longrope` the last 20 at positions past the original context."""
    variant, hf, model, prompt = pair
    want = (hf_stepped_greedy(hf, prompt, NEW_TOKENS) if variant == "longrope"
            else hf_greedy(hf, prompt, NEW_TOKENS))
    assert greedy_tokens(model, prompt, NEW_TOKENS) == want


def test_mlx4_matches_dequantized_reference() -> None:
    """mlx_lm.convert -q of a tiny phi3 checkpoint: 64 teacher-forced tokens against
    transformers holding the same 4-bit numbers (mlx4_checks)."""
    hf_dir = tiny_hf("phi3", {"partial_rotary_factor": 0.75, "sliding_window": 16})
    prompt = np.random.default_rng(2).integers(3, 49_152, 24).tolist()
    assert_mlx4_matches(hf_dir, prompt, linears=2 * 4 + 1)
