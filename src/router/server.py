"""`slotserve route`: serve the router with Hypercorn until SIGINT/SIGTERM.

The router loads no model and imports no MLX: it can run on a machine without an accelerator,
in front of replicas anywhere it can reach.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import signal
import sys

import structlog
from hypercorn.asyncio import serve
from hypercorn.config import Config

from slotserve.router.app import create_app

log = structlog.get_logger("slotserve.router")


def banner(host: str, port: int, replicas: list[str]) -> str:
    shown = "localhost" if host in ("0.0.0.0", "::", "") else host
    shown = f"[{shown}]" if ":" in shown else shown
    base = f"http://{shown}:{port}"
    listed = "\n".join(f"  {i}: {u}" for i, u in enumerate(replicas))
    return (f"slotserve router on {base} (OpenAI and Anthropic APIs at {base}/v1; health at "
            f"{base}/health, replicas at {base}/replicas) in front of:\n{listed}")


async def run(args: argparse.Namespace) -> None:
    app = create_app(args.replica, health_interval=args.health_interval,
                     health_timeout=args.health_timeout, fail_after=args.health_failures,
                     cache_threshold=args.cache_threshold, balance_abs=args.balance_abs,
                     balance_rel=args.balance_rel)
    cfg = Config()
    cfg.bind = [f"[{args.host}]:{args.port}" if ":" in args.host else f"{args.host}:{args.port}"]
    cfg.graceful_timeout = 10.0
    cfg.accesslog = None
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(RuntimeError, ValueError, NotImplementedError):
            loop.add_signal_handler(sig, stop.set)
    await serve(app, cfg, shutdown_trigger=stop.wait)  # type: ignore[arg-type]


def main(args: argparse.Namespace) -> int:
    """Returns 0 after a signal, 2 for unusable arguments, 1 if serving failed."""
    if not args.replica:
        sys.stderr.write("slotserve route: error: give at least one --replica URL\n")
        return 2
    bad = [u for u in args.replica if not u.startswith(("http://", "https://"))]
    if bad:
        sys.stderr.write(f"slotserve route: error: a replica is an http:// or https:// URL, "
                         f"not {bad[0]!r}\n")
        return 2
    if len(set(args.replica)) != len(args.replica):
        sys.stderr.write("slotserve route: error: a --replica URL is given twice\n")
        return 2
    sys.stdout.write(banner(args.host, args.port, args.replica) + "\n")
    sys.stdout.flush()
    try:
        asyncio.run(run(args))
    except Exception as exc:  # a taken port, say: exit 1 for a supervisor
        log.error("router stopped", error=f"{type(exc).__name__}: {exc}")
        return 1
    return 0
