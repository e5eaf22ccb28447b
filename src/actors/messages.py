"""Typed messages and the request/response records that flow between actors."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from slotserve.actors.base import Address, Handler
from slotserve.runtime.grammar import Grammar, Matcher
from slotserve.runtime.runner import RowWork, Sampled
from slotserve.runtime.sampling import RowState, SamplingParams

# Who may reuse whose KV: (tenant, cache salt). Requests share prefix KV only when their
# namespaces are equal; None is a request whose KV no other request may use, nor it theirs.
CacheNamespace = tuple[str, str]
GLOBAL_NAMESPACE: CacheNamespace = ("", "")


@dataclass
class GenerationRequest:
    """A tokenized request, ready for admission."""

    request_id: str
    prompt_ids: list[int]
    max_tokens: int
    params: SamplingParams
    stop: list[str] = field(default_factory=list)
    stop_ids: frozenset[int] = frozenset()
    logprobs: bool = False
    top_logprobs: int = 0
    arrived: float = field(default_factory=time.perf_counter)
    grammar: Grammar | None = None  # constrained decoding (response_format)
    cache_namespace: CacheNamespace | None = GLOBAL_NAMESPACE  # prefix reuse only within it
    # an engine-internal pass nobody waits for (a settle pass: slotserve.actors.settle):
    # placed only when nothing is queued, its chunks get only the prefill budget left over
    background: bool = False


@dataclass
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    reused_tokens: int = 0


@dataclass
class TokenLogprob:
    token: int
    logprob: float
    top: list[tuple[int, float]] | None = None


@dataclass
class Delta:
    """What a client receives: new text (possibly empty), then one final Delta."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None  # "stop" | "length" | "cancelled" | "error"
    usage: Usage | None = None
    error: str | None = None
    ttft: float | None = None


# ---- Slot mailbox ---------------------------------------------------------------


@dataclass
class Progress:
    """A preempted request's state, kept while it waits to resume."""

    tokens: list[int]  # the prompt and every token generated so far
    generated: int
    state: RowState  # sampler state (seeded draws, penalty counts)
    matcher: Matcher | None  # grammar position
    reused: int  # prompt tokens the first placement found in the cache (usage)


@dataclass
class Assign:
    """Serve this request; `reused` tokens of it are in the pages admission gave the slot."""

    request: GenerationRequest
    session: Address[SessionMessage]  # the Session that receives this request's tokens
    reused: int = 0
    progress: Progress | None = None  # resume a preempted request from here


@dataclass
class StepDone:
    """The Batcher ran a step that fed `fed` tokens of this slot (epoch guards reuse)."""

    epoch: int
    fed: int
    sampled: Sampled | None


@dataclass
class StepFailed:
    epoch: int
    error: str


@dataclass
class Withdrawn:
    """The Batcher dropped this slot's offer before any step took it (see Withdraw)."""

    epoch: int


@dataclass
class Cancel:
    epoch: int
    reason: str  # "cancelled" | "stop" | "shutdown"


@dataclass
class Resume:
    """The session drained its mailbox: the slot may offer work again."""

    epoch: int


@dataclass
class Preempt:
    """Step back: free your pages for an older request (admission's preemption)."""

    epoch: int


@dataclass
class PagesReady:
    """The pages the slot waited for may be there now: offer again."""

    epoch: int


SlotMessage = Assign | Cancel | Resume | StepDone | StepFailed | Withdrawn | Preempt | PagesReady


# ---- Batcher mailbox ------------------------------------------------------------


@dataclass
class Ready:
    """The slot offers work for the next step: `work` holds all its pending tokens (the
    Batcher feeds a prefix of them); the slot changes nothing in it until the answer
    (StepDone, StepFailed or Withdrawn) comes back."""

    slot_id: int
    epoch: int
    work: RowWork
    prefilling: bool
    arrived_at: float
    slot: Handler[SlotMessage]
    background: bool = False  # GenerationRequest.background: the budget left over only


@dataclass
class NoWork:
    """The slot handled its step result and offers nothing (finished, or its client is
    slow: it waits for Resume)."""

    slot_id: int


@dataclass
class Withdraw:
    """The slot's request ended while its offer was out: drop the offer if no step has
    taken it yet (answered with Withdrawn; a step that did take it answers StepDone)."""

    slot_id: int
    epoch: int


BatcherMessage = Ready | NoWork | Withdraw


# ---- Session mailbox ------------------------------------------------------------


@dataclass
class Started:
    """The slot took the request; `reused` prompt tokens came from resident KV."""

    reused: int


@dataclass
class TokenEvent:
    token: int
    logprob: TokenLogprob | None = None


@dataclass
class FinishEvent:
    reason: str
    usage: Usage
    error: str | None = None


SessionMessage = Started | TokenEvent | FinishEvent
