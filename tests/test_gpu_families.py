"""Qwen2, Mistral, Phi-3, Gemma 3 (ConditionalGeneration layout) and gpt-oss on the GPU against
the CPU run of the same file (skipped where MLX has no GPU, e.g. CI).

Each checkpoint is written here with MLX alone (the device has no transformers): random
weights in the family's Hugging Face names, its projections MLX 4-bit as mlx-lm writes
them (gpt-oss: its experts in the released MXFP4 layout). The CPU run (float32 compute,
slotserve's CPU kernels) is the reference: the GPU run (bfloat16, slotserve's CUDA 4-bit
and attention kernels, the attention kernel with gpt-oss's sinks; gpt-oss also on MLX ops,
SLOTSERVE_CUDA_KERNELS=0) must agree on the
top token at >= 95 % of 64 teacher-forced positions of the CPU's greedy continuation, and
no logit may differ by more than 10 % of the CPU logits' range (bfloat16 rounding is ~1 %;
a dropped bias, sink or window moves them by far more). The shapes take the CUDA kernels
(widths multiples of 128, head_dim 32); the windows (16) are shorter than the sequence.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import pytest

from slotserve.model.layers import Backend, Batch
from slotserve.model.loader import load
from slotserve.runtime.plain import greedy_tokens

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not mx.is_available(mx.gpu), reason="needs MLX with a GPU"),
]

H, INTER, V, HEADS, KV, D, LAYERS, WINDOW = 128, 256, 512, 4, 2, 32, 3, 16
STEPS, PROMPT_LEN, MIN_AGREEMENT = 64, 24, 0.95
FAMILIES = ["qwen2", "mistral", "phi3", "gemma3-cg", "gpt-oss"]
LAYER_TYPES = ["sliding_attention", "full_attention", "sliding_attention"]


def _config(family: str) -> dict[str, Any]:
    common: dict[str, Any] = dict(
        hidden_size=H, intermediate_size=INTER, vocab_size=V, num_hidden_layers=LAYERS,
        num_attention_heads=HEADS, num_key_value_heads=KV, head_dim=D, rms_norm_eps=1e-6,
        max_position_embeddings=512, tie_word_embeddings=False, rope_theta=10_000.0)
    if family == "qwen2":
        return {**common, "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2",
                "use_sliding_window": False}
    if family == "mistral":
        return {**common, "architectures": ["MistralForCausalLM"], "model_type": "mistral",
                "sliding_window": WINDOW}
    if family == "phi3":
        rotary = int(D * 0.75) // 2
        return {**common, "architectures": ["Phi3ForCausalLM"], "model_type": "phi3",
                "partial_rotary_factor": 0.75, "original_max_position_embeddings": 48,
                "rope_scaling": {"type": "longrope",
                                 "short_factor": [1.0 + 0.1 * i for i in range(rotary)],
                                 "long_factor": [2.0 + 0.5 * i for i in range(rotary)]}}
    if family == "gemma3-cg":
        text = {**common, "model_type": "gemma3_text", "sliding_window": WINDOW,
                "layer_types": LAYER_TYPES, "query_pre_attn_scalar": D,
                "rope_local_base_freq": 10_000.0, "tie_word_embeddings": True}
        return {"architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3",
                "text_config": text}
    assert family == "gpt-oss"
    return {**common, "architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss",
            "num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": WINDOW,
            "layer_types": LAYER_TYPES, "attention_bias": True, "swiglu_limit": 7.0,
            "rope_scaling": {"rope_type": "yarn", "factor": 8.0, "beta_fast": 32.0,
                             "beta_slow": 1.0, "truncate": False,
                             "original_max_position_embeddings": 64}}


def _tensors(family: str, rng: np.random.Generator) -> dict[str, mx.array]:
    """Random weights under the family's checkpoint names (float32)."""

    def rand(*shape: int, std: float = 0.05, mean: float = 0.0) -> mx.array:
        return mx.array(rng.normal(mean, std, shape).astype(np.float32))

    pre = "language_model.model" if family == "gemma3-cg" else "model"
    norm_mean = 0.0 if family == "gemma3-cg" else 1.0  # Gemma's norms act as (1 + w)
    # Gemma scales its (tied) embedding by sqrt(hidden) and norms every output: drawn as
    # tests/test_oracle_gemma3.py draws it, so its greedy tokens vary
    gemma = family == "gemma3-cg"
    norm_std = 0.3 if gemma else 0.1
    t: dict[str, mx.array] = {f"{pre}.embed_tokens.weight": rand(V, H, std=0.3 if gemma
                                                                 else 0.5),
                              f"{pre}.norm.weight": rand(H, std=norm_std, mean=norm_mean)}
    if family != "gemma3-cg":
        t["lm_head.weight"] = rand(V, H, std=0.5)
    for i in range(LAYERS):
        p = f"{pre}.layers.{i}"
        for n in ("input_layernorm", "post_attention_layernorm"):
            t[f"{p}.{n}.weight"] = rand(H, std=norm_std, mean=norm_mean)
        a = f"{p}.self_attn"
        if family == "phi3":
            t[f"{a}.qkv_proj.weight"] = rand((HEADS + 2 * KV) * D, H)
            t[f"{p}.mlp.gate_up_proj.weight"] = rand(2 * INTER, H)
            t[f"{p}.mlp.down_proj.weight"] = rand(H, INTER)
        else:
            for n, rows in (("q_proj", HEADS * D), ("k_proj", KV * D), ("v_proj", KV * D)):
                t[f"{a}.{n}.weight"] = rand(rows, H)
                if family in ("qwen2", "gpt-oss"):
                    t[f"{a}.{n}.bias"] = rand(rows, std=0.3)
        t[f"{a}.o_proj.weight"] = rand(H, HEADS * D)
        if family == "gemma3-cg":
            for n in ("pre_feedforward_layernorm", "post_feedforward_layernorm"):
                t[f"{p}.{n}.weight"] = rand(H, std=norm_std)
            t[f"{a}.q_norm.weight"], t[f"{a}.k_norm.weight"] = rand(D, std=0.3), rand(D, std=0.3)
        if family in ("qwen2", "mistral", "gemma3-cg"):
            for n, shape in (("gate_proj", (INTER, H)), ("up_proj", (INTER, H)),
                             ("down_proj", (H, INTER))):
                t[f"{p}.mlp.{n}.weight"] = rand(*shape)
        if family == "gpt-oss":
            t[f"{a}.o_proj.bias"] = rand(H, std=0.3)
            t[f"{a}.sinks"] = rand(HEADS, std=1.0)
            t[f"{p}.mlp.router.weight"], t[f"{p}.mlp.router.bias"] = rand(4, H), rand(4)
            e = f"{p}.mlp.experts"
            for n, (rows, cols) in (("gate_up_proj", (2 * INTER, H)), ("down_proj", (H, INTER))):
                codes, scales = mx.quantize(rand(4, rows, cols), group_size=32, bits=4,
                                            mode="mxfp4")
                t[f"{e}.{n}_blocks"] = codes.view(mx.uint8).reshape(4, rows, cols // 32, 16)
                t[f"{e}.{n}_scales"] = scales
                t[f"{e}.{n}_bias"] = rand(4, rows, std=0.3)
    return t


def write_checkpoint(family: str, path: Path, seed: int = 0) -> Path:
    """The family's tiny checkpoint with its 2-D projections MLX 4-bit (group 64)."""
    path.mkdir(parents=True, exist_ok=True)
    out: dict[str, mx.array] = {}
    for name, w in _tensors(family, np.random.default_rng(seed)).items():
        if name.endswith(("_proj.weight", "embed_tokens.weight", "lm_head.weight")):
            out[name], out[name[:-6] + "scales"], out[name[:-6] + "biases"] = mx.quantize(
                w, group_size=64, bits=4)
        else:
            out[name] = w
    mx.save_safetensors(str(path / "model.safetensors"), out, metadata={"format": "mlx"})
    cfg = {**_config(family), "quantization": {"group_size": 64, "bits": 4}}
    (path / "config.json").write_text(json.dumps(cfg))
    return path


def teacher_forced(model: Any, seq: list[int]) -> np.ndarray:
    """Logits at every position of seq after the prompt's last token (one prefill)."""
    n = len(seq)
    rows = list(range(PROMPT_LEN - 1, n - 1))
    return np.array(model(mx.array(seq), Batch.build([(model.new_kv(), 0, n)]), rows))


def cpu_reference(path: Path) -> tuple[list[int], np.ndarray]:
    """The CPU run's greedy continuation (prompt + STEPS tokens) and its logits."""
    model = load(path, device="cpu", with_tokenizer=False, probe_rows=None).model
    prompt = np.random.default_rng(1).integers(3, V, PROMPT_LEN).tolist()
    seq = prompt + greedy_tokens(model, prompt, STEPS)
    return seq, teacher_forced(model, seq)


@pytest.fixture
def default_device() -> Iterator[None]:
    before = mx.default_device()
    yield
    mx.set_default_device(before)


@pytest.mark.usefixtures("default_device")
@pytest.mark.parametrize(("family", "cuda_kernels"),
                         [(f, True) for f in FAMILIES] + [("gpt-oss", False)])
def test_gpu_matches_cpu_run_of_the_same_file(family: str, cuda_kernels: bool, tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    path = write_checkpoint(family, tmp_path / family)
    seq, want = cpu_reference(path)
    if not cuda_kernels:  # MLX ops on the GPU
        monkeypatch.setenv("SLOTSERVE_CUDA_KERNELS", "0")
    model = load(path, device="gpu", with_tokenizer=False, probe_rows=None).model
    backends = {b.attn.backend for b in model.layers}
    assert backends == {Backend.CUDA if cuda_kernels else Backend.MLX}, backends
    try:
        got = teacher_forced(model, seq)
    except RuntimeError as exc:  # an MLX launch the device refused: say how to find it
        pytest.fail(f"{family} on {next(iter(backends)).value}: the GPU forward raised {exc}; "
                    "`bash bench/gpu.sh mlx_ops` runs each MLX op of this path alone at "
                    "these shapes and names the one that fails")
    agreement = float((got.argmax(-1) == np.array(seq[PROMPT_LEN:])).mean())
    diff = float(np.abs(got - want).max())
    spread = float(want.max() - want.min())
    assert agreement >= MIN_AGREEMENT, f"{family}: top-1 agreement {agreement}, max diff {diff}"
    assert diff <= 0.1 * spread, f"{family}: max |logit diff| {diff}, CPU logit range {spread}"
