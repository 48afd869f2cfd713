"""The independent re-read after a marker, in shares that the workers of every replica on the root take.

A commit that leaves bytes checked on arrival to the re-read stores, before its marker, that it is due
(:func:`mark_due`), under one prefix: a killed service loses none of it, and a replica finds all of it by
listing that prefix, never every run::

    reread/<run>/<name>/<sid>/DUE             the re-read of what session sid commits is due
    reread/<run>/<name>/<sid>/PLAN            the data files in shares of about equal bytes (created once)
    reread/<run>/<name>/<sid>/claim-<i>-<a>   who checks share i until when (attempt a, created once)
    reread/<run>/<name>/<sid>/part-<i>        share i's verification record

No scheduler: each service's :class:`Rereads` takes its own commit's entry at once (:meth:`Rereads.start`)
and every entry on each sweep (:meth:`Rereads.sweep`: at startup, then every ``CKPTD_RECLAIM_INTERVAL``).
The plan is the first taker's (a share per worker process, or per :data:`SHARE_BYTES` where more, at
most one per file). A taker claims shares no one claimed (a sweep also those whose claim expired: their
taker died), as many at once as it has workers, has each checked by the one checker in a worker process
(:func:`.verification.check_share`; share 0 also checks every tensor's tiling, as ``ckptd verify`` does),
stores its record, and renews its claims every ``CKPTD_JOB_HEARTBEAT_SECONDS`` to
``CKPTD_JOB_TAKEOVER_SECONDS`` ahead; a replica that stops deletes the claims it holds on shares not
stored, so the next sweep of another takes them at once. A failed share records the checkpoint known bad
at once; the taker that finds every part stored records the one verification
(:func:`.verification.compose_record`) and deletes the entry, as does any taker of an entry whose
checkpoint is verified, known bad or gone (or never committed, after the takeover time), with the folders
that leaves empty. Hosts' clocks must agree to well within the takeover time (as for jobs).
"""

from __future__ import annotations

import heapq
import json
import logging
import math
import threading
import time
import uuid
from concurrent.futures import FIRST_COMPLETED, Future, wait
from typing import Callable, Iterator

from ckptd_schemas import CheckpointNotFound, CkptdError

from ..storage import Storage
from .paths import Committed, Paths
from .records import PENDING, VerifyRecord, record_of, status_of
from .verification import check_share, compose_record, strays_of
from .visibility import Visibility

__all__ = ["PREFIX", "Rereads", "SHARE_BYTES", "mark_due", "split"]

log = logging.getLogger("ckptd.store")

PREFIX = "reread"
#: A share is at most about this many bytes where the checkpoint has files enough: large checkpoints are
#: spread over every replica's workers, not only the committing one's.
SHARE_BYTES = 1 << 30


def mark_due(storage: Storage, run: str, name: str, sid: str) -> None:
    """Before the marker of a commit that leaves bytes to the re-read: the entry (module docstring)."""
    storage.put(f"{PREFIX}/{run}/{name}/{sid}/DUE", json.dumps({"at": time.time()}).encode())


def split(sizes: dict[str, int], n: int) -> list[list[str]]:
    """The files in ``min(n, len(sizes))`` shares of about equal bytes: largest first, each to the lightest."""
    heap = [(0, i) for i in range(min(n, len(sizes)))]
    shares: list[list[str]] = [[] for _ in heap]
    for f in sorted(sizes, key=lambda f: (-sizes[f], f)):
        load, i = heapq.heappop(heap)
        shares[i].append(f)
        heapq.heappush(heap, (load + sizes[f], i))
    return [sorted(s) for s in shares]


class Rereads:
    """This replica's part in the re-reads due on its root (module docstring). ``submit(fn, *args)``
    runs ``fn`` in a worker process (``workers`` of them); ``on_share`` hears each share's record checked
    here, ``on_done`` the run of each checkpoint whose verification it recorded (retention follows)."""

    def __init__(self, storage: Storage, visibility: Visibility, submit: Callable[..., Future], workers: int, *,
                 renew_every: float, claim_for: float, on_share: Callable[[VerifyRecord], None] = lambda _: None,
                 on_done: Callable[[str], None] = lambda _: None) -> None:
        self.storage, self.vis, self.submit, self.workers = storage, visibility, submit, max(1, workers)
        self.renew_every, self.claim_for, self.on_share, self.on_done = renew_every, claim_for, on_share, on_done
        self.me = uuid.uuid4().hex[:16]
        self._taking: set[str] = set()
        self._lock = threading.Lock()
        self._stopped = threading.Event()
        self._held: set[str] = set()  # claim keys written here whose part is not stored by this replica
        self._holding = threading.Lock()  # a claim written (created, renewed) or released: one at a time

    def start(self, run: str, name: str, sid: str) -> None:
        """Take the entry of this replica's commit of ``run/name`` by session ``sid``, in a thread."""
        self._spawn([f"{PREFIX}/{run}/{name}/{sid}"], takeover=False)

    def sweep(self) -> None:
        """Take every entry under the prefix that this replica does not take already, one after the other
        in a thread, expired claims taken over."""
        self._spawn(sorted({k.rsplit("/", 1)[0] for k, _ in self.storage.walk(PREFIX) if k.count("/") == 4}),
                    takeover=True)

    def stop(self) -> None:
        """At shutdown, before the workers stop: nothing is claimed, renewed or submitted from here on, and
        the claims held on shares whose part is not stored are deleted (best effort: a claim left expires),
        so another replica's next sweep takes them at once. A worker that still stores its part does no
        harm: a share checked twice stores the same verdict."""
        with self._holding:
            self._stopped.set()
            held, self._held = sorted(self._held), set()
        for key in held:
            try:
                self.storage.delete(key)
            except CkptdError as e:
                log.warning("re-read claim %s not released: %s", key, e.message)

    def _spawn(self, entries: list[str], takeover: bool) -> None:
        if self._stopped.is_set():
            return
        with self._lock:
            entries = [e for e in entries if e not in self._taking]
            self._taking.update(entries)
        if entries:
            threading.Thread(target=self._run, args=(entries, takeover), name="ckptd-reread", daemon=True).start()

    def _run(self, entries: list[str], takeover: bool) -> None:
        for entry in entries:
            try:
                self._take(entry, takeover)
            except CkptdError as e:  # the store failed: the claims expire, and a sweep takes the rest
                log.warning("re-read %s stopped: %s", entry, e.message)
            except Exception:  # noqa: BLE001 - one entry must not stop the others
                log.exception("re-read %s failed", entry)
            finally:
                with self._lock:
                    self._taking.discard(entry)
                with self._holding:  # a failed worker's claim expires, and a sweep takes its share over
                    self._held = {k for k in self._held if not k.startswith(f"{entry}/")}

    def _take(self, entry: str, takeover: bool) -> None:
        _, run, name, sid = entry.split("/")
        listed = set(self.storage.list(entry))
        c = self.vis.check(run, name)
        if "DUE" not in listed or c is None or c.session != sid or status_of(self.storage, c)[0] != PENDING:
            due = self.storage.read_json_or_none(f"{entry}/DUE") if "DUE" in listed else None
            if c is not None and c.session == sid or not isinstance(due, dict) or \
                    time.time() - float(due.get("at", 0)) > self.claim_for:  # else: its commit may be under way
                self._drop(entry)
            return
        shares = self._plan(entry, c)
        futures: dict[Future, tuple[int, str]] = {}
        claims = self._claims(entry, len(shares), listed, takeover)
        renew_at, more = time.monotonic() + self.renew_every, True
        while True:
            while more and len(futures) < self.workers and not self._stopped.is_set():
                if (claim := next(claims, None)) is None:
                    more = False
                else:
                    futures[self.submit(check_share, self.storage.url, run, name, shares[claim[0]],
                                        claim[0] == 0)] = claim
            if not futures:
                break
            done, _ = wait(futures, timeout=max(0.0, renew_at - time.monotonic()), return_when=FIRST_COMPLETED)
            if self._stopped.is_set():
                return
            if time.monotonic() >= renew_at:
                for _, key in futures.values():
                    with self._holding:
                        if key in self._held:  # not released since
                            self.storage.put(key, self._claim())
                renew_at = time.monotonic() + self.renew_every
            for fut in done:
                i, key = futures.pop(fut)
                try:
                    part = VerifyRecord.model_validate(fut.result())
                except CheckpointNotFound:
                    part = None
                except Exception as e:  # noqa: BLE001 - a worker that died: its claim expires, a sweep takes it
                    log.warning("re-read share %d of %s/%s not checked: %s", i, run, name, e)
                    continue
                if part is None or part.manifest_xxh3 != c.digest:  # deleted, or another checkpoint now
                    self._drop(entry)
                    return
                self.storage.put(f"{entry}/part-{i}", part.model_dump_json().encode())
                with self._holding:
                    self._held.discard(key)
                self.on_share(part)
                if not part.ok:
                    self._record(c, [part])  # known bad now, whatever the other shares find
        parts = [f"{entry}/part-{i}" for i in range(len(shares))]
        if set(self.storage.list(entry)) >= {p.rsplit("/", 1)[1] for p in parts}:
            self._record(c, [VerifyRecord.model_validate_json(self.storage.read(p)) for p in parts],
                         done=True)
            self._drop(entry.rsplit("/", 1)[0])  # with any entry of a session that lost the name

    def _drop(self, key: str) -> None:
        """Delete ``key`` (an entry, or every entry of a name) and the folders above it that this leaves
        empty (:meth:`~ckptd.storage.Storage.delete_if_empty`: a local root's ``reread/<run>``)."""
        self.storage.delete_tree(key)
        while (key := key.rsplit("/", 1)[0]) != PREFIX:
            self.storage.delete_if_empty(key)

    def _plan(self, entry: str, c: Committed) -> list[list[str]]:
        sizes = {f: e.size for f, e in self.vis.manifest(c).files.items()}
        n = max(self.workers, math.ceil(sum(sizes.values()) / SHARE_BYTES))
        self.storage.create_if_absent(f"{entry}/PLAN", json.dumps(split(sizes, n)).encode())
        return json.loads(self.storage.read(f"{entry}/PLAN"))

    def _claim(self) -> bytes:
        return json.dumps({"by": self.me, "until": time.time() + self.claim_for}).encode()

    def _claims(self, entry: str, n: int, listed: set[str], takeover: bool) -> Iterator[tuple[int, str]]:
        """Each share this replica claims, as asked: one no one claimed, or (``takeover``) one whose last
        claim has expired with its part not stored; (index, claim key)."""
        tries: dict[int, int] = {}
        for e in listed:
            if e.startswith("claim-") and e.count("-") == 2:
                i, a = e.split("-")[1:]
                tries[int(i)] = max(tries.get(int(i), -1), int(a))
        for i in range(n):
            a = tries.get(i)
            if f"part-{i}" in listed or a is not None and not (takeover and self._expired(f"{entry}/claim-{i}-{a}")):
                continue
            key = f"{entry}/claim-{i}-{0 if a is None else a + 1}"
            if not self.storage.exists(f"{entry}/part-{i}") and self._hold(key):
                yield i, key

    def _hold(self, key: str) -> bool:
        """Create the claim ``key`` unless this replica stopped; True when created (held until its part is
        stored here, or released at :meth:`stop`)."""
        with self._holding:
            if self._stopped.is_set() or not self.storage.create_if_absent(key, self._claim()):
                return False
            self._held.add(key)
            return True

    def _expired(self, key: str) -> bool:
        try:
            return float(self.storage.read_json_or_none(key)["until"]) < time.time()
        except (CkptdError, KeyError, TypeError, ValueError):
            return True  # gone, or not a claim this service wrote

    def _record(self, c: Committed, parts: list[VerifyRecord], done: bool = False) -> None:
        """Store the checkpoint's verification from ``parts`` (all of them when ``done``), unless it is
        good and a verification of that manifest is recorded already; none for a checkpoint gone since."""
        rec = compose_record(parts, strays_of(self.storage, c, self.vis.manifest(c)) if done else [])
        if rec.ok and record_of(self.storage, c) is not None:
            return
        key = Paths.verification(c.run, c.name)
        self.storage.put(key, rec.model_dump_json().encode())
        if self.vis.check(c.run, c.name) is None:
            self.storage.delete(key)
            return
        self.on_done(c.run)
        log.info("re-read of %s in %d shares: %s", c.ref, len(parts), "verified" if rec.ok else "known bad")
