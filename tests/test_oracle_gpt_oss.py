"""gpt-oss (GptOssForCausalLM) against transformers on a tiny random checkpoint.

Sinks, biases and router biases are drawn large (HF zero-initializes some), the window (8)
is far shorter than the 40-token prompt on the sliding layers, YaRN has an original context
of 64 (so its ramp sits mid-spectrum) and the experts' GLU is clamped at a limit the random
activations reach (limit 0.5), so a dropped sink, bias, window, YaRN attention factor, the
interleaved gate/up order or the clamp each change the logits. Both the CPU attention
kernel and the MLX-ops attention (which take the sinks each their own way) are checked.

The same checkpoint in the released files' layout (experts as MXFP4 `*_blocks`/`*_scales`,
written with MLX's own mxfp4 quantizer, OpenAI's quantization_config) is read by
transformers' MXFP4 reader (Mxfp4Config(dequantize=True)) as the reference.
"""

from __future__ import annotations  # noqa: I001  (slotserve preloads OpenBLAS before MLX)

import json
from pathlib import Path
from typing import Any

import slotserve  # noqa: F401
import mlx.core as mx
import numpy as np
import pytest

from slotserve.kernels import native
from slotserve.kernels.quantized import Mxfp4Weight
from slotserve.model import layers
from slotserve.model.layers import Backend, Batch
from slotserve.runtime.plain import greedy_tokens

from model_checks import assert_mixed_decode_matches_solo, hf_greedy
from slotserve.model.loader import load

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

NEW_TOKENS = 32
YARN = {"rope_type": "yarn", "factor": 8.0, "beta_fast": 32.0, "beta_slow": 1.0,
        "truncate": False, "original_max_position_embeddings": 64, "rope_theta": 150_000.0}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any, list[int]]:
    cfg = transformers.GptOssConfig(
        vocab_size=384, hidden_size=64, intermediate_size=64, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=4,
        num_experts_per_tok=2, sliding_window=8, max_position_embeddings=512,
        swiglu_limit=0.5, rope_parameters=YARN, bos_token_id=None, eos_token_id=None,
        pad_token_id=None,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
    )
    torch.manual_seed(0)
    hf = transformers.GptOssForCausalLM(cfg).to(torch.float32).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "norm" in name:
                p.normal_(1.0, 0.3)
            else:
                p.normal_(0.0, 1.0 if name.endswith("sinks") else
                          0.5 if "bias" in name else 0.08)
    path = tmp_path_factory.mktemp("gpt-oss")
    hf.save_pretrained(path, safe_serialization=True)
    prompt = np.random.default_rng(1).integers(3, 384, 40).tolist()
    return path, hf, prompt


@pytest.fixture(params=["cpu-kernel", "mlx-ops"])
def model(request: pytest.FixtureRequest, checkpoint: Any,
          monkeypatch: pytest.MonkeyPatch) -> Any:
    if request.param == "mlx-ops":
        monkeypatch.setattr(native, "library", lambda *a, **k: None)
    elif native.library() is None:
        pytest.skip("the CPU kernels are not built here")
    m = load(checkpoint[0], device="cpu", with_tokenizer=False).model
    want = Backend.CPU if request.param == "cpu-kernel" else Backend.MLX
    assert all(b.attn.backend is want and b.attn.sinks is not None for b in m.layers)
    return m


def test_config_read(model: Any, checkpoint: Any) -> None:
    c, h = model.config, checkpoint[1].config
    assert c.family == "gpt_oss" and c.attention_bias
    assert [c.window(i) for i in range(c.num_layers)] == [8, None, 8]
    assert (c.num_experts, c.experts_per_token, c.swiglu_limit) == (4, 2, 0.5)
    assert c.rope_scaling is not None and c.rope_scaling["rope_type"] == "yarn"
    assert model.layers[0].attn.rope.attention_factor == pytest.approx(
        checkpoint[1].model.rotary_emb.attention_scaling)
    assert h.layer_types[1] == "full_attention"


def test_logits_match_hf(model: Any, checkpoint: Any) -> None:
    _, hf, prompt = checkpoint
    n = len(prompt)
    ours = model(mx.array(prompt), Batch.build([(model.new_kv(), 0, n)]), list(range(n)))
    with torch.no_grad():
        want = hf(torch.tensor([prompt])).logits[0].numpy()
    diff = np.abs(np.array(ours) - want).max()
    assert diff <= 1e-3, f"max |logit diff| = {diff}"


def test_greedy_decode_matches_hf_generate(model: Any, checkpoint: Any) -> None:
    _, hf, prompt = checkpoint
    assert greedy_tokens(model, prompt, NEW_TOKENS) == hf_greedy(hf, prompt, NEW_TOKENS)


def test_mixed_decode_batch_gives_solo_bits(model: Any, checkpoint: Any,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """Three slots in one decode step (sinks, windows and experts routed per row) give each
    row exactly its solo logits; the row floor as the start-up probe sets it for 64-wide
    outputs (see test_oracle_gemma3)."""
    monkeypatch.setattr(layers, "LINEAR_ROW_FLOOR", 32)
    assert_mixed_decode_matches_solo(model, checkpoint[2], [11, 222, 333])


def write_mxfp4(src: Path, dst: Path) -> None:
    """src's checkpoint with the experts as the released files keep them: MXFP4 blocks
    [E, out, in / 32, 16] (two codes a byte, low nibble first) and E8M0 scales."""
    out: dict[str, mx.array] = {}
    for key, value in mx.load(str(src / "model.safetensors")).items():
        if key.endswith(("experts.gate_up_proj", "experts.down_proj")):
            codes, scales = mx.quantize(value.swapaxes(1, 2), group_size=32, bits=4,
                                        mode="mxfp4")
            e, rows, words = codes.shape
            out[key + "_blocks"] = codes.view(mx.uint8).reshape(e, rows, words * 4 // 16, 16)
            out[key + "_scales"] = scales
        else:
            out[key] = value
    dst.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(dst / "model.safetensors"), out, metadata={"format": "pt"})
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"] = {
        "quant_method": "mxfp4",
        "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                   "model.embed_tokens", "lm_head"]}
    (dst / "config.json").write_text(json.dumps(cfg))


def test_mxfp4_experts_match_transformers_reader(checkpoint: Any, tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """Logits and greedy tokens as transformers' MXFP4 reader gives them, the experts kept
    MXFP4, and decode rows keep their solo bits in a mixed batch."""
    path, _, prompt = checkpoint
    write_mxfp4(path, tmp_path)
    hf = transformers.GptOssForCausalLM.from_pretrained(
        tmp_path, quantization_config=transformers.Mxfp4Config(dequantize=True),
    ).to(torch.float32).eval()
    hf.generation_config.eos_token_id = None
    model = load(tmp_path, device="cpu", with_tokenizer=False).model
    n = len(prompt)
    ours = model(mx.array(prompt), Batch.build([(model.new_kv(), 0, n)]), list(range(n)))
    with torch.no_grad():
        want = hf(torch.tensor([prompt])).logits[0].numpy()
    diff = np.abs(np.array(ours) - want).max()
    assert diff <= 1e-3, f"max |logit diff| = {diff}"
    assert greedy_tokens(model, prompt, NEW_TOKENS) == hf_greedy(hf, prompt, NEW_TOKENS)
    experts = model.layers[0].mlp
    assert isinstance(experts.gate_up.q, Mxfp4Weight) and isinstance(experts.down.q, Mxfp4Weight)
    monkeypatch.setattr(layers, "LINEAR_ROW_FLOOR", 32)
    assert_mixed_decode_matches_solo(model, prompt, [11, 222, 333])
