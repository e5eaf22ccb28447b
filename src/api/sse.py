"""Server-sent events: OpenAI's `data: {json}` framing, and keepalives while a request waits.

Proxies and clients drop connections that stay silent too long; a request can sit in the queue
or in a long prefill for many seconds before its first token, so the stream sends a comment
line every `interval` seconds until something real arrives.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any, TypeVar

from slotserve.api.errors import dumps

T = TypeVar("T")

DONE = b"data: [DONE]\n\n"
KEEPALIVE = b": keepalive\n\n"
HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}

_END = object()


def event(payload: Any) -> bytes:
    """One `data:` event; strict JSON (see `errors.dumps`): a NaN ends the stream as an error."""
    return b"data: " + dumps(payload).encode() + b"\n\n"


async def with_keepalive(source: AsyncIterator[T], interval: float) -> AsyncIterator[T | None]:
    """Yield the source's items, and None whenever `interval` seconds pass without one.

    The pending read is never cancelled by a tick (cancelling it would cancel the request);
    it is cancelled only when this iterator itself is closed (the client went away).
    """
    async def step() -> Any:
        return await anext(source, _END)

    pending: asyncio.Future[Any] | None = None
    try:
        while True:
            if pending is None:
                pending = asyncio.ensure_future(step())
            done, _ = await asyncio.wait({pending}, timeout=interval)
            if not done:
                yield None
                continue
            item, pending = pending.result(), None
            if item is _END:
                return
            yield item
    finally:
        if pending is not None and not pending.done():
            pending.cancel()
            await asyncio.wait({pending})
        aclose = getattr(source, "aclose", None)
        if aclose is not None:
            await aclose()
