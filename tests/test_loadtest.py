"""The load test harness end to end: loadtests/run.py's short version as a subprocess.

Starts a real server (the bundled SmolLM2), runs Locust for 20 s with 8 users and checks that it
passed and wrote its reports. Its long prompts are ~600 tokens, not the default run's ~2.2k: a
2.2k-token prefill takes 5-8 s of the 20 on a quiet 2-core CPU and much longer on a loaded
one, so the short run checks the harness, not how fast the CPU is. Needs locust (the `test`
extra); skipped without it.
"""

from __future__ import annotations

import csv
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
RUN = ROOT / "loadtests" / "run.py"

pytestmark = pytest.mark.skipif(importlib.util.find_spec("locust") is None,
                                reason="locust is not installed (pip install -e '.[test]')")


@pytest.mark.timeout(210)
def test_short_load_run_passes_and_writes_reports(tmp_path: Path) -> None:
    # --stop-timeout: the users' last requests finish and are reported, so every kind of
    # request a user started is in the stats however slow (or busy) the machine is
    out = tmp_path / "reports"
    proc = subprocess.run([sys.executable, str(RUN), "--time", "20", "--users", "8",
                           "--spawn-rate", "4", "--long-tokens", "600", "--stop-timeout", "60",
                           "--out", str(out)],
                          capture_output=True, text=True, timeout=200, cwd=ROOT)
    assert proc.returncode == 0, f"{proc.stdout}\n{proc.stderr}"
    assert "PASS" in proc.stdout
    for name in ("locust_stats.csv", "locust_failures.csv", "locust.html", "summary.json",
                 "metrics.txt", "rss.csv", "server.log"):
        assert (out / name).stat().st_size > 0, name
    summary = json.loads((out / "summary.json").read_text())
    assert summary["verdict"]["passed"] and summary["failed"] == 0
    assert summary["ttft_ms"]["count"] > 0 and summary["completion_tokens"] > 0
    with (out / "locust_stats.csv").open() as f:
        names = {row["Name"] for row in csv.DictReader(f)}
    assert {"ttft_ms", "decode_tok_s", "chat short", "completion"} <= names
