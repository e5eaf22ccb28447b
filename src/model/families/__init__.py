"""The model families slotserve runs, one module each (its config, layers and Model, and
its `FAMILY` facts), registered here: the readers find a checkpoint's family by its names."""

from __future__ import annotations

from typing import Any

from slotserve.model.errors import UnsupportedModelError
from slotserve.model.families import (
    deepseek_v4,
    gemma3,
    gemma4,
    gpt_oss,
    llama,
    phi3,
    qwen2,
    qwen3,
    qwen3_5,
    qwen3_5_moe,
    qwen3_moe,
    qwen3_next,
)
from slotserve.model.family import Family

FAMILIES: dict[str, Family] = {
    f.name: f for f in (llama.FAMILY, qwen2.FAMILY, qwen3.FAMILY, qwen3_moe.FAMILY,
                       gemma3.FAMILY, gemma4.FAMILY, qwen3_5.FAMILY, phi3.FAMILY, gpt_oss.FAMILY,
                       qwen3_5_moe.FAMILY, qwen3_next.FAMILY, deepseek_v4.FAMILY)
}


def family(name: str) -> Family:
    """The family of a ModelConfig.family name."""
    return FAMILIES[name]


def for_hf(cfg: dict[str, Any], source: str) -> Family:
    """The family of a Hugging Face config.json: its first architecture slotserve knows,
    else its model_type."""
    archs = cfg.get("architectures") or []
    by_arch = {a: f for f in FAMILIES.values() for a in f.hf_architectures}
    found = next((by_arch[a] for a in archs if a in by_arch), None)
    if found is None:
        found = next((f for f in FAMILIES.values()
                      if f.hf_model_type == cfg.get("model_type", "")), None)
    if found is None:
        raise UnsupportedModelError(
            f"{source}: unsupported architecture {archs or cfg.get('model_type')!r}; "
            f"supported: {sorted(by_arch)}"
        )
    return found


def for_gguf(meta: dict[str, Any], source: str) -> Family:
    """The family of GGUF metadata (general.architecture)."""
    arch = meta.get("general.architecture")
    arch = arch.item() if hasattr(arch, "item") else arch
    by_arch = {f.gguf_architecture: f for f in FAMILIES.values()}
    if arch not in by_arch:
        raise UnsupportedModelError(
            f"{source}: unsupported GGUF architecture {arch!r}; supported: {sorted(by_arch)}"
        )
    return by_arch[arch]
