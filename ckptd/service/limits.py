"""Per-request limits: no request may cost the service more than its size pays for, nor hold it longer
than its bytes take to arrive.

Five pieces, each used at one place of the request's life (each says its bound):

1. :class:`PrincipalRequests` (ASGI middleware, inside ``AccessMiddleware``, which names the
   principal): one token's requests in progress, 429 before routing; probes are never counted.
2. :class:`BodyTimeouts` (ASGI middleware, inside it): a request body that stalls or trickles, 408.
3. :class:`UploadSlots` (the ``upload_file``, ``presign_file`` and ``confirm_file`` handlers, before any
   byte is stored): one token's uploads at once, 429, so another token's still get worker threads.
4. :func:`read_plan_budget` (the ``read_plan`` and ``load_tree_pieces`` handlers): the work a plan may
   do, a constant plus a multiple of the regions its request names, 413 before the work is done; the
   regions are at most ``read_plan_max_requests`` (``bodies.parse_read_requests``).
5. :func:`widen_threads` (the lifespan, before the first request): how many blocking calls run in
   worker threads at once, :data:`THREADS`.

Connection-level limits (request heads, unread responses, the connection cap) are in
:mod:`ckptd.service.connections`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from typing import Any, Awaitable, Collection, Iterator, Sequence

import anyio.to_thread
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ckptd_schemas import PlanBudget, RequestTimeout, TooManyRequests

from .auth import ANONYMOUS, Principal, match_route
from .error_body import send_error
from .logs import route_name

__all__ = ["ANSWER_PER_REQUEST", "CHUNKS_PER_REQUEST", "THREADS", "BodyTimeouts", "PrincipalRequests", "UploadSlots",
           "mark_answered", "read_plan_budget", "was_answered", "widen_threads"]

log = logging.getLogger("ckptd.service")

CHUNKS_PER_REQUEST = 64
"""Chunk visits a read plan may make per region it names, beyond the settings' constant: a region visits
the chunks it may meet (its tensor's interval index): one or two for a rank's slice at any world size,
every chunk for a whole tensor (a reshard from W ranks to fewer meets about W over their number). A
load-tree answer holds a chunk row (about 2 KiB with its proof) per chunk visited, at most."""
ANSWER_PER_REQUEST = 2
"""Copies plus fetches a read plan may answer per region it names, beyond the settings' constant (each
costs the service about 4 KiB of memory while the answer is built, and time: BENCHMARKS.md, Figures
behind the code). With at most ``read_plan_max_requests`` regions, a plan's memory is bounded whatever
its request says."""
THREADS = 512
"""Blocking calls (``run_in_threadpool``) run at once; anyio's default is 40. Most wait for the store: a rank's
index waits for the one write that stores every index waiting (:mod:`ckptd.store.rank_indexes`), so at 40
the 41st waited for a thread, not the store (BENCHMARKS.md, Commit lag). 512: the ranks one such write
holds at most; the requests stay bounded by the connection cap and the per-token limits above."""
_ANSWERED = "ckptd_answered"  # scope state key: a middleware has answered the request itself


def widen_threads() -> None:
    """Let :data:`THREADS` blocking calls of this event loop run at once (call it in the loop, before
    serving: anyio's limiter is one per loop)."""
    anyio.to_thread.current_default_thread_limiter().total_tokens = THREADS


def read_plan_budget(requests: int, base_chunks: int, base_answer: int) -> PlanBudget:
    """The budget of a read-plan (or load-tree) request naming ``requests`` regions."""
    return PlanBudget(max_chunks=base_chunks + CHUNKS_PER_REQUEST * requests,
                      max_answer=base_answer + ANSWER_PER_REQUEST * requests,
                      setting="CKPTD_READ_PLAN_CHUNK_BUDGET / CKPTD_READ_PLAN_ANSWER_BUDGET")


def mark_answered(scope: Scope) -> None:
    """Record that a middleware answered this request (a 408 or 413): the client disconnect the app
    meets next is that answer's doing, not the client's."""
    scope.setdefault("state", {})[_ANSWERED] = True


def was_answered(scope: Scope) -> bool:
    return bool(scope.get("state", {}).get(_ANSWERED))


def _leave(active: dict[str, int], name: str) -> None:
    """One upload or request of ``name`` ended: its count down, and no entry left at zero."""
    if left := active[name] - 1:
        active[name] = left
    else:
        del active[name]


class UploadSlots:
    """Concurrent uploads per principal (token name), at most ``limit`` each (0: no limit)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._active: dict[str, int] = {}
        self._lock = threading.Lock()

    @contextlib.contextmanager
    def held(self, principal: str, file: str) -> Iterator[None]:
        """One slot of ``principal`` for the block (``TooManyRequests`` when none is free), given back
        once the upload has finished either way."""
        with self._lock:
            n = self._active.get(principal, 0)
            if self.limit and n >= self.limit:
                raise TooManyRequests(
                    f"token {principal!r} already has {n} uploads in progress, the limit "
                    f"(CKPTD_MAX_UPLOADS_PER_PRINCIPAL) is {self.limit}: file {file!r} was not accepted; "
                    f"retry once one finishes", limit=self.limit, token=principal, file=file, limit_name="uploads")
            self._active[principal] = n + 1
        try:
            yield
        finally:
            with self._lock:
                _leave(self._active, principal)


class PrincipalRequests:
    """At most ``limit`` requests of one principal (token) in progress at once, of every kind (0: no limit;
    module docstring, 1): a request counts from here until the app has answered it (a streamed download
    until its last byte is sent); ``open_paths`` (probes, metrics) never count."""

    def __init__(self, app: ASGIApp, limit: int, open_paths: Collection[str] = (), routes: Sequence[Any] = (),
                 metrics: Any = None) -> None:
        self.app, self.limit, self.open_paths, self.routes, self.metrics = app, limit, open_paths, routes, metrics
        self._active: dict[str, int] = {}  # one event loop: no lock

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        principal = scope.get("state", {}).get("principal") if scope["type"] == "http" else None
        if (self.limit <= 0 or not isinstance(principal, Principal) or principal is ANONYMOUS
                or scope["path"] in self.open_paths):
            await self.app(scope, receive, send)
            return
        name = principal.name
        n = self._active.get(name, 0)
        if n >= self.limit:
            await self._refuse(scope, send, name, n)
            return
        self._active[name] = n + 1
        try:
            await self.app(scope, receive, send)
        finally:
            _leave(self._active, name)

    async def _refuse(self, scope: Scope, send: Send, name: str, n: int) -> None:
        """429 in the error shape; the connection closes when a body follows (it is never read)."""
        match_route(scope, self.routes)  # the access log and the metrics name the route
        if self.metrics is not None:
            self.metrics.limit_refusals.labels("requests").inc()
        err = TooManyRequests(
            f"token {name!r} already has {n} requests in progress, the limit (CKPTD_MAX_REQUESTS_PER_PRINCIPAL) is "
            f"{self.limit}: {scope['method']} {scope['path'][:200]} was not accepted; retry once one finishes",
            limit=self.limit, token=name, in_progress=n, limit_name="requests")
        headers = [(b"retry-after", b"1")]
        if any(k == b"transfer-encoding" or (k == b"content-length" and v.strip() not in (b"", b"0"))
               for k, v in scope.get("headers", ())):
            headers.append((b"connection", b"close"))
        await send_error(send, scope, err, headers)


_TIMEOUT = getattr(asyncio, "timeout", None)  # Python 3.11+


async def _within(awaitable: Awaitable[Message], seconds: float) -> Message:
    """``awaitable`` with a deadline on the running task (``asyncio.timeout``, Python 3.11+): no task per
    body piece, and a message that is already there is taken even at a deadline of 0, where
    ``asyncio.wait_for(..., 0)`` on Python 3.11 cancels it unrun (every body answered 408)."""
    if _TIMEOUT is None:  # Python 3.10
        return await asyncio.wait_for(awaitable, seconds)
    async with _TIMEOUT(seconds):
        return await awaitable


class BodyTimeouts:
    """Answer 408 and close when a request body stalls for ``idle_seconds``, or arrives slower than
    ``min_rate`` bytes/s once ``grace_seconds`` of slack are spent (0 turns either off).

    Only the app's own waits for the body count. The rate is a budget of seconds: a body starts
    with ``grace_seconds``; every wait for it spends its length, every byte that arrives buys
    ``1 / min_rate`` s back, and the budget never exceeds ``max(grace_seconds, idle_seconds)``.
    So a body that arrives at speed may still pause for as long as the idle bound allows, while
    one that trickles, from its start or after a fast start, is answered once it has fallen
    ``grace_seconds`` behind: whatever its size, a body takes at most its length over
    ``min_rate`` plus the grace.
    """

    def __init__(self, app: ASGIApp, idle_seconds: float, min_rate: float = 0.0, grace_seconds: float = 30.0,
                 metrics: Any = None) -> None:
        self.app, self.metrics = app, metrics
        self.idle = idle_seconds if idle_seconds and idle_seconds > 0 else None
        self.rate = min_rate if min_rate and min_rate > 0 else None
        self.grace = max(0.0, grace_seconds)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or (self.idle is None and self.rate is None):
            await self.app(scope, receive, send)
            return
        loop = asyncio.get_running_loop()
        idle, rate = self.idle, self.rate
        ceiling = max(self.grace, idle or 0.0)
        budget = self.grace  # seconds the body may still fall behind the minimum rate
        received, waited = 0, 0.0
        body_done = responded = started = False

        async def timed_receive() -> Message:
            nonlocal body_done, responded, budget, received, waited
            if responded:
                return {"type": "http.disconnect"}
            if body_done:  # after the body: the app waits for a disconnect, as long as it likes
                return await receive()
            by_rate = rate is not None and (idle is None or budget < idle)
            t0 = loop.time()
            try:
                msg = await _within(receive(), max(0.0, budget) if by_rate else idle)
            except asyncio.TimeoutError:
                waited += loop.time() - t0
                responded = True
                mark_answered(scope)
                if not started:
                    await send_error(send, scope, self._timeout(scope, by_rate, received, waited),
                                     [(b"connection", b"close")])
                return {"type": "http.disconnect"}
            spent = loop.time() - t0
            waited += spent
            if msg["type"] == "http.request":
                n = len(msg.get("body", b""))
                received += n
                if rate is not None:
                    budget = min(budget - spent + n / rate, ceiling)
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

    def _timeout(self, scope: Scope, by_rate: bool, received: int, waited: float) -> RequestTimeout:
        """The 408 of a body past a bound (counted and logged here)."""
        route = route_name(scope)
        if self.metrics is not None:
            self.metrics.limit_refusals.labels("body_rate" if by_rate else "body_idle").inc()
        if not by_rate:
            log.warning("%s: request body idle for %.0f s, connection closed (408)", route, self.idle)
            return RequestTimeout(f"the request body sent nothing for {self.idle:g} s "
                                  f"(CKPTD_BODY_IDLE_TIMEOUT_SECONDS): connection closed", timeout_s=self.idle)
        avg = received / waited if waited > 0 else 0.0
        log.warning("%s: request body at %.0f bytes/s (%d bytes in %.1f s), under %g bytes/s: connection closed (408)",
                    route, avg, received, waited, self.rate)
        return RequestTimeout(
            f"the request body arrived at {avg:.0f} bytes/s ({received} bytes in {waited:.1f} s), under the minimum "
            f"of {self.rate:g} bytes/s (CKPTD_BODY_MIN_BYTES_PER_SECOND) once {self.grace:g} s of grace "
            f"(CKPTD_BODY_RATE_GRACE_SECONDS) were spent: connection closed",
            timeout_s=round(waited, 3), min_bytes_per_second=self.rate, received=received)
