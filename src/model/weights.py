"""Read checkpoint tensors into one naming scheme (Hugging Face's).

GGUF files are read by `mx.load`: Q4_0/Q4_1/Q8_0 tensors arrive as MLX affine
quantized triples (group size 32, bits per tensor), K-quants arrive dequantized.
Names are mapped to HF names; llama.cpp's Q/K row permutation (done for the llama
architecture so it can use interleaved RoPE) is undone, so every family runs HF's
rotate-half RoPE; gemma's norm weights (stored +1 by llama.cpp) are shifted back.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import mlx.core as mx

from slotserve.kernels.quantized import QuantizedWeight
from slotserve.model.errors import ModelLoadError, UnsupportedModelError

GROUP_SIZE_GGUF = 32


Tensor = mx.array | QuantizedWeight

_GGUF_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_exps": "mlp.experts.gate_proj",
    "ffn_up_exps": "mlp.experts.up_proj",
    "ffn_down_exps": "mlp.experts.down_proj",
    "attn_norm": "input_layernorm",
    "post_attention_norm": "post_attention_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
_GGUF_TOP_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}


def _gguf_layer_name(family: str, part: str) -> str | None:
    if part == "ffn_norm":  # gemma3 puts a norm before and after the MLP
        return "pre_feedforward_layernorm" if family == "gemma3" else "post_attention_layernorm"
    return _GGUF_LAYER_NAMES.get(part)


def _unpermute_rows(t: Tensor, n_heads: int) -> Tensor:
    """Invert llama.cpp's per-head interleave of Q/K rows (HF rotate-half layout)."""
    rows = t.shape[0]
    half = rows // n_heads // 2
    order = mx.arange(rows).reshape(n_heads, half, 2).swapaxes(1, 2).reshape(rows)
    return t.take_rows(order) if isinstance(t, QuantizedWeight) else t[order]


def read_gguf(path: Path, family: str, num_heads: int, num_kv_heads: int,
              raw: dict[str, mx.array]) -> dict[str, Tensor]:
    """Map GGUF tensors (already loaded by mx.load) to HF names."""
    out: dict[str, Tensor] = {}
    bases = sorted({k.rsplit(".", 1)[0] for k in raw})
    for base in bases:
        w = raw.get(base + ".weight")
        if w is None:
            raise UnsupportedModelError(f"{path}: tensor {base} has no weight")
        scales = raw.get(base + ".scales")
        tensor: Tensor
        if scales is not None:
            bits = w.shape[-1] * 32 // (scales.shape[-1] * GROUP_SIZE_GGUF)
            tensor = QuantizedWeight(w, scales, raw[base + ".biases"], GROUP_SIZE_GGUF, bits)
        elif w.dtype in (mx.uint8, mx.uint32, mx.int8):
            raise UnsupportedModelError(f"{path}: tensor {base} has an unsupported quant type")
        else:
            tensor = w
        m = re.fullmatch(r"blk\.(\d+)\.(\w+)", base)
        if m:
            part = _gguf_layer_name(family, m.group(2))
            if part is None:
                raise UnsupportedModelError(f"{path}: unknown GGUF tensor {base!r}")
            name = f"model.layers.{m.group(1)}.{part}"
            if family == "llama" and part == "self_attn.q_proj":
                tensor = _unpermute_rows(tensor, num_heads)
            elif family == "llama" and part == "self_attn.k_proj":
                tensor = _unpermute_rows(tensor, num_kv_heads)
        elif base in _GGUF_TOP_NAMES:
            name = _GGUF_TOP_NAMES[base]
        else:
            raise UnsupportedModelError(f"{path}: unknown GGUF tensor {base!r}")
        if family == "gemma3" and name.endswith("norm") and isinstance(tensor, mx.array):
            tensor = tensor - 1.0
        out[name + ".weight"] = tensor
    return out


def read_safetensors_dir(path: Path) -> dict[str, Tensor]:
    """Load single or sharded model*.safetensors (with index) from an HF directory."""
    index = path / "model.safetensors.index.json"
    if index.exists():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        files = [path / s for s in shards]
    else:
        files = sorted(path.glob("model*.safetensors"))
    if not files:
        raise ModelLoadError(f"{path}: no model*.safetensors files")
    raw: dict[str, mx.array] = {}
    for f in files:
        if not f.exists():
            raise ModelLoadError(f"{path}: shard {f.name} named in the index is missing")
        raw.update(mx.load(str(f)))
    out: dict[str, Tensor] = {}
    for key, value in raw.items():
        if key.endswith(".scales") or key.endswith(".biases"):
            continue
        base = key[: -len(".weight")] if key.endswith(".weight") else None
        if base is not None and base + ".scales" in raw:
            scales = raw[base + ".scales"]
            out[key] = _mlx_quantized(value, scales, raw.get(base + ".biases"), path)
        else:
            out[_strip_prefix(key)] = value
    return {_strip_prefix(k): v for k, v in out.items()}


def _mlx_quantized(w: mx.array, scales: mx.array, biases: mx.array | None,
                   path: Path) -> QuantizedWeight:
    cfg = json.loads((path / "config.json").read_text()).get("quantization", {})
    group = int(cfg.get("group_size", 64))
    bits = w.shape[-1] * 32 // (scales.shape[-1] * group)
    if biases is None:
        raise UnsupportedModelError(f"{path}: quantized tensors without biases are unsupported")
    return QuantizedWeight(w, scales, biases, group, bits)


def _strip_prefix(key: str) -> str:
    """Gemma3 multimodal checkpoints nest the text model; keep HF causal-LM names."""
    return key.replace("model.language_model.", "model.").replace("language_model.", "")


def stack_experts(weights: dict[str, Tensor], num_layers: int, num_experts: int) -> None:
    """Turn HF per-expert tensors into one [E, out, in] tensor per layer and projection."""
    for i in range(num_layers):
        for proj in ("gate_proj", "up_proj", "down_proj"):
            stacked = f"model.layers.{i}.mlp.experts.{proj}.weight"
            if stacked in weights:
                continue
            keys = [f"model.layers.{i}.mlp.experts.{e}.{proj}.weight" for e in range(num_experts)]
            if all(k in weights for k in keys):
                parts = [weights.pop(k) for k in keys]
                if any(isinstance(p, QuantizedWeight) for p in parts):
                    raise UnsupportedModelError("per-expert quantized tensors are unsupported")
                weights[stacked] = mx.stack(parts)  # type: ignore[arg-type]
