"""Real coding agents against a local slotserve: one non-interactive turn each (`make e2e`).

    .venv/bin/python loadtests/agents_e2e.py                      # all three, bundled SmolLM2
    .venv/bin/python loadtests/agents_e2e.py --agents codex --model path/to/model

Installs the pinned CLIs from npm into ~/.cache/slotserve/e2e (once; needs node and npm), starts
`slotserve serve` on a free port, and runs, each in a fresh HOME with its own configuration:

    opencode   opencode run -m slotserve/default   (an @ai-sdk/openai-compatible provider)
    codex      codex exec --skip-git-repo-check    (a custom model provider, wire_api responses)
    claude     claude -p --model default           (ANTHROPIC_BASE_URL; on the bundled
               SmolLM2 with --tools Bash,Read: Claude Code's default system prompt and tools
               are ~22,700 tokens, past SmolLM2's 8,192-token context)

With --record DIR, each agent talks to slotserve through a recording proxy
(agents_record.py) and DIR/<agent>.json gets its requests and the answers' shapes, as
tests/fixtures/agents/ holds them (replayed by tests/test_agents_replay.py).

An agent passes when its CLI exits 0 and the server's access log shows its route answered 200
and no request of it answered an error. Writes --out/<agent>.log and --out/server.log; exits 0
only when every agent passed. Turns are slow on a CPU: a coding agent's own prompt is
thousands of tokens (Codex's ~6,400), prefilled before the first token.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

from agents_gate import start_server, stop_server
from agents_record import RecordingProxy, fixture

ROOT = Path(__file__).resolve().parent.parent
CACHE = Path.home() / ".cache" / "slotserve" / "e2e"
PACKAGES = {"opencode": "opencode-ai@1.18.33", "codex": "@openai/codex@0.171.0",
            "claude": "@anthropic-ai/claude-code@2.1.197"}
ROUTES = {"opencode": "/v1/chat/completions", "codex": "/v1/responses",
          "claude": "/v1/messages"}
PROMPT = "Reply with one short sentence: what is 2 + 2?"
SMALL_CONTEXT_TOOLS = "Bash,Read"


def install() -> Path:
    """The CLIs' bin directory, installed from npm the first time."""
    bin_dir = CACHE / "node_modules" / ".bin"
    if all((bin_dir / name).exists() for name in PACKAGES):
        return bin_dir
    npm = shutil.which("npm")
    if npm is None:
        raise SystemExit("agents_e2e: npm not found (apt-get install nodejs npm)")
    CACHE.mkdir(parents=True, exist_ok=True)
    subprocess.run([npm, "install", "--no-audit", "--no-fund", "--prefix", str(CACHE),
                    *PACKAGES.values()], check=True)
    return bin_dir


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def command(agent: str, bin_dir: Path, url: str, home: Path, work: Path,
            small_context: bool) -> tuple[list[str], dict[str, str]]:
    """The agent's command line and environment, its configuration written under `home`.
    `small_context`: the bundled SmolLM2 (8,192 tokens), for which Claude Code gets a smaller
    tool set (`SMALL_CONTEXT_TOOLS`)."""
    env = {"HOME": str(home), "PATH": os.environ.get("PATH", ""), "TERM": "dumb",
           "NO_COLOR": "1", "CI": "1"}
    if agent == "opencode":
        (work / "opencode.json").write_text(json.dumps({
            "$schema": "https://opencode.ai/config.json",
            "provider": {"slotserve": {"npm": "@ai-sdk/openai-compatible", "name": "slotserve",
                                       "options": {"baseURL": url + "/v1", "apiKey": "none"},
                                       "models": {"default": {"name": "slotserve"}}}},
            "model": "slotserve/default"}))
        return [str(bin_dir / "opencode"), "run", "-m", "slotserve/default", PROMPT], env
    if agent == "codex":
        codex_home = home / ".codex"
        codex_home.mkdir(parents=True, exist_ok=True)
        (codex_home / "config.toml").write_text(
            'model = "default"\nmodel_provider = "slotserve"\n\n'
            "[model_providers.slotserve]\n"
            f'name = "slotserve"\nbase_url = "{url}/v1"\nwire_api = "responses"\n')
        env["CODEX_HOME"] = str(codex_home)
        return [str(bin_dir / "codex"), "exec", "--skip-git-repo-check", PROMPT], env
    env.update(ANTHROPIC_BASE_URL=url, ANTHROPIC_API_KEY="none",
               DISABLE_AUTOUPDATER="1", DISABLE_TELEMETRY="1")
    cmd = [str(bin_dir / "claude"), "-p", PROMPT, "--model", "default"]
    if small_context:  # its default prompt and tools are ~22,700 tokens: past 8,192
        cmd += ["--tools", SMALL_CONTEXT_TOOLS]
    return cmd, env


def served(log_text: str, route: str) -> tuple[list[int], list[str]]:
    """The statuses the access log shows for `route`, and the server's error lines."""
    statuses, errors = [], []
    for line in log_text.splitlines():
        if "request" in line and f"path={route}" in line and "status=" in line:
            statuses.append(int(line.split("status=")[1].split()[0]))
        if "[error" in line:
            errors.append(line)
    return statuses, errors


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--agents", default="opencode,codex,claude")
    p.add_argument("--model", help="the model to serve (default: the bundled SmolLM2)")
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds per agent turn")
    p.add_argument("--out", type=Path, default=ROOT / "reports" / "e2e")
    p.add_argument("--record", type=Path, help="write each agent's exchanges as a fixture here")
    args = p.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    bin_dir = install()
    try:
        proc, url = start_server(args.model, 2, args.out, ("--log-level", "info"))
    except RuntimeError as exc:
        raise SystemExit(f"agents_e2e: {exc}") from None
    results = {}
    try:
        for agent in args.agents.split(","):
            home = args.out / "homes" / agent
            shutil.rmtree(home, ignore_errors=True)
            work = home / "work"
            work.mkdir(parents=True)
            proxy = RecordingProxy(url).start() if args.record else None
            cmd, env = command(agent, bin_dir, proxy.url if proxy else url, home, work,
                               args.model is None)
            before = len((args.out / "server.log").read_text(errors="replace"))
            started = time.monotonic()
            with (args.out / f"{agent}.log").open("wb") as log:
                try:
                    rc = subprocess.run(cmd, cwd=work, env=env, stdin=subprocess.DEVNULL,
                                        stdout=log, stderr=subprocess.STDOUT,
                                        timeout=args.timeout).returncode
                except subprocess.TimeoutExpired:
                    rc = 124
            seconds = time.monotonic() - started
            if proxy is not None:
                proxy.stop()
                args.record.mkdir(parents=True, exist_ok=True)
                (args.record / f"{agent}.json").write_text(json.dumps(
                    fixture(agent, PACKAGES[agent], proxy.exchanges), indent=1) + "\n")
            text = (args.out / "server.log").read_text(errors="replace")[before:]
            statuses, errors = served(text, ROUTES[agent])
            ok = rc == 0 and 200 in statuses and all(s < 400 for s in statuses) and not errors
            results[agent] = ok
            print(f"{'ok  ' if ok else 'FAIL'} {agent:8} exit {rc}  {ROUTES[agent]} "
                  f"statuses {statuses}  {seconds:.0f} s  (log: {args.out / (agent + '.log')})")
            for line in errors[:3]:
                print("     server:", line[:200])
    finally:
        stop_server(proc)
    passed = all(results.values())
    print("PASS" if passed else "FAIL")
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
