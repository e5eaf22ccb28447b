"""`slotserve route` in front of two real `slotserve serve` replicas (SmolLM2) on 127.0.0.1.

Which replica served a request is read from the replicas themselves (their /metrics counters),
not from the router: a continuation lands where its prefix is (that replica reports reused
prompt tokens, the other none), new conversations spread over both, a killed replica is taken
out while requests keep succeeding, a replica that dies under a request gives its client a 502
(or an error event in its stream) at once, and a replica started again is taken back in.

The replicas and the router start once for the module (about 15 s); the test that kills a
replica runs last.
"""

from __future__ import annotations

import json
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest

from slotserve.router.affinity import chain_for, tenant_of
from slotserve.router.replicas import Pool

pytestmark = pytest.mark.timeout(300)

GREEDY = {"temperature": 0, "max_tokens": 6}


# ---- the keys and the choice, without servers ---------------------------------------------


def test_a_continuation_walks_the_chain_of_its_first_turn() -> None:
    tenant = tenant_of({})
    first = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    again = [{"content": "Be brief.", "role": "system"}, {"role": "user", "content": "Hi"},
             {"role": "assistant", "content": "Hello! How can I help you today?"},
             {"role": "user", "content": "Name a colour."}]
    a = chain_for("/v1/chat/completions", {"messages": first}, tenant)
    b = chain_for("/v1/chat/completions", {"messages": again}, tenant)
    assert b.keys[:2] == a.keys and len(b.keys) == 4  # key order does not matter
    # the answer after the matched prefix was generated on that replica: it counts
    assert b.matched_chars(1) / b.total > 0.7
    other = chain_for("/v1/chat/completions", {"messages": first},
                      tenant_of({"Authorization": "Bearer k2"}))
    assert not set(other.keys) & set(a.keys)  # another tenant never matches
    salted = chain_for("/v1/chat/completions", {"messages": first, "cache_salt": "x"}, tenant)
    assert not set(salted.keys) & set(a.keys)
    anth = chain_for("/v1/messages", {"system": "Be brief.", "messages": first[1:]}, tenant)
    assert anth.keys and not set(anth.keys) & set(a.keys)
    keyed = chain_for("/v1/messages", {"messages": first, "metadata": {"user_id": "u1"}},
                      tenant)
    assert keyed.conversation is not None
    long = "word " * 200
    c1 = chain_for("/v1/completions", {"prompt": long}, tenant)
    c2 = chain_for("/v1/completions", {"prompt": long + "and more words"}, tenant)
    assert c2.keys[:len(c1.keys) - 1] == c1.keys[:-1]
    assert chain_for("/v1/models", {}, tenant).keys == []


def test_the_pool_prefers_the_prefix_until_it_is_overloaded() -> None:
    pool = Pool(["http://a", "http://b"], balance_abs=2, balance_rel=1.5)
    a, b = pool.replicas.values()
    for r in (a, b):
        pool.mark_up(r)
    tenant = tenant_of({})
    msgs = [{"role": "user", "content": "tell me about the sea"}]
    chain = chain_for("/v1/chat/completions", {"messages": msgs}, tenant)
    first = pool.choose(chain)
    assert first is not None and first.reason == "load"
    first.replica.routed += 1
    pool.record(first.replica, chain)
    other = pool.choose(chain_for("/v1/chat/completions",
                                  {"messages": [{"role": "user", "content": "x"}]}, tenant))
    assert other is not None and other.replica is not first.replica  # ties spread
    cont = chain_for("/v1/chat/completions", {"messages": [
        *msgs, {"role": "assistant", "content": "It is wide."},
        {"role": "user", "content": "and deep?"}]}, tenant)
    again = pool.choose(cont)
    assert again is not None and again.replica is first.replica and again.reason == "prefix"
    first.replica.in_flight = 3  # 3 - 0 > 2 and 3 > 1.5 * 0: load wins
    moved = pool.choose(cont)
    assert moved is not None and moved.replica is not first.replica
    first.replica.in_flight = 0
    pool.mark_failed(first.replica, "refused", at_once=True)
    assert pool.choose(cont).replica is not first.replica  # type: ignore[union-attr]
    pool.mark_up(first.replica)  # back in, with nothing recorded for it
    assert pool.choose(cont).reason == "load"  # type: ignore[union-attr]
    with pytest.raises(ValueError, match="twice"):
        Pool(["http://a", "http://a"])


# ---- two real replicas and the router -----------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def slotserve_command() -> list[str]:
    script = Path(sys.executable).with_name("slotserve")
    return [str(script)] if script.exists() else [sys.executable, "-m", "slotserve.cli"]


@dataclass
class Proc:
    args: list[str]
    url: str
    log: Path
    proc: subprocess.Popen[bytes] | None = None

    def start(self) -> Proc:
        with self.log.open("ab") as out:
            self.proc = subprocess.Popen(self.args, stdout=out, stderr=subprocess.STDOUT)
        return self

    def wait_healthy(self, timeout: float = 180) -> None:
        deadline = time.monotonic() + timeout
        while True:
            assert self.proc is not None and self.proc.poll() is None, (
                f"{self.args} exited: {self.log.read_text()[-3000:]}")
            assert time.monotonic() < deadline, f"not healthy: {self.log.read_text()[-3000:]}"
            try:
                if httpx.get(self.url + "/health", timeout=5).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.1)

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(30)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


@dataclass
class Cluster:
    replicas: list[Proc]
    router: Proc

    def counters(self) -> list[dict[str, float]]:
        return [metrics(r.url) for r in self.replicas]

    def state(self) -> list[dict[str, object]]:
        return httpx.get(self.router.url + "/replicas", timeout=10).json()["replicas"]


def metrics(url: str) -> dict[str, float]:
    text = httpx.get(url + "/metrics", timeout=10).text
    out: dict[str, float] = {}
    for name in ("slotserve_prompt_tokens_total", "slotserve_prompt_tokens_reused_total"):
        found = re.search(rf"^{name} (\S+)$", text, re.M)
        out[name] = float(found.group(1)) if found else 0.0
    return out


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    tmp = tmp_path_factory.mktemp("router")
    replicas = []
    for i in range(2):
        port = free_port()
        replicas.append(Proc([*slotserve_command(), "serve", "--port", str(port),
                              "--max-slots", "2"], f"http://127.0.0.1:{port}",
                             tmp / f"replica{i}.log"))
    port = free_port()
    router = Proc([*slotserve_command(), "--log-level", "info", "route",
                   *(a for r in replicas for a in ("--replica", r.url)), "--port", str(port),
                   "--health-interval", "0.3", "--health-failures", "2"],
                  f"http://127.0.0.1:{port}", tmp / "router.log")
    try:
        for p in (*replicas, router):
            p.start()
        for p in (*replicas, router):
            p.wait_healthy()
        deadline = time.monotonic() + 30
        while sum(bool(r["healthy"]) for r in Cluster(replicas, router).state()) < 2:
            assert time.monotonic() < deadline, "the router never saw both replicas healthy"
            time.sleep(0.1)
        yield Cluster(replicas, router)
    finally:
        for p in (router, *replicas):
            p.stop()


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120)


def served_by(before: list[dict[str, float]], after: list[dict[str, float]]) -> list[int]:
    return [i for i, (b, a) in enumerate(zip(before, after, strict=True))
            if a["slotserve_prompt_tokens_total"] > b["slotserve_prompt_tokens_total"]]


def test_new_conversations_spread(cluster: Cluster) -> None:
    c = client(cluster.router.url)
    homes = set()
    for topic in ("owls", "tides"):
        before = cluster.counters()
        c.chat.completions.create(model="default", messages=[
            {"role": "user", "content": f"One fact about {topic}, please."}], **GREEDY)
        homes.update(served_by(before, cluster.counters()))
    assert homes == {0, 1}


def test_a_continuation_goes_where_its_prefix_is(cluster: Cluster) -> None:
    c = client(cluster.router.url)
    turn = [{"role": "user", "content": "Name three rivers in Europe."}]
    before = cluster.counters()
    r1 = c.chat.completions.create(model="default", messages=turn, **GREEDY)
    mid = cluster.counters()
    (home,) = served_by(before, mid)
    turn += [{"role": "assistant", "content": r1.choices[0].message.content},
             {"role": "user", "content": "Which is the longest?"}]
    r2 = c.chat.completions.create(model="default", messages=turn, **GREEDY)
    after = cluster.counters()
    assert served_by(mid, after) == [home]
    reused = [a["slotserve_prompt_tokens_reused_total"] - m["slotserve_prompt_tokens_reused_total"]
              for m, a in zip(mid, after, strict=True)]
    assert reused[home] > 0 and reused[1 - home] == 0
    assert r2.usage is not None and r2.usage.prompt_tokens_details is not None
    assert r2.usage.prompt_tokens_details.cached_tokens == reused[home]


def test_streams_pass_through_unchanged(cluster: Cluster) -> None:
    msgs = [{"role": "user", "content": "Say hello in French."}]
    direct = client(cluster.replicas[0].url).chat.completions.create(
        model="default", messages=msgs, **GREEDY).choices[0].message.content
    stream = client(cluster.router.url).chat.completions.create(
        model="default", messages=msgs, stream=True, **GREEDY)
    assert "".join(ch.choices[0].delta.content or "" for ch in stream
                   if ch.choices) == direct
    # Anthropic Messages: the replica's event lines, as it wrote them
    body = {"model": "default", "max_tokens": 8, "temperature": 0, "stream": True,
            "messages": msgs}
    with httpx.stream("POST", cluster.router.url + "/v1/messages", json=body,
                      timeout=60) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith(
            "text/event-stream")
        events = [line.removeprefix("event: ") for line in r.iter_lines()
                  if line.startswith("event: ")]
    assert events[0] == "message_start" and events[-1] == "message_stop"
    assert client(cluster.router.url).models.list().data[0].id
    missing = httpx.get(cluster.router.url + "/nowhere", timeout=10)
    assert missing.status_code == 404 and missing.json()["error"]["message"]


def test_a_stored_response_is_continued_where_it_is(cluster: Cluster) -> None:
    body = {"model": "default", "input": "Name a fruit.", "max_output_tokens": 6,
            "temperature": 0, "stream": True}
    with httpx.stream("POST", cluster.router.url + "/v1/responses", json=body,
                      timeout=60) as r:
        assert r.status_code == 200
        home = r.headers["x-slotserve-replica"]
        events = [json.loads(line.removeprefix("data: ")) for line in r.iter_lines()
                  if line.startswith("data: ")]  # stored once the stream has ended
    created = events[0]
    assert created["type"] == "response.created"
    assert events[-1]["type"] in ("response.completed", "response.incomplete")
    for _ in range(2):  # whatever the load says, the stored response is on one replica only
        nxt = httpx.post(cluster.router.url + "/v1/responses", json={
            "model": "default", "input": "And a vegetable?", "max_output_tokens": 6,
            "temperature": 0, "previous_response_id": created["response"]["id"]}, timeout=60)
        assert nxt.status_code == 200, nxt.text
        assert nxt.headers["x-slotserve-replica"] == home
        assert nxt.headers["x-slotserve-route"] == "response"


def _long_request(url: str, stream: bool, result: dict[str, object]) -> None:
    body = {"model": "default", "prompt": "Once upon a time", "max_tokens": 4000,
            "ignore_eos": True, "temperature": 0, "stream": stream}
    started = time.monotonic()
    try:
        if stream:
            with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as r:
                result["status"] = r.status_code
                lines = result.setdefault("lines", [])
                for line in r.iter_lines():
                    if line:
                        lines.append(line)  # type: ignore[attr-defined]
        else:
            r = httpx.post(url + "/v1/completions", json=body, timeout=120)
            result["status"], result["body"] = r.status_code, r.json()
    except Exception as exc:  # reported to the test
        result["error"] = repr(exc)
    result["seconds"] = time.monotonic() - started


def _run_until_busy(cluster: Cluster, stream: bool) -> tuple[threading.Thread, dict, int]:
    result: dict[str, object] = {}
    t = threading.Thread(target=_long_request, args=(cluster.router.url, stream, result))
    t.start()
    deadline = time.monotonic() + 60
    while True:
        busy = [i for i, r in enumerate(cluster.state()) if r["in_flight"]]
        if busy:
            return t, result, busy[0]
        assert time.monotonic() < deadline and t.is_alive(), result
        time.sleep(0.05)


def test_a_replica_that_dies_is_taken_out_and_back_in(cluster: Cluster) -> None:
    # a stream whose replica is killed ends with an error event, not a hang
    t, result, victim = _run_until_busy(cluster, stream=True)
    deadline = time.monotonic() + 60
    while len(result.get("lines", [])) < 3:  # type: ignore[arg-type]
        assert time.monotonic() < deadline and t.is_alive(), result
        time.sleep(0.05)
    cluster.replicas[victim].kill()
    t.join(60)
    assert not t.is_alive(), "the client hung on a dead replica"
    lines = result["lines"]
    assert result["status"] == 200 and isinstance(lines, list) and len(lines) > 2
    last = json.loads(lines[-1].removeprefix("data: "))
    assert last["error"]["code"] == "replica_failed", last
    # the next requests succeed on the other replica, and the dead one is out
    c = client(cluster.router.url)
    for topic in ("rain", "snow", "hail"):
        r = c.chat.completions.create(model="default", messages=[
            {"role": "user", "content": f"A word about {topic}."}], **GREEDY)
        assert r.choices[0].message.content
    state = cluster.state()
    assert not state[victim]["healthy"] and state[1 - victim]["healthy"]
    # started again on its port, it is taken back in
    cluster.replicas[victim].start().wait_healthy()
    deadline = time.monotonic() + 30
    while not cluster.state()[victim]["healthy"]:
        assert time.monotonic() < deadline, "the restarted replica was not taken back in"
        time.sleep(0.1)
    # a non-streaming request whose replica dies gets a 502 in OpenAI's shape
    t, result, victim = _run_until_busy(cluster, stream=False)
    cluster.replicas[victim].kill()
    t.join(60)
    assert not t.is_alive(), "the client hung on a dead replica"
    assert result.get("status") == 502, result
    err = result["body"]["error"]  # type: ignore[index]
    assert err["code"] == "replica_failed" and "failed during the request" in err["message"]


def test_no_replica_left_is_a_503(tmp_path: Path) -> None:
    port, dead = free_port(), free_port()
    router = Proc([*slotserve_command(), "route", "--replica", f"http://127.0.0.1:{dead}",
                   "--port", str(port)], f"http://127.0.0.1:{port}", tmp_path / "r.log")
    router.start()
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                h = httpx.get(router.url + "/health", timeout=5)
                break
            except httpx.TransportError:
                assert time.monotonic() < deadline, router.log.read_text()
                time.sleep(0.1)
        assert h.status_code == 503
        r = httpx.post(router.url + "/v1/messages", json={"messages": []}, timeout=10)
        assert r.status_code == 503 and r.json()["type"] == "error"
        assert r.headers["retry-after"] == "1"
    finally:
        router.stop()
