"""An engine never dies silently: crashes injected into the Batcher's loop and into a Slot.

- A Slot's handler that raises is contained (actors.base): only that request fails, its peer
  finishes, and the slot serves the next request with the same tokens as ever.
- An exception escaping `Batcher.run` fails the engine (Engine._supervise says why it is not
  restarted): every request ends with an error that gives the reason, new ones are refused
  with a 503 that gives it (not a 500), /health answers 503 with it, shutdown is prompt, and
  `slotserve serve` exits 1.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from engine_harness import EngineHarness, wait_until

from slotserve.actors.batcher import Batcher
from slotserve.actors.messages import StepDone
from slotserve.actors.slot import Slot
from slotserve.api import server
from slotserve.api.app import create_app
from slotserve.api.server import BackgroundServer
from slotserve.engine import Completion, EngineConfig, EngineFailedError

HELLO = [{"role": "user", "content": "Hello there"}]
OPTIONS: dict[str, Any] = {"max_tokens": 12, "ignore_eos": True, "temperature": 0}


def crash_plan_once(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Batcher._plan raises on its next call (once); returns the list that counts calls."""
    calls: list[int] = []
    plan = Batcher._plan

    def crashing(self: Batcher) -> Any:
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("injected batcher crash")
        return plan(self)

    monkeypatch.setattr(Batcher, "_plan", crashing)
    return calls




# ---- a Slot's handler raises: contained ------------------------------------------------


@pytest.fixture(scope="module")
def one_slot() -> Iterator[EngineHarness]:
    h = EngineHarness(max_slots=1)
    yield h
    h.close()


def test_slot_crash_fails_only_its_request(one_slot: EngineHarness,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    engine = one_slot.engine
    before = one_slot.call(lambda: engine.chat_complete(HELLO, **OPTIONS))
    assert before.finish_reason == "length" and len(before.token_ids) == 12
    handle = Slot.handle
    crashed: list[int] = []

    def crashing(self: Slot, msg: Any) -> None:
        # the third step result of the first request crashes the slot's handler
        if isinstance(msg, StepDone) and not crashed and self.generated == 2:
            crashed.append(self.id)
            raise RuntimeError("injected slot crash")
        handle(self, msg)

    monkeypatch.setattr(Slot, "handle", crashing)

    async def run() -> tuple[Completion, Completion]:
        # the second waits in the queue for the only slot, the one that crashes
        return await asyncio.gather(engine.chat_complete(HELLO, **OPTIONS),
                                    engine.chat_complete(HELLO, **OPTIONS))

    failed, peer = one_slot.call(run)
    assert crashed == [0]
    assert failed.finish_reason == "error" and "injected slot crash" in (failed.error or "")
    assert failed.token_ids == before.token_ids[:2]
    # the peer, served next by the slot that crashed, is untouched: the same tokens as ever
    assert peer.finish_reason == "length" and peer.token_ids == before.token_ids
    after = one_slot.call(lambda: engine.chat_complete(HELLO, **OPTIONS))
    assert after.token_ids == before.token_ids
    assert engine.failure is None and engine.ready
    assert wait_until(lambda: not any(s.busy or s.in_flight for s in engine.slots), 60)


# ---- the Batcher's loop raises: the engine fails ----------------------------------------


def test_batcher_crash_fails_the_engine_in_process(monkeypatch: pytest.MonkeyPatch) -> None:
    h = EngineHarness(max_slots=2, max_queue=4)
    engine = h.engine
    try:
        crash_plan_once(monkeypatch)

        async def run() -> list[Completion]:
            # two running (or placed) and one queued: all three must end, with the reason
            return await asyncio.gather(*(engine.chat_complete(HELLO, **OPTIONS)
                                          for _ in range(3)))

        results = h.call(run, timeout=60)
        for r in results:
            assert r.finish_reason == "error"
            assert "the engine failed" in (r.error or "") and "injected batcher crash" in r.error
        assert engine.failure is not None and "injected batcher crash" in engine.failure
        assert not engine.ready
        assert not any(s.busy for s in engine.slots) and not engine.admission.queue
        with pytest.raises(EngineFailedError, match="injected batcher crash"):
            h.call(lambda: engine.chat_complete(HELLO, **OPTIONS))
        reason = h.call(engine.wait_failed)
        assert reason == engine.failure
    finally:
        started = time.monotonic()
        h.close()
        # no 30 s drain: nothing is left to finish (a bound well under it, loose enough for a
        # loaded machine)
        assert time.monotonic() - started < 20


def test_batcher_crash_over_http(monkeypatch: pytest.MonkeyPatch) -> None:
    """Served: the request in flight gets a 503 that says why, and so do new requests and
    /health; /slots shows every slot free. The server keeps answering so (stop_on_failure
    off), and serve() reports the failure when it stops."""
    srv = BackgroundServer(create_app(EngineConfig(max_slots=2, max_queue=4)),
                           stop_on_failure=False).start()
    try:
        crash_plan_once(monkeypatch)
        with httpx.Client(base_url=srv.url, timeout=60) as c:
            r = c.post("/v1/chat/completions", json={"messages": HELLO, **OPTIONS})
            assert r.status_code == 503, r.text
            err = r.json()["error"]
            assert "the engine failed" in err["message"] and "injected" in err["message"]
            assert err["type"] == "server_error"
            health = c.get("/health")
            assert health.status_code == 503
            body = health.json()
            assert body["status"] == "failed"
            assert "injected batcher crash" in body["error"]["message"]
            assert body["error"]["type"] == "server_error"
            for path, payload in (
                    ("/v1/chat/completions", {"messages": HELLO, **OPTIONS, "stream": True}),
                    ("/v1/completions", {"prompt": "Hi", "max_tokens": 2}),
                    ("/v1/messages", {"model": "default", "max_tokens": 2, "messages": HELLO})):
                r = c.post(path, json=payload)
                assert r.status_code == 503, (path, r.text)
                assert "injected batcher crash" in r.text, (path, r.text)
            slots = c.get("/slots").json()
            assert slots["status"] == "failed" and not any(s["busy"] for s in slots["slots"])
            assert 'slotserve_ready 0.0' in c.get("/metrics").text
    finally:
        srv.stop()
    assert isinstance(srv.error, EngineFailedError)
    assert "injected batcher crash" in str(srv.error)


def test_serve_exits_1_when_the_engine_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    """`slotserve serve` (server.main) returns 1, promptly, when the step loop crashes while
    serving: a supervisor then starts it again."""
    async def crash(self: Batcher) -> None:
        raise RuntimeError("injected batcher crash")

    monkeypatch.setattr(Batcher, "run", crash)
    args = argparse.Namespace(model=None, host="127.0.0.1", port=0, max_slots=1, max_queue=1,
                              log_format="console", log_level="warning")
    started = time.monotonic()
    assert server.main(args) == 1
    assert time.monotonic() - started < 60  # a model load and a prompt stop, no 30 s drain
