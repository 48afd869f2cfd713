"""Per-request limits: no request may cost the service more than its size pays for.

Three pieces, each used at one place of the request's life:

1. :class:`BodyIdleTimeout` (ASGI middleware, inside ``AccessMiddleware``):
   while the app waits for the next piece of a request body, at most
   ``body_idle_timeout_seconds``; then the request is answered 408
   (``RequestTimeout``, ``Connection: close``) and the app sees the client
   gone. Only the app's own waits count, so a slow storage write that pauses
   reading never times a client out.
2. :class:`UploadSlots` (in the ``upload_file`` and ``adopt_file`` handlers,
   before any byte is stored): at most ``max_uploads_per_principal`` uploads
   of one token at once; the next is refused 429 (``TooManyRequests``), which
   the client retries with backoff. One token's uploads cannot take every
   worker thread, so another token's still run.
3. :func:`read_plan_budget` (in the ``read_plan`` handler): the work a plan
   may do, a constant plus a multiple of the request body's size
   (:class:`ckptd_schemas.PlanBudget`); over it the request is refused 413
   before the work is done.

Connection-level limits (request heads that never complete, idle sockets
exhausting file descriptors) are in :mod:`ckptd.service.connections`.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from typing import Any, Callable

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ckptd_schemas import PlanBudget, RequestTimeout, TooManyRequests

from .error_body import send_error

__all__ = ["ANSWER_PER_BODY_BYTE", "CHUNKS_PER_BODY_BYTE", "BodyIdleTimeout", "UploadSlots", "mark_answered",
           "read_plan_budget", "was_answered"]

log = logging.getLogger("ckptd.service")

CHUNKS_PER_BODY_BYTE = 16
"""Chunk visits a read plan may make per byte of its request, beyond the settings' constant: a request
names a tensor in about 40 bytes, and a rank's slice of a 1,024-rank tensor visits its 1,024 chunks."""
ANSWER_PER_BODY_BYTE = 1
"""Copies plus fetches a read plan may answer per byte of its request, beyond the settings' constant
(each costs the service about 3 KB and 50 us to build and 300 bytes to send)."""
_ANSWERED = "ckptd_answered"  # scope state key: a middleware has answered the request itself


def read_plan_budget(body_bytes: int, base_chunks: int, base_answer: int) -> PlanBudget:
    """The budget of a read-plan request of ``body_bytes`` bytes."""
    return PlanBudget(max_chunks=base_chunks + CHUNKS_PER_BODY_BYTE * body_bytes,
                      max_answer=base_answer + ANSWER_PER_BODY_BYTE * body_bytes,
                      setting="CKPTD_READ_PLAN_CHUNK_BUDGET / CKPTD_READ_PLAN_ANSWER_BUDGET")


def mark_answered(scope: Scope) -> None:
    """Record that a middleware answered this request (a 408 or 413): the client disconnect the app
    meets next is that answer's doing, not the client's."""
    scope.setdefault("state", {})[_ANSWERED] = True


def was_answered(scope: Scope) -> bool:
    return bool(scope.get("state", {}).get(_ANSWERED))


class UploadSlots:
    """Concurrent uploads per principal (token name), at most ``limit`` each (0: no limit)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._active: dict[str, int] = {}
        self._lock = threading.Lock()

    def active(self, principal: str) -> int:
        with self._lock:
            return self._active.get(principal, 0)

    def acquire(self, principal: str, file: str) -> Callable[[], None]:
        """Take one slot of ``principal`` (``TooManyRequests`` when none is free); returns its release,
        which the caller runs once the upload has finished either way (a second call does nothing)."""
        with self._lock:
            n = self._active.get(principal, 0)
            if self.limit and n >= self.limit:
                raise TooManyRequests(
                    f"token {principal!r} already has {n} uploads in progress, the limit "
                    f"(CKPTD_MAX_UPLOADS_PER_PRINCIPAL) is {self.limit}: file {file!r} was not accepted; "
                    f"retry once one finishes", limit=self.limit, token=principal, file=file)
            self._active[principal] = n + 1
        released = False

        def release() -> None:
            nonlocal released
            with self._lock:
                if released:
                    return
                released = True
                left = self._active[principal] - 1
                if left:
                    self._active[principal] = left
                else:
                    del self._active[principal]

        return release


class BodyIdleTimeout:
    """Answer 408 and close when a request body stalls for ``seconds`` while the app waits for it."""

    def __init__(self, app: ASGIApp, seconds: float, metrics: Any = None) -> None:
        self.app, self.seconds, self.metrics = app, seconds, metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not self.seconds or self.seconds <= 0:
            await self.app(scope, receive, send)
            return
        body_done = False
        responded = False
        started = False

        async def timed_receive() -> Message:
            nonlocal body_done, responded
            if responded:
                return {"type": "http.disconnect"}
            if body_done:  # after the body: the app waits for a disconnect, as long as it likes
                return await receive()
            try:
                msg = await asyncio.wait_for(receive(), self.seconds)
            except asyncio.TimeoutError:
                responded = True
                mark_answered(scope)
                route = getattr(scope.get("route"), "name", None) or "unmatched"
                if self.metrics is not None:
                    self.metrics.limit_refusals.labels("body_idle").inc()
                log.warning("%s: request body idle for %.0f s, connection closed (408)", route, self.seconds)
                if not started:
                    err = RequestTimeout(f"the request body sent nothing for {self.seconds:g} s "
                                         f"(CKPTD_BODY_IDLE_TIMEOUT_SECONDS): connection closed",
                                         timeout_s=self.seconds)
                    await send_error(send, scope, err, [(b"connection", b"close")])
                return {"type": "http.disconnect"}
            if msg["type"] != "http.request" or not msg.get("more_body", False):
                body_done = True
            return msg

        async def guarded_send(msg: Message) -> None:
            nonlocal started
            if responded:
                return  # the 408 is the answer; the handler's own (to the disconnect) is dropped
            if msg["type"] == "http.response.start":
                started = True
            await send(msg)

        await self.app(scope, timed_receive, guarded_send)
