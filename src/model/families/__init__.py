"""One module per model family; FAMILIES maps a family name to its Model class."""

from __future__ import annotations

import importlib
from typing import Any

FAMILY_MODULES = {
    "llama": "slotserve.model.families.llama",
    "qwen3": "slotserve.model.families.qwen3",
    "qwen3_moe": "slotserve.model.families.qwen3_moe",
    "gemma3": "slotserve.model.families.gemma3",
}


def model_class(family: str) -> Any:
    return importlib.import_module(FAMILY_MODULES[family]).Model
