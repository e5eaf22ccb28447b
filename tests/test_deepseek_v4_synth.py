"""`slotserve synth` for DeepSeek-V4: the tiny preset, in both formats, loads as deepseek_v4
(every layer kind, the hash table valid) and decodes; the 10-layer Flash preset has the
real model's per-layer shape (~6.6B parameters a layer, ~67B in all)."""

from __future__ import annotations

from pathlib import Path

import pytest

from slotserve.model.families import deepseek_v4
from slotserve.model.loader import load
from slotserve.runtime.plain import greedy_tokens
from slotserve.tools.synth import preset_config, synth, tensor_shapes


@pytest.mark.parametrize("fmt", ["bf16", "mlx4"])
def test_tiny_preset_loads_and_decodes(tmp_path: Path, fmt: str) -> None:
    synth("tiny-deepseek-v4", tmp_path, fmt=fmt)
    loaded = load(tmp_path, device="cpu", with_tokenizer=False)
    cfg = loaded.config
    assert isinstance(cfg, deepseek_v4.Config)
    assert set(cfg.layer_types) == {deepseek_v4.SLIDING, deepseek_v4.CSA, deepseek_v4.HCA}
    table = loaded.model.layers[0].mlp.table
    assert table is not None and int(table.min()) >= 0 and int(table.max()) < cfg.num_experts
    tokens = greedy_tokens(loaded.model, list(range(100, 180)), 4)
    assert len(tokens) == 4 and all(0 <= t < cfg.vocab_size for t in tokens)


def test_flash_preset_has_the_real_shape() -> None:
    cfg = preset_config("deepseek-v4-flash-10l")
    params = 0
    for _, shape in tensor_shapes(cfg, "mlx4"):
        n = 1
        for s in shape:
            n *= s
        params += n
    assert 66e9 < params < 68e9, params
    assert cfg["layer_types"].count("compressed_sparse_attention") == 4
