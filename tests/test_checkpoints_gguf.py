"""GGUF files made by llama.cpp's own converter and quantizer load and match transformers.

Each family's tiny random checkpoint (transformers' real classes, tests/converted.py) goes
through convert_hf_to_gguf.py to f16 and Q8_0 and through llama-quantize to Q4_K_M (rows of
256, as K-quants need; Q4_K_M mixes Q4_K with Q6_K, which slotserve requantizes to 8-bit):
llama (plain and Llama-3-scaled), qwen3, gemma3, phi3 (fused projections, LongRoPE), qwen2
(f16: q/k/v biases, the real Qwen2 vocabulary), Mistral (f16), qwen3_moe (f16, Q8_0 and
llama-quantize's MXFP4_MOE: 3-D experts) and gpt-oss (f16, MXFP4_MOE, and its released
files' path: an HF checkpoint with MXFP4 experts through the converter, which repacks them).
The reference for each file is transformers run on the weights that file holds, dequantized
by transformers' own GGUF reader (converted.dequantized_hf), so a misread tensor, scale,
permutation or metadata key shows up, while the file's own rounding does not.

Criteria, over slotserve's 64 greedy tokens after the prompt and the reference's logits of
the whole sequence in one forward (teacher-forced): for f16, bf16 and Q8_0 the reference's
top-1 after each of the first 32 prefixes is slotserve's token (its own greedy run would
give the same 32); for every format top-1 agreement >= 0.95 and logits within RMS_TOL (RMS
of the difference over RMS of the reference logits). On the CPU slotserve
multiplies quantized weights with int8-quantized activations, as llama.cpp does: that is
the 1-1.5% the quantized files measure; f16 ones measure ~5e-7. The checkpoints spread
their token-embedding norms (row_spread) so that the top logit stands out as in a trained
model rather than tying with thousands of others.
"""

from __future__ import annotations  # noqa: I001  (slotserve preloads OpenBLAS before MLX)

from pathlib import Path
from typing import Any

import slotserve  # noqa: F401
import mlx.core as mx
import numpy as np
import pytest
from structlog.testing import capture_logs

from converted import dequantized_hf, quantize, tiny_hf, to_gguf, to_hf_mxfp4
from slotserve.model.config import gguf_rope_scaling
from slotserve.model.errors import UnsupportedModelError
from slotserve.model.layers import Batch
from slotserve.model.loader import load
from slotserve.runtime.plain import greedy_tokens

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

K_QUANT_SHAPE = dict(hidden_size=256, intermediate_size=512, head_dim=64)
CASES: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("llama", {}),
    # Llama 3.1's scaling, with an original context short enough to scale these positions:
    # the converter writes it as the rope_freqs tensor
    "llama3-rope": ("llama", {"rope_parameters": {
        "rope_type": "llama3", "rope_theta": 500_000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 64}}),
    "qwen3": ("qwen3", {}),
    # MistralForCausalLM (its window 4096 past these positions): the converter writes it as
    # llama, with no window key (llama.cpp's llama runs no window)
    "mistral": ("mistral", {}),
    # q/k/v biases; the real Qwen2 vocabulary (CASE_TOKENIZER), as the converter needs it
    "qwen2": ("qwen2", {}),
    # llama.cpp's layout: 5 sliding layers then a global one (the converter writes no
    # pattern), query scale 1/sqrt(head_dim) (it writes no scalar either), a logit softcap
    "gemma3": ("gemma3_text", {"num_hidden_layers": 6, "sliding_window": 16,
                               "query_pre_attn_scalar": 64, "final_logit_softcapping": 30.0}),
    # Gemma3ForConditionalGeneration (Gemma 3 4B-27B's layout; the converter writes its text
    # part): llama.cpp's 5:1 pattern, the 4B's linear RoPE scaling of the global layers (the
    # sliding ones unscaled), a tiny vision tower the file leaves out
    "gemma3-cg": ("gemma3", {
        "text_config": {**K_QUANT_SHAPE, "num_hidden_layers": 6, "sliding_window": 16,
                        "query_pre_attn_scalar": 64, "num_attention_heads": 4,
                        "num_key_value_heads": 2, "vocab_size": 49152,
                        "rope_scaling": {"rope_type": "linear", "factor": 8.0}},
        "vision_config": {"hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1,
                          "num_attention_heads": 2, "image_size": 28, "patch_size": 14,
                          "model_type": "siglip_vision_model"},
        "mm_tokens_per_image": 4}),
    # fused qkv / gate_up, LongRoPE on 0.75 of each head (an original context past these
    # positions: the short factors, the attention factor), a window on every layer, untied
    "phi3": ("phi3", {"partial_rotary_factor": 0.75, "original_max_position_embeddings": 128,
                      "rope_scaling": {"rope_type": "longrope",
                                       "short_factor": [1.0 + 0.1 * i for i in range(24)],
                                       "long_factor": [2.0 + 0.5 * i for i in range(24)]},
                      "sliding_window": 48, "tie_word_embeddings": False}),
    # experts as 3-D tensors [experts, out, in]; rows of 64, too short for K-quants; top-k
    # weights renormalized, as in the released models (llama.cpp assumes it: no key says)
    "qwen3_moe": ("qwen3_moe", {"hidden_size": 64, "head_dim": 16, "intermediate_size": 96,
                                "moe_intermediate_size": 32, "num_experts": 8,
                                "num_experts_per_tok": 2, "norm_topk_prob": True}),
    # sinks, biases everywhere, sliding (window 32) and full layers alternating, YaRN, 4
    # experts with the clamped GLU; MXFP4_MOE: llama-quantize's type of the released files
    # (MXFP4 experts, Q8_0 attention)
    "gpt_oss": ("gpt_oss", {"num_local_experts": 4, "num_experts_per_tok": 2,
                            "sliding_window": 32}),
}
# the tokenizer files (converted.TOKENIZERS) of the cases that cannot ship SmolLM2's as it is
CASE_TOKENIZER = {"qwen2": "qwen2", "phi3": "smollm2-gpt2"}
# phi3's seed-0 checkpoint has a near-tie (0.15 between the top two of logits spread over
# ~70, at token 22) that Q8_0's int8 activations flip (its RMS 1.5%, top-1 agreement 0.98)
# gpt_oss's seed-0 checkpoint falls into a two-token loop whose every other margin drifts to
# a tie (0.24 -> 0.003 from token 40 on): 8 of 64 flip under MXFP4_MOE (RMS 0.8%)
CASE_SEED = {"phi3": 1, "gpt_oss": 1}
FORMATS = ("f16", "q8_0", "Q4_K_M")
# qwen3_moe's rows are too short for K-quants (MXFP4_MOE: its experts in MXFP4); qwen2's
# 151,936-token vocabulary makes each of its runs slow, and its quantized files would test
# what llama's do (its biases stay F32 in every format)
CASE_FORMATS = {"qwen3_moe": ("f16", "q8_0", "MXFP4_MOE"), "qwen2": ("f16",),
                "gpt_oss": ("f16", "MXFP4_MOE", "hf-mxfp4"), "mistral": ("f16",),
                "gemma3-cg": ("f16", "Q4_K_M")}
RUNS = [(c, f) for c in CASES for f in CASE_FORMATS.get(c, FORMATS)]
# hf-mxfp4: the released files' path, the HF checkpoint with MXFP4 experts through the
# converter (which repacks the blocks as GGML MXFP4), the rest f16
GREEDY_EXACT = {"f16", "bf16", "q8_0", "hf-mxfp4"}
RMS_TOL = {"f16": 1e-5, "bf16": 1e-5, "q8_0": 0.03, "Q4_K_M": 0.04, "MXFP4_MOE": 0.04,
           "hf-mxfp4": 1e-5}
PROMPT = np.random.default_rng(0).integers(0, 49152, 40).tolist()
NEW = 64


def gguf_file(case: str, fmt: str) -> tuple[Path, Path]:
    family, overrides = CASES[case]
    shape = {} if "text_config" in overrides else K_QUANT_SHAPE  # (nested: its own)
    hf_dir = tiny_hf(family, {**shape, **overrides}, seed=CASE_SEED.get(case, 0),
                     row_spread=1.0, tokenizer=CASE_TOKENIZER.get(case, "smollm2"))
    if fmt in ("f16", "bf16", "q8_0"):
        return hf_dir, to_gguf(hf_dir, fmt)
    if fmt == "hf-mxfp4":
        return hf_dir, to_gguf(to_hf_mxfp4(hf_dir), "f16")
    return hf_dir, quantize(to_gguf(hf_dir, "f16"), fmt)


def reference(hf_dir: Path, path: Path, seq: tuple[int, ...]) -> np.ndarray:
    """transformers on the file's dequantized weights: the logits of every position of seq,
    one forward (teacher-forced: its top-1 after each prefix is its greedy choice there)."""
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        dequantized_hf(hf_dir, path), dtype=torch.float32).eval()
    with torch.no_grad():
        return hf(torch.tensor([list(seq)])).logits[0].numpy()


def compare(model: Any, hf_dir: Path, path: Path, fmt: str) -> None:
    """slotserve's NEW greedy tokens after PROMPT against the reference's logits over PROMPT
    + those tokens: for the GREEDY_EXACT formats the reference's own top-1 after each of the
    first 32 prefixes is slotserve's token (so its greedy run would give the same 32); for
    every format logits within RMS_TOL and top-1 agreement >= 0.95 at the NEW positions."""
    tokens = greedy_tokens(model, PROMPT, NEW)
    seq = PROMPT + tokens
    ref = reference(hf_dir, path, tuple(seq))
    first = len(PROMPT) - 1  # the position that predicts the first new token
    if fmt in GREEDY_EXACT:
        assert ref[first:first + 32].argmax(-1).tolist() == tokens[:32]
    got = all_logits(model, seq)
    rms = float(np.sqrt(np.mean((got - ref) ** 2) / np.mean(ref**2)))
    assert rms <= RMS_TOL[fmt], rms
    agree = float(np.mean(got[first:-1].argmax(-1) == ref[first:-1].argmax(-1)))
    assert agree >= 0.95, agree


def all_logits(model: Any, seq: list[int]) -> np.ndarray:
    out = model(mx.array(seq), Batch.build([(model.new_kv(), 0, len(seq))]),
                list(range(len(seq))))
    return np.array(out.astype(mx.float32))


@pytest.mark.parametrize(("case", "fmt"), RUNS)
def test_converted_gguf_matches_transformers(case: str, fmt: str) -> None:
    hf_dir, path = gguf_file(case, fmt)
    with capture_logs() as logs:
        model = load(path, device="cpu", with_tokenizer=False, probe_rows=None).model
    compare(model, hf_dir, path, fmt)
    read = next(e for e in logs if e["event"] == "gguf tensors read")
    if fmt == "Q4_K_M":  # Q4_K stays 4-bit; Q6_K is converted, and the log says so
        assert read["lossless"].get("Q4_K -> MLX 4-bit g32", 0) > 0, read
        assert read["requantized"].get("Q6_K -> MLX 8-bit g32", 0) > 0, read
    if fmt == "q8_0":
        assert read["lossless"].get("Q8_0 -> MLX 8-bit g32", 0) > 0, read
    if fmt in ("MXFP4_MOE", "hf-mxfp4"):  # the experts stay MXFP4, as MLX's mxfp4
        assert read["lossless"].get("MXFP4 -> MLX mxfp4", 0) == 3 * 2, read


def test_bf16_gguf_matches_transformers() -> None:
    hf_dir, path = gguf_file("llama", "bf16")
    compare(load(path, device="cpu", with_tokenizer=False, probe_rows=None).model, hf_dir,
            path, "bf16")


def test_llama3_gguf_carries_rope_freqs() -> None:
    """The converter writes Llama 3's scaling as a tensor, not as keys: it is read as the
    per-frequency divisors and is no weight of the model."""
    from slotserve.model.loader import read_checkpoint

    cfg, weights, _ = read_checkpoint(gguf_file("llama3-rope", "f16")[1])
    assert cfg.rope_scaling is not None and cfg.rope_scaling["rope_type"] == "freq_factors"
    factors = cfg.rope_scaling["factors"]
    assert len(factors) == 32 and min(factors) == 1.0 and max(factors) == 8.0
    assert not any("rope" in k for k in weights)


def test_phi3_gguf_carries_longrope() -> None:
    """Phi-3's LongRoPE as the converter writes it (factor tensors, the rotated share of the
    head, the original context, the attention factor) reads back as the HF config had it;
    the long factors, unused by the positions above, are checked here."""
    import math

    from slotserve.model.loader import read_checkpoint

    hf_dir, path = gguf_file("phi3", "f16")
    cfg, weights, _ = read_checkpoint(path)
    rope = cfg.rope()
    want = CASES["phi3"][1]["rope_scaling"]
    assert (cfg.rotary_dim, cfg.original_max_position_embeddings) == (48, 128)
    assert [cfg.window(i) for i in range(cfg.num_layers)] == [48, 48]
    assert np.allclose(rope["short_factor"], want["short_factor"])
    assert np.allclose(rope["long_factor"], want["long_factor"])
    assert math.isclose(rope["attention_factor"], math.sqrt(1 + math.log(16) / math.log(128)),
                        rel_tol=1e-6)
    assert not any("rope" in k for k in weights)


def test_gpt_oss_gguf_tokenizer_splits_as_o200k() -> None:
    """gpt-oss's GGUF files name their pre-tokenizer "gpt-4o" (o200k): read with its split, not
    GPT-2's fallback (capitals lead a word, contractions of either case, digits in threes)."""
    from slotserve.model.loader import default_model_path
    from slotserve.model.tokenizer import Tokenizer

    _, meta = mx.load(str(default_model_path()), return_metadata=True)
    with capture_logs() as logs:
        tok = Tokenizer.from_gguf_metadata({**meta, "tokenizer.ggml.pre": "gpt-4o"}, "m.gguf")
    assert not [e for e in logs if e["event"].startswith("unknown tokenizer.ggml.pre")]
    pieces = [p for p, _ in tok._tk.pre_tokenizer.pre_tokenize_str("Hello World'S 12345 ok\n\n")]
    assert pieces == ["Hello", "ĠWorld'S", "Ġ", "123", "45", "Ġok", "ĊĊ"]


# --- refusals -------------------------------------------------------------------------------


def _write_gguf(path: Path, arch: str, tensors: dict[str, tuple[np.ndarray, Any]],
                **keys: Any) -> Path:
    """A small GGUF written by the gguf package's own writer."""
    import gguf

    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(1)
    w.add_embedding_length(32)
    w.add_head_count(1)
    w.add_feed_forward_length(32)
    for k, v in keys.items():
        w.add_string(k, v) if isinstance(v, str) else w.add_float32(k, v)
    for name, (data, raw_dtype) in tensors.items():
        w.add_tensor(name, data, raw_dtype=raw_dtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_unsupported_gguf_architecture_is_refused(tmp_path: Path) -> None:
    path = _write_gguf(tmp_path / "m.gguf", "mamba",
                       {"token_embd.weight": (np.zeros((4, 32), np.float32), None)})
    with pytest.raises(UnsupportedModelError,
                       match=r"unsupported GGUF architecture 'mamba'; supported: \[.*'llama'"):
        load(path, device="cpu", with_tokenizer=False, probe_rows=None)


def test_unsupported_tensor_type_is_refused(tmp_path: Path) -> None:
    """A tensor type the gguf package cannot dequantize is named, with what loads."""
    import gguf

    q8_1 = gguf.GGMLQuantizationType.Q8_1  # llama.cpp's activation type: no dequantizer
    _, type_size = gguf.GGML_QUANT_SIZES[q8_1]
    path = _write_gguf(tmp_path / "m.gguf", "llama", {
        "token_embd.weight": (np.zeros((4, type_size), np.uint8), q8_1)})
    with pytest.raises(UnsupportedModelError,
                       match=r"'token_embd.weight' has type Q8_1.*supported: .*Q4_K.*IQ4_XS"):
        load(path, device="cpu", with_tokenizer=False, probe_rows=None)


def test_unsupported_rope_scaling_is_refused() -> None:
    keys = {"rope.scaling.type": "dynamic", "rope.scaling.factor": 4.0}
    with pytest.raises(UnsupportedModelError,
                       match=r"m.gguf: unsupported GGUF rope scaling 'dynamic'; supported: "
                             r"none, linear, yarn, llama3"):
        gguf_rope_scaling(lambda k, d=None: keys.get(k, d), None, "m.gguf")
    assert gguf_rope_scaling(lambda k, d=None: {"rope.scaling.type": "linear",
                                                "rope.scaling.factor": 2.0}.get(k, d),
                             None, "m.gguf") == {"rope_type": "linear", "factor": 2.0}
    yarn = {"rope.scaling.type": "yarn", "rope.scaling.factor": 4.0,
            "rope.scaling.original_context_length": 32768,
            "rope.scaling.yarn_attn_factor": 0.9}
    assert gguf_rope_scaling(lambda k, d=None: yarn.get(k, d), None, "m.gguf") == {
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768,
        "beta_fast": 32.0, "beta_slow": 1.0, "attention_factor": 0.9}
    yarn["rope.scaling.yarn_log_multiplier"] = 0.1  # DeepSeek's mscale_all_dim
    with pytest.raises(UnsupportedModelError, match="yarn_log_multiplier 0.1"):
        gguf_rope_scaling(lambda k, d=None: yarn.get(k, d), None, "m.gguf")


# --- every type, tensor by tensor, against the gguf package's own dequantization -----------

# llama-quantize's types whose tensors slotserve reads each way: Q4_0/Q4_1/Q5_0/Q5_1/Q8_0,
# Q4_K/Q5_K (codes as stored) and Q2_K/Q3_K/Q6_K/IQ4_NL/IQ4_XS (requantized to 8-bit)
QUANT_TYPES = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K_M", "Q5_K_M", "Q6_K", "IQ4_XS",
               "IQ4_NL")


@pytest.mark.parametrize("qtype", QUANT_TYPES)
def test_every_tensor_reads_as_gguf_dequantizes_it(qtype: str) -> None:
    """Each tensor as slotserve holds it, dequantized, against gguf-py's dequantization of the
    same bytes: equal up to the float16 rounding of the K-quants' per-block scales
    (lossless types) or within one step of the 8-bit requantization (the others)."""
    from gguf import quants as gguf_quants

    from slotserve.model import gguf

    path = quantize(to_gguf(tiny_hf("llama", K_QUANT_SHAPE, row_spread=1.0), "f16"), qtype)
    header = gguf.read_header(path)
    with capture_logs() as logs:
        tensors = gguf.read_tensors(path, header)
    data = np.memmap(path, np.uint8, mode="r")
    seen = set()
    for info in header.tensors:
        if info.kind.name in ("F32", "F16") or (info.name == "token_embd.weight"
                                                 and qtype != "Q6_K"):
            continue  # the embedding is Q6_K in every file: checked once, in Q6_K's
        seen.add(info.kind.name)
        block, size = gguf.GGML_QUANT_SIZES[info.kind]
        raw = data[info.offset: info.offset + info.shape[0] * info.shape[1] // block * size]
        want = gguf_quants.dequantize(np.asarray(raw).reshape(info.shape[0], -1), info.kind)
        base = info.name.removesuffix(".weight")
        w, s, b = (tensors[f"{base}.{p}"] for p in ("weight", "scales", "biases"))
        bits = w.shape[-1] * 32 // (s.shape[-1] * gguf.GROUP)
        got = np.array(mx.dequantize(w, s.astype(mx.float32), b.astype(mx.float32),
                                     group_size=gguf.GROUP, bits=bits))
        step = np.abs(want).reshape(want.shape[0], -1, gguf.GROUP).max(-1).repeat(gguf.GROUP, 1)
        lossless = info.kind in gguf._EXACT
        # the float16 rounding of the K-quants' scales d * sc and biases -dmin * m (exact for
        # the other lossless types); about one 8-bit step for the requantized ones
        bound = step * (2.0**-9 if lossless else 0.02)
        assert np.all(np.abs(got - want) <= bound + 1e-12), (info.name, info.kind.name)
    read = next(e for e in logs if e["event"] == "gguf tensors read")
    assert seen and all(any(k.startswith(t) for k in (*read["lossless"], *read["requantized"]))
                        for t in seen), (seen, read)


def test_mxfp4_experts_read_as_gguf_dequantizes_them() -> None:
    """MXFP4 expert stacks stay MXFP4 (MLX's mxfp4: the same codes and scales), exactly equal
    to gguf-py's dequantization of the same bytes."""
    from gguf import quants as gguf_quants

    from slotserve.model import gguf

    path = gguf_file("gpt_oss", "MXFP4_MOE")[1]
    header = gguf.read_header(path)
    tensors = gguf.read_tensors(path, header)
    data = np.memmap(path, np.uint8, mode="r")
    experts = [t for t in header.tensors if t.kind.name == "MXFP4"]
    assert len(experts) == 6 and all(len(t.shape) == 3 for t in experts)
    for info in experts:
        block, size = gguf.GGML_QUANT_SIZES[info.kind]
        rows = int(np.prod(info.shape[:-1]))
        raw = data[info.offset: info.offset + rows * info.shape[-1] // block * size]
        want = gguf_quants.dequantize(np.asarray(raw).reshape(rows, -1), info.kind)
        base = info.name.removesuffix(".weight")
        w, s = tensors[f"{base}.weight"], tensors[f"{base}.scales"]
        assert s.dtype == mx.uint8 and f"{base}.biases" not in tensors
        got = mx.dequantize(w, s, None, group_size=32, bits=4, mode="mxfp4")
        assert np.array_equal(np.array(got.astype(mx.float32)).reshape(rows, -1), want)


def test_gemma3_gguf_fields_follow_llama_cpp() -> None:
    """What llama.cpp derives for Gemma 3 without keys the converter writes: the 27B's query
    scale (hidden / heads = 168, not its head_dim 128), the 5:1 sliding pattern; what it
    reads when written: attention.scale, a per-layer pattern, the softcap, the local base."""
    from slotserve.model.families.gemma3 import FULL, SLIDING, Config

    common = dict(num_layers=62, hidden_size=5376, num_heads=32, head_dim=128)
    keys: dict[str, Any] = {"attention.sliding_window": 1024}
    got = Config.gguf_fields(lambda k, d=None: keys.get(k, d), common)
    assert got["query_pre_attn_scalar"] == 168.0 and got["sliding_window"] == 1024
    assert got["layer_types"][:6] == [SLIDING] * 5 + [FULL] and got["rope_local_theta"] == 1e4
    assert Config.gguf_fields(lambda k, d=None: keys.get(k, d),
                              {**common, "num_layers": 34})["query_pre_attn_scalar"] == 128.0
    keys.update({"attention.scale": 0.125, "final_logit_softcapping": 30.0,
                 "rope.freq_base_swa": 5e3,
                 "attention.sliding_window_pattern": mx.array([True, False] * 31)})
    got = Config.gguf_fields(lambda k, d=None: keys.get(k, d), common)
    assert got["query_pre_attn_scalar"] == 64.0 and got["final_logit_softcapping"] == 30.0
    assert got["layer_types"][:2] == [SLIDING, FULL] and got["rope_local_theta"] == 5e3


def test_gpt_oss_gguf_fields_follow_llama_cpp() -> None:
    """gpt-oss's layer pattern as llama.cpp reads it (openai-moe.cpp): even layers slide by
    default, else `attention.sliding_window_pattern` (a per-layer list, or n: every n-th
    layer full); YaRN untruncated; a sliding layers' own RoPE base is refused."""
    from slotserve.model.families.gpt_oss import FULL, Config
    from slotserve.model.families.llama import SLIDING

    def fields(**extra: Any) -> dict[str, Any]:
        keys = {"expert_count": 4, "expert_used_count": 2, "attention.sliding_window": 128,
                **{k.replace("__", "."): v for k, v in extra.items()}}
        common = dict(num_layers=4, rope_theta=150000.0,
                      rope_scaling={"rope_type": "yarn", "factor": 32.0})
        got = Config.gguf_fields(lambda k, d=None: keys.get(k, d), common)
        assert common["rope_scaling"]["truncate"] is False
        return got

    assert fields()["layer_types"] == [SLIDING, FULL] * 2
    assert fields(attention__sliding_window_pattern=3)["layer_types"] == [SLIDING, SLIDING,
                                                                           FULL, SLIDING]
    per_layer = mx.array([False, True, True, False])
    assert fields(attention__sliding_window_pattern=per_layer)["layer_types"] == [
        FULL, SLIDING, SLIDING, FULL]
    with pytest.raises(UnsupportedModelError, match="rope.freq_base_swa 10000.0 differs"):
        fields(rope__freq_base_swa=10000.0)
