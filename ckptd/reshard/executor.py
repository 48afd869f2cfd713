"""The reshard executor: runs a plan's work units with bounded memory, then commits.

Call order (``run_plan`` does all of it; ``ckptd reshard-worker`` does steps 0
and 2 for one unit):

0. ``plan_device`` / ``plan_engine``: where chunks are assembled. ``--device
   auto`` runs on the CPU unless the plan casts enough bytes for the GPU to
   pay for its start-up (:func:`choose_device`, :data:`GPU_CAST_MIN_BYTES`).
1. ``open_target``: open an upload session for the output ref (``derived_from``
   the source), exactly as a trainer save does.
2. ``run_unit`` per work unit, in any order or process: for each target chunk,
   fetch its source byte ranges (block digests verified), assemble it on the
   chosen device (cast there if asked), stream it into the unit's target file.
   Memory held: one target chunk plus the fetches that fill it. A drill
   (``ckptd.reshard.drill``) runs the same units into a sink that stores
   nothing (``open_file``: the session's files, or a digest sink).
3. ``finalize``: build each target rank's index, and compare every tensor's
   layout-independent digest on the source and on the target; any difference
   aborts the session (nothing becomes visible). Otherwise the indexes go in
   and the output commits through the normal protocol.

The digests come from bytes step 2 already holds: each unit hashes the
verified source bytes it fetched and the target chunks it wrote, in 64 KiB
blocks (``ckptd_schemas.digest``), and returns the block values with its
result; ``finalize`` only reads the ragged ends of pieces. Tensors whose
chunks are not row-major runs (column shards) or whose source must be cast
are hashed by walking the stored data instead.

Memory traffic, the cost besides the disk: :func:`run_unit` allocates its buffers once, and
``write_hashed`` hashes each slice for every digest while it is in cache.
"""

from __future__ import annotations

import logging
import multiprocessing
import threading
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from functools import partial
from math import prod
from typing import Any, Callable, Literal

from pydantic import BaseModel, ConfigDict

from ckptd_schemas import (
    BoxChunk, CheckpointNotFound, Chunk, CkptdError, Conflict, Fetch, FlatChunk, IntegrityError, InvalidRequest,
    Location, Manifest, ObjectEntry, OpenSession, RankIndex, TensorEntry, itemsize, parse_ref,
    run_fetches,
)
from ckptd_schemas.digest import DigestPart, combine, digest_piece

from ..store import CheckpointReader, SessionStore
from ..store.inflight import ordered_map
from ..store.reader import naming_tensor
from ..store.paths import Paths
from ..store.verification import require_verified
from ..store.merge import merge_indexes
from .digest import tensor_digest
from ckptd_schemas.format.engines import Engine, cuda_present, pick_engine
from ..store.intake import recorded_file
from .pieces import SourcePieces, target_place, write_hashed
from .planner import (
    ALIGN, ReshardChunk, ReshardOutline, ReshardPlan, UnitCut, WorkUnit, already_read, cast_dtype, kept_block,
    outline_reshard,
)
from .spec import parse_spec

__all__ = ["GPU_CAST_MIN_BYTES", "PROCESS_MIN_CHUNKS", "DeviceChoice", "ReshardResult", "Throttle", "UnitResult",
           "cast_bytes", "choose_device", "finalize", "open_target", "outline_again", "plan_device", "plan_engine",
           "reader_of", "run_plan", "run_share", "run_unit", "source_pieces"]

log = logging.getLogger("ckptd.reshard")
_PAD = bytes(ALIGN)

#: Source bytes a plan must cast (``--dtype``) before ``--device auto`` runs it on the GPU; below, or
#: without a cast, ``auto`` runs it on the CPU. Without a cast the GPU's engine only moves bytes, as fast
#: as the CPU's, and its start-up (torch import, CUDA context) is pure cost; with one, the saving grows
#: with the bytes and the start-up does not. 4 GiB is the one cast measured where the GPU won as a whole
#: process (BENCHMARKS.md, Figures behind the code); ``python -m bench.gpu`` reports
#: ``reshard_gpu_break_even_cast_bytes`` on a GPU: set this from it.
GPU_CAST_MIN_BYTES = 4 << 30

Device = Literal["cpu", "cuda"]


@dataclass(frozen=True)
class DeviceChoice:
    """Where a plan's chunks are assembled and cast, and why (printed by ``ckptd reshard``, recorded in
    service job results)."""
    device: Device
    reason: str
    cast_bytes: int = 0


def cast_bytes(plan: ReshardOutline) -> int:
    """The source bytes ``plan`` converts to another dtype (0 without ``--dtype``)."""
    return sum(tc.numel * itemsize(src) for c in plan.cuts for tc, src, dtype, _, _ in c.chunks if src != dtype)


def choose_device(requested: str, cast: int, cuda: Callable[[], bool]) -> DeviceChoice:
    """The one rule for ``--device`` (the CLI, service jobs and ``reshard-worker`` pods all come here).

    ``cpu`` and ``cuda`` are taken as asked (``cuda`` without a GPU is refused later, by ``pick_engine``).
    ``auto`` picks the GPU only when ``cast`` (source bytes to convert) reaches :data:`GPU_CAST_MIN_BYTES`
    and a CUDA device is present; ``cuda`` is called only then: probing for a GPU may import torch.
    """
    if requested not in ("auto", "cpu", "cuda"):
        raise InvalidRequest(f"device must be auto, cpu or cuda, not {requested!r}", device=requested)
    if requested != "auto":
        return DeviceChoice(requested, f"--device {requested}", cast)  # type: ignore[arg-type]
    if cast == 0:
        return DeviceChoice("cpu", "auto: no dtype cast, the GPU buys nothing", 0)
    size = f"{cast / 2**30:.2f} GiB" if cast >= 2**30 // 100 else f"{cast / 2**20:.2f} MiB"
    least = f"{GPU_CAST_MIN_BYTES / 2**30:g} GiB"
    if cast < GPU_CAST_MIN_BYTES:
        return DeviceChoice("cpu", f"auto: {size} to cast, under the {least} at which the GPU pays for its "
                                   f"start-up", cast)
    if not cuda():
        return DeviceChoice("cpu", f"auto: {size} to cast, but no CUDA device", cast)
    return DeviceChoice("cuda", f"auto: {size} to cast, at least the {least} at which the GPU pays for its start-up",
                        cast)


def plan_device(plan: ReshardOutline, device: str) -> DeviceChoice:
    """:func:`choose_device` for ``plan`` on this machine."""
    return choose_device(device, cast_bytes(plan), cuda_present)


def plan_engine(plan: ReshardOutline, device: "str | DeviceChoice") -> Engine:
    """The engine for ``plan`` on ``device`` (``auto``, ``cpu``, ``cuda``, or a choice already made): torch
    where the plan casts or on the GPU, the host's numpy otherwise."""
    choice = device if isinstance(device, DeviceChoice) else plan_device(plan, device)
    return pick_engine(choice.device, casts=plan.header["dtype"] is not None)


class UnitResult(BaseModel):
    model_config = ConfigDict(extra="forbid")
    index: int
    rank: int
    file: str
    chunks: list[tuple[str, Chunk]]
    bytes_read: int
    bytes_written: int
    digests: list[DigestPart] = []


@dataclass
class ReshardResult:
    ref: str
    manifest_xxh3: str
    units: int
    bytes_read: int
    bytes_written: int
    seconds: float
    device: str = ""  # where the chunks were assembled: cpu or cuda
    reason: str = ""  # why (DeviceChoice.reason)
    engine: str = ""  # host (numpy), torch-cpu or torch-cuda
    processes: int = 1  # processes that shared the units (run_plan: threads of one process when 1)

    def as_json(self) -> dict[str, Any]:
        """The result as a job records it and ``ckptd reshard`` prints it, either way in: with the engine
        that ran and why (:func:`choose_device`)."""
        return {"ref": self.ref, "manifest_xxh3": self.manifest_xxh3, "units": self.units,
                "bytes_read": self.bytes_read, "bytes_written": self.bytes_written, "seconds": round(self.seconds, 3),
                "processes": self.processes, "engine": {"device": self.device, "reason": self.reason,
                                                        "impl": self.engine}}


def open_target(sessions: SessionStore, plan: ReshardPlan, out_ref: str, session: str) -> None:
    r = parse_ref(out_ref)  # the run and name are checked by the session's open
    sessions.open(r.run, r.name, OpenSession(session=session, world_size=plan.world_size, step=plan.source_step,
                                             derived_from=plan.source))


def source_pieces(reader: CheckpointReader, plan: ReshardPlan) -> SourcePieces:
    """The source tensors whose digests the units compute as they read (``run_unit``'s ``pieces``)."""
    src = parse_ref(plan.source)
    m = reader.manifest(src.run, src.name)
    return SourcePieces(m, (t.name for t in m.tensors if t.digest is None and not _cast(plan, t.dtype)))


def _cast(plan: ReshardPlan, dtype: str) -> bool:
    return cast_dtype(dtype, plan.dtype) != dtype


def run_unit(reader: CheckpointReader, plan: ReshardPlan, unit: WorkUnit, open_file: Callable[[str], Any], *,
             engine: Engine, progress: Callable[[int], None] | None = None, pieces: SourcePieces | None = None,
             scratch: dict[str, Any] | None = None) -> UnitResult:
    """Fill ``unit``'s target chunks one at a time from their source byte ranges (each fetch block-verified:
    a damaged one raises naming the tensor) and write them into ``open_file(unit.file)``: a file sink
    (``size``, ``write``, ``finish``, ``abort``), the output session's (``SessionStore.intake.receive``) or a
    drill's digest sink. The buffers are allocated once, at the largest size the chunks need; a caller that
    runs many units keeps them in ``scratch``. The result holds the source tensors' digest parts
    (``pieces``) seen in the fetches and the target chunks' parts."""
    pieces = pieces or source_pieces(reader, plan)
    src = parse_ref(plan.source)
    fetch_bytes, chunk_bytes = _largest(unit.chunks)
    scratch = {} if scratch is None else scratch  # what a caller keeps unit to unit (the buffers grow as needed)
    if not scratch:
        scratch.update(fetches=_Fetches(reader, src.run, src.name, fetch_bytes), staging=engine.buffer(chunk_bytes),
                       shapes={t.name: t.shape for t in reader.manifest(src.run, src.name).tensors})
    fetches, staging, shapes = scratch["fetches"], scratch["staging"], scratch["shapes"]
    parts: list[DigestPart] = []
    whole: set[tuple[str, int]] = set()  # source chunks already in ``parts`` whole
    bytes_read = [0]

    def read(f: Fetch) -> memoryview:
        data, n_read = fetches.get(f)
        bytes_read[0] += n_read
        return data

    def fetched(f: Fetch, data: memoryview) -> None:
        parts.extend(pieces.parts(f.file, f.start, data, whole))

    sink = open_file(unit.file)
    chunks: list[tuple[str, Chunk]] = []
    try:
        for pc in unit.chunks:
            shape = shapes[pc.tensor]
            staging.begin(pc.src_dtype, pc.numel, shape, sizes=pc.sizes, offsets=pc.offsets, flat_start=pc.flat_start)
            with naming_tensor(pc.tensor, plan.source):  # a damaged fetch raises naming the tensor
                run_fetches(pc.reads, read, staging.copy, fetched)
            raw = staging.result(pc.dtype)
            assert sink.size == pc.file_offset, "work unit layout out of step with the plan"
            place = target_place(shape, pc.dtype, (pc.offsets, pc.sizes, pc.flat_start))
            xxh3, values = write_hashed(sink.write, raw, place)
            pad = (-len(raw)) % ALIGN
            if pad:
                sink.write(_PAD[:pad])
            loc = Location(file=unit.file, offset=pc.file_offset, length=len(raw), raw_length=len(raw), xxh3=xxh3)
            if place is not None:
                parts.append(digest_piece("dst", pc.tensor, place[1], place[0], raw, file=unit.file,
                                          file_offset=pc.file_offset, values=values))
            if pc.sizes is not None:
                chunk: Chunk = BoxChunk(rank=unit.rank, offsets=pc.offsets, sizes=pc.sizes, location=loc)
            else:
                chunk = FlatChunk(rank=unit.rank, start=pc.flat_start, length=pc.flat_length, location=loc)
            chunks.append((pc.tensor, chunk))
            if progress:
                progress(pc.nbytes)
        sink.finish(None)
    except BaseException:
        sink.abort()
        raise
    return UnitResult(index=unit.index, rank=unit.rank, file=unit.file, chunks=chunks, bytes_read=bytes_read[0],
                      bytes_written=unit.size, digests=parts)


def _largest(chunks: list[ReshardChunk]) -> tuple[int, int]:
    """(largest fetch, largest target chunk before any cast, at least 1) of a unit's chunks: its buffers are
    allocated once at these sizes, not grown chunk by chunk (each growth faults in fresh pages)."""
    fetch = max((f.end - f.start for pc in chunks for f in pc.reads.fetches), default=0)
    chunk = max((pc.numel * itemsize(pc.src_dtype) for pc in chunks), default=0)
    return fetch, max(chunk, 1)


class _Tail:
    """The last block of a file's previous fetch: where it starts, how long, and a buffer reused for it."""

    def __init__(self, block_size: int) -> None:
        self.start, self.length, self.buf = 0, 0, bytearray(block_size)

    def keep(self, start: int, data: memoryview) -> None:
        if len(self.buf) < len(data):
            self.buf = bytearray(len(data))
        self.buf[:len(data)] = data
        self.start, self.length = start, len(data)


class _Fetches:
    """Source byte ranges for one work unit, read into one buffer allocated once (``size``: the unit's largest
    fetch), so no fetch faults in fresh pages.

    Fetches are whole verification blocks, so neighbouring target chunks taken
    from one source file share the block at their boundary: the last block of
    each file's previous fetch is kept and copied, not read again (the caller
    verifies every fetch before using it, so a kept block was verified once and
    is verified again as part of the new fetch). ``get`` returns (the fetched
    bytes, a view valid until the next ``get``; bytes read from storage).
    """

    def __init__(self, reader: CheckpointReader, run: str, name: str, size: int) -> None:
        self.reader, self.run, self.name = reader, run, name
        self.buf = bytearray(size)
        self.tails: dict[str, _Tail] = {}  # file -> its last fetched block

    def get(self, f: Fetch) -> tuple[memoryview, int]:
        start, end = f.start, f.end
        key, size = self.reader.file_key(self.run, self.name, f.file)
        if not 0 <= start <= end <= size:
            raise CheckpointNotFound(f"byte range [{start}, {end}) outside file {f.file!r} of {size} bytes",
                                     file=f.file)
        if len(self.buf) < end - start:  # only for a fetch the unit did not announce
            self.buf = bytearray(end - start)
        view = memoryview(self.buf)[:end - start]
        tail = self.tails.get(f.file)
        have = already_read((tail.start, tail.start + tail.length) if tail is not None else None, start, end)
        if have:
            view[:have] = memoryview(tail.buf)[start - tail.start:start - tail.start + have]
        got = len(view) - have
        if got:  # all of it, or CorruptCheckpoint: the file is absent, resized or short on storage
            self.reader.storage.read_committed_into(key, start + have, view[have:], size, file=f.file)
        k0, _ = kept_block(start, end, f.block_size)
        if f.file not in self.tails:
            self.tails[f.file] = _Tail(f.block_size)
        self.tails[f.file].keep(k0, view[k0 - start:])
        return view, got


def _indexes(plan: ReshardPlan, source: Manifest, results: list[UnitResult],
             objects: list[ObjectEntry], objects_file: str | None) -> list[RankIndex]:
    by_rank: dict[int, dict[str, list[Chunk]]] = {r: {} for r in range(plan.world_size)}
    files: dict[int, list[str]] = {r: [] for r in range(plan.world_size)}
    for res in sorted(results, key=lambda r: r.index):
        files[res.rank].append(res.file)
        for name, chunk in res.chunks:
            by_rank[res.rank].setdefault(name, []).append(chunk)
    if objects_file is not None:
        files[0].append(objects_file)
    out = []
    for r in range(plan.world_size):
        tensors = []
        for t in source.tensors:
            chunks = by_rank[r].get(t.name)
            if chunks is None and r != 0:  # rank 0 declares every tensor: the manifest keeps source order
                continue
            tensors.append(TensorEntry(name=t.name, shape=t.shape, dtype=cast_dtype(t.dtype, plan.dtype),
                                       group=t.group, chunks=chunks or [], placement=plan.placements.get(t.name)))
        out.append(RankIndex(rank=r, world_size=plan.world_size, coords=plan.coords[r] if plan.coords else {},
                             mesh=plan.mesh, layouts=plan.group_layouts, tensors=tensors,
                             objects=objects if r == 0 else [],
                             param_groups=source.param_groups if r == 0 else [], files=files[r]))
    return out


def _copy_objects(reader: CheckpointReader, sessions: SessionStore, source: Manifest, out_ref: str,
                  session: str, world: int) -> tuple[list[ObjectEntry], str | None]:
    """Carry objects over: global ones stay global; per-rank ones keep their rank if it exists."""
    keep = [o for o in source.objects if o.rank is None or o.rank < world]
    if all(o.location is None for o in keep):
        return keep, None
    out = parse_ref(out_ref)
    fname = "objects.bin"
    sink = sessions.intake.receive(out.run, out.name, session, fname)
    moved: list[ObjectEntry] = []
    try:
        for o in keep:
            if o.location is None:
                moved.append(o)
                continue
            data = o.checked(reader.read_range(source.run, source.name, o.location.file, o.location.offset,
                                               o.location.offset + o.location.length), source.ref)
            loc = o.location.model_copy(update={"file": fname, "offset": sink.size})
            sink.write(data)
            pad = (-len(data)) % ALIGN
            if pad:
                sink.write(_PAD[:pad])
            moved.append(o.model_copy(update={"location": loc}))
        sink.finish(None)
    except BaseException:
        sink.abort()
        raise
    return moved, fname


def _digests(todo: list[tuple[str, Manifest, TensorEntry, Callable[[str, int, int], bytes], str | None]],
             jobs: int) -> dict[tuple[str, str], str]:
    """Layout-independent digests of (side, manifest, tensor, read, cast) items, ``jobs`` tensors at a time."""
    values = ordered_map(lambda item: tensor_digest(item[1], item[2], item[3], cast=item[4]), todo, jobs)
    return {(side, t.name): v for (side, _, t, _, _), v in zip(todo, values)}


def reader_of(storage: object, key_of: Callable[[str], str]) -> Callable[[str, int, int], bytearray]:
    """``read(file, start, end)``: the stored bytes of ``file`` (at ``key_of(file)``), short at its end."""
    def read(file: str, start: int, end: int) -> bytearray:
        buf = bytearray(end - start)
        got = storage.read_into(key_of(file), start, memoryview(buf))
        return buf if got == len(buf) else buf[:got]
    return read


def finalize(reader: CheckpointReader, sessions: SessionStore, plan: ReshardPlan, results: list[UnitResult],
             out_ref: str, session: str, *, jobs: int = 1) -> str:
    """Check digests source vs target (``jobs`` tensors at a time), then send the indexes (the last one
    commits)."""
    src = parse_ref(plan.source)
    out = parse_ref(out_ref)
    source = reader.manifest(src.run, src.name)
    objects, objects_file = _copy_objects(reader, sessions, source, out_ref, session, plan.world_size)
    indexes = _indexes(plan, source, results, objects, objects_file)
    files = {}
    for ix in indexes:
        for f in ix.files:
            entry = recorded_file(sessions.storage, out.run, out.name, session, f)
            if entry is None:
                raise IntegrityError(f"target file {f!r} of {out_ref} was not written", file=f)
            files[f] = entry
    target = merge_indexes(run=out.run, name=out.name, session=session, step=plan.source_step,
                           created_at=source.created_at, world_size=plan.world_size, indexes=indexes, files=files,
                           derived_from=plan.source)
    read_target = reader_of(sessions.storage, lambda file: Paths.file(out.run, out.name, session, file))
    src_keys = {f: Paths.file(source.run, source.name, source.session, f) for f in source.files}
    read_source = reader_of(reader.storage, lambda file: src_keys[file])

    want = {t.name: t.digest for t in source.tensors if t.digest is not None and not _cast(plan, t.dtype)}
    sizes = {("src", t.name): itemsize(t.dtype) * prod(t.shape) for t in source.tensors
             if t.name not in want and not _cast(plan, t.dtype)}
    sizes.update({("dst", t.name): itemsize(t.dtype) * prod(t.shape) for t in target.tensors})
    reads = {"src": read_source, "dst": read_target}
    digests = combine((p for r in results for p in r.digests), sizes,
                      lambda side, file, a, b: reads[side](file, a, b))
    todo = [("src", source, t, read_source, plan.dtype) for t in source.tensors
            if t.name not in want and ("src", t.name) not in digests]
    todo += [("dst", target, t, read_target, None) for t in target.tensors if ("dst", t.name) not in digests]
    digests.update(_digests(todo, jobs))
    want.update({name: v for (side, name), v in digests.items() if side == "src"})
    got = {name: v for (side, name), v in digests.items() if side == "dst"}
    bad = sorted(n for n in want if got.get(n) != want[n])
    if bad:
        sessions.sweeper.abort(out.run, out.name, session)
        raise IntegrityError(f"reshard {plan.source} -> {plan.target_spec}: digests differ for {len(bad)} tensors "
                             f"({bad[:5]}); the output was discarded", tensors=bad[:64])
    digest = ""
    for ix in indexes:
        ix = ix.model_copy(update={"tensors": [t.model_copy(update={"digest": got[t.name]}) for t in ix.tensors]})
        status = sessions.put_index(out.run, out.name, session, ix)
        digest = status.manifest_xxh3 or digest
    return digest


#: Target chunks from which :func:`run_plan` runs an outline's shares in ``jobs`` processes rather than
#: threads. A target chunk costs about 0.7 ms of Python (planning its reads, fetching, verifying,
#: assembling, hashing and writing it), so threads share one core; a spawned process costs about 0.6 s
#: (start-up, a manifest read, a cut of every unit again). Measured, 2 jobs, fsdp2 R x 200 -> R/2 on 2
#: vCPUs: 3,200 target chunks 2.3 s in threads, 1.8 s in processes; 12,800: 10.4 s, 7.7 s; 102,400:
#: 96.9 s, 70.3 s.
PROCESS_MIN_CHUNKS = 2_000


def run_plan(reader: CheckpointReader, sessions: SessionStore, plan: ReshardOutline, out_ref: str, session: str, *,
             device: str = "auto", jobs: int = 1, progress: Callable[[int], None] | None = None,
             engine: Engine | None = None, max_bytes_per_s: float = 0.0,
             processes: bool | None = None) -> ReshardResult:
    """Run every unit of ``plan`` (``jobs`` at a time) and commit ``out_ref``; on any error the output
    session is aborted. Each unit's reads are planned by whoever runs it, as it starts
    it: the run holds the reads of ``jobs`` units at a time, not the whole job's; from
    :data:`PROCESS_MIN_CHUNKS` target chunks (or with ``processes=True``), ``jobs`` spawned processes
    share its units (``i % jobs``), each cutting them again from the source and converting its share.
    ``max_bytes_per_s`` caps the run's I/O (0: none), split evenly over its processes; ``progress`` gets
    the bytes written as they are. ``engine`` overrides the one ``device`` picks (tests run torch on the
    CPU; threads only); the result names the engine and why it ran (:func:`choose_device`)."""
    t0 = time.monotonic()
    shares = min(jobs, len(plan.cuts)) if engine is None and (
        processes if processes is not None else plan.chunks >= PROCESS_MIN_CHUNKS) else 1
    if engine is None:
        choice = plan_device(plan, device)
        engine = plan_engine(plan, choice)
    else:
        choice = DeviceChoice("cuda" if "cuda" in engine.name else "cpu", "engine given by the caller")
    header = plan.plan(reads=False)
    src = parse_ref(header.source)
    require_verified(reader.storage, src.run, src.name)  # the one checker's verdict on the source first
    open_target(sessions, header, out_ref, session)
    out = parse_ref(out_ref)
    try:
        with sessions.activity.held(out.run, out.name, session):  # a unit may take minutes between writes
            if shares > 1:
                results = _in_processes(reader.storage.url, plan, out_ref, session, choice.device, shares,
                                        max_bytes_per_s, progress)
            else:
                results = run_share(reader, sessions, plan, 0, 1, out_ref, session, engine=engine,
                                    progress=Throttle(max_bytes_per_s, progress).spend, jobs=jobs)
            digest = finalize(reader, sessions, header, results, out_ref, session, jobs=jobs)
    except BaseException:
        try:
            if sessions.status(out.run, out.name, session).state != "committed":
                sessions.sweeper.abort(out.run, out.name, session)
        except Exception:  # noqa: BLE001 - best effort cleanup; the session stays invisible anyway
            pass
        raise
    return ReshardResult(ref=out_ref, manifest_xxh3=digest, units=len(plan.cuts),
                         bytes_read=sum(r.bytes_read for r in results),
                         bytes_written=sum(r.bytes_written for r in results), seconds=time.monotonic() - t0,
                         device=choice.device, reason=choice.reason, engine=engine.name, processes=shares)


def outline_again(reader: CheckpointReader, source: str, session: str, to: str, dtype: str | None,
                  min_units: int, file_bytes: int = 1 << 30) -> ReshardOutline:
    """A job's units cut again where they run, from the same source checkpoint (its session checked: a
    name deleted and committed again is another checkpoint, and the job refuses it)."""
    src = parse_ref(source)
    manifest = reader.manifest(src.run, src.name)
    if manifest.session != session:
        raise Conflict(f"reshard source {source} is another checkpoint (session {manifest.session}) than the job "
                       f"was planned from (session {session})", ref=source)
    return outline_reshard(manifest, parse_spec(to), dtype=dtype, min_units=min_units, file_bytes=file_bytes)


class Throttle:
    """Token bucket: conversion I/O never exceeds ``rate`` bytes/s (0 = unlimited); ``spend`` then passes
    the bytes on to ``progress``."""

    def __init__(self, rate: float, progress: Callable[[int], None] | None = None) -> None:
        self.rate, self.progress = rate, progress
        self.t0 = time.monotonic()
        self.spent = 0
        self._lock = threading.Lock()

    def spend(self, n: int) -> None:
        if self.rate > 0:
            with self._lock:
                self.spent += n
                ahead = self.spent / self.rate - (time.monotonic() - self.t0)
            if ahead > 0:
                time.sleep(ahead)
        if self.progress is not None:
            self.progress(n)


def _in_processes(root: str, outline: ReshardOutline, out_ref: str, session: str, device: str, shares: int,
                  max_bytes_per_s: float, progress: Callable[[int], None] | None) -> list[UnitResult]:
    """Every unit of ``outline``, converted by ``shares`` spawned processes (:func:`_run_share`); the bytes
    they write reach ``progress`` through a queue as they go."""
    ctx = multiprocessing.get_context("spawn")
    written = ctx.Queue()

    def relay() -> None:
        while (n := written.get()) is not None:
            if progress is not None:
                progress(n)

    relayer = threading.Thread(target=relay, name="ckptd-reshard-progress", daemon=True)
    relayer.start()
    h = outline.header
    job = (root, h["source"], h["source_session"], h["target_spec"], h["dtype"], outline.min_units,
           outline.file_bytes, len(outline.cuts), out_ref, session, device, max_bytes_per_s / shares)
    try:
        with ProcessPoolExecutor(shares, mp_context=ctx, initializer=_share_started, initargs=(written,)) as pool:
            futures = [pool.submit(_run_share, *job, i, shares) for i in range(shares)]
            return [r for f in futures for r in f.result()]
    finally:
        written.put(None)
        relayer.join()


_WRITTEN: Any = None  # in a share's process: the queue its bytes written go to


def _share_started(written: Any) -> None:
    global _WRITTEN
    _WRITTEN = written


def _run_share(root: str, source: str, source_session: str, to: str, dtype: str | None, min_units: int,
               file_bytes: int, units: int, out_ref: str, session: str, device: str, rate: float, share: int,
               shares: int) -> list[UnitResult]:
    """Body of a share's process: cut the units again, plan and convert those ``i % shares == share``."""
    from ..store.tiers import open_root

    storage = open_root(root)
    reader, sessions = CheckpointReader(storage), SessionStore(storage)
    outline = outline_again(reader, source, source_session, to, dtype, min_units, file_bytes)
    if len(outline.cuts) != units:
        raise CkptdError(f"reshard {source} -> {to}: share {share} cut {len(outline.cuts)} units, not {units}")
    return run_share(reader, sessions, outline, share, shares, out_ref, session,
                     engine=plan_engine(outline, device), progress=Throttle(rate, _WRITTEN.put).spend)


def run_share(reader: CheckpointReader, sessions: SessionStore, outline: ReshardOutline, share: int, shares: int,
              out_ref: str, session: str, *, engine: Engine, progress: Callable[[int], None] | None = None,
              jobs: int = 1) -> list[UnitResult]:
    """The units ``i % shares == share`` of ``outline``, each planned as it starts and converted into the
    open session, ``jobs`` at a time (the threads of :func:`run_plan`, a share's process, a ``ckptd
    reshard-worker`` pod): the reads of ``jobs`` units held at a time."""
    header = outline.plan(reads=False)
    pieces = source_pieces(reader, header)
    out = parse_ref(out_ref)
    open_file = partial(sessions.intake.receive, out.run, out.name, session)

    def unit(cut: UnitCut) -> UnitResult:
        return run_unit(reader, header, outline.unit(cut), open_file, engine=engine, progress=progress,
                        pieces=pieces)

    with engine.running():
        return list(ordered_map(unit, outline.share_of(share, shares), jobs))
