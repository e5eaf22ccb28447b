"""GGUF files on the GPU against the CPU run of the same file (skipped where MLX has no GPU).

Each file is written here by the `gguf` package itself (the device has no llama.cpp
converter): a llama, a Gemma 3, a Qwen2 (q/k/v biases), a Phi-3 (fused qkv and gate_up,
LongRoPE factor tensors on 3/4 of each head, positions past the original context) and a
gpt-oss (sinks, biases, alternating windows, YaRN, MXFP4 experts kept as MLX mxfp4) of
random weights in llama.cpp's names and keys, their projections Q4_0 and the embedding and
output Q8_0 (gguf-py quantizes those types; the K-quants need llama-quantize), which
slotserve holds as MLX 4- and 8-bit, group 32 (gpt-oss's sinks in slotserve's CUDA
attention kernel). The
criteria are tests/test_gpu_families.py's: the GPU run (bfloat16, MLX's quantized matmul:
slotserve's CUDA 4-bit kernel takes group 64 only) agrees with the CPU run's top token at
>= 95 % of 64 teacher-forced positions of the CPU's greedy continuation, and no logit
differs by more than 10 % of the CPU logits' range.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import pytest

from slotserve.model.layers import Batch
from slotserve.model.loader import load
from slotserve.runtime.plain import greedy_tokens

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not mx.is_available(mx.gpu), reason="needs MLX with a GPU"),
]

H, INTER, V, HEADS, KV, D, LAYERS, WINDOW = 128, 256, 512, 4, 2, 32, 6, 16
STEPS, PROMPT_LEN, MIN_AGREEMENT = 64, 24, 0.95
ARCHS = ("llama", "gemma3", "qwen2", "phi3", "gpt-oss")
EXPERTS, PHI3_ROTARY, PHI3_ORIGINAL = 4, 24, 32  # gpt-oss's experts; Phi-3's RoPE


def write_gguf(arch: str, path: Path, seed: int = 0) -> Path:
    """A tiny random `arch` GGUF (one of ARCHS) written by gguf.GGUFWriter."""
    import gguf

    rng = np.random.default_rng(seed)
    q4, q8 = gguf.GGMLQuantizationType.Q4_0, gguf.GGMLQuantizationType.Q8_0
    mxfp4 = gguf.GGMLQuantizationType.MXFP4
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(LAYERS)
    w.add_context_length(512)
    w.add_embedding_length(H)
    w.add_feed_forward_length(INTER)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV)
    w.add_key_length(D)
    w.add_value_length(D)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(10_000.0)
    w.add_vocab_size(V)
    if arch in ("gemma3", "phi3", "gpt-oss"):
        w.add_sliding_window(WINDOW)  # gemma3: 5 sliding, 1 global; gpt-oss: alternating
    if arch == "phi3":
        w.add_rope_dimension_count(PHI3_ROTARY)
        w.add_rope_scaling_orig_ctx_len(PHI3_ORIGINAL)
        w.add_rope_scaling_attn_factors(1.19)
    if arch == "gpt-oss":
        w.add_expert_count(EXPERTS)
        w.add_expert_used_count(2)
        w.add_expert_feed_forward_length(INTER)
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(32.0)
        w.add_rope_scaling_orig_ctx_len(32)

    def put(name: str, shape: tuple[int, ...], std: float, kind: Any = None,
            mean: float = 0.0) -> None:
        arr = rng.normal(mean, std, shape).astype(np.float32)
        if kind is None:
            w.add_tensor(name, arr)
        else:
            w.add_tensor(name, gguf.quants.quantize(arr, kind), raw_dtype=kind)

    put("token_embd.weight", (V, H), 0.5, q8)
    put("output.weight", (V, H), 0.5, q8)
    put("output_norm.weight", (H,), 0.1, mean=1.0)  # gemma's are stored as 1 + w, too
    norms = ["attn_norm", "post_attention_norm" if arch == "gpt-oss" else "ffn_norm"]
    if arch == "gemma3":
        norms += ["post_attention_norm", "post_ffw_norm"]
    if arch == "phi3":  # LongRoPE's per-frequency factors over the rotated dims
        put("rope_factors_short.weight", (PHI3_ROTARY // 2,), 0.2, mean=1.5)
        put("rope_factors_long.weight", (PHI3_ROTARY // 2,), 1.0, mean=6.0)
    attention = [("attn_q", (HEADS * D, H)), ("attn_k", (KV * D, H)),
                 ("attn_v", (KV * D, H)), ("attn_output", (H, HEADS * D))]
    mlp = [("ffn_gate", (INTER, H)), ("ffn_up", (INTER, H)), ("ffn_down", (H, INTER))]
    if arch == "phi3":  # llama.cpp keeps Phi-3's fused projections fused
        attention = [("attn_qkv", ((HEADS + 2 * KV) * D, H)), attention[-1]]
        mlp = [("ffn_up", (2 * INTER, H)), mlp[-1]]
    if arch == "gpt-oss":
        mlp = []
    for i in range(LAYERS):
        p = f"blk.{i}"
        for n in norms:
            put(f"{p}.{n}.weight", (H,), 0.1, mean=1.0)
        if arch == "gemma3":
            put(f"{p}.attn_q_norm.weight", (D,), 0.1, mean=1.0)
            put(f"{p}.attn_k_norm.weight", (D,), 0.1, mean=1.0)
        for n, shape in attention + mlp:
            put(f"{p}.{n}.weight", shape, 0.05, q4)
            if arch == "gpt-oss" or (arch == "qwen2" and n in ("attn_q", "attn_k", "attn_v")):
                put(f"{p}.{n}.bias", shape[:1], 0.05)
        if arch == "gpt-oss":
            put(f"{p}.attn_sinks.weight", (HEADS,), 1.0)
            put(f"{p}.ffn_gate_inp.weight", (EXPERTS, H), 0.2)
            put(f"{p}.ffn_gate_inp.bias", (EXPERTS,), 0.2)
            for n, shape in (("gate", (INTER, H)), ("up", (INTER, H)), ("down", (H, INTER))):
                put(f"{p}.ffn_{n}_exps.weight", (EXPERTS, *shape), 0.05, mxfp4)
                put(f"{p}.ffn_{n}_exps.bias", (EXPERTS, shape[0]), 0.05)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def teacher_forced(model: Any, seq: list[int]) -> np.ndarray:
    """Logits at every position of seq after the prompt's last token (one prefill)."""
    n = len(seq)
    rows = list(range(PROMPT_LEN - 1, n - 1))
    out = model(mx.array(seq), Batch.build([(model.new_kv(), 0, n)]), rows)
    return np.array(out.astype(mx.float32))


def cpu_reference(path: Path) -> tuple[list[int], np.ndarray]:
    model = load(path, device="cpu", with_tokenizer=False, probe_rows=None).model
    prompt = np.random.default_rng(1).integers(3, V, PROMPT_LEN).tolist()
    seq = prompt + greedy_tokens(model, prompt, STEPS)
    return seq, teacher_forced(model, seq)


@pytest.fixture(autouse=True)
def default_device() -> Iterator[None]:
    before = mx.default_device()
    yield
    mx.set_default_device(before)


@pytest.mark.parametrize("arch", ARCHS)
def test_gguf_on_gpu_matches_cpu_run_of_the_same_file(arch: str, tmp_path: Path) -> None:
    path = write_gguf(arch, tmp_path / f"{arch}.gguf")
    seq, want = cpu_reference(path)
    model = load(path, device="gpu", with_tokenizer=False, probe_rows=None).model
    got = teacher_forced(model, seq)
    agreement = float((got.argmax(-1) == np.array(seq[PROMPT_LEN:])).mean())
    diff = float(np.abs(got - want).max())
    spread = float(want.max() - want.min())
    assert agreement >= MIN_AGREEMENT, f"{arch}: top-1 agreement {agreement}, max diff {diff}"
    assert diff <= 0.1 * spread, f"{arch}: max |logit diff| {diff}, CPU logit range {spread}"
