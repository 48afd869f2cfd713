"""Connection-level limits, in uvicorn's httptools protocol: request heads that never complete,
responses the client never reads, and idle sockets that would exhaust the process's file descriptors.

uvicorn arms no timer on a new connection (its keep-alive timeout starts after a first
response) and none while a request's head arrives, so a client that connects and sends
nothing, or sends its headers one byte a minute, holds a socket and a descriptor forever.
With the descriptors exhausted, accept() fails and ``/healthz`` goes unanswered.
:func:`guard_protocol` subclasses the protocol with two limits:

* a head deadline: ``header_timeout`` seconds from the connection's opening (or from the
  first byte of a later request on it) to the end of the request's headers; past it the
  connection is closed. A body that stalls is :class:`ckptd.service.limits.BodyIdleTimeout`'s.
* a send deadline: while a response waits for the client to read (the transport's write
  buffer is over its high-water mark, so uvicorn has paused the response), at most
  ``send_timeout`` seconds; then the connection is aborted (its buffered bytes dropped). A
  reader that never reads would otherwise hold its socket, a descriptor, a response coroutine
  and up to one storage piece of buffered bytes forever.
* a connection cap: at most :func:`connection_cap` connections (``max_connections``, and
  never more than the descriptor limit less a reserve for storage files and the thread
  pool). A connection over the cap closes the longest-idle connection that has no request
  in progress (a head still arriving counts as idle); failing that, the one whose response
  has waited longest for its client to read; or itself when every one is busy sending or
  receiving. A probe that connects and sends its request at once is answered; idle sockets
  and readers that stopped reading are shed.

Call order: ``serve`` builds the protocol class once (:func:`guard_protocol`) and hands it
to uvicorn as ``http=``; uvicorn calls ``connection_made``, the parser callbacks and
``connection_lost`` on each instance.
"""

from __future__ import annotations

import logging
import resource
from typing import Any

__all__ = ["connection_cap", "guard_protocol"]

log = logging.getLogger("ckptd.service")


def connection_cap(max_connections: int) -> int:
    """``max_connections``, lowered to the descriptor limit less an eighth of it (64 at least)."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or soft <= 0:
        return max_connections
    return max(8, min(max_connections, soft - max(64, soft // 8)))


def guard_protocol(base: type, header_timeout: float, max_connections: int, metrics: Any = None,
                   send_timeout: float = 0.0) -> type:
    """``base`` (uvicorn's httptools protocol, or a subclass) with the head and send deadlines and the cap."""
    cap = connection_cap(max_connections)

    def refused(limit: str) -> None:
        if metrics is not None:
            metrics.limit_refusals.labels(limit).inc()

    class GuardedProtocol(base):  # type: ignore[misc, valid-type]
        _ckptd_head_timer: Any = None
        _ckptd_idle_since = 0.0  # loop time since which no request has been in progress
        _ckptd_send_timer: Any = None
        _ckptd_paused_since: float | None = None  # loop time since which the client has not read enough

        def _ckptd_busy(self) -> bool:
            cycle = getattr(self, "cycle", None)
            return cycle is not None and not cycle.response_complete

        def _ckptd_arm(self) -> None:
            if header_timeout and header_timeout > 0 and self._ckptd_head_timer is None:
                self._ckptd_head_timer = self.loop.call_later(header_timeout, self._ckptd_head_expired)

        def _ckptd_disarm(self) -> None:
            if self._ckptd_head_timer is not None:
                self._ckptd_head_timer.cancel()
                self._ckptd_head_timer = None

        def _ckptd_head_expired(self) -> None:
            self._ckptd_head_timer = None
            if not self.transport.is_closing() and not self._ckptd_busy():
                refused("header_timeout")
                log.debug("closed a connection that sent no complete request head in %.0f s", header_timeout)
                self.transport.close()

        def _ckptd_send_expired(self) -> None:
            self._ckptd_send_timer = None
            if self._ckptd_paused_since is not None and not self.transport.is_closing():
                refused("send_idle")
                log.warning("closed a connection whose client read nothing of its response for %.0f s "
                            "(CKPTD_SEND_IDLE_TIMEOUT_SECONDS)", send_timeout)
                self.transport.abort()  # close() would wait for the unread bytes to drain

        def _ckptd_disarm_send(self) -> None:
            self._ckptd_paused_since = None
            if self._ckptd_send_timer is not None:
                self._ckptd_send_timer.cancel()
                self._ckptd_send_timer = None

        def pause_writing(self) -> None:
            if self._ckptd_paused_since is None:
                self._ckptd_paused_since = self.loop.time()
                if send_timeout and send_timeout > 0:
                    self._ckptd_send_timer = self.loop.call_later(send_timeout, self._ckptd_send_expired)
            super().pause_writing()

        def resume_writing(self) -> None:
            self._ckptd_disarm_send()
            super().resume_writing()

        def _ckptd_shed(self) -> None:
            others = [c for c in self.connections
                      if c is not self and isinstance(c, GuardedProtocol) and not c.transport.is_closing()]
            idle = [c for c in others if not c._ckptd_busy()]
            stalled = [c for c in others if c._ckptd_busy() and c._ckptd_paused_since is not None]
            refused("connections")
            if idle:
                min(idle, key=lambda c: c._ckptd_idle_since).transport.close()
            elif stalled:  # a response its client is not reading: its buffered bytes are dropped
                min(stalled, key=lambda c: c._ckptd_paused_since).transport.abort()
            else:
                log.warning("%d connections open (the cap, CKPTD_MAX_CONNECTIONS or the descriptor limit), every "
                            "one with a request in progress: a new connection was closed", cap)
                self.transport.close()

        def connection_made(self, transport: Any) -> None:
            super().connection_made(transport)
            self._ckptd_idle_since = self.loop.time()
            self._ckptd_arm()
            if len(self.connections) > cap:
                self._ckptd_shed()

        def connection_lost(self, exc: Exception | None) -> None:
            self._ckptd_disarm()
            self._ckptd_disarm_send()
            super().connection_lost(exc)

        def on_message_begin(self) -> None:
            self._ckptd_arm()  # a later request on a kept-alive connection: its head's deadline
            super().on_message_begin()

        def on_headers_complete(self) -> None:
            self._ckptd_disarm()
            super().on_headers_complete()

        def on_response_complete(self) -> None:
            self._ckptd_idle_since = self.loop.time()
            super().on_response_complete()

    GuardedProtocol.__name__ = GuardedProtocol.__qualname__ = f"Guarded{base.__name__}"
    return GuardedProtocol
