"""Tokenizers the tests read offline: the bundled SmolLM2, a small SentencePiece vocabulary, and
llama.cpp's vocabulary-only GGUFs of real models when its source tree is in the cache (the peer
benchmark unpacks it there, bench/peer_llamacpp.py; tests that use them skip without it)."""

from __future__ import annotations

from functools import cache
from pathlib import Path
from typing import Any

import mlx.core as mx
from structlog.testing import capture_logs

from slotserve.model.loader import default_model_path
from slotserve.model.tokenizer import Tokenizer

# --- SentencePiece-style ("llama") GGUF vocab: byte fallback, a user-defined "▁▁" ---------------

PIECES = ["▁t", "he", "▁the", "in", "▁a", "er", "ll", "▁w", "or", "ld", "▁wor", "▁world",
          "▁he", "▁hell", "▁hello", "▁in", "ing", "▁th", "▁thing", "▁wh", "at", "▁what", "▁l",
          "ow", "▁low"]
CHARS = list("▁abcdefghijklmnopqrstuvwxyz")
SPECIAL = ["<unk>", "<s>", "</s>", "<start_of_turn>", "<end_of_turn>", "▁▁"]
BYTES = [f"<0x{b:02X}>" for b in range(256)]


def spm_meta(add_space_prefix: bool) -> dict[str, Any]:
    """GGUF metadata of a small SentencePiece BPE vocabulary (every other byte falls back)."""
    n = len(PIECES) + len(CHARS)
    return {
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.tokens": SPECIAL + BYTES + PIECES + CHARS,
        "tokenizer.ggml.token_type": mx.array([2, 3, 3, 3, 3, 4] + [6] * 256 + [1] * n),
        "tokenizer.ggml.scores": mx.array([0.0] * (len(SPECIAL) + 256)
                                          + [-float(i) for i in range(len(PIECES))]
                                          + [-100.0 - i for i in range(len(CHARS))]),
        "tokenizer.ggml.bos_token_id": mx.array(1),
        "tokenizer.ggml.eos_token_id": mx.array(2),
        "tokenizer.ggml.unknown_token_id": mx.array(0),
        "tokenizer.ggml.add_bos_token": mx.array(True),
        "tokenizer.ggml.add_space_prefix": mx.array(add_space_prefix),
    }


@cache
def spm(add_space_prefix: bool) -> Tokenizer:
    return Tokenizer.from_gguf_metadata(spm_meta(add_space_prefix), "synthetic.gguf")


@cache
def smollm2() -> Tokenizer:
    """The bundled SmolLM2's tokenizer (byte-level BPE, 49152 tokens)."""
    path = default_model_path()
    _, meta = mx.load(str(path), return_metadata=True)
    return Tokenizer.from_gguf_metadata(meta, str(path))


# --- llama.cpp's vocab GGUFs: the tokenizers of the families slotserve runs, and GPT-2 ----------

LLAMA_CPP_VOCABS = ("llama-spm", "llama-bpe", "qwen2", "phi-3", "gpt-2")
_LLAMA_CPP_MODELS = Path.home() / ".cache" / "slotserve"


def llama_cpp_vocabs() -> list[str]:
    """The names in LLAMA_CPP_VOCABS whose `ggml-vocab-NAME.gguf` is here (maybe none)."""
    return [n for n in LLAMA_CPP_VOCABS if _llama_cpp_path(n) is not None]


def _llama_cpp_path(name: str) -> Path | None:
    pattern = f"llama.cpp-*/src/*/llama.cpp/models/ggml-vocab-{name}.gguf"
    found = sorted(_LLAMA_CPP_MODELS.glob(pattern))
    return found[-1] if found else None


@cache
def llama_cpp(name: str) -> Tokenizer:
    path = _llama_cpp_path(name)
    assert path is not None, name
    _, meta = mx.load(str(path), return_metadata=True)
    with capture_logs():  # e.g. "unknown tokenizer.ggml.pre" for gpt-2
        return Tokenizer.from_gguf_metadata(meta, str(path))


def by_name(name: str) -> Tokenizer:
    """'smollm2', 'spm', 'spm-prefix' or one of llama_cpp_vocabs()."""
    if name == "smollm2":
        return smollm2()
    if name in ("spm", "spm-prefix"):
        return spm(name == "spm-prefix")
    return llama_cpp(name)

