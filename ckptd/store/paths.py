"""Where things live under the storage root, and the small records there (marker, session).

::

    runs/<run>/<name>/COMMITTED                         marker: names session + manifest digest
    runs/<run>/<name>/VERIFIED.json                     the last verification of it (store.records)
    runs/<run>/<name>/DRILL.json                        the last conversion drill (reshard.drill)
    runs/<run>/<name>/NOT_DURABLE.json                  a durable copy that failed (store.durable)
    runs/<run>/<name>/sessions/<sid>/SESSION.json       upload session (open-or-join, create-if-absent)
    runs/<run>/<name>/sessions/<sid>/ACTIVE.json        when a writer was last heard from (store.activity)
    runs/<run>/<name>/sessions/<sid>/files/<file>       data streamed by ranks (staging)
    runs/<run>/<name>/sessions/<sid>/digests/<file>     size, XXH3 and block digests of a file (created once)
    runs/<run>/<name>/sessions/<sid>/arrived/<file>     the rows checked as the file arrived, its stored identity
    runs/<run>/<name>/sessions/<sid>/presigned/<file>   the presign of a file uploaded by URL (created once)
    runs/<run>/<name>/sessions/<sid>/ranks/<w>/<...>.json  rank indexes written together (store.rank_indexes)
    runs/<run>/<name>/sessions/<sid>/manifest-<xxh3>.json
    runs/<run>/<name>/sessions/<sid>/FAILED.json        why the commit was refused
    reread/<run>/<name>/<sid>/...                       a re-read due after a marker, its shares (store.rereads)

A session directory is the staging area of one save attempt: nothing outside
it changes until the marker is created. The marker is created exactly once
(first writer wins) and names the manifest by digest, so a checkpoint is
visible iff its marker parses and names the digest of a manifest that parses
and agrees with it (``visibility``, docs/design.md §2); the same rule holds on local
disks and on object stores, with no rename. Session
directories that no marker names are reclaimed once no writer is heard from, or after a TTL.
Anything else under a committed checkpoint's directory is no part of it (:func:`strays`).
"""

from __future__ import annotations

import errno
import os
import re
import stat as statmod
from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING, ClassVar, Collection, Iterable

from pydantic import BaseModel, ConfigDict

from ckptd_schemas import CheckpointSummary, CkptdError, check_session

from ..storage import open_regular

if TYPE_CHECKING:
    from ..storage import Storage

__all__ = ["Committed", "Marker", "SessionMeta", "Paths", "RankBatch", "rank_batch", "read_small", "regular_file", "strays"]

RUNS = "runs"
#: What a checkpoint's directory holds beside its sessions: the marker and the records about it.
CHECKPOINT_RECORDS = ("COMMITTED", "VERIFIED.json", "DRILL.json", "NOT_DURABLE.json")


class Marker(BaseModel):
    """``COMMITTED``: binds the ref, the session, the manifest's digest and the step; what makes a
    checkpoint visible is decided by :mod:`.visibility`."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    ref: str
    session: str
    manifest: str
    manifest_xxh3: str
    step: int | None
    derived_from: str | None
    committed_at: datetime
    parent: str | None = None  # lineage across runs (OpenSession.parent); absent in markers written before it
    #: the root of the manifest's load tree (``ckptd_schemas.loadtree``): what a loading rank checks each
    #: piece of its metadata against; absent in markers written before it (those loads read the manifest)
    load_tree: str | None = None


class SessionMeta(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    session: str
    world_size: int
    step: int | None
    created_at: datetime
    derived_from: str | None = None
    parent: str | None = None


class Paths:
    """Key builders; arguments must already be validated names. :meth:`parse` reads a key back."""

    @staticmethod
    def parse(key: str) -> tuple[str | None, str | None, str | None]:
        """(run, checkpoint name, the rest) of a key under ``runs/`` (None where the key stops short);
        (None, None, None) for a key outside ``runs/``."""
        parts = key.split("/", 3)
        if parts[0] != RUNS:
            return None, None, None
        parts += [None] * (4 - len(parts))  # type: ignore[list-item]
        return parts[1], parts[2], parts[3]

    @classmethod
    def is_marker(cls, key: str) -> bool:
        run, name, rest = cls.parse(key)
        return run is not None and name is not None and rest == "COMMITTED"

    @staticmethod
    def runs() -> str:
        return RUNS

    @staticmethod
    def run(run: str) -> str:
        return f"{RUNS}/{run}"

    @staticmethod
    def ckpt(run: str, name: str) -> str:
        return f"{RUNS}/{run}/{name}"

    @staticmethod
    def marker(run: str, name: str) -> str:
        return f"{RUNS}/{run}/{name}/COMMITTED"

    @staticmethod
    def verification(run: str, name: str) -> str:
        return f"{RUNS}/{run}/{name}/VERIFIED.json"

    @staticmethod
    def drill(run: str, name: str) -> str:
        return f"{RUNS}/{run}/{name}/DRILL.json"

    @staticmethod
    def sessions(run: str, name: str) -> str:
        return f"{RUNS}/{run}/{name}/sessions"

    @staticmethod
    def session(run: str, name: str, sid: str) -> str:
        return f"{RUNS}/{run}/{name}/sessions/{sid}"

    @classmethod
    def session_meta(cls, run: str, name: str, sid: str) -> str:
        return f"{cls.session(run, name, sid)}/SESSION.json"

    @classmethod
    def file(cls, run: str, name: str, sid: str, file: str) -> str:
        return f"{cls.session(run, name, sid)}/files/{file}"

    @classmethod
    def digest(cls, run: str, name: str, sid: str, file: str) -> str:
        return f"{cls.session(run, name, sid)}/digests/{file}"

    @classmethod
    def arrival(cls, run: str, name: str, sid: str, file: str) -> str:
        return f"{cls.session(run, name, sid)}/arrived/{file}"

    @classmethod
    def presign_claim(cls, run: str, name: str, sid: str, file: str) -> str:
        return f"{cls.session(run, name, sid)}/presigned/{file}"

    @classmethod
    def activity(cls, run: str, name: str, sid: str) -> str:
        return f"{cls.session(run, name, sid)}/ACTIVE.json"

    @classmethod
    def ranks(cls, run: str, name: str, sid: str) -> str:
        return f"{cls.session(run, name, sid)}/ranks"

    @classmethod
    def rank_window(cls, run: str, name: str, sid: str, window: int) -> str:
        """The folder of the rank-index objects of ranks ``[window * WINDOW, (window + 1) * WINDOW)``."""
        return f"{cls.ranks(run, name, sid)}/{window:05d}"

    @classmethod
    def rank_batch(cls, run: str, name: str, sid: str, b: "RankBatch") -> str:
        """An object holding the indexes of ranks ``b.ranks`` (:mod:`.rank_indexes`), named for what it holds."""
        mask = sum(1 << (r - b.window * RankBatch.WINDOW) for r in b.ranks)
        return f"{cls.rank_window(run, name, sid, b.window)}/{b.stamp:013d}-{b.nonce}-{b.tag}-{mask:x}.json"

    @classmethod
    def manifest(cls, run: str, name: str, sid: str, digest: str) -> str:
        return f"{cls.session(run, name, sid)}/manifest-{digest}.json"

    @classmethod
    def failed(cls, run: str, name: str, sid: str) -> str:
        return f"{cls.session(run, name, sid)}/FAILED.json"

    @classmethod
    def not_durable(cls, run: str, name: str) -> str:
        return f"{cls.ckpt(run, name)}/NOT_DURABLE.json"


@dataclass(frozen=True)
class Committed:
    """A visible checkpoint: its marker, and where its (checked) manifest lives."""

    run: str
    name: str
    marker: Marker
    manifest_key: str
    #: the manifest's ``created_at`` (bound by its digest): orders checkpoints of one step
    created_at: datetime | None = None

    @property
    def ref(self) -> str:
        return f"{self.run}/{self.name}"

    @property
    def session(self) -> str:
        return self.marker.session

    @property
    def step(self) -> int | None:
        return self.marker.step

    @property
    def digest(self) -> str:
        return self.marker.manifest_xxh3

    @property
    def derived_from(self) -> str | None:
        return self.marker.derived_from

    @property
    def parent(self) -> str | None:
        return self.marker.parent

    @property
    def committed_at(self) -> datetime:
        return self.marker.committed_at

    def summary(self, status: tuple[str | None, str | None] = (None, None)) -> CheckpointSummary:
        """The listing's row; ``status``: ``records.status_of`` of this checkpoint, when the caller read it."""
        m = self.marker
        return CheckpointSummary(run=self.run, name=self.name, step=m.step, derived_from=m.derived_from, parent=m.parent,
                                 session=m.session, committed_at=m.committed_at, manifest_xxh3=m.manifest_xxh3,
                                 status=status[0], status_reason=status[1])


@dataclass(frozen=True)
class RankBatch:
    """What a rank-index object's name says (:meth:`Paths.rank_batch`): its window, when and by whom it was
    written (``stamp``: the writer's clock in ms; ``nonce``: 8 hex digits), the incarnation ``tag`` of its
    session (8 hex digits) and the ranks it holds, all in the window."""

    WINDOW: ClassVar[int] = 512  # ranks per window: a listing of one window answers for them all
    window: int
    stamp: int
    nonce: str
    tag: str
    ranks: tuple[int, ...]


_BATCH = re.compile(r"(\d{5})/(\d{13})-([0-9a-f]{8})-([0-9a-f]{8})-([1-9a-f][0-9a-f]{0,127})\.json")


def rank_batch(rel: str) -> RankBatch | None:
    """What the name of a rank-index object says, from its key below ``ranks/`` (``<window>/<name>``); None
    where it is no such name."""
    m = _BATCH.fullmatch(rel)
    if m is None:
        return None
    window, mask = int(m[1]), int(m[5], 16)  # 128 hex digits: WINDOW bits at most
    base = window * RankBatch.WINDOW
    return RankBatch(window, int(m[2]), m[3], m[4], tuple(base + i for i in range(mask.bit_length()) if mask >> i & 1))


def strays(keys: Iterable[str], c: Committed, files: Collection[str], world_size: int) -> list[str]:
    """The keys among ``keys`` (what is stored under ``c``'s directory, :meth:`Paths.ckpt`) that are no
    part of the committed checkpoint ``c``, whose manifest names ``files`` and ``world_size`` ranks.

    Its own are the marker and records beside it (:data:`CHECKPOINT_RECORDS`) and, in its session,
    the session's record and last activity, its manifest, its rank-index objects (any whose name holds
    ranks below ``world_size`` alone, :func:`rank_batch`), and each named file
    with its digest record (and presign claim, or arrival record). Anything else in the session (a temp file a writer
    killed mid-write left, a file no index names, a planted one) is a stray. The directories of
    other sessions (save attempts that lost, reclaimed by the sweep) are theirs, not strays."""
    run, name, sid = c.run, c.name, c.session
    own = {f"{Paths.ckpt(run, name)}/{r}" for r in CHECKPOINT_RECORDS}
    own |= {Paths.session_meta(run, name, sid), Paths.activity(run, name, sid),
            f"{Paths.session(run, name, sid)}/{c.marker.manifest}"}
    for f in files:
        own |= {Paths.file(run, name, sid, f), Paths.digest(run, name, sid, f),
                Paths.presign_claim(run, name, sid, f), Paths.arrival(run, name, sid, f)}
    sessions, ranks = Paths.sessions(run, name) + "/", Paths.ranks(run, name, sid) + "/"
    out = []
    for key in keys:
        if key in own:
            continue
        if key.startswith(ranks) and (b := rank_batch(key[len(ranks):])) is not None and b.ranks[-1] < world_size:
            continue
        other = key[len(sessions):].split("/", 1)[0] if key.startswith(sessions) else None
        if other is not None and other != sid and "/" in key[len(sessions):]:
            try:
                check_session(other)
                continue  # another save attempt's staging: the sweep's
            except CkptdError:
                pass
        out.append(key)
    return out


def regular_file(path: str) -> tuple[os.stat_result | None, str | None]:
    """``(stat, None)`` for a regular file, ``(None, None)`` when nothing is there, ``(None, why)`` for
    anything else (a directory, a FIFO, a symlink loop, a path this process may not stat): such an
    object is never opened, since a FIFO would block the reader."""
    try:
        st = os.stat(path)
    except (FileNotFoundError, NotADirectoryError):
        return None, None
    except OSError as e:
        return None, f"cannot be read: {e.strerror}"
    if not statmod.S_ISREG(st.st_mode):
        return None, "is not a regular file"
    return st, None


def read_small(storage: Storage, key: str, limit: int) -> tuple[bytes | None, str | None]:
    """A small record (a marker, a verification record): ``(bytes, None)``; ``(None, None)`` when nothing
    is there; ``(None, why)`` when what is there is no such record: more than ``limit`` bytes, or, on a
    local root, anything but a regular readable file. Either way at most ``limit + 1`` bytes are read: a
    planted huge object or sparse file never whole. On a local root the path is opened as every read of
    the root opens it (:func:`~ckptd.storage.open_regular`: without blocking, then what was opened is
    checked), so an object swapped in after a look at the path never blocks the reader and a device is
    never read. An object store's failure to read is raised (the backend's, 503)."""
    path = storage.local_path(key)
    if path is None:
        raw = storage.read_head(key, limit + 1)
    else:
        try:
            fd = open_regular(path)
        except (FileNotFoundError, NotADirectoryError):
            return None, None
        except OSError as e:
            return None, "is not a regular file" if e.errno in (errno.EINVAL, errno.EISDIR) else \
                f"cannot be read: {e.strerror}"
        try:
            raw = os.read(fd, limit + 1)
        except OSError as e:
            return None, f"cannot be read: {e.strerror}"
        finally:
            os.close(fd)
    if raw is not None and len(raw) > limit:
        return None, f"holds more than {limit} bytes"
    return raw, None
