"""The llama family's variants against transformers on tiny random checkpoints: Mistral
(one sliding window on every layer), Ministral (sliding and full layers by `layer_types`)
and a Llama with `attention_bias` and `mlp_bias`.

The windows (8 positions) are far shorter than the 40-token prompt, so a dropped window
changes the logits at once; biases are drawn large (HF initializes them to zero).
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

from model_checks import hf_greedy
from slotserve.model.loader import load

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

NEW_TOKENS = 32
COMMON = dict(vocab_size=384, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
              num_attention_heads=4, num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-5,
              max_position_embeddings=512, bos_token_id=None, eos_token_id=None,
              pad_token_id=None, tie_word_embeddings=False)
VARIANTS: dict[str, tuple[str, str, dict[str, Any]]] = {
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=8)),
    "ministral": ("MinistralConfig", "MinistralForCausalLM", dict(
        sliding_window=8,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"])),
    "llama-bias": ("LlamaConfig", "LlamaForCausalLM", dict(attention_bias=True,
                                                           mlp_bias=True)),
}


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def pair(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Any:
    config_class, model_class, extra = VARIANTS[request.param]
    cfg = getattr(transformers, config_class)(**COMMON, **extra)
    torch.manual_seed(0)
    hf = getattr(transformers, model_class)(cfg).to(torch.float32).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            mean, std = (1.0, 0.3) if "norm" in name else (0.0, 0.5 if "bias" in name else 0.08)
            p.normal_(mean, std)
    path = Path(tmp_path_factory.mktemp(request.param))
    hf.save_pretrained(path, safe_serialization=True)
    prompt = np.random.default_rng(1).integers(3, 384, 40).tolist()
    return request.param, hf, load(path, device="cpu", with_tokenizer=False).model, prompt


def test_config_and_logits_match_hf(pair: Any) -> None:
    variant, hf, model, prompt = pair
    c = model.config
    assert c.family == "llama"
    windows = [c.window(i) for i in range(c.num_layers)]
    assert windows == {"mistral": [8, 8, 8], "ministral": [8, None, 8],
                       "llama-bias": [None] * 3}[variant]
    assert (c.attention_bias, c.mlp_bias) == ((True, True) if variant == "llama-bias"
                                              else (False, False))
    n = len(prompt)
    ours = model(mx.array(prompt), Batch.build([(model.new_kv(), 0, n)]), list(range(n)))
    with torch.no_grad():
        want = hf(torch.tensor([prompt])).logits[0].numpy()
    diff = np.abs(np.array(ours) - want).max()
    assert diff <= 1e-3, f"max |logit diff| = {diff}"


def test_greedy_decode_matches_hf_generate(pair: Any) -> None:
    _, hf, model, prompt = pair
    assert greedy_tokens(model, prompt, NEW_TOKENS) == hf_greedy(hf, prompt, NEW_TOKENS)
