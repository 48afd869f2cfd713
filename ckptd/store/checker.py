"""The one checker: the only code that decides "these stored bytes are what this manifest says".

Every path that judges stored bytes asks :func:`judge`: the commit (:func:`check_commit`, called
from :meth:`Committer._commit <ckptd.store.commit.Committer._commit>` after the merge and
before the manifest is written), ``ckptd verify`` and the service's verification
(:func:`verify_manifest`, which reports every problem instead of raising the first, over the
bytes a :data:`~ckptd_schemas.readplan.ReadFn` returns: storage directly for ``--root``, the service over HTTP for
``--server``, so ``ckptd verify`` never trusts the process that wrote them), and the durable copy (:mod:`ckptd.store.durable`,
which writes each window to the durable tier as it passes). Their verdicts cannot differ: it is
the same code over the same bytes.

Each file is read once, in order (:data:`READ_SIZE` windows into one reused buffer per thread,
files :data:`JOBS` at a time, at a commit on a remote store :data:`REMOTE_JOBS`, each waiting
on round trips; on a local root the pages are dropped from the cache once the file is checked),
and, as its bytes pass:

* its whole-file and block digests are recomputed and compared with the file's record;
* every chunk's (and stored object's) XXH3-64 is recomputed from its stored bytes and compared
  with the one the manifest declares;
* every compressed chunk (zstd, blosc2) is walked and decoded in bounded memory
  (``frame_check``) and must hold exactly ``numel x itemsize`` bytes of its tensor piece
  (the manifest's ``raw_length``), at most ``FRAME_BYTES`` (4 MiB, the frame limit: a chunk
  declaring more is refused before anything is allocated for it); compressed chunks of one file
  may not share bytes, so at most one frame per file is decoded at a time, and each is judged
  (its decoder freed) as soon as its last byte has passed: whatever an index declares, a file's
  check holds one read window and one frame;
* replicas (the same region of a tensor under one digest, written by several ranks) are hashed
  with SHA-256 as well, and must be identical bytes: a writer can forge XXH3-64 collisions
  (it is not a cryptographic hash; a birthday search over 2^32 candidate chunks is hours on one
  core), and a reader takes whichever replica is nearest.

With ``tiling=True`` (verify: the manifest is read back from storage) each tensor's chunks must
also tile its shape exactly; the commit's merge checked that already (:mod:`.merge`).

At a commit, a file checked as it arrived, or linked from a checked file, whose stored identity is
still the one recorded then is confirmed by that identity (:meth:`StorageFiles.arrived`) and read
after the marker by the re-read; every other file is read, whichever way it entered the session
(an upload by URL, a file changed since): a record made once is never trusted later without the bytes.
A problem names the tensor, rank and file (:class:`Problem`); the commit raises the first
(:class:`~ckptd_schemas.ChecksumMismatch` for a digest, :class:`~ckptd_schemas.IntegrityError`
otherwise) and marks the session failed like any other refusal; verify lists them all. Pure over
a :class:`StoredBytes` source, so it is tested without a service.
"""

from __future__ import annotations

import contextlib
import hashlib
import mmap
import os
import threading
from array import array
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from itertools import repeat
from math import prod
from operator import itemgetter, le, sub
from typing import Callable, Collection, Iterable, Mapping, Protocol, Sequence

import xxhash

from ckptd_schemas import (
    Box, ChecksumMismatch, CkptdError, FileEntry, IntegrityError, Manifest, Region, StorageError, itemsize,
)
from ckptd_schemas.arrival import Declared, rows_digest
from ckptd_schemas.chunktable import check_columns_tiling
from ckptd_schemas.readplan import ReadFn

from ..storage import Storage
from .inflight import is_remote
from ckptd_schemas.format.frames import ChunkCheck, frame_check
from ckptd_schemas.filedigest import StreamDigest

__all__ = ["JOBS", "READ_SIZE", "REMOTE_JOBS", "FileCheck", "Findings", "Problem", "StorageFiles", "StoredBytes",
           "Verdict", "arrival_check", "check_commit", "file_rows", "jobs_for", "judge", "verify_manifest"]

READ_SIZE = 4 << 20
JOBS = 2  # a second file's reads keep the device busy while the first one's windows are hashed
REMOTE_JOBS = 8  # a commit on a remote store: files checked at once (8 read buffers of the store's piece)
_hex = xxhash.xxh3_64_hexdigest


class StoredBytes(Protocol):
    """Where the checker reads a file's bytes. Optional: ``size(file)``, the stored size (a file longer
    than its record is a problem too), ``done(file, ok)``, called once each file is checked
    (``ok``: no problem found in it), before the next file of its thread starts, and
    ``arrived(file)``, the :func:`~ckptd_schemas.arrival.rows_digest` of the rows checked as the file
    arrived when its stored identity is still the one it was stored with, else None: a file whose
    rows are exactly those, none of them a replica, is not read again."""

    def read_into(self, file: str, start: int, view: memoryview) -> int: ...


class StorageFiles:
    """A session's files in a :class:`Storage`, by file name."""

    def __init__(self, storage: Storage, key_of: Callable[[str], str], keep_cached: frozenset[str] = frozenset(),
                 arrivals: Mapping[str, tuple[str, str]] | None = None,
                 stamps: Mapping[str, str | None] | None = None) -> None:
        self.storage, self.key_of, self.keep_cached = storage, key_of, keep_cached
        self.arrivals = arrivals or {}  # file -> (rows digest, stamp) checked as it arrived
        self.stamps = stamps or {}  # file -> its stamp just now (the commit's, taken before the check)

    def arrived(self, file: str) -> str | None:
        """The rows checked as ``file`` arrived, when it is still the object stored then (its stamp)."""
        rec = self.arrivals.get(file)
        if rec is None or not rec[1]:
            return None
        now = self.stamps[file] if file in self.stamps else self.storage.stamp(self.key_of(file))
        return rec[0] if now == rec[1] else None

    def read_into(self, file: str, start: int, view: memoryview) -> int:
        """Past the page cache (``uncached``: each byte is read once here, and no cache page is filled
        and dropped for it), except the files in ``keep_cached``."""
        return self.storage.read_into(self.key_of(file), start, view, uncached=file not in self.keep_cached)

    def size(self, file: str) -> int | None:
        return self.storage.size(self.key_of(file))

    def done(self, file: str, ok: bool) -> None:
        """The file is checked (``ok``: no problem found in it): drop what a local page cache holds of it
        (the unaligned ends a read past the cache leaves there, or all of it where the filesystem
        refuses ``O_DIRECT``), so a checkpoint does not push the trainer's working set out. Files in
        ``keep_cached`` (linked from an earlier checkpoint: the frozen part every later save links and
        its commit reads again) keep their pages, so the next commit reads them from memory."""
        path = self.storage.local_path(self.key_of(file))
        if path is None or file in self.keep_cached or not hasattr(os, "posix_fadvise"):
            return
        with contextlib.suppress(OSError):
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)  # a FIFO put there opens at once
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def check_commit(manifest: Manifest, storage: Storage, key_of: Callable[[str], str],
                 arrivals: Mapping[str, tuple[str, str]] | None = None,
                 stamps: Mapping[str, str | None] | None = None) -> Verdict:
    """:func:`judge` over a session's files (``key_of`` gives a file's storage key), reading in the
    store's own piece size (S3: 16 MiB, a ranged GET each) where that is larger, except the files
    ``arrivals`` vouches for (:meth:`StorageFiles.arrived`: their ``stamps`` now, as the commit took
    them); raise the first problem, or return the verdict (bytes read, bytes vouched for by their
    arrival check)."""
    linked = frozenset(f for f, e in manifest.files.items() if e.linked)
    verdict = judge(manifest, StorageFiles(storage, key_of, linked, arrivals, stamps),
                    jobs=jobs_for(manifest, storage, key_of), read_size=max(READ_SIZE, storage.read_piece))
    verdict.raise_first()
    return verdict


def jobs_for(manifest: Manifest, storage: Storage, key_of: Callable[[str], str]) -> int:
    """Files checked at once in ``storage``: :data:`JOBS`, or :data:`REMOTE_JOBS` on a remote store."""
    first = next(iter(manifest.files), None)
    return REMOTE_JOBS if first is not None and is_remote(storage, key_of(first)) else JOBS


# -- what to check -------------------------------------------------------------------------------------

@dataclass
class _Rows:
    """Every chunk and stored object of the manifest as columns (one row each)."""

    file: list[str] = field(default_factory=list)
    offset: list[int] = field(default_factory=list)
    length: list[int] = field(default_factory=list)
    xxh3: list[str] = field(default_factory=list)
    owner: list[int] = field(default_factory=list)   # index into ``whats``
    rank: list[int | None] = field(default_factory=list)
    special: dict[int, "_Special"] = field(default_factory=dict)  # zstd or replica rows
    whats: list[tuple[str, str]] = field(default_factory=list)    # (kind, name): ("tensor", "model.w")

    def what(self, i: int) -> str:
        kind, name = self.whats[self.owner[i]]
        r = self.rank[i]
        return f"{kind} {name!r}" + (f" (rank {r})" if r is not None else "")

    def add(self, kind: str, name: str, file: str, offset: int, length: int, xxh3: str, rank: int | None) -> int:
        """One row of its own owner (an object, a declared chunk); returns its index."""
        self.whats.append((kind, name))
        self.file.append(file)
        self.offset.append(offset)
        self.length.append(length)
        self.xxh3.append(xxh3)
        self.owner.append(len(self.whats) - 1)
        self.rank.append(rank)
        return len(self.xxh3) - 1

    def problem(self, i: int, message: str, file: str, error: type[IntegrityError] = IntegrityError,
                **more: object) -> "Problem":
        """A problem of row ``i`` in ``file``: ``message`` after the row's name, ``more`` details."""
        kind, name = self.whats[self.owner[i]]
        return Problem(error, f"{self.what(i)}{message}", {kind: name, "rank": self.rank[i], "file": file, **more})


@dataclass
class _Special:
    raw_length: int | None = None     # set for compressed rows: the decoded length they must have
    replica_of: int | None = None     # group id, for replicas
    codec: str = "zstd"               # of a compressed row


def _rows(manifest: Manifest, only: frozenset[str] | None = None) -> tuple[_Rows, list[list[int]]]:
    """The rows to check, and the replica groups (rows that must hold identical bytes); ``only``: of
    the tensors and objects with a row in one of these files alone."""
    rows, groups = _Rows(), []
    for t in manifest.tensors:
        if only is not None and only.isdisjoint(t.table.file):  # most tensors, at C speed
            continue
        tab, base, n = t.table, len(rows.xxh3), len(t.table)
        owner = len(rows.whats)
        rows.whats.append(("tensor", t.name))
        rows.file += tab.file
        rows.offset += tab.offset
        rows.length += tab.length
        rows.xxh3 += tab.xxh3
        rows.owner += [owner] * n
        rows.rank += tab.rank if tab.rank is not None else [None] * n
        if tab.codec is not None and tab.codec.count("raw") != n:
            isz = itemsize(t.dtype)
            for i, codec in enumerate(tab.codec):
                if codec != "raw":
                    sizes = tab.sizes[i]
                    numel = sizes[0] if tab.is_flat(i) else prod(sizes)
                    rows.special[base + i] = _Special(raw_length=numel * isz, codec=codec)
        if len(set(tab.xxh3)) != n:  # two rows with one digest: maybe replicas of one region
            for members in _replicas(t.name, t.shape, tab, base):
                for i in members:
                    rows.special.setdefault(i, _Special()).replica_of = len(groups)
                groups.append(members)
    for o in manifest.objects:
        if o.location is None or only is not None and o.location.file not in only:
            continue
        loc = o.location
        i = rows.add("object", o.name, loc.file, loc.offset, loc.length, loc.xxh3, o.rank)
        if loc.codec != "raw":
            rows.special[i] = _Special(raw_length=loc.raw_length, codec=loc.codec)
    return rows, groups


def _replicas(name: str, shape: list[int], tab, base: int) -> list[list[int]]:
    """The groups of rows (numbered from ``base``) that the tiling counts as replicas of one region.

    The tiling (:func:`~ckptd_schemas.geometry.check_tiling`) takes two chunks under one digest as
    replicas box by box, whatever their kind: a flat range and a box over the same elements are
    replicas, and so would be a box and the part of a flat range it equals. So rows are grouped by
    the boxes they cover, not by how their index writes them; rows of one digest whose boxes differ
    but share one are refused (only a forged collision gives chunks of different sizes one digest).
    """
    by_digest: dict[str, list[int]] = {}
    for i, d in enumerate(tab.xxh3):
        by_digest.setdefault(d, []).append(i)
    out = []
    for d, same in by_digest.items():
        if len(same) < 2:
            continue
        regions: dict[tuple[Box, ...], list[int]] = {}
        for i in same:
            region = Region(flat=(tab.offsets[i][0], tab.sizes[i][0])) if tab.is_flat(i) else \
                Region(box=Box(tuple(tab.offsets[i]), tuple(tab.sizes[i])))
            regions.setdefault(tuple(region.boxes(shape)), []).append(i)
        if len(regions) > 1:
            owner: dict[Box, tuple[Box, ...]] = {}
            for key in regions:
                for box in key:
                    other = owner.setdefault(box, key)
                    if other is not key:
                        rows = regions[other] + regions[key]
                        ranks = sorted({tab.rank[i] for i in rows}) if tab.rank is not None else []
                        raise IntegrityError(
                            f"refused at commit: tensor {name!r}: ranks {ranks} store different regions under one "
                            f"digest {d} that share offsets {list(box.offsets)} sizes {list(box.sizes)}: only "
                            f"chunks of the same elements can be replicas", tensor=name, ranks=ranks,
                            file=tab.file[rows[0]])
        out += [[base + i for i in members] for members in regions.values() if len(members) > 1]
    return out


# -- problems ------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Problem:
    """One thing the stored bytes get wrong: the typed error to raise, its sentence, its details."""

    error: type[IntegrityError]
    message: str
    details: dict

    def exception(self, prefix: str = "", suffix: str = "") -> IntegrityError:
        return self.error(prefix + self.message + suffix, **{k: v for k, v in self.details.items() if v is not None})


@dataclass
class Verdict:
    """What :func:`judge` found: every problem, in file order, and the bytes read."""

    problems: list[Problem]
    bytes_read: int
    bytes_arrived: int = 0  # bytes of files checked as they arrived, not read again (``arrived``)
    files_arrived: frozenset[str] = frozenset()

    @property
    def ok(self) -> bool:
        return not self.problems

    def raise_first(self) -> None:
        """Raise the first problem, if any (the commit's refusal)."""
        if self.problems:
            more = f" (and {len(self.problems) - 1} more problems)" if len(self.problems) > 1 else ""
            raise self.problems[0].exception("refused at commit: ", more)


def _chunk_problem(rows: _Rows, i: int, got: str) -> Problem:
    lo, f = rows.offset[i], rows.file[i]
    return rows.problem(i, f": bytes [{lo}, {lo + rows.length[i]}) of file {f!r} hash to {got}, its index says "
                           f"{rows.xxh3[i]}", f, ChecksumMismatch, offset=lo, declared=rows.xxh3[i], actual=got)


# -- one file ------------------------------------------------------------------------------------------

class _Stream:
    """A row whose bytes span windows, or that needs more than its XXH3 (a compressed chunk, a replica).

    A compressed row is decoded (``frame``) only when it shares no bytes with the compressed row
    before it (:class:`_Frames`); a row on exactly that row's bytes takes its verdict (``twin_of``)."""

    def __init__(self, i: int, special: _Special | None) -> None:
        self.i = i
        self.xxh3 = xxhash.xxh3_64()
        self.sha = hashlib.sha256() if special is not None and special.replica_of is not None else None
        self.frame: ChunkCheck | None = None
        self.twin_of: int | None = None

    def feed(self, data: memoryview) -> None:
        self.xxh3.update(data)
        if self.sha is not None:
            self.sha.update(data)
        if self.frame is not None:
            self.frame.feed(data)


class _Frames:
    """The compressed rows of one file, met in offset order: at most one decoded at a time.

    Compressed chunks never share bytes (each is its own frame, cut by the writer one after the
    other), so a file holds at most one compressed row in progress, and its check at most one frame
    (:data:`~ckptd_schemas.format.frames.FRAME_BYTES`) of memory: rows that overlap another are a
    problem and are not decoded (256 such rows, 32 bytes apart, each a valid 4 MiB Blosc2 chunk, once
    held 1 GiB at once). A row on exactly the bytes, codec and size of the one before is its twin
    (two tensors on one frame): decoded once, given the same verdict."""

    def __init__(self, fname: str, rows: _Rows, problems: list[Problem]) -> None:
        self.fname, self.rows, self.problems = fname, rows, problems
        self.last: tuple[int, int, str, int, int] | None = None  # offset, end, codec, raw length, row
        self.whys: dict[int, str | None] = {}

    def start(self, s: _Stream, special: _Special) -> None:
        rows, i = self.rows, s.i
        assert special.raw_length is not None
        lo, hi = rows.offset[i], rows.offset[i] + rows.length[i]
        key = (lo, hi, special.codec, special.raw_length)
        last = self.last
        if last is not None and key == last[:4]:
            s.twin_of = last[4]
        elif last is not None and lo < last[1]:
            self.problems.append(rows.problem(
                i, f": file {self.fname!r} bytes [{lo}, {hi}) overlap the compressed chunk of {rows.what(last[4])} at "
                f"bytes [{last[0]}, {last[1]}): compressed chunks may not share bytes", self.fname))
        else:
            s.frame = frame_check(special.codec, special.raw_length)
            self.last = (*key, i)

    def verdict(self, s: _Stream) -> str | None:
        """``s``'s frame problem, or None; its decoder and buffers are freed here."""
        if s.frame is not None:
            why = self.whys[s.i] = s.frame.problem()
            s.frame = None
            return why
        return self.whys.get(s.twin_of) if s.twin_of is not None else None


class FileCheck:
    """One file's rows checked as its bytes pass, in order (push): fed by :func:`_check_file`'s reads
    (the commit, a verification) or by the bytes as they arrive (:func:`arrival_check`), the same code.

    A row that needs a stream is judged as soon as its last byte has passed (its digest, its frame:
    :meth:`_Frames.verdict`), so memory holds only the rows in progress, never the file's."""

    def __init__(self, fname: str, members: Sequence[int], rows: _Rows) -> None:
        self.fname, self.rows = fname, rows
        self.problems: list[Problem] = []
        self.shas: dict[int, bytes] = {}  # the SHA-256 of its replica rows
        offs = itemgetter(*members)(rows.offset) if len(members) > 1 else tuple(rows.offset[i] for i in members)
        if not all(map(le, offs, offs[1:])):
            members = [i for _, i in sorted(zip(offs, members))]
            offs = tuple(rows.offset[i] for i in members)
        self.members, self.offs = members, offs
        self.ends = [o + rows.length[i] for o, i in zip(offs, members)]
        self.frames = _Frames(fname, rows, self.problems)
        self.streams: list[_Stream] = []
        self.k, self.pos = 0, 0  # members[:k] have started; bytes [0, pos) have passed

    def _start(self, q: int) -> _Stream:
        s = _Stream(self.members[q], sp := self.rows.special.get(self.members[q]))
        if sp is not None and sp.raw_length is not None:
            self.frames.start(s, sp)
        return s

    def _finish(self, s: _Stream) -> None:
        rows, fname = self.rows, self.fname
        got = s.xxh3.hexdigest()
        if got != rows.xxh3[s.i]:
            self.problems.append(_chunk_problem(rows, s.i, got))
        if (why := self.frames.verdict(s)) is not None:
            self.problems.append(rows.problem(s.i, f": file {fname!r} bytes [{rows.offset[s.i]}, "
                                                   f"{rows.offset[s.i] + rows.length[s.i]}): {why}", fname))
        if s.sha is not None:
            self.shas[s.i] = s.sha.digest()

    def feed(self, view: memoryview | bytes) -> None:
        """The file's next bytes."""
        view = memoryview(view)
        rows, members, offs, ends, pos = self.rows, self.members, self.offs, self.ends, self.pos
        end = pos + len(view)
        still = []
        for s in self.streams:  # rows begun in an earlier window
            i = s.i
            s.feed(view[:min(rows.offset[i] + rows.length[i], end) - pos])
            if rows.offset[i] + rows.length[i] <= end:
                self._finish(s)
            else:
                still.append(s)
        self.streams = still
        k = j = self.k
        while j < len(members) and offs[j] < end:
            j += 1
        # Rows that start here: whole, plain ones hashed at C speed in one map; the rest streamed.
        special = rows.special
        plain = [q for q in range(k, j) if ends[q] <= end and members[q] not in special]
        if plain:
            lo = list(map(sub, map(offs.__getitem__, plain), repeat(pos)))
            hi = list(map(sub, map(ends.__getitem__, plain), repeat(pos)))
            got = list(map(_hex, map(view.__getitem__, map(slice, lo, hi))))
            want = [rows.xxh3[members[q]] for q in plain]
            if got != want:
                self.problems += [_chunk_problem(rows, members[q], g) for q, g, w in zip(plain, got, want) if g != w]
        if len(plain) != j - k:
            taken = set(plain)
            for q in range(k, j):
                if q not in taken:
                    s = self._start(q)
                    s.feed(view[offs[q] - pos:min(ends[q], end) - pos])
                    if ends[q] <= end:
                        self._finish(s)
                    else:
                        self.streams.append(s)
        self.k, self.pos = j, end

    def finish(self) -> list[Problem]:
        """After the last byte: the problems found. A row that ends past the bytes fed is one, whatever
        its digest (the digest of the part that is there, or of nothing, would otherwise pass)."""
        for q in [q for q, e in enumerate(self.ends) if e > self.pos]:
            self.problems.append(self.rows.problem(self.members[q], f": bytes [{self.offs[q]}, {self.ends[q]}) of file "
                                                   f"{self.fname!r} end past its {self.pos} bytes", self.fname))
        for s in self.streams:  # rows the bytes ended inside of
            self._finish(s)
        self.streams = []
        for q in range(self.k, len(self.members)):  # rows at the very end (empty) or past it
            self._finish(self._start(q))
        self.k = len(self.members)
        return self.problems


def _check_file(fname: str, entry: FileEntry, members: Sequence[int], rows: _Rows, source: StoredBytes,
                buf: memoryview, progress: Callable[[int], None] | None) -> tuple[list[Problem], dict[int, bytes], int]:
    """One file read in order once, through a :class:`FileCheck`, its whole-file and block digests
    compared with its record. Returns its problems, the SHA-256 of its replica rows, bytes read."""
    check = FileCheck(fname, members, rows)
    digest = StreamDigest(entry.block_size)
    pos = 0
    while pos < entry.size:
        n = source.read_into(fname, pos, buf[:min(len(buf), entry.size - pos)])
        if n <= 0:
            check.problems.append(Problem(IntegrityError, f"file {fname!r}: short read at byte {pos} of {entry.size}",
                                          {"file": fname}))
            return check.problems, check.shas, pos
        view = buf[:n]
        digest.update(view)
        if progress is not None:
            progress(n)
        check.feed(view)
        pos += n
    problems = check.finish()
    whole, blocks = digest.finish()
    if whole != entry.xxh3 or blocks != entry.blocks:
        bad = next((b for b, (x, y) in enumerate(zip(blocks, entry.blocks)) if x != y), None)
        where = "" if bad is None else \
            f" (bytes [{bad * entry.block_size}, {min((bad + 1) * entry.block_size, entry.size)}) differ)"
        problems.append(Problem(ChecksumMismatch, f"file {fname!r}: its {entry.size} bytes hash to {whole}, the "
                                 f"service recorded {entry.xxh3} when it received them{where}",
                                 {"file": fname, "declared": entry.xxh3, "actual": whole}))
    return problems, check.shas, pos


def arrival_check(fname: str, declared: Sequence[Declared]) -> FileCheck:
    """The check of a file's bytes as they arrive against the rows its writer declared (XXH3-64 of each,
    frames decoded to their length, compressed rows apart): fed by the ingest seam
    (:class:`~.intake.FileSink`), finished after the last byte; what it covered is
    ``rows_digest(declared)``. Replicas are compared at the commit, which reads their files."""
    rows = _Rows()
    for d in declared:
        i = rows.add(d.kind, d.name, fname, d.offset, d.length, d.xxh3, None)
        if d.codec != "raw":
            rows.special[i] = _Special(raw_length=d.raw_length, codec=d.codec)
    return FileCheck(fname, range(len(rows.xxh3)), rows)


def _row_set(rows: _Rows, members: Sequence[int]) -> frozenset | None:
    """A file's rows in the manifest as ``rows_digest`` takes them, or None when one is a replica
    (compared by reading)."""
    out = []
    for i in members:
        sp = rows.special.get(i)
        if sp is not None and sp.replica_of is not None:
            return None
        raw = sp is None or sp.raw_length is None
        out.append((rows.offset[i], rows.length[i], rows.xxh3[i], "raw" if raw else sp.codec,
                    rows.length[i] if raw else sp.raw_length))
    return frozenset(out)


def file_rows(manifest: Manifest, files: Collection[str]) -> dict[str, frozenset | None]:
    """The rows of each of ``files`` in ``manifest`` (offset, length, XXH3, codec, decoded length), None
    for a file holding a replica: what the commit compares between a linked file and its source."""
    rows, _ = _rows(manifest, frozenset(files))
    members: dict[str, list[int]] = {f: [] for f in files}
    for i, f in enumerate(rows.file):
        if f in members:
            members[f].append(i)
    return {f: _row_set(rows, m) for f, m in members.items()}


# -- all of it -------------------------------------------------------------------------------------------

def judge(manifest: Manifest, source: StoredBytes, *, jobs: int = JOBS, read_size: int = READ_SIZE,
          tiling: bool = False, progress: Callable[[int], None] | None = None,
          storage_errors_are_problems: bool = False, files: Collection[str] | None = None) -> Verdict:
    """Every problem of the bytes ``source`` holds against ``manifest`` (module docstring), in file
    order after the tiling's. A file that cannot be read whole is a problem of that file (damage: the
    source raises :class:`~ckptd_schemas.IntegrityError`); a failing store (``StorageError``) is raised,
    as transient, unless ``storage_errors_are_problems`` (a verification, which reports what it could
    not read). ``progress`` is called with the size of every window read. ``files``: judge only these
    files' bytes (a reader's report of damage: ``verification.recheck_files``), and replicas only among
    the rows they hold."""
    problems: list[Problem] = []
    if tiling:
        for t in manifest.tensors:
            try:
                check_columns_tiling(t.name, t.shape, t.table)
            except CkptdError as e:
                problems.append(Problem(IntegrityError, e.message, {"tensor": t.name}))
    rows, groups = _rows(manifest)
    by_file: dict[str, Sequence[int]] = {f: array("q") for f in manifest.files}  # 8 bytes a row, not an int object
    appends = {f: v.append for f, v in by_file.items()}
    for i, f in enumerate(rows.file):
        if f not in appends:
            problems.append(rows.problem(i, f" points at file {f!r}, which the manifest does not list", f))
            continue
        appends[f](i)
    items = sorted(by_file.items()) if files is None else sorted((f, v) for f, v in by_file.items() if f in files)

    local = threading.local()  # one read buffer per thread, reused for all its files
    done = getattr(source, "done", None)
    arrived = getattr(source, "arrived", None)
    skipped: list[int] = []
    stored_size = getattr(source, "size", None)
    unreadable = (IntegrityError, StorageError) if storage_errors_are_problems else (IntegrityError,)

    def one(item: tuple[str, Sequence[int]]) -> tuple[list[Problem], dict[int, bytes], int]:
        buf = getattr(local, "buf", None)
        if buf is None:  # page-aligned (an anonymous mapping): a local store reads into it past the cache
            buf = local.buf = memoryview(mmap.mmap(-1, read_size))
        fname, members = item
        if (arrived is not None and (when := arrived(fname)) is not None
                and (covered := _row_set(rows, members)) is not None and when == rows_digest(covered)):
            skipped.append(fname)  # checked as it arrived, still those bytes
            if done is not None:
                done(fname, True)
            return [], {}, 0
        try:
            out = _check_file(fname, manifest.files[fname], members, rows, source, buf, progress)
            size = stored_size(fname) if stored_size is not None else None
            if size is not None and size != manifest.files[fname].size:
                out[0].append(Problem(IntegrityError, f"file {fname!r} holds {size} bytes, its record says "
                                      f"{manifest.files[fname].size}", {"file": fname}))
        except unreadable as e:
            out = [Problem(IntegrityError, f"file {fname!r}: {e.message}", {"file": fname})], {}, 0
        except BaseException:
            if done is not None:
                done(fname, False)
            raise
        if done is not None:
            done(fname, not out[0])
        return out

    results: Iterable
    if jobs > 1 and len(items) > 1:
        with ThreadPoolExecutor(min(jobs, len(items)), thread_name_prefix="ckptd-check") as pool:
            results = list(pool.map(one, items))
    else:
        results = [one(it) for it in items]
    shas: dict[int, bytes] = {}
    nbytes = 0
    for p, sh, n in results:
        problems += p
        shas.update(sh)
        nbytes += n
    for members in groups:
        if files is not None:
            members = [i for i in members if rows.file[i] in files]
        if len({shas.get(i) for i in members}) > 1:
            i = members[0]
            kind, name = rows.whats[rows.owner[i]]
            ranks = sorted({rows.rank[m] for m in members if rows.rank[m] is not None})
            files = sorted({rows.file[m] for m in members})
            problems.append(Problem(IntegrityError, f"{kind} {name!r}: ranks {ranks} store one region as replicas "
                                    f"with digest {rows.xxh3[i]}, but their bytes differ (files {files})",
                                    {kind: name, "ranks": ranks, "file": files[0]}))
    return Verdict(problems, nbytes, sum(manifest.files[f].size for f in skipped), frozenset(skipped))


# -- every problem of a committed checkpoint, for `ckptd verify` and the service's verification --

@dataclass
class Findings:
    """What one pass of the checker over a committed checkpoint found (:func:`verify_manifest`). A
    verification the service stores is a :class:`~.records.VerifyRecord` made from it (with the
    manifest's digest, the time and the files' stamps)."""

    ref: str
    files: int = 0
    tensors: int = 0
    chunks: int = 0
    bytes_read: int = 0
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems


class _Windows:
    """A :data:`~ckptd_schemas.readplan.ReadFn` as the checker reads: into its buffer, window by window."""

    def __init__(self, read: ReadFn) -> None:
        self.read = read

    def read_into(self, file: str, start: int, view: memoryview) -> int:
        data = self.read(file, start, start + len(view))
        view[:len(data)] = data
        return len(data)


def verify_manifest(
    manifest: Manifest, read: ReadFn, *, progress: Callable[[int], None] | None = None, jobs: int = JOBS,
    storage_errors_are_problems: bool = True, files: Collection[str] | None = None, tiling: bool = False,
) -> Findings:
    """Check every file, chunk and tensor of ``manifest`` against the bytes ``read`` returns, ``jobs``
    files at a time (a read waits on the device or the network without the GIL, so a second file's
    reads keep it busy while the first one's windows are hashed). Problems in file order. A store that
    fails a read (``StorageError``) is a problem of that file, or, with ``storage_errors_are_problems``
    False, raised: a verification whose outcome is recorded must not call a checkpoint bad because
    its store was briefly unreachable. Each tensor's tiling is checked when every file is (``files`` None),
    or when ``tiling`` asks it of a check of some files (one share of a re-read: :mod:`.rereads`)."""
    verdict = judge(manifest, _Windows(read), jobs=jobs, read_size=READ_SIZE, tiling=tiling or files is None,
                    progress=progress, storage_errors_are_problems=storage_errors_are_problems, files=files)
    chunks = sum(len(t.table) for t in manifest.tensors) + sum(1 for o in manifest.objects if o.location is not None)
    return Findings(ref=manifest.ref, files=len(manifest.files), tensors=len(manifest.tensors), chunks=chunks,
                    bytes_read=verdict.bytes_read, problems=[p.message for p in verdict.problems])
