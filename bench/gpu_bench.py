"""GPU benchmark of the engine on a (synthetic) checkpoint: one JSON report.

    python bench/gpu_bench.py --model /tmp/synth/llama3-8b-mlx4 --out bench.json

Sections:
- `memory`: measured copy (read+write) and read-only bandwidth of the GPU (MLX ops).
- `invariance`: the start-up probe's report, per-shape row counts whose results
  differ from the largest batch, and an engine check (each of 8 requests alone vs
  all 8 together; a continuation from a retained prefix vs the same prompt cold).
- `sweep`: N streams through the real engine (actors, batcher, sampler): aggregate
  tok/s end to end, and from steady decode steps (all N decoding) the step time,
  the model time inside it, decode tok/s = N / step, and the weight bytes read per
  model step over that time (achieved weight bandwidth).
- `runner`: the same decode steps through the model directly (no engine), split into
  graph-building time (Python) and total step time.
- `ttft`: time to first token of a 1k-token prompt (cold) through the engine.
- `cold_start` (`--cold`): the first `--cold-streams` batch right after start-up, then the
  same batch twice more (warm): wall time, TTFT, decode traces made, slowest steps, and
  cold / warm (issue 18: <= 1.5x). `--no-warm-up` starts the engine without its warm-up.
- `sampling` (`--sampling`): `slotserve bench --sampling`'s table: at each of
  `--sampling-streams`, greedy, temperature 0.7 + top_p 0.9 and temperature 0.7 + top_k 40
  on the same prompts, decode tok/s and the ratio to greedy (issue 18: >= 0.9x).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from functools import partial
from pathlib import Path
from typing import Any

import anyio

import slotserve  # noqa: F401  (OpenBLAS before MLX on Linux; harmless elsewhere)
from slotserve.engine import Engine
from slotserve.kernels import cuda
from slotserve.tools.bench import SAMPLING_CASES, prompt_ids, run_streams, sampling_table

GB = 1e9


def emit(obj: Any) -> None:
    print(json.dumps(obj), flush=True)


# ---- things that run on the engine's MLX thread --------------------------------------------


def memory_bandwidth(nbytes: int = 2**31, reps: int = 10) -> dict[str, float]:
    """Copy (read+write) and read-only bandwidth of the default device, GB/s."""
    import mlx.core as mx

    a = mx.random.uniform(shape=(nbytes // 2,)).astype(mx.bfloat16)
    mx.eval(a)
    copy_s = _timed(lambda: a + 1, reps)
    read_s = _timed(lambda: a.max(), reps)
    return {"copy_gbps_read_plus_write": round(2 * nbytes / copy_s / GB, 1),
            "read_gbps": round(nbytes / read_s / GB, 1), "buffer_gb": round(nbytes / GB, 2)}


def _weights(model: Any) -> tuple[int, int]:
    """(bytes of every Linear read in a step, bytes of all MoE expert tensors)."""
    from slotserve.model.probe import linears

    dense = 0
    for lin in linears(model):  # not the embedding: a lookup reads only the step's rows
        if lin.q is not None:
            dense += lin.q.weight.nbytes + lin.q.scales.nbytes + lin.q.biases.nbytes
        else:
            dense += lin.w.nbytes
    experts = 0
    for layer in model.layers:
        if not hasattr(layer.mlp, "route"):
            continue  # a dense MLP: its Linears are counted above
        for proj in (getattr(layer.mlp, "gate_up", None), getattr(layer.mlp, "down", None)):
            if proj is None:
                continue
            if getattr(proj, "q", None) is not None:
                experts += proj.q.weight.nbytes + proj.q.scales.nbytes + proj.q.biases.nbytes
            elif getattr(proj, "wt", None) is not None:
                experts += proj.wt.nbytes
    return dense, experts


def weight_bytes_per_step(model: Any, rows: int) -> int:
    """Weight bytes one decode step of `rows` rows reads (experts: expected distinct ones)."""
    dense, experts = _weights(model)
    cfg = model.config
    if not experts or not cfg.num_experts:
        return dense
    e, k = cfg.num_experts, cfg.experts_per_token
    touched = e * (1 - (1 - k / e) ** rows)  # uniform random routing
    return int(dense + experts * touched / e)


def linear_diagnostics(model: Any, max_rows: int = 256) -> dict[str, list[int]]:
    """Per distinct Linear shape: row counts whose rows differ from the max-row result."""
    import mlx.core as mx

    from slotserve.kernels.invariance import row_counts
    from slotserve.model.probe import linears

    seen: dict[tuple[int, ...], Any] = {}
    for lin in linears(model):
        shape = lin.q.shape if lin.q is not None else tuple(lin.w.shape)
        seen.setdefault(shape, lin)
    out: dict[str, list[int]] = {}
    for shape, lin in seen.items():
        rows = max_rows if shape[0] < 32768 else min(max_rows, 64)
        x = mx.random.normal((rows, shape[1]), key=mx.random.key(7)).astype(model.dtype)
        ref = lin(x)
        mx.eval(ref)
        out[str(list(shape))] = [m for m in row_counts(rows)
                                 if not mx.array_equal(lin(x[:m]), ref[:m]).item()]
    moe = next((layer.mlp for layer in model.layers if hasattr(layer.mlp, "route")), None)
    if moe is not None:
        x = mx.random.normal((max_rows, model.config.hidden_size),
                             key=mx.random.key(8)).astype(model.dtype)
        ref = moe(x)
        mx.eval(ref)
        out["moe_experts"] = [m for m in row_counts(max_rows)
                              if not mx.array_equal(moe(x[:m]), ref[:m]).item()]
    return out


def _kv_arrays(kvs: list[Any]) -> list[Any]:
    """The arrays a step writes: the slots' shared page pool's."""
    return kvs[0].pool.arrays()


def prefilled_slots(model: Any, n: int, ctx: int) -> tuple[list[Any], Any]:
    """n slots holding ctx random prompt tokens each, and each one's last token."""
    import mlx.core as mx

    from slotserve.model.layers import Batch

    kvs = [model.new_kv() for _ in range(n)]
    vocab = min(model.config.vocab_size, 49152)
    ids = mx.random.randint(0, vocab, (n, ctx), key=mx.random.key(n)).astype(mx.int32)
    per = max(1, 2048 // ctx)
    for i in range(0, n, per):  # prefill a few slots per step
        part = list(range(i, min(n, i + per)))
        batch = Batch.build([(kvs[j], 0, ctx) for j in part])
        model(ids[part[0] : part[-1] + 1].reshape(-1), batch, [])
        mx.eval(batch.written())
    return kvs, ids[:, -1]


def decode_step(model: Any, kvs: list[Any], tok: Any, pos: int, compiled: Any = None) -> Any:
    """One greedy decode step of every slot at position pos (lazy: nothing evaluated);
    through `compiled` (a runtime.compiled.CompiledDecode) when given."""
    import mlx.core as mx

    from slotserve.model.layers import Batch

    batch = Batch.build([(kv, pos, 1) for kv in kvs])
    rows = list(range(len(kvs)))
    logits = compiled.run(tok, batch, rows) if compiled is not None else None
    if logits is None:  # plain: no compiled runner, or a shape's first step
        logits = model(tok, batch, rows)
    return mx.argmax(logits, axis=-1).astype(mx.int32)


def runner_timing(model: Any, n: int, ctx: int, steps: int = 16,
                  compiled: Any = None) -> dict[str, float]:
    """Decode steps of n slots straight through the model: graph build vs total time.

    compiled: a runtime.compiled.CompiledDecode to run the steps through (its first step
    at each shape traces it, inside the warm-up steps)."""
    import mlx.core as mx

    kvs, tok = prefilled_slots(model, n, ctx)
    builds, totals = [], []
    for s in range(steps + 3):
        t0 = time.perf_counter()
        tok = decode_step(model, kvs, tok, ctx + s, compiled)
        t1 = time.perf_counter()
        mx.eval(tok, _kv_arrays(kvs))
        t2 = time.perf_counter()
        if s >= 3:
            builds.append(t1 - t0)
            totals.append(t2 - t0)
    # pipelined, as the engine runs on a GPU: step s+1's graph is built on the lazy tokens
    # of step s before anything waits for the device; `launch` is the host time MLX takes
    # to hand a step's graph to the device (mx.async_eval)
    piped, launches = [], []
    t_prev = time.perf_counter()
    base = ctx + steps + 3
    for s in range(steps + 3):
        nxt = decode_step(model, kvs, tok, base + s, compiled)
        t_launch = time.perf_counter()
        mx.async_eval(nxt, _kv_arrays(kvs))
        launch = time.perf_counter() - t_launch
        mx.eval(tok)  # the previous step's tokens
        tok = nxt
        now = time.perf_counter()
        if s >= 3:
            piped.append(now - t_prev)
            launches.append(launch)
        t_prev = now
    mx.eval(tok)
    for kv in kvs:  # pages back to the pool for the next run
        kv.release()
    step = statistics.median(totals)
    pstep = statistics.median(piped)
    wbytes = weight_bytes_per_step(model, n)
    return {"streams": n, "compiled": bool(compiled is not None and compiled.traced),
            "step_ms": round(step * 1000, 2),
            "graph_build_ms": round(statistics.median(builds) * 1000, 2),
            "launch_ms": round(statistics.median(launches) * 1000, 2),
            "decode_tok_s": round(n / step, 1), "weight_gbps": round(wbytes / step / GB, 1),
            "pipelined_step_ms": round(pstep * 1000, 2),
            "pipelined_tok_s": round(n / pstep, 1)}


def matmul_share(model: Any, rows: tuple[int, ...] = (1, 8, 64)) -> list[dict[str, Any]]:
    """How much of a decode step is the Linears: every packed Linear of the model once, in
    model order, in one graph (weights streamed from HBM as in a step), with slotserve's
    4-bit kernel and with MLX's; per weight shape too. Compare with runner_timing's step."""
    import mlx.core as mx

    from slotserve.model.probe import linears

    lins = [lin for lin in linears(model) if lin.q4 is not None]
    if not lins:
        return []
    out = []
    for m in rows:
        xs = {k: mx.random.normal((m, k), key=mx.random.key(k)).astype(mx.bfloat16)
              for k in {lin.q.shape[1] for lin in lins}}
        mx.eval(list(xs.values()))

        def total(fn: Any, subset: list[Any]) -> float:
            ts = []
            for _ in range(4):
                t0 = time.perf_counter()
                mx.eval([fn(lin) for lin in subset])
                ts.append(time.perf_counter() - t0)
            return statistics.median(ts[1:]) * 1000

        def ours(lin: Any, xs: dict[int, Any] = xs) -> Any:
            return cuda.q4_matmul(xs[lin.q.shape[1]], *lin.q4)

        def theirs(lin: Any, xs: dict[int, Any] = xs) -> Any:
            q = lin.q
            return mx.quantized_matmul(xs[q.shape[1]], q.weight, q.scales, q.biases,
                                       transpose=True, group_size=q.group_size, bits=q.bits)

        nbytes = sum(lin.q.weight.nbytes + lin.q.scales.nbytes + lin.q.biases.nbytes
                     for lin in lins)
        r: dict[str, Any] = {"rows": m, "linears": len(lins),
                             "kernel_ms": round(total(ours, lins), 3),
                             "mlx_ms": round(total(theirs, lins), 3)}
        r["kernel_gbps"] = round(nbytes / r["kernel_ms"] * 1000 / GB, 1)
        shapes: dict[str, list[Any]] = {}
        for lin in lins:
            shapes.setdefault(str(list(lin.q.shape)), []).append(lin)
        r["kernel_ms_by_shape"] = {k: round(total(ours, v), 3) for k, v in shapes.items()}
        out.append(r)
        emit({"matmul_share": r})
    return out


# ---- micro-benchmarks (no checkpoint): where a decode step's time goes ------------------------


def _timed(fn: Any, reps: int = 20) -> float:
    """Seconds per call: the median over 3 batches of `reps` calls evaluated together, after
    one warm-up call (which pays any JIT); batching keeps per-eval overhead out of it."""
    import mlx.core as mx

    mx.eval(fn())
    ts = []
    for _ in range(3):
        t0 = time.perf_counter()
        mx.eval([fn() for _ in range(reps)])
        ts.append((time.perf_counter() - t0) / reps)
    return statistics.median(ts)


def graph_build_us(reps: int = 200) -> dict[str, float]:
    """Host microseconds to add one op to the graph (no evaluation): a step's graph build
    time is the sum of these over its ~20 ops per layer."""
    import mlx.core as mx

    x = mx.random.normal((1, 4096)).astype(mx.bfloat16)
    w = (mx.random.normal((6144, 4096)) * 0.02).astype(mx.bfloat16)
    q, s, b = mx.quantize(w, group_size=64, bits=4)
    norm = mx.ones((4096,), mx.bfloat16)
    pool = mx.zeros((64 * 8 * 128, 128), mx.bfloat16)
    rows = mx.arange(8, dtype=mx.int32)
    kv = mx.zeros((1, 8, 128), mx.bfloat16)
    mx.eval(x, q, s, b, norm, pool)
    cases: dict[str, Any] = {
        "rms_norm": lambda: mx.fast.rms_norm(x, norm, 1e-5),
        "add": lambda: x + x,
        "quantized_matmul": lambda: mx.quantized_matmul(x, q, s, b, transpose=True,
                                                        group_size=64, bits=4),
        "scatter_write": lambda: pool.at[rows].add(kv.reshape(8, 128)),
    }
    if cuda.enabled():
        packed = cuda.q4_pack(q, s, b)
        qkv = mx.zeros((1, 6144), mx.bfloat16)
        cos = mx.ones((256, 128), mx.bfloat16)
        pos = mx.zeros((1,), mx.int32)
        tables = mx.zeros((1, 2, 8), mx.int32)
        qh = mx.zeros((1, 32, 128), mx.bfloat16)
        gate_up = mx.zeros((1, 28672), mx.bfloat16)
        mx.eval(packed, qkv, cos, pos, tables, qh, gate_up)
        cases.update({
            "q4_matmul": lambda: cuda.q4_matmul(x, *packed),
            "rope_write": lambda: cuda.rope_write(qkv, cos, cos, pos, tables[0, :1], pool, pool,
                                                  32, 8, 128),
            "paged_attention": lambda: cuda.paged_attention(qh, pool, pool, tables, pos, pos,
                                                            0.088),
            "swiglu": lambda: cuda.swiglu(gate_up),
        })
    out = {}
    for name, fn in cases.items():
        fn()
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        out[name] = round((time.perf_counter() - t0) / reps * 1e6, 2)
    emit({"graph_build_us": out})
    return out


def eval_us_per_op(ops: int = 400) -> dict[str, float]:
    """Host-and-launch microseconds per op when the GPU work is negligible: a chain of
    `ops` tiny dependent ops, built then evaluated; with graph_build_us this is what a
    step's ~400 ops cost the host however small their kernels."""
    import mlx.core as mx

    x = mx.ones((1, 256), mx.bfloat16)
    w = mx.ones((256,), mx.bfloat16)
    mx.eval(x, w)

    def chain(step: Any) -> float:
        best = float("inf")
        for _ in range(4):
            y = x
            t0 = time.perf_counter()
            for _ in range(ops):
                y = step(y)
            t1 = time.perf_counter()
            mx.eval(y)
            best = min(best, time.perf_counter() - t1 + (t1 - t0))
        return round(best / ops * 1e6, 2)

    out = {"mlx_add": chain(lambda y: y + x),
           "mlx_rms_norm": chain(lambda y: mx.fast.rms_norm(y, w, 1e-5)),
           "mlx_concat": chain(lambda y: mx.concatenate([y, y], axis=1)[:, :256])}
    if cuda.enabled():
        out["slotserve_swiglu_after_concat"] = chain(
            lambda y: cuda.swiglu(mx.concatenate([y, y], axis=1)))
        # the same one-line kernel with a short source and with 10 kB more of it (a
        # comment): MLX handles a custom kernel's whole source on every call and launch
        for label, pad in (("custom_copy_short_source", ""),
                           ("custom_copy_10kb_longer_source", "// " + "x" * 10000 + "\n")):
            kernel = mx.fast.cuda_kernel(
                name=f"slotserve_bench_copy{len(pad)}", input_names=["a"], output_names=["b"],
                source=pad + "b[threadIdx.x] = a[threadIdx.x];")
            out[label] = chain(lambda y, k=kernel: k(
                inputs=[y], grid=(256, 1, 1), threadgroup=(256, 1, 1), output_shapes=[y.shape],
                output_dtypes=[y.dtype])[0])
    emit({"eval_us_per_op": out})
    return out


# Llama-3-8B's Linear shapes [out, in]: QKV, O, gate+up, down, lm_head
LLAMA3_8B_LINEARS = ((6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336), (128256, 4096))
L2_BYTES = 50 * 2**20  # the H200's L2: weights timed must not stay resident between calls


def _copies(arrays: tuple[Any, ...], nbytes: int) -> Any:
    """A callable returning, in turn, distinct copies of `arrays` totalling > 2.5x the L2,
    so a timed matmul streams its weights from HBM as it does inside a model step."""
    import itertools

    import mlx.core as mx

    n = max(1, -(-int(2.5 * L2_BYTES) // nbytes))
    sets = [arrays] + [tuple(a + 0 for a in arrays) for _ in range(n - 1)]
    mx.eval(sets)
    it = itertools.cycle(sets)
    return lambda: next(it)


def _matmul_case(n_out: int, n_in: int, rows: tuple[int, ...]) -> list[dict[str, Any]]:
    import mlx.core as mx

    w = (mx.random.normal((n_out, n_in)) * n_in**-0.5).astype(mx.bfloat16)
    q, s, b = mx.quantize(w, group_size=64, bits=4)
    qbytes = q.nbytes + s.nbytes + b.nbytes
    next_q = _copies((q, s, b), qbytes)
    next_w = _copies((w,), w.nbytes)
    next_k = _copies(cuda.q4_pack(q, s, b), qbytes) if cuda.enabled() else None
    out = []
    for m in rows:
        x = mx.random.normal((m, n_in)).astype(mx.bfloat16)
        tq = _timed(lambda x=x: mx.quantized_matmul(x, *next_q(), transpose=True,
                                                    group_size=64, bits=4))
        tb = _timed(lambda x=x: x @ next_w()[0].T)
        r = {"shape": [m, n_in, n_out], "q4_us": round(tq * 1e6, 1),
             "q4_gbps": round(qbytes / tq / GB, 1), "bf16_us": round(tb * 1e6, 1),
             "bf16_gbps": round(w.nbytes / tb / GB, 1)}
        if next_k is not None:  # slotserve's own 4-bit kernel on the same weights
            tk = _timed(lambda x=x: cuda.q4_matmul(x, *next_k()))
            r.update(kernel_us=round(tk * 1e6, 1), kernel_gbps=round(qbytes / tk / GB, 1))
        out.append(r)
        emit({"micro_matmul": r})
    return out


def micro_matmul(rows: tuple[int, ...] = (1, 8, 64, 128)) -> list[dict[str, Any]]:
    """4-bit (group 64; MLX's kernel and slotserve's) vs bf16 matmuls of Llama-3-8B's
    shapes (QKV, O, gate+up, down, lm_head) at several row counts."""
    return [r for n_out, n_in in LLAMA3_8B_LINEARS for r in _matmul_case(n_out, n_in, rows)]


def _attention_case(n: int, span: int, kv_heads: int, head_dim: int,
                    group: int) -> dict[str, Any]:
    import mlx.core as mx

    from slotserve.kernels.attention import BLOCK, causal_bias, decode_attention

    nb = span // BLOCK
    pool_blocks = n * nb * kv_heads
    keys = mx.random.normal((pool_blocks, BLOCK, head_dim)).astype(mx.bfloat16)
    values = mx.random.normal((pool_blocks, BLOCK, head_dim)).astype(mx.bfloat16)
    blocks = mx.random.permutation(pool_blocks).reshape(n, nb, kv_heads).astype(mx.int32)
    q = mx.random.normal((n, kv_heads * group, head_dim)).astype(mx.bfloat16)
    bias = mx.concatenate([causal_bias(span - 1 - i % 7, 1, span) for i in range(n)])
    mx.eval(keys, values, blocks, q, bias)
    r: dict[str, Any] = {"slots": n, "span": span}
    t = _timed(lambda: decode_attention(q, keys, values, blocks, bias, head_dim**-0.5))
    r["gather_mm_us"] = round(t * 1e6)
    if cuda.enabled():  # slotserve's paged-attention kernel: the same rows and blocks
        pos = mx.array([span - 1 - i % 7 for i in range(n)], dtype=mx.int32)
        row_table = mx.arange(n, dtype=mx.int32)
        pool_k, pool_v = keys.reshape(-1, head_dim), values.reshape(-1, head_dim)
        t = _timed(lambda: cuda.paged_attention(q, pool_k, pool_v, blocks, row_table, pos,
                                                head_dim**-0.5))
        r["cuda_kernel_us"] = round(t * 1e6)
    emit({"micro_attention": r})
    return r


def micro_attention(slots: tuple[int, ...] = (8, 64, 128), span: int = 256, kv_heads: int = 8,
                    head_dim: int = 128, group: int = 4) -> list[dict[str, Any]]:
    """One layer's decode attention over the paged pool (Llama-3-8B heads): MLX's path
    (`block_matmul`, gather_mm straight out of the pool) and, on CUDA, slotserve's kernel."""
    return [_attention_case(n, span, kv_heads, head_dim, group) for n in slots]


def kv_bytes(span: int, kv_heads: int = 8, head_dim: int = 128) -> int:
    """The bf16 K and V bytes one layer's attention reads for a row at a span-token context."""
    return 2 * span * kv_heads * head_dim * 2


def long_attention_inputs(span: int, chunk: int = 1024, kv_heads: int = 8, head_dim: int = 128,
                          group: int = 4) -> dict[str, Any]:
    """One slot's random K/V of `span` tokens in the paged pool (Llama-3-8B heads by
    default) and the last `chunk` rows of its prompt in tiles: paged_attention's arguments
    for that prefill step (q, kpool, vpool, tables, row_table, row_pos; tiles), evaluated."""
    import mlx.core as mx

    from slotserve.kernels.cuda import launch

    nb = span // 128
    n = min(chunk, span)
    args = {
        "q": mx.random.normal((n, kv_heads * group, head_dim)).astype(mx.bfloat16),
        "kpool": mx.random.normal((nb * kv_heads * 128, head_dim)).astype(mx.bfloat16),
        "vpool": mx.random.normal((nb * kv_heads * 128, head_dim)).astype(mx.bfloat16),
        "tables": mx.random.permutation(nb * kv_heads).reshape(1, nb, kv_heads)
                    .astype(mx.int32),
        "row_table": mx.zeros((n,), mx.int32),
        "row_pos": mx.arange(span - n, span, dtype=mx.int32),
        "tiles": mx.array(launch.attention_tiles([(0, n)], n, n), dtype=mx.int32),
    }
    mx.eval(*args.values())
    return args


def micro_long_attention(spans: tuple[int, ...] = (1024, 4096, 16384, 32768),
                         split_blocks: tuple[int, ...] = (8, 4, 2, 1), chunk: int = 1024,
                         kv_heads: int = 8, head_dim: int = 128,
                         group: int = 4) -> list[dict[str, Any]]:
    """One layer's attention at long contexts (Llama-3-8B heads) through slotserve's kernel,
    for each split size: one decode row at the span's last position (what decode at 16k
    waits for) and the prefill chunk of `chunk` rows ending there, in tiles (what a long
    prompt's prefill waits for). Sets launch.SPLIT_BLOCKS for the sweep and puts it back."""

    from slotserve.kernels.cuda import launch

    out: list[dict[str, Any]] = []
    if not cuda.enabled():
        return out
    saved = launch.SPLIT_BLOCKS
    try:
        for span in spans:
            a = long_attention_inputs(span, chunk, kv_heads, head_dim, group)
            n = a["q"].shape[0]
            cases = {
                "decode": partial(cuda.paged_attention, a["q"][-1:], a["kpool"], a["vpool"],
                                  a["tables"], a["row_table"][-1:], a["row_pos"][-1:],
                                  head_dim**-0.5),
                "prefill": partial(cuda.paged_attention, a["q"], a["kpool"], a["vpool"],
                                   a["tables"], a["row_table"], a["row_pos"], head_dim**-0.5,
                                   tiles=a["tiles"]),
            }
            for sb in split_blocks:
                launch.SPLIT_BLOCKS = sb
                for case, call in cases.items():
                    t = _timed(call)
                    rows = 1 if case == "decode" else n
                    # the keys the rows attend: the chunk's triangle over the span
                    attended = rows * (span - rows) + rows * (rows + 1) // 2
                    r = {"span": span, "case": case, "rows": rows, "split_blocks": sb,
                         "us": round(t * 1e6, 1),
                         "gbps": round(kv_bytes(span, kv_heads, head_dim) / t / GB, 1),
                         "tflops": round(4 * kv_heads * group * head_dim * attended / t / 1e12,
                                         1)}
                    out.append(r)
                    emit({"micro_long_attention": r})
    finally:
        launch.SPLIT_BLOCKS = saved
    return out


def micro_sampler(rows: tuple[int, ...] = (1, 8, 64), vocab: int = 128256) -> list[dict[str, Any]]:
    """The device sampler's time per step on [N, vocab] logits (the 8B's vocabulary):
    greedy, temperature alone, top_p 0.9, top_k 40, and MLX's sort of the rows alone."""
    import mlx.core as mx

    from slotserve.runtime.sampling import RowState, SamplingParams, draft_rows

    cases = {"greedy": SamplingParams(temperature=0.0),
             "temperature": SamplingParams(temperature=0.7, seed=1),
             "top_p": SamplingParams(temperature=0.7, top_p=0.9, seed=1),
             "top_k": SamplingParams(temperature=0.7, top_k=40, seed=1)}
    out = []
    for n in rows:
        logits = (mx.random.normal((n, vocab)) * 3).astype(mx.bfloat16)
        mx.eval(logits)
        r: dict[str, Any] = {"rows": n}
        for name, params in cases.items():
            states = [RowState(params) for _ in range(n)]
            t = _timed(lambda lg=logits, ps=[params] * n, st=states: draft_rows(
                lg, ps, st, on_device=True).tokens)
            r[f"{name}_us"] = round(t * 1e6, 1)
        f = logits.astype(mx.float32)
        r["sort_us"] = round(_timed(partial(mx.sort, f, axis=-1)) * 1e6, 1)
        r["cumsum_us"] = round(_timed(partial(mx.cumsum, f, axis=-1)) * 1e6, 1)
        out.append(r)
        emit({"micro_sampler": r})
    return out


# ---- engine-level checks ---------------------------------------------------------------------


def _opts(i: int, max_tokens: int) -> dict[str, Any]:
    if i % 2:
        return {"temperature": 0.9, "top_p": 0.95, "seed": 100 + i, "max_tokens": max_tokens,
                "ignore_eos": True}
    return {"temperature": 0.0, "max_tokens": max_tokens, "ignore_eos": True}


async def engine_invariance(engine: Engine, n: int = 8, max_tokens: int = 16) -> dict[str, Any]:
    """Each request alone (cold) vs all n together; prefix reuse vs cold."""
    prompts = [prompt_ids(engine, 500 + i, 24 + 9 * i) for i in range(n)]
    solo = []
    for i in range(n):
        engine.drop_retained()
        solo.append(await engine.complete(prompts[i], **_opts(i, max_tokens)))
    engine.drop_retained()
    together: dict[int, Any] = {}

    async def one(i: int) -> None:
        await anyio.sleep(0.01 * i)
        together[i] = await engine.complete(prompts[i], **_opts(i, max_tokens))

    async with anyio.create_task_group() as tg:
        for i in range(n):
            tg.start_soon(one, i)
    batch_same = [together[i].token_ids == solo[i].token_ids for i in range(n)]
    prefix: dict[str, Any] = {}
    for i in (0, 1):  # greedy and seeded; each continues its own retained conversation
        engine.drop_retained()
        first = await engine.complete(prompts[i], **_opts(i, max_tokens))
        convo = prompts[i] + first.token_ids + prompt_ids(engine, 900 + i, 20)
        warm = await engine.complete(convo, **_opts(i, max_tokens))
        engine.drop_retained()
        cold = await engine.complete(convo, **_opts(i, max_tokens))
        prefix["greedy" if i == 0 else "seeded"] = {
            "reused_tokens": warm.usage.reused_tokens, "same": warm.token_ids == cold.token_ids}
    return {"batch_of": n, "batch_same": batch_same, "batch_invariant": all(batch_same),
            "prefix": prefix,
            "prefix_invariant": all(p["same"] and p["reused_tokens"] > 0
                                    for p in prefix.values()),
            "sample_tokens": solo[0].token_ids[:8]}


async def cold_start(engine: Engine, n: int, prompt_tokens: int,
                     new_tokens: int) -> dict[str, Any]:
    """The first n-stream batch after start-up, then the same batch (same prompts, nothing
    retained) twice more: what the first requests wait for that later ones do not."""
    assert engine.batcher is not None
    stats, compiled = engine.batcher.stats, engine.batcher.runner.compiled
    out: dict[str, Any] = {}
    for label in ("cold", "warm", "warm_again"):
        engine.drop_retained()
        traced, since = compiled.traced if compiled else 0, len(stats.recent)
        r = await run_streams(engine, n, prompt_tokens, new_tokens, offset=700)
        slowest = sorted(stats.recent[since:], key=lambda s: -s[1])[:5]
        r["steps"] = len(stats.recent) - since
        r["traced"] = compiled.traced - traced if compiled else 0
        r["slowest_steps"] = [{"rows": rows, "ms": round(sec * 1000, 1)}
                              for rows, sec, _ in slowest]
        out[label] = r
        emit({"cold_start": label, **r})
    out["cold_vs_warm"] = round(out["cold"]["wall_s"] / out["warm"]["wall_s"], 2)
    return out


async def ttft(engine: Engine, tokens: int, reps: int = 3) -> dict[str, Any]:
    ids = prompt_ids(engine, 999, tokens)[:tokens]
    times = []
    for r in range(reps + 1):
        engine.drop_retained()
        req = engine.make_request(ids, max_tokens=1, temperature=0.0, ignore_eos=True)
        t0 = time.perf_counter()
        async for d in engine.generate(req):
            if d.token_ids:
                if r:
                    times.append(time.perf_counter() - t0)
                break
    med = statistics.median(times)
    return {"prompt_tokens": tokens, "ttft_ms": round(med * 1000, 1),
            "prefill_tok_s": round(tokens / med, 1), "runs_ms": [round(t * 1000, 1) for t in times]}


# ---- main --------------------------------------------------------------------------------------


async def sweep(engine: Engine, model: Any, streams: list[int], args: argparse.Namespace,
                label: str) -> list[dict[str, Any]]:
    """N streams through the engine for each N: decode tok/s from the steady decode steps."""
    out = []
    for i, n in enumerate(streams):
        engine.drop_retained()
        r = await run_streams(engine, n, args.prompt_tokens, args.new_tokens,
                              offset=100 * (i + 1))
        if r.get("step_ms"):
            r["decode_tok_s"] = round(n * 1000 / r["step_ms"], 1)
            wb = weight_bytes_per_step(model, n)
            r["weight_gbps_model"] = round(wb / (r["model_ms"] / 1000) / GB, 1)
        out.append(r)
        emit({label: r})
    return out


async def run(args: argparse.Namespace) -> dict[str, Any]:
    import mlx.core as mx

    streams = [int(x) for x in args.streams.split(",") if x]
    sampled = [int(x) for x in args.sampling_streams.split(",") if x] if args.sampling else []
    slots = max(streams + sampled + [8, args.cold_streams if args.cold else 1])
    t0 = time.perf_counter()
    engine = Engine.load(args.model, device=args.device, max_slots=slots,
                         max_queue=4 * slots, prefill_budget=args.prefill_budget,
                         warm_up=False if args.no_warm_up else None)
    report: dict[str, Any] = {"date": time.strftime("%Y-%m-%d %H:%M:%S"),
                              "model": str(args.model), "python": platform.python_version(),
                              "mlx": mx.__version__, "args": vars(args)}
    async with engine:
        lm = engine.loaded
        assert lm is not None and engine.mlx is not None
        model = lm.model
        report["load_s"] = round(time.perf_counter() - t0, 2)
        if args.cold:  # before anything else runs a step
            report["cold_start"] = await cold_start(engine, args.cold_streams,
                                                    args.prompt_tokens, args.new_tokens)
            emit({"cold_vs_warm": report["cold_start"]["cold_vs_warm"]})
        report["device"] = lm.device
        report["family"] = lm.config.family
        dense, experts = engine.mlx.call(lambda: _weights(model))
        report["weights_gb"] = {"linear": round(dense / GB, 3), "experts": round(experts / GB, 3)}
        report["probe"] = vars(lm.invariance) if lm.invariance else None
        emit({"load": report["load_s"], "probe": report["probe"],
              "weights_gb": report["weights_gb"]})
        report["memory"] = engine.mlx.call(memory_bandwidth)
        emit({"memory": report["memory"]})
        if not args.skip_invariance:
            report["linear_rows_that_differ"] = engine.mlx.call(lambda: linear_diagnostics(model))
            emit({"linear_rows_that_differ": report["linear_rows_that_differ"]})
            report["engine_invariance"] = await engine_invariance(engine)
            emit({"engine_invariance": report["engine_invariance"]})
        # warm-up as long as a sweep point: after a 4-token warm-up the first sweep point
        # (N = 1) once stepped slower (6.4 ms) than the next (N = 8, 5.6 ms)
        await run_streams(engine, 8, args.prompt_tokens, args.new_tokens)
        if sampled:  # the sampler's shapes warmed as the greedy ones just were
            await run_streams(engine, 8, args.prompt_tokens, args.new_tokens,
                              sampling=SAMPLING_CASES["temperature 0.7, top_p 0.9"])
            report["sampling"] = await sampling_table(engine, sampled, args.prompt_tokens,
                                                      args.sampling_new_tokens)
            for r in report["sampling"]:
                emit({"sampling": r})
        report["sweep"] = await sweep(engine, model, streams, args, "sweep")
        assert engine.batcher is not None
        runner_obj = engine.batcher.runner
        report["speculated_rows"] = runner_obj.spec_rows
        report["pipelined"] = runner_obj.speculate
        if runner_obj.speculate:  # the same sweep, steps not pipelined, side by side
            runner_obj.speculate = False
            report["sweep_not_pipelined"] = await sweep(engine, model, streams, args,
                                                        "sweep_not_pipelined")
            runner_obj.speculate = True
        if runner_obj.compiled is not None:  # and not compiled (Python builds every step)
            compiled, runner_obj.compiled = runner_obj.compiled, None
            report["sweep_not_compiled"] = await sweep(engine, model, streams, args,
                                                       "sweep_not_compiled")
            runner_obj.compiled = compiled
            report["compiled_traces"] = compiled.traced
        report["ttft"] = await ttft(engine, args.ttft_tokens)
        emit({"ttft": report["ttft"]})
        runner = []
        for n in streams:  # plain and compiled forward side by side
            for compiled in [None] + ([runner_obj.compiled] if runner_obj.compiled else []):
                engine.drop_retained()
                r = engine.mlx.call(lambda n=n, c=compiled: runner_timing(
                    model, n, args.prompt_tokens, compiled=c))
                runner.append(r)
                emit({"runner": r})
        report["runner"] = runner
        report["matmul_share"] = engine.mlx.call(lambda: matmul_share(model))
        report["eval_us_per_op"] = engine.mlx.call(eval_us_per_op)
        report["peak_memory_gb"] = round(engine.mlx.call(mx.get_peak_memory) / GB, 2)
    return report


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="checkpoint (required unless --micro)")
    p.add_argument("--device", default="gpu", choices=["auto", "cpu", "gpu"])
    p.add_argument("--streams", default="1,8,32,64,128")
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--ttft-tokens", type=int, default=1024)
    p.add_argument("--prefill-budget", type=int, default=1024)
    p.add_argument("--skip-invariance", action="store_true")
    p.add_argument("--cold", action="store_true",
                   help="first: the first batch after start-up against the same batch warm")
    p.add_argument("--cold-streams", type=int, default=8)
    p.add_argument("--no-warm-up", action="store_true",
                   help="start the engine without its start-up warm-up (runtime.warmup)")
    p.add_argument("--sampling", action="store_true",
                   help="the sampled-decoding table (greedy, top_p, top_k) before the sweep; "
                        "--streams '' skips the sweep")
    p.add_argument("--sampling-streams", default="1,8,64")
    p.add_argument("--sampling-new-tokens", type=int, default=256)
    p.add_argument("--out", default=None, help="JSON report path (default: stdout only)")
    p.add_argument("--micro", action="store_true",
                   help="only the micro-benchmarks (matmul by rows, attention); no model")
    p.add_argument("--micro-parts", default="matmul,attention",
                   help="with --micro: of matmul, attention, long_attention, sampler")
    args = p.parse_args(argv)
    if args.micro:
        import mlx.core as mx

        if args.device == "gpu":
            mx.set_default_device(mx.gpu)
        parts = {"matmul": micro_matmul, "attention": micro_attention,
                 "long_attention": micro_long_attention, "sampler": micro_sampler}
        report = {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "mlx": mx.__version__,
                  "memory": memory_bandwidth(), "graph_build_us": graph_build_us()}
        for part in args.micro_parts.split(","):
            report[part] = parts[part]()
    else:
        report = anyio.run(run, args)
    text = json.dumps(report, indent=2)
    if args.out:
        Path(args.out).write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
