"""Tiny random-weight checkpoints (HF format) that the engine can serve end to end.

They borrow SmolLM2's tokenizer (so chat templates and stop tokens are real) and
use its vocabulary size; everything else is a few layers of width 64.
"""

from __future__ import annotations

from pathlib import Path

from slotserve.tools.synth import write_smollm2_tokenizer


def make_tiny(family: str, path: Path, seed: int = 0) -> Path:
    import torch
    import transformers

    path.mkdir(parents=True, exist_ok=True)
    vocab = write_smollm2_tokenizer(path)
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
