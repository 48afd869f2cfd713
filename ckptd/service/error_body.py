"""The one builder of the service's error bodies, for every layer that answers an error.

``{"error": {"code", "message", "details"[, "request_id"]}}`` (:func:`error_body`), from the
exception handlers (:mod:`ckptd.service.errors`), from ASGI middleware before routing
(:func:`send_error`: 401, 403, 408, 413) and from the HTTP protocol below the app
(:func:`raw_error_response`: a request head the parser refuses, or one over the size limit).
"""

from __future__ import annotations

import json

from starlette.types import Scope, Send

from ckptd_schemas import CkptdError

__all__ = ["error_body", "error_bytes", "raw_error_response", "send_error"]


def error_body(err: CkptdError, request_id: str | None = None) -> dict:
    """``{"error": {"code", "message", "details"[, "request_id"]}}``: the one error shape."""
    body = err.to_body()
    if request_id:
        body["error"]["request_id"] = request_id
    return body


def error_bytes(err: CkptdError, request_id: str | None = None) -> bytes:
    """:func:`error_body` as compact JSON."""
    return json.dumps(error_body(err, request_id), separators=(",", ":")).encode()


def raw_error_response(err: CkptdError, status: int | None = None, reason: str = "") -> bytes:
    """A whole HTTP/1.1 error response that closes the connection, for a request refused below the
    ASGI app (the HTTP parser): the same body as every other error."""
    body = error_bytes(err)
    return (b"HTTP/1.1 %d %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\nconnection: close\r\n\r\n%s"
            % (status or err.status, reason.encode(), len(body), body))


async def send_error(send: Send, scope: Scope, err: CkptdError,
                     headers: list[tuple[bytes, bytes]] | None = None) -> None:
    """Answer ``err`` from ASGI middleware (before or beside the app's own handlers)."""
    raw = error_bytes(err, scope.get("state", {}).get("request_id"))
    await send({"type": "http.response.start", "status": err.status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(raw)).encode()),
                            *(headers or [])]})
    await send({"type": "http.response.body", "body": raw})
