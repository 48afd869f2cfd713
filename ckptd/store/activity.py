"""When an upload session last showed a live writer, and when the sweep reclaims it: one rule.

A session is alive while a rank that joined it is: every writer request that succeeds (a file, a
presign, a confirmation, a link, a rank's index) and the client's keep-alive, which a rank sends from opening the
session until it is committed, refused or gone (``SessionInfo.keepalive_seconds`` tells it how
often), mark it active. A rank done with its part keeps sending: the others may be minutes behind
(a longer upload queue), and the session dies only when every rank that joined it stopped. A
status poll counts for nothing (it changes nothing).

Call order: :meth:`SessionActivity.touch` once a writer request of the session succeeded (a refused
one writes nothing) and on ``SessionStore.keep_alive``; :meth:`SessionActivity.held` around a writer
inside the service's process (a reshard job, an import), which has no client to send keep-alives;
:meth:`SessionActivity.last` and :func:`reclaim_at` when the sweep (``Sweeper.reclaim_stale``)
or the web view asks when a session goes. The record is one
small object per session (``Paths.activity``), written at most every ``every`` seconds by each
process, so a thousand ranks' keep-alives cost a write per interval, not a thousand.
"""

from __future__ import annotations

import contextlib
import json
import logging
import threading
import time
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from typing import Iterator

from ckptd_schemas import CkptdError

from ..storage import Storage
from .paths import Paths

__all__ = ["DEAD_SESSION_AFTER", "KEEPALIVE_PER_WINDOW", "Reclaim", "SessionActivity", "reclaim_at"]

log = logging.getLogger("ckptd.store")

DEAD_SESSION_AFTER = 300.0  # seconds without a live writer before an uncommitted session is reclaimed
KEEPALIVE_PER_WINDOW = 10  # keep-alives a rank sends per idle window: nine can be lost before it matters


@dataclass(frozen=True)
class Reclaim:
    """When the sweep reclaims a session, and why: ``idle`` (no live writer since ``last``) or
    ``expired`` (opened longer ago than the TTL, however active: a writer that never finishes)."""

    at: datetime
    reason: str
    last: datetime


def reclaim_at(created: datetime, last: datetime | None, *, ttl: float, idle: float) -> Reclaim:
    """The one rule: the earlier of ``created + ttl`` and ``last activity + idle`` (activity counted
    from the opening when no writer was seen since)."""
    last = max(created, last) if last is not None else created
    expires, goes_idle = created + timedelta(seconds=ttl), last + timedelta(seconds=idle)
    if goes_idle < expires:
        return Reclaim(goes_idle, "idle", last)
    return Reclaim(expires, "expired", last)


class SessionActivity:
    """The activity record of each session: written on touch (throttled per process), read by the sweep."""

    def __init__(self, storage: Storage, *, every: float = DEAD_SESSION_AFTER / KEEPALIVE_PER_WINDOW / 2) -> None:
        self.storage, self.every = storage, every
        self._written: dict[str, float] = {}  # session key -> monotonic time of this process's last write
        self._lock = threading.Lock()
        self._held: set[tuple[str, str, str]] = set()
        self._thread: threading.Thread | None = None

    def hold(self, run: str, name: str, sid: str) -> None:
        """A writer in this process (a reshard job, an import) works on the session until :meth:`release`:
        a thread touches it every ``every`` seconds, between writes that may be minutes apart."""
        with self._lock:
            self._held.add((run, name, sid))
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._keep, name="ckptd-session-activity", daemon=True)
                self._thread.start()
        self.touch(run, name, sid)

    def release(self, run: str, name: str, sid: str) -> None:
        with self._lock:
            self._held.discard((run, name, sid))

    @contextlib.contextmanager
    def held(self, run: str, name: str, sid: str) -> Iterator[None]:
        """:meth:`hold` for the block."""
        self.hold(run, name, sid)
        try:
            yield
        finally:
            self.release(run, name, sid)

    def _keep(self) -> None:
        while True:
            time.sleep(self.every)
            with self._lock:
                held = list(self._held)
            for run, name, sid in held:
                try:
                    self.touch(run, name, sid)
                except Exception:  # noqa: BLE001 - the store unreachable now: the next interval tries again
                    log.warning("session %s of %s/%s: activity not recorded", sid, run, name, exc_info=True)

    def _recent(self, key: str, now: float) -> bool:
        """This process wrote ``key``'s record less than (about) ``every`` seconds before ``now``; the
        caller holds the lock. The margin keeps a thread that touches every ``every`` seconds writing."""
        return now - self._written.get(key, -self.every) < self.every * 0.9

    def fresh(self, run: str, name: str, sid: str) -> bool:
        """True when this process recorded the session's activity moments ago: a keep-alive then needs
        no read or write of the store at all."""
        with self._lock:
            return self._recent(Paths.activity(run, name, sid), time.monotonic())

    def forget(self, run: str, name: str, sid: str) -> None:
        """The session ended here (committed, refused, aborted): its next keep-alive is checked against
        the store again (and answered 409 or 404), not taken as fresh."""
        with self._lock:
            self._written.pop(Paths.activity(run, name, sid), None)

    def touch(self, run: str, name: str, sid: str) -> None:
        """Record that a writer of the session is alive now (at most one write per ``every`` seconds)."""
        key, now = Paths.activity(run, name, sid), time.monotonic()
        with self._lock:
            if self._recent(key, now):
                return
            self._written[key] = now
            if len(self._written) > 4096:  # sessions long gone: forget them
                for k in [k for k, t in self._written.items() if now - t > 10 * self.every]:
                    del self._written[k]
        self.storage.put(key, json.dumps({"at": datetime.now(timezone.utc).isoformat()}).encode())

    def last(self, run: str, name: str, sid: str) -> datetime | None:
        """The last recorded activity, or None when no writer was recorded (or the record is unreadable)."""
        try:
            data = self.storage.read_json_or_none(Paths.activity(run, name, sid))
            at = datetime.fromisoformat(data["at"]) if isinstance(data, dict) else None
        except (CkptdError, KeyError, TypeError, ValueError):
            return None
        return at if at is not None and at.tzinfo is not None else None
