"""Tensor parallel on two GPUs of one host (MLX's NCCL backend): skipped with fewer.

`slotserve serve --tensor-parallel 2 --device gpu` on a random-weight Llama-3-8B shape
(MLX 4-bit, a few layers; slotserve synth), one GPU a rank. Batch invariance across ranks:
every answer, greedy and seeded, is the same text alone and among the others at once, and
the same again on a second run. (On bf16 a split matmul rounds its halves apart, so the
tokens of one GPU are not asserted here; the CPU test compares those in float32.)

    pytest -m gpu tests/test_tensor_parallel_gpu.py     # SLOTSERVE_TOKENIZER_DIR where the
                                                         # bundled SmolLM2 is not installed
"""

from __future__ import annotations

import os
import shutil
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

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(1800)]

LAYERS = 4
REQUESTS = [{"prompt": f"Item {i}: the colour of the sea is", "max_tokens": 32,
             "temperature": 0 if i % 2 == 0 else 0.8, "seed": i} for i in range(8)]


def gpus() -> int:
    if not mx.is_available(mx.gpu) or shutil.which("nvidia-smi") is None:
        return 0
    out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True).stdout
    return sum(line.startswith("GPU ") for line in out.splitlines())


def slotserve() -> list[str]:
    script = Path(sys.executable).with_name("slotserve")
    return [str(script)] if script.exists() else [sys.executable, "-m", "slotserve.cli"]


def checkpoint() -> Path:
    path = Path.home() / ".cache" / "slotserve" / f"tp-gpu-llama3-8b-l{LAYERS}-mlx4"
    if not (path / "config.json").exists():
        subprocess.run([*slotserve(), "synth", "llama3-8b", str(path), "--layers", str(LAYERS)],
                       check=True)
    return path


def complete(url: str, body: dict[str, object]) -> str:
    r = httpx.post(url + "/v1/completions", json=body, timeout=600)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


@pytest.mark.skipif(gpus() < 2, reason="needs two GPUs (NCCL tensor parallel)")
def test_two_gpus_answer_alike_alone_and_batched(tmp_path: Path) -> None:
    model = checkpoint()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = tmp_path / "tp.log"
    with log.open("wb") as out:
        proc = subprocess.Popen([*slotserve(), "--log-level", "info", "serve", "--model",
                                 str(model), "--device", "gpu", "--tensor-parallel", "2",
                                 "--port", str(port), "--max-slots", "16"],
                                stdout=out, stderr=subprocess.STDOUT, env=dict(os.environ))
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 1200  # a fresh machine JIT-compiles the CUDA kernels
        while True:
            assert proc.poll() is None, log.read_text()[-4000:]
            assert time.monotonic() < deadline, log.read_text()[-4000:]
            try:
                if httpx.get(url + "/health", timeout=5).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(1)
        assert "rank=1" in log.read_text()
        alone = [complete(url, b) for b in REQUESTS]
        with ThreadPoolExecutor(len(REQUESTS)) as pool:
            together = list(pool.map(lambda b: complete(url, b), REQUESTS))
        again = [complete(url, b) for b in REQUESTS]
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(120)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    assert together == alone
    assert again == alone
    assert proc.returncode == 0 and "worker stopping" in log.read_text()
