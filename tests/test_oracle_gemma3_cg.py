"""Gemma 3 4B/12B/27B's layout (Gemma3ForConditionalGeneration) against transformers.

The checkpoint is a tiny random Gemma3ForConditionalGeneration with a vision tower, whose
config.json is then written the way google/gemma-3-4b-it's is: `text_config` names only
what differs from transformers' defaults (8 heads, 4 KV heads, head_dim 256, rope theta
1e6, query_pre_attn_scalar 256, the 5:1 sliding pattern), with the old-style linear
`rope_scaling`. transformers loads that directory as the oracle; slotserve must read the
same config, serve the text part (weights under `language_model.`) and leave the vision
tower out with a log line.
"""

from __future__ import annotations  # noqa: I001  (slotserve preloads OpenBLAS before MLX)

import json
from pathlib import Path
from typing import Any

import slotserve  # noqa: F401
import mlx.core as mx
import numpy as np
import pytest
from structlog.testing import capture_logs

from slotserve.model.layers import Batch
from slotserve.runtime.plain import greedy_tokens

from converted import tiny_hf
from mlx4_checks import assert_mlx4_matches
from model_checks import hf_greedy
from slotserve.model.loader import load

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

NEW_TOKENS = 32
VOCAB = 512
# google/gemma-3-4b-it's text_config in miniature: only what differs from the defaults
TEXT_CONFIG = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=6,
                   vocab_size=VOCAB, model_type="gemma3_text", sliding_window=8,
                   rope_scaling={"factor": 8.0, "rope_type": "linear"})
# the converted checkpoint's text model: tiny_hf's SmolLM2 vocabulary, one global layer
CONVERTED_TEXT = dict(vocab_size=49_152, hidden_size=64, intermediate_size=128,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      head_dim=16, sliding_window=8, query_pre_attn_scalar=16,
                      layer_types=["sliding_attention", "full_attention"])
VISION_CONFIG = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                     num_attention_heads=2, image_size=28, patch_size=14,
                     model_type="siglip_vision_model")


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> Any:
    path = Path(tmp_path_factory.mktemp("gemma3-cg"))
    text = {k: v for k, v in TEXT_CONFIG.items() if k not in ("model_type", "rope_scaling")}
    cfg = transformers.Gemma3Config(text_config=text, vision_config=VISION_CONFIG,
                                    mm_tokens_per_image=4)
    torch.manual_seed(0)
    made = transformers.Gemma3ForConditionalGeneration(cfg)
    with torch.no_grad():  # HF zero-inits norms; random ones exercise the (1 + w) form
        for name, p in made.named_parameters():
            p.normal_(0.0, 0.3 if "norm" in name else 0.08)
    made.save_pretrained(path)
    (path / "config.json").write_text(json.dumps({
        "architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3",
        "boi_token_index": 255_999, "eoi_token_index": 256_000, "image_token_index": 262_144,
        "mm_tokens_per_image": 4, "initializer_range": 0.02, "torch_dtype": "float32",
        "text_config": TEXT_CONFIG, "vision_config": VISION_CONFIG,
    }))
    hf = transformers.Gemma3ForConditionalGeneration.from_pretrained(path).float().eval()
    hf.generation_config.eos_token_id = None
    hf.generation_config.pad_token_id = 0
    with capture_logs() as logs:
        ours = load(path, device="cpu", with_tokenizer=False)
    prompt = np.random.default_rng(1).integers(3, VOCAB, 40).tolist()
    return hf, ours.model, prompt, logs


def test_config_read_as_transformers_reads_it(pair: Any) -> None:
    hf, model, _, logs = pair
    c, h = model.config, hf.config.text_config
    assert c.family == "gemma3"
    assert (c.num_heads, c.num_kv_heads, c.head_dim) == (8, 4, 256)
    assert (c.num_heads, c.num_kv_heads, c.head_dim) == (
        h.num_attention_heads, h.num_key_value_heads, h.head_dim)
    assert c.layer_types == list(h.layer_types) == ["sliding_attention"] * 5 + ["full_attention"]
    assert c.attn_scale == h.query_pre_attn_scalar**-0.5 == 256**-0.5
    assert c.rope_theta == h.rope_parameters["full_attention"]["rope_theta"] == 1e6
    assert c.rope_scaling == {"factor": 8.0, "rope_type": "linear"}
    assert c.vocab_size == VOCAB and c.tie_embeddings
    assert [e for e in logs if e["event"].startswith("vision tower not loaded")]


def test_text_logits_match(pair: Any) -> None:
    hf, model, prompt, _ = pair
    with torch.no_grad():
        want = hf(input_ids=torch.tensor([prompt])).logits[0].numpy()
    n = len(prompt)
    got = model(mx.array(prompt), Batch.build([(model.new_kv(), 0, n)]), list(range(n)))
    diff = np.abs(np.array(got) - want).max()
    assert diff <= 1e-3, diff


def test_greedy_tokens_match(pair: Any) -> None:
    hf, model, prompt, _ = pair
    assert greedy_tokens(model, prompt, NEW_TOKENS) == hf_greedy(hf, prompt, NEW_TOKENS)


def test_mlx4_text_part_matches_dequantized_reference() -> None:
    """mlx_lm.convert -q of a Gemma3ForConditionalGeneration (it drops the vision tower and
    keeps the text weights under language_model.): 64 teacher-forced tokens against
    transformers holding the same 4-bit numbers (mlx4_checks)."""
    hf_dir = tiny_hf("gemma3", {"text_config": CONVERTED_TEXT, "vision_config": VISION_CONFIG,
                                "mm_tokens_per_image": 4})
    prompt = np.random.default_rng(2).integers(3, 49_152, 24).tolist()
    assert_mlx4_matches(hf_dir, prompt, linears=2 * 4 + 1)
