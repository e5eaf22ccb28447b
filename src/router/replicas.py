"""The replicas behind the router: their health, their load, and which one a request goes to.

Choice (`Pool.choose`), in order:

1. A request that names a stored response (`previous_response_id`, `/v1/responses/{id}`)
   goes to the replica that made it: only that one has it.
2. The conversation key (`prompt_cache_key`, `user`, `metadata.user_id`) last routed to a
   healthy replica goes there again, unless that replica is overloaded (below).
3. The longest prefix of the request's chain (`affinity.Chain`) that some healthy replica was
   sent: if the characters it covers (with the answer generated there) are at least
   `cache_threshold` of the prompt, it goes there, unless overloaded.
4. Otherwise the replica with the fewest requests in flight (ties: the fewest routed so far,
   so that requests one after another still spread).

"Overloaded", as SGLang's router's balance thresholds: the affine replica has more than
`balance_abs` requests in flight over the least loaded one *and* more than `balance_rel`
times as many. Load is what the router itself has in flight there (it sees every request).

The tables are bounded (least recently used dropped first) and approximate: a replica evicts
idle KV on its own, so a recorded prefix may be gone there (it is then recomputed, no worse
than any other choice). A replica that comes back after failing health checks starts with
no recorded prefixes: it may have restarted with an empty cache.
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from dataclasses import dataclass, field

from slotserve.router.affinity import Chain

MAX_KEYS = 200_000  # recorded prefix keys (all replicas); ~100 bytes each
MAX_IDS = 100_000  # recorded response ids


@dataclass
class Replica:
    url: str
    healthy: bool = False
    in_flight: int = 0
    routed: int = 0
    failures: int = 0  # consecutive failed health checks
    last_error: str | None = None
    checked_at: float | None = None
    # set when the replica is taken out: requests streaming from it stop waiting at once
    down: asyncio.Event = field(default_factory=asyncio.Event)

    def describe(self) -> dict[str, object]:
        return {"url": self.url, "healthy": self.healthy, "in_flight": self.in_flight,
                "routed": self.routed, "last_error": self.last_error}


class LRU(OrderedDict[bytes | str, str]):
    def __init__(self, limit: int) -> None:
        super().__init__()
        self.limit = limit

    def put(self, key: bytes | str, url: str) -> None:
        self[key] = url
        self.move_to_end(key)
        while len(self) > self.limit:
            self.popitem(last=False)

    def touch(self, key: bytes | str) -> str | None:
        url = self.get(key)
        if url is not None:
            self.move_to_end(key)
        return url


@dataclass
class Choice:
    replica: Replica
    reason: str  # "response", "conversation", "prefix", "load"


class Pool:
    def __init__(self, urls: list[str], *, cache_threshold: float = 0.5,
                 balance_abs: int = 4, balance_rel: float = 1.5,
                 fail_after: int = 2) -> None:
        if not urls:
            raise ValueError("the router needs at least one --replica URL")
        if len(set(urls)) != len(urls):
            raise ValueError(f"a --replica URL is given twice: {urls}")
        self.replicas = {u: Replica(u) for u in urls}
        self.cache_threshold, self.balance_abs, self.balance_rel = (
            cache_threshold, balance_abs, balance_rel)
        self.fail_after = fail_after
        self.prefixes = LRU(MAX_KEYS)  # chain key -> url
        self.conversations = LRU(MAX_IDS)  # conversation key -> url
        self.responses = LRU(MAX_IDS)  # response id -> url

    def healthy(self) -> list[Replica]:
        return [r for r in self.replicas.values() if r.healthy]

    # ---- health -----------------------------------------------------------------------

    def mark_up(self, replica: Replica) -> None:
        replica.failures, replica.last_error = 0, None
        replica.checked_at = time.monotonic()
        if not replica.healthy:
            self.forget(replica.url)  # it may have restarted: its cache is not what we saw
            replica.down = asyncio.Event()
            replica.healthy = True

    def mark_failed(self, replica: Replica, error: str, *, at_once: bool = False) -> None:
        """A failed health check (out after `fail_after` in a row), or a failure seen while
        forwarding (`at_once`: a refused connection is not a slow moment)."""
        replica.failures += 1
        replica.last_error = error
        replica.checked_at = time.monotonic()
        if replica.healthy and (at_once or replica.failures >= self.fail_after):
            replica.healthy = False
            replica.down.set()

    def forget(self, url: str) -> None:
        for table in (self.prefixes, self.conversations):
            for key in [k for k, v in table.items() if v == url]:
                del table[key]

    # ---- choice -----------------------------------------------------------------------

    def choose(self, chain: Chain, response_id: str | None = None,
               exclude: frozenset[str] = frozenset()) -> Choice | None:
        """Where a request goes (None: no healthy replica left outside `exclude`)."""
        live = [r for r in self.healthy() if r.url not in exclude]
        if not live:
            return None
        least = min(live, key=lambda r: (r.in_flight, r.routed))
        by_url = {r.url: r for r in live}
        if response_id is not None:
            url = self.responses.touch(response_id)
            if url in by_url:
                return Choice(by_url[url], "response")
        if chain.conversation is not None:
            url = self.conversations.touch(chain.conversation)
            if url in by_url and not self._overloaded(by_url[url], least):
                return Choice(by_url[url], "conversation")
        for i in range(len(chain.keys) - 1, -1, -1):
            url = self.prefixes.get(chain.keys[i])
            if url not in by_url:
                continue
            covered = chain.matched_chars(i) / max(chain.total, 1)
            if covered >= self.cache_threshold and not self._overloaded(by_url[url], least):
                self.prefixes.touch(chain.keys[i])
                return Choice(by_url[url], "prefix")
            break
        return Choice(least, "load")

    def _overloaded(self, replica: Replica, least: Replica) -> bool:
        return (replica.in_flight - least.in_flight > self.balance_abs
                and replica.in_flight > self.balance_rel * least.in_flight)

    def record(self, replica: Replica, chain: Chain) -> None:
        """The request with `chain` went to `replica`: its prefixes are (about to be) there."""
        for key in chain.keys:
            self.prefixes.put(key, replica.url)
        if chain.conversation is not None:
            self.conversations.put(chain.conversation, replica.url)

    def record_response(self, response_id: str, replica: Replica) -> None:
        self.responses.put(response_id, replica.url)
