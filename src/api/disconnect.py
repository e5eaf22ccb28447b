"""Notice a client that goes away, whatever Quart does with the news.

Hypercorn reports a closed connection (FIN or RST) as the ASGI message `http.disconnect` from
`receive()`, also while a response is pending: after a complete request h11 keeps reading the
socket, so the close is seen at once. Quart's reader task takes the message and cancels the
request's handler, but on Python 3.11 that cancellation can be lost: Quart waits for the body
with `asyncio.wait_for`, which returns the body and swallows a cancellation that arrives in the
same tick as the body's last bytes (a client that sends its request and closes at once). The
handler then ran its whole generation for nobody (up to the context length), and a stream
wrote every chunk to the closed socket (asyncio logs `socket.send() raised exception.` for
each).

So the app does not depend on that cancellation: `ClientWatch`, an ASGI middleware in front of
Quart, watches `receive()` for `http.disconnect` and tells the request's `ClientLink`, whose
callbacks (the generation code registers `engine.cancel(session)`) run in the same tick; and it
drops every response message sent after that, so nothing is written to the closed socket.

One case stays out of reach of any ASGI app: a client that sent bytes beyond its request
(a pipelined next request) is not read by h11 until the current response ends (`h11.PAUSED`),
so its close is seen only when a write fails: a stream's next token or keepalive comment, and
for a non-streaming request the end of its generation.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

import structlog

log = structlog.get_logger("slotserve.api")

SCOPE_KEY = "slotserve.client"  # the request's ClientLink in its ASGI scope

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


class ClientLink:
    """Whether one request's client is still connected, and what to do when it leaves."""

    __slots__ = ("_callbacks", "gone")

    def __init__(self) -> None:
        self.gone = False
        self._callbacks: list[Callable[[], None]] = []

    def on_gone(self, callback: Callable[[], None]) -> None:
        """Call `callback` once the client has gone (at once if it already has). Callbacks
        run on the event loop and must not block; an exception is logged, not raised."""
        if self.gone:
            self._run(callback)
        else:
            self._callbacks.append(callback)

    def mark_gone(self) -> None:
        if self.gone:
            return
        self.gone = True
        callbacks, self._callbacks = self._callbacks, []
        for callback in callbacks:
            self._run(callback)

    @staticmethod
    def _run(callback: Callable[[], None]) -> None:
        try:
            callback()
        except Exception:  # one failing callback must not keep the others from running
            log.exception("client disconnect callback failed")


def client_link(scope: Scope) -> ClientLink | None:
    """The request's link, if the app runs behind `ClientWatch`."""
    link = scope.get(SCOPE_KEY)
    return link if isinstance(link, ClientLink) else None


class ClientWatch:
    """ASGI middleware: a `ClientLink` per HTTP request, marked gone on `http.disconnect`.

    Hypercorn also sends `http.disconnect` after a response has ended normally; callbacks then
    find their request finished and do nothing.
    """

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope.get("type") != "http":
            await self.app(scope, receive, send)
            return
        link = ClientLink()
        scope[SCOPE_KEY] = link

        async def watched_receive() -> Message:
            message = await receive()
            if message.get("type") == "http.disconnect":
                link.mark_gone()
            return message

        async def send_while_connected(message: Message) -> None:
            if link.gone and str(message.get("type", "")).startswith("http.response."):
                return  # the socket is closed: writing would only fail (and be logged)
            await send(message)

        await self.app(scope, watched_receive, send_while_connected)
