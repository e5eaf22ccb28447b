"""`slotserve bench`: in-process throughput and latency of the engine.

Single-stream mode (`--single`) measures load time, decode tok/s through the engine
and through a plain single-sequence loop over the same model code, prefill tok/s
on a 512-token prompt, and peak RSS. Concurrency mode drives N streams of distinct
prompts (greedy, fixed length via ignore_eos) and reports aggregate tok/s, TTFT
and inter-token latency percentiles, and the engine's own per-step overhead.
Sampling mode (`--sampling`) runs the same N streams once per sampler case of
`SAMPLING_CASES` (greedy, temperature 0.7 + top_p 0.9, temperature 0.7 + top_k 40; the
same prompts of exactly --prompt-tokens tokens for each) and reports each case's tok/s and
its ratio to greedy at that N.
Long-context mode (`--long`) runs the cases of `--contexts` (`C` is one prompt of C tokens,
`NxC` N concurrent prompts of C tokens each; default 4k, 16k, 32k), each prompt distinct
from its first tokens (no prefix reuse): TTFT, prefill tok/s, decode tok/s at that context
(from the steady decode steps) and the wall time end to end, the long-agent workloads of
issue 18 that bench/gpu_peer.py sets beside llama.cpp's.
"""

from __future__ import annotations

import argparse
import json
import platform
import resource
import statistics
import time
from pathlib import Path
from typing import Any

import anyio

from slotserve.engine import Engine

TOPICS = [
    "the history of the printing press", "how volcanoes form", "the rules of chess",
    "why the sky is blue", "the life cycle of a butterfly", "how a compiler works",
    "the water cycle", "the causes of the French revolution", "how vaccines work",
    "the structure of DNA", "how airplanes fly", "the basics of photosynthesis",
    "how the internet routes packets", "the history of jazz", "how batteries store energy",
    "the geography of Japan",
]


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    return s[min(len(s) - 1, int(round(q * (len(s) - 1))))]


def prompt_ids(engine: Engine, i: int, target: int) -> list[int]:
    """A distinct chat prompt of about `target` tokens."""
    topic = TOPICS[i % len(TOPICS)]
    text = f"Request {i}. Write a detailed essay about {topic}."
    ids = engine.render_chat([{"role": "user", "content": text}])
    filler = engine.tokenizer.encode(" Please be thorough and precise.", add_special=False)
    while len(ids) < target:
        ids = ids[:-3] + filler + ids[-3:]
    return ids


def exact_prompt_ids(engine: Engine, i: int, target: int) -> list[int]:
    """A distinct chat prompt of exactly `target` tokens (filler repeated in one go, so a
    32k-token prompt costs one list build, not thousands), for the long-context cases."""
    head = engine.render_chat([{"role": "user", "content":
                                f"Request {i}. Write a detailed essay about "
                                f"{TOPICS[i % len(TOPICS)]}."}])
    if target < len(head):
        raise ValueError(f"a prompt needs at least {len(head)} tokens here, not {target}")
    filler = engine.tokenizer.encode(" Please be thorough and precise.", add_special=False)
    body = (filler * ((target - len(head)) // len(filler) + 1))[:target - len(head)]
    return head[:-3] + body + head[-3:]


async def run_streams(engine: Engine, n: int, prompt_tokens: int, new_tokens: int,
                      offset: int = 0, sampling: dict[str, Any] | None = None,
                      exact: bool = False) -> dict[str, Any]:
    """N concurrent streams; `sampling` (temperature, top_p, top_k, seed) or greedy;
    `exact`: prompts of exactly `prompt_tokens` tokens (exact_prompt_ids)."""
    ttfts: list[float] = []
    gaps: list[float] = []
    produced = [0] * n
    make_ids = exact_prompt_ids if exact else prompt_ids
    prompts = [make_ids(engine, offset + k, prompt_tokens) for k in range(n)]

    async def one(k: int) -> None:
        opts = sampling or {"temperature": 0.0}
        req = engine.make_request(prompts[k], max_tokens=new_tokens, ignore_eos=True, **opts)
        t0 = time.perf_counter()
        last = None
        async for d in engine.generate(req):
            now = time.perf_counter()
            if d.token_ids:
                if last is None:
                    ttfts.append(now - t0)
                else:
                    gaps.append(now - last)
                last = now
                produced[k] += len(d.token_ids)

    steps_before = len(engine.batcher.stats.recent) if engine.batcher else 0
    t0 = time.perf_counter()
    async with anyio.create_task_group() as tg:
        for k in range(n):
            tg.start_soon(one, k)
    wall = time.perf_counter() - t0
    total = sum(produced)
    overhead = step_overhead(engine, steps_before, n)
    return {
        "streams": n, "prompt_tokens": sum(map(len, prompts)), "tokens": total,
        "wall_s": round(wall, 3),
        "aggregate_tok_s": round(total / wall, 2),
        "per_stream_tok_s": round(total / wall / n, 2),
        "ttft_p50_ms": round(pct(ttfts, 0.5) * 1000, 1),
        "ttft_p95_ms": round(pct(ttfts, 0.95) * 1000, 1),
        "ttft_max_ms": round(max(ttfts, default=float("nan")) * 1000, 1),
        "itl_p50_ms": round(pct(gaps, 0.5) * 1000, 1),
        "itl_p95_ms": round(pct(gaps, 0.95) * 1000, 1),
        **overhead,
    }


# `--sampling`'s cases, greedy first (the ratios' reference); seeded, so runs repeat
SAMPLING_CASES: dict[str, dict[str, Any]] = {
    "greedy": {"temperature": 0.0},
    "temperature 0.7, top_p 0.9": {"temperature": 0.7, "top_p": 0.9, "seed": 1234},
    "temperature 0.7, top_k 40": {"temperature": 0.7, "top_k": 40, "seed": 1234},
}


async def sampling_table(engine: Engine, streams: list[int], prompt_tokens: int,
                         new_tokens: int, offset: int = 0,
                         exact: bool = False) -> list[dict[str, Any]]:
    """For each N, each sampler case on the same N prompts (no prefix kept between cases):
    aggregate and steady-decode tok/s (N / step time) and both as a ratio to greedy's.
    `exact`: prompts of exactly `prompt_tokens` tokens (as llama-batched-bench's are)."""
    rows: list[dict[str, Any]] = []
    for i, n in enumerate(streams):
        greedy: dict[str, Any] | None = None
        for name, opts in SAMPLING_CASES.items():
            engine.drop_retained()
            r = {"case": name, **await run_streams(engine, n, prompt_tokens, new_tokens,
                                                   offset=offset + 100 * (i + 1),
                                                   sampling=opts, exact=exact)}
            r["decode_tok_s"] = round(n * 1000 / r["step_ms"], 1) if r["step_ms"] else None
            if greedy is None:
                greedy = r
            else:
                r["aggregate_vs_greedy"] = round(r["aggregate_tok_s"]
                                                 / greedy["aggregate_tok_s"], 3)
                if r["decode_tok_s"] and greedy["decode_tok_s"]:
                    r["decode_vs_greedy"] = round(r["decode_tok_s"] / greedy["decode_tok_s"], 3)
            rows.append(r)
    return rows


DEFAULT_CONTEXTS = "4096,16384,32768"


def parse_contexts(text: str) -> list[tuple[int, int]]:
    """`--contexts`: comma-separated `C` (one prompt of C tokens) or `NxC` (N prompts of C
    tokens at once) -> [(N, C)]."""
    cases = []
    for item in (x.strip() for x in text.split(",")):
        if not item:
            continue
        n, _, c = item.lower().rpartition("x")
        try:
            case = (int(n) if n else 1, int(c))
        except ValueError:
            raise ValueError(f"--contexts takes C or NxC items (4096, 8x16384), "
                             f"not {item!r}") from None
        if min(case) < 1:
            raise ValueError(f"--contexts: streams and tokens must be positive, not {item!r}")
        cases.append(case)
    if not cases:
        raise ValueError("--contexts is empty")
    return cases


async def long_table(engine: Engine, cases: list[tuple[int, int]], new_tokens: int,
                     sampling: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """Each (N, C) case: N distinct prompts of exactly C tokens at once, `new_tokens` each.
    prefill tok/s is the N * C prompt tokens over the slowest TTFT (the last prompt's first
    token ends the prefill of all of them); decode tok/s = N / step time over the steps
    that decoded all N rows at that context."""
    too_long = [c for _, c in cases if c + new_tokens > engine.context_length]
    if too_long:
        raise SystemExit(f"slotserve bench --long: {max(too_long)} prompt tokens + {new_tokens} "
                         f"new do not fit this model's context of {engine.context_length}")
    rows = []
    for i, (n, ctx) in enumerate(cases):
        engine.drop_retained()
        r = await run_streams(engine, n, ctx, new_tokens, offset=1000 + 100 * i,
                              sampling=sampling, exact=True)
        r = {"context": ctx, **r}
        r["prefill_tok_s"] = round(n * ctx / (r["ttft_max_ms"] / 1000), 1)
        r["decode_tok_s"] = round(n * 1000 / r["step_ms"], 1) if r["step_ms"] else None
        rows.append(r)
    return rows


def step_overhead(engine: Engine, since: int, n: int) -> dict[str, Any]:
    """Per-step time outside the model forward, over steps that decoded all n streams."""
    assert engine.batcher is not None
    recent = engine.batcher.stats.recent[since:]
    walls, models = [], []
    for (rows, model_s, start), (_, _, nxt) in zip(recent, recent[1:], strict=False):
        if rows == n:  # steady decode: one row per stream
            walls.append(nxt - start)
            models.append(model_s)
    if not walls:
        return {"step_ms": None, "model_ms": None, "overhead_pct": None}
    w, m = statistics.median(walls), statistics.median(models)
    return {"step_ms": round(w * 1000, 2), "model_ms": round(m * 1000, 2),
            "overhead_pct": round(100 * (w - m) / w, 1)}


def plain_loop(engine: Engine, ids: list[int], new_tokens: int) -> float:
    """Tokens/s of a bare single-sequence loop over the same model code (no actors)."""
    from slotserve.runtime.plain import greedy_timed

    model = engine.loaded.model  # type: ignore[union-attr]
    assert engine.mlx is not None
    return engine.mlx.call(lambda: greedy_timed(model, ids, new_tokens)[1])


async def bench_single(engine: Engine, new_tokens: int) -> dict[str, Any]:
    engine.drop_retained()
    await run_streams(engine, 1, 64, 8)  # warm-up
    n1 = await run_streams(engine, 1, 64, new_tokens)
    ids = prompt_ids(engine, 0, 64)
    plain = plain_loop(engine, ids, new_tokens)
    engine.drop_retained()
    ids512 = prompt_ids(engine, 998, 512)[:512]
    req = engine.make_request(ids512, max_tokens=1, temperature=0.0, ignore_eos=True)
    t0 = time.perf_counter()
    async for _ in engine.generate(req):
        pass
    prefill = 512 / (time.perf_counter() - t0)
    return {
        "engine_decode_tok_s": round(1000 / n1["itl_p50_ms"], 2),
        "engine_end_to_end_tok_s": n1["aggregate_tok_s"],
        "plain_loop_decode_tok_s": round(plain, 2),
        "engine_vs_plain": round((1000 / n1["itl_p50_ms"]) / plain, 3),
        "prefill_512_tok_s": round(prefill, 1),
        "ttft_ms": n1["ttft_p50_ms"],
    }


def plot(results: list[dict[str, Any]], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ns = [r["streams"] for r in results]
    fig, ax = plt.subplots(1, 2, figsize=(10, 4))
    ax[0].plot(ns, [r["aggregate_tok_s"] for r in results], "o-", label="slotserve")
    ax[0].set_xscale("log", base=2)
    ax[0].set_xlabel("concurrent streams")
    ax[0].set_ylabel("aggregate tok/s")
    ax[0].set_title("throughput")
    ax[1].plot(ns, [r["ttft_p50_ms"] for r in results], "o-", label="TTFT p50")
    ax[1].plot(ns, [r["ttft_p95_ms"] for r in results], "o--", label="TTFT p95")
    ax[1].plot(ns, [r["itl_p50_ms"] for r in results], "s-", label="ITL p50")
    ax[1].set_xscale("log", base=2)
    ax[1].set_xlabel("concurrent streams")
    ax[1].set_ylabel("ms")
    ax[1].legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main(args: argparse.Namespace) -> int:
    streams = [int(x) for x in str(args.streams).split(",") if x]
    sampling = None
    if getattr(args, "temperature", 0.0):  # sampled decoding, seeded per request
        sampling = {"temperature": args.temperature, "seed": 1234}
        if args.top_p is not None:
            sampling["top_p"] = args.top_p
        if args.top_k is not None:
            sampling["top_k"] = args.top_k
    try:
        long_cases = (parse_contexts(getattr(args, "contexts", None) or DEFAULT_CONTEXTS)
                      if getattr(args, "long", False) else [])
    except ValueError as exc:
        raise SystemExit(f"slotserve bench: {exc}") from None
    sampled = getattr(args, "sampling_cases", False)
    slots = max((streams if sampled or not long_cases else [])
                + [n for n, _ in long_cases])
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    extra: dict[str, Any] = {}
    if getattr(args, "prefill_budget", None):
        extra["prefill_budget"] = args.prefill_budget

    async def run() -> dict[str, Any]:
        t0 = time.perf_counter()
        engine = Engine.load(args.model, device=args.device, max_slots=slots,
                             max_queue=4 * slots, **extra)
        async with engine:
            load_s = time.perf_counter() - t0
            info: dict[str, Any] = {
                "date": time.strftime("%Y-%m-%d %H:%M"), "machine": platform.processor()
                or platform.machine(), "python": platform.python_version(),
                "model": str(engine.loaded.path.name),  # type: ignore[union-attr]
                "device": engine.loaded.device,  # type: ignore[union-attr]
                "load_s": round(load_s, 2),
                "sampling": sampling or {"temperature": 0.0},
                "invariance": vars(engine.loaded.invariance)  # type: ignore[union-attr]
                if engine.loaded.invariance else None,  # type: ignore[union-attr]
            }
            info["prefill_budget"] = engine.config.prefill_budget
            if args.single:
                info["single"] = await bench_single(engine, args.new_tokens)
            elif long_cases or sampled:
                # --sampling and --long compose: one load (and warm-up) for both tables
                if sampled:
                    await run_streams(engine, 1, 32, 4, sampling=SAMPLING_CASES[
                        "temperature 0.7, top_p 0.9"])  # warm-up, the sampler's too
                    info["sampling"] = await sampling_table(engine, streams,
                                                            args.prompt_tokens,
                                                            args.new_tokens, exact=True)
                    for r in info["sampling"]:
                        print(json.dumps(r), flush=True)  # noqa: T201 - progress for the user
                if long_cases:  # warm-up: two prefill chunks (a full one's shapes compiled)
                    budget = engine.config.prefill_budget
                    assert budget is not None  # (the device's default, set at load)
                    await run_streams(engine, 1, min(2 * budget, min(c for _, c in long_cases)),
                                      4, sampling=sampling, exact=True)
                    info["long"] = await long_table(engine, long_cases,
                                                    getattr(args, "long_new_tokens", None)
                                                    or args.new_tokens, sampling)
                    for r in info["long"]:
                        print(json.dumps(r), flush=True)  # noqa: T201 - progress for the user
            else:
                await run_streams(engine, 1, 32, 4)  # warm-up
                rows = []
                for i, n in enumerate(streams):
                    r = await run_streams(engine, n, args.prompt_tokens, args.new_tokens,
                                          offset=100 * (i + 1), sampling=sampling)
                    rows.append(r)
                    print(json.dumps(r), flush=True)  # noqa: T201 - progress for the user
                info["concurrency"] = rows
            info["peak_rss_mb"] = round(peak_rss_mb(), 1)
            return info

    result = anyio.run(run)
    name = ("single" if args.single else "long" if long_cases else
            "sampling" if sampled else "concurrency")
    (out / f"{name}.json").write_text(json.dumps(result, indent=2))
    if name == "concurrency":
        plot(result["concurrency"], out / f"{name}.png",
             f"slotserve {result['model']} on {result['device']}")
    print(json.dumps(result, indent=2))  # noqa: T201 - the command's output
    return 0
