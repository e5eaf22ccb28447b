"""Qwen2 / Qwen2.5 against transformers' Qwen2ForCausalLM on tiny random checkpoints.

The q/k/v biases are drawn large (HF initializes them to zero), so a model that dropped
them diverges at once; the `windowed` variant turns Qwen2's optional sliding window on
(layers from max_window_layers on, window 8 against a 40-token prompt). A checkpoint whose
tensors the family does not read (the same biases under a config that says llama, no
attention_bias) is refused, not served wrong.
"""

from __future__ import annotations  # noqa: I001  (slotserve preloads OpenBLAS before MLX)

import json
from pathlib import Path
from typing import Any

import slotserve  # noqa: F401
import mlx.core as mx
import numpy as np
import pytest

from slotserve.model.errors import UnsupportedModelError
from slotserve.model.layers import Batch
from slotserve.runtime.plain import greedy_tokens

from converted import tiny_hf
from mlx4_checks import assert_mlx4_matches
from model_checks import hf_greedy
from slotserve.model.loader import load

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

NEW_TOKENS = 32
VARIANTS: dict[str, dict[str, Any]] = {
    "plain": dict(tie_word_embeddings=True),
    "windowed": dict(use_sliding_window=True, sliding_window=8, max_window_layers=1,
                     tie_word_embeddings=False),
}


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def pair(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Any:
    cfg = transformers.Qwen2Config(
        vocab_size=384, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-6,
        rope_theta=1_000_000.0, max_position_embeddings=512, bos_token_id=None,
        eos_token_id=None, pad_token_id=None, **VARIANTS[request.param],
    )
    torch.manual_seed(0)
    hf = transformers.Qwen2ForCausalLM(cfg).to(torch.float32).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            mean, std = (1.0, 0.3) if "norm" in name else (0.0, 0.5 if "bias" in name else 0.08)
            p.normal_(mean, std)
    path = Path(tmp_path_factory.mktemp(f"qwen2-{request.param}"))
    hf.save_pretrained(path, safe_serialization=True)
    prompt = np.random.default_rng(1).integers(3, 384, 40).tolist()
    return path, hf, load(path, device="cpu", with_tokenizer=False).model, prompt


def test_config_and_logits_match_hf(pair: Any) -> None:
    path, hf, model, prompt = pair
    c = model.config
    assert c.family == "qwen2"
    assert [c.window(i) for i in range(c.num_layers)] == [
        hf.config.sliding_window if t == "sliding_attention" else None
        for t in hf.config.layer_types]
    n = len(prompt)
    ours = model(mx.array(prompt), Batch.build([(model.new_kv(), 0, n)]), list(range(n)))
    with torch.no_grad():
        want = hf(torch.tensor([prompt])).logits[0].numpy()
    diff = np.abs(np.array(ours) - want).max()
    assert diff <= 1e-3, f"max |logit diff| = {diff}"


def test_greedy_decode_matches_hf_generate(pair: Any) -> None:
    _, hf, model, prompt = pair
    assert greedy_tokens(model, prompt, NEW_TOKENS) == hf_greedy(hf, prompt, NEW_TOKENS)


def test_unread_tensors_are_refused(pair: Any, tmp_path: Path) -> None:
    """The biased checkpoint named as plain llama (no attention_bias): refused, by name."""
    path, _, _, _ = pair
    for f in path.iterdir():
        (tmp_path / f.name).write_bytes(f.read_bytes())
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(architectures=["LlamaForCausalLM"], model_type="llama")
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedModelError, match=r"does not use: .*self_attn\.k_proj\.bias"):
        load(tmp_path, device="cpu", with_tokenizer=False, probe_rows=None)


def test_stored_rope_frequencies_are_not_refused(pair: Any, tmp_path: Path) -> None:
    """Older Llama-family checkpoints also store rotary_emb.inv_freq, which the config
    determines: they load."""
    path, _, _, _ = pair
    for f in path.iterdir():
        (tmp_path / f.name).write_bytes(f.read_bytes())
    tensors = mx.load(str(path / "model.safetensors"))
    tensors["model.layers.0.self_attn.rotary_emb.inv_freq"] = mx.ones((8,))
    mx.save_safetensors(str(tmp_path / "model.safetensors"), tensors, metadata={"format": "pt"})
    assert load(tmp_path, device="cpu", with_tokenizer=False, probe_rows=None).config.family \
        == "qwen2"


def test_mlx4_matches_dequantized_reference() -> None:
    """mlx_lm.convert -q of a tiny qwen2 checkpoint: 64 teacher-forced tokens against
    transformers holding the same 4-bit numbers (mlx4_checks)."""
    hf_dir = tiny_hf("qwen2", {})
    prompt = np.random.default_rng(2).integers(3, 49_152, 24).tolist()
    assert_mlx4_matches(hf_dir, prompt, linears=2 * 4 + 1)
