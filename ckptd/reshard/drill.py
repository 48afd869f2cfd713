"""Conversion drills: prove that a committed checkpoint converts into other layouts, writing nothing but a record.

A drill of checkpoint ``RUN/NAME`` into layouts L1, L2... (``ckptd drill REF --to SPEC ...``, ``POST
/v1/drill``, or the service's policy ``CKPTD_DRILL_EVERY``) does, per layout, what ``ckptd reshard``
does up to its commit, and nothing after it:

1. **plan** the conversion (``plan_reshard``, the same pure planner); every layout is planned before
   anything is read, so a spec that does not parse, or a layout the checkpoint cannot take, is
   refused (:class:`InvalidRequest`) with no record written;
2. **run the reshard's own work units** (``executor.run_unit``: source byte ranges fetched and
   block-verified, each target chunk assembled on the host engine and hashed as the reshard writes it),
   a tensor at a time (its target chunks as one unit), into a **digest sink** that stores nothing
   (:class:`_DigestSink`), and combine the target's **layout-independent digest** from the parts the
   unit returns (``ckptd_schemas.digest.combine``), as the reshard's commit does. Memory: one target
   chunk and the fetches that fill it, and the ragged digest-block ends of the tensor's chunks (at most
   256 KiB a chunk); a tensor whose chunks are not row-major runs (``tp``'s row-parallel ``Shard(1)``
   boxes) is kept and placed whole into one buffer, so it holds that tensor's target bytes twice;
3. **check the target's geometry**: the tensor's target chunks tile its global shape exactly, replicas
   alike (``ckptd_schemas.geometry.check_tiling``, the commit's own rule);
4. **compare** with the source's digest: the one its manifest records (derived checkpoints), else
   the one combined from the verified source bytes the unit fetched (``SourcePieces``), else
   a walk over the stored tensor (``tensor_digest``).

No target file is written and no upload session opened. A damaged source byte, a target chunk that
fails the tiling, or a digest that differs is a **problem** naming the tensor and the layout; the
drill goes on with the other tensors and layouts. Only a storage failure (:class:`StorageError`)
stops it, and then nothing is recorded.

The outcome (:class:`DrillRecord`: per layout ``ok``, ``tensors``, ``bytes``, ``seconds``,
``problems``; the manifest digest drilled) is stored beside the checkpoint as ``runs/RUN/NAME/DRILL.json``
(``Paths.drill``), the only object a drill leaves; while it reads, its caller holds a lease on the
checkpoint (``leases/``, released at the end), so retention spares it. A record never changes what the checkpoint
is: ``RUN/latest`` and retention follow verification records (``VERIFIED.json``) only.

Call order: :func:`plan_drill` (pure), then :func:`drill_checkpoint` (per layout :func:`drill_plan`)
and :func:`write_record`; readers call :func:`read_record`. In the service a drill is a job
(``ckptd.reshard.jobs``), resumed by a live replica when its service stops (``ckptd.reshard.recovery``).
"""

from __future__ import annotations

import logging
import threading
import time
from bisect import bisect_right
from datetime import datetime, timezone
from math import prod
from typing import Any, Callable

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from ckptd_schemas import (
    ChecksumMismatch, CkptdError, InvalidRequest, Manifest, StorageError, TensorEntry, itemsize, parse_ref,
)
from ckptd_schemas.digest import DIGEST_BLOCK, StreamHasher, combine
from ckptd_schemas.format.engines import Engine, HostEngine
from ckptd_schemas.geometry import check_tiling

from ..storage import Storage
from ..store import CheckpointReader
from ..store.checker import StorageFiles, judge
from ..store.inflight import ordered_map
from ..store.paths import Paths
from .digest import tensor_digest
from .drill_layouts import check_layout, resolve_layout
from .executor import UnitResult, reader_of, run_unit
from .models import MAX_LAYOUTS
from .pieces import SourcePieces, target_place
from .planner import ALIGN, ReshardChunk, ReshardPlan, WorkUnit, plan_reshard

__all__ = ["MAX_PROBLEMS", "DrillProblem", "DrillRecord", "LayoutDrill", "drill_bytes", "drill_checkpoint",
           "drill_plan", "plan_drill", "read_record", "write_record"]

log = logging.getLogger("ckptd.reshard")

#: Problems kept per layout in a record (a count of the rest is the last one).
MAX_PROBLEMS = 100


class _M(BaseModel):
    model_config = ConfigDict(extra="forbid")


class DrillProblem(_M):
    layout: str = Field(description="the layout as asked (half, double, or a spec)")
    tensor: str | None = Field(None, description="the tensor concerned; None for a problem of the whole layout")
    message: str


class LayoutDrill(_M):
    layout: str = Field(description="the layout as asked (half, double, or a spec)")
    spec: str = Field(description="the layout spec it resolved to")
    ok: bool
    tensors: int = Field(description="tensors checked")
    bytes: int = Field(description="bytes of target chunks assembled (all of the target's when ok)")
    bytes_read: int = Field(description="bytes read from storage")
    seconds: float
    problems: list[DrillProblem] = []


class DrillRecord(_M):
    """What one drill of a committed checkpoint found (``runs/RUN/NAME/DRILL.json``)."""

    ref: str
    manifest_xxh3: str = Field(description="digest of the manifest drilled: the record is about that manifest only")
    ok: bool
    layouts: list[LayoutDrill]
    seconds: float
    drilled_at: datetime


# -- one layout -----------------------------------------------------------------------------------------

def plan_drill(manifest: Manifest, layouts: list[str]) -> list[tuple[str, ReshardPlan]]:
    """(layout as asked, its plan) for each of ``layouts``: every spec parsed and planned before any I/O;
    :class:`InvalidRequest` (with the grammar) for any that does not parse or that this checkpoint cannot
    take. Duplicates (after resolving half and double) are drilled once."""
    if not layouts:
        raise InvalidRequest("a drill needs at least one layout (--to SPEC)")
    if len(layouts) > MAX_LAYOUTS:
        raise InvalidRequest(f"a drill takes at most {MAX_LAYOUTS} layouts, not {len(layouts)}", layouts=len(layouts))
    asked = [check_layout(x) for x in layouts]  # every one parsed before any is planned
    out: dict[str, tuple[str, ReshardPlan]] = {}  # by the spec resolved
    for name in asked:
        spec = resolve_layout(name, manifest.topology)
        if str(spec) not in out:
            out[str(spec)] = (name, plan_reshard(manifest, spec))
    return list(out.values())


def drill_plan(reader: CheckpointReader, manifest: Manifest, layout: str, plan: ReshardPlan, *, jobs: int = 1,
               progress: Callable[[int], None] | None = None) -> LayoutDrill:
    """Run every unit of ``plan`` (the conversion of ``manifest`` into ``layout``) into a digest sink, a
    tensor at a time, and check each tensor against the source (module docstring); ``jobs`` tensors at a
    time. Writes nothing."""
    t0 = time.monotonic()
    chunks: dict[str, list[tuple[int, ReshardChunk]]] = {t.name: [] for t in manifest.tensors}
    for u in plan.units:  # planned from this manifest: every target chunk is of one of its tensors
        for pc in u.chunks:
            chunks[pc.tensor].append((u.rank, pc))
    engine = HostEngine()  # a drill does not cast: the host's numpy engine moves the bytes
    pieces = SourcePieces(manifest, (t.name for t in manifest.tensors if t.digest is None))
    source = StorageFiles(reader.storage, lambda file: Paths.file(manifest.run, manifest.name, manifest.session, file))
    read_source = reader_of(source.storage, source.key_of)

    lock, local = threading.Lock(), threading.local()  # local: each thread's buffers, reused tensor to tensor
    counts = [0, 0]  # bytes assembled, bytes read

    def advance(n: int) -> None:
        with lock:
            counts[0] += n
        if progress is not None:
            progress(n)

    def one(t: TensorEntry) -> DrillProblem | None:
        try:
            scratch = local.__dict__.setdefault("scratch", {})
            got, n_read = _target_digest(reader, plan, t, chunks[t.name], engine, pieces, read_source, advance,
                                         scratch)
            with lock:
                counts[1] += n_read
            want = t.digest or got.get("src") or tensor_digest(manifest, t, read_source)
            return None if got["dst"] == want else DrillProblem(layout=layout, tensor=t.name, message=(
                f"the assembled target's layout-independent digest {got['dst']} differs from the source's {want}"))
        except StorageError:
            raise  # the store failed, not the checkpoint: the drill stops, nothing is recorded
        except ChecksumMismatch as e:  # a fetch failed its block digests: whose bytes are damaged? The one checker
            # judges the files holding the tensor's chunks and names the damaged ones
            found = judge(manifest, source, files={c.location.file for c in t.chunks if c.location is not None})
            own = next((p.message for p in found.problems if p.details.get("tensor") == t.name), None)
            message = (f"its stored bytes are damaged: {own}" if own is not None else
                       f"a verification block it is read from is damaged "
                       f"({e.message.removeprefix(f'tensor {t.name!r} of {manifest.ref}: ')}), but its own chunks "
                       f"hash right: the damaged bytes are another tensor's")
            return DrillProblem(layout=layout, tensor=t.name, message=message)
        except CkptdError as e:
            return DrillProblem(layout=layout, tensor=t.name, message=e.message)
        except Exception as e:  # noqa: BLE001 - a bug the drill exists to find: named, not fatal
            log.exception("drill of %s into %s: tensor %s", manifest.ref, layout, t.name)
            return DrillProblem(layout=layout, tensor=t.name, message=f"internal error: {type(e).__name__}: {e}")

    problems = [p for p in ordered_map(one, manifest.tensors, jobs) if p is not None]
    if len(problems) > MAX_PROBLEMS:
        rest = len(problems) - MAX_PROBLEMS + 1
        problems = problems[:MAX_PROBLEMS - 1] + [DrillProblem(layout=layout, message=f"{rest} more problems")]
    return LayoutDrill(layout=layout, spec=plan.target_spec, ok=not problems, tensors=len(manifest.tensors),
                       bytes=counts[0], bytes_read=counts[1], seconds=round(time.monotonic() - t0, 3),
                       problems=problems)


class _DigestSink:
    """A drill's target file (``run_unit``'s ``open_file``), of one tensor: hashed by ``run_unit`` as it is
    written, stored nowhere. Kept: each write shorter than two digest blocks (``write_hashed`` cuts a chunk
    at its digest-block bounds, so these hold every ragged end its digest part refers to, which ``combine``
    reads back: at most 4 blocks a chunk); or, given a ``whole`` buffer of the file's size, every write, in
    it (the chunks are then placed, :func:`_placed_digest`)."""

    def __init__(self, whole: memoryview | None) -> None:
        self.whole, self.size, self.starts, self.pieces = whole, 0, [], []

    def write(self, data: memoryview | bytes) -> None:
        if self.whole is not None:
            self.whole[self.size:self.size + len(data)] = data
        elif len(data) < 2 * DIGEST_BLOCK:
            self.starts.append(self.size)
            self.pieces.append(bytes(data))
        self.size += len(data)

    def finish(self, expected: str | None = None) -> None:
        pass

    abort = finish

    def read(self, file: str, start: int, end: int) -> bytes:
        """Bytes [start, end) of the file from the writes kept (short where they leave a gap)."""
        i, out = max(0, bisect_right(self.starts, start) - 1), bytearray()
        while i < len(self.starts) and self.starts[i] <= start + len(out) < end:
            out += self.pieces[i][start + len(out) - self.starts[i]:end - self.starts[i]]
            i += 1
        return bytes(out)


def _target_digest(reader: CheckpointReader, plan: ReshardPlan, t: TensorEntry,
                   chunks: list[tuple[int, ReshardChunk]], engine: Engine, pieces: SourcePieces,
                   read_source: Callable[[str, int, int], bytes], progress: Callable[[int], None],
                   scratch: dict[str, Any]) -> tuple[dict[str, str], int]:
    """Tensor ``t``'s target chunks (with their ranks), laid out as one work unit of their own (each chunk
    padded to ``ALIGN``, as the planner lays a unit) and run by the reshard's own ``run_unit`` into a
    :class:`_DigestSink`: ({"dst": the target's layout-independent digest, "src": the source's where the
    verified fetches yielded it}, bytes read). Raises :class:`TilingError` when the chunks do not tile ``t``
    exactly (replicas, one region on several ranks, must hold the same bytes: the commit's rule)."""
    shape = list(t.shape)
    at, laid = 0, []
    for _, pc in chunks:
        laid.append(pc.model_copy(update={"file_offset": at}))
        at += pc.nbytes + (-pc.nbytes) % ALIGN
    runs = all(target_place(shape, pc.dtype, (pc.offsets, pc.sizes, pc.flat_start)) is not None
               for pc in laid if pc.numel)
    sink = _DigestSink(None if runs else memoryview(np.empty(at, dtype=np.uint8)))
    nbytes = itemsize(t.dtype) * prod(shape)
    r = run_unit(reader, plan, WorkUnit(index=0, rank=0, file="target", size=at, chunks=laid), lambda file: sink,
                 engine=engine, progress=progress, pieces=pieces, scratch=scratch)
    check_tiling(t.name, shape, [(c.region, rank, c.location.xxh3) for (rank, _), (_, c) in zip(chunks, r.chunks)])
    got = combine(r.digests, {("src", t.name): nbytes, ("dst", t.name): nbytes},
                  lambda side, file, a, b: (sink.read if side == "dst" else read_source)(file, a, b))
    if not runs:
        got[("dst", t.name)] = _placed_digest(shape, itemsize(t.dtype), r, sink.whole)
    return {side: v for (side, _), v in got.items()}, r.bytes_read


def _placed_digest(shape: list[int], isz: int, r: UnitResult, data: memoryview) -> str:
    """The digest of a tensor whose chunks are not all row-major runs: the chunks of unit result ``r`` (their
    bytes: the unit's file, ``data``) placed into one buffer of the tensor's row-major bytes, hashed."""
    whole = np.empty(isz * prod(shape), dtype=np.uint8)  # the chunks tile it: every byte is written
    rows = whole.reshape(*shape[:-1], shape[-1] * isz)  # a 0-d tensor is a run: never here
    src = np.frombuffer(data, dtype=np.uint8)
    for _, c in r.chunks:  # boxes: a flat range is one run
        raw = src[c.location.offset:c.location.offset + c.location.length]
        off, size = list(c.offsets), list(c.sizes)
        index = tuple(slice(o, o + s) for o, s in zip(off[:-1], size[:-1])) + (
            slice(off[-1] * isz, (off[-1] + size[-1]) * isz),)
        rows[index] = raw.reshape(*size[:-1], size[-1] * isz)
    h = StreamHasher()
    h.update(memoryview(whole))
    return h.hexdigest()


# -- one checkpoint ------------------------------------------------------------------------------------

def drill_checkpoint(storage: Storage, ref: str, layouts: list[str], *, jobs: int = 1,
                     start: Callable[[int], Callable[[int], None] | None] = lambda total: None,
                     record: bool = True) -> DrillRecord:
    """Drill the visible checkpoint ``ref`` into each of ``layouts`` and (``record``) store the record
    beside it. ``start(total)``: called once every layout is planned, with the bytes the drill will
    assemble; it returns the callback those bytes are counted to as they are. The caller holds a lease on
    ``ref`` meanwhile (so retention spares it): the job runner (``jobs.run_job``) or ``ckptd drill --root``."""
    t0 = time.monotonic()
    r = parse_ref(ref)
    reader = CheckpointReader(storage)
    c = reader.committed(r.run, r.name)  # not visible: CheckpointNotFound, nothing recorded
    manifest = reader.visibility.manifest(c)
    plans = plan_drill(manifest, layouts)
    progress = start(drill_bytes(plans))
    results = [drill_plan(reader, manifest, layout, plan, jobs=jobs, progress=progress) for layout, plan in plans]
    rec = DrillRecord(ref=c.ref, manifest_xxh3=c.digest, ok=all(x.ok for x in results), layouts=results,
                      seconds=round(time.monotonic() - t0, 3), drilled_at=datetime.now(timezone.utc))
    if record:
        write_record(storage, rec)
    return rec


def drill_bytes(plans: list[tuple[str, ReshardPlan]]) -> int:
    """The bytes of target chunks a drill of ``plans`` assembles."""
    return sum(pc.nbytes for _, p in plans for u in p.units for pc in u.chunks)


def write_record(storage: Storage, rec: DrillRecord) -> None:
    r = parse_ref(rec.ref)
    storage.put(Paths.drill(r.run, r.name), rec.model_dump_json().encode())


def read_record(storage: Storage, run: str, name: str) -> DrillRecord | None:
    """The stored drill record of the visible checkpoint ``run/name`` (``latest`` allowed), if there is one
    about the manifest committed there now (one about an earlier checkpoint under the name, or one that
    does not parse, counts as none). :class:`CheckpointNotFound` when the checkpoint is not visible."""
    c = CheckpointReader(storage).committed(run, name)
    raw = storage.read_or_none(Paths.drill(c.run, c.name))
    if raw is None or len(raw) > 4 << 20:
        return None
    try:
        rec = DrillRecord.model_validate_json(raw)
    except ValidationError:
        return None
    return rec if rec.manifest_xxh3 == c.digest else None

