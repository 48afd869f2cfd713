"""Leases: a checkpoint being read or converted must not be deleted.

A lease is a small object ``leases/<run>/<name>/<holder>.json`` holding its holder, its owner and
an expiry time; holders renew it while they work and release it when done. Retention (``ckptd
gc``, ``ckptd rm``) skips any checkpoint with an unexpired lease. A crashed holder's lease simply
expires, and a record expired for longer than :data:`EXPIRED_KEPT_SECONDS` is deleted by the next
reader of the leases (gc, ``rm``, the web view), so dead records do not pile up under a checkpoint.

Two kinds of holder:

* the service's own work (reshard jobs, drills, verifications, exports, and this replica's
  lease for reads that name none): :class:`Leases`, owned by :data:`SERVICE`;
* readers over HTTP: :class:`ReadLeases`, named ``client-<holder>``, each owned by the principal
  (the token) that took it. Only that principal renews or releases it; an admin may break it
  (logged); a principal holds at most ``per_principal`` unexpired leases at one replica.

What leases what (the rule the docs state, decided here):

* reading metadata (manifest, load tree, read plans, listings, the web view) takes no lease;
* a load takes its own lease (``PUT .../leases/HOLDER``) once it knows which checkpoint it reads,
  renews it every third of the period, and releases it on every way out (``ckptd_client``);
* a byte read that names no lease its principal holds (``X-Ckptd-Lease``) leases the checkpoint on
  this replica's account until ``seconds`` after the read (to within :data:`REPLICA_RENEW_SECONDS`:
  the lease is rewritten at most that often);
* on a root this process may not write (``StorageReadOnly``), reads go on without leases (logged once).

A lease granted protects, whatever it races with (``rm``, gc, the retention policy): one rule, two
halves, both here. A deleter (:meth:`Leases.delete`) first claims the checkpoint
(``leases/<run>/<name>/deleting``, created only if absent), *then* reads its leases, and deletes
(marker first) only when none is held, within :data:`CLAIM_USE_SECONDS` of its claim; the claim goes
with the leases' directory, after the checkpoint. A new lease (:meth:`Leases.acquire`) is written
*first*, then the claim is read, then the marker: a claim still live after
:data:`CLAIM_WAIT_SECONDS` withdraws it (:class:`~ckptd_schemas.CheckpointBeingDeleted`; a claim
withdrawn meanwhile was a deleter that saw this lease and kept the checkpoint), and so does a marker gone
(:class:`~ckptd_schemas.CheckpointNotFound`: deleted before the lease was written). Each side writes
before it reads what the other writes, so at least one of them sees the other: a lease that stands
was seen by every deleter that went on to delete, and that deleter kept the checkpoint
(:class:`~ckptd_schemas.CheckpointLeased`, naming the holders). A renewal takes the same steps (a
renewal refused keeps its record: a deleter may have read it). A dead deleter's claim stops counting after
:data:`CLAIM_SECONDS` (a deleter that took longer than :data:`CLAIM_USE_SECONDS` to read the leases
gives up instead). The storage must show a write to every read that starts after it (a local or
network filesystem, S3); the hosts' clocks must agree to within ``CLAIM_SECONDS - CLAIM_USE_SECONDS``.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Callable, Iterator

from ckptd_schemas import (
    CheckpointBeingDeleted, CheckpointLeased, CheckpointNotFound, CkptdError, Forbidden, StorageError,
    StorageReadOnly, TooManyRequests,
)

from ..storage import Storage
from .paths import Paths

__all__ = ["CLAIM_SECONDS", "CLAIM_USE_SECONDS", "EXPIRED_KEPT_SECONDS", "LeaseRecord", "Leases", "ReadLeases",
           "REPLICA_RENEW_SECONDS", "SERVICE"]

log = logging.getLogger("ckptd.service")

SERVICE = "ckptd"  # the owner of the service's own leases
EXPIRED_KEPT_SECONDS = 300.0  # a holder renewing late finds its record still there
REPLICA_RENEW_SECONDS = 30.0  # the most a replica's lease for reads may end early after the last read
CLAIM = "deleting"  # a deleter's claim on a checkpoint, beside its leases (no ``.json``: never a lease)
CLAIM_SECONDS = 120.0  # a claim older than this is a dead deleter's: leases and deleters pass over it
CLAIM_USE_SECONDS = 30.0  # a deleter deletes only this soon after its claim, else it gives up
CLAIM_WAIT_SECONDS = 2.0  # a new lease that finds a live claim waits this long for the deleter's decision


@dataclass(frozen=True)
class LeaseRecord:
    holder: str
    owner: str | None  # None: a record without one (written before leases had owners): only an admin breaks it
    expires_at: float


class Leases:
    def __init__(self, storage: Storage) -> None:
        self.storage = storage

    @staticmethod
    def _key(run: str, name: str, holder: str) -> str:
        return f"leases/{run}/{name}/{holder}.json"

    def acquire(self, run: str, name: str, holder: str, *, ttl: float, owner: str = SERVICE) -> bool:
        """Write (or renew) the lease, then make sure it protects (module docstring): it is refused
        while a deletion of ``run/name`` is under way (``CheckpointBeingDeleted``; a new lease is
        withdrawn, a renewal's record stays) or once it is done (``CheckpointNotFound``). False where
        this process may not write the root (a read-only mount: nothing deletes there from here, so the
        read goes on without one; logged once)."""
        key = self._key(run, name, holder)
        before = self._parse(key, holder)
        try:
            self.storage.put(key, json.dumps({"holder": holder, "owner": owner,
                                              "expires_at": time.time() + ttl}).encode())
        except StorageReadOnly as e:
            _unleased(run, name, e)
            return False
        except StorageError:  # the leases' directory deleted under the write: with the checkpoint, marker first
            if not self.storage.exists(Paths.marker(run, name)):
                raise CheckpointNotFound(f"checkpoint {run}/{name} was deleted", ref=f"{run}/{name}") from None
            raise
        renewal = before is not None and before.expires_at > time.time()
        try:
            claim = self._claim(run, name)
            until = time.monotonic() + CLAIM_WAIT_SECONDS
            while claim is not None and time.monotonic() < until:  # a deleter decides in milliseconds
                time.sleep(0.005)
                claim = self._claim(run, name)
            if claim is not None:
                raise CheckpointBeingDeleted(f"checkpoint {run}/{name} is being deleted ({claim}): no lease is "
                                             f"granted on it", ref=f"{run}/{name}", holder=holder)
            if not self.storage.exists(Paths.marker(run, name)):
                raise CheckpointNotFound(f"checkpoint {run}/{name} was deleted", ref=f"{run}/{name}")
        except (CheckpointBeingDeleted, CheckpointNotFound) as e:
            if not (renewal and isinstance(e, CheckpointBeingDeleted)):  # a renewal's record stays (a deleter
                with contextlib.suppress(CkptdError, OSError):  # that read it keeps the checkpoint); a new one goes
                    self.storage.delete(key)
            raise
        return True

    def _claim(self, run: str, name: str) -> str | None:
        """Who claims ``run/name`` for deletion and since when, while that claim counts; else None."""
        raw = self.storage.read_or_none(f"leases/{run}/{name}/{CLAIM}")
        if raw is None:
            return None
        try:
            data = json.loads(raw)
            at, by = float(data["at"]), str(data["by"])
        except (ValueError, TypeError, KeyError, OverflowError):
            return "by a deleter whose claim does not parse"  # counts: only a deleter's own writes go there
        if at < time.time() - CLAIM_SECONDS:
            return None
        return f"by {by} since {time.strftime('%H:%M:%S', time.gmtime(at))} UTC"

    def delete(self, run: str, name: str, remove: Callable[[], None]) -> None:
        """Delete ``run/name`` (``remove``: its marker first, then its files) unless a lease holds it,
        the one way retention deletes (module docstring). Raises ``CheckpointLeased`` (naming the
        holders), ``CheckpointBeingDeleted`` (another deleter's claim is live, or this one's read took
        too long) or ``CheckpointNotFound`` (gone already), deleting nothing; returns once deleted."""
        key, me = f"leases/{run}/{name}/{CLAIM}", f"{os.getpid()}-{uuid.uuid4().hex[:12]}"
        mine = json.dumps({"by": me, "at": time.time()}).encode()
        if not self.storage.create_if_absent(key, mine):
            held = self._claim(run, name)
            if held is not None:
                raise CheckpointBeingDeleted(f"checkpoint {run}/{name} is being deleted {held}", ref=f"{run}/{name}")
            self.storage.put(key, mine)  # a dead deleter's claim, overwritten: the key is never absent
        started = time.monotonic()
        try:
            if self.storage.read_or_none(key) != mine:
                raise CheckpointBeingDeleted(f"checkpoint {run}/{name} is being deleted by another request",
                                             ref=f"{run}/{name}")
            held_by = self.holding(run, name)
            if held_by:
                raise CheckpointLeased(f"{self.describe(run, name, held_by)} (checkpoint {run}/{name} stays)",
                                       ref=f"{run}/{name}", holders=[h for h, _ in held_by])
            if not self.storage.exists(Paths.marker(run, name)):
                raise CheckpointNotFound(f"checkpoint {run}/{name} is gone already", ref=f"{run}/{name}")
            if time.monotonic() - started > CLAIM_USE_SECONDS:
                raise CheckpointBeingDeleted(f"checkpoint {run}/{name}: reading its leases took longer than "
                                             f"{CLAIM_USE_SECONDS:g} s; nothing deleted (try again)",
                                             ref=f"{run}/{name}")
        except CkptdError:
            if self.storage.read_or_none(key) == mine:
                with contextlib.suppress(CkptdError, OSError):
                    self.storage.delete(key)
            raise
        remove()
        self.storage.delete_tree(f"leases/{run}/{name}")  # the claim and expired records: after the checkpoint

    def release(self, run: str, name: str, holder: str) -> None:
        self.storage.delete(self._key(run, name, holder))

    def record(self, run: str, name: str, holder: str) -> LeaseRecord | None:
        """Lease ``holder``'s record, expired or not; None when there is none (or it is not a lease)."""
        return self._parse(self._key(run, name, holder), holder)

    def _parse(self, key: str, entry: str) -> LeaseRecord | None:
        path = self.storage.local_path(key)
        if path is not None and not os.path.isfile(path):
            return None  # never opened: a FIFO there would block gc
        raw = self.storage.read_or_none(key)
        try:
            data = json.loads(raw) if raw is not None else None
            if not isinstance(data, dict):
                return None
            owner = data.get("owner")
            return LeaseRecord(str(data.get("holder", entry)), owner if isinstance(owner, str) else None,
                               float(data.get("expires_at", 0)))
        except (ValueError, TypeError, OverflowError):
            return None

    def active(self, run: str, name: str, *, now: float | None = None) -> list[str]:
        """The holders of the unexpired leases on ``run/name``."""
        return [holder for holder, _ in self.holding(run, name, now=now)]

    def describe(self, run: str, name: str, held: list[tuple[str, float]]) -> str:
        """Why retention keeps a leased checkpoint: each holder and when its lease ends (``leased`` when
        they are gone by now); ``held``: :meth:`holding`'s answer."""
        if not held:
            return "leased"
        return "leased by " + ", ".join(
            f"{h} until {time.strftime('%Y-%m-%d %H:%M:%S', time.gmtime(t))} UTC" for h, t in held[:4]) + (
            f" and {len(held) - 4} more" if len(held) > 4 else "")

    def holding(self, run: str, name: str, *, now: float | None = None) -> list[tuple[str, float]]:
        """(holder, expiry as a Unix time) of each unexpired lease on ``run/name``. A record expired
        for longer than :data:`EXPIRED_KEPT_SECONDS` is deleted on the way (best effort)."""
        now = time.time() if now is None else now
        out = []
        for entry in self.storage.list(f"leases/{run}/{name}"):
            # A read that fails raises (gc then deletes nothing); an entry that is not a lease this
            # store wrote (a directory, not JSON, no expiry) holds nothing.
            key = f"leases/{run}/{name}/{entry}"
            if entry == CLAIM:
                continue
            rec = self._parse(key, entry)
            if rec is None:
                continue
            if rec.expires_at > now:
                out.append((rec.holder, rec.expires_at))
            elif rec.expires_at < now - EXPIRED_KEPT_SECONDS and entry.endswith(".json"):
                with contextlib.suppress(CkptdError, OSError):  # a read-only root keeps it: harmless
                    self.storage.delete(key)
        return out

    @contextlib.contextmanager
    def hold(self, run: str, name: str, what: str, *, ttl: float = 300.0,
             holder: str | None = None) -> Iterator[str]:
        """Lease ``run/name`` for the duration of the block (``what``: reshard, export...), renewed every
        ``ttl / 3`` seconds by a thread, released at the end; a crashed holder's lease expires.
        ``holder`` names the lease (a reshard job takes over the one its submission took)."""
        holder = holder or f"{what}-{uuid.uuid4().hex[:12]}"
        if not self.acquire(run, name, holder, ttl=ttl):
            yield holder  # a read-only root: no renewals, nothing to release
            return
        stop = threading.Event()

        def renew() -> None:
            while not stop.wait(ttl / 3):
                try:
                    self.acquire(run, name, holder, ttl=ttl)
                except CkptdError as e:  # renewed too late, and the checkpoint is going: the work finds out
                    log.warning("lease %s on %s/%s not renewed: %s", holder, run, name, e.message)

        t = threading.Thread(target=renew, name="ckptd-lease", daemon=True)
        t.start()
        try:
            yield holder
        finally:
            stop.set()
            t.join(timeout=5)
            self.release(run, name, holder)


_warned_read_only = False


def _unleased(run: str, name: str, e: StorageReadOnly) -> None:
    """A lease that could not be written because this process may not write the root (a read-only
    mount): the read goes on without it (logged once per process: where another host can write the
    root and run gc, a reader here is not protected)."""
    global _warned_read_only
    if not _warned_read_only:
        _warned_read_only = True
        log.warning("reads of %s/%s (and any after) hold no lease: %s", run, name, e.message)


_HOLDER = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]{0,63}")  # a reader's lease name, as the lease routes take


class ReadLeases:
    """Readers' leases over HTTP, each owned by the principal that took it, and this replica's lease
    for byte reads that name none (module docstring).

    Call order (the read routes): :meth:`hold` for ``PUT .../leases/HOLDER`` (take or renew),
    :meth:`release` for its ``DELETE``, :meth:`touch` before serving file bytes."""

    def __init__(self, storage: Storage, seconds: float, per_principal: int = 100_000) -> None:
        self.leases, self.seconds = Leases(storage), seconds  # CKPTD_READ_LEASE_SECONDS
        self.per_principal = per_principal  # CKPTD_READ_LEASES_PER_TOKEN
        self.holder = f"reader-{uuid.uuid4().hex[:12]}"  # this replica
        self._renew_every = min(REPLICA_RENEW_SECONDS, seconds / 10)
        self._written: dict[tuple[str, str], float] = {}  # (run, name) -> when this replica's lease was written
        self._own: dict[tuple[str, str, str, str], float] = {}  # a named lease found owned: until when trusted
        self._taken: dict[str, dict[tuple[str, str, str], float]] = {}  # principal -> lease -> expiry
        self._lock = threading.Lock()

    # -- a reader's own lease --------------------------------------------------------------------
    def hold(self, run: str, name: str, holder: str, principal: str, *, admin: bool = False) -> None:
        """Take or renew lease ``holder`` on ``run/name`` for ``principal``, for one period from now.
        Forbidden when another principal holds it unexpired (an admin takes it over: logged);
        TooManyRequests past ``per_principal`` unexpired leases of this principal taken here;
        CheckpointBeingDeleted or CheckpointNotFound as :meth:`Leases.acquire` (no lease then)."""
        if self.seconds <= 0:
            return
        rec = self.leases.record(run, name, f"client-{holder}")
        now = time.time()
        if rec is not None and rec.expires_at > now and rec.owner != principal:
            if not admin:
                raise Forbidden(f"read lease {holder!r} on {run}/{name} belongs to another token; take a lease of "
                                f"your own name", ref=f"{run}/{name}", holder=holder)
            log.warning("read lease %s on %s/%s of token %s taken over by admin %s", holder, run, name,
                        rec.owner or "(unknown)", principal)
        with self._lock:
            mine = self._taken.setdefault(principal, {})
            if (run, name, holder) not in mine and len(mine) >= self.per_principal:
                for k in [k for k, t in mine.items() if t <= now]:
                    del mine[k]
                if len(mine) >= self.per_principal:
                    raise TooManyRequests(
                        f"token {principal!r} holds {len(mine)} read leases at this replica, the most one token may "
                        f"hold (CKPTD_READ_LEASES_PER_TOKEN); release finished ones", ref=f"{run}/{name}",
                        holder=holder, limit_name="read_leases")
            mine[(run, name, holder)] = now + self.seconds
        written = False
        try:  # refused while the checkpoint is being deleted, or once it is gone: no lease
            written = self.leases.acquire(run, name, f"client-{holder}", ttl=self.seconds, owner=principal)
        finally:
            if not written:
                with self._lock:
                    mine.pop((run, name, holder), None)

    def release(self, run: str, name: str, holder: str, principal: str, *, admin: bool = False) -> None:
        """Release lease ``holder``: only its owner may (Forbidden otherwise), or an admin, who breaks
        it (logged). Releasing a lease that is not there is done already."""
        rec = self.leases.record(run, name, f"client-{holder}")
        if rec is None:
            return
        if rec.owner != principal:
            if not admin:
                raise Forbidden(f"read lease {holder!r} on {run}/{name} belongs to another token; only it or an "
                                f"admin may release it", ref=f"{run}/{name}", holder=holder)
            log.warning("read lease %s on %s/%s of token %s broken by admin %s (it ended at %s)", holder, run, name,
                        rec.owner or "(unknown)", principal,
                        time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(rec.expires_at)))
        self.leases.release(run, name, f"client-{holder}")
        with self._lock:
            self._taken.get(rec.owner or "", {}).pop((run, name, holder), None)
            for k in [k for k in self._own if k[:3] == (run, name, holder)]:
                del self._own[k]

    # -- byte reads ----------------------------------------------------------------------------
    def touch(self, run: str, name: str, holder: str | None, principal: str) -> None:
        """A byte read of ``run/name``: nothing more when it names a lease ``principal`` holds (its
        holder renews it), else this replica's lease, rewritten at most every ``_renew_every`` s so that
        it ends ``seconds`` after the last read, to within that."""
        if self.seconds <= 0:
            return
        if holder is not None and _HOLDER.fullmatch(holder) and self._holds(run, name, holder, principal):
            return
        now = time.monotonic()
        with self._lock:
            if now - self._written.get((run, name), -1e18) < self._renew_every:
                return
            self._written[(run, name)] = now
            if len(self._written) > 10_000:
                self._written = {k: v for k, v in self._written.items() if now - v < self._renew_every}
        try:
            self.leases.acquire(run, name, self.holder, ttl=self.seconds)
        except CkptdError:  # being deleted, or gone: this read is refused, and the next one asks again
            with self._lock:
                self._written.pop((run, name), None)
            raise

    def _holds(self, run: str, name: str, holder: str, principal: str) -> bool:
        """Whether ``principal`` holds lease ``holder`` unexpired (read once per ``_renew_every`` s)."""
        key, now = (run, name, holder, principal), time.monotonic()
        with self._lock:
            if self._own.get(key, -1.0) > now:
                return True
        rec = self.leases.record(run, name, f"client-{holder}")
        if rec is None or rec.owner != principal or rec.expires_at <= time.time():
            return False
        with self._lock:
            self._own[key] = now + self._renew_every
            if len(self._own) > 10_000:
                self._own = {k: t for k, t in self._own.items() if t > now}
        return True
