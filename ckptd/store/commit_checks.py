"""The commit's own check of the stored bytes: nothing becomes visible that ``ckptd verify`` rejects.

Called from one place, :meth:`SessionStore._commit <ckptd.store.sessions.SessionStore._commit>`,
after :func:`~ckptd.store.merge.merge_indexes` (shapes, dtypes, bounds, tiling; replicas there are
chunks of one region with one declared digest) and before the manifest is written:

1. every file a rank wrote itself (direct writes) is found as the service left it after hashing it:
   same inode, size, mode, mtime and ctime (:class:`~ckptd_schemas.AdoptedFile`);
2. every file is read once, in order (:data:`READ_SIZE` windows into one reused buffer per thread,
   files :data:`JOBS` at a time; on a local root the pages are still cached from the upload or
   the adoption, and are dropped from the cache once the file is checked), and, as its bytes pass:

   * its whole-file and block digests are recomputed and compared with the digest record;
   * every chunk's (and stored object's) XXH3-64 is recomputed from its stored bytes and compared
     with the one its index declares;
   * every compressed chunk (zstd, blosc2) is walked and decoded in bounded memory
     (:func:`~ckptd.store.frames.frame_check`)
     and must hold exactly ``numel x itemsize`` bytes of its tensor piece (the manifest's ``raw_length``);
   * replicas (the same region of a tensor under one digest, written by several ranks) are hashed
     with SHA-256 as well, and must be identical bytes: a writer can forge XXH3-64 collisions
     (it is not a cryptographic hash; a birthday search over 2^32 candidate chunks is hours on one
     core), and a reader takes whichever replica is nearest;
3. step 1 again, so a write to an adopted file during the pass is seen.

A file linked from an earlier checkpoint (incremental saves, ``FileEntry.linked``) is not read
when every chunk placed in it sits where the source's manifest placed a chunk (same offset,
length, digest and decoded length), none of them a replica: the source's commit checked those
bytes, and the link is the same stored file. Otherwise it is read and checked like any other.

Those are the checks of :mod:`ckptd.store.verify`, plus replicas by content and the adopted files'
metadata. A failure raises a typed error (:class:`~ckptd_schemas.ChecksumMismatch` for a digest,
:class:`~ckptd_schemas.IntegrityError` otherwise) naming the tensor, rank and file; the commit then
marks the session failed like any other refusal. Pure over a :class:`StoredBytes` source and a stat
function, so it is tested without a service.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import stat as stat_mod
import threading
from array import array
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from itertools import repeat
from math import prod
from operator import itemgetter, le, sub
from typing import Callable, Iterable, Mapping, Protocol, Sequence

import xxhash

from ckptd_schemas import AdoptedFile, Box, ChecksumMismatch, FileEntry, IntegrityError, Manifest, Region, itemsize

from ..storage import Storage
from .frames import frame_check
from ckptd_schemas.filedigest import StreamDigest

__all__ = ["JOBS", "READ_SIZE", "StorageFiles", "StoredBytes", "check_commit", "check_stored", "local_stat",
           "verified_locations"]

READ_SIZE = 4 << 20
JOBS = 2
_EMPTY = xxhash.xxh3_64_hexdigest(b"")
_hex = xxhash.xxh3_64_hexdigest


class StoredBytes(Protocol):
    def read_into(self, file: str, start: int, view: memoryview) -> int: ...


class StorageFiles:
    """A session's files in a :class:`Storage`, by file name."""

    def __init__(self, storage: Storage, key_of: Callable[[str], str]) -> None:
        self.storage, self.key_of = storage, key_of

    def read_into(self, file: str, start: int, view: memoryview) -> int:
        return self.storage.read_into(self.key_of(file), start, view)

    def done(self, file: str) -> None:
        """The file is checked: drop its pages from a local page cache (uploads and adoptions leave
        them there for this pass), so a checkpoint does not push the trainer's working set out."""
        path = self.storage.local_path(self.key_of(file))
        if path is None or not hasattr(os, "posix_fadvise"):
            return
        with contextlib.suppress(OSError):
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def local_stat(storage: Storage, key_of: Callable[[str], str]) -> Callable[[str], os.stat_result | None] | None:
    """``lstat`` of a session file on a local root (None when absent); None where files have no path."""
    if storage.local_path(key_of("probe")) is None:
        return None

    def one(file: str) -> os.stat_result | None:
        try:
            return os.lstat(storage.local_path(key_of(file)))  # type: ignore[arg-type]
        except (FileNotFoundError, NotADirectoryError):
            return None

    return one


def check_commit(manifest: Manifest, entries: Mapping[str, FileEntry], storage: Storage,
                  key_of: Callable[[str], str], verified: Mapping[str, set[tuple]] | None = None) -> int:
    """:func:`check_stored` over a session's files: ``entries`` are their digest records (with the
    ``adopted`` record of each directly written file), ``key_of`` gives a file's storage key,
    ``verified`` the locations a linked file's source checked (:func:`verified_locations`)."""
    adopted = {f: e.adopted for f, e in entries.items() if e.adopted is not None}
    # One read per window: an object store's (S3: 16 MiB, a ranged GET each) rather than 4 MiB.
    return check_stored(manifest, StorageFiles(storage, key_of), adopted=adopted,
                        stat=local_stat(storage, key_of) if adopted else None, verified=verified,
                        read_size=max(READ_SIZE, storage.read_piece))


def verified_locations(manifest: Manifest) -> dict[str, set[tuple]]:
    """Per file, the chunk and object locations ``manifest`` places in it, as the rows' keys that
    :func:`check_stored` compares: (offset, length, XXH3, decoded length and codec of a compressed row)."""
    rows, _ = _rows(manifest)
    out: dict[str, set[tuple]] = {}
    for i, f in enumerate(rows.file):
        out.setdefault(f, set()).add(_key(rows, i))
    return out


def _key(rows: "_Rows", i: int) -> tuple:
    special = rows.special.get(i)
    if special is None or special.raw_length is None:
        return rows.offset[i], rows.length[i], rows.xxh3[i], None, "raw"
    return rows.offset[i], rows.length[i], rows.xxh3[i], special.raw_length, special.codec


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


@dataclass
class _Special:
    raw_length: int | None = None     # set for compressed rows: the decoded length they must have
    replica_of: int | None = None     # group id, for replicas
    codec: str = "zstd"               # of a compressed row


def _rows(manifest: Manifest) -> tuple[_Rows, list[list[int]]]:
    """The rows to check, and the replica groups (rows that must hold identical bytes)."""
    rows, groups = _Rows(), []
    for t in manifest.tensors:
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
        if o.location is None:
            continue
        loc, i = o.location, len(rows.xxh3)
        rows.whats.append(("object", o.name))
        rows.file.append(loc.file)
        rows.offset.append(loc.offset)
        rows.length.append(loc.length)
        rows.xxh3.append(loc.xxh3)
        rows.owner.append(len(rows.whats) - 1)
        rows.rank.append(o.rank)
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
class _Problem:
    error: type[IntegrityError]
    message: str
    details: dict


def _chunk_problem(rows: _Rows, i: int, got: str) -> _Problem:
    lo, f = rows.offset[i], rows.file[i]
    kind, name = rows.whats[rows.owner[i]]
    return _Problem(ChecksumMismatch,
                    f"{rows.what(i)}: bytes [{lo}, {lo + rows.length[i]}) of file {f!r} hash to {got}, its index "
                    f"says {rows.xxh3[i]}", {kind: name, "rank": rows.rank[i], "file": f, "offset": lo,
                                             "declared": rows.xxh3[i], "actual": got})


def _raise_first(problems: list[_Problem]) -> None:
    if not problems:
        return
    p = problems[0]
    more = f" (and {len(problems) - 1} more problems)" if len(problems) > 1 else ""
    raise p.error(f"refused at commit: {p.message}{more}", **{k: v for k, v in p.details.items() if v is not None})


# -- adopted files ---------------------------------------------------------------------------------------

def _adopted_problems(adopted: Mapping[str, AdoptedFile], stat: Callable[[str], os.stat_result | None]
                      ) -> list[_Problem]:
    out = []
    for f, want in sorted(adopted.items()):
        st = stat(f)
        if st is None:
            why = "is gone"
        elif not stat_mod.S_ISREG(st.st_mode):
            why = "is no longer a regular file"
        else:
            now = AdoptedFile(inode=st.st_ino, size=st.st_size, mode=stat_mod.S_IMODE(st.st_mode),
                              mtime_ns=st.st_mtime_ns, ctime_ns=st.st_ctime_ns)
            diff = [k for k in ("inode", "size", "mode", "mtime_ns", "ctime_ns") if getattr(now, k) != getattr(want, k)]
            if not diff:
                continue
            why = "changed after the service hashed it (" + ", ".join(
                f"{k} {getattr(want, k)} -> {getattr(now, k)}" for k in diff) + ")"
        out.append(_Problem(IntegrityError, f"file {f!r}, written directly by its rank, {why}", {"file": f}))
    return out


# -- one file ------------------------------------------------------------------------------------------

class _Stream:
    """A row whose bytes span windows, or that needs more than its XXH3 (zstd, replica)."""

    def __init__(self, i: int, special: _Special | None) -> None:
        self.i = i
        self.xxh3 = xxhash.xxh3_64()
        self.sha = hashlib.sha256() if special is not None and special.replica_of is not None else None
        self.frame = (frame_check(special.codec, special.raw_length)
                      if special is not None and special.raw_length is not None else None)

    def feed(self, data: memoryview) -> None:
        self.xxh3.update(data)
        if self.sha is not None:
            self.sha.update(data)
        if self.frame is not None:
            self.frame.feed(data)


def _check_file(fname: str, entry: FileEntry, members: Sequence[int], rows: _Rows, source: StoredBytes,
                buf: memoryview) -> tuple[list[_Problem], dict[int, bytes], int]:
    """One file read in order once. Returns its problems, the SHA-256 of its replica rows, bytes read."""
    problems: list[_Problem] = []
    shas: dict[int, bytes] = {}
    offs = itemgetter(*members)(rows.offset) if len(members) > 1 else tuple(rows.offset[i] for i in members)
    if not all(map(le, offs, offs[1:])):
        members = [i for _, i in sorted(zip(offs, members))]
        offs = tuple(rows.offset[i] for i in members)
    lens = [rows.length[i] for i in members]
    ends = [o + n for o, n in zip(offs, lens)]
    special = rows.special
    streams: list[_Stream] = []
    done: list[_Stream] = []
    digest = StreamDigest(entry.block_size)
    k, pos = 0, 0  # members[:k] have started
    while pos < entry.size:
        n = source.read_into(fname, pos, buf[:min(len(buf), entry.size - pos)])
        if n <= 0:
            problems.append(_Problem(IntegrityError, f"file {fname!r}: short read at byte {pos} of {entry.size}",
                                     {"file": fname}))
            return problems, shas, pos
        view, end = buf[:n], pos + n
        digest.update(view)
        for s in streams:  # rows begun in an earlier window
            i = s.i
            s.feed(view[:min(rows.offset[i] + rows.length[i], end) - pos])
        j = k
        while j < len(members) and offs[j] < end:
            j += 1
        # Rows that start here: whole, plain ones hashed at C speed in one map; the rest streamed.
        plain = [q for q in range(k, j) if ends[q] <= end and members[q] not in special]
        if plain:
            lo = list(map(sub, map(offs.__getitem__, plain), repeat(pos)))
            hi = list(map(sub, map(ends.__getitem__, plain), repeat(pos)))
            got = list(map(_hex, map(view.__getitem__, map(slice, lo, hi))))
            want = [rows.xxh3[members[q]] for q in plain]
            if got != want:
                problems += [_chunk_problem(rows, members[q], g) for q, g, w in zip(plain, got, want) if g != w]
        if len(plain) != j - k:
            taken = set(plain)
            for q in range(k, j):
                if q not in taken:
                    s = _Stream(members[q], special.get(members[q]))
                    s.feed(view[offs[q] - pos:min(ends[q], end) - pos])
                    streams.append(s)
        k = j
        still = []
        for s in streams:
            (done if rows.offset[s.i] + rows.length[s.i] <= end else still).append(s)
        streams = still
        pos = end
    for q in range(k, len(members)):  # empty rows at the very end of the file
        done.append(_Stream(members[q], special.get(members[q])))
    for s in done:
        got = s.xxh3.hexdigest()
        if got != rows.xxh3[s.i]:
            problems.append(_chunk_problem(rows, s.i, got))
        if s.frame is not None and (why := s.frame.problem()) is not None:
            kind, name = rows.whats[rows.owner[s.i]]
            problems.append(_Problem(IntegrityError, f"{rows.what(s.i)}: file {fname!r} bytes [{rows.offset[s.i]}, "
                                     f"{rows.offset[s.i] + rows.length[s.i]}): {why}",
                                     {kind: name, "rank": rows.rank[s.i], "file": fname}))
        if s.sha is not None:
            shas[s.i] = s.sha.digest()
    whole, blocks = digest.finish()
    if whole != entry.xxh3 or blocks != entry.blocks:
        bad = next((b for b, (x, y) in enumerate(zip(blocks, entry.blocks)) if x != y), None)
        where = "" if bad is None else \
            f" (bytes [{bad * entry.block_size}, {min((bad + 1) * entry.block_size, entry.size)}) differ)"
        problems.append(_Problem(ChecksumMismatch, f"file {fname!r}: its {entry.size} bytes hash to {whole}, the "
                                 f"service recorded {entry.xxh3} when it received them{where}",
                                 {"file": fname, "declared": entry.xxh3, "actual": whole}))
    return problems, shas, pos


# -- all of it -------------------------------------------------------------------------------------------

def check_stored(manifest: Manifest, source: StoredBytes, *, adopted: Mapping[str, AdoptedFile] | None = None,
                 stat: Callable[[str], os.stat_result | None] | None = None, jobs: int = JOBS,
                 read_size: int = READ_SIZE, verified: Mapping[str, set[tuple]] | None = None) -> int:
    """Raise the first problem (in file order) unless every check above holds; return the bytes read.
    Files in ``verified`` whose rows are all among its locations (and none a replica) are not read."""
    adopted = {f: a for f, a in (adopted or {}).items() if f in manifest.files}
    if adopted and stat is not None:
        _raise_first(_adopted_problems(adopted, stat))
    rows, groups = _rows(manifest)
    by_file: dict[str, Sequence[int]] = {f: array("q") for f in manifest.files}  # 8 bytes a row, not an int object
    appends = {f: v.append for f, v in by_file.items()}
    for i, f in enumerate(rows.file):
        appends[f](i)
    if verified:
        for f, keys in verified.items():
            members = by_file.get(f)
            if members is not None and all(
                    _key(rows, i) in keys and (rows.special.get(i) is None or rows.special[i].replica_of is None)
                    for i in members):
                del by_file[f]
    items = sorted(by_file.items())

    local = threading.local()  # one read buffer per thread, reused for all its files
    done = getattr(source, "done", None)

    def one(item: tuple[str, Sequence[int]]) -> tuple[list[_Problem], dict[int, bytes], int]:
        buf = getattr(local, "buf", None)
        if buf is None:
            buf = local.buf = memoryview(bytearray(read_size))
        fname, members = item
        try:
            return _check_file(fname, manifest.files[fname], members, rows, source, buf)
        finally:
            if done is not None:
                done(fname)

    results: Iterable
    if jobs > 1 and len(items) > 1:
        with ThreadPoolExecutor(min(jobs, len(items)), thread_name_prefix="ckptd-commit-check") as pool:
            results = list(pool.map(one, items))
    else:
        results = [one(it) for it in items]
    problems: list[_Problem] = []
    shas: dict[int, bytes] = {}
    nbytes = 0
    for p, s, n in results:
        problems += p
        shas.update(s)
        nbytes += n
    for members in groups:
        if len({shas.get(i) for i in members}) > 1:
            i = members[0]
            kind, name = rows.whats[rows.owner[i]]
            ranks = sorted({rows.rank[m] for m in members if rows.rank[m] is not None})
            files = sorted({rows.file[m] for m in members})
            problems.append(_Problem(IntegrityError, f"{kind} {name!r}: ranks {ranks} store one region as replicas "
                                     f"with digest {rows.xxh3[i]}, but their bytes differ (files {files})",
                                     {kind: name, "ranks": ranks, "file": files[0]}))
    _raise_first(problems)
    if adopted and stat is not None:
        _raise_first(_adopted_problems(adopted, stat))
    return nbytes

