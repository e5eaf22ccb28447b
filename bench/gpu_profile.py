"""GPU time of one decode step, kernel by kernel, under Nsight Compute.

Which kernels a decode step of N rows spends its device time in (the benchmark's step
times say how long, not where). Run on the GPU machine (bench/gpu.sh, stage `profile`):

    ncu --profile-from-start off --clock-control none --metrics gpu__time_duration.sum \\
        --csv --log-file steps.csv python bench/gpu_profile.py MODEL --rows 1,64
    python bench/gpu_profile.py --summarize steps.csv

Only the decode steps are profiled (cuProfilerStart/Stop around each); a marker kernel
named after the row count opens each step's range in the log. ncu flushes the caches
before every kernel, so each reads its weights from HBM as in a real step.
"""

from __future__ import annotations

import argparse
import csv
import ctypes
import itertools
import json
import re
import sys
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

MARKER = "slotserve_profile_rows"


def _marker(tag: str) -> None:
    """A one-thread kernel named MARKER + tag: opens the next range in ncu's log."""
    import mlx.core as mx

    kernel = mx.fast.cuda_kernel(name=f"{MARKER}{tag}", input_names=["a"],
                                 output_names=["b"], source="b[0] = a[0];")
    (b,) = kernel(inputs=[mx.zeros((1,), mx.float32)], grid=(1, 1, 1), threadgroup=(1, 1, 1),
                  output_shapes=[(1,)], output_dtypes=[mx.float32])
    mx.eval(b)


@contextmanager
def _profiled() -> Iterator[None]:
    """ncu records kernels only inside this (it runs with --profile-from-start off)."""
    import mlx.core as mx

    driver = ctypes.CDLL("libcuda.so.1")
    mx.synchronize()
    driver.cuProfilerStart()
    try:
        yield
    finally:
        mx.synchronize()
        driver.cuProfilerStop()


def profile(model_path: str, rows: list[int], ctx: int) -> None:
    import mlx.core as mx
    from gpu_bench import _kv_arrays, decode_step, prefilled_slots

    from slotserve.model.loader import load

    lm = load(model_path, device="gpu", with_tokenizer=False, probe_rows=None)
    for n in rows:
        kvs, tok = prefilled_slots(lm.model, n, ctx)
        for s in range(3):  # warm: every kernel of a step compiled and cached
            tok = decode_step(lm.model, kvs, tok, ctx + s)
            mx.eval(tok, _kv_arrays(kvs))
        with _profiled():
            _marker(str(n))
            tok = decode_step(lm.model, kvs, tok, ctx + 3)
            mx.eval(tok, _kv_arrays(kvs))


# launch shapes swept per row count: (row tiles, column tiles, ring stages); the engine's
# rule (slotserve.kernels.cuda.launch.Q4_SHAPES) was read off this sweep. An x prefetch (all
# row tiles' x loads issued together) was swept too: slower at every shape (158 registers,
# one block per SM), so it was removed.
LAUNCH_SWEEP: dict[int, list[tuple[int, int, int]]] = {
    1: [(1, 1, 8), (1, 2, 4), (1, 2, 8), (1, 2, 16), (1, 4, 2), (1, 4, 4), (1, 4, 8), (1, 8, 2),
        (1, 8, 3)],
    32: [(1, 4, 4), (1, 8, 2), (2, 2, 4), (2, 4, 2), (2, 4, 4), (2, 8, 2)],
    64: [(1, 8, 2), (2, 4, 2), (2, 8, 2), (4, 2, 4), (4, 4, 2)],
    128: [(2, 4, 2), (2, 8, 2), (4, 2, 4), (4, 4, 2), (8, 2, 2)],
}


def launches(shapes: list[tuple[int, int]], rows: list[int], *, rule_only: bool = False) -> None:
    """Each launch shape of slotserve's 4-bit kernels once per (weight shape, row count),
    behind a marker naming it: ncu's log then holds every variant's GPU time, caches
    flushed before each as in a step (launch.Q4_SHAPES is chosen from these). Each variant
    is one launch through q4.run, the kernel with a given shape (not the product API).
    rule_only: just the launch the engine makes (for ncu's detailed sections)."""
    import mlx.core as mx

    from slotserve.kernels import cuda
    from slotserve.kernels.cuda import q4
    from slotserve.kernels.cuda.launch import Q4Shape

    cases = []
    for n, k in shapes:
        w = (mx.random.normal((n, k)) * k**-0.5).astype(mx.bfloat16)
        packed = cuda.q4_pack(*mx.quantize(w, group_size=64, bits=4))
        for m in rows:
            x = mx.random.normal((m, k)).astype(mx.bfloat16)
            if rule_only:
                cases.append((f"{m}_n{n}k{k}_rule", lambda x=x, p=packed: cuda.q4_matmul(x, *p)))
                continue
            for mt, nt, stages in LAUNCH_SWEEP.get(m, []):
                if n % (8 * nt) == 0:
                    shape = Q4Shape(mt, nt, stages)
                    cases.append((f"{m}_n{n}k{k}_mt{mt}_nt{nt}_s{stages}",
                                  lambda x=x, p=packed, a=shape: q4.run(x, *p, a)))
    for _, run in cases:  # compile and warm, outside the profiled range
        mx.eval(run())
    with _profiled():
        for tag, run in cases:
            _marker(tag)
            mx.eval(run())


def prefill_attention(ctx: int, chunk: int = 1024, heads: int = 32, kv_heads: int = 8,
                      head_dim: int = 128) -> None:
    """One layer's attention for the last `chunk` rows of a ctx-token prompt (Llama-3-8B's
    heads), in the tiles and the form (launch.attention_merge) the engine would give that
    prefill step: timed here (gpu_bench._timed), checked against each row attended alone (a
    decode step's form: same_bits), and launched once behind a marker for ncu."""
    import mlx.core as mx
    from gpu_bench import _timed, long_attention_inputs

    from slotserve.kernels import cuda
    from slotserve.kernels.cuda import launch

    mx.set_default_device(mx.gpu)
    a = long_attention_inputs(ctx, chunk, kv_heads, head_dim, heads // kv_heads)
    positions = range(ctx - chunk, ctx)
    merge = launch.attention_merge(
        launch.tile_walks(a["tiles"].tolist(), positions, chunk), kv_heads)

    def run() -> mx.array:
        return cuda.paged_attention(a["q"], a["kpool"], a["vpool"], a["tables"],
                                    a["row_table"], a["row_pos"], head_dim**-0.5,
                                    tiles=a["tiles"], merge=merge)

    ms = _timed(run) * 1e3
    flops = 4 * heads * head_dim * sum(p + 1 for p in positions)
    # the bits: each row as a decode step would attend it (a tile a row: the narrow blocks)
    alone = cuda.paged_attention(a["q"], a["kpool"], a["vpool"], a["tables"], a["row_table"],
                                 a["row_pos"], head_dim**-0.5)
    print(json.dumps({"ctx": ctx, "chunk": chunk, "merge": merge, "ms": round(ms, 3),
                      "tflops": round(flops / ms / 1e9, 1),
                      "same_bits": mx.array_equal(run(), alone).item()}))
    with _profiled():
        _marker(f"attn{ctx}")
        mx.eval(run())


def decode_attention(ctx: int, heads: int = 32, kv_heads: int = 8, head_dim: int = 128,
                     pool_bytes: int = 256 << 20) -> None:
    """One layer's attention for one decode row at position ctx - 1 (Llama-3-8B's heads):
    paged_attention with the row in a tile of its own (a block per split and kv head, then
    the combine, where its keys pass one split), the walk a decode step's rope_attention
    launch makes without its RoPE and K/V write. Timed, with the K/V bytes it reads a
    second: the calls take several slots' K/V in turn, `pool_bytes` in all at least, so
    each reads its keys from HBM as a step's layers do, not from the L2 a repeated call
    would leave them in. Then the launch once more behind a marker, for ncu.

    The host's cost of a call (its two launches) is a floor under the time: 45-75 us at a
    1k context on an H100 (2026-12-07), where 4 MB of K/V take ~2 us to read. Differences
    below that are the host's; an engine A/B (gpu.sh ab) at 16k-32k decides."""
    import mlx.core as mx
    from gpu_bench import GB, _timed, kv_bytes, long_attention_inputs

    from slotserve.kernels import cuda
    from slotserve.kernels.cuda import launch

    mx.set_default_device(mx.gpu)
    nbytes = kv_bytes(ctx, kv_heads, head_dim)
    copies = [long_attention_inputs(ctx, 1, kv_heads, head_dim, heads // kv_heads)
              for _ in range(max(1, -(-pool_bytes // nbytes)))]
    turn = itertools.cycle(copies)

    def run() -> mx.array:
        a = next(turn)
        return cuda.paged_attention(a["q"], a["kpool"], a["vpool"], a["tables"],
                                    a["row_table"], a["row_pos"], head_dim**-0.5)

    s = _timed(run)
    print(json.dumps({"ctx": ctx, "splits": launch.attention_splits(ctx // 128),
                      "split_blocks": launch.SPLIT_BLOCKS, "copies": len(copies),
                      "us": round(s * 1e6, 2), "kv_gbps": round(nbytes / s / GB, 1)}))
    with _profiled():
        _marker(f"decode{ctx}")
        mx.eval(run())


def gemm_timing(rows: list[int]) -> None:
    """q4_matmul at prefill row counts (q4_gemm where launch.q4_gemm says so) on Llama-3-8B's
    projections: ms a launch (gpu_bench._timed, caches warm) and TFLOPS; at each shape's
    first row count, whether it gives q4_matmul's own launch (q4.run) bit for bit; that
    launch once more behind a marker, for ncu."""
    import mlx.core as mx
    from gpu_bench import LLAMA3_8B_LINEARS, _timed

    from slotserve.kernels import cuda
    from slotserve.kernels.cuda import launch, q4

    mx.set_default_device(mx.gpu)
    for n, k in LLAMA3_8B_LINEARS:
        if n > 65536:  # the lm_head: its prefill row is the prompt's last alone
            continue
        w = (mx.random.normal((n, k)) * k**-0.5).astype(mx.bfloat16)
        packed = cuda.q4_pack(*mx.quantize(w, group_size=64, bits=4))
        for i, m in enumerate(rows):
            x = mx.random.normal((m, k)).astype(mx.bfloat16)
            mx.eval(x, *packed)
            ms = _timed(lambda x=x, p=packed: cuda.q4_matmul(x, *p)) * 1e3
            r: dict[str, Any] = {"n": n, "k": k, "rows": m, "gemm": launch.q4_gemm(m, n),
                                 "ms": round(ms, 3), "tflops": round(2 * m * n * k / ms / 1e9, 1)}
            if i == 0:
                r["same_bits"] = mx.array_equal(cuda.q4_matmul(x, *packed), q4.run(
                    x, *packed, launch.q4_shape(m, n))).item()
            print(json.dumps(r), flush=True)
            if i == 0:
                with _profiled():
                    _marker(f"gemm{m}x{n}x{k}")
                    mx.eval(cuda.q4_matmul(x, *packed))


def _short(name: str) -> str:
    """A kernel's family: slotserve's by name, MLX's by its function name."""
    name = re.sub(r"<.*", "", name.replace("void ", "").split("(")[0])
    return name.split("::")[-1].removeprefix("custom_kernel_")


def summarize(csv_path: Path) -> dict[str, Any]:
    """{rows: {kernels, total_us, by_kernel: {name: [count, us]}}} from ncu's CSV log."""
    text = csv_path.read_text().splitlines()
    start = next((i for i, line in enumerate(text) if line.startswith('"ID"')), None)
    if start is None:
        raise ValueError(f"{csv_path}: no kernel records in ncu's log (did the profiled "
                         "command fail? its output is above)")
    steps: dict[str, dict[str, list[float]]] = {}
    current: dict[str, list[float]] | None = None
    for row in csv.DictReader(text[start:]):
        if row.get("Metric Name") != "gpu__time_duration.sum":
            continue
        marker = re.search(MARKER + r"(\w+?)\(", row["Kernel Name"] + "(")
        if marker:
            current = steps.setdefault(marker.group(1), defaultdict(lambda: [0, 0.0]))
            continue
        if current is None:
            continue
        name = _short(row["Kernel Name"])
        scale = {"ns": 1e-3, "nsecond": 1e-3, "us": 1.0, "usecond": 1.0, "ms": 1e3,
                 "msecond": 1e3}[row["Metric Unit"]]
        entry = current[name]
        entry[0] += 1
        entry[1] += float(row["Metric Value"].replace(",", "")) * scale
    out: dict[str, Any] = {}
    for rows, kernels in steps.items():
        ranked = sorted(kernels.items(), key=lambda kv: -kv[1][1])
        out[rows] = {"kernels": int(sum(c for c, _ in kernels.values())),
                     "total_us": round(sum(us for _, us in kernels.values()), 1),
                     "by_kernel": {k: [int(c), round(us, 1)] for k, (c, us) in ranked}}
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model", nargs="?")
    p.add_argument("--rows", default="1,64")
    p.add_argument("--ctx", type=int, default=128, help="prompt tokens per slot")
    p.add_argument("--summarize", type=Path, help="an ncu CSV log: print the summary")
    p.add_argument("--launches", action="store_true",
                   help="no model: every 4-bit launch shape on Llama-3-8B's weight shapes")
    p.add_argument("--rule-only", action="store_true",
                   help="with --launches: only the engine's launch, on gate+up and down")
    p.add_argument("--split-blocks", type=int,
                   help="key blocks an attention split takes (launch.SPLIT_BLOCKS) for this "
                        "profile: the split size a long row's decode runs with")
    p.add_argument("--prefill-attention", type=str, metavar="CTX[,CTX]",
                   help="no model: one layer's attention for the last 1,024 rows of a "
                        "CTX-token prompt, timed and profiled")
    p.add_argument("--decode-attention", type=str, metavar="CTX[,CTX]",
                   help="no model: one layer's attention for one decode row at a CTX-token "
                        "context, timed (K/V read from HBM), and profiled")
    p.add_argument("--gemm-timing", action="store_true",
                   help="no model: q4_matmul at --rows on Llama-3-8B's projections, timed, "
                        "and its bits against q4_matmul's own launch")
    args = p.parse_args(argv)
    if args.split_blocks:
        from slotserve.kernels.cuda import launch

        launch.SPLIT_BLOCKS = args.split_blocks
    if args.summarize:
        try:
            summary = summarize(args.summarize)
        except ValueError as exc:
            print(exc, file=sys.stderr)
            return 1
        json.dump(summary, sys.stdout, indent=1)
        print()
        return 0
    sys.path.insert(0, str(Path(__file__).parent))
    rows = [int(r) for r in args.rows.split(",")]
    if args.gemm_timing:
        gemm_timing(rows)
        return 0
    if args.prefill_attention:
        for ctx in args.prefill_attention.split(","):
            prefill_attention(int(ctx))
        return 0
    if args.decode_attention:
        for ctx in args.decode_attention.split(","):
            decode_attention(int(ctx))
        return 0
    if args.launches:
        import mlx.core as mx

        mx.set_default_device(mx.gpu)
        from gpu_bench import LLAMA3_8B_LINEARS

        shapes = list(LLAMA3_8B_LINEARS)
        if args.rule_only:
            shapes = [(n, k) for n, k in shapes if max(n, k) > 8192]
        launches(shapes, rows, rule_only=args.rule_only)
        return 0
    profile(args.model, rows, args.ctx)
    return 0


if __name__ == "__main__":
    sys.exit(main())
