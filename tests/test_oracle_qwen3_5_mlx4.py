"""Qwen3.5 converted by mlx-lm (`mlx_lm.convert -q`, MLX 4-bit) against transformers.

mlx-lm writes the hybrid in its own layout: conv weights [D, K, 1] (MLX's conv layout) and
the zero-centered norms as 1 + w. slotserve reads that file; the reference is transformers'
Qwen3_5ForConditionalGeneration holding the file's numbers (quantized tensors dequantized,
mlx-lm's layout undone). The file's tensors, dequantized, give the reference's logits to
float rounding (so every layout change is undone exactly); kept 4-bit with int8 activations
(the CPU's quantized path) the top token agrees at >= 95 % of 64 teacher-forced positions
(mlx4_checks' bound; the embedding rows are spread as training spreads them, so the top
token stands out of 49,152). No logit bound on that path: int8 activations move the q/k
rows of the DeltaNet heads, and the per-head L2 norm turns a small head's rounding into a
large change of direction (on this tiny random model the hidden states move ~4 % a layer,
the logits up to ~25 % of their largest; the GPU's 4-bit kernel takes bf16 activations).
"""

from __future__ import annotations  # noqa: I001  (slotserve preloads OpenBLAS before MLX)

import json
from pathlib import Path
from typing import Any

import slotserve  # noqa: F401
import mlx.core as mx
import numpy as np
import pytest

from slotserve.model.families.qwen3_5 import SHIFTED_NORMS
from slotserve.model.layers import Batch
from slotserve.model.loader import build_model, load, read_checkpoint
from slotserve.model.weights import QuantizedWeight
from slotserve.tools.synth import write_smollm2_tokenizer

from converted import to_mlx4
from mlx4_checks import MIN_AGREEMENT, STEPS
from test_oracle_qwen3_5 import TEXT, randomize

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("mlx_lm")

VISION = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
              num_position_embeddings=16, patch_size=4, temporal_patch_size=1,
              spatial_merge_size=1)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    hf_dir = tmp_path_factory.mktemp("qwen3_5_hf")
    vocab = write_smollm2_tokenizer(hf_dir)
    cfg = transformers.Qwen3_5Config(text_config={**TEXT, "vocab_size": vocab},
                                     vision_config=VISION)
    hf = randomize(transformers.Qwen3_5ForConditionalGeneration(cfg), 4)
    with torch.no_grad():  # rows of trained-like norms: the top logit stands out of 49,152
        torch.manual_seed(9)
        for table in (hf.get_input_embeddings().weight, hf.lm_head.weight):
            table.mul_(torch.exp(torch.randn(table.shape[0], 1)))
    hf.save_pretrained(hf_dir, safe_serialization=True)
    return hf_dir, to_mlx4(hf_dir)


def _reference(hf_dir: Path, mlx_dir: Path) -> Any:
    """transformers' model of hf_dir holding the MLX file's numbers, mlx-lm's layout undone."""
    hf = transformers.Qwen3_5ForConditionalGeneration.from_pretrained(hf_dir).float().eval()
    quant = json.loads((mlx_dir / "config.json").read_text())["quantization"]
    raw: dict[str, mx.array] = {}
    for f in sorted(mlx_dir.glob("model*.safetensors")):
        raw.update(mx.load(str(f)))
    state = {}
    for key, value in raw.items():
        if key.endswith((".scales", ".biases")):
            continue
        base = key.removesuffix(".weight")
        if base + ".scales" in raw:
            spec = quant.get(base, quant)  # mlx-lm keeps the routers at 8 bits
            value = mx.dequantize(value, raw[base + ".scales"], raw[base + ".biases"],
                                  group_size=spec["group_size"], bits=spec["bits"])
        value = value.astype(mx.float32)
        if key.endswith("conv1d.weight"):
            value = value.swapaxes(1, 2)
        elif key.endswith(SHIFTED_NORMS):
            value = value - 1.0
        name = key.replace("language_model.model.", "model.language_model.", 1)
        name = name.replace("language_model.lm_head.", "lm_head.", 1)
        state[name] = torch.from_numpy(np.array(value))
    own = hf.state_dict()
    assert all(k in own for k in state), [k for k in state if k not in own][:5]
    missing = [k for k in own if k not in state and "visual" not in k]
    assert not missing, missing[:5]
    hf.load_state_dict(state, strict=False)
    return hf


def test_mlx4_checkpoint_matches_dequantized_reference(checkpoints: tuple[Path, Path]) -> None:
    hf_dir, mlx_dir = checkpoints
    ref = _reference(hf_dir, mlx_dir)
    prompt = [int(t) for t in np.random.RandomState(5).randint(0, 49152, 40)]
    n = len(prompt)
    with torch.no_grad():
        out = ref.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=STEPS,
                           min_new_tokens=STEPS,
                           attention_mask=torch.ones(1, n, dtype=torch.long))
        seq = out[0].tolist()
        want = ref(torch.tensor([seq])).logits[0, n - 1 : -1].numpy()
    loaded = load(mlx_dir, device="cpu", with_tokenizer=False)
    assert loaded.config.family == "qwen3_5"
    model = loaded.model
    got = np.array(model(mx.array(seq), Batch.build([(model.new_kv(), 0, len(seq))]),
                         list(range(n - 1, len(seq) - 1))))
    agreement = float((got.argmax(-1) == np.array(seq[n:])).mean())
    assert agreement >= MIN_AGREEMENT, agreement
    # the same tensors dequantized: the reference's numbers to float rounding
    cfg, weights, _ = read_checkpoint(mlx_dir)
    dense = {k: v.dequantize(mx.float32) if isinstance(v, QuantizedWeight) else v
             for k, v in weights.items()}
    model = build_model(cfg, dense, "cpu", mlx_dir)
    exact = np.array(model(mx.array(seq), Batch.build([(model.new_kv(), 0, len(seq))]),
                           list(range(n - 1, len(seq) - 1))))
    assert float(np.abs(exact - want).max()) <= 1e-4 * float(np.abs(want).max())
