"""Qwen3.5 / Qwen3.5-MoE / Qwen3-Next GGUF files made by llama.cpp's convert_hf_to_gguf.py
(b11434) against transformers: f16 and bf16 32 greedy tokens equal, Q8_0 within its
activations' rounding.

The converter writes the Gated DeltaNet layers its own way (conversion/qwen.py,
Qwen3NextModel and _LinearAttentionVReorderBase): ssm_a holds -exp(A_log), dt_bias becomes
ssm_dt.bias, the conv weight loses its middle axis, every zero-centered norm but the
DeltaNet's gated one is stored as 1 + w, and with more value than key heads the value heads
are reordered from grouped by key head to tiled (slotserve keeps them tiled:
deltanet.GatedDeltaNet's `tiled_value_heads`; not in Qwen3-Next's files, whose fused
in_proj_qkvz the converter splits into q/k/v and z). The reference for each file is transformers
on the file's own numbers (gguf-py dequantizes them; `hf_state` undoes the converter's
steps, independently of slotserve's reader), so a quantized file is checked for what it
holds, not for its quantization error. The tiny checkpoint has 2 key and 4 value heads
(the reorder matters) and spread token-embedding norms (converted.tiny_hf's row_spread:
a clear top logit, as in a trained model).
"""

from __future__ import annotations  # noqa: I001  (slotserve preloads OpenBLAS before MLX)

import json
import shutil
from functools import cache
from pathlib import Path
from typing import Any

import slotserve  # noqa: F401
import mlx.core as mx
import numpy as np
import pytest

from converted import gguf_py_tensors, tiny_hf, to_gguf
from model_checks import hf_greedy

from slotserve.model.layers import Batch
from slotserve.model.loader import load
from slotserve.runtime.plain import greedy_tokens

transformers = pytest.importorskip("transformers")
torch = pytest.importorskip("torch")

HK, HV, DK, DV = 2, 4, 16, 16
SHAPE = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, head_dim=32, linear_num_key_heads=HK,
             linear_num_value_heads=HV, linear_key_head_dim=DK, linear_value_head_dim=DV,
             max_position_embeddings=4096, tie_word_embeddings=False)
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
           shared_expert_intermediate_size=48)
CASES: dict[str, dict[str, Any]] = {"qwen3_5_text": {}, "qwen3_5_moe_text": MOE,
                                    "qwen3_next": MOE}
FAMILIES = {"qwen3_5_text": "qwen3_5", "qwen3_5_moe_text": "qwen3_5_moe",
            "qwen3_next": "qwen3_next"}
# the dense family in every format; the MoE ones share its DeltaNet and attention paths,
# so one float format each (the experts and Qwen3-Next's layout)
RUNS = [("qwen3_5_text", "f16"), ("qwen3_5_text", "bf16"), ("qwen3_5_text", "q8_0"),
        ("qwen3_5_moe_text", "f16"), ("qwen3_next", "bf16")]
PROMPT = np.random.default_rng(0).integers(0, 49152, 40).tolist()
NEW = 32
NAMES = {"attn_norm": "input_layernorm", "post_attention_norm": "post_attention_layernorm",
         "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
         "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
         "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
         "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
         "attn_qkv": "linear_attn.in_proj_qkv", "attn_gate": "linear_attn.in_proj_z",
         "ssm_alpha": "linear_attn.in_proj_a", "ssm_beta": "linear_attn.in_proj_b",
         "ssm_conv1d": "linear_attn.conv1d", "ssm_norm": "linear_attn.norm",
         "ssm_out": "linear_attn.out_proj", "ssm_a": "linear_attn.A_log",
         "ssm_dt": "linear_attn.dt_bias", "ssm_ba": "linear_attn.in_proj_ba"}
MOE_NAMES = {"ffn_gate_inp": "mlp.gate", "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
             "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
             "ffn_up_shexp": "mlp.shared_expert.up_proj",
             "ffn_down_shexp": "mlp.shared_expert.down_proj"}


def _grouped(t: np.ndarray, axis: int, head: int) -> np.ndarray:
    """The converter's value-head reorder undone along `axis`: tiled -> grouped by key head."""
    t = np.moveaxis(t, axis, 0)
    rest = t.shape[1:]
    t = t.reshape(HV // HK, HK, head, *rest).swapaxes(0, 1).reshape(HV * head, *rest)
    return np.moveaxis(t, 0, axis)


def _qkvz(qkv: np.ndarray, z: np.ndarray) -> np.ndarray:
    """Qwen3-Next's in_proj_qkvz (per key head: its q, k, then its value heads' v and z)
    from the converter's split."""
    r = HV // HK
    q, k, v = qkv[: HK * DK], qkv[HK * DK : 2 * HK * DK], qkv[2 * HK * DK :]
    return np.concatenate([np.concatenate([q[h * DK : (h + 1) * DK], k[h * DK : (h + 1) * DK],
                                           v[h * r * DV : (h + 1) * r * DV],
                                           z[h * r * DV : (h + 1) * r * DV]])
                           for h in range(HK)])


def hf_state(path: Path, tiled: bool = True, next_layout: bool = False) -> dict[str, Any]:
    """transformers' state dict of the numbers a GGUF file holds (gguf-py dequantizes);
    `tiled`: the file's value heads are in the converter's tiled order (Qwen3.5's);
    `next_layout`: transformers' Qwen3-Next names (in_proj_qkvz, in_proj_ba)."""
    def grouped(t: np.ndarray, axis: int, head: int) -> np.ndarray:
        return _grouped(t, axis, head) if tiled else t

    out: dict[str, Any] = {}
    experts: dict[str, dict[str, np.ndarray]] = {}
    for name, v in gguf_py_tensors(path).items():
        if name == "token_embd.weight":
            out["model.embed_tokens.weight"] = v
            continue
        if name in ("output.weight", "output_norm.weight"):
            out["lm_head.weight" if name == "output.weight" else "model.norm.weight"] = (
                v if name == "output.weight" else v - 1.0)
            continue
        _, layer, part, *_ = name.split(".")
        if int(layer) >= SHAPE["num_hidden_layers"]:  # the MTP head's block (transformers
            continue  # reads none of it either)
        p = f"model.layers.{layer}"
        if part in ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"):
            experts.setdefault(p, {})[part] = v
            continue
        if part in MOE_NAMES:
            out[f"{p}.{MOE_NAMES[part]}.weight"] = v
            continue
        if part in ("attn_norm", "post_attention_norm", "attn_q_norm", "attn_k_norm"):
            v = v - 1.0
        if part == "ssm_a":
            v = np.log(-v)
        if part in ("ssm_a", "ssm_dt", "ssm_alpha", "ssm_beta"):
            v = grouped(v, 0, 1)
        elif part in ("attn_gate",):
            v = grouped(v, 0, DV)
        elif part == "attn_qkv":
            v = np.concatenate([v[: 2 * HK * DK], grouped(v[2 * HK * DK :], 0, DV)])
        elif part == "ssm_conv1d":
            v = np.concatenate([v[: 2 * HK * DK], grouped(v[2 * HK * DK :], 0, DV)])[:, None]
        elif part == "ssm_out":
            v = grouped(v, 1, DV)
        suffix = "" if part in ("ssm_a", "ssm_dt") else ".weight"
        out[f"{p}.{NAMES[part]}{suffix}"] = v
    for p, e in experts.items():  # transformers 5: [E, 2I, H] gate then up, [E, H, I]
        out[f"{p}.mlp.experts.gate_up_proj"] = np.concatenate(
            [e["ffn_gate_exps"], e["ffn_up_exps"]], axis=1)
        out[f"{p}.mlp.experts.down_proj"] = e["ffn_down_exps"]
    if next_layout:
        for name in [n for n in out if n.endswith("linear_attn.in_proj_qkv.weight")]:
            z = out.pop(name.replace("in_proj_qkv", "in_proj_z"))
            out[name.replace("in_proj_qkv", "in_proj_qkvz")] = _qkvz(out.pop(name), z)
    return {k: torch.from_numpy(np.array(v, copy=True)) for k, v in out.items()}


def _convertible(hf: Path, out: Path) -> Path:
    """hf_dir as the converter takes it: its tokenizer check knows SmolLM2's pre-tokenizer
    only as transformers' generic tokenizer gives it, which the qwen3_5 text model type maps
    to and the MoE and Next ones do not (they map to Qwen's own class): the copy says
    qwen3_5_text (the converter picks its model class by `architectures` alone)."""
    if not out.exists():
        shutil.copytree(hf, out)
        cfg = json.loads((out / "config.json").read_text())
        cfg["model_type"] = "qwen3_5_text"
        (out / "config.json").write_text(json.dumps(cfg))
    return out


@cache
def hf_dir(model_type: str = "qwen3_5_text") -> Path:
    return tiny_hf(model_type, {**SHAPE, **CASES[model_type]}, row_spread=1.0)


@pytest.mark.parametrize(("model_type", "fmt"), RUNS)
def test_converted_gguf_matches_transformers(model_type: str, fmt: str,
                                             tmp_path_factory: pytest.TempPathFactory) -> None:
    """f16 and bf16: 32 greedy tokens equal. Q8_0 stays 8-bit and meets int8 activations
    (as llama.cpp's CPU path does): its logits are within 6 % RMS of the reference over 64
    of the reference's tokens and agree on the top token at >= 95 % of them (measured:
    4.6 % and 97 %; the DeltaNet's exp-gated decays carry the activations' rounding along
    the sequence, so its greedy run parts from the reference after 20-30 tokens)."""
    src = hf_dir(model_type)
    if model_type != "qwen3_5_text":
        src = _convertible(src, tmp_path_factory.getbasetemp() / f"convertible-{src.name}")
    path = to_gguf(src, fmt, ("--no-mtp",))  # (a tiny checkpoint has no MTP head)
    hf = transformers.AutoModelForCausalLM.from_pretrained(hf_dir(model_type),
                                                           dtype=torch.float32)
    nxt = model_type == "qwen3_next"
    missing, unexpected = hf.load_state_dict(hf_state(path, not nxt, nxt), strict=False)
    assert not missing and not unexpected, (missing, unexpected)
    hf.eval()
    loaded = load(path, device="cpu", with_tokenizer=False, probe_rows=None)
    cfg = loaded.config
    assert cfg.family == FAMILIES[model_type]
    assert cfg.value_heads_tiled is not nxt  # type: ignore[attr-defined]
    assert cfg.layer_types == ["linear_attention"] * 3 + ["full_attention"]  # type: ignore[attr-defined]
    if fmt != "q8_0":
        assert greedy_tokens(loaded.model, PROMPT, NEW) == hf_greedy(hf, PROMPT, NEW)
        return
    seq = PROMPT + hf_greedy(hf, PROMPT, 2 * NEW)
    with torch.no_grad():
        ref = hf(torch.tensor([seq])).logits[0].numpy()
    model = loaded.model
    got = np.array(model(mx.array(seq), Batch.build([(model.new_kv(), 0, len(seq))]),
                         list(range(len(seq)))))
    rms = float(np.sqrt(np.mean((got - ref) ** 2) / np.mean(ref**2)))
    assert rms <= 0.06, rms
    first = len(PROMPT) - 1  # the position that predicts the first new token
    agree = float(np.mean(got[first:-1].argmax(-1) == ref[first:-1].argmax(-1)))
    assert agree >= 0.95, agree


def test_a_file_with_its_mtp_head_loads_the_decoder(
        tmp_path_factory: pytest.TempPathFactory) -> None:
    """The released checkpoints carry a multi-token-prediction head (`mtp.*`), which the
    converter writes as one more block (block_count 5, nextn_predict_layers 1): the
    decoder's four blocks are read, the head's left (as transformers leaves `mtp.*`)."""
    from safetensors.torch import load_file, save_file

    out = tmp_path_factory.getbasetemp() / "qwen3_5-mtp"
    if not out.exists():
        shutil.copytree(hf_dir(), out)
        w = load_file(str(out / "model.safetensors"))
        for k in [k for k in w if k.startswith("model.layers.3.")]:  # a full-attention block
            w["mtp.layers.0." + k[len("model.layers.3."):]] = w[k].clone()
        g = torch.Generator().manual_seed(0)
        w["mtp.fc.weight"] = torch.randn(64, 128, generator=g) * 0.05
        for n in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
            w[f"mtp.{n}.weight"] = torch.randn(64, generator=g) * 0.3
        save_file(w, str(out / "model.safetensors"), metadata={"format": "pt"})
        cfg = json.loads((out / "config.json").read_text())
        (out / "config.json").write_text(json.dumps({**cfg, "mtp_num_hidden_layers": 1}))
    path = to_gguf(out, "f16")
    hf = transformers.AutoModelForCausalLM.from_pretrained(hf_dir(), dtype=torch.float32)
    missing, unexpected = hf.load_state_dict(hf_state(path), strict=False)
    assert not missing and not unexpected, (missing, unexpected)
    loaded = load(path, device="cpu", with_tokenizer=False, probe_rows=None)
    assert loaded.config.num_layers == 4
    assert greedy_tokens(loaded.model, PROMPT, NEW) == hf_greedy(hf.eval(), PROMPT, NEW)
