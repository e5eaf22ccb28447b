"""`slotserve synth` for Gemma 4: the real sizes' shapes (31B dense, 26B-A4B MoE) and the
tiny presets the GPU tests serve, written in both formats and loaded as the gemma4 family."""

from __future__ import annotations

import math
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from slotserve.model.config import config_from_hf
from slotserve.model.families import family
from slotserve.model.layers import Batch
from slotserve.model.loader import load
from slotserve.tools.synth import preset_config, synth, tensor_shapes


@pytest.mark.parametrize("preset, billions, per_position", [
    # 50 sliding layers of 16 x 256 and 10 global ones of 4 x 512, K and V, bf16
    ("gemma4-31b", 30.7, 2 * 2 * (50 * 16 * 256 + 10 * 4 * 512)),
    # 25 sliding layers of 8 x 256 and 5 global ones of 2 x 512
    ("gemma4-26b-a4b", 25.2, 2 * 2 * (25 * 8 * 256 + 5 * 2 * 512)),
])
def test_real_sizes(preset: str, billions: float, per_position: int) -> None:
    """The presets have the released models' parameter counts (text decoder) and KV cost."""
    cfg = preset_config(preset)
    params = sum(math.prod(shape) for _, shape in tensor_shapes(cfg, "bf16"))
    assert abs(params / 1e9 - billions) < 0.05, params
    c = config_from_hf(cfg, family("gemma4"), preset)
    shapes = [(c.kv_heads_of(i), c.head_dim_of(i)) for i in range(c.num_layers)]
    assert 2 * 2 * sum(h * d for h, d in shapes) == per_position


@pytest.mark.parametrize("preset", ["gemma4-26b-a4b", "deepseek-v4-flash-10l"])
def test_fewer_layers_cut_the_schedules(preset: str) -> None:
    """`--layers` writes that many layers: the per-layer schedules are cut with the count
    (a full-length schedule once made a 2-layer Gemma 4 checkpoint of all 30 layers)."""
    cfg = preset_config(preset, layers=3)
    assert len(cfg["layer_types"]) == 3
    assert len(cfg.get("mlp_layer_types", [0] * 3)) == 3
    if preset.startswith("gemma4"):  # what the family reads: the last layer global
        assert cfg["layer_types"][-1] == "full_attention"
    indices = {int(name.split(".")[2]) for name, _ in tensor_shapes(cfg, "mlx4")
               if name.startswith("model.layers.")}
    assert indices == {0, 1, 2}


@pytest.mark.parametrize("preset, fmt", [("tiny-gemma4", "mlx4"), ("tiny-gemma4-moe", "bf16"),
                                         ("tiny-gemma4-moe", "mlx4")])
def test_tiny_presets_load_and_run(tmp_path: Path, preset: str, fmt: str) -> None:
    synth(preset, tmp_path, fmt)
    loaded = load(tmp_path, device="cpu", probe_rows=None)
    assert loaded.config.family == "gemma4"
    model, n = loaded.model, 24
    tokens = mx.array(np.random.default_rng(0).integers(3, 40000, n))
    logits = model(tokens, Batch.build([(model.new_kv(), 0, n)]), [n - 1])
    assert logits is not None and bool(mx.all(mx.isfinite(logits)))
    assert "<|tool_call>" in loaded.tokenizer.special_tokens
