"""Tiny random-weight checkpoints (HF format) that the engine can serve end to end.

They borrow SmolLM2's tokenizer (so chat templates and stop tokens are real) and
use its vocabulary size; everything else is a few layers of width 64.
"""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx

from slotserve.model.loader import default_model_path
from slotserve.model.tokenizer import Tokenizer


def _write_tokenizer(path: Path) -> int:
    _, meta = mx.load(str(default_model_path()), return_metadata=True)
    tok = Tokenizer.from_gguf_metadata(meta, "smollm2")
    (path / "tokenizer.json").write_text(tok.to_hf_tokenizer_json())
    cfg = {"chat_template": tok.chat_template, "bos_token": "<|im_start|>",
           "eos_token": "<|im_end|>", "add_bos_token": False}
    (path / "tokenizer_config.json").write_text(json.dumps(cfg))
    return tok.vocab_size


def make_tiny(family: str, path: Path, seed: int = 0) -> Path:
    import torch
    import transformers

    path.mkdir(parents=True, exist_ok=True)
    vocab = _write_tokenizer(path)
    common = dict(vocab_size=vocab, hidden_size=64, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, max_position_embeddings=2048,
                  rms_norm_eps=1e-6, tie_word_embeddings=True)
    if family == "qwen3_moe":
        cfg = transformers.Qwen3MoeConfig(
            **common, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
            num_experts=8, num_experts_per_tok=2, norm_topk_prob=True, mlp_only_layers=[1],
            rope_theta=1_000_000.0)
        model = transformers.Qwen3MoeForCausalLM(cfg)
    elif family == "gemma3":
        cfg = transformers.Gemma3TextConfig(
            **common, intermediate_size=128, num_hidden_layers=4, sliding_window=16,
            layer_types=["sliding_attention", "sliding_attention", "sliding_attention",
                         "full_attention"], query_pre_attn_scalar=16)
        model = transformers.Gemma3ForCausalLM(cfg)
    else:
        raise ValueError(family)
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(0.0, 0.3 if "norm" in name else 0.08)
    model.to(torch.float32).save_pretrained(path, safe_serialization=True)
    return path
