"""What slotserve knows about a model family beside its forward, in one object per family.

Each family module (`slotserve.model.families.<name>`) declares a `Family`: the names its
checkpoints go by (Hugging Face architectures and model type, the GGUF architecture), its
config dataclass (which reads the family's own config keys), the conventions of its GGUF
tensors (llama.cpp's names, Q/K row order and norm offset) and the layout changes between
the tensors as stored and as the model reads them. The readers (`model.config`,
`model.weights`, `model.loader`) and the exporter (`tools.export`) ask the family object,
so adding a family touches its own module and the registry in `families/__init__.py` only.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from slotserve.model.config import ModelConfig
from slotserve.model.weights import Tensor


def _as_stored(weights: dict[str, Tensor], cfg: ModelConfig) -> None:
    """The default `Family.sanitize`: the model reads the tensors under the stored names."""


def _unchanged(tensors: dict[str, Any]) -> dict[str, Any]:
    """The default `Family.hf_tensors`: Hugging Face stores the tensors as slotserve holds them."""
    return tensors


@dataclass(frozen=True)
class Family:
    """One model family: its names, config class, checkpoint conventions and Model class."""

    name: str  # ModelConfig.family
    config: type[ModelConfig]  # the family's config dataclass (reads its own keys)
    model: Callable[..., Any]  # Model(cfg, weights, dtype, keep_quantized)
    hf_architectures: tuple[str, ...]  # config.json "architectures"; export writes the first
    hf_model_type: str  # config.json "model_type" (read when "architectures" names none)
    gguf_architecture: str  # GGUF general.architecture
    # llama.cpp layer tensor names of this family beyond (or instead of) weights.GGUF_LAYER_NAMES
    gguf_layer_names: Mapping[str, str] = field(default_factory=dict)
    # llama.cpp names of tensors outside the blocks beyond weights.GGUF_TOP_NAMES
    gguf_top_names: Mapping[str, str] = field(default_factory=dict)
    # llama.cpp stores Q/K rows interleaved per head (for its interleaved RoPE): undo it
    gguf_interleaved_qk: bool = False
    # llama.cpp stores this family's norm weights plus this offset: subtract it
    gguf_norm_offset: float = 0.0
    # after reading: bring stored tensors into the names and layout the model reads
    sanitize: Callable[[dict[str, Tensor], ModelConfig], None] = _as_stored
    # export: the tensors slotserve holds, in Hugging Face's own names and layout
    hf_tensors: Callable[[dict[str, Any]], dict[str, Any]] = _unchanged
    # control tokens every chat template of this family writes; non-empty: a checkpoint
    # whose template lacks one, or that ships none, is refused at load (see
    # chat_template.ChatTemplate.for_tokenizer) instead of prompting in another format
    template_markers: tuple[str, ...] = ()
