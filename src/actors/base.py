"""A small actor base: a bounded mailbox, a run loop, and supervision.

Each actor is a task in its owner's task group. Messages are sent to its mailbox
(an anyio memory object stream, bounded so a fast sender cannot grow memory
without limit). If handling a message raises, `on_crash` decides what fails (the
requests the actor serves), the error is logged, and the actor keeps running:
one bad request never takes the engine down.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, Generic, TypeVar

import anyio
import structlog
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

M = TypeVar("M")

log = structlog.get_logger("slotserve.actors")


class Actor(ABC, Generic[M]):
    mailbox_size = 64

    def __init__(self, name: str) -> None:
        self.name = name
        send, recv = anyio.create_memory_object_stream[M](self.mailbox_size)
        self._send: MemoryObjectSendStream[M] = send
        self._recv: MemoryObjectReceiveStream[M] = recv

    def tell(self, msg: M) -> None:
        """Deliver without waiting; a full mailbox is a bug in the protocol, so it raises.

        A message to an actor that has stopped is dropped: nobody is left to act on it.
        """
        try:
            self._send.send_nowait(msg)
        except (anyio.ClosedResourceError, anyio.BrokenResourceError):
            log.debug("message to stopped actor dropped", actor=self.name,
                      message=type(msg).__name__)

    async def ask(self, msg: M) -> None:
        """Deliver, waiting for room in the mailbox (backpressure on the sender)."""
        await self._send.send(msg)

    @property
    def queued(self) -> int:
        return self._recv.statistics().current_buffer_used

    async def run(self) -> None:
        async with self._recv:
            async for msg in self._recv:
                try:
                    await self.handle(msg)
                except Exception as exc:
                    self.contain(msg, exc)

    def contain(self, msg: Any, exc: Exception) -> None:
        """Supervision, for the mailbox loop and for events handed over by a direct call:
        report, fail what the message concerned (on_crash), keep serving. Call it from the
        `except` block, so the log carries the traceback."""
        log.exception("actor crashed on message", actor=self.name, message=type(msg).__name__)
        self.on_crash(msg, exc)

    def close(self) -> None:
        self._send.close()

    @abstractmethod
    async def handle(self, msg: M) -> None:
        """Process one message."""

    def on_crash(self, msg: M, exc: Exception) -> None:
        """Fail whatever the message concerned; subclasses override."""
