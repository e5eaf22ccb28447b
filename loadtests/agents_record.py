"""A recording reverse proxy between a coding agent and slotserve, and the fixtures made from
what it recorded.

    proxy = RecordingProxy("http://127.0.0.1:8000").start()   # the agent talks to proxy.url
    ...
    proxy.stop(); proxy.exchanges                               # every request and response

`agents_e2e.py --record DIR` puts one in front of the server for each agent and writes
DIR/<agent>.json with `fixture(exchanges)`: each request (method, path, the headers an agent's
protocol depends on, the JSON body) and what the server answered (status, content type, and
for a stream the sequence of its event types). The fixtures in tests/fixtures/agents/ were made
so; tests/test_agents_replay.py sends their requests to a real server and checks the answers'
protocol shape, so the suite covers the agents' requests without node.

A fixture holds no secrets: authorization headers are never kept, and Claude Code's per-request
billing line and user id are blanked. Long texts (system prompts, tool descriptions, tool
results) are cut to `TEXT_LIMIT` characters with a marker, which keeps each request's structure
(every field, message, item and tool) while keeping the file and its replay small.
"""

from __future__ import annotations

import json
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import httpx

KEPT_HEADERS = ("content-type", "accept", "anthropic-version", "anthropic-beta", "user-agent",
                "openai-beta", "originator", "x-stainless-lang", "x-stainless-package-version")
TEXT_LIMIT = 300
_CUT = " [...cut for the fixture]"
_HOP = {"connection", "keep-alive", "transfer-encoding", "content-length", "host"}


class RecordingProxy:
    """Forwards every request to `upstream` as it is, streams the answer back as it comes,
    and keeps both (bodies whole) in `exchanges`."""

    def __init__(self, upstream: str) -> None:
        self.upstream = upstream.rstrip("/")
        self.exchanges: list[dict[str, Any]] = []
        self._lock = threading.Condition()
        self._active = 0  # requests being answered (stop waits for them to be recorded)
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: Any) -> None:  # the server logs requests
                pass

            def _any(self) -> None:
                with proxy._lock:
                    proxy._active += 1
                try:
                    self._forward()
                finally:
                    with proxy._lock:
                        proxy._active -= 1
                        proxy._lock.notify_all()

            def _forward(self) -> None:
                length = int(self.headers.get("content-length") or 0)
                body = self.rfile.read(length) if length else b""
                headers = {k: v for k, v in self.headers.items() if k.lower() not in _HOP}
                record: dict[str, Any] = {"method": self.command, "path": self.path,
                                          "headers": dict(self.headers.items()),
                                          "body": body.decode("utf-8", "replace")}
                with httpx.Client(timeout=None) as client, client.stream(
                        self.command, proxy.upstream + self.path, headers=headers,
                        content=body) as r:
                    self.send_response(r.status_code)
                    for k, v in r.headers.items():
                        if k.lower() not in _HOP:
                            self.send_header(k, v)
                    bodiless = self.command == "HEAD" or r.status_code in (204, 304)
                    self.send_header(*(("Content-Length", "0") if bodiless
                                       else ("Transfer-Encoding", "chunked")))
                    self.end_headers()
                    parts = []
                    try:
                        for chunk in r.iter_raw():
                            parts.append(chunk)
                            self.wfile.write(f"{len(chunk):x}\r\n".encode() + chunk + b"\r\n")
                            self.wfile.flush()
                        if not bodiless:
                            self.wfile.write(b"0\r\n\r\n")
                            self.wfile.flush()
                    except (BrokenPipeError, ConnectionResetError):  # the agent stopped reading
                        record["client_closed"] = True
                record["status"] = r.status_code
                record["content_type"] = r.headers.get("content-type", "")
                record["response"] = b"".join(parts).decode("utf-8", "replace")
                with proxy._lock:
                    proxy.exchanges.append(record)

            do_GET = do_POST = do_HEAD = do_OPTIONS = do_PUT = do_DELETE = _any

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    def start(self) -> RecordingProxy:
        self._thread.start()
        return self

    def stop(self, wait: float = 60.0) -> None:
        """Stop once the requests being answered are recorded (an agent may exit before the
        proxy has finished with its last answer)."""
        with self._lock:
            self._lock.wait_for(lambda: self._active == 0, timeout=wait)
        self._server.shutdown()
        self._server.server_close()


# ---- fixtures ------------------------------------------------------------------------------


def _cut(value: Any) -> Any:
    """Long strings shortened, everything else kept (recursively)."""
    if isinstance(value, str):
        return value if len(value) <= TEXT_LIMIT else value[:TEXT_LIMIT] + _CUT
    if isinstance(value, list):
        return [_cut(v) for v in value]
    if isinstance(value, dict):
        return {k: _cut(v) for k, v in value.items()}
    return value


_BILLING = re.compile(r"x-anthropic-billing-header:[^\n]*")
_UUID = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")


def _scrub(value: Any) -> Any:
    """No identifiers in a fixture: Claude Code's billing line, metadata.user_id and every
    UUID (Codex's session, turn and installation ids) blanked, in every string."""
    if isinstance(value, str):
        value = _BILLING.sub("x-anthropic-billing-header: cc_version=0; cch=0;", value)
        return _UUID.sub("00000000-0000-0000-0000-000000000000", value)
    if isinstance(value, list):
        return [_scrub(v) for v in value]
    if isinstance(value, dict):
        out = {k: _scrub(v) for k, v in value.items()}
        if isinstance(out.get("metadata"), dict) and "user_id" in out["metadata"]:
            out["metadata"]["user_id"] = "user_fixture"
        return out
    return value


def _events(exchange: dict[str, Any]) -> list[str]:
    """The event types of a recorded stream, in order (a chat stream's chunks as `chunk`)."""
    kinds = []
    for line in exchange["response"].splitlines():
        if line.startswith("event: "):
            continue
        if not line.startswith("data: "):
            continue
        data = line[6:]
        if data == "[DONE]":
            kinds.append("[DONE]")
            continue
        try:
            ev = json.loads(data)
        except ValueError:
            continue
        kind = ev.get("type") or ev.get("object") or "data"
        if not kinds or kinds[-1] != kind or kind not in (
                "chat.completion.chunk", "content_block_delta", "response.output_text.delta",
                "response.function_call_arguments.delta", "response.reasoning_text.delta",
                "response.in_progress"):
            kinds.append(kind)
    return kinds


def recut(record: dict[str, Any]) -> dict[str, Any]:
    """A fixture made again under the current scrubbing and TEXT_LIMIT (both idempotent)."""
    for x in record["exchanges"]:
        if x["request"]["body"] is not None:
            x["request"]["body"] = _cut(_scrub(x["request"]["body"]))
    return record


def fixture(agent: str, version: str, exchanges: list[dict[str, Any]]) -> dict[str, Any]:
    """Recorded exchanges as a fixture (see the module's docstring)."""
    out = []
    for ex in exchanges:
        try:
            body = json.loads(ex["body"]) if ex["body"] else None
        except ValueError:
            body = None
        headers = {k.lower(): v for k, v in ex["headers"].items() if k.lower() in KEPT_HEADERS}
        stream = "text/event-stream" in ex["content_type"]
        entry: dict[str, Any] = {
            "request": {"method": ex["method"], "path": ex["path"], "headers": headers,
                        "body": _cut(_scrub(body)) if body is not None else None},
            "response": {"status": ex["status"], "content_type": ex["content_type"]}}
        if stream:
            entry["response"]["events"] = _events(ex)
        if ex.get("client_closed"):  # the agent stopped reading before the answer's end
            entry["response"]["client_closed"] = True
        out.append(entry)
    return {"agent": agent, "version": version, "exchanges": out}


if __name__ == "__main__":  # re-cut fixtures in place: agents_record.py FILE...
    import sys

    for name in sys.argv[1:]:
        with open(name) as f:
            data = recut(json.load(f))
        with open(name, "w") as f:
            f.write(json.dumps(data, indent=1) + "\n")
