"""The OpenAI-compatible HTTP app: routes, auth, and JSON errors for every failure.

    app = create_app(EngineConfig(max_slots=8), api_key="secret")   # or a list, or APIKeys
    await serve(app, host="127.0.0.1", port=8000)      # slotserve.api.server

The engine loads in the background once serving starts (GET /health answers 503 until it is
ready, and again, with the reason, if the engine fails) and drains when serving stops. The app
runs behind `disconnect.ClientWatch`, which tells each request when its client goes away.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Iterable
from typing import Any

import structlog
from quart import Quart, Response, g, request
from werkzeug.exceptions import HTTPException

from slotserve.api import anthropic, generation, responses_api
from slotserve.api.disconnect import ClientWatch
from slotserve.api.errors import HTTP_ERRORS, APIError, error_body, json_response
from slotserve.api.keys import APIKeys, as_api_keys
from slotserve.api.schemas import (
    openapi_document,
    parse_body,
    parse_chat,
    parse_completion,
    parse_responses,
)
from slotserve.api.state import AppState, Settings
from slotserve.engine import EngineConfig

log = structlog.get_logger("slotserve.api")

OPEN_PATHS = frozenset({"/health", "/"})


DRAIN_SECONDS = 10.0  # how long a refused upload may take to finish before we answer anyway


async def drain_refused_body() -> None:
    """Wait until the client has sent the body we refused (Quart discards it as it comes).

    Answering 413 while the client is still uploading makes the server close a connection
    with unread data, and the client sees a reset instead of our JSON error. Quart keeps
    no public handle on "the body has ended", hence its private event (quart 0.22, pinned).
    """
    ended = getattr(request.body, "_complete", None)
    if isinstance(ended, asyncio.Event):
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(ended.wait(), DRAIN_SECONDS)


def create_app(engine_config: EngineConfig | None = None,
               api_key: str | Iterable[str] | APIKeys | None = None, *,
               keepalive_interval: float = 15.0, max_body_bytes: int = 8 * 2**20,
               model_id: str | None = None, queue_timeout: float | None = 600.0,
               strict_model_names: bool = False) -> Quart:
    """Build the app; nothing loads until it is served (see `app_state(app)` for the engine).

    `api_key`: the accepted key, several (any of them is accepted), or None for no auth.
    `queue_timeout`: seconds a request may wait for a slot before it is answered 429 (None:
    no bound). `strict_model_names`: a model name other than the served id is a 404 (by
    default any name is the one served model).
    """
    settings = Settings(api_keys=as_api_keys(api_key), keepalive_interval=keepalive_interval,
                        max_body_bytes=max_body_bytes, queue_timeout=queue_timeout,
                        strict_model_names=strict_model_names)
    state = AppState(engine_config or EngineConfig(), settings, model_id)
    app = Quart("slotserve")
    app.config.update(MAX_CONTENT_LENGTH=max_body_bytes, RESPONSE_TIMEOUT=None,
                      PROVIDE_AUTOMATIC_OPTIONS=False)
    app.extensions["slotserve"] = state
    # in front of Quart: a disconnect reaches the request even when Quart's own cancellation
    # of the handler is lost (see disconnect.py)
    app.asgi_app = ClientWatch(app.asgi_app)  # type: ignore[method-assign]

    @app.before_serving
    async def start_engine() -> None:
        state.start()

    @app.after_serving
    async def stop_engine() -> None:
        await state.drain()

    @app.before_request
    async def authenticate() -> Response | None:
        g.started = time.perf_counter()
        g.api_key = None  # index of the caller's key in settings.api_keys
        if request.method == "OPTIONS":  # a browser's CORS preflight carries no key
            return preflight()
        keys = settings.api_keys
        if not keys or request.path in OPEN_PATHS:
            return None
        # constant time whatever is sent (see slotserve.api.keys); never logged or echoed.
        # Every route takes either header: OpenAI clients send a Bearer token, Anthropic
        # ones x-api-key, and agents reach routes of both kinds.
        scheme, _, token = request.headers.get("Authorization", "").partition(" ")
        g.api_key = keys.match(token.strip()) if scheme.lower() == "bearer" else None
        if g.api_key is None and "x-api-key" in request.headers:
            g.api_key = keys.match(request.headers.get("x-api-key", "").strip())
        if g.api_key is not None:
            return None
        hint = "send 'Authorization: Bearer <key>' or 'x-api-key: <key>'"
        if anthropic.is_anthropic_path(request.path):
            return unread_body_refusal(anthropic.error_response(
                401, f"invalid or missing API key ({hint})"))
        return unread_body_refusal(json_response(
            error_body(f"invalid or missing API key ({hint})", code="invalid_api_key"), 401,
            {"WWW-Authenticate": "Bearer"}))

    @app.after_request
    async def log_request(response: Response) -> Response:
        """One access-log line per request (streams: when the headers go out), and the CORS
        header that lets a browser page read the answer."""
        started = g.get("started")
        ms = None if started is None else round((time.perf_counter() - started) * 1000, 1)
        log.info("request", method=request.method, path=request.path,
                 status=response.status_code, ms=ms)
        response.headers.setdefault("Access-Control-Allow-Origin", "*")
        return response

    # ---- errors ------------------------------------------------------------------------

    @app.errorhandler(APIError)
    async def api_error(exc: APIError) -> Response:
        if anthropic.is_anthropic_path(request.path):
            return anthropic.api_error_response(exc)
        return exc.response()

    @app.errorhandler(HTTPException)
    async def http_error(exc: HTTPException) -> Response:
        status = exc.code or 500
        kind, code = HTTP_ERRORS.get(status, ("invalid_request_error", "http_error"))
        message = {404: f"no route for {request.method} {request.path}",
                   405: f"method {request.method} is not allowed on {request.path}",
                   413: f"request body larger than {max_body_bytes} bytes"}.get(
                       status, exc.description or exc.name)
        headers = {k: v for k, v in exc.get_headers() if k.lower() == "allow"}
        if status == 413:
            await drain_refused_body()
        if anthropic.is_anthropic_path(request.path):
            return anthropic.error_response(status, message, headers)
        return json_response(error_body(message, type=kind, code=code), status, headers)

    @app.errorhandler(Exception)
    async def internal_error(exc: Exception) -> Response:
        log.error("unhandled error", path=request.path, exc_info=exc)
        if anthropic.is_anthropic_path(request.path):
            return anthropic.error_response(500, f"internal error: {type(exc).__name__}")
        return json_response(error_body(f"internal error: {type(exc).__name__}",
                                        type="server_error", code="internal_error"), 500)

    # ---- routes ------------------------------------------------------------------------

    async def body() -> dict[str, Any]:
        raw = await request.get_data(cache=False)
        return parse_body(raw if isinstance(raw, bytes) else raw.encode())

    def check_model(name: str | None) -> None:
        if not state.knows_model(name):
            raise APIError(404, f"the model {name!r} does not exist; this server serves "
                           f"{state.model_id!r}", param="model", code="model_not_found")

    @app.post("/v1/chat/completions")
    async def chat_completions() -> Response:
        req = parse_chat(await body())
        check_model(req.model)
        return await generation.chat(state, req)

    @app.post("/v1/completions")
    async def completions() -> Response:
        req = parse_completion(await body())
        check_model(req.model)
        return await generation.completion(state, req)

    @app.post(anthropic.PATH)
    async def messages() -> Response:
        req = anthropic.parse_messages(await body())
        check_model(req.model)
        return await anthropic.messages(state, req)

    @app.post(anthropic.PATH + "/count_tokens")
    async def count_tokens() -> Response:
        req = anthropic.parse_messages(await body(), count=True)
        check_model(req.model)
        return await anthropic.count_tokens(state, req)

    @app.route("/", methods=["GET", "HEAD"])
    async def root() -> Response:
        """What is served here (Claude Code checks the base URL with HEAD /)."""
        return json_response({"name": "slotserve", "model": state.model_id,
                              "status": state.status,
                              "routes": ["/v1/chat/completions", "/v1/completions",
                                         "/v1/responses", "/v1/messages",
                                         "/v1/messages/count_tokens", "/v1/models",
                                         "/health", "/metrics", "/openapi.json"]})

    @app.post(responses_api.PATH)
    async def responses() -> Response:
        req = parse_responses(await body())
        check_model(req.model)
        return await responses_api.create(state, req)

    @app.get("/openapi.json")
    async def openapi() -> Response:
        """The request bodies of the generation routes, from the models that validate them."""
        return json_response(openapi_document())

    @app.get("/v1/models")
    async def models() -> Response:
        return json_response({"object": "list", "data": [model_card(state)]})

    @app.get("/v1/models/<path:name>")
    async def model(name: str) -> Response:
        check_model(name)
        return json_response(model_card(state))

    @app.get("/health")
    async def health() -> Response:
        """200 {"status": "ok"} when requests are taken; otherwise 503 with the status
        (loading, shutting_down, failed) and an OpenAI-style error that says why."""
        status = state.status
        if status == "ok":
            return json_response({"status": status})
        err = state.unavailable()
        return json_response({"status": status, **err.body()}, 503, err.headers)

    @app.get("/metrics")
    async def metrics() -> Response:
        payload, content_type = state.metrics.render()
        return Response(payload, content_type=content_type)

    @app.get("/slots")
    async def slots() -> Response:
        engine = state.engine
        if engine is None or engine.admission is None:
            return json_response({"slots": [], "status": state.status})
        return json_response({"slots": engine.slot_states(), "kv": engine.kv_summary(),
                              "status": state.status})

    return app


CORS_METHODS = "GET, POST, HEAD, OPTIONS"


def preflight() -> Response:
    """The answer to a CORS preflight (OPTIONS) on any path: any origin, the methods served,
    and whatever request headers the browser asks to send (an API key among them)."""
    asked = request.headers.get("Access-Control-Request-Headers",
                                "authorization, content-type, x-api-key")
    return Response("", status=204, headers={
        "Access-Control-Allow-Origin": "*", "Access-Control-Allow-Methods": CORS_METHODS,
        "Access-Control-Allow-Headers": asked, "Access-Control-Max-Age": "86400"})


def unread_body_refusal(response: Response) -> Response:
    """A refusal sent before the request's body was read closes the connection: the unread
    body would otherwise be taken for the next request on a kept-alive connection (the
    server drops it; a client that had already sent its next request there sees "server
    disconnected without a response")."""
    if request.headers.get("Content-Length", "0") != "0" or "Transfer-Encoding" in request.headers:
        response.headers["Connection"] = "close"
    return response


def model_card(state: AppState) -> dict[str, Any]:
    created = int(state.engine.started_at) if state.engine else int(time.time())
    return {"id": state.model_id, "object": "model", "created": created, "owned_by": "slotserve"}


def app_state(app: Quart) -> AppState:
    """The state behind an app from `create_app` (its engine, settings and metrics)."""
    return app.extensions["slotserve"]
