"""Load test: start slotserve, run Locust headless against it, check the outcome, clean up.

    .venv/bin/python loadtests/run.py                    # what `make loadtest` runs: 60 s, 16 users
    .venv/bin/python loadtests/run.py --time 20 --users 8 --out /tmp/lt   # the short version

Starts `slotserve serve` (the bundled SmolLM2 unless --model; --max-slots 8, --max-queue 16) on a
free port of 127.0.0.1, waits for GET /health to answer 200, runs loadtests/locustfile.py headless
(--users users spawned at --spawn-rate per second for --time seconds), and writes into --out
(default reports/loadtest, git-ignored):

    locust_stats.csv, locust_stats_history.csv, locust_failures.csv, locust_exceptions.csv,
    locust.html, locust.log     Locust's own reports and log
    summary.json                the locustfile's exact numbers plus this script's verdict
    metrics.txt                 the server's /metrics at the end
    rss.csv                     the server's RSS, sampled every 5 s
    server.log                  the server's output

Everything it started (server and Locust, each in its own process group) is stopped on exit,
on failure and on Ctrl-C / SIGTERM.

Exit status 0 only when
- no request failed (a 429 with a Retry-After header counts as a success; one without fails),
- the p95 time to first token of interactive streams (short chats, agent turns, disconnecting
  clients) is at most --ttft-p95-ms (default 20000 ms, 2.5x the measured p95; see
  TTFT_P95_BOUND_MS),
- with --check-rss: the server's RSS at the end is within --rss-tolerance (10%) of its RSS after
  the warm-up (--warmup seconds into the run; default a third of the run, at most 60 s). RSS is
  sampled every 5 s; prefill makes it swing by 10-30% for seconds at a time, so "after warm-up"
  is the median of the samples in the window that starts at --warmup and "at the end" the
  median of the last window (windows: a sixth of the run, 10-60 s).

The 10-minute soak (not run in CI):

    .venv/bin/python loadtests/run.py --time 600 --users 16 --spawn-rate 4 --check-rss \
        --kv-budget 1GiB --out reports/soak

Finished conversations keep their KV until the budget needs the pages (the prefix cache), so
a server's memory rises to weights + KV budget and stays there: the soak gives the server a
budget its warm-up fills (--kv-budget 1GiB; the default, 30 % of RAM, takes this load ~9
minutes to fill), and what it checks is that nothing grows after that.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import psutil

HERE = Path(__file__).resolve().parent
LOCUSTFILE = HERE / "locustfile.py"
DEFAULT_OUT = HERE.parent / "reports" / "loadtest"

# Long prompts in the gated default run: ~2.1k tokens (the "2k+"). With the native CPU
# kernels a 2.1k-token prompt prefills in ~5-8 s on the 2-core CPU while other streams run,
# and the Batcher gives short prompts their share of each tick's prefill budget, so they are
# not held behind it.
DEFAULT_LONG_TOKENS = 2200
# Bound on the p95 time to first token of interactive streams (short chats, agent turns,
# disconnecting clients). Measured on the 2-core CPU machine (2026-11-30 08:2x UTC): default
# run (60 s, 16 users at 4/s, 8 slots, queue 16, ~2.1k-token long prompts) p95 8.0 s (p50
# 1.2 s); the short run (20 s, 8 users) p95 1.8 s. The bound is 2.5x the default run's p95.
TTFT_P95_BOUND_MS = 20_000.0
RSS_SAMPLE_S = 5.0


class Interrupted(Exception):
    """SIGINT (Ctrl-C) or SIGTERM."""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--time", type=float, default=60.0, help="seconds of load (default 60)")
    p.add_argument("--users", type=int, default=16, help="concurrent users (default 16)")
    p.add_argument("--spawn-rate", type=float, default=4.0,
                   help="users started per second (default 4)")
    p.add_argument("--stop-timeout", type=float, default=0.0,
                   help="seconds the users get at the end to finish the requests they are "
                   "in (default 0: those are cut off); with it every user that started a "
                   "request reports it, however slow the machine")
    p.add_argument("--max-slots", type=int, default=8)
    p.add_argument("--max-queue", type=int, default=16)
    p.add_argument("--kv-budget", default=None,
                   help="the server's --kv-budget (default: the server's own default)")
    p.add_argument("--model", default=None, help="model for the server (default: bundled)")
    p.add_argument("--port", type=int, default=0, help="server port (default: a free one)")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT,
                   help="report folder (default reports/loadtest)")
    p.add_argument("--ttft-p95-ms", type=float, default=TTFT_P95_BOUND_MS,
                   help=f"bound on interactive p95 TTFT (default {TTFT_P95_BOUND_MS:.0f})")
    p.add_argument("--long-tokens", type=int, default=DEFAULT_LONG_TOKENS,
                   help="approximate size of the long prompts in tokens (default "
                        f"{DEFAULT_LONG_TOKENS}; the locustfile alone uses 2200)")
    p.add_argument("--warmup", type=float, default=None,
                   help="seconds into the run for the reference RSS sample "
                        "(default: a third of --time, at most 60)")
    p.add_argument("--check-rss", action="store_true",
                   help="fail when the end RSS is more than --rss-tolerance above the warm-up's")
    p.add_argument("--rss-tolerance", type=float, default=0.10)
    p.add_argument("--startup-timeout", type=float, default=180.0)
    return p.parse_args(argv)


# ---- processes ----------------------------------------------------------------------------


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def start_server(args: argparse.Namespace, port: int, log: Any) -> subprocess.Popen[bytes]:
    cmd = [sys.executable, "-m", "slotserve.cli", "--log-level", "warning", "serve",
           "--host", "127.0.0.1", "--port", str(port), "--max-slots", str(args.max_slots),
           "--max-queue", str(args.max_queue)]
    if args.model:
        cmd += ["--model", args.model]
    if args.kv_budget:
        cmd += ["--kv-budget", args.kv_budget]
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def wait_healthy(url: str, proc: subprocess.Popen[bytes], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with status {proc.returncode} before it "
                               "was ready (see server.log)")
        with contextlib.suppress(OSError):
            with urllib.request.urlopen(url + "/health", timeout=2) as r:
                if r.status == 200:
                    return
        time.sleep(0.25)
    raise RuntimeError(f"the server was not healthy after {timeout:.0f} s (see server.log)")


def stop(proc: subprocess.Popen[bytes] | None, sig: int = signal.SIGINT,
         grace: float = 20.0) -> None:
    """Signal the process group, then kill it if it is still there after `grace` seconds."""
    if proc is None or proc.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, sig)
    try:
        proc.wait(grace)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)


def rss_bytes(pid: int) -> int | None:
    try:
        return psutil.Process(pid).memory_info().rss
    except psutil.Error:
        return None


def fetch_text(url: str) -> str | None:
    try:
        with urllib.request.urlopen(url, timeout=10) as r:
            return r.read().decode()
    except (OSError, urllib.error.URLError):
        return None


def metric_values(text: str | None) -> dict[str, float]:
    """Prometheus text -> {'name{labels}': value} (samples only)."""
    out: dict[str, float] = {}
    for line in (text or "").splitlines():
        if line and not line.startswith("#"):
            key, _, value = line.rpartition(" ")
            with contextlib.suppress(ValueError):
                out[key] = float(value)
    return out


def rss_windows(rows: list[tuple[float, int]], warmup: float,
                duration: float) -> tuple[int | None, int | None]:
    """Median RSS of the window starting at `warmup`, and of the last window of the run."""
    window = max(2 * RSS_SAMPLE_S, min(60.0, duration / 6))
    warm = [b for t, b in rows if warmup <= t < warmup + window]
    if not warm or not rows:
        return None, None
    last = rows[-1][0]
    end = [b for t, b in rows if t >= max(last - window, warmup)]
    return int(statistics.median(warm)), int(statistics.median(end))


def locust_failures(stats_csv: Path) -> int | None:
    """Failure count of the requests (METRIC rows excluded) in Locust's stats CSV."""
    if not stats_csv.exists():
        return None
    with stats_csv.open() as f:
        rows = list(csv.DictReader(f))
    return sum(int(r["Failure Count"]) for r in rows
               if r["Name"] != "Aggregated" and r["Type"] != "METRIC")


# ---- the run ------------------------------------------------------------------------------


def run(args: argparse.Namespace) -> int:
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    summary_path = out / "summary.json"
    summary_path.unlink(missing_ok=True)
    port = args.port or free_port()
    url = f"http://127.0.0.1:{port}"
    warmup = args.warmup if args.warmup is not None else min(60.0, args.time / 3)
    server = locust = None
    rss_rows: list[tuple[float, int]] = []
    with (out / "server.log").open("wb") as slog, (out / "locust.log").open("wb") as llog:
        try:
            t0 = time.monotonic()
            server = start_server(args, port, slog)
            wait_healthy(url, server, args.startup_timeout)
            print(f"server ready on {url} after {time.monotonic() - t0:.1f} s "
                  f"(pid {server.pid}, max-slots {args.max_slots}, max-queue {args.max_queue})")
            env = dict(os.environ, SLOTSERVE_LOADTEST_SUMMARY=str(summary_path),
                       SLOTSERVE_LOADTEST_LONG_TOKENS=str(args.long_tokens))
            prefix = out / "locust"
            cmd = [sys.executable, "-m", "locust", "-f", str(LOCUSTFILE), "--headless",
                   "--host", url, "--users", str(args.users),
                   "--spawn-rate", str(args.spawn_rate), "--run-time", f"{args.time:g}s",
                   "--csv", str(prefix), "--html", f"{prefix}.html", "--only-summary",
                   "--stop-timeout", f"{args.stop_timeout:g}"]
            print(f"locust: {args.users} users at {args.spawn_rate:g}/s for {args.time:g} s")
            started = time.monotonic()
            locust = subprocess.Popen(cmd, stdout=llog, stderr=subprocess.STDOUT, env=env,
                                      start_new_session=True)
            deadline = started + args.time + args.stop_timeout + 120
            next_sample = 0.0
            while locust.poll() is None:
                if time.monotonic() > deadline:
                    raise RuntimeError("locust did not stop on its own")
                if server.poll() is not None:
                    raise RuntimeError(f"the server died (status {server.returncode})")
                now = time.monotonic() - started
                if now >= next_sample:
                    rss = rss_bytes(server.pid)
                    if rss is not None:
                        rss_rows.append((now, rss))
                    next_sample = now + RSS_SAMPLE_S
                time.sleep(0.5)
            rss = rss_bytes(server.pid)
            if rss is not None:
                rss_rows.append((time.monotonic() - started, rss))
            warm_rss, end_rss = rss_windows(rss_rows, warmup, args.time)
            metrics = fetch_text(url + "/metrics")
            (out / "metrics.txt").write_text(metrics or "")
            return verdict(args, out, summary_path, locust.returncode, metrics, warm_rss,
                           end_rss)
        except (KeyboardInterrupt, Interrupted):
            print("interrupted: stopping the server and Locust", file=sys.stderr)
            return 130
        except RuntimeError as exc:
            print(f"load test failed: {exc}", file=sys.stderr)
            return 1
        finally:
            stop(locust, signal.SIGTERM, grace=10)
            stop(server, signal.SIGINT, grace=20)
            with (out / "rss.csv").open("w") as f:
                f.write("seconds,rss_bytes\n")
                f.writelines(f"{t:.1f},{b}\n" for t, b in rss_rows)


def verdict(args: argparse.Namespace, out: Path, summary_path: Path, locust_rc: int | None,
            metrics_text: str | None, warm_rss: int | None, end_rss: int | None) -> int:
    problems: list[str] = []
    if not summary_path.exists():
        problems.append(f"locust wrote no summary (exit status {locust_rc}; see locust.log)")
        s: dict[str, Any] = {}
    else:
        s = json.loads(summary_path.read_text())
    csv_failed = locust_failures(out / "locust_stats.csv")
    failed = max(s.get("failed", 0), csv_failed or 0)
    if failed:
        problems.append(f"{failed} request(s) failed: {s.get('failures')} (locust_failures.csv)")
    if s.get("rate_limited_without_retry_after"):
        problems.append(f"{s['rate_limited_without_retry_after']} 429(s) without Retry-After")
    ttft = s.get("ttft_ms", {})
    p95 = ttft.get("p95")
    if s and p95 is None:
        problems.append("no interactive stream produced a first token")
    elif p95 is not None and p95 > args.ttft_p95_ms:
        problems.append(f"p95 TTFT {p95:.0f} ms exceeds the bound {args.ttft_p95_ms:.0f} ms")
    growth = None
    if warm_rss and end_rss:
        growth = end_rss / warm_rss - 1
        if args.check_rss and growth > args.rss_tolerance:
            problems.append(f"server RSS grew {growth:.1%} after warm-up (more than "
                            f"{args.rss_tolerance:.0%})")
    elif args.check_rss:
        problems.append("no RSS sample after warm-up (run longer than --warmup)")
    m = metric_values(metrics_text)
    server = {
        "reused_prompt_tokens": m.get("slotserve_prompt_tokens_reused_total"),
        "prompt_tokens": m.get("slotserve_prompt_tokens_total"),
        "generated_tokens": m.get("slotserve_generation_tokens_total"),
        "cancelled": m.get('slotserve_requests_total{finish_reason="cancelled"}'),
        "rejected_queue_full": m.get('slotserve_rejections_total{reason="queue_full"}'),
    }
    result = {"passed": not problems, "problems": problems, "ttft_p95_bound_ms": args.ttft_p95_ms,
              "rss_warmup_bytes": warm_rss, "rss_end_bytes": end_rss,
              "rss_growth": None if growth is None else round(growth, 4),
              "server_metrics": server,
              "config": {"time_s": args.time, "users": args.users,
                         "spawn_rate": args.spawn_rate, "max_slots": args.max_slots,
                         "max_queue": args.max_queue, "long_tokens": args.long_tokens}}
    s["verdict"] = result
    summary_path.write_text(json.dumps(s, indent=2))
    print_summary(s, out)
    return 0 if not problems else 1


def _ms(stats: dict[str, Any], key: str) -> str:
    v = stats.get(key)
    return "-" if v is None else f"{v:.0f}"


def print_summary(s: dict[str, Any], out: Path) -> None:
    v = s["verdict"]
    ok = sum(s.get("requests", {}).values())
    print(f"requests: {ok} ok ({s.get('rate_limited', 0)} of them 429 with Retry-After), "
          f"{s.get('failed', 0)} failed, {s.get('disconnects', 0)} client disconnects; "
          f"by name: {s.get('requests', {})}")
    t, lt = s.get("ttft_ms", {}), s.get("ttft_long_ms", {})
    print(f"TTFT interactive: p50 {_ms(t, 'p50')} ms, p95 {_ms(t, 'p95')} ms "
          f"(bound {v['ttft_p95_bound_ms']:.0f}), max {_ms(t, 'max')} ms, n={t.get('count', 0)}; "
          f"long prompts {s.get('long_prompt_tokens', [])} tokens: p50 {_ms(lt, 'p50')} ms, "
          f"n={lt.get('count', 0)}")
    d = s.get("decode_tok_s", {})
    p50 = d.get("p50")
    print(f"tokens/s: aggregate {s.get('aggregate_tok_s')} over {s.get('elapsed_s')} s, "
          f"per stream p50 {'-' if p50 is None else f'{p50:.1f}'}")
    srv = v["server_metrics"]
    print(f"prefix reuse: agent follow-ups {s.get('agent_followups', 0)}, reused "
          f"{s.get('agent_reused_tokens', 0)}/{s.get('agent_prompt_tokens', 0)} prompt tokens "
          f"(ratio {s.get('agent_reuse_ratio')}); server total reused "
          f"{srv['reused_prompt_tokens']}, cancelled {srv['cancelled']}, "
          f"queue-full rejections {srv['rejected_queue_full']}")
    if v["rss_growth"] is not None:
        print(f"server RSS: {v['rss_warmup_bytes'] / 2**20:.0f} MiB after warm-up, "
              f"{v['rss_end_bytes'] / 2**20:.0f} MiB at the end ({v['rss_growth']:+.1%})")
    print(f"reports: {out}")
    print("PASS" if v["passed"] else "FAIL: " + "; ".join(v["problems"]))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)

    def on_signal(signum: int, frame: Any) -> None:
        raise Interrupted

    # explicit handlers: a shell starts background jobs with SIGINT ignored
    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
