"""A small actor base: a bounded mailbox, synchronous handlers, and supervision.

Every actor lives on the engine's one event loop. `tell` appends to the actor's
bounded mailbox and, if the actor is not already scheduled, puts one drain callback
on the loop's ready queue (`call_soon`): the drain hands each queued message to
`handle`, which never awaits. A message therefore costs a deque append, and an actor
that gets a message every tick costs one loop callback a tick, not a task switch:
that is what lets the Batcher tell each of dozens of slots its step result, and each
slot tell its session a token, through the mailboxes and nothing else.

Backpressure is the mailbox bound. A sender reads `room()` before it sends what may
be followed by more (a slot parks itself when its session's mailbox is nearly full),
and an actor that cannot take its next message yet (a session whose client is not
reading) holds its mailbox (`can_take` false) until `wake()` is called. A full
mailbox on `tell` is a bug in the protocol: it raises.

Supervision: if `handle` raises, the error is logged with its traceback, `on_crash`
fails whatever the message concerned (the requests the actor serves), and the actor
keeps serving the next message. One bad request never takes the engine down.
"""

from __future__ import annotations

import asyncio
from abc import ABC, abstractmethod
from collections import deque
from typing import Generic, Protocol, TypeVar

import structlog

M = TypeVar("M")
M_contra = TypeVar("M_contra", contravariant=True)

log = structlog.get_logger("slotserve.actors")


class MailboxFullError(RuntimeError):
    """A sender ignored `room()`: the actors' protocol bounds every mailbox."""


class Address(Protocol[M_contra]):
    """What one actor knows of another: where to send, and how much room is left."""

    def tell(self, msg: M_contra) -> None: ...

    def room(self) -> int: ...


class Handler(Address[M_contra], Protocol[M_contra]):
    """An actor's address with `tell_or_handle`: for the messages without which what they
    concern would wait forever (a step's result, a cancel)."""

    def tell_or_handle(self, msg: M_contra, failure: str, **context: object) -> None: ...


def try_tell(target: Address[M_contra], msg: M_contra, failure: str,
             **context: object) -> Exception | None:
    """Tell `target` `msg`; None when told. A tell that raises (a full or closed mailbox: a
    bug in the protocol) is logged, traceback and message type included, as `failure`, and
    its error returned: the caller then does what the message would have done, or fails
    what it concerned, instead of letting the error stop it halfway."""
    try:
        target.tell(msg)
        return None
    except Exception as exc:
        log.exception(failure, message=type(msg).__name__, **context)
        return exc


class Actor(ABC, Generic[M]):
    mailbox_size = 64

    def __init__(self, name: str) -> None:
        self.name = name
        self._mailbox: deque[M] = deque()
        self._scheduled = False
        self._stopped = False

    # ---- the address: what other actors call -----------------------------------------

    def tell(self, msg: M) -> None:
        """Deliver without waiting. A message to a stopped actor is dropped: nobody is left
        to act on it."""
        if self._stopped:
            log.debug("message to stopped actor dropped", actor=self.name,
                      message=type(msg).__name__)
            return
        if len(self._mailbox) >= self.mailbox_size:
            raise MailboxFullError(f"{self.name}: mailbox full ({self.mailbox_size})")
        self._mailbox.append(msg)
        self._schedule()

    def tell_or_handle(self, msg: M, failure: str, **context: object) -> None:
        """Tell `msg`; should the tell raise (a full mailbox: a protocol bug, logged as
        `failure`), handle it now, from outside the mailbox, contained as a handler that
        raised would be. For the messages whose loss would leave what they concern waiting
        forever: a step's result (the slot would never offer again, its request never
        finish), a cancel (the slot would decode for nobody to max_tokens, holding pages).
        Handled ahead of what is queued, so such a message must stand on its own (each
        carries the epoch it is for)."""
        if try_tell(self, msg, failure, actor=self.name, **context) is None:
            return
        try:
            self.handle(msg)
        except Exception as exc:
            self.contain(msg, exc)

    def room(self) -> int:
        """Messages the mailbox can still take."""
        return self.mailbox_size - len(self._mailbox)

    @property
    def queued(self) -> int:
        return len(self._mailbox)

    # ---- the loop side --------------------------------------------------------------

    def can_take(self) -> bool:
        """Whether the next message may be handled now; an actor waiting on something
        outside the actors (a client reading) says no, then calls `wake` when it may."""
        return True

    def wake(self) -> None:
        """Drain again: what `can_take` waited for has happened."""
        if self._mailbox:
            self._schedule()

    def stop(self) -> None:
        """Take no more messages; what is queued is dropped."""
        self._stopped = True
        self._mailbox.clear()

    def _schedule(self) -> None:
        if not self._scheduled:
            self._scheduled = True
            asyncio.get_running_loop().call_soon(self._drain)

    def _drain(self) -> None:
        self._scheduled = False
        while self._mailbox and not self._stopped and self.can_take():
            msg = self._mailbox.popleft()
            try:
                self.handle(msg)
            except Exception as exc:
                self.contain(msg, exc)
        self.drained()

    def contain(self, msg: M, exc: Exception) -> None:
        """Report (call from an `except` block, so the log carries the traceback), fail
        what the message concerned (`on_crash`), keep serving."""
        log.exception("actor crashed on message", actor=self.name, message=type(msg).__name__)
        try:
            self.on_crash(msg, exc)
        except Exception:
            log.exception("actor crash handler failed", actor=self.name)

    @abstractmethod
    def handle(self, msg: M) -> None:
        """Process one message (never awaits)."""

    def drained(self) -> None:
        """Called after each drain; subclasses override (e.g. to tell a sender to resume)."""

    def on_crash(self, msg: M, exc: Exception) -> None:
        """Fail whatever the message concerned; subclasses override."""
