"""Tensor parallel over MLX's ring backend: `slotserve serve --tensor-parallel 2` on the CPU,
two processes over 127.0.0.1, against the same model in one process.

The models are a tiny random llama made by transformers (4 heads, 2 kv heads, so each rank
holds 2 and 1; SmolLM2's 9 heads do not split in two) and tiny_models' Qwen3-MoE (each rank
holds half of every expert), cached under ~/.cache/slotserve/. Requests go concurrently to
the split server (batched steps, a shared prefix whose page start is copied) and one by one
to the single process; greedy and seeded answers must be the same text. The single process
is the reference: splitting a matmul's sum in two rounds differently, so this checks that
such rounding stays below what changes a token, and that the ranks stay in step through
batching, prefix reuse and KV copies.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import mlx.core as mx
import pytest
from tiny_models import make_tiny

from slotserve.api.app import create_app
from slotserve.api.server import BackgroundServer
from slotserve.engine import EngineConfig
from slotserve.kernels.quantized import QuantizedWeight
from slotserve.model.parallel import shard_weights

pytestmark = pytest.mark.timeout(300)

RECIPE = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
              intermediate_size=128, num_hidden_layers=2, max_position_embeddings=2048,
              rms_norm_eps=1e-6, tie_word_embeddings=True, seed=0)
LONG = " ".join(f"item{i}" for i in range(120))
REQUESTS = [
    {"prompt": "Hello there", "max_tokens": 16, "temperature": 0},
    {"prompt": "The quick brown fox", "max_tokens": 16, "temperature": 0.8, "seed": 7},
    {"prompt": "Once upon a time", "max_tokens": 16, "temperature": 0.9, "top_p": 0.9,
     "seed": 11},
    {"prompt": "Hello there", "max_tokens": 16, "temperature": 0.8, "seed": 3},
]
SHARED = [{"prompt": LONG + " alpha", "max_tokens": 8, "temperature": 0},
          {"prompt": LONG + " beta gamma", "max_tokens": 8, "temperature": 0.7, "seed": 5}]


def tiny_llama() -> Path:
    """The tiny llama checkpoint, built once per recipe."""
    key = hashlib.sha256(json.dumps(RECIPE, sort_keys=True).encode()).hexdigest()[:16]
    path = Path.home() / ".cache" / "slotserve" / f"tp-tiny-llama-{key}"
    if (path / "model.safetensors").exists():
        return path
    import torch
    import transformers

    from slotserve.tools.synth import write_smollm2_tokenizer

    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    tmp.mkdir(parents=True, exist_ok=True)
    vocab = write_smollm2_tokenizer(tmp)
    recipe = {k: v for k, v in RECIPE.items() if k != "seed"}
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(vocab_size=vocab, **recipe))
    torch.manual_seed(RECIPE["seed"])
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(0.0, 0.3 if "norm" in name else 0.08)
    model.to(torch.float32).save_pretrained(tmp, safe_serialization=True)
    if not path.exists():  # another process may have built it meanwhile: either will do
        os.replace(tmp, path)
    return path


def tiny_moe() -> Path:
    """tiny_models' Qwen3-MoE (8 experts of width 32, a dense layer of 96), built once."""
    source = (Path(__file__).with_name("tiny_models.py")).read_bytes()
    key = hashlib.sha256(source).hexdigest()[:16]
    path = Path.home() / ".cache" / "slotserve" / f"tp-tiny-qwen3_moe-{key}"
    if not (path / "model.safetensors").exists():
        tmp = make_tiny("qwen3_moe", path.with_name(path.name + f".tmp{os.getpid()}"))
        if not path.exists():
            os.replace(tmp, path)
    return path


def _dense(t: object) -> mx.array:
    return t.dequantize(mx.float32) if isinstance(t, QuantizedWeight) else t  # type: ignore[return-value]


@pytest.mark.parametrize("quantized", [False, True])
def test_each_rank_gets_its_rows_and_columns(quantized: bool) -> None:
    mx.random.seed(0)
    full = {"l.q_proj.weight": mx.random.normal((8, 128)),
            "l.o_proj.weight": mx.random.normal((128, 256)),
            "l.mlp.experts.gate_proj.weight": mx.random.normal((3, 8, 128)),
            "l.mlp.experts.down_proj.weight": mx.random.normal((3, 128, 256)),
            "l.mlp.experts.gate_up_proj": mx.random.normal((3, 16, 128)),
            "l.input_layernorm.weight": mx.random.normal((128,))}
    tensors: dict[str, object] = dict(full)
    if quantized:
        for name, w in full.items():
            if w.ndim > 1:
                tensors[name] = QuantizedWeight(*mx.quantize(w, group_size=64, bits=4), 64, 4)
    dense = {k: _dense(v) for k, v in tensors.items()}
    parts = [shard_weights(tensors, r, 2) for r in range(2)]  # type: ignore[arg-type]
    for r, part in enumerate(parts):
        got = {k: _dense(v) for k, v in part.items()}
        assert mx.array_equal(got["l.q_proj.weight"], dense["l.q_proj.weight"][4 * r:4 * r + 4])
        assert mx.array_equal(got["l.o_proj.weight"],
                              dense["l.o_proj.weight"][:, 128 * r:128 * r + 128])
        assert mx.array_equal(got["l.mlp.experts.gate_proj.weight"],
                              dense["l.mlp.experts.gate_proj.weight"][:, 4 * r:4 * r + 4])
        assert mx.array_equal(got["l.mlp.experts.down_proj.weight"],
                              dense["l.mlp.experts.down_proj.weight"][:, :, 128 * r:128 * r + 128])
        gu = dense["l.mlp.experts.gate_up_proj"]
        assert mx.array_equal(got["l.mlp.experts.gate_up_proj"], mx.concatenate(
            [gu[:, 4 * r:4 * r + 4], gu[:, 8 + 4 * r:8 + 4 * r + 4]], axis=1))
        assert got["l.input_layernorm.weight"] is dense["l.input_layernorm.weight"]
    # the two column halves' products add up to the whole product
    x = mx.random.normal((2, 256))
    whole = x @ dense["l.o_proj.weight"].T
    halves = sum(x[:, 128 * r:128 * r + 128] @ _dense(parts[r]["l.o_proj.weight"]).T
                 for r in range(2))
    assert mx.allclose(whole, halves, atol=1e-4)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def complete(url: str, body: dict[str, object]) -> tuple[str, int]:
    r = httpx.post(url + "/v1/completions", json=body, timeout=240)
    assert r.status_code == 200, r.text
    data = r.json()
    return data["choices"][0]["text"], data["usage"]["prompt_tokens_details"]["cached_tokens"]


@pytest.mark.parametrize("family", ["llama", "qwen3_moe"])
def test_two_ranks_answer_as_one_process(tmp_path: Path, family: str) -> None:
    model = tiny_llama() if family == "llama" else tiny_moe()
    port = free_port()
    log = tmp_path / "tp.log"
    script = Path(sys.executable).with_name("slotserve")
    cmd = [str(script)] if script.exists() else [sys.executable, "-m", "slotserve.cli"]
    env = dict(os.environ, OMP_NUM_THREADS="1")  # two ranks on two cores: no spinning pools
    with log.open("wb") as out:
        proc = subprocess.Popen([*cmd, "--log-level", "info", "serve", "--model", str(model),
                                 "--device", "cpu", "--tensor-parallel", "2", "--port",
                                 str(port), "--max-slots", "4"], stdout=out,
                                stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        while True:
            assert proc.poll() is None, log.read_text()[-4000:]
            assert time.monotonic() < deadline, log.read_text()[-4000:]
            try:
                if httpx.get(url + "/health", timeout=5).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        assert "rank=1" in log.read_text()  # the second rank loaded its half
        with ThreadPoolExecutor(len(REQUESTS)) as pool:  # batched steps on both ranks
            split = list(pool.map(lambda b: complete(url, b), REQUESTS))
        split_shared = [complete(url, b) for b in SHARED]
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    text = log.read_text()
    assert proc.returncode == 0, text[-4000:]
    assert "worker stopping" in text, "rank 1 did not stop with rank 0"
    with BackgroundServer(create_app(EngineConfig(model=str(model), device="cpu",
                                                  max_slots=4))).start() as one:
        alone = [complete(one.url, b) for b in REQUESTS]
        alone_shared = [complete(one.url, b) for b in SHARED]
    assert [t for t, _ in split] == [t for t, _ in alone]
    assert [t for t, _ in split_shared] == [t for t, _ in alone_shared]
    # the second shared prompt reused the first one's pages on both ranks
    assert split_shared[1][1] > 0 and split_shared[1][1] == alone_shared[1][1]
