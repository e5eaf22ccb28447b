"""Gemma 4 converted by mlx-lm (`mlx_lm.convert -q`, MLX 4-bit) and by llama.cpp's
convert_hf_to_gguf.py (GGUF f32 / f16 / bf16 / Q8_0) against transformers.

mlx-lm writes Gemma 4 in its own layout: each layer's experts as `experts.switch_glu`
stacks (gate, up and down apart), the routers at 8 bits, no K/V projections on the layers
that read shared K/V. slotserve reads that file; the reference is transformers'
Gemma4ForCausalLM holding the file's numbers (quantized tensors dequantized, the experts
fused back), compared as mlx4_checks does for the other families: the top token at >= 95 %
of 64 teacher-forced positions (the logits bounded as the test says). The checkpoint's
config.json names its global heads as the released ones do (global_head_dim,
num_global_key_value_heads), which is what mlx-lm reads.
"""

from __future__ import annotations  # noqa: I001  (slotserve preloads OpenBLAS before MLX)

import json
from pathlib import Path
from typing import Any

import slotserve  # noqa: F401
import mlx.core as mx
import numpy as np
import pytest
from structlog.testing import capture_logs

from slotserve.kernels import cpu_qgemm
from slotserve.kernels.quantized import QuantizedWeight
from slotserve.model.layers import Batch
from slotserve.model.loader import load, read_checkpoint
from slotserve.model.tokenizer import Tokenizer
from slotserve.runtime.plain import greedy_tokens
from slotserve.tools.synth import write_smollm2_tokenizer

from converted import _cached, _digest, gguf_py_tensors, to_gguf, to_mlx4
from mlx4_checks import LOGIT_TOLERANCE, MIN_AGREEMENT, STEPS

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("mlx_lm")

S, F = "sliding_attention", "full_attention"
GLOBAL = {"global_head_dim": 32, "num_global_key_value_heads": 1}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    hf_dir = tmp_path_factory.mktemp("gemma4_hf")
    vocab = write_smollm2_tokenizer(hf_dir)
    cfg = transformers.Gemma4TextConfig(
        vocab_size=vocab, vocab_size_per_layer_input=vocab, hidden_size=64,
        intermediate_size=128, num_hidden_layers=6, layer_types=[S, S, F] * 2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, attention_k_eq_v=True,
        sliding_window=16, num_kv_shared_layers=2, hidden_size_per_layer_input=8,
        enable_moe_block=True, num_experts=8, top_k_experts=2, moe_intermediate_size=64,
        max_position_embeddings=512, final_logit_softcapping=30.0, **GLOBAL)
    torch.manual_seed(3)
    hf = transformers.Gemma4ForCausalLM(cfg).float().eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "norm" in name or name.endswith("scale"):
                p.copy_(1.0 + 0.3 * torch.randn_like(p))
            else:
                p.normal_(0.0, 0.08)
        # rows of trained-like norms: the top logit stands out of 49,152
        table = hf.get_input_embeddings().weight
        table.mul_(torch.exp(torch.randn(table.shape[0], 1)))
    hf.save_pretrained(hf_dir, safe_serialization=True)
    written = json.loads((hf_dir / "config.json").read_text())
    (hf_dir / "config.json").write_text(json.dumps({**written, **GLOBAL}))
    return hf_dir, to_mlx4(hf_dir)


def _reference(hf_dir: Path, mlx_dir: Path) -> Any:
    """transformers' model of hf_dir holding the MLX file's numbers (experts fused back)."""
    hf = transformers.Gemma4ForCausalLM.from_pretrained(hf_dir).float().eval()
    quant = json.loads((mlx_dir / "config.json").read_text())["quantization"]
    raw: dict[str, mx.array] = {}
    for f in sorted(mlx_dir.glob("model*.safetensors")):
        raw.update(mx.load(str(f)))
    values: dict[str, mx.array] = {}
    for key, value in raw.items():
        if key.endswith((".scales", ".biases")):
            continue
        base = key.removesuffix(".weight")
        if base + ".scales" in raw:
            spec = quant.get(base, quant)  # mlx-lm keeps the routers at 8 bits
            value = mx.dequantize(value, raw[base + ".scales"], raw[base + ".biases"],
                                  group_size=spec["group_size"], bits=spec["bits"])
        values[key] = value.astype(mx.float32)
    for key in [k for k in values if k.endswith(".experts.switch_glu.gate_proj.weight")]:
        p = key.removesuffix(".switch_glu.gate_proj.weight")
        gate, up = values.pop(key), values.pop(f"{p}.switch_glu.up_proj.weight")
        values[f"{p}.gate_up_proj"] = mx.concatenate([gate, up], axis=1)
        values[f"{p}.down_proj"] = values.pop(f"{p}.switch_glu.down_proj.weight")
    state = {k: torch.from_numpy(np.array(v)) for k, v in values.items()}
    own = hf.state_dict()
    assert all(k in own for k in state), [k for k in state if k not in own][:5]
    missing = [k for k in own if k not in state and not k.endswith("lm_head.weight")]
    assert not missing, f"the MLX file lacks {missing[:5]}"
    hf.load_state_dict(state, strict=False)
    hf.generation_config.eos_token_id = None
    hf.generation_config.pad_token_id = 0
    return hf


def test_mlx4_matches_transformers_on_its_numbers(checkpoints: tuple[Path, Path],
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """Read exactly (4-bit codes dequantized to float: the reference's logits to 1e-3), and
    as served (codes kept 4-bit, int8 activations): the reference's top token at >= 95 % of
    64 positions. The int8 path's worst logit differs more than mlx4_checks' 0.1 here (a
    tanh-capped, per-layer-input MoE whose 8-bit router may pick another second expert),
    so its mean difference is bounded instead."""
    hf_dir, mlx_dir = checkpoints
    ref = _reference(hf_dir, mlx_dir)
    prompt = np.random.default_rng(5).integers(3, 49152, 24).tolist()
    n = len(prompt)
    with torch.no_grad():
        out = ref.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=STEPS,
                           min_new_tokens=STEPS, attention_mask=torch.ones(1, n, dtype=torch.long))
        seq = out[0].tolist()
        want = ref(torch.tensor([seq])).logits[0, n - 1 : -1].numpy()

    def logits(model: Any) -> np.ndarray:
        return np.array(model(mx.array(seq), Batch.build([(model.new_kv(), 0, len(seq))]),
                              list(range(n - 1, len(seq) - 1))))

    loaded = load(mlx_dir, device="cpu", with_tokenizer=False)
    assert loaded.config.family == "gemma4"
    served = loaded.model
    assert sum(isinstance(lin.kernel, cpu_qgemm.QMatrix) for lin in served.linears()) > 0
    got = logits(served)
    agreement = float((got.argmax(-1) == np.array(seq[n:])).mean())
    assert agreement >= MIN_AGREEMENT, agreement
    assert np.abs(got - want).mean() <= LOGIT_TOLERANCE / 4, np.abs(got - want).mean()
    monkeypatch.setattr(cpu_qgemm, "supported", lambda weight: False)
    exact = load(mlx_dir, device="cpu", with_tokenizer=False, probe_rows=None).model
    assert np.abs(logits(exact) - want).max() <= 1e-3


def _gemma_style_tokenizer(out: Path) -> int:
    """A small BPE tokenizer shaped as Gemma 4's (SentencePiece-style spaces, byte fallback,
    which llama.cpp's Gemma 4 converter requires), with Gemma 4's control tokens listed as
    special as the released tokenizer_config does, and Google's chat template; returns its
    vocab size."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, trainers

    from slotserve.tools.synth import GEMMA4_TOKENS

    tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tok.normalizer = normalizers.Replace(" ", "\u2581")
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(),
                                     decoders.Fuse()])
    specials = ["<pad>", "<eos>", "<bos>", "<unk>", *(f"<0x{i:02X}>" for i in range(256))]
    text = ["The quick brown fox jumps over the lazy dog.", "What is the weather in Paris?"]
    tok.train_from_iterator(text * 20, trainers.BpeTrainer(vocab_size=400, show_progress=False,
                                                           special_tokens=specials))
    control = [t for t in GEMMA4_TOKENS if t not in specials]
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in control])
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<bos>",
        "eos_token": "<eos>", "pad_token": "<pad>", "unk_token": "<unk>",
        "extra_special_tokens": control, "chat_template": _google_template()}))
    return tok.get_vocab_size(True)


def _google_template() -> str:
    from converted import llama_cpp_tree

    return (llama_cpp_tree() / "models" / "templates" / "google-gemma-4-31B-it.jinja").read_text()


# a Gemma 4 with every part the GGUF must carry: experts beside the MLP, per-layer inputs,
# K/V shared by the last two layers (whose MLPs are double-wide), attention_k_eq_v, a cap
GGUF_CONFIG: dict[str, Any] = dict(
    hidden_size=64, intermediate_size=128, num_hidden_layers=6, layer_types=[S, S, F] * 2,
    num_attention_heads=4, num_key_value_heads=2, head_dim=16, attention_k_eq_v=True,
    sliding_window=16, num_kv_shared_layers=2, use_double_wide_mlp=True,
    hidden_size_per_layer_input=8, enable_moe_block=True, num_experts=8, top_k_experts=2,
    moe_intermediate_size=64, max_position_embeddings=1024, final_logit_softcapping=30.0,
    pad_token_id=0, eos_token_id=1, bos_token_id=2, **GLOBAL)
# logits' RMS difference over the reference's, per format. None for Q8_0: this random MoE's
# routers sit on near-ties, so at the random prompt's positions even float16 rounding of its
# weights (1e-4) moves a row's logits by up to half their size (another second expert); that
# measures the router, not the reader, so Q8_0 is held to its tensors read bit-exact, the 32
# greedy tokens and the top-1 agreement instead
GGUF_RMS_TOL: dict[str, float | None] = {"f32": 1e-5, "f16": 1e-5, "bf16": 1e-5, "q8_0": None}


@pytest.fixture(scope="module")
def gguf_source() -> Path:
    """The tiny Gemma 4 above with a Gemma-style tokenizer, built once into the converted
    cache (so the GGUF files made from it are cached too)."""
    def make(out: Path) -> None:
        vocab = _gemma_style_tokenizer(out)
        cfg = transformers.Gemma4TextConfig(vocab_size=vocab, vocab_size_per_layer_input=vocab,
                                            **GGUF_CONFIG)
        torch.manual_seed(7)
        hf = transformers.Gemma4ForCausalLM(cfg).float().eval()
        with torch.no_grad():
            for name, p in hf.named_parameters():
                if "norm" in name or name.endswith("scale"):
                    p.copy_(1.0 + 0.3 * torch.randn_like(p))
                else:
                    p.normal_(0.0, 0.08)
            table = hf.get_input_embeddings().weight
            table.mul_(torch.exp(torch.randn(table.shape[0], 1)))
        hf.save_pretrained(out, safe_serialization=True)
        written = json.loads((out / "config.json").read_text())
        (out / "config.json").write_text(json.dumps({**written, **GLOBAL}))

    key = _digest(GGUF_CONFIG, 7, transformers.__version__, "gemma4-gguf-2")
    return _cached("hf-gemma4-gguf", key, make)


def _gguf_reference(hf_dir: Path, gguf_file: Path) -> Any:
    """transformers' Gemma4ForCausalLM holding the GGUF file's numbers, as the gguf package
    dequantizes them, each found under the converter's own name for it (gguf-py's
    TensorNameMap; the router's scales beside the router and the experts' down projection,
    as conversion/gemma.py writes them): read independently of slotserve's reader."""
    import gguf

    hf = transformers.Gemma4ForCausalLM.from_pretrained(hf_dir).float().eval()
    stored = gguf_py_tensors(gguf_file)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.GEMMA4, hf.config.num_hidden_layers)
    state = {}
    for name, param in hf.state_dict().items():
        if name == "lm_head.weight":
            continue  # tied
        base = name.removesuffix(".weight")
        if base.endswith(".router.scale"):
            key = names.get_name(base.replace(".router.scale", ".router.proj")) + ".scale"
        elif base.endswith(".router.per_expert_scale"):
            key = names.get_name(base.replace(".router.per_expert_scale",
                                              ".experts.down_proj")) + ".scale"
        else:
            key = names.get_name(base) + ".weight"
        state[name] = torch.from_numpy(stored[key].reshape(param.shape))
    hf.load_state_dict(state, strict=False)
    hf.generation_config.eos_token_id = None
    hf.generation_config.pad_token_id = 0
    return hf


@pytest.mark.parametrize("outtype", ["f32", "f16", "bf16", "q8_0"])
def test_gguf_from_llama_cpp_matches_transformers(gguf_source: Path, outtype: str) -> None:
    """llama.cpp's convert_hf_to_gguf.py output read by slotserve (per-layer kv heads and
    MLP widths, the sliding layers' own head size, proportional RoPE from rope_freqs, the
    router and expert scales, k_eq_v from the missing attn_v): 32 greedy tokens equal to
    transformers on the file's numbers (f32: the original checkpoint itself), the logits'
    RMS difference within GGUF_RMS_TOL over the prompt and those tokens, top-1
    agreement >= 95 % over the 32 teacher-forced positions; Q8_0 stays 8-bit and every
    tensor is read as the gguf package dequantizes it."""
    path = to_gguf(gguf_source, outtype)
    ref = (transformers.Gemma4ForCausalLM.from_pretrained(gguf_source).float().eval()
           if outtype == "f32" else _gguf_reference(gguf_source, path))
    ref.generation_config.eos_token_id = None
    ref.generation_config.pad_token_id = 0
    prompt = np.random.default_rng(11).integers(3, ref.config.vocab_size, 24).tolist()
    n = len(prompt)
    with torch.no_grad():
        seq = ref.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=32,
                           min_new_tokens=32,
                           attention_mask=torch.ones(1, n, dtype=torch.long))[0].tolist()
        want = ref(torch.tensor([seq])).logits[0].numpy()
    with capture_logs() as logs:
        loaded = load(path, device="cpu", with_tokenizer=False, probe_rows=None)
    cfg = loaded.config
    assert (cfg.family, cfg.attention_k_eq_v, cfg.global_head_dim, cfg.head_dim,
            cfg.global_kv_heads) == ("gemma4", True, 32, 16, 1)
    model = loaded.model
    assert greedy_tokens(model, prompt, 32) == seq[n:]
    got = np.array(model(mx.array(seq), Batch.build([(model.new_kv(), 0, len(seq))]),
                         list(range(len(seq)))))
    tol = GGUF_RMS_TOL[outtype]
    if tol is not None:
        rms = float(np.sqrt(np.mean((got - want) ** 2) / np.mean(want**2)))
        assert rms <= tol, rms
    agree = float(np.mean(got[n - 1 : -1].argmax(-1) == want[n - 1 : -1].argmax(-1)))
    assert agree >= 0.95, agree
    if outtype == "q8_0":
        read = next(e for e in logs if e["event"] == "gguf tensors read")
        assert read["lossless"].get("Q8_0 -> MLX 8-bit g32", 0) > 0, read
        _assert_reads_the_files_numbers(path, ref)


def _assert_reads_the_files_numbers(path: Path, ref: Any) -> None:
    """Every tensor slotserve reads from the file, dequantized in float32, is the number the
    reference holds under its HF name (the quantized ones too: codes, scales and biases)."""
    _, weights, _ = read_checkpoint(path)
    want = ref.state_dict()
    assert set(weights) == set(want) - {"lm_head.weight"}
    for name, w in weights.items():
        if isinstance(w, QuantizedWeight):
            w = mx.dequantize(w.weight, w.scales.astype(mx.float32),
                              w.biases.astype(mx.float32), group_size=w.group_size,
                              bits=w.bits)
        got = np.array(w.astype(mx.float32)).reshape(want[name].shape)
        assert np.array_equal(got, want[name].numpy()), name


def test_gguf_tokenizer_is_the_checkpoints(gguf_source: Path) -> None:
    """The file's `gemma4` tokenizer (SentencePiece-style BPE with merges, byte fallback)
    encodes as the checkpoint's own tokenizer.json, after the BOS the file asks for; the
    tool-call markers stay single tokens."""
    hf = Tokenizer.from_hf_dir(gguf_source)
    path = to_gguf(gguf_source, "f16")
    tok = load(path, device="cpu", with_tokenizer=True, probe_rows=None).tokenizer
    assert tok.bos_id == 2
    for text in ["The quick brown fox", " What is the weather in Paris?", "h\u00e9llo  x",
                 "caf\u00e9 \u2615 dog."]:
        ids = tok.encode(text)
        assert ids[0] == tok.bos_id and ids[1:] == hf.encode(text), text
        assert tok.decode(ids[1:]) == text
    marker = tok.encode_template("<|tool_call>")
    assert marker[-1] == hf.special_tokens["<|tool_call>"]


WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}
TOOL_CHAT = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Weather in Paris? <|tool_call>call:x{}<tool_call|>"},
    {"role": "assistant", "content": "", "tool_calls": [{
        "id": "c1", "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
    {"role": "tool", "tool_call_id": "c1", "content": '{"temp": 21}'},
    {"role": "user", "content": "And Rome?"},
]


def test_gguf_serves_chat_with_tools_as_the_checkpoint(gguf_source: Path) -> None:
    """The GGUF carries Google's template, and its tokenizer reads the markers llama.cpp
    stores as USER_DEFINED (<|tool_call>, <|tool_response>, <|"|>, ...) as the control
    tokens they are: a conversation with a tool, a call and its result renders to the
    checkpoint's own ids (a user's typed marker stays text), <turn|> and <|tool_response>
    stop generation, and the engine serves a chat with tools from the file."""
    from engine_harness import EngineHarness

    from slotserve.model.chat_template import ChatTemplate
    from slotserve.model.families.gemma4 import TEMPLATE_MARKERS
    from slotserve.model.tokenizer import GEMMA4_RENDERED

    path = to_gguf(gguf_source, "q8_0")
    hf = Tokenizer.from_hf_dir(gguf_source)
    tok = load(path, device="cpu", with_tokenizer=True, probe_rows=None).tokenizer
    for marker in (*GEMMA4_RENDERED, "<|turn>", "<turn|>", "<|tool>", "<tool|>"):
        assert tok.special_tokens[marker] == hf.special_tokens[marker], marker
    assert {tok.special_tokens["<turn|>"], tok.special_tokens["<|tool_response>"]} <= tok.stop_ids
    assert tok.special_tokens["<|tool_call>"] not in tok.encode("<|tool_call>")

    def render(t: Tokenizer) -> list[int]:
        template = ChatTemplate.for_tokenizer(t, "gemma4", TEMPLATE_MARKERS)
        r = template.render_guarded(TOOL_CHAT, tools=[WEATHER_TOOL], specials=t.special_tokens)
        return t.encode_template(r.text, r.holes, add_special=True)

    ids = render(tok)
    assert ids == render(hf)
    assert ids.count(tok.special_tokens["<|tool_call>"]) == 1  # the template's, not the user's
    h = EngineHarness(path, max_slots=2, max_queue=4)
    try:
        engine = h.engine
        assert engine.render_chat(TOOL_CHAT, [WEATHER_TOOL]) == ids
        done = h.call(lambda: engine.chat_complete(TOOL_CHAT, tools=[WEATHER_TOOL],
                                                   max_tokens=8, temperature=0.0))
        assert done.error is None and done.finish_reason in ("stop", "length")
        assert done.token_ids and done.usage.prompt_tokens == len(ids)
    finally:
        h.close()
