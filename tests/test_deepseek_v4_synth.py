"""`slotserve synth` for DeepSeek-V4: the tiny preset loads as deepseek_v4 (every layer kind,
the hash table valid) and decodes, and its export is what transformers reads; the 10-layer
Flash preset has the real model's per-layer shape (~6.6B parameters a layer, ~67B in all)
and RoPE."""

from __future__ import annotations

from pathlib import Path

import pytest

from slotserve.model.families import deepseek_v4
from slotserve.model.loader import load
from slotserve.runtime.plain import greedy_tokens
from slotserve.tools.synth import preset_config, synth, tensor_shapes


def test_tiny_preset_loads_and_decodes(tmp_path: Path) -> None:
    """MLX 4-bit (the bf16 format: test_export_is_read_by_transformers)."""
    synth("tiny-deepseek-v4", tmp_path, fmt="mlx4")
    loaded = load(tmp_path, device="cpu", with_tokenizer=False)
    cfg = loaded.config
    assert isinstance(cfg, deepseek_v4.Config)
    assert set(cfg.layer_types) == {deepseek_v4.SLIDING, deepseek_v4.CSA, deepseek_v4.HCA}
    table = loaded.model.layers[0].mlp.table
    assert table is not None and int(table.min()) >= 0 and int(table.max()) < cfg.num_experts
    tokens = greedy_tokens(loaded.model, list(range(100, 180)), 4)
    assert len(tokens) == 4 and all(0 <= t < cfg.vocab_size for t in tokens)


def test_large_stacks_are_written_in_slices(tmp_path: Path,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """Expert stacks past CHUNK_VALUES are drawn and quantized a slice of experts at a time
    (the whole Flash stack in one launch failed on CUDA) and stored as one tensor each."""
    import mlx.core as mx

    from slotserve.tools import synth as synth_mod

    whole, sliced = tmp_path / "whole", tmp_path / "sliced"
    synth("tiny-deepseek-v4", whole, fmt="mlx4")
    monkeypatch.setattr(synth_mod, "CHUNK_VALUES", 3 * 256 * 256)  # 3 experts a slice
    synth("tiny-deepseek-v4", sliced, fmt="mlx4")

    def tensors(d: Path) -> dict[str, mx.array]:
        out: dict[str, mx.array] = {}
        for f in sorted(d.glob("model*.safetensors")):
            out.update(mx.load(str(f)))
        return out

    a, b = tensors(whole), tensors(sliced)
    assert {k: (v.shape, v.dtype) for k, v in a.items()} == \
        {k: (v.shape, v.dtype) for k, v in b.items()}
    stack = "model.layers.0.mlp.experts.gate_up_proj"
    assert not mx.array_equal(a[f"{stack}.weight"], b[f"{stack}.weight"])  # drawn anew
    assert mx.array_equal(a["model.embed_tokens.weight"], b["model.embed_tokens.weight"])
    loaded = load(sliced, device="cpu", with_tokenizer=False)
    tokens = greedy_tokens(loaded.model, list(range(100, 180)), 4)
    assert len(tokens) == 4 and all(0 <= t < loaded.config.vocab_size for t in tokens)


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


def test_flash_preset_rope_matches_transformers() -> None:
    """The released models' RoPE: plain on sliding layers, YaRN (factor 16, no attention
    factor) on the compressed ones; the inverse frequencies as transformers computes them."""
    import json

    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4RotaryEmbedding

    from slotserve.model.config import config_from_hf
    from slotserve.model.families import family

    raw = {k: v for k, v in preset_config("deepseek-v4-flash-10l").items()
           if k not in ("architectures", "torch_dtype", "model_type")}
    hf_cfg = transformers.DeepseekV4Config(**raw)
    ours = config_from_hf({**json.loads(hf_cfg.to_json_string()),
                           "architectures": ["DeepseekV4ForCausalLM"]},
                          family("deepseek_v4"), "preset")
    assert isinstance(ours, deepseek_v4.Config) and ours.rope_dim == 64
    assert ours.compress_rope_scaling is not None
    rotary = DeepseekV4RotaryEmbedding(hf_cfg)
    for kind, theta, scaling in (("main", ours.rope_theta, None),
                                 ("compress", ours.compress_rope_theta,
                                  ours.compress_rope_scaling)):
        rope = deepseek_v4.InterleavedRope(ours.rope_dim, theta, scaling)
        want = getattr(rotary, f"{kind}_inv_freq").to(torch.float32).numpy()
        assert abs(rope.factor - getattr(rotary, f"{kind}_attention_scaling")) < 1e-9
        got = [float(x) for x in rope.inv_freq.tolist()]
        assert max(abs(g - w) / w for g, w in zip(got, want.tolist(), strict=True)) < 1e-6


def test_export_is_read_by_transformers(tmp_path: Path) -> None:
    """`slotserve export` writes the reference names (as save_pretrained does, per-expert
    weights, the hash table as integers) and a config transformers builds the same model
    from: its logits are ours."""
    import mlx.core as mx
    import numpy as np

    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from slotserve.model.layers import Batch
    from slotserve.tools.export import export

    synth("tiny-deepseek-v4", tmp_path / "src", fmt="bf16")
    export(tmp_path / "src", tmp_path / "out")
    hf = transformers.DeepseekV4ForCausalLM.from_pretrained(
        tmp_path / "out", dtype=torch.float32).eval()
    prompt = list(range(100, 260))
    with torch.no_grad():
        want = hf(torch.tensor([prompt])).logits[0, -1].numpy()
    for path in (tmp_path / "src", tmp_path / "out"):
        model = load(path, device="cpu", with_tokenizer=False).model
        got = np.array(model(mx.array(prompt), Batch.build([(model.new_kv(), 0, len(prompt))]),
                             [len(prompt) - 1])[0])
        assert np.abs(got - want).max() <= 1e-3 * max(1.0, float(np.abs(want).max()))
