"""`slotserve synth` for the Gated DeltaNet hybrids: the tiny Qwen3.5-MoE preset, in both
formats, loads as qwen3_5_moe and decodes; the 35B-A3B preset has the real model's shape."""

from __future__ import annotations

from pathlib import Path

import pytest

from slotserve.model.loader import load
from slotserve.runtime.plain import greedy_tokens
from slotserve.tools.synth import preset_config, synth, tensor_shapes


@pytest.mark.parametrize("fmt", ["bf16", "mlx4"])
def test_tiny_preset_loads_and_decodes(tmp_path: Path, fmt: str) -> None:
    synth("tiny-qwen3.5-moe", tmp_path, fmt=fmt)
    loaded = load(tmp_path, device="cpu", with_tokenizer=False)
    assert loaded.config.family == "qwen3_5_moe"
    assert loaded.config.layer_types == ["linear_attention"] * 3 + ["full_attention"]  # type: ignore[attr-defined]
    tokens = greedy_tokens(loaded.model, [1, 2, 3, 4, 5], 4)
    assert len(tokens) == 4 and all(0 <= t < loaded.config.vocab_size for t in tokens)


def test_35b_a3b_preset_has_the_real_shape() -> None:
    cfg = preset_config("qwen3.5-35b-a3b")
    params = 0
    for _, shape in tensor_shapes(cfg, "bf16"):
        n = 1
        for s in shape:
            n *= s
        params += n
    assert 34e9 < params < 36.5e9, params  # 35B total (3B active: 8 of 256 experts)
