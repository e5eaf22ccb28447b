"""llama.cpp (CUDA) beside slotserve on the lent GPU: the same workloads, one ratio table.

Three steps, each its own subcommand (bench/gpu.sh's `peer` stage runs them in order):

    python bench/gpu_peer.py gguf /tmp/peer/llama3-8b-q4_0.gguf --tokenizer .gputok
    python bench/gpu_peer.py llamacpp --bin /tmp/llama.cpp-build/bin \\
        --model /tmp/peer/llama3-8b-q4_0.gguf --out $OUT/peer_llamacpp.json
    python -m slotserve.cli bench --model $LLAMA --sampling --streams 1,8,64,128 \\
        --prompt-tokens 128 --new-tokens 128 --long --contexts 1024,16384,8x16384,4x32768 \\
        --out $OUT/peer_slotserve                          # slotserve's side (long.json)
    python bench/gpu_peer.py table --llamacpp $OUT/peer_llamacpp.json \\
        --slotserve $OUT/peer_slotserve/long.json --out $OUT/peer   # peer.json + peer.md

`gguf` writes a random-weight Q4_0 GGUF of a slotserve synth preset's shape (default
llama3-8b: the shape `slotserve synth llama3-8b` makes for slotserve's side), in llama.cpp's
tensor names and keys. Q4_0 is llama.cpp's plain 4-bit: blocks of 32 weights, each an f16
scale and 16 bytes of nibbles (w = d * (q - 8)); random nibble bytes with finite, small
scales are valid weights and read exactly as many bytes per step as real ones. Every linear
weight, the embedding and the output are Q4_0 (slotserve's mlx4 model is 4-bit throughout
too). The vocabulary is the tokenizer folder's (SmolLM2's BPE, 49,152 tokens) padded with
control tokens up to the preset's vocabulary size (128,256 for llama3-8b), since llama.cpp
sizes the embedding by the token list. The tensors stream to the file one by one (an 8B
file needs no more memory than its largest tensor).

`llamacpp` runs llama-batched-bench (flash attention on, every layer on the GPU, KV f16,
batch 2048 / ubatch 512: llama.cpp's defaults) on the workloads: decode with N streams at a
`--prompt-tokens` prompt, and each `--contexts` case (C: one prompt of C tokens, NxC: N of
them) with `--new-tokens` new tokens each; cases of one context share a run (its context
sized for the largest N: llama-batched-bench silently skips a case that does not fit, so
every missing case is an error here). llama-bench adds pp/tg for one sequence (tg at a
prompt's depth too) as references. `table` pairs each workload's llama.cpp number with
slotserve's (`slotserve bench --sampling --long` in one load) and divides: every ratio is
slotserve over llama.cpp in speed (for times, llama.cpp's time over slotserve's), so > 1
means slotserve is faster.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

Q4_BLOCK = 32  # weights per Q4_0 block
Q4_BYTES = 18  # bytes per block: f16 scale + 16 bytes of nibbles
DECODE_STREAMS = "1,8,64,128"
CONTEXTS = "1024,16384,8x16384,4x32768"
PROMPT_TOKENS = 128
NEW_TOKENS = 128
BATCH, UBATCH = 2048, 512


def say(msg: str) -> None:
    print(f"[gpu-peer] {msg}", flush=True)  # noqa: T201 - progress on the device log


# ---------------------------------------------------------------------------- GGUF


def parse_contexts(text: str) -> list[tuple[int, int]]:
    """`C` or `NxC` items, comma-separated -> [(N, C)], as `slotserve bench --contexts`
    reads them (tests/test_peer_gguf.py checks the two agree). Not imported from there: that
    pulls in the engine and MLX, whose CUDA context has no business in the llama.cpp runs."""
    cases = []
    for item in (x.strip().lower() for x in text.split(",") if x.strip()):
        n, _, c = item.rpartition("x")
        if not c.isdigit() or (n and not n.isdigit()) or int(c) < 1 or (n and int(n) < 1):
            raise SystemExit(f"--contexts takes C or NxC items (4096, 8x16384), not {item!r}")
        cases.append((int(n) if n else 1, int(c)))
    if not cases:
        raise SystemExit("--contexts is empty")
    return cases


def preset(name: str, layers: int | None) -> dict[str, Any]:
    """The config of a `slotserve synth` preset: the same shape on both sides."""
    from slotserve.tools.synth import preset_config

    cfg = preset_config(name, layers)
    if cfg.get("model_type") != "llama":
        raise SystemExit(f"gpu_peer writes llama GGUFs only; {name!r} is "
                         f"{cfg.get('model_type')!r} (use llama3-8b or tiny-llama)")
    return cfg


def vocabulary(tokenizer_dir: Path, size: int) -> tuple[list[str], list[int], list[str], dict]:
    """(tokens, token types, merges, special ids) of a BPE tokenizer.json, padded with
    control tokens to `size` entries."""
    import gguf

    tj = json.loads((tokenizer_dir / "tokenizer.json").read_text())
    model = tj["model"]
    if model.get("type") != "BPE":
        raise SystemExit(f"{tokenizer_dir}/tokenizer.json is {model.get('type')}, not BPE")
    by_id = {i: t for t, i in model["vocab"].items()}
    special = {}
    for a in tj.get("added_tokens", []):
        by_id[a["id"]] = a["content"]
        if a.get("special"):
            special[a["content"]] = a["id"]
    n = max(by_id) + 1
    if n > size:
        raise SystemExit(f"the tokenizer has {n} tokens, more than the model's {size}")
    normal, control = int(gguf.TokenType.NORMAL), int(gguf.TokenType.CONTROL)
    tokens = [by_id.get(i, f"<|reserved_{i}|>") for i in range(n)]
    types = [control if t in special or i not in by_id else normal
             for i, t in enumerate(tokens)]
    tokens += [f"<|reserved_{i}|>" for i in range(n, size)]
    types += [control] * (size - n)
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]
    cfg_path = tokenizer_dir / "tokenizer_config.json"
    tcfg = json.loads(cfg_path.read_text()) if cfg_path.exists() else {}

    def tid(key: str, default: str) -> int:
        val = tcfg.get(key) or default
        val = val.get("content", default) if isinstance(val, dict) else val
        return model["vocab"].get(val, special.get(val, 0))

    ids = {"bos": tid("bos_token", "<|endoftext|>"), "eos": tid("eos_token", "<|endoftext|>")}
    return tokens, types, merges, ids


def llama_tensors(cfg: dict[str, Any]) -> Iterator[tuple[str, tuple[int, int] | tuple[int]]]:
    """(llama.cpp tensor name, (rows, cols) or (n,)) in file order; rows = outputs."""
    h, v, ff = cfg["hidden_size"], cfg["vocab_size"], cfg["intermediate_size"]
    heads, kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    d = cfg.get("head_dim") or h // heads
    yield "token_embd.weight", (v, h)
    for i in range(cfg["num_hidden_layers"]):
        p = f"blk.{i}"
        yield f"{p}.attn_norm.weight", (h,)
        yield f"{p}.attn_q.weight", (heads * d, h)
        yield f"{p}.attn_k.weight", (kv * d, h)
        yield f"{p}.attn_v.weight", (kv * d, h)
        yield f"{p}.attn_output.weight", (h, heads * d)
        yield f"{p}.ffn_norm.weight", (h,)
        yield f"{p}.ffn_gate.weight", (ff, h)
        yield f"{p}.ffn_up.weight", (ff, h)
        yield f"{p}.ffn_down.weight", (h, ff)
    yield "output_norm.weight", (h,)
    yield "output.weight", (v, h)


def random_q4_0(rng: np.random.Generator, rows: int, cols: int) -> np.ndarray:
    """A (rows, cols) Q4_0 weight as llama.cpp stores it: uint8 (rows, cols / 32 * 18).
    Nibbles are random bytes; the f16 scales are finite, about 1 / (4.6 sqrt(cols)) (the
    nibbles' spread is 4.6), so a layer roughly keeps its input's scale."""
    if cols % Q4_BLOCK:
        raise ValueError(f"Q4_0 needs rows of a multiple of {Q4_BLOCK} weights, not {cols}")
    blocks = rows * cols // Q4_BLOCK
    n = blocks * Q4_BYTES  # the generator's raw 64-bit words: ~10x faster than integers()
    raw = rng.bit_generator.random_raw(-(-n // 8)).view(np.uint8)
    out = raw[:n].reshape(blocks, Q4_BYTES)
    d = 1.0 / (4.6 * np.sqrt(cols))
    scales = (d * (0.75 + 0.5 * rng.random(blocks, dtype=np.float32))).astype(np.float16)
    out[:, :2] = scales.view(np.uint8).reshape(blocks, 2)
    return out.reshape(rows, cols // Q4_BLOCK * Q4_BYTES)


def write_gguf(path: Path, cfg: dict[str, Any], tokenizer_dir: Path, seed: int = 0) -> dict:
    """Write the random Q4_0 GGUF of `cfg`'s shape; returns what was written."""
    try:
        import gguf
    except ImportError as exc:
        raise SystemExit(f"the `gguf` package (0.19) is needed to write the GGUF: {exc}") from exc

    t0 = time.perf_counter()
    rng = np.random.default_rng(seed)
    q4 = gguf.GGMLQuantizationType.Q4_0
    h, heads = cfg["hidden_size"], cfg["num_attention_heads"]
    d = cfg.get("head_dim") or h // heads
    tokens, types, merges, ids = vocabulary(tokenizer_dir, cfg["vocab_size"])
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    w = gguf.GGUFWriter(str(tmp), "llama")
    w.add_name(f"random {cfg['hidden_size']}x{cfg['num_hidden_layers']} llama (slotserve)")
    w.add_file_type(int(gguf.LlamaFileType.MOSTLY_Q4_0))
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(h)
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_key_length(d)
    w.add_value_length(d)
    w.add_rope_dimension_count(d)
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_rope_freq_base(cfg["rope_theta"])
    w.add_vocab_size(cfg["vocab_size"])
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")  # SmolLM2's pre-tokenizer, as convert_hf_to_gguf names it
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(ids["bos"])
    w.add_eos_token_id(ids["eos"])
    w.add_add_bos_token(False)
    shapes = list(llama_tensors(cfg))
    for name, shape in shapes:
        if len(shape) == 1:
            w.add_tensor_info(name, shape, np.dtype(np.float32), shape[0] * 4)
        else:
            rows, cols = shape
            nbytes = rows * cols // Q4_BLOCK * Q4_BYTES
            w.add_tensor_info(name, (rows, cols // Q4_BLOCK * Q4_BYTES), np.dtype(np.uint8),
                              nbytes, raw_dtype=q4)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for _, shape in shapes:
        if len(shape) == 1:
            w.write_tensor_data(np.ones(shape, dtype=np.float32))
        else:
            w.write_tensor_data(random_q4_0(rng, *shape))
    w.close()
    tmp.rename(path)
    info = {"path": str(path), "bytes": path.stat().st_size, "tensors": len(shapes),
            "vocab": len(tokens), "tokenizer_tokens": sum(t == 1 for t in types),
            "layers": cfg["num_hidden_layers"], "seconds": round(time.perf_counter() - t0, 1)}
    say(f"wrote {path}: {info['bytes'] / 2**30:.2f} GiB, {info['tensors']} tensors, "
        f"vocab {info['vocab']}, in {info['seconds']} s")
    return info


# ---------------------------------------------------------------------------- llama.cpp


def run_tool(cmd: list[str], timeout: float) -> tuple[str, float]:
    """Run a llama.cpp tool; its stdout (the results), raising with its log's tail on failure."""
    say("$ " + " ".join(cmd))
    t0 = time.perf_counter()
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False)
    except subprocess.TimeoutExpired as exc:
        raise RuntimeError(f"timed out after {timeout:.0f} s: {' '.join(cmd)}") from exc
    if r.returncode:
        tail = "\n".join((r.stdout + r.stderr).splitlines()[-25:])
        raise RuntimeError(f"exit {r.returncode}: {' '.join(cmd)}\n{tail}")
    return r.stdout, time.perf_counter() - t0


def batched_bench(exe: Path, model: Path, prompt: int, new: int, streams: list[int],
                  timeout: float, extra: list[str]) -> list[dict[str, Any]]:
    """llama-batched-bench at one prompt length for each N: its jsonl rows (pp, tg, pl,
    t_pp, speed_pp, t_tg, speed_tg, t, speed). The context fits the largest N exactly."""
    ctx = max(streams) * (prompt + new)
    cmd = [str(exe), "-m", str(model), "-ngl", "999", "-fa", "on", "-c", str(ctx),
           "-b", str(BATCH), "-ub", str(UBATCH), "-npp", str(prompt), "-ntg", str(new),
           "-npl", ",".join(map(str, streams)), "--output-format", "jsonl", *extra]
    out, took = run_tool(cmd, timeout)
    rows = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    got = sorted(r["pl"] for r in rows)
    if got != sorted(streams):
        raise RuntimeError(f"llama-batched-bench ran N = {got}, asked for {streams} "
                           f"(context {ctx}): see its output above")
    for r in rows:
        r["command"], r["run_s"] = " ".join(cmd), round(took, 1)
    return rows


def llama_bench(exe: Path, model: Path, args: list[str], timeout: float) -> list[dict[str, Any]]:
    """llama-bench -o json: one row per test (n_prompt, n_gen, n_depth, avg_ts, stddev_ts)."""
    cmd = [str(exe), "-m", str(model), "-ngl", "999", "-fa", "1", "-o", "json", *args]
    out, _ = run_tool(cmd, timeout)
    start = out.find("[")
    rows = json.loads(out[start:]) if start >= 0 else []
    keep = ("n_prompt", "n_gen", "n_depth", "avg_ts", "stddev_ts", "n_batch", "n_ubatch",
            "gpu_info", "backends", "build_number", "model_size", "model_n_params")
    return [{k: r.get(k) for k in keep} | {"command": " ".join(cmd)} for r in rows]


def run_llamacpp(args: argparse.Namespace) -> dict[str, Any]:
    bindir = Path(args.bin)
    bb, lb = bindir / "llama-batched-bench", bindir / "llama-bench"
    for exe in (bb, lb):
        if not exe.exists():
            raise SystemExit(f"{exe} is missing: build llama.cpp first (bench/gpu.sh peer_build)")
    model = Path(args.model)
    streams = [int(x) for x in args.decode_streams.split(",") if x]
    cases = parse_contexts(args.contexts)
    extra = args.extra.split() if args.extra else []
    report: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S"), "host": platform.node(),
        "model": str(model), "prompt_tokens": args.prompt_tokens,
        "new_tokens": args.new_tokens, "batch": BATCH, "ubatch": UBATCH,
        "flash_attn": True, "errors": []}

    def attempt(label: str, fn: Any) -> Any:
        try:
            return fn()
        except RuntimeError as exc:  # one failed workload does not stop the others
            say(f"{label} FAILED: {exc}")
            report["errors"].append(f"{label}: {exc}")
            return []

    report["decode"] = attempt("decode", lambda: batched_bench(
        bb, model, args.prompt_tokens, args.new_tokens, streams, args.timeout, extra))
    by_ctx: dict[int, list[int]] = {}
    for n, c in cases:
        by_ctx.setdefault(c, []).append(n)
    report["long"] = []
    for c, ns in by_ctx.items():
        report["long"] += attempt(f"context {c}", lambda c=c, ns=ns: batched_bench(
            bb, model, c, args.new_tokens, sorted(set(ns)), args.timeout, extra))
    ones = sorted(c for n, c in cases if n == 1)
    tests = ["-p", str(ones[0] if ones else args.prompt_tokens), "-n", str(args.new_tokens),
             "-r", str(args.reps)]
    report["llama_bench"] = attempt("llama-bench", lambda: llama_bench(
        lb, model, tests, args.timeout))
    if len(ones) > 1:  # decode one sequence at the depth of the longest single prompt
        report["llama_bench"] += attempt("llama-bench depth", lambda: llama_bench(
            lb, model, ["-p", "0", "-n", str(args.new_tokens), "-d", str(ones[-1]),
                        "-r", str(args.reps)], args.timeout))
    for r in report["decode"] + report["long"]:
        say(f"pp {r['pp']} tg {r['tg']} N {r['pl']}: PP {r['speed_pp']:.0f} t/s "
            f"({r['t_pp']:.2f} s), TG {r['speed_tg']:.1f} t/s, total {r['t']:.2f} s")
    for r in report["llama_bench"]:
        say(f"llama-bench pp {r['n_prompt']} tg {r['n_gen']} depth {r['n_depth']}: "
            f"{r['avg_ts']:.1f} t/s")
    return report


# ---------------------------------------------------------------------------- table


def _sampled(ours: dict[str, Any]) -> list[dict[str, Any]]:
    """slotserve bench's sampler table; without --sampling its "sampling" is the one sampler
    setting the run used (a dict), not a table."""
    rows = ours.get("sampling")
    return rows if isinstance(rows, list) else []


def _ratio(ours: float | None, theirs: float | None, times: bool = False) -> float | None:
    if not ours or not theirs:
        return None
    return round(theirs / ours if times else ours / theirs, 2)


def ratio_rows(peer: dict[str, Any], ours: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per workload: llama.cpp's number, slotserve's, ratio (> 1: slotserve faster)."""
    rows: list[dict[str, Any]] = []
    decode = {r["pl"]: r for r in peer.get("decode", [])}
    greedy = {r["streams"]: r for r in _sampled(ours) if r["case"] == "greedy"}
    for n in sorted(set(decode) | set(greedy)):
        theirs = decode.get(n, {}).get("speed_tg")
        mine = greedy.get(n, {}).get("decode_tok_s")
        pp = decode.get(n, {}).get("pp") or peer.get("prompt_tokens")
        rows.append({"workload": f"decode, N={n}, {pp}-token prompt (t/s)", "unit": "t/s",
                     "llama_cpp": theirs, "slotserve": mine, "ratio": _ratio(mine, theirs)})
    long_peer = {(r["pl"], r["pp"]): r for r in peer.get("long", [])}
    long_ours = {(r["streams"], r["context"]): r for r in ours.get("long", [])}
    for n, c in sorted(set(long_peer) | set(long_ours), key=lambda k: (k[0] > 1, k[1], k[0])):
        p, o = long_peer.get((n, c), {}), long_ours.get((n, c), {})
        if n == 1:
            mine_pp = o.get("prefill_tok_s")
            rows.append({"workload": f"one {c:,}-token prompt: prefill (t/s)", "unit": "t/s",
                         "llama_cpp": p.get("speed_pp"), "slotserve": mine_pp,
                         "ratio": _ratio(mine_pp, p.get("speed_pp")),
                         "llama_cpp_s": p.get("t_pp"),
                         "slotserve_ttft_s": round(o["ttft_max_ms"] / 1000, 3) if o else None})
            rows.append({"workload": f"one {c:,}-token prompt: decode at that context (t/s)",
                         "unit": "t/s", "llama_cpp": p.get("speed_tg"),
                         "slotserve": o.get("decode_tok_s"),
                         "ratio": _ratio(o.get("decode_tok_s"), p.get("speed_tg"))})
        else:
            tg = p.get("tg") or o.get("tokens", 0) // max(n, 1)
            rows.append({"workload": f"{n} x {c:,}-token prompts + {tg} new each, end to end (s)",
                         "unit": "s", "llama_cpp": p.get("t"), "slotserve": o.get("wall_s"),
                         "ratio": _ratio(o.get("wall_s"), p.get("t"), times=True),
                         "slotserve_ttft_p50_s": round(o["ttft_p50_ms"] / 1000, 2) if o else None,
                         "slotserve_ttft_max_s": round(o["ttft_max_ms"] / 1000, 2) if o else None})
    return rows


def sampling_rows(peer: dict[str, Any], ours: dict[str, Any]) -> list[dict[str, Any]]:
    """Per N: slotserve's decode tok/s per sampler case, each case's ratio to greedy, and
    top_p's ratio to llama.cpp's decode (llama-batched-bench samples nothing: its TG is the
    no-sampler reference)."""
    decode = {r["pl"]: r.get("speed_tg") for r in peer.get("decode", [])}
    by_n: dict[int, dict[str, Any]] = {}
    for r in _sampled(ours):
        row = by_n.setdefault(r["streams"], {"streams": r["streams"],
                                             "llama_cpp_greedy": decode.get(r["streams"])})
        row[r["case"]] = r.get("decode_tok_s")
        if "decode_vs_greedy" in r:
            row[f"{r['case']} vs greedy"] = r["decode_vs_greedy"]
    for row in by_n.values():
        row["top_p vs llama.cpp"] = _ratio(row.get("temperature 0.7, top_p 0.9"),
                                           row["llama_cpp_greedy"])
    return [by_n[n] for n in sorted(by_n)]


def _fmt(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:,.2f}" if abs(v) < 100 else f"{v:,.0f}"
    return f"{v:,}" if isinstance(v, int) else str(v)


def markdown(rows: list[dict[str, Any]], sampled: list[dict[str, Any]],
             peer: dict[str, Any], ours: dict[str, Any]) -> str:
    gpu = next((r.get("gpu_info") for r in peer.get("llama_bench", []) if r.get("gpu_info")),
               None)
    lines = [f"llama.cpp b{os.environ.get('LLAMA_VERSION', '11434')} CUDA "
             f"({gpu or 'GPU'}; Q4_0, flash attention, batch {peer.get('batch')} / ubatch "
             f"{peer.get('ubatch')}) against slotserve ({ours.get('model')}, "
             f"{ours.get('device')}, prefill budget {ours.get('prefill_budget')}); ratio = "
             "slotserve / llama.cpp in speed (llama.cpp / slotserve in time): > 1 is "
             "slotserve faster.", "",
             "| workload | llama.cpp CUDA | slotserve | ratio |", "|---|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['workload']} | {_fmt(r['llama_cpp'])} | {_fmt(r['slotserve'])} "
                     f"| {_fmt(r['ratio'])} |")
    refs = peer.get("llama_bench", [])
    if refs:
        lines += ["", "llama-bench (one sequence): " + "; ".join(
            f"{'pp' if r['n_prompt'] else 'tg'}{r['n_prompt'] or r['n_gen']}"
            f"{'@d' + str(r['n_depth']) if r.get('n_depth') else ''} "
            f"{r['avg_ts']:,.1f} t/s" for r in refs)]
    if sampled:
        cases = [k for k in sampled[0] if k.startswith("temperature") and "vs" not in k]
        head = ["N", "llama.cpp (no sampler)", "slotserve greedy"]
        for c in cases:
            head += [f"slotserve {c}", "vs greedy"]
        head.append("top_p vs llama.cpp")
        lines += ["", "Decode tok/s by sampler (slotserve, seeded), beside llama.cpp's "
                  "decode (llama-batched-bench samples nothing):", "",
                  "| " + " | ".join(head) + " |", "|" + "---:|" * len(head)]
        for r in sampled:
            cells = [r["streams"], r["llama_cpp_greedy"], r.get("greedy")]
            for c in cases:
                cells += [r.get(c), r.get(f"{c} vs greedy")]
            cells.append(r.get("top_p vs llama.cpp"))
            lines.append("| " + " | ".join(_fmt(c) for c in cells) + " |")
    if peer.get("errors"):
        lines += ["", "llama.cpp runs that failed: " + "; ".join(
            e.splitlines()[0] for e in peer["errors"])]
    return "\n".join(lines) + "\n"


def make_table(args: argparse.Namespace) -> dict[str, Any]:
    peer = json.loads(Path(args.llamacpp).read_text())
    ours = json.loads(Path(args.slotserve).read_text())
    rows, sampled = ratio_rows(peer, ours), sampling_rows(peer, ours)
    report = {"rows": rows, "sampling": sampled, "llamacpp": peer, "slotserve": ours}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(report, indent=2))
    text = markdown(rows, sampled, peer, ours)
    out.with_suffix(".md").write_text(text)
    print(text)  # noqa: T201 - the table, into the device log
    return report


# ---------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True)
    g = sub.add_parser("gguf", help="write the random Q4_0 GGUF of a synth preset's shape")
    g.add_argument("path", type=Path)
    g.add_argument("--preset", default="llama3-8b", help="llama3-8b or tiny-llama")
    g.add_argument("--layers", type=int, default=None, help="fewer layers than the preset")
    g.add_argument("--vocab", type=int, default=None,
                   help="another vocabulary size than the preset's (padded with control tokens)")
    g.add_argument("--tokenizer", type=Path,
                   default=Path(os.environ.get("SLOTSERVE_TOKENIZER_DIR", ".gputok")),
                   help="folder with tokenizer.json (+ tokenizer_config.json)")
    g.add_argument("--seed", type=int, default=0)
    r = sub.add_parser("llamacpp", help="llama-batched-bench + llama-bench on the workloads")
    r.add_argument("--bin", required=True, help="llama.cpp's build/bin")
    r.add_argument("--model", required=True)
    r.add_argument("--decode-streams", default=DECODE_STREAMS)
    r.add_argument("--prompt-tokens", type=int, default=PROMPT_TOKENS)
    r.add_argument("--new-tokens", type=int, default=NEW_TOKENS)
    r.add_argument("--contexts", default=CONTEXTS, help="C or NxC, comma-separated")
    r.add_argument("--reps", type=int, default=3, help="llama-bench repetitions")
    r.add_argument("--timeout", type=float, default=240, help="seconds per llama.cpp run")
    r.add_argument("--extra", default="", help="more flags for llama-batched-bench")
    r.add_argument("--out", required=True)
    t = sub.add_parser("table", help="the ratio table of the two sides' JSON")
    t.add_argument("--llamacpp", required=True)
    t.add_argument("--slotserve", required=True, help="slotserve bench --sampling --long JSON")
    t.add_argument("--out", required=True, help="path stem: writes .json and .md")
    args = p.parse_args(argv)
    if args.command == "gguf":
        if not args.tokenizer.is_dir():
            raise SystemExit(f"no tokenizer folder at {args.tokenizer} (carry .gputok/)")
        cfg = preset(args.preset, args.layers)
        if args.vocab:
            cfg["vocab_size"] = args.vocab
        write_gguf(args.path, cfg, args.tokenizer, args.seed)
    elif args.command == "llamacpp":
        report = run_llamacpp(args)
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(report, indent=2))
        return 1 if not (report["decode"] or report["long"]) else 0
    else:
        make_table(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
