"""Read checkpoint tensors into one naming scheme (Hugging Face's).

GGUF files are read by slotserve.model.gguf: quantized tensors arrive as MLX affine
quantized triples (group size 32, 4 or 8 bits per tensor; which GGML type becomes what is
said there), dense ones as stored.
Names are mapped to HF names by llama.cpp's convention (`GGUF_LAYER_NAMES`, plus what the
family adds); what a family's GGUF files do differently is the family's to say
(`Family`): llama.cpp's Q/K row permutation (done for the llama architecture so it can
use interleaved RoPE) is undone, so every family runs HF's rotate-half RoPE, and norm
weights stored with an offset (gemma's, +1) are shifted back.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Protocol

import mlx.core as mx

from slotserve.kernels.quantized import Mxfp4Weight, QuantizedWeight
from slotserve.model.config import ModelConfig
from slotserve.model.errors import ModelLoadError, UnsupportedModelError

GROUP_SIZE_GGUF = 32


Tensor = mx.array | QuantizedWeight

# llama.cpp's names of a block's tensors, as every family's GGUF files use them; a family
# adds its own or renames one (Family.gguf_layer_names)
GGUF_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
GGUF_TOP_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}


class GGUFConventions(Protocol):
    """What a family's GGUF files do their own way (slotserve.model.family.Family has it)."""

    @property
    def gguf_layer_names(self) -> Mapping[str, str]: ...

    @property
    def gguf_top_names(self) -> Mapping[str, str]: ...

    @property
    def gguf_interleaved_qk(self) -> bool: ...

    @property
    def gguf_norm_offset(self) -> float: ...


def _unpermute_rows(t: Tensor, n_heads: int) -> Tensor:
    """Invert llama.cpp's per-head interleave of Q/K rows (HF rotate-half layout)."""
    rows = t.shape[0]
    half = rows // n_heads // 2
    order = mx.arange(rows).reshape(n_heads, half, 2).swapaxes(1, 2).reshape(rows)
    return t.take_rows(order) if isinstance(t, QuantizedWeight) else t[order]


def read_gguf(path: Path, family: GGUFConventions, cfg: ModelConfig,
              raw: dict[str, mx.array]) -> dict[str, Tensor]:
    """Map GGUF tensors (as slotserve.model.gguf.read_tensors gives them) to HF names."""
    layer_names = {**GGUF_LAYER_NAMES, **family.gguf_layer_names}
    top_names = {**GGUF_TOP_NAMES, **family.gguf_top_names}
    heads = {"self_attn.q_proj": cfg.num_heads, "self_attn.k_proj": cfg.num_kv_heads}
    out: dict[str, Tensor] = {}
    # a block's tensor named without a suffix (Qwen3.5's blk.N.ssm_a) is its weight
    raw = {(k + ".weight" if re.fullmatch(r"blk\.\d+\.\w+", k) else k): v
           for k, v in raw.items()}
    bases = sorted({k.rsplit(".", 1)[0] for k in raw})
    # dense tensors beside a weight under another suffix (Gemma 4's router and expert
    # `.scale`s): kept under the HF name plus that suffix, for the family to place
    extras: dict[str, dict[str, mx.array]] = {}
    for key, value in raw.items():
        base, _, suffix = key.rpartition(".")
        if base and suffix not in ("weight", "scales", "biases", "bias"):
            extras.setdefault(base, {})[suffix] = value
    for base in bases:
        block = re.match(r"blk\.(\d+)\.", base)
        if block and int(block.group(1)) >= cfg.num_layers:
            continue  # past the decoder's blocks: a multi-token-prediction head (nextn)
        w = raw.get(base + ".weight")
        if w is None and base + ".bias" not in raw:
            raise UnsupportedModelError(f"{path}: tensor {base} has no weight")
        scales = raw.get(base + ".scales")
        tensor: Tensor | Mxfp4Weight | None
        if w is None:  # a bias alone (Qwen3.5's blk.N.ssm_dt.bias)
            tensor = None
        elif scales is not None and scales.dtype == mx.uint8:  # E8M0 scales: MXFP4 experts
            tensor = Mxfp4Weight(w, scales)
        elif scales is not None:
            bits = w.shape[-1] * 32 // (scales.shape[-1] * GROUP_SIZE_GGUF)
            tensor = QuantizedWeight(w, scales, raw[base + ".biases"], GROUP_SIZE_GGUF, bits)
        elif w.dtype in (mx.uint8, mx.uint32, mx.int8):
            raise UnsupportedModelError(f"{path}: tensor {base} has an unsupported quant type")
        else:
            tensor = w
        bias = raw.get(base + ".bias")  # Qwen2's q/k/v biases, `attention_bias` models
        m = re.fullmatch(r"blk\.(\d+)\.(\w+)", base)
        if m:
            part = layer_names.get(m.group(2))
            if part is None:
                raise UnsupportedModelError(f"{path}: unknown GGUF tensor {base!r}")
            name = f"model.layers.{m.group(1)}.{part}"
            if family.gguf_interleaved_qk and part in heads and tensor is not None:
                tensor = _unpermute_rows(tensor, heads[part])
                bias = None if bias is None else _unpermute_rows(bias, heads[part])
        elif base in top_names:
            name = top_names[base]
        else:
            raise UnsupportedModelError(f"{path}: unknown GGUF tensor {base!r}")
        if family.gguf_norm_offset and name.endswith("norm") and isinstance(tensor, mx.array):
            tensor = tensor - family.gguf_norm_offset
        if tensor is not None:
            out[name + ".weight"] = tensor
        if bias is not None:
            out[name + ".bias"] = bias
        for suffix, value in extras.get(base, {}).items():
            out[f"{name}.{suffix}"] = value
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
