"""Session actor: one per request, between its slot and its client.

It turns token ids into text (UTF-8 safe), applies stop strings, and hands Deltas to
the client through a small bounded stream (`client`, a DeltaStream). When the client
reads slowly the stream fills, the Session holds its mailbox (`can_take`), the mailbox
fills, and the slot stops offering work (it reads `room()` before each offer): backpressure
without stalling anyone else's batch. Each read from the stream wakes the Session; once
its mailbox has room again it tells the slot to Resume.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from types import TracebackType
from typing import Protocol

import anyio
import structlog
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from slotserve.actors.base import Actor, Address, try_tell
from slotserve.actors.messages import (
    Delta,
    FinishEvent,
    GenerationRequest,
    Resume,
    SessionMessage,
    SlotMessage,
    Started,
    TokenEvent,
    Usage,
)
from slotserve.model.detokenizer import IncrementalDetokenizer, StopMatcher

log = structlog.get_logger("slotserve.session")

# deltas a client may leave unread before its session holds its mailbox (`can_take`); the
# stream has one place more, kept for the final delta of `Session.fail`
CLIENT_BUFFER = 8


class SlotAddress(Address[SlotMessage], Protocol):
    """A slot as its session knows it (slotserve.actors.slot.Slot): its address, and
    `cancel`, which ends the request there even when a Cancel cannot be told."""

    def cancel(self, epoch: int, reason: str) -> None: ...


class DeltaStream:
    """The client's end of a session: `async for delta in stream` (or `async with`). Each
    delta taken frees room, so the session is woken to go on; closing it early tells the
    session its client is gone."""

    def __init__(self, recv: MemoryObjectReceiveStream[Delta], session: Session) -> None:
        self._recv = recv
        self._session = session

    def __aiter__(self) -> DeltaStream:
        return self

    async def __anext__(self) -> Delta:
        try:
            delta = await self._recv.receive()
        except anyio.EndOfStream:
            raise StopAsyncIteration from None
        self._session.wake()
        return delta

    async def aclose(self) -> None:
        await self._recv.aclose()
        self._session.wake()  # its next emit finds the stream closed: the client is gone

    async def __aenter__(self) -> DeltaStream:
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None,
                        exc: BaseException | None, tb: TracebackType | None) -> None:
        await self.aclose()


class Session(Actor[SessionMessage]):
    mailbox_size = 8

    def __init__(self, request: GenerationRequest, tokenizer: object,
                 on_closed: Callable[[Session], None] | None = None) -> None:
        super().__init__(f"session-{request.request_id}")
        self.request = request
        self.detok = IncrementalDetokenizer(tokenizer, skip_special=True)  # type: ignore[arg-type]
        self.stops = StopMatcher(request.stop) if request.stop else None
        send, recv = anyio.create_memory_object_stream[Delta](CLIENT_BUFFER + 1)
        self.out: MemoryObjectSendStream[Delta] = send
        self.client = DeltaStream(recv, self)
        self.slot: SlotAddress | None = None
        self.reused = 0  # prompt tokens the slot reused (set at bind; usage on a stop string)
        self.epoch = 0
        self.finished = False
        self.first_token_at: float | None = None
        self.completion_tokens = 0
        self.on_closed = on_closed
        self._sender_waits = False  # the slot found the mailbox nearly full and paused

    def bind(self, slot: SlotAddress, epoch: int) -> None:
        self.slot, self.epoch = slot, epoch

    def cancel(self) -> None:
        """Client went away: tell the slot, which frees itself at once."""
        if not self.finished and self.slot is not None:
            self.slot.cancel(self.epoch, "cancelled")

    def tell(self, msg: SessionMessage) -> None:
        super().tell(msg)
        if self.room() < 2:
            self._sender_waits = True

    def can_take(self) -> bool:
        """Room in the client stream for what one event can emit (two deltas at most); a
        finished session takes (and drops) everything."""
        return self.finished or self.out.statistics().current_buffer_used <= CLIENT_BUFFER - 2

    def handle(self, msg: SessionMessage) -> None:
        if self.finished:
            return
        if isinstance(msg, Started):
            self.reused = msg.reused
            return
        for delta in self._deltas(msg):
            self._emit(delta)

    def drained(self) -> None:
        """Mailbox room again after the slot paused: let it offer work again."""
        if self._sender_waits and self.room() >= 2 and not self.finished:
            self._sender_waits = False
            if self.slot is not None:
                self._resume(self.slot)

    def _resume(self, slot: SlotAddress) -> None:
        """Tell the paused slot to go on. Should the tell raise (a full mailbox, a protocol
        bug), the request fails: the slot would wait for this Resume for ever, and its
        client for the rest of its answer. (Raised here, outside `handle`, the error would
        reach the event loop: nothing would fail the request.)"""
        exc = try_tell(slot, Resume(self.epoch), "telling the slot to resume failed: the "
                       "request fails", request_id=self.request.request_id)
        if exc is not None:
            self.fail("error", f"internal error resuming the request: {type(exc).__name__}: "
                      f"{exc}")
            slot.cancel(self.epoch, "cancelled")

    def _deltas(self, msg: TokenEvent | FinishEvent) -> list[Delta]:
        """What the client gets for this event (a final delta finishes the session)."""
        if isinstance(msg, TokenEvent):
            return self._token(msg)
        return self._finish(msg)

    def _token(self, ev: TokenEvent) -> list[Delta]:
        if self.first_token_at is None:
            self.first_token_at = time.perf_counter()
        self.completion_tokens += 1
        text = self.detok.add(ev.token)
        stopped = False
        if self.stops is not None:
            text, stopped = self.stops.feed(text)
        out = [Delta(text=text, token_ids=[ev.token],
                     logprobs=[ev.logprob] if ev.logprob is not None else [])]
        if stopped and self.slot is not None:
            self.slot.cancel(self.epoch, "stop")  # (ends it even if the Cancel cannot be told)
            usage = Usage(len(self.request.prompt_ids), self.completion_tokens, self.reused)
            out.append(self._final("stop", usage, None))
        return out

    def _finish(self, ev: FinishEvent) -> list[Delta]:
        reason = "cancelled" if ev.reason == "cancelled" else ev.reason
        out = []
        if ev.error is None and reason in ("stop", "length"):
            tail = self.detok.flush()
            if self.stops is not None:
                tail, _ = self.stops.feed(tail)
                if not self.stops.stopped:
                    tail += self.stops.flush()
            if tail:
                out.append(Delta(text=tail))
        out.append(self._final(reason, ev.usage, ev.error))
        return out

    def _final(self, reason: str, usage: Usage, error: str | None) -> Delta:
        """The last delta; the session is finished from here on."""
        self.finished = True
        ttft = None if self.first_token_at is None else self.first_token_at - self.request.arrived
        return Delta(finish_reason=reason, usage=usage, error=error, ttft=ttft)

    def _emit(self, delta: Delta) -> None:
        try:
            self.out.send_nowait(delta)
        except (anyio.BrokenResourceError, anyio.ClosedResourceError):
            self._client_gone()
            return
        self._closed_after(delta)

    def _closed_after(self, delta: Delta) -> None:
        if delta.finish_reason is not None:
            self._close()

    def _close(self) -> None:
        self.out.close()
        self.stop()
        if self.on_closed is not None:
            on_closed, self.on_closed = self.on_closed, None
            on_closed(self)

    def _client_gone(self) -> None:
        """The client stopped listening: free the slot (`cancel` ends the request there
        even when the Cancel cannot be told, so the session always closes)."""
        self.finished = True
        if self.slot is not None:
            self.slot.cancel(self.epoch, "cancelled")
        self._close()

    def on_crash(self, msg: SessionMessage, exc: Exception) -> None:
        """This request fails with an error; its slot is freed; peers never notice. The
        client hears first, and `cancel` ends the request on the slot even when its Cancel
        cannot be told (a full mailbox, a protocol bug): the session crashes once, not on
        each token a slot left running would go on sending."""
        self.fail("error", f"internal error in session: {exc}")
        if self.slot is not None:
            self.slot.cancel(self.epoch, "cancelled")

    def fail(self, reason: str, error: str | None) -> None:
        """Finish a request from outside its slot's events: one that is not on a slot
        (queued, or preempted and waiting to resume: rejected, cancelled, failed to place,
        or the engine failed) or whose session crashed.

        Its final delta always reaches the client, whenever it is called: an event is
        handled only while two of CLIENT_BUFFER places are free (`can_take`) and emits two
        deltas at most, so the events' deltas never take the stream's one place more, and
        it is there for this one. A client that stopped reading (a preempted request's, say)
        then reads what it was sent and why it ended, with the tokens it was sent counted
        in its usage, instead of a stream that just stops or a usage of none. Events still
        in the mailbox (tokens it was not sent) are dropped: memory stays bounded."""
        if self.finished:
            return
        usage = Usage(len(self.request.prompt_ids), self.completion_tokens, self.reused)
        try:
            self.out.send_nowait(self._final(reason, usage, error))
        except anyio.WouldBlock:  # (never: the place is kept; a bug if it ever is)
            log.error("a session's final delta found no room", request_id=self.request.request_id)
        except (anyio.BrokenResourceError, anyio.ClosedResourceError):
            pass  # the client has gone
        self.finished = True
        self._close()
