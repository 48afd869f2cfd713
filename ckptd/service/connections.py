"""Connection-level limits in front of uvicorn's HTTP protocol: request heads that never
complete or never end, responses the client never reads, idle sockets that would exhaust the
process's file descriptors, and parser errors answered in the service's error shape.

uvicorn arms no timer on a new connection (its keep-alive timeout starts after a first
response) and none while a request's head arrives, and its httptools parser puts no bound on
a head's size; so a client that connects and sends nothing, sends its headers one byte a
minute, or sends one endless header, holds a socket, a descriptor and memory forever. With
the descriptors exhausted, accept() fails and ``/healthz`` goes unanswered.

:class:`ConnectionGuard` wraps each connection's protocol by composition
(:class:`GuardedConnection`, an ``asyncio.Protocol`` that owns uvicorn's protocol, whichever
uvicorn picks, and hands it the transport through a view) and learns where each request is
from an ASGI middleware (:meth:`ConnectionGuard.track`); it relies on nothing of uvicorn but
its ``http=`` protocol-class option and the ASGI scope's ``client``. Its limits:

* a head bound: at most ``max_header_bytes`` from a request's first byte to the blank line
  that ends its head; beyond, 431 in the service's error shape and the connection closed.
* a head deadline: ``header_timeout`` seconds from the connection's opening (or from the
  first byte of a later request on it) to the end of the request's head; past it the
  connection is closed. A body that stalls or trickles is :class:`ckptd.service.limits.BodyTimeouts`'s.
* a send deadline: while a response waits for the client to read (the transport's write
  buffer is over its high-water mark, so uvicorn has paused the response), at most
  ``send_timeout`` seconds; then the connection is aborted (its buffered bytes dropped).
* a connection cap: at most :func:`connection_cap` connections. One over it closes, in order, the
  longest-idle connection with no request in progress (a head still arriving counts as idle), the
  one whose response has waited longest for its client to read, or the one whose request body is
  furthest behind ``min_body_rate`` (bytes received less the rate times its seconds, those uvicorn
  paused reading not counted; answered 503 ``Unavailable``, ``Retry-After``). When every other
  connection is busy otherwise, up to :data:`PROBE_CONNECTIONS` more are kept for
  :data:`PROBE_PATHS` only (full: one kept longest without a request makes room); any other request
  on one is answered 503, a probe's answer closes it; only then is a new connection closed
  (docs/security.md, "The connection cap sheds the least useful connection").
* parser errors: what the parser writes while it parses (its plain-text 400 for malformed
  framing) is replaced by the service's JSON 400, or dropped when a response is mid-stream.

Where each request's head and body begin and end comes from the connection's own ``httptools``
parser (llhttp: parsing the bytes twice costs little), fed the same bytes as uvicorn's, with the
same leniency, its callbacks the connection's ``on_*`` methods; bytes it refuses, uvicorn's parser
refuses too (400), and the guard stops tracking.

Call order: ``serve`` passes ``guard.protocol(inner)`` to uvicorn as ``http=`` and ``guard.track(app)``
as the app; uvicorn calls each :class:`GuardedConnection` as a protocol, which calls uvicorn's; the
middleware reports ``request_started`` and ``request_ended``; uvicorn's flow control reaches
``pause_reading``/``resume_reading`` through the transport view, which reports them.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import resource
from collections.abc import Callable
from typing import Any

import httptools

from starlette.types import Scope, Send

from ckptd_schemas import InvalidRequest, PayloadTooLarge, Unavailable

from .error_body import raw_error_response, send_error
from .limits import mark_answered

__all__ = ["PROBE_CONNECTIONS", "PROBE_PATHS", "ConnectionGuard", "GuardedConnection", "connection_cap"]

log = logging.getLogger("ckptd.service")

_PARSER_400 = b"HTTP/1.1 400 "
PROBE_PATHS = frozenset({"/healthz", "/readyz"})
"""The requests a connection kept over the cap may carry."""
PROBE_CONNECTIONS = 16
"""Connections kept over the cap for probes when every other one is busy (within the descriptors
:func:`connection_cap` leaves free)."""
_REFERENCE_RATE = 1024.0  # bytes/s: orders the bodies to shed when no minimum rate is set


def connection_cap(max_connections: int) -> int:
    """``max_connections``, lowered to the descriptor limit less an eighth of it (64 at least)."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or soft <= 0:
        return max_connections
    return max(8, min(max_connections, soft - max(64, soft // 8)))


class ConnectionGuard:
    """The limits and the open connections of one server (see the module docstring)."""

    def __init__(self, header_timeout: float, send_timeout: float, max_header_bytes: int, max_connections: int,
                 metrics: Any = None, min_body_rate: float = 0.0) -> None:
        self.header_timeout, self.send_timeout = header_timeout, send_timeout
        self.body_rate = min_body_rate if min_body_rate > 0 else _REFERENCE_RATE
        self.max_header_bytes, self.cap, self.metrics = max_header_bytes, connection_cap(max_connections), metrics
        self.open: dict[tuple[str, int], GuardedConnection] = {}
        self.too_large = raw_error_response(
            PayloadTooLarge(f"request line and headers exceed {max_header_bytes} bytes", limit=max_header_bytes),
            status=431, reason="Request Header Fields Too Large")

    def protocol(self, inner: Callable[..., asyncio.Protocol]) -> Callable[..., asyncio.Protocol]:
        """A protocol factory for uvicorn's ``http=``: each connection's ``inner`` (called with
        uvicorn's keyword arguments) behind a :class:`GuardedConnection`."""
        def make(**kwargs: Any) -> GuardedConnection:
            return GuardedConnection(self, inner(**kwargs))
        return make

    def track(self, app: Any) -> Any:
        """``app`` with each HTTP request reported to the connection it arrived on."""
        guard = self

        async def tracked(scope: dict, receive: Callable, send: Callable) -> None:
            client = scope.get("client") if scope.get("type") == "http" else None
            conn = guard.open.get((str(client[0]), int(client[1]))) if client else None
            if conn is None:
                await app(scope, receive, send)
                return
            conn.request_started(scope)
            probe_only = conn.probe_only

            async def tracked_send(msg: dict) -> None:
                if msg.get("type") == "http.response.start":
                    conn.responding = True
                    if probe_only:  # the probe's answer ends the connection: the room over the cap is for probes
                        msg = {**msg, "headers": [*msg.get("headers", []), (b"connection", b"close")]}
                await send(msg)

            try:
                if probe_only and scope.get("path") not in PROBE_PATHS:
                    await guard.refuse_over_cap(scope, tracked_send)
                else:
                    await app(scope, receive, tracked_send)
            finally:
                conn.request_ended()

        return tracked

    async def refuse_over_cap(self, scope: Scope, send: Send) -> None:
        """503 for a request other than a probe on a connection kept over the cap for probes."""
        self.refused("connections")
        err = Unavailable(f"the service is at its connection cap ({self.cap} connections, CKPTD_MAX_CONNECTIONS or "
                          f"the descriptor limit), every one busy: this connection was accepted for /healthz and "
                          f"/readyz only; retry", limit=self.cap)
        await send_error(send, scope, err, [(b"retry-after", b"1"), (b"connection", b"close")])

    def shed_response(self, received: int, seconds: float) -> bytes:
        """The raw 503 written to a connection whose request body is shed at the cap."""
        err = Unavailable(f"the service is at its connection cap ({self.cap} connections, CKPTD_MAX_CONNECTIONS or "
                          f"the descriptor limit), every one busy: this request's body, the furthest behind "
                          f"({received} bytes in {seconds:.1f} s), was dropped to make room; retry",
                          limit=self.cap, received=received)
        raw = raw_error_response(err, reason="Service Unavailable")
        return raw.replace(b"\r\n\r\n", b"\r\nretry-after: 1\r\n\r\n", 1)

    def refused(self, limit: str) -> None:
        if self.metrics is not None:
            self.metrics.limit_refusals.labels(limit).inc()


class GuardedConnection(asyncio.Protocol):
    """One client connection: the guard's limits, then uvicorn's protocol ``inner``."""

    def __init__(self, guard: ConnectionGuard, inner: asyncio.Protocol) -> None:
        self.guard, self.inner = guard, inner
        self.transport: Any = None
        self.key: tuple[str, int] | None = None
        self.loop = asyncio.get_running_loop()
        self.framing: Any = None
        self._new_framing()
        self.in_body = False  # between a head's end and its message's end
        self.head_bytes = 0  # bytes received since the current head began
        self.parsed = 0  # request line and headers parsed so far
        self.pending_heads = 0  # heads seen ending whose request the app has not started
        self.in_app = 0  # requests the app is handling
        self.responding = False  # a response has started and its request has not ended
        self.refusing = False  # a head over the bound: bytes are dropped, 431 follows the requests before it
        self.parsing = False  # inside inner.data_received: what it writes is the parser's
        self.idle_since = self.loop.time()
        self.paused_since: float | None = None
        self.probe_only = False  # kept over the cap: probes only, closed after one
        self.scope: Scope | None = None  # the request the app is handling
        self.body_started: float | None = None  # when the body now arriving began (its head ended)
        self.body_bytes = 0  # bytes of that body received so far
        self.content_length: int | None = None  # the head's Content-Length (None: absent, or chunked)
        self.body_left: int | None = None  # bytes of a Content-Length body still to come
        self.chunked = False  # the head names a Transfer-Encoding: the framing parser counts its body
        self.body_paused = 0.0  # read_paused(now) when it began
        self.read_paused_total = 0.0  # seconds uvicorn has paused reading this connection, finished pauses
        self.read_paused_since: float | None = None
        self.head_timer: asyncio.TimerHandle | None = None
        self.send_timer: asyncio.TimerHandle | None = None

    # -- asyncio.Protocol, forwarded to uvicorn's protocol -------------------------------------------------------

    def connection_made(self, transport: Any) -> None:
        self.transport = transport
        peer = transport.get_extra_info("peername")
        if isinstance(peer, tuple) and len(peer) >= 2:
            self.key = (str(peer[0]), int(peer[1]))
            self.guard.open[self.key] = self
        self.inner.connection_made(_TransportView(transport, self))
        self._arm_head()
        if len(self.guard.open) > self.guard.cap:
            self._shed()

    def data_received(self, data: bytes) -> None:
        if self.refusing:
            return
        if self.framing is not None and not self._track(data):
            return
        self.parsing = True
        try:
            self.inner.data_received(data)
        finally:
            self.parsing = False

    def eof_received(self) -> bool | None:
        return self.inner.eof_received()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm_head()
        self._disarm_send()
        if self.key is not None and self.guard.open.get(self.key) is self:
            del self.guard.open[self.key]
        self.inner.connection_lost(exc)

    def pause_writing(self) -> None:
        if self.paused_since is None:
            self.paused_since = self.loop.time()
            if self.guard.send_timeout > 0:
                self.send_timer = self.loop.call_later(self.guard.send_timeout, self._send_expired)
        self.inner.pause_writing()

    def resume_writing(self) -> None:
        self._disarm_send()
        self.inner.resume_writing()

    # -- reports from the middleware ---------------------------------------------------------------------------

    def request_started(self, scope: Scope | None = None) -> None:
        self.pending_heads = max(0, self.pending_heads - 1)
        self.in_app += 1
        self.scope = scope

    def request_ended(self) -> None:
        self.in_app = max(0, self.in_app - 1)
        self.responding = False
        self.scope = None
        self.idle_since = self.loop.time()
        if self.refusing and not self.in_app:
            self._answer_too_large()

    def busy(self) -> bool:
        return bool(self.in_app or self.pending_heads)

    # -- flow control, reported by the transport view: seconds uvicorn does not read are not the client's

    def reading_paused(self) -> None:
        if self.read_paused_since is None:
            self.read_paused_since = self.loop.time()

    def reading_resumed(self) -> None:
        if self.read_paused_since is not None:
            self.read_paused_total += self.loop.time() - self.read_paused_since
            self.read_paused_since = None

    def read_paused(self, now: float) -> float:
        return self.read_paused_total + (now - self.read_paused_since if self.read_paused_since is not None else 0.0)

    def receiving_body(self) -> bool:
        """A request whose body is still arriving, with no response begun."""
        return self.in_body and self.body_started is not None and not self.responding and not self.refusing

    def body_seconds(self, now: float) -> float:
        """Seconds the body now arriving has taken, less those uvicorn paused reading it."""
        if self.body_started is None:
            return 0.0
        return max(0.0, now - self.body_started - (self.read_paused(now) - self.body_paused))

    def body_lead(self, now: float) -> float:
        """Bytes the body is ahead of the guard's rate (negative: behind); the lowest is shed first."""
        return self.body_bytes - self.guard.body_rate * self.body_seconds(now)

    def _track(self, data: bytes) -> bool:
        """Feed ``data`` to the framing parser and count it against the head bound; False when refused.

        The bytes of a body whose length the head declared are counted here instead of being fed to
        the framing parser (which would copy every piece of the body only to report its length):
        when the body ends, a fresh parser takes the bytes that follow (a pipelined request)."""
        left = self.body_left
        if left:  # inside a Content-Length body: count, do not parse
            n = len(data)
            if n < left:
                self.body_part(n)
                return True
            self.body_part(left)
            self.on_message_complete()
            self._new_framing()
            if n == left:
                return True
            data = data[left:]
        limit = self.guard.max_header_bytes
        if not self.in_body:
            self.head_bytes += len(data)
        try:
            self.framing.feed_data(data)
        except httptools.HttpParserCallbackError:  # a request line or header over the bound
            self._refuse_too_large()
            return False
        except (httptools.HttpParserError, httptools.HttpParserUpgrade):
            self.framing = None  # uvicorn's parser, fed the same bytes, answers them
            return True
        if not self.in_body and self.head_bytes > limit:  # one header still arriving
            self._refuse_too_large()
            return False
        return True

    def _new_framing(self) -> None:
        """A fresh framing parser, as lenient as uvicorn's; its callbacks are the ``on_*`` methods below."""
        self.framing = httptools.HttpRequestParser(self)
        with contextlib.suppress(AttributeError):  # httptools < 0.6.3
            self.framing.set_dangerous_leniencies(lenient_data_after_close=True)

    # -- the framing parser's callbacks (httptools calls them while it parses) ---------------------------------

    def on_message_begin(self) -> None:
        self.parsed, self.in_body = 0, False
        self.content_length = self.body_left = None
        self.chunked = False
        self._arm_head()  # the first byte of a later request on a kept-alive connection

    def on_url(self, url: bytes) -> None:
        self.head_part(len(url))

    def on_header(self, name: bytes, value: bytes) -> None:
        self.head_part(len(name) + len(value) + 4)
        key = name.lower()
        if key == b"content-length" and not self.chunked:
            self.content_length = int(value) if value.strip().isdigit() else None
        elif key == b"transfer-encoding":  # the parser frames the body (a Content-Length beside it is void)
            self.content_length, self.chunked = None, True

    def head_part(self, size: int) -> None:
        self.parsed += size
        if self.parsed > self.guard.max_header_bytes:
            raise ValueError("request head over the bound")

    def on_headers_complete(self) -> None:
        self.in_body = True
        self.pending_heads += 1
        self._disarm_head()
        now = self.loop.time()
        self.body_started, self.body_bytes, self.body_paused = now, 0, self.read_paused(now)
        self.body_left = self.content_length

    def on_body(self, body: bytes) -> None:
        self.body_part(len(body))

    def body_part(self, size: int) -> None:
        self.body_bytes += size
        if self.body_left is not None:
            self.body_left -= size

    def on_message_complete(self) -> None:
        self.in_body, self.head_bytes = False, 0
        self.body_left = None
        self.body_started = None

    def _refuse_too_large(self) -> None:
        """Stop taking bytes; answer 431 and close now, or once the requests before it are answered."""
        self.refusing = True
        self.guard.refused("header_bytes")
        log.warning("request head over %d bytes refused (431)", self.guard.max_header_bytes)
        if not self.in_app and not self.pending_heads:
            self._answer_too_large()

    def _answer_too_large(self) -> None:
        if not self.transport.is_closing():
            self.transport.write(self.guard.too_large)
            self.transport.close()

    def _arm_head(self) -> None:
        timeout = self.guard.header_timeout
        if timeout > 0 and self.head_timer is None:
            self.head_timer = self.loop.call_later(timeout, self._head_expired)

    def _disarm_head(self) -> None:
        if self.head_timer is not None:
            self.head_timer.cancel()
            self.head_timer = None

    def _head_expired(self) -> None:
        self.head_timer = None
        if self.transport.is_closing():
            return
        if self.busy():  # a pipelined head behind a request in progress: its time counts once that is answered
            self._arm_head()
        else:
            self.guard.refused("header_timeout")
            log.debug("closed a connection that sent no complete request head in %.0f s", self.guard.header_timeout)
            self.transport.close()

    def _send_expired(self) -> None:
        self.send_timer = None
        if self.paused_since is not None and not self.transport.is_closing():
            self.guard.refused("send_idle")
            log.warning("closed a connection whose client read nothing of its response for %.0f s "
                        "(CKPTD_SEND_IDLE_TIMEOUT_SECONDS)", self.guard.send_timeout)
            self.transport.abort()  # close() would wait for the unread bytes to drain

    def _disarm_send(self) -> None:
        self.paused_since = None
        if self.send_timer is not None:
            self.send_timer.cancel()
            self.send_timer = None

    def _shed(self) -> None:
        """Over the cap: make room by the order of the module docstring's connection cap."""
        now = self.loop.time()
        others = [c for c in self.guard.open.values() if c is not self and not c.transport.is_closing()]
        idle = [c for c in others if not c.busy() and not c.probe_only]  # a probe's head may be on its way
        stalled = [c for c in others if c.busy() and c.paused_since is not None]
        bodies = [c for c in others if c.busy() and c.receiving_body()]
        probes = [c for c in others if c.probe_only]
        if len(probes) < PROBE_CONNECTIONS and not (idle or stalled or bodies):
            self.probe_only = True
            return
        self.guard.refused("connections")
        if idle:
            min(idle, key=lambda c: c.idle_since).transport.close()
        elif stalled:  # a response its client is not reading: its buffered bytes are dropped
            min(stalled, key=lambda c: c.paused_since or 0.0).transport.abort()
        elif bodies:
            min(bodies, key=lambda c: (c.body_lead(now), c.body_started or 0.0)).drop_body(now)
        elif waiting := [c for c in probes if not c.busy()]:  # the room for probes is full: of those that
            min(waiting, key=lambda c: c.idle_since).transport.close()  # have sent no request, the longest
            self.probe_only = True  # idle makes room
        else:
            log.warning("%d connections open (the cap, CKPTD_MAX_CONNECTIONS or the descriptor limit) and %d more "
                        "for probes, every one with a request in progress: a new connection was closed",
                        self.guard.cap, PROBE_CONNECTIONS)
            self.transport.close()

    def drop_body(self, now: float) -> None:
        """Shed at the cap while its request body arrives: 503 (unless a response began), then closed.
        The app then meets a disconnect, which is this answer's doing, not the client's."""
        received, seconds = self.body_bytes, self.body_seconds(now)
        log.warning("%d connections open (the cap, CKPTD_MAX_CONNECTIONS or the descriptor limit), every one with a "
                    "request in progress: closed the one whose request body is furthest behind (%d bytes in %.1f s)",
                    self.guard.cap, received, seconds)
        if self.scope is not None:
            mark_answered(self.scope)
        if not self.responding:
            self.transport.write(self.guard.shed_response(received, seconds))
        self.transport.close()


class _TransportView:
    """The transport as uvicorn's protocol sees it: the same, except that what the parser
    writes while parsing (its own 400) becomes the service's error shape."""

    def __init__(self, transport: Any, conn: GuardedConnection) -> None:
        self._transport, self._conn = transport, conn

    def write(self, data: bytes | bytearray | memoryview) -> None:
        if self._conn.parsing and bytes(data[:len(_PARSER_400)]) == _PARSER_400:
            if self._conn.responding:
                return  # a response is mid-stream: the parser's 400 would corrupt it; the close follows
            data = raw_error_response(InvalidRequest(f"malformed HTTP request: {_reason(data)}"),
                                      reason="Bad Request")
        self._transport.write(data)

    def pause_reading(self) -> None:
        self._conn.reading_paused()
        self._transport.pause_reading()

    def resume_reading(self) -> None:
        self._conn.reading_resumed()
        self._transport.resume_reading()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)


def _reason(response: bytes | bytearray | memoryview) -> str:
    """The plain-text body of the parser's 400 (uvicorn's message), or a generic one."""
    raw = bytes(response)
    body = raw.partition(b"\r\n\r\n")[2].decode("ascii", "replace").strip()
    return body[:200] or "the request could not be parsed"
