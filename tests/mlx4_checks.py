"""MLX 4-bit checkpoints (made by `mlx_lm.convert -q`) against transformers.

The reference is transformers' own model holding the 4-bit file's numbers: every tensor of
the converted file, quantized ones dequantized (`mx.dequantize`), loaded into the family's
HF class. Against it, what slotserve computes from the file (4-bit weights kept quantized,
int8 activations on the CPU) must agree on the top token at >= 95 % of 64 teacher-forced
positions (the greedy continuation of the reference) and stay within a stated logit
tolerance. Against the float checkpoint itself tiny random models make no such test: their
logits spread ~0.2 over 49,152 tokens, under 4-bit rounding noise.
"""

from __future__ import annotations  # noqa: I001  (slotserve preloads OpenBLAS before MLX)

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import slotserve  # noqa: F401
import mlx.core as mx
import numpy as np

from slotserve.kernels import cpu_qgemm
from slotserve.model.layers import Batch
from slotserve.model.loader import load

from converted import to_mlx4

STEPS = 64
MIN_AGREEMENT = 0.95
LOGIT_TOLERANCE = 0.1  # int8 activations x 4-bit codes against float32 dequantized weights


@dataclass
class Mlx4Result:
    agreement: float  # top-1 agreement with the reference over STEPS positions
    max_logit_diff: float
    quantized_linears: int  # Linear layers slotserve kept 4-bit


def dequantized_reference(hf_dir: Path, mlx_dir: Path) -> Any:
    """transformers' model of hf_dir, given every tensor of the MLX file (dequantized)."""
    import torch
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(hf_dir).float().eval()
    quant = json.loads((mlx_dir / "config.json").read_text())["quantization"]
    raw: dict[str, mx.array] = {}
    for f in sorted(mlx_dir.glob("model*.safetensors")):
        raw.update(mx.load(str(f)))
    state: dict[str, Any] = {}
    for key, value in raw.items():
        if key.endswith((".scales", ".biases")):
            continue
        base = key.removesuffix(".weight")
        if base + ".scales" in raw:
            value = mx.dequantize(value, raw[base + ".scales"], raw[base + ".biases"],
                                  group_size=quant["group_size"], bits=quant["bits"])
        state[key] = torch.from_numpy(np.array(value.astype(mx.float32)))
    own = hf.state_dict()
    for key in [k for k in state if k not in own]:
        # mlx-lm writes a multimodal model's text weights under the old names
        moved = key.replace("language_model.model.", "model.language_model.", 1)
        assert moved in own, f"{key}: no HF tensor of that name"
        state[moved] = state.pop(key)
    missing = [k for k in own if k not in state and "vision" not in k
               and "multi_modal" not in k and not k.endswith("lm_head.weight")]
    assert not missing, f"the MLX file lacks {missing[:5]}"
    hf.load_state_dict(state, strict=False)
    hf.generation_config.eos_token_id = None
    hf.generation_config.pad_token_id = 0
    return hf


def check_mlx4(hf_dir: Path, prompt: list[int]) -> Mlx4Result:
    """Convert hf_dir with mlx_lm.convert -q (cached), load it in slotserve on the CPU and
    compare with the dequantized reference over STEPS teacher-forced positions."""
    import torch

    mlx_dir = to_mlx4(hf_dir)
    ref = dequantized_reference(hf_dir, mlx_dir)
    n = len(prompt)
    with torch.no_grad():
        out = ref.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=STEPS,
                           attention_mask=torch.ones(1, n, dtype=torch.long),
                           min_new_tokens=STEPS)
        seq = out[0].tolist()
        want = ref(torch.tensor([seq])).logits[0, n - 1 : -1].numpy()
    model = load(mlx_dir, device="cpu", with_tokenizer=False).model
    kept = sum(isinstance(lin.kernel, cpu_qgemm.QMatrix) for lin in model.linears())
    got = np.array(model(mx.array(seq), Batch.build([(model.new_kv(), 0, len(seq))]),
                         list(range(n - 1, len(seq) - 1))))
    agreement = float((got.argmax(-1) == np.array(seq[n:])).mean())
    return Mlx4Result(agreement, float(np.abs(got - want).max()), kept)


def assert_mlx4_matches(hf_dir: Path, prompt: list[int], linears: int) -> None:
    """check_mlx4 within the bounds above, with `linears` matmuls kept 4-bit."""
    r = check_mlx4(hf_dir, prompt)
    assert r.quantized_linears == linears, r
    assert r.agreement >= MIN_AGREEMENT, r
    assert r.max_logit_diff <= LOGIT_TOLERANCE, r
