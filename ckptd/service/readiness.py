"""Readiness: the storage answers a listing, and the root can be written (``GET /readyz``).

Call order: ``create_app`` builds one :class:`Readiness` over the service's storage
(``app.state.readiness``); ``ckptd serve`` calls :meth:`Readiness.announce` before it listens, which
probes once and says in the first lines of the log when the root cannot be written; each ``/readyz``
calls :meth:`Readiness.start` and waits for its outcome at most :data:`PROBE_DEADLINE` (past it,
:meth:`Readiness.overdue`), and :func:`answer` builds the response.

A probe answers within a second whatever the store does: it reads and writes through
``Storage.for_probes`` (each call tried once, within a short timeout: a store that answers 503 fails
the probe in one round trip, where the service's own calls retry for a minute or more), on a thread
of its own, one at a time; a probe still running at the deadline is answered 503 naming the
deadline, and its outcome, when it comes, answers the next ``/readyz``.

The write probe creates and deletes a small hidden object at the root (``.ckptd-ready-<id>``: never
listed, and written with ``create_if_absent``, the one write no save protocol step is made of). Its
outcome, with the listing's, is kept for :data:`PROBE_SECONDS`: a storm of probes costs one write
per few seconds. Why a root cannot be written is the error a save would meet there (a read-only
filesystem, a root the service's user may not write: ``StorageReadOnly``, answered 507 and never
retried), so ``/readyz`` reports exactly that message.

``/readyz`` (``for=writes``, the default) is ready when both hold, else 503. A service meant to
serve loads only from a read-only root is probed with ``/readyz?for=reads``: ready while the listing
works, and the body still says that the root cannot be written and why.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from concurrent.futures import Future, TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import Any, Callable, Literal

from ckptd_schemas import CkptdError, StorageError, StoragePermanent

from ..storage import Storage
from .error_body import error_body

__all__ = ["PROBE_DEADLINE", "PROBE_SECONDS", "Probe", "Readiness", "answer"]

log = logging.getLogger("ckptd.service")
PROBE_SECONDS = 5.0  # how long one probe's outcome answers /readyz
PROBE_DEADLINE = 0.8  # seconds /readyz waits for a probe before it answers 503 (the probe goes on)


@dataclass(frozen=True)
class Probe:
    """One probe's outcome: ``read_error`` (the listing failed) and ``write_error`` (the root cannot be
    written), None where that part worked; ``at``: its ``time.monotonic()``."""

    read_error: StorageError | None
    write_error: StorageError | None
    at: float

    @property
    def readable(self) -> bool:
        return self.read_error is None

    @property
    def writable(self) -> bool:
        return self.write_error is None


class Readiness:
    """Probes ``storage`` at most once per ``seconds``; ``on_failure`` counts each failed probe part."""

    def __init__(self, storage: Storage, seconds: float = PROBE_SECONDS,
                 on_failure: Callable[[StorageError], None] | None = None) -> None:
        self.storage, self.seconds = storage.for_probes(), seconds
        self.on_failure: Callable[[StorageError], None] = on_failure or (lambda _: None)
        self._last: Probe | None = None
        self._running: Future | None = None  # the probe in progress: one at a time, the others take its outcome
        self._lock = threading.Lock()  # held only to look at the two above, never while probing

    def start(self) -> Future:
        """The last outcome while it is fresh (a done future), else the probe in progress, started here
        when none is (on a thread of its own). Never blocks."""
        with self._lock:
            last = self._last
            if last is not None and time.monotonic() - last.at < self.seconds:
                done: Future = Future()
                done.set_result(last)
                return done
            if self._running is None:
                self._running = Future()
                threading.Thread(target=self._run, args=(self._running,), name="ckptd-readiness",
                                 daemon=True).start()
            return self._running

    def check(self, deadline: float | None = None) -> Probe:
        """The last outcome while it is fresh, else a new probe's (blocking: call it off the event
        loop); past ``deadline`` seconds, :meth:`overdue` (the probe goes on)."""
        try:
            return self.start().result(timeout=deadline)
        except FutureTimeout:
            return self.overdue(deadline or 0.0)

    def overdue(self, deadline: float) -> Probe:
        """The outcome of a probe that has not answered in ``deadline`` seconds: neither part holds."""
        err = StorageError(f"the storage did not answer the readiness probe (a listing and a small write at the "
                           f"root) within {deadline:g} s", timeout_s=deadline)
        self.on_failure(err)
        return Probe(err, err, time.monotonic())

    def _run(self, fut: Future) -> None:
        try:
            probe = self._probe()
        except BaseException as e:  # noqa: BLE001 - the waiters raise it; the next start probes again
            with self._lock:
                self._running = None
            fut.set_exception(e)
            return
        with self._lock:
            self._last, self._running = probe, None
        fut.set_result(probe)

    def _probe(self) -> Probe:
        read_error = self._attempt(lambda: self.storage.list("runs"))
        key = f".ckptd-ready-{uuid.uuid4().hex[:12]}"

        def write() -> None:
            self.storage.create_if_absent(key, b"ckptd readiness probe\n")
            self.storage.delete(key)

        return Probe(read_error, self._attempt(write), time.monotonic())

    def _attempt(self, fn: Callable[[], Any]) -> StorageError | None:
        try:
            fn()
        except CkptdError as e:  # the backend's own refusal (an unsafe key) too: as a storage failure
            err = e if isinstance(e, StorageError) else StorageError(e.message, **e.details)
            self.on_failure(err)
            return err
        return None

    def announce(self, wait: float = 10.0) -> None:
        """Probe once, and log (a warning) when the root cannot be written or read: the first lines of
        ``ckptd serve`` say it. A probe still running after ``wait`` seconds (a slow store) logs when
        it ends, and the service starts meanwhile."""
        t = threading.Thread(target=self._announce, name="ckptd-readiness", daemon=True)
        t.start()
        t.join(wait)

    def _announce(self) -> None:
        probe = self.check()
        url = self.storage.url
        if not probe.readable:
            log.warning("storage root %s cannot be listed: %s", url, probe.read_error.message)  # type: ignore[union-attr]
        if isinstance(probe.write_error, StoragePermanent):
            log.warning("storage root %s cannot be written: serving loads only; saves are refused at once (507 %s): "
                        "%s", url, probe.write_error.code, probe.write_error.message)
        elif probe.write_error is not None:
            log.warning("storage root %s could not be written just now (/readyz retries): %s", url,
                        probe.write_error.message)


def answer(probe: Probe, url: str, need: Literal["writes", "reads"],
           request_id: str | None = None) -> tuple[int, dict]:
    """(status, body) of ``/readyz``: 200 when what ``need`` asks for holds (``writes``: listed and
    written; ``reads``: listed), else 503. The body says both, and why not (``reason``, and the typed
    error of the failing part, as every error body carries it, when not ready)."""
    ready = probe.readable and (probe.writable or need == "reads")
    failure = probe.read_error or probe.write_error
    body: dict[str, Any] = {"status": "ready" if ready else "not ready", "for": need, "storage": url,
                            "readable": probe.readable, "writable": probe.writable}
    if failure is not None:
        body["reason"] = failure.message
    if not ready and failure is not None:
        body.update(error_body(failure, request_id))
    return (200 if ready else 503), body
