"""The four-agent gate: concurrent coding-agent conversations against a slotserve, checked.

    .venv/bin/python loadtests/agents_gate.py --url http://127.0.0.1:8000    # a running server
    .venv/bin/python loadtests/agents_gate.py                 # starts the bundled SmolLM2 itself
    .venv/bin/python loadtests/agents_gate.py --agents 4 --history-tokens 8000 \\
        --followup-ttft-ms 150 --min-reuse 0.95 --url ...     # the GPU preset (bench/gpu.sh)

Each agent holds one conversation (its own system prompt and a history of about
--history-tokens tokens of source code) and takes these turns, all agents at once:

  a  cold, tool_choice "required": the reply must be one well-formed call valid against its
     tool's schema
  a2 the same request again (cached repeat): its prompt must be reused (>= --min-reuse)
  b  the tool's result (a file's source) sent back, tool_choice "auto", streamed: a call in the
     stream must reassemble (SSE tool-call reconstruction) to valid JSON arguments; the same
     request then unstreamed and streamed again must give the same calls and report the same
     cached tokens
  c  the continuation after b (named tool write_file, whose argument is source code: quotes,
     backslashes and newlines inside JSON): reused >= --min-reuse and time to first token
     <= --followup-ttft-ms (0: no such bar)

With --followup-ttft-ratio R, the median TTFT of each follow-up turn (b and c) over the
agents must also be <= R times the median cold turn a's (issue 20's bar: 0.2 at 8k-token
histories).

It prints one line per turn and a verdict, writes --out/agents_gate.json, and exits 0 only
when every check held.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
import openai

ROOT = Path(__file__).resolve().parent.parent

TOOLS = [
    {"type": "function", "function": {
        "name": "read_file", "description": "Read a file of the repository",
        "parameters": {"type": "object", "properties": {"path": {"type": "string",
                                                                 "maxLength": 64}},
                       "required": ["path"], "additionalProperties": False}}},
    {"type": "function", "function": {
        "name": "write_file", "description": "Write a file of the repository",
        "parameters": {"type": "object", "properties": {
            "path": {"type": "string", "maxLength": 32},
            "content": {"type": "string", "maxLength": 120}},
            "required": ["path", "content"], "additionalProperties": False}}},
    {"type": "function", "function": {
        "name": "run_tests", "description": "Run the test suite",
        "parameters": {"type": "object", "properties": {"pattern": {"type": "string",
                                                                    "maxLength": 32}},
                       "required": ["pattern"], "additionalProperties": False}}},
]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}

SOURCE = '''def parse(line: str) -> dict[str, str]:
    """Split "key = value" into a pair; quotes and backslashes are kept: "a\\\\b"."""
    key, _, value = line.partition("=")
    return {key.strip(): value.strip()}
'''


def valid_arguments(name: str, arguments: str) -> bool:
    """The arguments against the tool's schema (the keywords the gate's schemas use)."""
    try:
        args = json.loads(arguments)
    except ValueError:
        return False
    schema = SCHEMAS.get(name)
    if schema is None or not isinstance(args, dict) or set(args) != set(schema["required"]):
        return False
    return all(isinstance(args[k], str) and len(args[k]) <= spec["maxLength"]
               for k, spec in schema["properties"].items())


def history(agent: int, tokens: int) -> list[dict[str, Any]]:
    """An agent's conversation so far: a system prompt and ~`tokens` tokens of source."""
    files = []
    n = 0
    while n * 40 < tokens:  # ~40 tokens per function
        files.append(f"def helper_{agent}_{n}(x: int) -> int:\n    return x * {n} + {agent}\n")
        n += 1
    return [{"role": "system", "content": f"You are coding agent {agent}. Use the tools."},
            {"role": "user", "content": "Here is the module:\n\n" + "\n".join(files)},
            {"role": "assistant", "content": "I have read the module."},
            {"role": "user", "content": "Read config.py, then fix its parse function."}]


@dataclass
class Turn:
    agent: int
    turn: str
    ttft_ms: float
    prompt_tokens: int
    cached_tokens: int
    calls: list[tuple[str, str]] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    completion_tokens: int = 0
    # the previous turn's prompt and reply tokens: what the cache could hold of this prompt
    seen: int = 0

    @property
    def reuse(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


async def streamed(client: openai.AsyncOpenAI, **body: Any) -> tuple[float, list, Any]:
    """A streamed chat: (time to first chunk with content or a call, calls, usage)."""
    start = time.perf_counter()
    first = None
    calls: dict[int, list[str]] = {}
    usage = None
    stream = await client.chat.completions.create(
        **body, stream=True, stream_options={"include_usage": True})
    async for chunk in stream:
        usage = chunk.usage or usage
        for ch in chunk.choices:
            if first is None and (ch.delta.content or ch.delta.tool_calls):
                first = time.perf_counter()
            for tc in ch.delta.tool_calls or []:
                entry = calls.setdefault(tc.index, ["", ""])
                entry[0] += tc.function.name or ""
                entry[1] += tc.function.arguments or ""
    ttft = ((first or time.perf_counter()) - start) * 1000
    return ttft, [tuple(calls[i]) for i in sorted(calls)], usage


async def agent(client: openai.AsyncOpenAI, i: int, args: argparse.Namespace) -> list[Turn]:
    base = dict(model="default", tools=TOOLS, temperature=0, max_tokens=args.max_tokens,
                parallel_tool_calls=False)
    msgs = history(i, args.history_tokens)
    turns = []
    for name in ("a", "a2"):
        ttft, calls, usage = await streamed(client, messages=msgs, tool_choice="required",
                                            **base)
        t = Turn(i, name, ttft, usage.prompt_tokens, usage.prompt_tokens_details.cached_tokens,
                 calls, completion_tokens=usage.completion_tokens)
        if len(calls) != 1 or not valid_arguments(*calls[0]):
            t.problems.append(f"not one schema-valid call: {calls}")
        if name == "a2" and t.reuse < args.min_reuse:
            t.problems.append(f"reused {t.reuse:.0%} < {args.min_reuse:.0%}")
        turns.append(t)
    call = turns[0].calls[0] if turns[0].calls else ("read_file", '{"path": "config.py"}')
    msgs = msgs + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_a", "type": "function", "function": {"name": call[0],
                                                          "arguments": call[1]}}]},
        {"role": "tool", "tool_call_id": "call_a", "content": SOURCE * args.result_repeat}]
    free = {**base, "max_tokens": args.free_max_tokens or args.max_tokens}
    ttft, calls, usage = await streamed(client, messages=msgs, tool_choice="auto", **free)
    t = Turn(i, "b", ttft, usage.prompt_tokens, usage.prompt_tokens_details.cached_tokens, calls,
             completion_tokens=usage.completion_tokens,
             seen=turns[-1].prompt_tokens + turns[-1].completion_tokens)
    for c in calls:
        try:
            json.loads(c[1])
        except ValueError:
            t.problems.append(f"streamed arguments are not JSON: {c[1]!r}")
    # the same request again, unstreamed and then streamed, from the same cache state: the
    # same calls, and the same cached tokens reported
    whole = await client.chat.completions.create(messages=msgs, tool_choice="auto", **free)
    _, again, usage2 = await streamed(client, messages=msgs, tool_choice="auto", **free)
    got = [(c.function.name, c.function.arguments)
           for c in whole.choices[0].message.tool_calls or []]
    if again != got:
        t.problems.append(f"streamed calls {again} != unstreamed {got}")
    cached = (usage2.prompt_tokens_details.cached_tokens,
              whole.usage.prompt_tokens_details.cached_tokens)
    if cached[0] != cached[1]:
        t.problems.append(f"cached tokens streamed {cached[0]} != unstreamed {cached[1]}")
    turns.append(t)
    reply = whole.choices[0].message
    msgs = msgs + [{"role": "assistant", "content": reply.content or "",
                    **({"tool_calls": [c.model_dump() for c in reply.tool_calls]}
                       if reply.tool_calls else {})}]
    if reply.tool_calls:
        msgs += [{"role": "tool", "tool_call_id": c.id, "content": "ok"}
                 for c in reply.tool_calls]
    msgs.append({"role": "user", "content": "Now write the fixed config.py."})
    ttft, calls, usage = await streamed(
        client, messages=msgs, tool_choice={"type": "function",
                                            "function": {"name": "write_file"}}, **base)
    t = Turn(i, "c", ttft, usage.prompt_tokens, usage.prompt_tokens_details.cached_tokens, calls,
             completion_tokens=usage.completion_tokens,
             seen=whole.usage.prompt_tokens + whole.usage.completion_tokens)
    if len(calls) != 1 or calls[0][0] != "write_file" or not valid_arguments(*calls[0]):
        t.problems.append(f"not one schema-valid write_file call: {calls}")
    if t.reuse < args.min_reuse:
        t.problems.append(f"reused {t.reuse:.0%} < {args.min_reuse:.0%}")
    if args.followup_ttft_ms and ttft > args.followup_ttft_ms:
        t.problems.append(f"TTFT {ttft:.0f} ms > {args.followup_ttft_ms:.0f} ms")
    turns.append(t)
    return turns


async def gate(url: str, args: argparse.Namespace) -> list[Turn]:
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key=os.environ.get(
        "SLOTSERVE_API_KEY", "none"), max_retries=0, timeout=args.timeout)
    try:
        results = await asyncio.gather(*(agent(client, i, args) for i in range(args.agents)))
    finally:
        await client.close()
    return [t for turns in results for t in turns]


def summarize(turns: list[Turn]) -> dict[str, Any]:
    """Medians over the agents: the cold turn's TTFT, and per follow-up turn (b: after the
    tool result, c: after b's reply) the prompt share reused, the share of the tokens the
    cache could hold (the previous turn's prompt and reply: its length is the next prompt's
    common prefix with it, `seen`) and TTFT against the cold one."""
    by: dict[str, list[Turn]] = {}
    for t in turns:
        by.setdefault(t.turn, []).append(t)
    cold = statistics.median(t.ttft_ms for t in by.get("a", [])) if "a" in by else 0.0
    out: dict[str, Any] = {"cold_ttft_ms": cold, "follow_ups": {}}
    for name in ("b", "c"):
        ts = by.get(name, [])
        if not ts:
            continue
        ttft = statistics.median(t.ttft_ms for t in ts)
        out["follow_ups"][name] = {
            "reuse": statistics.median(t.reuse for t in ts),
            "reuse_of_seen": statistics.median(
                t.cached_tokens / t.seen if t.seen else 0.0 for t in ts),
            "ttft_ms": ttft, "ttft_vs_cold": ttft / cold if cold else 0.0}
    return out


def ttft_ratio_problems(summary: dict[str, Any], ratio: float | None) -> list[str]:
    """The follow-up turns whose median TTFT exceeds `ratio` times the cold turn's."""
    if ratio is None:
        return []
    return [f"turn {name}: median TTFT {s['ttft_vs_cold']:.3f}x the cold turn's > {ratio}x"
            for name, s in summary["follow_ups"].items() if s["ttft_vs_cold"] > ratio]


def start_server(model: str | None, max_slots: int, out: Path,
                 extra: tuple[str, ...] = (),
                 ready_s: float = 300.0) -> tuple[subprocess.Popen[bytes], str]:
    """`slotserve serve` on a free port (its output in out/server.log); returns once /health
    answers 200 (within `ready_s`: a GPU without MLX's kernel cache compiles for minutes
    first). The agent scripts in loadtests/ share it."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "slotserve.cli", *extra, "serve", "--host", "127.0.0.1",
           "--port", str(port), "--max-slots", str(max_slots)]
    if model:
        cmd += ["--model", model]
    log = (out / "server.log").open("wb")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT,
                            start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + ready_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited ({proc.returncode}); see {out}/server.log")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    stop_server(proc)
    raise RuntimeError(f"the server did not become ready within {ready_s:.0f} s")


def stop_server(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--url", help="a running server (default: start the bundled model)")
    p.add_argument("--model", help="the model to start (without --url)")
    p.add_argument("--agents", type=int, default=4)
    p.add_argument("--history-tokens", type=int, default=8000)
    p.add_argument("--result-repeat", type=int, default=8,
                   help="copies of the source file in turn b's tool result")
    p.add_argument("--max-tokens", type=int, default=160)
    p.add_argument("--free-max-tokens", type=int, default=None,
                   help="max_tokens of the free (tool_choice auto) turn b; default --max-tokens")
    p.add_argument("--followup-ttft-ms", type=float, default=150.0,
                   help="turn c's TTFT bar (0: none)")
    p.add_argument("--followup-ttft-ratio", type=float, default=None,
                   help="bar for each follow-up turn's median TTFT / the cold turn's")
    p.add_argument("--min-reuse", type=float, default=0.95)
    p.add_argument("--timeout", type=float, default=600.0)
    p.add_argument("--ready-timeout", type=float, default=300.0,
                   help="seconds the started server may take to load and warm up")
    p.add_argument("--out", type=Path, default=ROOT / "reports" / "agents_gate")
    args = p.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    proc = None
    url = args.url
    if url is None:
        proc, url = start_server(args.model, max(args.agents, 1), args.out,
                                 ready_s=args.ready_timeout)
    try:
        turns = asyncio.run(gate(url.rstrip("/"), args))
    finally:
        if proc is not None:
            stop_server(proc)
    for t in turns:
        mark = "ok  " if not t.problems else "FAIL"
        print(f"{mark} agent {t.agent} turn {t.turn:2}  ttft {t.ttft_ms:8.0f} ms  prompt "
              f"{t.prompt_tokens:6}  reused {t.reuse:6.1%}  {'; '.join(t.problems)}")
    passed = all(not t.problems for t in turns)
    summary = summarize(turns)
    for name, s in summary["follow_ups"].items():
        print(f"turn {name}: reused {s['reuse']:.1%} of the prompt ({s['reuse_of_seen']:.1%} "
              f"of what the cache could hold), TTFT {s['ttft_ms']:.0f} ms = "
              f"{s['ttft_vs_cold']:.3f}x the cold turn a's {summary['cold_ttft_ms']:.0f} ms "
              "(medians over the agents)")

    for problem in ttft_ratio_problems(summary, args.followup_ttft_ratio):
        print(f"FAIL {problem}")
        passed = False
    (args.out / "agents_gate.json").write_text(json.dumps(
        {"passed": passed, "settings": {k: str(v) for k, v in vars(args).items()},
         "summary": summary,
         "turns": [{**asdict(t), "reuse": t.reuse} for t in turns]}, indent=2))
    print("PASS" if passed else "FAIL")
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
