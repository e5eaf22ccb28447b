"""Peer benchmark: slotserve against mlx-lm's server, same weights, same MLX, same client.

    .venv/bin/python bench/peers.py                                    # 128 tokens, N=1..16
    .venv/bin/python bench/peers.py --new-tokens 32 --streams 1,2,4,8  # a quick run

1. Installs mlx-lm==0.32.2 with mlx[cpu]==0.32.4 (the MLX slotserve uses) into .venv-peers/
   (made git-ignored by a `*` .gitignore inside it); its dependencies are light (transformers
   without torch, sentencepiece, protobuf, pyyaml, jinja2), so they install normally.
2. Exports the bundled SmolLM2 with `slotserve export` (a Hugging Face directory with float32
   weights, kept in .venv-peers/models/) and checks that mlx-lm loads it.
3. Serves it with `python -m mlx_lm.server` (OpenBLAS preloaded with LD_PRELOAD, as slotserve
   loads it before MLX, so both run MLX's CPU back end on the same BLAS) and with
   `slotserve serve --model DIR` (--max-slots = the largest N), both on 127.0.0.1, both kept
   running; each gets a warm-up request, and their greedy answers to one prompt are compared.
4. For each N, runs both engines one after the other (the order alternates from one N to the
   next): N concurrent streaming chats (httpx, asyncio), distinct prompts (the same set for both
   engines), temperature 0, --new-tokens each with EOS suppressed by `logit_bias` (both servers
   honour it; slotserve also gets `ignore_eos`), `stream_options.include_usage` for the counts.
   Aggregate tok/s = completion tokens of all N streams / wall time from the first request to
   the last [DONE]; TTFT = request sent to first content chunk, client side.
   --prefill-tokens N also times one ~N-token prompt (max_tokens 1) on each engine.
5. Writes peers.json, peers.md (side-by-side table) and peers.png into --out (default
   reports/peers, git-ignored), and prints the table.

mlx-lm's server runs its defaults (batch generation, --decode-concurrency 32,
--prompt-concurrency 8, prompt cache on); nothing is tuned for either engine.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
PEER_VENV = ROOT / ".venv-peers"
MODEL_DIR = PEER_VENV / "models" / "smollm2-f32"
MLX_LM = "mlx-lm==0.32.2"
MLX = "mlx[cpu]==0.32.4"
OPENBLAS = "/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3"
# SmolLM2's stop tokens: <|endoftext|> (0) and <|im_end|> (2); a -100 bias keeps greedy decoding
# off them, so every stream generates exactly --new-tokens tokens on both engines.
NO_EOS = {"0": -100.0, "2": -100.0}
TOPICS = ["a lighthouse keeper", "a city under the sea", "a clockmaker's apprentice",
          "the first colony on Mars", "a dragon who hoards books", "a detective in Venice",
          "a robot learning to paint", "a storm-chasing pilot", "an abandoned space station",
          "a village of glassblowers", "a time-travelling librarian", "the last dodo",
          "a cartographer of dreams", "a haunted vineyard", "a submarine crew",
          "a festival of lanterns", "a mountain rescue team", "a chess prodigy"]
STYLES = ["Write a long story about {t}.", "Describe, in great detail, a day in the life of {t}.",
          "Tell an epic tale about {t}, with many characters.",
          "Write a travel diary narrated by {t}."]


# ---- set-up ---------------------------------------------------------------------------------


def run(cmd: list[str], **kw: Any) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, check=True, text=True, **kw)


def peer_python() -> Path:
    return PEER_VENV / "bin" / "python"


def ensure_peer_venv() -> dict[str, str]:
    """Create/update .venv-peers with mlx-lm and the pinned MLX; return the versions found."""
    py = peer_python()
    if not py.exists():
        run([sys.executable, "-m", "venv", str(PEER_VENV)])
    (PEER_VENV / ".gitignore").write_text("*\n")
    probe = ("import importlib.metadata as m, json; "
             "print(json.dumps({d: m.version(d) for d in ('mlx-lm', 'mlx', 'mlx-cpu')}))")
    versions = _versions(py, probe)
    if versions.get("mlx-lm") != MLX_LM.split("==")[1] or \
            versions.get("mlx") != MLX.split("==")[1]:
        print(f"installing {MLX_LM} {MLX} into {PEER_VENV}", file=sys.stderr)
        run([str(py), "-m", "pip", "install", "-q", MLX_LM, MLX])
        versions = _versions(py, probe)
    return versions


def _versions(py: Path, probe: str) -> dict[str, str]:
    r = subprocess.run([str(py), "-c", probe], text=True, capture_output=True)
    return json.loads(r.stdout) if r.returncode == 0 else {}


def ensure_model(model_dir: Path) -> None:
    if not (model_dir / "config.json").exists():
        model_dir.parent.mkdir(parents=True, exist_ok=True)
        run([sys.executable, "-m", "slotserve.cli", "export", str(model_dir)],
            stdout=subprocess.DEVNULL)


def check_mlx_lm_loads(model_dir: Path) -> str:
    """Load the export with mlx-lm and greedily generate a few tokens (raises if it fails)."""
    code = ("import sys; from mlx_lm import load, generate; m, t = load(sys.argv[1]); "
            "p = t.apply_chat_template([{'role': 'user', 'content': 'What is the capital of "
            "France?'}], add_generation_prompt=True); "
            "print(generate(m, t, prompt=p, max_tokens=8))")
    r = run([str(peer_python()), "-c", code, str(model_dir)], capture_output=True,
            env=peer_env())
    return r.stdout.strip()


def peer_env() -> dict[str, str]:
    env = dict(os.environ)
    if os.path.exists(OPENBLAS):
        env["LD_PRELOAD"] = OPENBLAS
    return env


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, name: str, cmd: list[str], env: dict[str, str], log: Path) -> None:
        self.name, self.port = name, int(cmd[cmd.index("--port") + 1])
        self.url = f"http://127.0.0.1:{self.port}"
        self._log = log.open("wb")
        self.proc = subprocess.Popen(cmd, env=env, stdout=self._log, stderr=subprocess.STDOUT,
                                     start_new_session=True)

    def wait_ready(self, timeout: float = 300.0) -> None:
        import httpx

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode} "
                                   f"(see {self._log.name})")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            time.sleep(0.5)
        raise RuntimeError(f"{self.name} not ready after {timeout:.0f} s")

    def blas(self) -> str:
        """Which BLAS the process mapped (to confirm both run on OpenBLAS)."""
        try:
            maps = Path(f"/proc/{self.proc.pid}/maps").read_text()
        except OSError:
            return "unknown"
        return "openblas" if "openblas" in maps else "reference"

    def stop(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGINT)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        self._log.close()


# ---- the client -----------------------------------------------------------------------------


def prompts(n: int, salt: int) -> list[str]:
    return [STYLES[(i + salt) % len(STYLES)].format(t=TOPICS[(i * 7 + salt) % len(TOPICS)])
            + f" (Chapter {salt * 100 + i + 1}.)" for i in range(n)]


def body(prompt: str, new_tokens: int) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": prompt}],
            "max_tokens": new_tokens, "temperature": 0.0, "stream": True,
            "stream_options": {"include_usage": True}, "logit_bias": NO_EOS, "ignore_eos": True}


async def one_stream(client: Any, url: str, payload: dict[str, Any]) -> dict[str, Any]:
    t0 = time.perf_counter()
    first = last = None
    chunks, usage, text = 0, None, []
    async with client.stream("POST", url + "/v1/chat/completions", json=payload) as r:
        if r.status_code != 200:
            raise RuntimeError(f"{url}: HTTP {r.status_code}: {(await r.aread())[:200]!r}")
        async for line in r.aiter_lines():
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                break
            chunk = json.loads(data)
            if "error" in chunk:
                raise RuntimeError(f"{url}: {chunk['error']}")
            if chunk.get("usage"):
                usage = chunk["usage"]
            for c in chunk.get("choices", []):
                piece = (c.get("delta") or {}).get("content") or ""
                if piece:
                    now = time.perf_counter()
                    first = first or now
                    last = now
                    chunks += 1
                    text.append(piece)
    end = time.perf_counter()
    tokens = int(usage["completion_tokens"]) if usage else chunks
    return {"ttft_s": (first - t0) if first else None, "end": end, "start": t0,
            "tokens": tokens, "decode_s": (last - first) if first and last else None,
            "text": "".join(text)}


async def run_level(url: str, texts: list[str], new_tokens: int) -> dict[str, Any]:
    import httpx

    limits = httpx.Limits(max_connections=len(texts) + 4)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=limits) as client:
        t0 = time.perf_counter()
        results = await asyncio.gather(*(one_stream(client, url, body(t, new_tokens))
                                         for t in texts))
        wall = time.perf_counter() - t0
    tokens = sum(r["tokens"] for r in results)
    ttfts = sorted(r["ttft_s"] for r in results if r["ttft_s"] is not None)
    rates = [(r["tokens"] - 1) / r["decode_s"] for r in results
             if r["decode_s"] and r["tokens"] > 1]
    return {"streams": len(texts), "tokens": tokens, "wall_s": round(wall, 3),
            "aggregate_tok_s": round(tokens / wall, 2),
            "ttft_p50_s": round(pct(ttfts, 50), 3), "ttft_p95_s": round(pct(ttfts, 95), 3),
            "per_stream_tok_s_p50": round(pct(sorted(rates), 50), 2) if rates else None,
            "all_full_length": all(r["tokens"] == new_tokens for r in results)}


def pct(ordered: list[float], q: float) -> float:
    """Nearest-rank percentile of an ascending list."""
    if not ordered:
        return float("nan")
    k = max(1, -(-len(ordered) * q // 100))
    return ordered[int(k) - 1]


async def prefill_ttft(url: str, tokens: int) -> dict[str, Any]:
    """One request with a ~`tokens`-token prompt and max_tokens 1: the prefill time."""
    import httpx

    lines = [f"Note {i}: the {TOPICS[i % len(TOPICS)]} counted {i * 37 % 1000} items."
             for i in range(max(1, tokens // 16))]
    payload = {"max_tokens": 1, "temperature": 0.0,
               "messages": [{"role": "user", "content": "\n".join(lines) + "\nSummarise."}]}
    async with httpx.AsyncClient(timeout=900) as c:
        t0 = time.perf_counter()
        r = await c.post(url + "/v1/chat/completions", json=payload)
        r.raise_for_status()
        seconds = time.perf_counter() - t0
    n = int(r.json()["usage"]["prompt_tokens"])
    return {"prompt_tokens": n, "seconds": round(seconds, 2), "tok_s": round(n / seconds, 1)}


async def greedy_text(url: str, tokens: int = 16) -> str:
    import httpx

    payload = {"max_tokens": tokens, "temperature": 0.0,
               "messages": [{"role": "user", "content": "What is the capital of France?"}]}
    async with httpx.AsyncClient(timeout=120) as c:
        r = await c.post(url + "/v1/chat/completions", json=payload)
        r.raise_for_status()
        return r.json()["choices"][0]["message"]["content"]


# ---- report ---------------------------------------------------------------------------------


def table(rows: list[dict[str, Any]]) -> str:
    head = ("| N | slotserve tok/s | mlx-lm tok/s | ratio | slotserve TTFT p50 / p95 (s) "
            "| mlx-lm TTFT p50 / p95 (s) |\n|---:|---:|---:|---:|---|---|\n")
    lines = []
    for r in rows:
        s, m = r["slotserve"], r["mlx-lm"]
        lines.append(f"| {r['streams']} | {s['aggregate_tok_s']:.1f} | {m['aggregate_tok_s']:.1f}"
                     f" | {r['ratio']:.2f} | {s['ttft_p50_s']:.2f} / {s['ttft_p95_s']:.2f} "
                     f"| {m['ttft_p50_s']:.2f} / {m['ttft_p95_s']:.2f} |")
    return head + "\n".join(lines) + "\n"


def plot(rows: list[dict[str, Any]], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ns = [r["streams"] for r in rows]
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4.2))
    for name, marker, color in (("slotserve", "o", "C0"), ("mlx-lm", "s", "C1")):
        a.plot(ns, [r[name]["aggregate_tok_s"] for r in rows], marker=marker, color=color,
               label=name)
        b.plot(ns, [r[name]["ttft_p50_s"] for r in rows], marker=marker, color=color,
               label=f"{name} p50")
        b.plot(ns, [r[name]["ttft_p95_s"] for r in rows], marker=marker, color=color,
               linestyle="--", label=f"{name} p95")
    for ax, ylabel in ((a, "aggregate tokens/s"), (b, "time to first token (s)")):
        ax.set_xscale("log", base=2)
        ax.set_xticks(ns, [str(n) for n in ns])
        ax.set_xlabel("concurrent streams")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ---- main -----------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--streams", default="1,2,4,8,16", help="concurrency levels (default 1..16)")
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--out", type=Path, default=ROOT / "reports" / "peers")
    p.add_argument("--prefill-tokens", type=int, default=0,
                   help="also time one ~N-token prompt's prefill on each engine (0: skip)")
    p.add_argument("--model-dir", type=Path, default=MODEL_DIR,
                   help="exported HF directory (made with `slotserve export` if missing)")
    args = p.parse_args(argv)
    levels = [int(x) for x in args.streams.split(",") if x.strip()]
    args.out.mkdir(parents=True, exist_ok=True)

    versions = ensure_peer_venv()
    ensure_model(args.model_dir)
    loaded = check_mlx_lm_loads(args.model_dir)
    print(f"peer venv: {versions}; mlx-lm loads the export: {loaded!r}", file=sys.stderr)

    servers: dict[str, Server] = {}
    try:
        servers["mlx-lm"] = Server(
            "mlx-lm", [str(peer_python()), "-m", "mlx_lm.server", "--model",
                       str(args.model_dir), "--host", "127.0.0.1", "--port", str(free_port()),
                       "--log-level", "WARNING"], peer_env(), args.out / "mlx-lm.log")
        servers["slotserve"] = Server(
            "slotserve", [sys.executable, "-m", "slotserve.cli", "serve", "--model",
                          str(args.model_dir), "--host", "127.0.0.1", "--port",
                          str(free_port()), "--max-slots", str(max(levels)), "--max-queue",
                          "64"], dict(os.environ), args.out / "slotserve.log")
        for s in servers.values():
            s.wait_ready()
        blas = {name: s.blas() for name, s in servers.items()}
        greedy = {name: asyncio.run(greedy_text(s.url)) for name, s in servers.items()}
        for s in servers.values():  # warm-up: first batches, compilation, caches
            asyncio.run(run_level(s.url, prompts(2, 999), min(8, args.new_tokens)))
        rows = []
        for i, n in enumerate(levels):
            order = ["slotserve", "mlx-lm"] if i % 2 == 0 else ["mlx-lm", "slotserve"]
            row: dict[str, Any] = {"streams": n, "order": order}
            texts = prompts(n, salt=i)
            for name in order:
                row[name] = asyncio.run(run_level(servers[name].url, texts, args.new_tokens))
                print(f"N={n} {name}: {row[name]['aggregate_tok_s']} tok/s, TTFT p50 "
                      f"{row[name]['ttft_p50_s']} s", file=sys.stderr)
            row["ratio"] = row["slotserve"]["aggregate_tok_s"] / row["mlx-lm"]["aggregate_tok_s"]
            rows.append(row)
        prefill = {name: asyncio.run(prefill_ttft(s.url, args.prefill_tokens))
                   for name, s in servers.items()} if args.prefill_tokens > 0 else None
    finally:
        for s in servers.values():
            s.stop()

    meta = {"new_tokens": args.new_tokens, "streams": levels, "model_dir": str(args.model_dir),
            "weights": "SmolLM2-135M-Instruct, float32 (slotserve export of the bundled GGUF)",
            "versions": versions, "blas": blas, "greedy_answer": greedy,
            "greedy_match": len(set(greedy.values())) == 1, "cpu_count": os.cpu_count(),
            "prefill": prefill,
            "ratio": "slotserve aggregate tok/s / mlx-lm aggregate tok/s"}
    (args.out / "peers.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    md = (f"# slotserve vs mlx-lm {versions.get('mlx-lm')} (MLX {versions.get('mlx')} CPU, "
          f"{os.cpu_count()} cores)\n\nSmolLM2-135M-Instruct float32, {args.new_tokens} new "
          f"tokens per stream (EOS suppressed), greedy, distinct prompts, streaming chat.\n\n"
          + table(rows))
    if prefill:
        md += "\nSingle long prompt, max_tokens 1 (prefill): " + ", ".join(
            f"{name} {v['prompt_tokens']} tokens in {v['seconds']} s ({v['tok_s']} tok/s)"
            for name, v in prefill.items()) + "\n"
    (args.out / "peers.md").write_text(md)
    plot(rows, args.out / "peers.png",
         f"slotserve vs mlx-lm server, SmolLM2-135M f32, {args.new_tokens} new tokens")
    print(md)
    print(f"greedy answers match: {meta['greedy_match']} {greedy}; BLAS: {blas}")
    print(f"wrote {args.out}/peers.json, peers.md, peers.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
