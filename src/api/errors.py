"""OpenAI-shaped error bodies, so every client library can read our failures."""

from __future__ import annotations

import json
from typing import Any

from quart import Response


class APIError(Exception):
    """Raised anywhere in request handling; becomes a JSON error response."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type = status, message, type
        self.param, self.code, self.headers = param, code, headers or {}

    def body(self) -> dict[str, Any]:
        return error_body(self.message, type=self.type, param=self.param, code=self.code)

    def response(self) -> Response:
        return json_response(self.body(), self.status, self.headers)


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def error_body(message: str, *, type: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def json_response(payload: Any, status: int = 200,
                  headers: dict[str, str] | None = None) -> Response:
    """UTF-8 JSON as the payload is ordered (Quart's jsonify sorts and escapes).

    Strict JSON: a NaN or infinity in the payload is a bug, raised here as ValueError (a 500),
    never written as the invalid `NaN` / `Infinity`."""
    return Response(dumps(payload), status=status, headers=headers,
                    content_type="application/json")


def dumps(payload: Any) -> str:
    """The JSON text of every response body and event: strict (ValueError on NaN / inf).

    U+0085, U+2028 and U+2029 (valid raw in JSON strings) are escaped: line readers built
    on str.splitlines (Python requests' iter_lines, among others) split an SSE data line at
    them, and the client then sees an unterminated string."""
    text = json.dumps(payload, ensure_ascii=False, allow_nan=False)
    if "\x85" in text or "\u2028" in text or "\u2029" in text:
        text = text.replace("\x85", "\\u0085").replace("\u2028", "\\u2028")
        text = text.replace("\u2029", "\\u2029")
    return text


# HTTP status -> (type, code) for errors raised by the framework itself (routing, body size).
HTTP_ERRORS: dict[int, tuple[str, str]] = {
    400: ("invalid_request_error", "bad_request"),
    401: ("invalid_request_error", "invalid_api_key"),
    404: ("invalid_request_error", "not_found"),
    405: ("invalid_request_error", "method_not_allowed"),
    408: ("invalid_request_error", "request_timeout"),
    413: ("invalid_request_error", "request_too_large"),
    415: ("invalid_request_error", "unsupported_media_type"),
}
