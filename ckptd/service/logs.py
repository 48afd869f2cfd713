"""Structured logs: one JSON object per line (or plain text), request ids, and the access log.

Every request gets an id: the caller's ``X-Request-Id`` when it is a safe token
(``[A-Za-z0-9._-]{1,128}``), a fresh one otherwise. It is echoed in the
response's ``X-Request-Id`` header, put in error bodies (``error.request_id``)
and in every log record written while the request is handled (the store's log
lines included: the id travels in a context variable, which the thread pool
copies). Each request ends with one access line on the ``ckptd.access`` logger (at ``warning`` for
401, 403 and 5xx answers, ``info`` otherwise; its fields: docs/http-api.md, Metrics and logs).

No request header is ever logged, and as a second line of defence every
formatted line has ``Bearer <token>`` redacted (uvicorn's ``trace`` level
prints raw ASGI scopes, headers included).
"""

from __future__ import annotations

import contextvars
import json
import logging
import re
import time
import uuid
from datetime import datetime, timezone
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

__all__ = ["JsonFormatter", "RequestContextMiddleware", "TextFormatter", "configure_logging", "request_id_var", "route_name"]

request_id_var: contextvars.ContextVar[str | None] = contextvars.ContextVar("ckptd_request_id", default=None)
REQUEST_ID_RE = re.compile(r"[A-Za-z0-9._-]{1,128}")
_BEARER_RE = re.compile(r"(?i)(bearer\s+)[^\s'\",;)\]}]+")
_STD_ATTRS = set(logging.LogRecord("", 0, "", 0, "", (), None).__dict__) | {"message", "asctime", "color_message"}
access_log = logging.getLogger("ckptd.access")


def redact(text: str) -> str:
    """``Bearer <anything>`` -> ``Bearer [redacted]``."""
    return _BEARER_RE.sub(r"\1[redacted]", text) if "earer" in text or "EARER" in text else text


class JsonFormatter(logging.Formatter):
    """One JSON object per line: ts, level, logger, msg, request_id, then the record's ``extra`` fields."""

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "ts": datetime.fromtimestamp(record.created, timezone.utc).isoformat(timespec="milliseconds")
            .replace("+00:00", "Z"),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        rid = getattr(record, "request_id", None) or request_id_var.get()
        if rid:
            out["request_id"] = rid
        for k, v in record.__dict__.items():
            if k not in _STD_ATTRS and k not in out and not k.startswith("_") and v is not None:
                out[k] = v
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        if record.stack_info:
            out["stack"] = self.formatStack(record.stack_info)
        return redact(json.dumps(out, default=str, ensure_ascii=False))


class TextFormatter(logging.Formatter):
    """``TIME LEVEL logger: message [request_id=...]``, for a terminal."""

    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s: %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        text = super().format(record)
        rid = getattr(record, "request_id", None) or request_id_var.get()
        if rid:
            text = f"{text} [request_id={rid}]"
        return redact(text)


def configure_logging(level: str, fmt: str) -> None:
    """Root handler on stderr in ``fmt`` (json or text); uvicorn's loggers write through it."""
    handler = logging.StreamHandler()
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]  # ours alone, as uvicorn's loggers below propagate to it
    lvl = level.upper()
    root.setLevel(logging.getLevelName(lvl) if isinstance(logging.getLevelName(lvl), int) else logging.DEBUG)
    for name in ("uvicorn", "uvicorn.error", "uvicorn.access", "uvicorn.asgi"):
        lg = logging.getLogger(name)
        lg.handlers.clear()
        lg.propagate = True


def route_name(scope: Scope) -> str:
    """The matched route's handler name, the label of its metrics and log lines (``unmatched``: none)."""
    return getattr(scope.get("route"), "name", None) or "unmatched"


class RequestContextMiddleware:
    """Request id, one access log line and the HTTP metrics of each request (pure ASGI: streams stay streams)."""

    def __init__(self, app: ASGIApp, metrics: Any = None) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        rid = next((v for k, v in scope.get("headers", ()) if k == b"x-request-id"), b"").decode("latin-1")
        if not REQUEST_ID_RE.fullmatch(rid):  # ASCII only: a byte past it never matches
            rid = uuid.uuid4().hex
        scope.setdefault("state", {})["request_id"] = rid
        token = request_id_var.set(rid)
        t0 = time.perf_counter()
        counts = {"in": 0, "out": 0, "status": 500}

        async def receive_counted() -> Message:
            msg = await receive()
            if msg["type"] == "http.request":
                counts["in"] += len(msg.get("body", b""))
            return msg

        async def send_tagged(msg: Message) -> None:
            if msg["type"] == "http.response.start":
                counts["status"] = msg["status"]
                msg = {**msg, "headers": [*msg.get("headers", []), (b"x-request-id", rid.encode())]}
            elif msg["type"] == "http.response.body":
                counts["out"] += len(msg.get("body", b""))
            await send(msg)

        try:
            await self.app(scope, receive_counted, send_tagged)
        finally:
            duration = time.perf_counter() - t0
            route = route_name(scope)
            if self.metrics is not None:
                self.metrics.observe_request(route, scope["method"], counts["status"], duration,
                                             counts["in"], counts["out"])
            params = scope.get("path_params") or {}
            status = counts["status"]
            extra = {"request_id": rid, "method": scope["method"], "path": scope["path"][:300], "route": route,
                     "status": status, "duration_ms": round(duration * 1000, 1), "bytes_in": counts["in"],
                     "bytes_out": counts["out"]}
            for k, field in (("run", "run"), ("name", "checkpoint")):  # "name" is a LogRecord attribute
                if isinstance(params.get(k), str):
                    extra[field] = params[k][:200]
            client = scope.get("client")
            if client:
                extra["client"] = client[0]
            principal = scope["state"].get("principal")
            if principal is not None:
                extra["principal"] = principal.name
            level = logging.WARNING if status >= 500 or status in (401, 403) else logging.INFO
            access_log.log(level, "%s %s %d %.1fms",
                           scope["method"], extra["path"], status, extra["duration_ms"], extra=extra)
            request_id_var.reset(token)
