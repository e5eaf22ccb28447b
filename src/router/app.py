"""The router's HTTP app: every `/v1/...` request forwarded to one replica, bytes unchanged.

    app = create_app(["http://10.0.0.1:8000", "http://10.0.0.2:8000"])
    await serve(app, host="0.0.0.0", port=8000)          # slotserve.router.server

A request is read whole (bodies are small next to their generation), its prefix chain is
computed (`affinity`), `Pool.choose` picks the replica, and the replica's answer comes back as
it was sent: status, headers, and the body chunk by chunk as the replica writes it, so SSE
streams (OpenAI `data:` lines, Anthropic `event:` lines, keepalive comments) pass through as
they are. The router never parses a stream beyond the first bytes of a Responses answer (its
`resp_...` id, so a later `previous_response_id` reaches the replica that stored it).

Failures, always an answer and never a hang:
- a replica that refuses the connection is taken out at once and the request goes to the next
  (nothing reached it);
- a replica that fails after it took the request (dies, drops the connection, or is taken
  out by the health checks while the request waits on it) ends the request with a 502 in the
  endpoint's error shape (OpenAI or Anthropic); a stream already under way ends with an error
  event in its dialect (`data: {"error": ...}`, Anthropic's `event: error`, the Responses
  API's `event: error`), then closes;
- with no healthy replica: 503 with Retry-After.
A client that goes away closes the upstream connection, which the replica takes as its client
leaving (it cancels the request and frees the slot).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
from collections.abc import AsyncIterator, Awaitable
from typing import Any, TypeVar

import httpx
import structlog
from quart import Quart, Response, request
from werkzeug.exceptions import HTTPException

from slotserve.api.disconnect import ClientWatch, client_link
from slotserve.router.affinity import chain_for, tenant_of
from slotserve.router.replicas import Pool, Replica

T = TypeVar("T")

log = structlog.get_logger("slotserve.router")

# hop-by-hop headers (RFC 9110 7.6.1) and those the next hop sets itself
HOP = frozenset({"connection", "keep-alive", "proxy-connection", "te", "trailer",
                 "transfer-encoding", "upgrade", "host", "content-length"})
RESPONSE_ID = re.compile(rb'"id"\s*:\s*"(resp_[A-Za-z0-9_-]+)"')
ID_SCAN_BYTES = 4096


class Gone(Exception):
    """The replica was taken out, or the client left, while the request waited on it."""


def create_app(replicas: list[str], *, health_interval: float = 2.0,
               health_timeout: float = 5.0, fail_after: int = 2,
               cache_threshold: float = 0.5, balance_abs: int = 4, balance_rel: float = 1.5,
               connect_timeout: float = 5.0, max_body_bytes: int = 8 * 2**20) -> Quart:
    """Build the router for `replicas` (base URLs, e.g. http://127.0.0.1:8001)."""
    pool = Pool([u.rstrip("/") for u in replicas], cache_threshold=cache_threshold,
                balance_abs=balance_abs, balance_rel=balance_rel, fail_after=fail_after)
    app = Quart("slotserve-router")
    app.config.update(MAX_CONTENT_LENGTH=max_body_bytes, RESPONSE_TIMEOUT=None,
                      BODY_TIMEOUT=None, PROVIDE_AUTOMATIC_OPTIONS=False)
    app.extensions["slotserve.router"] = pool
    app.asgi_app = ClientWatch(app.asgi_app)  # type: ignore[method-assign]
    clients: dict[str, httpx.AsyncClient] = {}
    tasks: list[asyncio.Task[None]] = []

    @app.before_serving
    async def start() -> None:
        # no read timeout: a generation may take minutes; a hung replica is found by the
        # health checks instead, which end its requests (Replica.down)
        clients["up"] = httpx.AsyncClient(
            timeout=httpx.Timeout(connect=connect_timeout, read=None, write=60.0, pool=None),
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=64))
        clients["health"] = httpx.AsyncClient(timeout=health_timeout)
        await check_all(pool, clients["health"])
        tasks.append(asyncio.ensure_future(health_loop(pool, clients["health"],
                                                       health_interval)))

    @app.after_serving
    async def stop() -> None:
        for t in tasks:
            t.cancel()
        for client in clients.values():
            await client.aclose()

    @app.errorhandler(HTTPException)
    async def http_error(exc: HTTPException) -> Response:
        status = exc.code or 500
        message = {404: f"no route for {request.method} {request.path}",
                   413: f"request body larger than {max_body_bytes} bytes"}.get(
                       status, exc.description or exc.name)
        return error_response(request.path, status, message, code="bad_request"
                              if status < 500 else "router_error")

    @app.get("/health")
    async def health() -> Response:
        """200 while at least one replica is healthy, else 503 with why."""
        live = len(pool.healthy())
        if live:
            return _json({"status": "ok", "replicas": live, "of": len(pool.replicas)})
        return _json({"status": "unavailable", **_openai_error(
            "no healthy replica", "server_error", "no_replica")}, 503, {"Retry-After": "1"})

    @app.get("/replicas")
    async def replicas_state() -> Response:
        """Each replica's health, requests in flight and requests routed to it."""
        return _json({"replicas": [r.describe() for r in pool.replicas.values()]})

    @app.route("/v1/<path:rest>", methods=["GET", "POST", "DELETE", "OPTIONS"])
    async def forward(rest: str) -> Response:
        path = "/v1/" + rest
        raw = await request.get_data(cache=False)
        raw = raw if isinstance(raw, bytes) else raw.encode()
        body = _json_object(raw) if request.method == "POST" else {}
        chain = chain_for(path, body, tenant_of(request.headers))
        response_id = _response_id(path, body)
        link = client_link(request.scope)
        gone = asyncio.Event()
        if link is not None:
            link.on_gone(gone.set)
        headers = [(k, v) for k, v in request.headers.items() if k.lower() not in HOP]
        target = path + (("?" + request.query_string.decode()) if request.query_string else "")
        tried: set[str] = set()
        while True:
            choice = pool.choose(chain, response_id, frozenset(tried))
            if choice is None:
                if tried:
                    return error_response(path, 502, f"every replica tried failed: "
                                          f"{_last_errors(pool, tried)}", code="replica_failed")
                return error_response(path, 503, "no healthy replica", code="no_replica",
                                      headers={"Retry-After": "1"})
            replica = choice.replica
            replica.in_flight += 1
            replica.routed += 1
            pool.record(replica, chain)
            up = clients["up"].build_request(request.method, replica.url + target,
                                             headers=headers, content=raw)
            try:
                upstream = await _unless(clients["up"].send(up, stream=True), replica, gone)
            except (httpx.ConnectError, httpx.ConnectTimeout) as exc:
                replica.in_flight -= 1
                pool.mark_failed(replica, f"{type(exc).__name__}: {exc}", at_once=True)
                log.warning("replica unreachable, trying another", replica=replica.url,
                            error=str(exc))
                tried.add(replica.url)
                continue
            except (httpx.HTTPError, Gone) as exc:
                replica.in_flight -= 1
                return _failed(pool, replica, path, exc, gone)
            break
        log.info("routed", path=path, replica=replica.url, reason=choice.reason,
                 status=upstream.status_code)
        out_headers = {k: v for k, v in upstream.headers.items() if k.lower() not in HOP}
        out_headers["X-Slotserve-Replica"] = str(list(pool.replicas).index(replica.url))
        out_headers["X-Slotserve-Route"] = choice.reason
        if upstream.headers.get("content-type", "").startswith("text/event-stream"):
            lease = Lease(replica, upstream)
            if link is not None:  # a client gone before the body starts: nobody iterates it
                link.on_gone(lease.release_unless_started)
            return Response(_stream(pool, lease, path, gone), status=upstream.status_code,
                            headers=out_headers)
        try:
            data = await _unless(upstream.aread(), replica, gone)
        except (httpx.HTTPError, Gone) as exc:
            return _failed(pool, replica, path, exc, gone)
        finally:
            await upstream.aclose()
            replica.in_flight -= 1
        if path == "/v1/responses" and upstream.status_code == 200:
            _note_response_id(pool, replica, data)
        return Response(data, status=upstream.status_code, headers=out_headers)

    return app


class Lease:
    """A streamed answer's hold on its replica (one request in flight) and on the upstream
    connection, given back exactly once: when the stream ends, or when the client left
    before Quart began to send it (the generator then never runs, nor its `finally`)."""

    def __init__(self, replica: Replica, upstream: httpx.Response) -> None:
        self.replica, self.upstream = replica, upstream
        self.started = self.released = False

    async def release(self) -> None:
        if self.released:
            return
        self.released = True
        self.replica.in_flight -= 1
        with contextlib.suppress(Exception):
            await self.upstream.aclose()

    def release_unless_started(self) -> None:
        if not self.started and not self.released:
            asyncio.ensure_future(self.release())


async def _stream(pool: Pool, lease: Lease, path: str,
                  gone: asyncio.Event) -> AsyncIterator[bytes]:
    """The replica's body as it comes; an error event in the stream's dialect if it breaks."""
    if lease.released:
        return
    lease.started = True
    replica, upstream = lease.replica, lease.upstream
    head = b""
    chunks = upstream.aiter_raw()
    try:
        while True:
            try:
                chunk = await _unless(anext(chunks), replica, gone)
            except StopAsyncIteration:
                return
            except (httpx.HTTPError, Gone) as exc:
                if gone.is_set():
                    return
                reason = _reason(replica, exc)
                pool.mark_failed(replica, reason, at_once=not isinstance(exc, Gone))
                log.warning("replica failed mid-stream", replica=replica.url, error=reason)
                yield stream_error(path, reason)
                return
            if path == "/v1/responses" and len(head) < ID_SCAN_BYTES:
                head += chunk
                _note_response_id(pool, replica, head)
            yield chunk
    finally:
        await lease.release()


async def _unless(awaitable: Awaitable[T], replica: Replica, gone: asyncio.Event) -> T:
    """`awaitable`'s result, or Gone as soon as the replica is taken out or the client left."""
    work = asyncio.ensure_future(awaitable)
    stops = [asyncio.ensure_future(replica.down.wait()), asyncio.ensure_future(gone.wait())]
    try:
        await asyncio.wait({work, *stops}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for s in stops:
            s.cancel()
    if work.done():
        return work.result()
    work.cancel()
    with contextlib.suppress(BaseException):
        await work
    raise Gone("the client went away" if gone.is_set() else
               f"the replica was taken out ({replica.last_error})")


def _failed(pool: Pool, replica: Replica, path: str, exc: Exception,
            gone: asyncio.Event) -> Response:
    reason = _reason(replica, exc)
    if not gone.is_set() and not isinstance(exc, Gone):
        pool.mark_failed(replica, reason, at_once=True)
    log.warning("replica failed mid-request", replica=replica.url, error=reason)
    return error_response(path, 502, reason, code="replica_failed")


def _reason(replica: Replica, exc: Exception) -> str:
    what = str(exc) or type(exc).__name__
    return f"the replica {replica.url} failed during the request: {what}"


def _last_errors(pool: Pool, urls: set[str]) -> str:
    return "; ".join(f"{u}: {pool.replicas[u].last_error}" for u in sorted(urls))


def _json_object(raw: bytes) -> dict[str, Any]:
    """The body as a JSON object, or {} (the replica answers a bad body itself)."""
    try:
        value = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        return {}
    return value if isinstance(value, dict) else {}


def _response_id(path: str, body: dict[str, Any]) -> str | None:
    if path.startswith("/v1/responses/"):
        return path.removeprefix("/v1/responses/").split("/", 1)[0] or None
    prev = body.get("previous_response_id") if path == "/v1/responses" else None
    return prev if isinstance(prev, str) else None


def _note_response_id(pool: Pool, replica: Replica, head: bytes) -> None:
    found = RESPONSE_ID.search(head[:ID_SCAN_BYTES])
    if found:
        pool.record_response(found.group(1).decode(), replica)


# ---- error shapes ----------------------------------------------------------------------------


def is_anthropic(path: str) -> bool:
    return path == "/v1/messages" or path.startswith("/v1/messages/")


def _openai_error(message: str, kind: str, code: str) -> dict[str, Any]:
    return {"error": {"message": message, "type": kind, "param": None, "code": code}}


def _anthropic_error(status: int, message: str) -> dict[str, Any]:
    kind = {400: "invalid_request_error", 404: "not_found_error", 413: "request_too_large",
            503: "overloaded_error"}.get(status, "api_error")
    return {"type": "error", "error": {"type": kind, "message": message}}


def error_response(path: str, status: int, message: str, *, code: str,
                   headers: dict[str, str] | None = None) -> Response:
    """An error the router itself answers, in the shape the endpoint's clients read."""
    if is_anthropic(path):
        return _json(_anthropic_error(status, message), status, headers)
    kind = "server_error" if status >= 500 else "invalid_request_error"
    return _json(_openai_error(message, kind, code), status, headers)


def stream_error(path: str, message: str) -> bytes:
    """The last event of a stream whose replica failed, in the stream's own dialect."""
    if is_anthropic(path):
        payload = _anthropic_error(502, message)
        return b"event: error\ndata: " + json.dumps(payload).encode() + b"\n\n"
    if path == "/v1/responses":
        payload = {"type": "error", "code": "replica_failed", "message": message,
                   "param": None}
        return b"event: error\ndata: " + json.dumps(payload).encode() + b"\n\n"
    payload = _openai_error(message, "server_error", "replica_failed")
    return b"data: " + json.dumps(payload).encode() + b"\n\n"


def _json(payload: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(json.dumps(payload), status=status, headers=headers,
                    content_type="application/json")


# ---- health ----------------------------------------------------------------------------------


async def check(pool: Pool, replica: Replica, client: httpx.AsyncClient) -> None:
    try:
        r = await client.get(replica.url + "/health")
    except httpx.HTTPError as exc:
        pool.mark_failed(replica, f"health check: {type(exc).__name__}: {exc}")
        return
    if r.status_code == 200:
        was = replica.healthy
        pool.mark_up(replica)
        if not was:
            log.info("replica in", replica=replica.url)
    else:
        was = replica.healthy
        pool.mark_failed(replica, f"health check: HTTP {r.status_code}")
        if was and not replica.healthy:
            log.warning("replica out", replica=replica.url, error=replica.last_error)


async def check_all(pool: Pool, client: httpx.AsyncClient) -> None:
    await asyncio.gather(*(check(pool, r, client) for r in pool.replicas.values()))


async def health_loop(pool: Pool, client: httpx.AsyncClient, interval: float) -> None:
    """GET /health on every replica each `interval` seconds, for as long as the router runs."""
    while True:
        await asyncio.sleep(interval)
        try:
            await check_all(pool, client)
        except Exception:  # one bad round must not end the checks
            log.exception("health checks failed")
