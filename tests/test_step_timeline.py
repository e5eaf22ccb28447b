"""bench/step_timeline.py on the bundled SmolLM2 (CPU, tiny settings): the step records of
two prompts served together account for every prompt token and every decoded token, keep
each step within the prefill budget, and sort the steps into their kinds."""

from __future__ import annotations

import argparse
import importlib.util
from pathlib import Path

import anyio

_SPEC = importlib.util.spec_from_file_location(
    "step_timeline", Path(__file__).resolve().parents[1] / "bench" / "step_timeline.py")
assert _SPEC is not None and _SPEC.loader is not None
step_timeline = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(step_timeline)


def test_the_steps_of_two_prompts_account_for_their_tokens() -> None:
    args = argparse.Namespace(model=None, device="cpu", streams=2, prompt_tokens=80,
                              new_tokens=5, prefill_budget=32, out=None)
    result = anyio.run(step_timeline.run, args)
    steps, kinds = result["steps"], result["summary"]["kinds"]
    assert result["case"]["tokens"] == 10
    # every prompt token is fed once; the first token of each stream comes from its
    # prompt's last chunk, the other four from decode rows
    assert sum(s["prefill_rows"] for s in steps) == 2 * 80
    assert sum(s["decode_rows"] for s in steps) == 2 * 4
    assert all(s["prefill_rows"] + s["decode_rows"] <= 32 for s in steps)
    assert all(s["model_s"] is not None and s["tick_s"] >= s["model_s"] for s in steps)
    assert max(s["max_context"] for s in steps) == 80 + 4
    assert set(kinds) <= {"prefill", "prefill+decode", "decode"} and "decode" in kinds
    assert sum(k["steps"] for k in kinds.values()) == len(steps)
    assert 0 < result["summary"]["prefill_done_s"] <= result["summary"]["steps_s"] + steps[0]["t_s"]
