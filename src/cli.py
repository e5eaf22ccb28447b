"""`slotserve` command line: generate, serve, bench, export."""

from __future__ import annotations

import argparse
import sys
from typing import Any

import slotserve  # noqa: F401  (loads OpenBLAS before MLX)
from slotserve.logs import configure_logging


def _progress(done: int, total: int) -> None:
    width = 30
    fill = width * done // max(total, 1)
    sys.stderr.write(f"\rloading model [{'#' * fill}{'.' * (width - fill)}] {done}/{total}")
    if done >= total:
        sys.stderr.write("\n")
    sys.stderr.flush()


def cmd_generate(args: argparse.Namespace) -> int:
    import anyio

    from slotserve.engine import Engine

    async def main() -> int:
        # one request, nothing batched beside it: the batch-invariance probe cannot matter
        engine = Engine.load(args.model, max_slots=1, device=args.device,
                             allow_batch_variance=True)
        engine.progress = _progress if sys.stderr.isatty() else None
        async with engine:
            opts: dict[str, Any] = {"max_tokens": args.max_tokens,
                                    "temperature": args.temperature}
            if args.seed is not None:
                opts["seed"] = args.seed
            if args.raw:
                ids = engine.tokenizer.encode(args.prompt)
                stream = engine.generate(engine.make_request(ids, **opts))
            else:
                messages = [{"role": "user", "content": args.prompt}]
                if args.system:
                    messages.insert(0, {"role": "system", "content": args.system})
                stream = engine.chat(messages, **opts)
            async for delta in stream:
                sys.stdout.write(delta.text)
                sys.stdout.flush()
                if delta.finish_reason is not None:
                    sys.stdout.write("\n")
                    if delta.error:
                        sys.stderr.write(f"error: {delta.error}\n")
                        return 1
        return 0

    return anyio.run(main)


def cmd_serve(args: argparse.Namespace) -> int:
    from slotserve.api.server import main as serve_main

    ranks = getattr(args, "tensor_parallel", 1)
    if ranks > 1:
        from slotserve.model import parallel

        if parallel.rank_from_env() > 0:  # a rank the launcher started: no HTTP here
            return parallel.worker_main(args.model, args.device, ranks)
        # started alone: this process is rank 0 and starts the others (under mlx.launch,
        # the launcher started them)
        argv = getattr(args, "argv", None)
        workers = ([] if parallel.launched_size() > 1
                   else parallel.launch(ranks, args.device,
                                        sys.argv[1:] if argv is None else argv))
        try:
            return serve_main(args)
        finally:
            parallel.reap(workers)
    return serve_main(args)


def cmd_route(args: argparse.Namespace) -> int:
    from slotserve.router.server import main as route_main

    return route_main(args)


def cmd_bench(args: argparse.Namespace) -> int:
    from slotserve.tools.bench import main as bench_main

    return bench_main(args)


def cmd_synth(args: argparse.Namespace) -> int:
    from slotserve.tools.synth import main as synth_main

    return synth_main(args)


def cmd_export(args: argparse.Namespace) -> int:
    from slotserve.tools.export import main as export_main

    return export_main(args)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="slotserve", description=__doc__)
    p.add_argument("--log-format", choices=["console", "json"], default="console")
    p.add_argument("--log-level", default=None,
                   help="default: info for serve (one access-log line per request), "
                        "warning for the other commands")
    sub = p.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="stream a completion to stdout")
    g.add_argument("prompt")
    g.add_argument("--model", default=None, help="GGUF file or HF directory (default: SmolLM2)")
    g.add_argument("--device", default="auto", choices=["auto", "cpu", "gpu"])
    g.add_argument("--raw", action="store_true",
                   help="plain completion of the prompt; by default the model's chat template "
                        "wraps it as a user turn")
    g.add_argument("--system", default=None,
                   help="system prompt for the chat turn (ignored with --raw)")
    g.add_argument("--max-tokens", type=int, default=256)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--seed", type=int, default=None)
    g.set_defaults(fn=cmd_generate)

    s = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
    s.add_argument("--model", default=None)
    s.add_argument("--device", default="auto", choices=["auto", "cpu", "gpu"])
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--max-slots", type=int, default=8)
    s.add_argument("--max-queue", type=int, default=64)
    s.add_argument("--queue-timeout", type=float, default=None, metavar="SECONDS",
                   help="answer a request still waiting for a slot after this long with 429 "
                        "and Retry-After (default 600; 0 waits without bound)")
    s.add_argument("--strict-model-names", action="store_true",
                   help="answer 404 to a request naming a model other than the served one "
                        "(default: any name is the served model, as agents send their own)")
    s.add_argument("--kv-budget", default=None,
                   help="KV cache budget, bytes or with a unit (e.g. 2GiB, 512MiB); default: "
                   "on a GPU the device memory left after the weights less 10%% (at least "
                   "4 GiB), on the CPU 30%% of RAM (at most 16 GiB)")
    s.add_argument("--prefill-budget", type=int, default=None,
                   help="prompt tokens per engine tick (default: 256 on a CPU, 1,024 on a GPU)")
    s.add_argument("--kv-reserve-tokens", type=int, default=None,
                   help="KV promised to a request beyond its prompt when it starts (default "
                        "256 tokens); it grows page by page after that, preempting the "
                        "youngest request when the budget is spent")
    s.add_argument("--state-snapshot-pages", type=int, default=2,
                   help="Gated DeltaNet models (qwen3_5*): keep a snapshot of the recurrent "
                        "state every this many KV pages (128 tokens) of a prompt, so a "
                        "follow-up turn resumes from the deepest one (default 2); each costs "
                        "the state's bytes in the KV budget")
    s.add_argument("--no-settle-passes", action="store_true",
                   help="Gated DeltaNet models: do not prefill a finished turn's generated "
                        "tokens again when idle (then a follow-up turn prefills them itself)")
    s.add_argument("--default-max-tokens", type=int, default=None,
                   help="max_tokens of a request that leaves it out (default: up to the "
                        "context length, with nothing reserved for it up front)")
    s.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' (visible to other local users "
                        "in ps; prefer --api-key-file or $SLOTSERVE_API_KEY)")
    s.add_argument("--api-key-file", default=None, metavar="PATH",
                   help="accept any key in PATH: one per line, blank lines and '#' comment "
                        "lines ignored. Keys from --api-key, --api-key-file and "
                        "$SLOTSERVE_API_KEY (comma- or newline-separated) are all accepted")
    s.add_argument("--cache-scope", choices=["key", "global", "none"], default="key",
                   help="who shares prefix KV (cached_tokens): requests of one API key (the "
                        "default; without a key, everyone), all requests, or none; a "
                        "request's cache_salt splits it further")
    s.add_argument("--tensor-parallel", type=int, default=1, metavar="N",
                   help="split the model over N ranks of this host, one process each (one "
                        "GPU each, NCCL; on the CPU the ring backend over 127.0.0.1); this "
                        "process serves HTTP as rank 0 and starts the others, or takes its "
                        "rank from mlx.launch (MLX_RANK)")
    s.add_argument("--allow-batch-variance", action="store_true",
                   help="serve even if the start-up probe finds outputs depend on the batch")
    s.set_defaults(fn=cmd_serve)

    r = sub.add_parser("route", help="prefix-aware router in front of slotserve replicas")
    from slotserve.router.options import add_arguments as route_arguments

    route_arguments(r)
    r.set_defaults(fn=cmd_route)

    b = sub.add_parser("bench", help="in-process throughput/latency benchmark")
    b.add_argument("--model", default=None)
    b.add_argument("--device", default="auto", choices=["auto", "cpu", "gpu"])
    b.add_argument("--streams", default="1,2,4,8,16,32")
    b.add_argument("--new-tokens", type=int, default=64)
    b.add_argument("--prompt-tokens", type=int, default=64)
    b.add_argument("--single", action="store_true",
                   help="single-stream numbers only: decode, 512-token prefill, RSS, load")
    b.add_argument("--out", default="bench-results", help="folder for JSON and PNG")
    b.add_argument("--temperature", type=float, default=0.0,
                   help="sampled decoding (seeded) instead of greedy")
    b.add_argument("--top-p", type=float, default=None)
    b.add_argument("--top-k", type=int, default=None)
    b.add_argument("--sampling", dest="sampling_cases", action="store_true",
                   help="each N greedy, temperature 0.7 + top_p 0.9 and temperature 0.7 + "
                        "top_k 40 (seeded) on the same prompts; tok/s and ratios to greedy")
    b.add_argument("--long", action="store_true",
                   help="long-context cases (--contexts): TTFT, prefill tok/s, decode tok/s at "
                        "that context and wall time end to end; composes with --sampling")
    b.add_argument("--contexts", default=None,
                   help="--long's cases: C (one prompt of C tokens) or NxC (N at once), "
                        "comma-separated (default: 4096,16384,32768)")
    b.add_argument("--long-new-tokens", type=int, default=None,
                   help="new tokens per --long prompt (default: --new-tokens)")
    b.add_argument("--prefill-budget", type=int, default=None,
                   help="prompt tokens per engine tick (default: the engine's)")
    b.set_defaults(fn=cmd_bench)

    # --- synth (random-weight checkpoints of real model shapes; see slotserve.tools.synth) ---
    y = sub.add_parser("synth", help="write a random-weight checkpoint of a named model shape")
    y.add_argument("preset", help="llama3-8b, qwen3-30b-a3b, tiny-llama or tiny-moe")
    y.add_argument("outdir")
    y.add_argument("--format", dest="fmt", choices=["bf16", "mlx4"], default="mlx4")
    y.add_argument("--layers", type=int, default=None, help="fewer layers than the preset")
    y.add_argument("--seed", type=int, default=0)
    y.add_argument("--tokenizer", default=None,
                   help="folder with tokenizer.json + tokenizer_config.json "
                        "(default: $SLOTSERVE_TOKENIZER_DIR, else the bundled SmolLM2)")
    y.set_defaults(fn=cmd_synth)
    e = sub.add_parser("export", help="write a Hugging Face directory from a GGUF/HF model")
    e.add_argument("model", nargs="?", default=None, help="GGUF file or HF dir (default: SmolLM2)")
    e.add_argument("outdir")
    e.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    e.set_defaults(fn=cmd_export)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.argv = argv  # the other ranks of --tensor-parallel run the same command
    args.log_level = args.log_level or ("info" if args.command == "serve" else "warning")
    configure_logging(args.log_format, args.log_level)
    return int(args.fn(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
