"""The forced-call target in the suite (loadtests/agents_forced.py), short: six sampled forced
requests on SmolLM2 (each surface's `required` / `any` and a named function or tool, each of
the three tools named once): every reply one well-formed call valid against its tool's schema.
`agents_forced.py --requests 50` (every way on every tool, four times over) is the target's
run."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from slotserve.api.anthropic import parse_messages
from slotserve.api.app import create_app
from slotserve.api.server import BackgroundServer
from slotserve.engine import EngineConfig

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "loadtests"))
import agents_forced  # noqa: E402


def test_the_checker_finds_schema_breaks() -> None:
    assert agents_forced.check("resize", '{"rows": 40, "cols": 120, "unit": "chars"}',
                               None) == []
    assert agents_forced.check("resize", '{"rows": 0, "cols": 1.5, "unit": "em"}', None) == [
        "arguments.rows: 0 out of [1, 200]", "arguments.cols: not an integer",
        "arguments.unit: 'em' not in the enum"]
    assert agents_forced.check("set_flags", {"debug": 1, "opt": {}, "x": 0}, None) == [
        "arguments: unexpected x",
        "arguments.debug: not a boolean", "arguments.opt: missing level"]
    assert agents_forced.check("read_file", '{"path": "a"', None)[0].startswith(
        "arguments are not JSON")
    assert agents_forced.check("read_file", "{}", "resize") == ["called 'read_file'"]


def test_anthropic_parallel_calls_can_be_disabled() -> None:
    body = {"max_tokens": 8, "messages": [{"role": "user", "content": "x"}],
            "tools": [{"name": "f", "input_schema": {"type": "object"}}]}
    assert parse_messages({**body, "tool_choice": {"type": "any"}}).parallel_calls
    for choice in ({"type": "any", "disable_parallel_tool_use": True},
                   {"type": "tool", "name": "f", "disable_parallel_tool_use": True}):
        assert not parse_messages({**body, "tool_choice": choice}).parallel_calls


@pytest.mark.timeout(600)
def test_forced_calls_short(tmp_path: Path) -> None:
    n = 6
    with BackgroundServer(create_app(EngineConfig(max_slots=6, max_queue=16))).start() as srv:
        rc = agents_forced.main(["--url", srv.url, "--requests", str(n), "--concurrency", "6",
                                 "--out", str(tmp_path)])
    report = json.loads((tmp_path / "agents_forced.json").read_text())
    assert rc == 0 and report["passed"], [r for r in report["results"] if r["problems"]]
    assert {r["call"] for r in report["results"]} == set(agents_forced.SCHEMAS)
