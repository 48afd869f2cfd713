"""What a root may still take: each writer's quota, and the reserve that keeps commits possible.

Asked at the one ingest seam (:mod:`.intake`) before a data file's bytes are stored, whichever way
they come in: received bytes batch by batch as they arrive, a presigned file's declared size at its
presign (before the client PUTs it), a linked file's size at its link; and by the session store before
a new session is made (:data:`OPEN_BYTES`, quota and reserve; a rank joining it asks nothing) and for a
rank index's blocks (its quota only).

**Quotas.** A writer (the token a request acts as: :class:`Holder`) may carry a quota, the bytes it
may hold. It holds every byte of the sessions of the runs its write scopes match, staged and
committed: data files, indexes, manifests and records, each at its blocks (:func:`on_disk`: a
200-byte record takes a 4 KiB block), each session's directories, a linked file counted in every
checkpoint that holds it (on an object store a link is a copy; on a local disk the name keeps the
bytes for as long as any checkpoint holds it), and a file presigned and not yet stored at its declared size (its parts, PUT
straight into the object store, are no object until its confirm). The rule is cheap and survives
restarts because the root is the truth: what a writer holds is measured there
(:meth:`~ckptd.storage.Storage.walk` of each session of its runs; a committed session, whose bytes
never grow, once per process) the first time it writes, again once
that measure is :data:`REMEASURE_SECONDS` old, and again (unless :data:`RECHECK_SECONDS` young)
before anything is refused, so bytes deleted since (gc, an abort, the sweep) never refuse a write,
and another replica's writes are seen within a minute. Between measures the bytes a writer brings
here are added as they come: one lock and one addition per batch, whatever the world size (bytes
still in a write window when measured, up to 12 MiB per upload in progress, are missed until the next
measure). One thread at a time measures a writer, outside its lock: the writer's other writes meanwhile
are answered at once from the last measure plus what was counted since (and added to the new measure's
total), so a slow root (20,000 sessions walk in seconds) holds one request thread, never the pool, and
never delays another token. A write that would take the writer past its quota is refused with
:class:`~ckptd_schemas.QuotaExceeded` naming the token, its quota and what it holds; the writer's
other uploads and every other token's go on. A writer without a quota is never measured.

**The reserve.** A local root keeps ``reserve`` bytes free (a size, or a percentage of its
filesystem): received bytes, and a new session, that would take the free space below it are refused
with :class:`~ckptd_schemas.ReserveReached`. Nothing else a save writes asks (a rank joining a session,
rank indexes, the manifest, the marker, verification records), so a save already open whose data files
have arrived still commits, into the reserve: at most one index per rank of its declared world size
(a rank past it is refused), each at most the service's index limit. Object stores have no disk to
fill, and no reserve.

Call order: the service builds one :class:`Space` (``CKPTD_ROOT_RESERVE``) and gives it to the
session store; the intake, ``SessionStore.open`` (:data:`OPEN_BYTES`, on the root) and
``SessionStore.put_index`` (the index's blocks, :func:`on_disk`, not on the root) call
:meth:`Space.charge` with the request's holder before they store.
"""

from __future__ import annotations

import math
import re
import threading
import time
from dataclasses import dataclass, field
from typing import Protocol

from ckptd_schemas import QuotaExceeded, ReserveReached, StorageError

from ..storage import Storage
from .paths import Marker, Paths
from .visibility import Visibility

__all__ = ["BLOCK", "OPEN_BYTES", "RECHECK_SECONDS", "REMEASURE_SECONDS", "SESSION_DIRS_BYTES", "Holder", "Space",
           "on_disk", "parse_reserve", "parse_size"]

REMEASURE_SECONDS = 60.0  # a writer's holding is measured again at its first write this long after the last measure
RECHECK_SECONDS = 2.0  # ... and before a refusal, unless measured this recently
BLOCK = 4096  # what a file or directory takes of a disk at least (a local filesystem's block; an object's floor)
SESSION_DIRS_BYTES = 3 * BLOCK  # a session's directories: its checkpoint's, the checkpoint's sessions', its own
OPEN_BYTES = SESSION_DIRS_BYTES + BLOCK  # what opening a session takes: its directories and its record

_SIZE = re.compile(r"(\d+(?:\.\d+)?)\s*(|b|[kmgtp]i?b?)", re.IGNORECASE)
_POWERS = "kmgtp"
SIZE_GRAMMAR = "a number of bytes with an optional unit (B, KiB, MiB, GiB, TiB, PiB, or kB, MB, GB, TB, PB)"


def on_disk(size: int) -> int:
    """The bytes a stored file of ``size`` bytes is counted at: whole blocks, one at least (an empty file's
    inode and directory entry, a 200-byte record's block)."""
    return max(1, -(-size // BLOCK)) * BLOCK


def parse_size(text: str) -> int:
    """``500GiB``, ``1.5TB``, ``4096`` -> bytes (``K``, ``Ki``, ``KB`` and ``KiB`` alike: ``i`` binary,
    none decimal). ``ValueError`` naming the grammar."""
    m = _SIZE.fullmatch(text.strip())
    if not m:
        raise ValueError(f"{text[:40]!r} is not a size: {SIZE_GRAMMAR}")
    unit = m[2].lower()
    scale = 1 if unit in ("", "b") else (1024 if "i" in unit else 1000) ** (_POWERS.index(unit[0]) + 1)
    return int(float(m[1]) * scale)


def parse_reserve(text: str) -> tuple[int, float]:
    """``"5%"`` -> (0, 0.05); ``"2GiB"`` -> (2 GiB, 0.0); ``"0"``: no reserve. ``ValueError``."""
    t = text.strip()
    if t.endswith("%"):
        pct = float(t[:-1]) if re.fullmatch(r"\d+(\.\d+)?", t[:-1].strip()) else math.nan
        if not 0 <= pct < 100:
            raise ValueError(f"{text[:40]!r}: a percentage of the root's filesystem from 0 to under 100, or {SIZE_GRAMMAR}")
        return 0, pct / 100
    return parse_size(t), 0.0


class Holder(Protocol):
    """Who writes (the service's ``auth.Principal``): its name, its quota in bytes (None: none) and
    the runs it may write."""

    @property
    def name(self) -> str: ...

    @property
    def quota(self) -> int | None: ...

    def can_write(self, run: str) -> bool: ...


@dataclass
class _Holding:
    held: int = 0
    measured_at: float = -math.inf
    measuring: bool = False  # one thread walks the root for this holder; the others answer from ``held``
    since: int = 0  # bytes counted while that walk runs, added to its total
    lock: threading.Lock = field(default_factory=threading.Lock)  # held for an addition, never for a walk


class Space:
    """Quotas and the reserve of one root (module docstring)."""

    def __init__(self, storage: Storage, reserve: str = "0") -> None:
        self.storage, self._markers = storage, Visibility(storage)  # the one reader of markers
        self.reserve_bytes, self.reserve_fraction = parse_reserve(reserve)
        self._holdings: dict[Holder, _Holding] = {}
        # (run, name) -> its marker's (session, manifest digest) and that session's bytes
        self._committed: dict[tuple[str, str], tuple[tuple[str, str], int]] = {}
        self._lock = threading.Lock()

    def charge(self, holder: Holder | None, run: str, file: str, nbytes: int, *, on_root: bool) -> None:
        """Before ``nbytes`` of ``file`` of ``run`` are stored for ``holder``: refused with
        :class:`ReserveReached` (``on_root``: they land on the root's disk) or :class:`QuotaExceeded`,
        else counted as the holder's."""
        if on_root:
            self._check_reserve(file, nbytes)
        if holder is not None and holder.quota is not None:
            self._charge_quota(holder, holder.quota, run, file, nbytes)

    def _check_reserve(self, file: str, nbytes: int) -> None:
        if not (self.reserve_bytes or self.reserve_fraction):
            return
        fs = self.storage.free_space()
        if fs is None:
            return
        free, total = fs
        keep = max(self.reserve_bytes, int(total * self.reserve_fraction))
        if free - nbytes < keep:
            raise ReserveReached(
                f"file {file!r}: the storage root {self.storage.url} has {free} bytes free and keeps {keep} in reserve "
                f"(CKPTD_ROOT_RESERVE) for the commits of saves in progress: no new data is taken until space is "
                f"freed (ckptd gc, rm)", root=self.storage.url, free=free, reserve=keep, file=file)

    def _holding(self, holder: Holder) -> _Holding:
        with self._lock:
            return self._holdings.setdefault(holder, _Holding())

    def _charge_quota(self, holder: Holder, quota: int, run: str, file: str, nbytes: int) -> None:
        """Count ``nbytes`` for ``holder``, measuring first when its measure is stale, and again before a
        refusal: by this thread alone, outside the holding's lock. While another thread measures, the
        answer is the last measure's plus what was counted since, at once."""
        h = self._holding(holder)
        if self._claim_measure(h, REMEASURE_SECONDS):
            self._measure(holder, h)
        for last_try in (False, True):
            with h.lock:
                if h.held + nbytes <= quota:
                    h.held += nbytes
                    h.since += nbytes if h.measuring else 0
                    return
                if last_try or not self._claim_measure(h, RECHECK_SECONDS, locked=True):
                    raise QuotaExceeded(
                        f"token {holder.name!r} holds {h.held} bytes of its quota of {quota} (the runs its write "
                        f"scopes match, staged and committed): {nbytes} more bytes of {file!r} of run {run!r} "
                        f"were refused; delete checkpoints (ckptd gc, rm) or raise the token's quota",
                        token=holder.name, quota=quota, held=h.held, run=run, file=file)
            self._measure(holder, h)  # deleted since the last measure: not counted against the writer

    @staticmethod
    def _claim_measure(h: _Holding, older_than: float, *, locked: bool = False) -> bool:
        """Whether this thread is the one to measure ``h`` now: its measure is over ``older_than`` seconds
        old and no other thread is measuring it (``locked``: the caller holds ``h.lock``)."""
        if not locked:
            with h.lock:
                return Space._claim_measure(h, older_than, locked=True)
        if h.measuring or time.monotonic() - h.measured_at <= older_than:
            return False
        h.measuring, h.since = True, 0
        return True

    def _measure(self, holder: Holder, h: _Holding) -> None:
        """``h.held`` := the bytes stored under the runs ``holder`` may write, plus what was counted while
        they were walked (the caller claimed the measure: :meth:`_claim_measure`)."""
        try:
            total = sum(self._run_usage(run) for run in self.storage.list(Paths.runs()) if holder.can_write(run))
        except BaseException:
            with h.lock:
                h.measuring = False
            raise
        with h.lock:
            h.held, h.measured_at, h.measuring = total + h.since, time.monotonic(), False

    def _run_usage(self, run: str) -> int:
        """The bytes of every session of ``run``'s checkpoints. A committed session's bytes never grow once
        its marker exists, so they are walked once per process and then taken from :attr:`_committed`
        while the marker names the same session and manifest (a checkpoint removed and saved again under
        its name and session id is walked again);
        the others (staging) are walked each time. The checkpoints' own small records are not counted."""
        total = 0
        seen: dict[tuple[str, str], tuple[tuple[str, str], int]] = {}
        for name in self.storage.list(Paths.run(run)):
            mark = _marker_session(self._markers, run, name)
            committed = mark[0] if mark is not None else None
            for sid in self.storage.list(Paths.sessions(run, name)):
                with self._lock:
                    known = self._committed.get((run, name))
                if sid == committed and known is not None and known[0] == mark:
                    used = known[1]
                else:
                    walked = self.storage.walk(Paths.session(run, name, sid))
                    used = SESSION_DIRS_BYTES + sum(on_disk(size) for _, size in walked)
                    if sid != committed:
                        used += self._presigned(run, name, sid, walked)
                if mark is not None and sid == committed:
                    seen[(run, name)] = (mark, used)
                total += used
        with self._lock:  # checkpoints gone since are forgotten
            for key in [k for k in self._committed if k[0] == run and k not in seen]:
                del self._committed[key]
            self._committed.update(seen)
        return total

    def _presigned(self, run: str, name: str, sid: str, walked: list[tuple[str, int]]) -> int:
        """The declared sizes of the files of staging session ``sid`` presigned and not stored yet: their
        parts are kept by the store as they are PUT (a multipart upload, not walked) until the confirm
        or the sweep, so the claim (:meth:`Paths.presign_claim`) stands for them."""
        keys = {k for k, _ in walked}
        claims = Paths.presign_claim(run, name, sid, "")
        total = 0
        for key in keys:
            if key.startswith(claims) and Paths.file(run, name, sid, key[len(claims):]) not in keys:
                try:
                    claim = self.storage.read_json_or_none(key)
                except StorageError:
                    continue
                size = claim.get("size") if isinstance(claim, dict) else None
                total += size if type(size) is int and size > 0 else 0
        return total


def _marker_session(vis: Visibility, run: str, name: str) -> tuple[str, str] | None:
    """The session and manifest digest ``run/name``'s marker names, or None (no marker, one that does
    not parse, or none that can be read now: walked as staging)."""
    try:
        m = vis.marker(run, name)
    except StorageError:
        return None
    return (m.session, m.manifest_xxh3) if isinstance(m, Marker) else None
