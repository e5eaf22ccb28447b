"""Prometheus metrics: request outcomes counted as they happen, engine state read per scrape.

Each app owns its registry, so several servers (tests, benchmarks) in one process never share
or collide on counters.
"""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator, Callable, Iterator
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.exposition import generate_latest
from prometheus_client.registry import Collector

from slotserve.actors.messages import Delta

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5,
                   5.0, 10.0)
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)


class EngineCollector(Collector):
    """Gauges computed from the live engine at scrape time (nothing to keep in sync)."""

    def __init__(self, engine: Callable[[], Any]) -> None:
        self.engine = engine

    def collect(self) -> Iterator[Any]:
        eng = self.engine()
        ready = GaugeMetricFamily("slotserve_ready", "1 when the server takes requests")
        ready.add_metric([], 1.0 if eng is not None and eng.ready and not eng.closing else 0.0)
        yield ready
        if eng is None or eng.admission is None:
            return
        kv = eng.kv_summary()
        gauges = {
            "slotserve_requests_running": ("Requests holding a slot", kv["running"]),
            "slotserve_requests_queued": ("Requests waiting for a slot", kv["queued"]),
            "slotserve_slots_busy": ("Slots serving a request", kv["running"]),
            "slotserve_slots_total": ("Configured slots", len(eng.slots)),
            "slotserve_kv_bytes_used": ("KV cache bytes resident (held or idle)", kv["used"]),
            "slotserve_kv_bytes_busy": ("KV bytes committed to running requests",
                                        kv["busy"]),
            "slotserve_kv_bytes_budget": ("KV cache byte budget", kv["budget"]),
        }
        for name, (doc, value) in gauges.items():
            g = GaugeMetricFamily(name, doc)
            g.add_metric([], float(value))
            yield g
        pages = GaugeMetricFamily("slotserve_kv_pages", "KV pages by state (budget, resident, "
                                  "held by running requests, idle in the prefix cache, shared "
                                  "by several, promised)", labels=["state"])
        for state, n in kv["pages"].items():
            pages.add_metric([state], float(n))
        yield pages
        for name, doc, counts in (
            ("slotserve_kv_preemptions", "Running requests preempted, by reason",
             kv["preemptions"]),
            ("slotserve_kv_evictions", "Idle KV pages evicted, by reason", kv["evictions"]),
        ):
            c = CounterMetricFamily(name, doc, labels=["reason"])
            for reason, n in counts.items():
                c.add_metric([reason], float(n))
            yield c
        st = eng.batcher.stats
        for name, doc, value in (
            ("slotserve_engine_steps", "Fused model steps run", st.steps),
            ("slotserve_engine_prefill_tokens", "Prompt tokens prefilled", st.prefill_tokens),
            ("slotserve_engine_model_seconds", "Seconds spent in model steps", st.model_seconds),
        ):
            c = CounterMetricFamily(name, doc)
            c.add_metric([], float(value))
            yield c


class Metrics:
    def __init__(self, engine: Callable[[], Any]) -> None:
        r = self.registry = CollectorRegistry()
        self.prompt_tokens = Counter("slotserve_prompt_tokens", "Prompt tokens of finished "
                                     "requests", registry=r)
        self.generated_tokens = Counter("slotserve_generation_tokens", "Tokens generated",
                                        registry=r)
        self.reused_tokens = Counter("slotserve_prompt_tokens_reused", "Prompt tokens served "
                                     "from a retained KV prefix", registry=r)
        self.requests = Counter("slotserve_requests", "Finished requests by finish reason",
                                ["finish_reason"], registry=r)
        self.rejections = Counter("slotserve_rejections", "Requests refused before running, "
                                  "by reason", ["reason"], registry=r)
        self.ttft = Histogram("slotserve_time_to_first_token_seconds", "Arrival to first token",
                              buckets=TTFT_BUCKETS, registry=r)
        self.itl = Histogram("slotserve_inter_token_latency_seconds", "Time between streamed "
                             "tokens", buckets=LATENCY_BUCKETS, registry=r)
        r.register(EngineCollector(engine))

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST

    def reject(self, reason: str) -> None:
        self.rejections.labels(reason=reason).inc()

    async def observe(self, deltas: AsyncGenerator[Delta, None]) -> AsyncGenerator[Delta, None]:
        """Pass deltas through, timing tokens and counting the outcome."""
        last: float | None = None
        outcome = "cancelled"  # unless a final delta says otherwise: the client left
        try:
            async for d in deltas:
                if d.token_ids:
                    now = time.perf_counter()
                    if last is not None:
                        self.itl.observe((now - last) / len(d.token_ids))
                    last = now
                if d.finish_reason is not None:
                    outcome = d.finish_reason
                    self._finished(d)
                yield d
        finally:
            self.requests.labels(finish_reason=outcome).inc()
            await deltas.aclose()  # cancels a request still running

    def _finished(self, d: Delta) -> None:
        if d.ttft is not None:
            self.ttft.observe(d.ttft)
        if d.usage is not None:
            self.prompt_tokens.inc(d.usage.prompt_tokens)
            self.generated_tokens.inc(d.usage.completion_tokens)
            self.reused_tokens.inc(d.usage.reused_tokens)
