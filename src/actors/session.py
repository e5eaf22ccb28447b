"""Session actor: one per request, between its slot and its client.

It turns token ids into text (UTF-8 safe), applies stop strings, and streams
Deltas to the client through a small bounded stream. When the client reads
slowly the Session blocks on that stream, its own mailbox fills, and the slot
stops asking for steps: backpressure without stalling anyone else's batch.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import anyio
import structlog
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from slotserve.actors.base import Actor
from slotserve.actors.messages import (
    Cancel,
    Delta,
    FinishEvent,
    GenerationRequest,
    Resume,
    SessionMessage,
    TokenEvent,
    Usage,
)
from slotserve.model.detokenizer import IncrementalDetokenizer, StopMatcher

log = structlog.get_logger("slotserve.session")

if TYPE_CHECKING:
    from slotserve.actors.slot import Slot

CLIENT_BUFFER = 8


class Session(Actor[SessionMessage]):
    mailbox_size = 8

    def __init__(self, request: GenerationRequest, tokenizer: object) -> None:
        super().__init__(f"session-{request.request_id}")
        self.request = request
        self.detok = IncrementalDetokenizer(tokenizer, skip_special=True)  # type: ignore[arg-type]
        self.stops = StopMatcher(request.stop) if request.stop else None
        send, recv = anyio.create_memory_object_stream[Delta](CLIENT_BUFFER)
        self.out: MemoryObjectSendStream[Delta] = send
        self.client: MemoryObjectReceiveStream[Delta] = recv
        self.slot: Slot | None = None
        self.epoch = 0
        self.finished = False
        self.first_token_at: float | None = None
        self.completion_tokens = 0

    def bind(self, slot: Slot, epoch: int) -> None:
        self.slot, self.epoch = slot, epoch

    def has_room(self) -> bool:
        """Room for one token and a finish event: otherwise the slot parks."""
        return self.queued <= self.mailbox_size - 2

    def cancel(self) -> None:
        """Client went away: tell the slot, which frees itself at once."""
        if not self.finished and self.slot is not None:
            self.slot.tell(Cancel(self.epoch, "cancelled"))

    def deliver(self, msg: SessionMessage) -> None:
        """Hand this session a token or finish event from its slot.

        Fast path: when nothing is queued ahead of it and the client stream has room for
        what the event can emit (two deltas at most), the event is handled right here, in the
        slot's call: no task switch per token, which matters at dozens of streams a step.
        Otherwise it goes through the mailbox as before, which keeps the order and lets a
        slow client's backlog park the slot.
        """
        if (self.queued or self.finished
                or self.out.statistics().current_buffer_used > CLIENT_BUFFER - 2):
            self.tell(msg)
            return
        try:
            for delta in self._deltas(msg):
                self._emit_now(delta)
        except Exception as exc:  # supervision, as in Actor.run
            log.exception("session crashed on a delivered event", session=self.name)
            self.on_crash(msg, exc)

    async def handle(self, msg: SessionMessage) -> None:
        if self.finished:
            return
        for delta in self._deltas(msg):
            await self._emit(delta)
        slot = self.slot
        if slot is not None and slot.parked and self.has_room() and not self.finished:
            slot.tell(Resume(self.epoch))

    def _deltas(self, msg: SessionMessage) -> list[Delta]:
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
            self.slot.tell(Cancel(self.epoch, "stop"))
            usage = Usage(len(self.request.prompt_ids), self.completion_tokens,
                          self.slot.reused)
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

    async def _emit(self, delta: Delta) -> None:
        try:
            await self.out.send(delta)
        except (anyio.BrokenResourceError, anyio.ClosedResourceError):
            self._client_gone()
            return
        self._closed_after(delta)

    def _emit_now(self, delta: Delta) -> None:
        """_emit for the fast path (deliver checked that the stream has room)."""
        try:
            self.out.send_nowait(delta)
        except (anyio.BrokenResourceError, anyio.ClosedResourceError):
            self._client_gone()
            return
        self._closed_after(delta)

    def _closed_after(self, delta: Delta) -> None:
        if delta.finish_reason is not None:
            self.out.close()
            self.close()

    def _client_gone(self) -> None:
        """The client stopped listening: free the slot."""
        self.finished = True
        if self.slot is not None:
            self.slot.tell(Cancel(self.epoch, "cancelled"))
        self.close()

    def on_crash(self, msg: SessionMessage, exc: Exception) -> None:
        """This request fails with an error; its slot is freed; peers never notice."""
        if self.slot is not None:
            self.slot.tell(Cancel(self.epoch, "cancelled"))
        self.fail("error", f"internal error in session: {exc}")

    def fail(self, reason: str, error: str | None) -> None:
        """Finish a request that never reached a slot (rejected or cancelled in queue)."""
        if self.finished:
            return
        self.finished = True
        usage = Usage(len(self.request.prompt_ids), 0, 0)
        try:
            self.out.send_nowait(Delta(finish_reason=reason, usage=usage, error=error))
        except anyio.WouldBlock:
            pass
        except (anyio.BrokenResourceError, anyio.ClosedResourceError):
            pass
        self.out.close()
        self.close()
