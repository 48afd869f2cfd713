"""The service's own verification of committed checkpoints (docs/design.md §2 item 5).

``ckptd verify`` runs the one checker (:mod:`.checker`) in its own process; the service runs it
again after each commit (``CKPTD_VERIFY_AFTER_COMMIT``: a re-read of what reached the disk) or on
request (``POST .../verify``), in one of its worker processes (warm, at low priority), and records
the outcome as the checkpoint's verification record (:mod:`.records`). The checkpoint itself
(marker, manifest, data) is not touched.

Call order: :func:`verify_committed` checks and records in the calling process (``ckptd gc``
offline); the service submits :func:`verify_and_record` to a worker, :func:`check_share` for each
share of the re-read after a marker (:mod:`.rereads`, which stores :func:`compose_record`'s record),
and :func:`recheck_and_record` when a reader reports damaged bytes; conversions call
:func:`require_verified` on their source; a dry run :func:`verify_unrecorded`; readers
:func:`read_record`.
"""

from __future__ import annotations

import time
from datetime import datetime, timezone
from typing import Callable

from ckptd_schemas import (
    LATEST, CheckpointNotFound, CkptdError, CorruptCheckpoint, InvalidRequest, Manifest, StorageError,
)

from ckptd_schemas.readplan import ReadFn

from ..storage import Storage
from .tiers import open_root
from .checker import Findings, jobs_for, verify_manifest
from .paths import Committed, Paths, strays
from .records import MAX_PROBLEMS, Stray, VerifyRecord, known_bad, record_holds, record_of, stamps_of
from .session_reads import read_meta
from .visibility import Visibility

#: The parts of a checkpoint besides its data files that a load can find damaged and report.
DAMAGE_PARTS = ("marker", "manifest", "load tree")

__all__ = ["DAMAGE_PARTS", "VerifyRecord", "check_share", "compose_record", "load_tree_problem", "strays_of",
           "read_record", "recheck_and_record", "recheck_files", "require_verified", "verify_and_record",
           "verify_committed", "verify_unrecorded"]


def _committed_reads(storage: Storage, c: Committed, manifest: Manifest) -> ReadFn:
    """Reads as ``CheckpointReader.read_range`` does (``ckptd verify --root``): a file absent or of
    another size than the manifest says is :class:`CorruptCheckpoint`, so every verifier agrees."""
    def read(file: str, start: int, end: int) -> bytes:
        key, size = Paths.file(c.run, c.name, c.session, file), manifest.files[file].size
        storage.check_committed(key, size, file=file)
        return storage.read_committed(key, start, end, size, file=file)
    return read


def verify_committed(storage: Storage, run: str, name: str) -> VerifyRecord:
    """Verify the visible checkpoint ``run/name`` (``latest`` allowed) here, store the record, return it."""
    rec, c = _verify_here(storage, run, name)
    key = Paths.verification(c.run, c.name)
    storage.put(key, rec.model_dump_json().encode())
    if Visibility(storage).check(c.run, c.name) is None:  # deleted meanwhile (rm, gc): leave nothing behind
        storage.delete(key)
    return rec


def require_verified(storage: Storage, run: str, name: str) -> VerifyRecord:
    """The one checker's verdict on the visible checkpoint ``run/name`` before a conversion (reshard,
    export) reads it as a source: its record while that still vouches for exactly the stored bytes
    (usually the commit's own: no second read), else a verification now, recorded. Raises
    :class:`~ckptd_schemas.CorruptCheckpoint` naming the problems when the stored bytes are not what
    the manifest says, so nothing is converted from a checkpoint that ``ckptd verify`` rejects, even
    where the conversion itself would not read the damaged bytes."""
    vis = Visibility(storage)
    c = vis.resolve(run, name)
    rec = record_of(storage, c)
    if record_holds(storage, c, rec, sorted(vis.manifest(c).files)):
        return rec  # type: ignore[return-value]
    rec = verify_committed(storage, c.run, c.name)
    if not rec.ok:
        manifest = vis.manifest(c)
        named = [f for f in manifest.files if any(f"'{f}'" in p for p in rec.problems)]
        held = sorted({t.name for t in manifest.tensors for ch in t.chunks if ch.location.file in named})
        where = f" (tensors stored there: {', '.join(repr(n) for n in held[:8])}{' ...' if len(held) > 8 else ''})" \
            if held else ""
        raise CorruptCheckpoint(f"{c.ref} does not verify, so it is not converted: "
                                f"{'; '.join(rec.problems[:3]) or 'verification failed'}{where} "
                                f"(ckptd verify names every problem)", ref=c.ref, tensors=held[:64], files=named[:64])
    return rec


def load_tree_problem(vis: Visibility, c: Committed) -> str | None:
    """Why ``c``'s manifest does not have the load tree its marker names (loading ranks check their
    pieces against that root), or None: it has, or the marker names none. Every verification asks."""
    if c.marker.load_tree is None:
        return None
    try:
        vis.load_tree(c)
    except CorruptCheckpoint as e:
        return e.message
    return None


def verify_unrecorded(storage: Storage, run: str, name: str, progress: Callable[[int], None] | None = None,
                      vis: Visibility | None = None) -> VerifyRecord:
    """:func:`verify_committed` that writes nothing: what a dry run (``ckptd gc --dry-run``) and
    ``ckptd verify --root`` do (``progress``: bytes checked, as read; ``vis``: the caller's, whose
    parsed manifest and load tree are used again)."""
    return _verify_here(storage, run, name, vis=vis, progress=progress)[0]


def _verify_here(storage: Storage, run: str, name: str, files: list[str] | None = None,
                 vis: Visibility | None = None, progress: Callable[[int], None] | None = None,
                 tiling: bool = False) -> tuple[VerifyRecord, Committed]:
    """Check ``run/name``'s stored bytes (only ``files``'s, when given: the stamps are theirs, no strays
    are looked for, and the tensors' tiling only with ``tiling``) and its load tree; the record, not
    stored. ``vis``: the caller's, whose parsed manifest is used again."""
    vis = vis or Visibility(storage)
    t0 = time.perf_counter()
    c = vis.resolve(run, name)  # not visible: CheckpointNotFound, nothing recorded
    report = Findings(ref=c.ref)
    stamps: dict[str, str | None] = {}
    found: list[Stray] = []
    try:
        manifest = vis.manifest(c)
        names = sorted(files if files is not None else manifest.files)
        before = stamps_of(storage, c, names)
        report = verify_manifest(manifest, _committed_reads(storage, c, manifest),
                                 jobs=jobs_for(manifest, storage, lambda f: Paths.file(c.run, c.name, c.session, f)),
                                 storage_errors_are_problems=False, files=files, progress=progress,
                                 tiling=tiling)
        problem = load_tree_problem(vis, c)
        if problem is not None:
            report.problems.append(problem)
        if before == stamps_of(storage, c, names) and all(before.values()):
            stamps = before
        if files is None:
            found = strays_of(storage, c, manifest)
    except StorageError:
        raise  # the store failed, not the checkpoint: nothing is recorded (a failed record makes `latest` skip it)
    except CkptdError as e:  # a manifest changed under us: recorded as a failure too
        report.problems.append(e.message)
    rec = VerifyRecord(ref=c.ref, manifest_xxh3=c.digest, ok=report.ok, problems=report.problems[:MAX_PROBLEMS],
                       files=report.files, tensors=report.tensors, chunks=report.chunks,
                       bytes_read=report.bytes_read, seconds=time.perf_counter() - t0,
                       verified_at=datetime.now(timezone.utc), stamps={k: v for k, v in stamps.items() if v},
                       strays=found[:MAX_PROBLEMS])
    return rec, c


def strays_of(storage: Storage, c: Committed, manifest: Manifest) -> list[Stray]:
    """The files stored in ``c``'s directory that are no part of it (:func:`.paths.strays`): what a
    full verification reports beside its verdict, which they do not change."""
    meta = read_meta(storage, c.run, c.name, c.session)
    stored = dict(storage.walk(Paths.ckpt(c.run, c.name)))
    world = meta.world_size if meta is not None else manifest.topology.world_size
    return [Stray(key=k, size=stored[k]) for k in strays(stored, c, manifest.files, world)]


def verify_and_record(root: str, run: str, name: str) -> dict:
    """In a worker process: :func:`verify_committed` on the storage at ``root``; the record as a dict
    (it crosses the process boundary)."""
    return verify_committed(open_root(root), run, name).model_dump(mode="json")


def check_share(root: str, run: str, name: str, files: list[str], tiling: bool = False) -> dict:
    """In a worker process: one share of the re-read after a marker (:mod:`.rereads`): ``files`` of the
    visible checkpoint ``run/name`` read and checked by the one checker, with their stamps and the load
    tree, and (``tiling``: one share of each re-read) every tensor's tiling, as ``ckptd verify`` checks
    it; the share's record as a dict, not stored."""
    return _verify_here(open_root(root), run, name, files=files, tiling=tiling)[0].model_dump(mode="json")


def compose_record(parts: list[VerifyRecord], found: list[Stray]) -> VerifyRecord:
    """The one verification record of a checkpoint re-read in shares (:mod:`.rereads`), from the shares'
    records (every one, or, to record it known bad at once, those so far with one that failed): good
    only when every share was; their problems, bytes, reading time and stamps together."""
    problems = list(dict.fromkeys(p for part in parts for p in part.problems))  # the load tree's, once
    return parts[0].model_copy(update=dict(
        ok=all(p.ok for p in parts), problems=problems[:MAX_PROBLEMS], bytes_read=sum(p.bytes_read for p in parts),
        seconds=sum(p.seconds for p in parts), verified_at=datetime.now(timezone.utc), strays=found[:MAX_PROBLEMS],
        stamps={f: s for p in parts for f, s in p.stamps.items()}))


def recheck_files(storage: Storage, run: str, name: str, files: list[str], parts: list[str] = ()) -> dict:
    """A reader's report that ``files`` of the visible checkpoint ``run/name`` (a concrete name) hold
    damaged bytes, or that ``parts`` of it (:data:`DAMAGE_PARTS`: the load failed on its marker, its
    manifest or its load tree): the one checker reads those files again, and checks the metadata as
    every verification does (the manifest against its marker's digest, the load tree against its
    marker's root), whatever the report names. Damaged: a failed record is stored (so ``RUN/latest``
    skips the checkpoint from now on: an auto-resume that hit it does not hit it again), unless one is
    stored already. Intact: nothing is stored (a check of some files vouches for no checkpoint; a
    reader's word alone never marks one bad). Returns ``{"ref", "files", "parts", "damaged",
    "problems", "recorded", "latest"}``: ``latest`` is what ``RUN/latest`` resolves to now (None: nothing).

    Unknown files are refused (``InvalidRequest``) before anything is read."""
    vis = Visibility(storage)
    c = vis.check(run, name)
    if c is None:
        raise CheckpointNotFound(f"{run}/{name} is not a visible checkpoint", ref=f"{run}/{name}")
    unknown = sorted(set(files) - set(vis.manifest(c).files))
    if unknown:
        raise InvalidRequest(f"{c.ref} has no data file {unknown[0]!r}", ref=c.ref, file=unknown[0])
    already = known_bad(storage, c)
    recorded = False
    problems: list[str] = []
    if already is None:
        rec, _ = _verify_here(storage, c.run, c.name, files=sorted(set(files)), vis=vis)  # one manifest parse
        problems = rec.problems
        if not rec.ok:
            storage.put(Paths.verification(c.run, c.name), rec.model_dump_json().encode())
            recorded = True
    else:
        problems = [already]
    try:
        latest: str | None = vis.resolve_ref(run, LATEST)[0].name
    except CheckpointNotFound:
        latest = None
    return {"ref": c.ref, "files": sorted(set(files)), "parts": sorted(set(parts)), "damaged": bool(problems),
            "problems": problems[:8], "recorded": recorded, "latest": latest}


def recheck_and_record(root: str, run: str, name: str, files: list[str], parts: list[str] = ()) -> dict:
    """In a worker process: :func:`recheck_files` on the storage at ``root``."""
    return recheck_files(open_root(root), run, name, files, parts)


def read_record(storage: Storage, run: str, name: str) -> VerifyRecord | None:
    """The stored record of ``run/name`` (a resolved name, not ``latest``), if any, and only if it is
    about the manifest committed there (a record that does not parse counts as none)."""
    c = Visibility(storage).check(run, name)
    return record_of(storage, c) if c is not None else None
