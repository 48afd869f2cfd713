"""Keep-alives for the sessions this process joined, so the service tells a slow save from a dead one.

Call order: :func:`~.session_calls.open_session` holds the session (:meth:`KeepAlive.hold`) when the
service asks for keep-alives (``SessionInfo.keepalive_seconds``); one daemon thread per process
then sends ``POST .../sessions/{session}/alive`` at the interval the service gave, through a save
queued behind another, a file that streams for minutes, an incremental save's links made in the
stall long before its upload starts, and after this rank's index while other ranks are minutes
behind. The service's typed answer once the session is committed, refused, aborted or reclaimed
releases it (nothing is left to keep), as does an abort here (:func:`~.session_calls.abort_session`).
A process that dies sends nothing more, and the service reclaims the session once no rank that
joined it was heard from for ten intervals.
"""

from __future__ import annotations

import logging
import threading
import time

from ckptd_schemas import Conflict, Forbidden, InvalidRequest, NotFound, Unauthorized

from .transport import Transport

__all__ = ["KEEPALIVE", "KeepAlive"]

log = logging.getLogger("ckptd_client")


class KeepAlive:
    """The sessions held, each with its transport, interval and next due time; one thread sends."""

    def __init__(self) -> None:
        self._held: dict[tuple[int, str], tuple[Transport, float, float]] = {}
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None

    def hold(self, transport: Transport, path: str, every: float) -> None:
        """Keep the session at ``path`` (``/v1/checkpoints/RUN/NAME/sessions/SID``) alive every ``every`` s."""
        with self._cond:
            self._held[(id(transport), path)] = (transport, every, time.monotonic() + every)
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="ckptd-keepalive", daemon=True)
                self._thread.start()
            self._cond.notify()

    def release(self, transport: Transport, path: str) -> None:
        with self._cond:
            self._held.pop((id(transport), path), None)

    def held(self) -> list[str]:
        with self._cond:
            return [path for _, path in self._held]

    def _run(self) -> None:
        while True:
            with self._cond:
                now = time.monotonic()
                due = [(k, v) for k, v in self._held.items() if v[2] <= now]
                if not due:
                    nxt = min((v[2] for v in self._held.values()), default=now + 60.0)
                    self._cond.wait(max(0.05, nxt - now))
                    continue
                for k, (t, every, _) in due:
                    self._held[k] = (t, every, now + every)
            for (key, (transport, every, _)) in due:
                self._send(key, transport, every)

    def _send(self, key: tuple[int, str], transport: Transport, every: float) -> None:
        if transport.closed:  # its client was closed: nobody of this process writes the session any more
            self.release(transport, key[1])
            return
        try:
            transport.request("POST", f"{key[1]}/alive", retry=False, timeout=min(10.0, every))
        except (NotFound, Conflict, Forbidden, Unauthorized, InvalidRequest) as e:
            log.debug("keep-alive for %s ends: %s", key[1], e.message)  # committed, refused, aborted or reclaimed
            self.release(transport, key[1])
        except Exception as e:  # noqa: BLE001 - unreachable or busy now: the next interval tries again
            log.debug("keep-alive for %s not sent: %s", key[1], e)


#: The process's keep-alive sender.
KEEPALIVE = KeepAlive()
