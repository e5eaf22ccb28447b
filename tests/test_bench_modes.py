"""`slotserve bench --long` and `--sampling` on the bundled SmolLM2 (CPU, tiny settings): the
long-context and sampler workloads that bench/gpu_peer.py sets beside llama.cpp's run end to
end through the real engine and write the numbers the ratio table reads."""

from __future__ import annotations

import json
from typing import Any

import pytest

from slotserve.cli import main
from slotserve.tools.bench import SAMPLING_CASES, parse_contexts


def test_contexts_parse() -> None:
    assert parse_contexts("4096, 8x16384,4X32768") == [(1, 4096), (8, 16384), (4, 32768)]
    for bad in ("", "x", "8x", "ax64", "0x64", "-5"):
        with pytest.raises(ValueError, match="--contexts"):
            parse_contexts(bad)


@pytest.fixture(scope="module")
def report(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """One run of both modes (they compose: one engine load for the two tables)."""
    out = tmp_path_factory.mktemp("bench")
    assert main(["bench", "--device", "cpu", "--sampling", "--streams", "2",
                 "--prompt-tokens", "60", "--new-tokens", "5", "--long",
                 "--contexts", "80,2x64", "--long-new-tokens", "6", "--prefill-budget", "32",
                 "--out", str(out)]) == 0
    return json.loads((out / "long.json").read_text())


def test_long_cases_run_with_exact_prompt_lengths(report: dict[str, Any]) -> None:
    assert report["prefill_budget"] == 32
    rows = report["long"]
    assert [(r["streams"], r["context"]) for r in rows] == [(1, 80), (2, 64)]
    for r in rows:
        assert r["prompt_tokens"] == r["streams"] * r["context"]  # exactly C tokens each
        assert r["tokens"] == 6 * r["streams"]  # ignore_eos: every stream ran to the end
        assert r["ttft_max_ms"] >= r["ttft_p50_ms"] > 0
        assert r["prefill_tok_s"] > 0 and r["wall_s"] > 0
        assert r["decode_tok_s"] is not None and r["decode_tok_s"] > 0


def test_sampling_cases_beside_greedy(report: dict[str, Any]) -> None:
    rows = report["sampling"]
    assert [r["case"] for r in rows] == list(SAMPLING_CASES)
    assert all(r["streams"] == 2 and r["prompt_tokens"] == 120 and r["tokens"] == 10
               for r in rows)
    greedy, *sampled = rows
    assert "aggregate_vs_greedy" not in greedy
    for r in sampled:
        assert r["aggregate_vs_greedy"] == pytest.approx(
            r["aggregate_tok_s"] / greedy["aggregate_tok_s"], rel=0.01)
