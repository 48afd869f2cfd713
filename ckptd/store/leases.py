"""Leases: a checkpoint being read or converted must not be deleted.

A lease is a small object ``leases/<run>/<name>/<holder>.json`` holding an
expiry time; holders renew it while they work and release it when done.
Retention (``ckptd gc``) skips any checkpoint with an unexpired lease. A
crashed holder's lease simply expires.

The service's reads lease what they serve (:class:`ReadLeases`): serving a manifest, a read plan
or file bytes renews the lease the request names (``X-Ckptd-Lease``: a load's own, released when
it returns), or else leases the checkpoint on this replica's account for
``CKPTD_READ_LEASE_SECONDS``, so gc does not delete it under a load that is still fetching its
files (renewed at most every half lease per replica).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import threading
import time
import uuid
from typing import Iterator

from ..storage import Storage

__all__ = ["Leases", "ReadLeases"]


class Leases:
    def __init__(self, storage: Storage) -> None:
        self.storage = storage

    @staticmethod
    def _key(run: str, name: str, holder: str) -> str:
        return f"leases/{run}/{name}/{holder}.json"

    def acquire(self, run: str, name: str, holder: str, *, ttl: float) -> None:
        self.storage.put(self._key(run, name, holder),
                         json.dumps({"holder": holder, "expires_at": time.time() + ttl}).encode())

    def release(self, run: str, name: str, holder: str) -> None:
        self.storage.delete(self._key(run, name, holder))

    def active(self, run: str, name: str, *, now: float | None = None) -> list[str]:
        """The holders of the unexpired leases on ``run/name``."""
        return [holder for holder, _ in self.holding(run, name, now=now)]

    def describe(self, run: str, name: str) -> str:
        """Why retention keeps a leased checkpoint: each holder and when its lease ends (``leased`` when
        they are gone by now)."""
        held = self.holding(run, name)
        if not held:
            return "leased"
        return "leased by " + ", ".join(
            f"{h} until {time.strftime('%Y-%m-%d %H:%M:%S', time.gmtime(t))} UTC" for h, t in held[:4]) + (
            f" and {len(held) - 4} more" if len(held) > 4 else "")

    def holding(self, run: str, name: str, *, now: float | None = None) -> list[tuple[str, float]]:
        """(holder, expiry as a Unix time) of each unexpired lease on ``run/name``."""
        now = time.time() if now is None else now
        out = []
        for entry in self.storage.list(f"leases/{run}/{name}"):
            # A read that fails raises (gc then deletes nothing); an entry that is not a lease this
            # store wrote (a directory, not JSON, no expiry) holds nothing.
            key = f"leases/{run}/{name}/{entry}"
            path = self.storage.local_path(key)
            if path is not None and not os.path.isfile(path):
                continue  # never opened: a FIFO there would block gc
            raw = self.storage.read_or_none(key)
            try:
                data = json.loads(raw) if raw is not None else None
                expires = float(data.get("expires_at", 0)) if isinstance(data, dict) else 0.0
            except (ValueError, TypeError, OverflowError):
                continue
            if expires > now:
                out.append((str(data.get("holder", entry)), expires))
        return out

    @contextlib.contextmanager
    def hold(self, run: str, name: str, what: str, *, ttl: float = 300.0,
             holder: str | None = None) -> Iterator[str]:
        """Lease ``run/name`` for the duration of the block (``what``: reshard, export...), renewed every
        ``ttl / 3`` seconds by a thread, released at the end; a crashed holder's lease expires.
        ``holder`` names the lease (a reshard job takes over the one its submission took)."""
        holder = holder or f"{what}-{uuid.uuid4().hex[:12]}"
        self.acquire(run, name, holder, ttl=ttl)
        stop = threading.Event()

        def renew() -> None:
            while not stop.wait(ttl / 3):
                self.acquire(run, name, holder, ttl=ttl)

        t = threading.Thread(target=renew, name="ckptd-lease", daemon=True)
        t.start()
        try:
            yield holder
        finally:
            stop.set()
            t.join(timeout=5)
            self.release(run, name, holder)


_HOLDER = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,127}")  # a reader's lease name, as the lease routes take


class ReadLeases:
    """Leases served checkpoints for a while; at most one storage write per checkpoint per half lease."""

    def __init__(self, storage: Storage, seconds: float) -> None:
        self.leases, self.seconds = Leases(storage), seconds  # CKPTD_READ_LEASE_SECONDS
        self.holder = f"reader-{uuid.uuid4().hex[:12]}"  # this replica
        self._renewed: dict[tuple[str, str], float] = {}
        self._lock = threading.Lock()

    def touch(self, run: str, name: str, holder: str | None = None) -> None:
        """A read of ``run/name``: renew the reader's own lease when the request names one
        (``X-Ckptd-Lease``: released by the reader when it is done, so nothing of its read outlives
        it), else this replica's lease on the checkpoint, which runs a while after the last read."""
        if self.seconds <= 0:
            return
        if holder is not None and not _HOLDER.fullmatch(holder):
            holder = None  # not a name a lease can have: as a read without one
        now = time.monotonic()
        key = (run, name, holder or "")
        with self._lock:
            if now - self._renewed.get(key, -1e18) < self.seconds / 2:
                return
            self._renewed[key] = now
            if len(self._renewed) > 10_000:
                self._renewed = {k: v for k, v in self._renewed.items() if now - v < self.seconds}
        if holder is not None:
            self.hold(run, name, holder)
            return
        # Renewed at most every half lease, so each renewal runs one and a half leases: a read
        # keeps the checkpoint for at least a whole lease after it, whenever the last renewal was.
        self.leases.acquire(run, name, self.holder, ttl=1.5 * self.seconds)

    def hold(self, run: str, name: str, holder: str) -> None:
        """A reader's own lease, for one lease period from now (the reader renews it)."""
        if self.seconds > 0:
            self.leases.acquire(run, name, f"client-{holder}", ttl=self.seconds)

    def release(self, run: str, name: str, holder: str) -> None:
        self.leases.release(run, name, f"client-{holder}")
