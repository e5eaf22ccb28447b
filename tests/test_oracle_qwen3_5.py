"""Qwen3.5 (dense) against Hugging Face transformers on tiny random checkpoints.

Three DeltaNet layers and one gated-attention layer; the prompt is 70 tokens, so the
prefill runs two whole sub-chunks in the chunked form and a 6-token tail recurrently
(slotserve.model.deltanet), and greedy decoding then runs the recurrent update for 32
tokens. Norm weights, A_log and dt_bias are drawn away from their init, so a skipped
(1 + w), a wrong gate or a wrong decay would diverge at once. The ForConditionalGeneration
layout (`model.language_model.`, a vision tower slotserve does not read) loads the same
text decoder.
"""

from __future__ import annotations  # noqa: I001  (slotserve preloads OpenBLAS before MLX)

from pathlib import Path
from typing import Any

import slotserve  # noqa: F401
import mlx.core as mx
import numpy as np
import pytest

from slotserve.model import deltanet
from slotserve.model.layers import Batch
from slotserve.runtime.plain import greedy_tokens

from model_checks import assert_mixed_decode_matches_solo, hf_greedy
from slotserve.model.loader import load

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

PROMPT = [int(t) for t in np.random.RandomState(7).randint(0, 320, 70)]
NEW_TOKENS = 32

TEXT = dict(
    vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
    num_attention_heads=4, num_key_value_heads=2, head_dim=32, linear_num_key_heads=2,
    linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
    linear_conv_kernel_dim=4, max_position_embeddings=512, rms_norm_eps=1e-6,
    tie_word_embeddings=False, bos_token_id=None, eos_token_id=None, pad_token_id=None,
)


def randomize(hf: Any, seed: int, std: float = 0.1) -> Any:
    """Weights of a trained model's scale; the norms, decays and gates off their init."""
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "visual" in name:
                continue
            if name.endswith("linear_attn.norm.weight"):
                p.copy_(1.0 + 0.3 * torch.randn_like(p))
            elif name.endswith("norm.weight"):
                p.copy_(0.3 * torch.randn_like(p))
            elif name.endswith("A_log"):
                p.copy_(torch.log(torch.empty_like(p).uniform_(0.5, 8.0)))
            elif name.endswith("dt_bias"):
                p.copy_(torch.randn_like(p))
            else:
                p.normal_(0.0, std)
    return hf.to(torch.float32).eval()


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    hf = randomize(transformers.Qwen3_5ForCausalLM(transformers.Qwen3_5TextConfig(**TEXT)), 0)
    path = tmp_path_factory.mktemp("qwen3_5")
    hf.save_pretrained(path, safe_serialization=True)
    return path, hf


def _hf_logits(hf: Any, tokens: list[int]) -> np.ndarray:
    with torch.no_grad():
        return hf(torch.tensor([tokens])).logits[0].float().numpy()


def test_config_and_prefill_logits_match_hf(checkpoint: tuple[Path, Any]) -> None:
    path, hf = checkpoint
    loaded = load(path, device="cpu", with_tokenizer=False)
    cfg = loaded.config
    assert cfg.family == "qwen3_5" and cfg.head_dim == 32
    assert cfg.layer_types == ["linear_attention"] * 3 + ["full_attention"]  # type: ignore[attr-defined]
    model = loaded.model
    kv = model.new_kv()
    assert isinstance(kv, deltanet.HybridKV)
    assert kv.pool.num_layers == 1  # pages hold the one attention layer's K/V only
    n = len(PROMPT)
    ours = model(mx.array(PROMPT), Batch.build([(kv, 0, n)]), logit_rows=list(range(n)))
    diff = np.abs(np.array(ours) - _hf_logits(hf, PROMPT)).max()
    assert diff <= 1e-3, f"max |logit diff| = {diff}"


def test_greedy_decode_matches_hf_generate(checkpoint: tuple[Path, Any]) -> None:
    path, hf = checkpoint
    model = load(path, device="cpu", with_tokenizer=False).model
    assert greedy_tokens(model, PROMPT, NEW_TOKENS) == hf_greedy(hf, PROMPT, NEW_TOKENS)


def test_mixed_decode_is_batch_invariant(checkpoint: tuple[Path, Any]) -> None:
    model = load(checkpoint[0], device="cpu", with_tokenizer=False).model
    assert_mixed_decode_matches_solo(model, PROMPT, [5, 77, 190])


def test_conditional_generation_layout_loads_the_text_decoder(
        tmp_path: Path, checkpoint: tuple[Path, Any]) -> None:
    vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2,
                  out_hidden_size=64, num_position_embeddings=16, patch_size=4,
                  temporal_patch_size=1, spatial_merge_size=1)
    cfg = transformers.Qwen3_5Config(text_config=TEXT, vision_config=vision)
    hf = randomize(transformers.Qwen3_5ForConditionalGeneration(cfg), 3)
    hf.save_pretrained(tmp_path, safe_serialization=True)
    loaded = load(tmp_path, device="cpu", with_tokenizer=False)
    assert loaded.config.family == "qwen3_5"
    model, prompt = loaded.model, PROMPT[:40]
    ours = model(mx.array(prompt), Batch.build([(model.new_kv(), 0, 40)]), [39])
    diff = np.abs(np.array(ours[0]) - _hf_logits(hf, prompt)[-1]).max()
    assert diff <= 1e-3, f"max |logit diff| = {diff}"
