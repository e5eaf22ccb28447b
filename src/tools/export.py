"""`slotserve export MODEL OUTDIR`: write a Hugging Face directory from a GGUF or HF model.

The output (config.json, model.safetensors, tokenizer.json, tokenizer_config.json with
the chat template, generation_config.json) loads in `transformers` and in mlx-lm and
gives the same greedy tokens as slotserve: weights are written exactly as slotserve
computes with them on CPU (dequantized float32 by default), with HF's tensor names and
layout (llama.cpp's Q/K row permutation undone, gemma norms shifted back).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import mlx.core as mx

from slotserve.model import families
from slotserve.model.config import ModelConfig
from slotserve.model.loader import default_model_path, read_checkpoint
from slotserve.model.tokenizer import Tokenizer
from slotserve.model.weights import QuantizedWeight

DTYPES = {"float32": mx.float32, "bfloat16": mx.bfloat16, "float16": mx.float16}


def hf_config(cfg: ModelConfig, tok: Tokenizer, dtype: str) -> dict[str, Any]:
    """config.json: the keys every family has, then the family's own (ModelConfig.hf_keys)."""
    family = families.family(cfg.family)
    out: dict[str, Any] = {
        "architectures": [family.hf_architectures[0]], "model_type": family.hf_model_type,
        "torch_dtype": dtype,
        "hidden_size": cfg.hidden_size, "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads, "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim, "intermediate_size": cfg.intermediate_size,
        "vocab_size": cfg.vocab_size, "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta, "rope_scaling": cfg.rope_scaling,
        "max_position_embeddings": cfg.max_position,
        "tie_word_embeddings": cfg.tie_embeddings,
        "bos_token_id": tok.bos_id, "eos_token_id": tok.eos_id, "pad_token_id": tok.pad_id,
        "attention_bias": False, "mlp_bias": False, "hidden_act": "silu",
    }
    out.update(cfg.hf_keys())
    return out


def hf_tensors(cfg: ModelConfig, weights: dict[str, Any], dtype: mx.Dtype) -> dict[str, mx.array]:
    """The tensors in dtype, in Hugging Face's names and layout (the family's to say)."""
    out = {name: t.dequantize(dtype) if isinstance(t, QuantizedWeight) else t.astype(dtype)
           for name, t in weights.items()}
    out = families.family(cfg.family).hf_tensors(out)
    if cfg.tie_embeddings:
        out.pop("lm_head.weight", None)
    return out


def export(model: str | Path | None, outdir: str | Path, dtype: str = "float32") -> Path:
    src = Path(model) if model else default_model_path()
    out = Path(outdir)
    out.mkdir(parents=True, exist_ok=True)
    cfg, weights, meta = read_checkpoint(src)
    tok = Tokenizer.from_gguf_metadata(meta, str(src)) if meta else Tokenizer.from_hf_dir(src)
    tensors = hf_tensors(cfg, weights, DTYPES[dtype])
    mx.save_safetensors(str(out / "model.safetensors"), tensors, metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(hf_config(cfg, tok, dtype), indent=2))
    (out / "tokenizer.json").write_text(tok.to_hf_tokenizer_json())

    def text(i: int | None) -> str | None:
        return tok.id_to_token(i) if i is not None else None

    tok_cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast", "chat_template": tok.chat_template,
        "bos_token": text(tok.bos_id), "eos_token": text(tok.eos_id),
        "pad_token": text(tok.pad_id), "unk_token": text(tok.unk_id),
        "add_bos_token": tok.add_bos, "model_max_length": cfg.max_position,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(tok_cfg, indent=2))
    gen = {"bos_token_id": tok.bos_id, "eos_token_id": sorted(tok.stop_ids)}
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2))
    return out


def main(args: argparse.Namespace) -> int:
    path = export(args.model, args.outdir, args.dtype)
    print(f"wrote {path}")  # noqa: T201 - command output
    return 0
