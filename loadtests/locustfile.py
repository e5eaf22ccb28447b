"""Locust users for slotserve's OpenAI-compatible API.

    locust -f loadtests/locustfile.py --host http://127.0.0.1:8000 --headless -u 16 -r 4 -t 60s

(`loadtests/run.py` starts a server, runs this headless and checks the outcome.)

User classes (spawned by weight; LongPromptUser is a single fixed user):

- ShortChatUser: short streaming chats, 16-32 new tokens.
- AgentUser: multi-turn conversations that continue their own history: each turn sends the
  previous assistant reply back plus a new user turn, so the server can reuse the slot's KV
  prefix. The reused tokens come from `usage.prompt_tokens_details.cached_tokens` of the final
  SSE chunk (`stream_options.include_usage`).
- CompletionUser: non-streaming /v1/completions.
- DisconnectUser: streaming chats that hang up after a few tokens.
- LongPromptUser: streaming chats over a ~2k-token prompt built from varied repeated text.

Requests are reported under readable names ("chat short", "chat agent", ...), timed to the end
of the stream. Measurements ride along as request events of type METRIC, whose "response time"
column holds the value in the unit the name states:

- METRIC ttft_ms: time to the first content token of interactive streams (short, agent,
  disconnect); METRIC ttft_long_ms: the same for long prompts.
- METRIC decode_tok_s: per stream, tokens after the first / time from first to last token.
- METRIC prefix_reused_tokens: cached prompt tokens reported for agent follow-up turns.
- METRIC long_prompt_tokens: prompt size of long-prompt requests (as the server counted it).
- METRIC retry_after_s: the Retry-After of each 429.

A 429 with a Retry-After header is a success (reported as "<name> [429]"), after which the user
waits min(Retry-After, 5) s; a 429 without it is a failure, as is any other non-200 status, an
error event inside a stream, or a stream that ends without `[DONE]`.

Environment: SLOTSERVE_LOADTEST_SUMMARY (path: write a JSON summary with exact percentiles when
the test stops), SLOTSERVE_LOADTEST_LONG_TOKENS (approximate long-prompt size, default 2200).
"""

from __future__ import annotations

import json
import math
import os
import random
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import requests
from locust import User, between, events, task

LONG_TOKENS = int(os.environ.get("SLOTSERVE_LOADTEST_LONG_TOKENS", "2200"))
SUMMARY_PATH = os.environ.get("SLOTSERVE_LOADTEST_SUMMARY")
TIMEOUT = (10.0, 180.0)  # connect, read (the server sends SSE keep-alives while it prefills)
MAX_BACKOFF_S = 5.0
AGENT_TURNS = 6

TOPICS = ["volcanoes", "the Roman empire", "sourdough bread", "black holes", "chess openings",
          "honeybees", "the French revolution", "jazz harmony", "coral reefs", "bicycle gears",
          "tea ceremonies", "glaciers", "origami", "the printing press", "octopuses", "sailing"]
ASKS = ["Give me one fun fact about {t}.", "Explain {t} in two sentences.",
        "Write a haiku about {t}.", "What is the most surprising thing about {t}?",
        "Name three words related to {t}.", "Why do people find {t} interesting?"]
AGENT_GOALS = ["plan a three-day trip to Lisbon", "organise a small team offsite",
               "debug a slow database query", "write a grocery list for a week of dinners",
               "prepare for a job interview", "set up a home vegetable garden"]
FOLLOW_UPS = ["The tool returned: {n} results. What is the next step?",
              "Good. Now refine step {n} and keep it short.",
              "Observation: step {n} failed with a timeout. How do we recover?",
              "Summarise the plan so far in one line, then continue with step {n}."]
WORDS = ["amber", "basalt", "cedar", "delta", "ember", "fjord", "granite", "harbor", "indigo",
         "juniper", "kelp", "lagoon", "meadow", "nickel", "orchid", "pewter", "quartz", "raven",
         "saffron", "tundra", "umber", "violet", "willow", "yarrow", "zephyr"]
TOKENS_PER_SENTENCE = 20.3  # SmolLM2 tokens per long_prompt() sentence (digits split), measured


# ---- results kept for the summary -------------------------------------------------------


@dataclass
class Results:
    started: float = field(default_factory=time.monotonic)
    ttft_ms: list[float] = field(default_factory=list)
    ttft_long_ms: list[float] = field(default_factory=list)
    decode_tok_s: list[float] = field(default_factory=list)
    requests: dict[str, int] = field(default_factory=dict)
    failures: dict[str, int] = field(default_factory=dict)
    rate_limited: int = 0
    rate_limited_without_retry_after: int = 0
    completion_tokens: int = 0
    agent_followups: int = 0
    agent_prompt_tokens: int = 0
    agent_reused_tokens: int = 0
    reused_tokens: int = 0
    long_prompt_tokens: list[int] = field(default_factory=list)
    disconnects: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)

    def count(self, table: dict[str, int], name: str) -> None:
        with self.lock:
            table[name] = table.get(name, 0) + 1


RESULTS = Results()


def percentile(values: list[float], q: float) -> float | None:
    """Nearest-rank percentile (q in 0..100); None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    rank = max(1, math.ceil(q / 100 * len(ordered)))
    return ordered[rank - 1]


def _stats(values: list[float]) -> dict[str, Any]:
    return {"count": len(values), "p50": percentile(values, 50), "p95": percentile(values, 95),
            "max": max(values) if values else None}


def summary(elapsed: float | None = None) -> dict[str, Any]:
    r = RESULTS
    elapsed = elapsed if elapsed is not None else time.monotonic() - r.started
    return {
        "elapsed_s": round(elapsed, 2),
        "requests": dict(r.requests),
        "failures": dict(r.failures),
        "failed": sum(r.failures.values()),
        "rate_limited": r.rate_limited,
        "rate_limited_without_retry_after": r.rate_limited_without_retry_after,
        "disconnects": r.disconnects,
        "ttft_ms": _stats(r.ttft_ms),
        "ttft_long_ms": _stats(r.ttft_long_ms),
        "decode_tok_s": _stats(r.decode_tok_s),
        "completion_tokens": r.completion_tokens,
        "aggregate_tok_s": round(r.completion_tokens / elapsed, 2) if elapsed > 0 else None,
        "reused_tokens": r.reused_tokens,
        "agent_followups": r.agent_followups,
        "agent_prompt_tokens": r.agent_prompt_tokens,
        "agent_reused_tokens": r.agent_reused_tokens,
        "agent_reuse_ratio": round(r.agent_reused_tokens / r.agent_prompt_tokens, 3)
        if r.agent_prompt_tokens else None,
        "long_prompt_tokens": list(r.long_prompt_tokens),
    }


@events.test_start.add_listener
def _on_start(environment: Any, **_: Any) -> None:
    global RESULTS
    RESULTS = Results()


@events.test_stop.add_listener
def _on_stop(environment: Any, **_: Any) -> None:
    if SUMMARY_PATH:
        with open(SUMMARY_PATH, "w") as f:
            json.dump(summary(), f, indent=2)


# ---- prompts ----------------------------------------------------------------------------


def long_prompt(rnd: random.Random, tokens: int = LONG_TOKENS) -> str:
    """About `tokens` tokens of varied, repetitive text, unique from its first line on."""
    head = f"Log {rnd.randrange(10**9)}: notes on {rnd.choice(TOPICS)}."
    lines = [head]
    for i in range(max(1, round(tokens / TOKENS_PER_SENTENCE))):
        a, b, c = rnd.sample(WORDS, 3)
        lines.append(f"Entry {i}: the {a} {b} stored {rnd.randrange(1000)} units of {c}.")
    lines.append("Which entry stored the most units? Answer briefly.")
    return "\n".join(lines)


# ---- the client -------------------------------------------------------------------------


class RequestFailed(Exception):
    pass


@dataclass
class Stream:
    text: str = ""
    usage: dict[str, Any] | None = None
    ttft_ms: float | None = None
    first: float | None = None
    last: float | None = None
    done: bool = False
    finish_reason: str | None = None


class OpenAIUser(User):
    """Shared plumbing: one HTTP session per user, request and metric events fired by hand
    (so a stream is timed to its end, not to its headers)."""

    abstract = True
    wait_time = between(0.2, 1.0)

    def on_start(self) -> None:
        self.http = requests.Session()
        self.rnd = random.Random()

    def on_stop(self) -> None:
        self.http.close()

    # -- events --

    def report(self, name: str, started: float, length: int = 0,
               exc: Exception | None = None) -> None:
        ms = (time.perf_counter() - started) * 1000
        self.environment.events.request.fire(request_type="POST", name=name, response_time=ms,
                                             response_length=length, exception=exc, context={})
        RESULTS.count(RESULTS.failures if exc else RESULTS.requests, name)

    def metric(self, name: str, value: float) -> None:
        self.environment.events.request.fire(request_type="METRIC", name=name,
                                             response_time=value, response_length=0,
                                             exception=None, context={})

    # -- requests --

    def post(self, path: str, body: dict[str, Any], stream: bool) -> requests.Response:
        return self.http.post(self.host.rstrip("/") + path, json=body, stream=stream,
                              timeout=TIMEOUT)

    def refused(self, name: str, started: float, resp: requests.Response) -> bool:
        """Handle a non-200 answer (True); a 429 with Retry-After counts as a success."""
        if resp.status_code == 200:
            return False
        body = resp.text[:200]
        resp.close()
        if resp.status_code == 429:
            retry = resp.headers.get("Retry-After")
            if retry is None:
                with RESULTS.lock:
                    RESULTS.rate_limited_without_retry_after += 1
                self.report(name, started, exc=RequestFailed("429 without Retry-After"))
                return True
            with RESULTS.lock:
                RESULTS.rate_limited += 1
            self.report(f"{name} [429]", started)
            try:
                wait = float(retry)
            except ValueError:
                wait = MAX_BACKOFF_S
            self.metric("retry_after_s", wait)
            time.sleep(min(max(wait, 0.0), MAX_BACKOFF_S))
            return True
        self.report(name, started, exc=RequestFailed(f"HTTP {resp.status_code}: {body}"))
        return True

    def chat_stream(self, name: str, messages: list[dict[str, Any]], max_tokens: int,
                    hang_up_after: int | None = None) -> Stream | None:
        """Stream one chat; None when it was refused or failed (already reported)."""
        body = {"messages": messages, "max_tokens": max_tokens, "stream": True,
                "stream_options": {"include_usage": True}, "temperature": 0.7,
                "seed": self.rnd.randrange(2**31)}
        started = time.perf_counter()
        out = Stream()
        try:
            resp = self.post("/v1/chat/completions", body, stream=True)
            if self.refused(name, started, resp):
                return None
            with resp:
                pieces = 0
                for line in resp.iter_lines(decode_unicode=True):
                    if not line or not line.startswith("data:"):
                        continue  # blank separators and ": keep-alive" comments
                    data = line[5:].strip()
                    if data == "[DONE]":
                        out.done = True
                        break
                    chunk = json.loads(data)
                    if "error" in chunk:
                        raise RequestFailed(f"error event: {chunk['error']}")
                    if chunk.get("usage"):
                        out.usage = chunk["usage"]
                    for choice in chunk.get("choices", []):
                        text = (choice.get("delta") or {}).get("content") or ""
                        if text:
                            now = time.perf_counter()
                            if out.first is None:
                                out.first = now
                                out.ttft_ms = (now - started) * 1000
                            out.last = now
                            out.text += text
                            pieces += 1
                        out.finish_reason = choice.get("finish_reason") or out.finish_reason
                    if hang_up_after is not None and pieces >= hang_up_after:
                        break  # leaving the `with` closes the connection mid-stream
            if hang_up_after is None:
                if not out.done:
                    raise RequestFailed("stream ended without [DONE]")
                if out.usage is None or out.finish_reason is None:
                    raise RequestFailed("stream without finish_reason or usage")
            elif out.first is None:
                raise RequestFailed("no token before hanging up")
        except (requests.RequestException, ValueError, RequestFailed) as exc:
            self.report(name, started, len(out.text), exc)
            return None
        self.report(name, started, len(out.text))
        self._record(out)
        return out

    def _record(self, out: Stream) -> None:
        if out.usage:
            n = int(out.usage.get("completion_tokens", 0))
            with RESULTS.lock:
                RESULTS.completion_tokens += n
                RESULTS.reused_tokens += cached_tokens(out.usage)
            if n > 1 and out.first is not None and out.last is not None \
                    and out.last > out.first:
                rate = (n - 1) / (out.last - out.first)
                RESULTS.decode_tok_s.append(rate)
                self.metric("decode_tok_s", rate)

    def ttft(self, out: Stream, long: bool = False) -> None:
        if out.ttft_ms is None:
            return
        (RESULTS.ttft_long_ms if long else RESULTS.ttft_ms).append(out.ttft_ms)
        self.metric("ttft_long_ms" if long else "ttft_ms", out.ttft_ms)


def cached_tokens(usage: dict[str, Any]) -> int:
    details = usage.get("prompt_tokens_details") or {}
    return int(details.get("cached_tokens") or 0)


# ---- the users --------------------------------------------------------------------------


class ShortChatUser(OpenAIUser):
    weight = 6

    @task
    def short_chat(self) -> None:
        ask = self.rnd.choice(ASKS).format(t=self.rnd.choice(TOPICS))
        out = self.chat_stream("chat short", [{"role": "user", "content": ask}],
                               self.rnd.randint(16, 32))
        if out is not None:
            self.ttft(out)


class AgentUser(OpenAIUser):
    """Continues its own conversation for AGENT_TURNS turns, then starts a new one."""

    weight = 4
    wait_time = between(0.1, 0.5)

    def on_start(self) -> None:
        super().on_start()
        self.messages: list[dict[str, Any]] = []

    @task
    def turn(self) -> None:
        if not self.messages or len(self.messages) >= 1 + 2 * AGENT_TURNS:
            goal = self.rnd.choice(AGENT_GOALS)
            self.messages = [
                {"role": "system", "content": f"You are agent #{self.rnd.randrange(10**6)}. "
                 "Work step by step and keep every answer short."},
                {"role": "user", "content": f"Help me {goal}. Start with step 1."}]
        follow_up = len(self.messages) > 2
        out = self.chat_stream("chat agent", self.messages, 24)
        if out is None:
            self.messages = []  # start over: the history may not match the server's any more
            return
        self.ttft(out)
        if follow_up and out.usage:
            reused = cached_tokens(out.usage)
            with RESULTS.lock:
                RESULTS.agent_followups += 1
                RESULTS.agent_prompt_tokens += int(out.usage.get("prompt_tokens", 0))
                RESULTS.agent_reused_tokens += reused
            self.metric("prefix_reused_tokens", reused)
        n = (len(self.messages) + 1) // 2
        self.messages += [{"role": "assistant", "content": out.text},
                          {"role": "user", "content": self.rnd.choice(FOLLOW_UPS).format(n=n)}]


class CompletionUser(OpenAIUser):
    weight = 3

    @task
    def completion(self) -> None:
        topic = self.rnd.choice(TOPICS)
        body = {"prompt": f"A short encyclopedia entry about {topic}:\n", "max_tokens": 16,
                "temperature": 0.7, "seed": self.rnd.randrange(2**31)}
        started = time.perf_counter()
        name = "completion"
        try:
            resp = self.post("/v1/completions", body, stream=False)
            if self.refused(name, started, resp):
                return
            data = resp.json()
            text = data["choices"][0]["text"]
            usage = data["usage"]
        except (requests.RequestException, ValueError, KeyError, IndexError) as exc:
            self.report(name, started, exc=RequestFailed(f"{type(exc).__name__}: {exc}"))
            return
        self.report(name, started, len(text))
        with RESULTS.lock:
            RESULTS.completion_tokens += int(usage.get("completion_tokens", 0))


class DisconnectUser(OpenAIUser):
    """Asks for 32 tokens and hangs up after 2-4 of them."""

    weight = 2

    @task
    def hang_up(self) -> None:
        ask = self.rnd.choice(ASKS).format(t=self.rnd.choice(TOPICS))
        out = self.chat_stream("chat disconnect", [{"role": "user", "content": ask}], 32,
                               hang_up_after=self.rnd.randint(2, 4))
        if out is not None:
            with RESULTS.lock:
                RESULTS.disconnects += 1
            self.ttft(out)


class LongPromptUser(OpenAIUser):
    """One user sending ~2k-token prompts (each unique from its first line on: no reuse)."""

    fixed_count = 1
    wait_time = between(5.0, 10.0)

    @task
    def long_chat(self) -> None:
        out = self.chat_stream("chat long", [{"role": "user", "content": long_prompt(self.rnd)}],
                               8)
        if out is None:
            return
        self.ttft(out, long=True)
        if out.usage:
            tokens = int(out.usage.get("prompt_tokens", 0))
            RESULTS.long_prompt_tokens.append(tokens)
            self.metric("long_prompt_tokens", tokens)
