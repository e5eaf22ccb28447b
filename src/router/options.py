"""`slotserve route`'s options, apart from the server so that the CLI's parser imports no
web stack."""

from __future__ import annotations

import argparse


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--replica", action="append", default=[], metavar="URL",
                   help="a slotserve replica's base URL (http://host:port); give it once per "
                        "replica")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--health-interval", type=float, default=2.0, metavar="SECONDS",
                   help="seconds between GET /health rounds (default 2)")
    p.add_argument("--health-timeout", type=float, default=5.0, metavar="SECONDS")
    p.add_argument("--health-failures", type=int, default=2, metavar="N",
                   help="failed checks in a row that take a replica out (a refused "
                        "connection while forwarding takes it out at once); one passing "
                        "check brings it back")
    p.add_argument("--cache-threshold", type=float, default=0.5,
                   help="share of a prompt a replica must already hold to be chosen for "
                        "it over the least loaded (default 0.5)")
    p.add_argument("--balance-abs", type=int, default=4,
                   help="requests in flight an affine replica may have over the least "
                        "loaded before load wins (with --balance-rel)")
    p.add_argument("--balance-rel", type=float, default=1.5)
