"""The four-agent gate (loadtests/agents_gate.py) in short settings on SmolLM2: four agents at
once, each a cold forced call, its cached repeat, a streamed tool-result turn and a forced
continuation with source code in its argument. Short settings: ~100-token histories, a
16-token free turn and CPU bounds on time to first token and reuse (the GPU preset's 150 ms /
95 % with 8k-token histories is `agents_gate.py`'s defaults)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from slotserve.api.app import create_app
from slotserve.api.server import BackgroundServer
from slotserve.engine import EngineConfig

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "loadtests"))
import agents_gate  # noqa: E402


@pytest.mark.timeout(900)
def test_four_agent_gate_short(tmp_path: Path) -> None:
    with BackgroundServer(create_app(EngineConfig(max_slots=4, max_queue=8))).start() as srv:
        rc = agents_gate.main(["--url", srv.url, "--agents", "4", "--history-tokens", "100",
                               "--result-repeat", "1", "--max-tokens", "200",
                               "--free-max-tokens", "16",
                               "--followup-ttft-ms", "120000", "--min-reuse", "0.8",
                               "--out", str(tmp_path)])
    report = json.loads((tmp_path / "agents_gate.json").read_text())
    problems = [(t["agent"], t["turn"], t["problems"]) for t in report["turns"] if t["problems"]]
    assert rc == 0 and report["passed"], problems
    assert len(report["turns"]) == 16


def test_ttft_ratio_bar_reads_each_follow_up_median() -> None:
    """--followup-ttft-ratio (issue 20's 0.2x bar) fails exactly the follow-up turns whose
    median TTFT is above the ratio to the cold turn's, and nothing without a ratio."""
    summary = {"cold_ttft_ms": 10000.0, "follow_ups": {
        "b": {"ttft_vs_cold": 0.21}, "c": {"ttft_vs_cold": 0.05}}}
    assert agents_gate.ttft_ratio_problems(summary, None) == []
    assert agents_gate.ttft_ratio_problems(summary, 0.25) == []
    problems = agents_gate.ttft_ratio_problems(summary, 0.2)
    assert len(problems) == 1 and problems[0].startswith("turn b:")
