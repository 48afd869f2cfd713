"""Conversion drills: prove that a committed checkpoint converts into other layouts, writing nothing but a record.

A drill of checkpoint ``RUN/NAME`` into layouts L1, L2... (``ckptd drill REF --to SPEC ...``, ``POST
/v1/drill``, or the service's policy ``CKPTD_DRILL_EVERY``) does, per layout, what ``ckptd reshard``
does up to its commit, and nothing after it:

1. **plan** the conversion (``plan_reshard``, the same pure planner); every layout is planned before
   anything is read, so a spec that does not parse, or a layout the checkpoint cannot take, is
   refused (:class:`InvalidRequest`) with no record written;
2. **check the target's geometry**: each tensor's target chunks tile its global shape exactly
   (``ckptd_schemas.geometry.check_tiling``, the commit's own rule);
3. **assemble every target chunk** with the executor's reading half (:class:`~.executor.ChunkAssembler`:
   source byte ranges fetched and block-verified, copied into the chunk on the host engine), tensor by
   tensor, and hash the assembled target into its **layout-independent digest**
   (``ckptd_schemas.digest``): chunks that are row-major runs (``full``, ``fsdp2``, ``zero*``,
   ``owner``, ``pp``, ``replicate``) in stream order through one ``StreamHasher``, so memory stays at
   one target chunk plus the fetches that fill it; a tensor with other chunks (``tp``'s row-parallel
   ``Shard(1)`` boxes) is placed whole into one buffer first, so it holds that tensor's bytes;
4. **compare** with the source's digest: the one its manifest records (derived checkpoints), else
   the one computed from the verified source bytes the chunks were read from (``SourcePieces``), else
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
and :func:`write_record`; readers call :func:`read_record`. In the service a drill is a job like a
reshard job (``ckptd.reshard.jobs``: ``submit_drill``, then the one runner ``run_job`` in the worker
pool, one record ``jobs/<id>.json`` of kind ``drill``); a drill job cut by a stop of its service is
resumed by a live replica (``ckptd.reshard.recovery``): a drill only reads and writes its record, so
running it again is harmless.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timezone
from typing import Callable

import numpy as np
import xxhash
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from ckptd_schemas import (
    ChecksumMismatch, CkptdError, InvalidRequest, Manifest, StorageError, TensorEntry, itemsize, parse_ref,
)
from ckptd_schemas.digest import StreamHasher, combine
from ckptd_schemas.geometry import Box, Region, check_tiling

from ..storage import Storage
from ..store import CheckpointReader
from ..store.paths import Paths
from .digest import tensor_digest
from .drill_layouts import check_layout, resolve_layout
from .executor import ChunkAssembler, plan_engine
from .models import MAX_LAYOUTS
from .pieces import SourcePieces, target_place
from .planner import ReshardChunk, ReshardPlan, plan_reshard

__all__ = ["MAX_PROBLEMS", "DrillProblem", "DrillRecord", "LayoutDrill", "drill_checkpoint", "drill_plan", "plan_drill",
           "problems_of", "read_record", "write_record"]

log = logging.getLogger("ckptd.reshard")

#: Problems kept per layout in a record (a count of the rest is the last one).
MAX_PROBLEMS = 100


class _M(BaseModel):
    model_config = ConfigDict(extra="forbid")


class DrillProblem(_M):
    layout: str = Field(description="the layout as asked (half, double, or a spec)")
    tensor: str | None = Field(None, description="the tensor concerned; None for a problem of the whole layout")
    message: str

    def __str__(self) -> str:
        return f"layout {self.layout}: " + (f"tensor {self.tensor!r}: " if self.tensor else "") + self.message


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

class _Problem(Exception):
    pass


def plan_drill(manifest: Manifest, layouts: list[str]) -> list[tuple[str, ReshardPlan]]:
    """(layout as asked, its plan) for each of ``layouts``: every spec parsed and planned before any I/O;
    :class:`InvalidRequest` (with the grammar) for any that does not parse or that this checkpoint cannot
    take. Duplicates (after resolving half and double) are drilled once."""
    if not layouts:
        raise InvalidRequest("a drill needs at least one layout (--to SPEC)")
    if len(layouts) > MAX_LAYOUTS:
        raise InvalidRequest(f"a drill takes at most {MAX_LAYOUTS} layouts, not {len(layouts)}", layouts=len(layouts))
    asked = [check_layout(x) for x in layouts]  # every one parsed before any is planned
    out: list[tuple[str, ReshardPlan]] = []
    seen: set[str] = set()
    for name in asked:
        spec = resolve_layout(name, manifest.topology)
        if str(spec) in seen:
            continue
        seen.add(str(spec))
        out.append((name, plan_reshard(manifest, spec)))
    return out


def drill_plan(reader: CheckpointReader, manifest: Manifest, layout: str, plan: ReshardPlan, *, jobs: int = 1,
               progress: Callable[[int], None] | None = None) -> LayoutDrill:
    """Assemble every target chunk of ``plan`` (the conversion of ``manifest`` into ``layout``) and check
    each tensor against the source (module docstring); ``jobs`` tensors at a time. Writes nothing."""
    t0 = time.monotonic()
    chunks: dict[str, list[tuple[int, ReshardChunk]]] = {t.name: [] for t in manifest.tensors}
    problems: list[DrillProblem] = []
    for u in plan.units:
        for pc in u.chunks:
            if pc.tensor in chunks:
                chunks[pc.tensor].append((u.rank, pc))
            elif not any(p.tensor == pc.tensor for p in problems):
                problems.append(DrillProblem(layout=layout, tensor=pc.tensor,
                                             message=f"the plan has a target chunk of a tensor {manifest.ref} "
                                                     f"does not hold"))
    every = [pc for u in plan.units for pc in u.chunks]
    engine = plan_engine(plan, "cpu")  # no cast: the host's numpy engine moves the bytes
    pieces = SourcePieces(manifest, (t.name for t in manifest.tensors if t.digest is None))
    src_keys = {f: Paths.file(manifest.run, manifest.name, manifest.session, f) for f in manifest.files}
    storage = reader.storage

    def read_source(file: str, start: int, end: int) -> bytes:
        buf = bytearray(end - start)
        got = storage.read_into(src_keys[file], start, memoryview(buf))
        return bytes(buf[:got])

    local = threading.local()
    lock = threading.Lock()
    assemblers: list[ChunkAssembler] = []
    assembled = [0]

    def advance(n: int) -> None:
        with lock:
            assembled[0] += n
        if progress is not None:
            progress(n)

    def assembler() -> ChunkAssembler:
        a = getattr(local, "assembler", None)
        if a is None:
            a = local.assembler = ChunkAssembler(reader, plan, every, engine=engine, pieces=pieces)
            with lock:
                assemblers.append(a)
        return a

    def one(t: TensorEntry) -> DrillProblem | None:
        try:
            a = assembler()
            a.forget_parts()  # this tensor's source parts only: memory stays per tensor
            got = _target_digest(a, t, chunks[t.name], advance)
            want = t.digest if t.digest is not None else _source_digest(manifest, t, a, read_source)
            if got != want:
                raise _Problem(f"the assembled target's layout-independent digest {got} differs from the "
                               f"source's {want}")
            return None
        except StorageError:
            raise  # the store failed, not the checkpoint: the drill stops, nothing is recorded
        except _Problem as e:
            return DrillProblem(layout=layout, tensor=t.name, message=str(e))
        except ChecksumMismatch as e:  # a fetch failed its block digests: whose bytes are damaged?
            own = _damaged_chunk(t, read_source)
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

    tensors = list(manifest.tensors)
    if jobs > 1 and len(tensors) > 1:
        with ThreadPoolExecutor(jobs, thread_name_prefix="ckptd-drill") as pool:
            found = list(pool.map(one, tensors))
    else:
        found = [one(t) for t in tensors]
    problems += [p for p in found if p is not None]
    if len(problems) > MAX_PROBLEMS:
        rest = len(problems) - MAX_PROBLEMS + 1
        problems = problems[:MAX_PROBLEMS - 1] + [DrillProblem(layout=layout, message=f"{rest} more problems")]
    return LayoutDrill(layout=layout, spec=plan.target_spec, ok=not problems, tensors=len(tensors),
                       bytes=assembled[0], bytes_read=sum(a.bytes_read for a in assemblers),
                       seconds=round(time.monotonic() - t0, 3), problems=problems)


def _target_digest(a: ChunkAssembler, t: TensorEntry, chunks: list[tuple[int, ReshardChunk]],
                   progress: Callable[[int], None] | None) -> str:
    """The layout-independent digest of tensor ``t`` as the target layout's chunks hold it, each chunk
    assembled from the source. Raises :class:`TilingError` when the chunks do not tile ``t`` exactly."""
    shape = list(t.shape)
    check_tiling(t.name, shape, [(_region(pc), rank, "") for rank, pc in chunks])
    held = [pc for _, pc in chunks if pc.numel]
    places = [target_place(shape, pc.dtype, (pc.offsets, pc.sizes, pc.flat_start)) for pc in held]
    if all(p is not None for p in places):
        return _stream_digest(a, t, sorted(zip(places, held), key=lambda x: x[0][0]), progress)  # type: ignore[index]
    return _placed_digest(a, t, held, progress)


def _region(pc: ReshardChunk) -> Region:
    if pc.sizes is not None:
        return Region(box=Box(tuple(pc.offsets or ()), tuple(pc.sizes)))
    return Region(flat=(pc.flat_start or 0, pc.flat_length or 0))


def _stream_digest(a: ChunkAssembler, t: TensorEntry, ordered: list[tuple[tuple[int, int], ReshardChunk]],
                   progress: Callable[[int], None] | None) -> str:
    """Chunks that are row-major runs, in stream order: one pass, one chunk in memory. Replicas (a range
    held twice) must be byte-identical and are hashed once."""
    h = StreamHasher()
    covered, last = 0, (-1, -1)
    last_xxh3: str | None = None
    for i, ((start, _), pc) in enumerate(ordered):
        end = start + pc.nbytes
        raw = a.assemble(pc, list(t.shape))
        if progress:
            progress(pc.nbytes)
        if (start, end) == last:
            if xxhash.xxh3_64_hexdigest(raw) != last_xxh3:
                raise _Problem(f"two target chunks hold bytes [{start}, {end}) with different contents")
            continue
        if start != covered:
            raise _Problem(f"target chunks leave bytes [{covered}, {start}) uncovered" if start > covered
                           else f"target chunks overlap at bytes [{start}, {covered})")
        h.update(raw)
        nxt = ordered[i + 1][0][0] if i + 1 < len(ordered) else None
        last_xxh3 = xxhash.xxh3_64_hexdigest(raw) if nxt == start else None  # hashed only when a replica follows
        covered, last = end, (start, end)
    return h.hexdigest()


def _placed_digest(a: ChunkAssembler, t: TensorEntry, held: list[ReshardChunk],
                   progress: Callable[[int], None] | None) -> str:
    """Chunks that are not all row-major runs: each placed into one buffer of the whole tensor (its bytes
    in memory), then hashed in stream order."""
    shape = list(t.shape)
    isz = itemsize(t.dtype)
    n = isz
    for d in shape:
        n *= d
    whole = np.zeros(n, dtype=np.uint8)
    rows = whole.reshape(*shape[:-1], shape[-1] * isz)  # a 0-d tensor is a run: never here
    for pc in held:
        raw = np.frombuffer(a.assemble(pc, shape), dtype=np.uint8)
        if progress:
            progress(pc.nbytes)
        if pc.sizes is None:
            start = (pc.flat_start or 0) * isz
            whole[start:start + raw.size] = raw
            continue
        off, size = list(pc.offsets or ()), list(pc.sizes)
        index = tuple(slice(o, o + s) for o, s in zip(off[:-1], size[:-1])) + (
            slice(off[-1] * isz, (off[-1] + size[-1]) * isz),)
        rows[index] = raw.reshape(*size[:-1], size[-1] * isz)
    h = StreamHasher()
    h.update(memoryview(whole))
    return h.hexdigest()


def _damaged_chunk(t: TensorEntry, read_source: Callable[[str, int, int], bytes],
                   piece: int = 8 << 20) -> str | None:
    """The first chunk of ``t`` whose stored bytes do not hash to the XXH3 its manifest records, named; None
    when every chunk holds. Each chunk is read in pieces of at most ``piece`` bytes."""
    for c in t.chunks:
        loc = c.location
        if loc is None:
            continue
        h, pos, end = xxhash.xxh3_64(), loc.offset, loc.offset + loc.length
        while pos < end:
            data = read_source(loc.file, pos, min(pos + piece, end))
            if not data:
                break
            h.update(data)
            pos += len(data)
        if pos < end:
            return f"the chunk on rank {c.rank} at bytes [{loc.offset}, {end}) of file {loc.file!r} is cut short"
        if h.hexdigest() != loc.xxh3:
            return (f"the chunk on rank {c.rank} at bytes [{loc.offset}, {end}) of file {loc.file!r} hashes to "
                    f"{h.hexdigest()}, the manifest says {loc.xxh3}")
    return None


def _source_digest(manifest: Manifest, t: TensorEntry, a: ChunkAssembler,
                   read_source: Callable[[str, int, int], bytes]) -> str:
    """The source tensor's digest from the parts its verified fetches yielded while its target chunks were
    assembled (ragged ends read back from the source files); failing that (chunks that are not row-major
    runs, compressed chunks), by walking the stored tensor in slabs."""
    n = itemsize(t.dtype)
    for d in t.shape:
        n *= d
    got = combine((p for p in a.parts if p.tensor == t.name), {("src", t.name): n},
                  lambda side, file, start, end: read_source(file, start, end))
    if ("src", t.name) in got:
        return got[("src", t.name)]
    return tensor_digest(manifest, t, read_source)


# -- one checkpoint ------------------------------------------------------------------------------------

def drill_checkpoint(storage: Storage, ref: str, layouts: list[str], *, jobs: int = 1,
                     progress: Callable[[int], None] | None = None, record: bool = True,
                     plans: list[tuple[str, ReshardPlan]] | None = None) -> DrillRecord:
    """Drill the visible checkpoint ``ref`` into each of ``layouts`` and (``record``) store the record
    beside it. ``plans``: from :func:`plan_drill` of the same manifest, when the caller planned already.
    The caller holds a lease on ``ref`` meanwhile (so retention spares it): the job runner
    (``jobs.run_job``) or ``ckptd drill --root``."""
    t0 = time.monotonic()
    r = parse_ref(ref)
    reader = CheckpointReader(storage)
    c = reader.committed(r.run, r.name)  # not visible: CheckpointNotFound, nothing recorded
    manifest = reader.visibility.manifest(c)
    if plans is None or any(p.source != manifest.ref or p.source_session != manifest.session for _, p in plans):
        plans = plan_drill(manifest, layouts)  # planned here, or again: the caller's plans are of another manifest
    results = [drill_plan(reader, manifest, layout, plan, jobs=jobs, progress=progress) for layout, plan in plans]
    rec = DrillRecord(ref=c.ref, manifest_xxh3=c.digest, ok=all(x.ok for x in results), layouts=results,
                      seconds=round(time.monotonic() - t0, 3), drilled_at=datetime.now(timezone.utc))
    if record:
        write_record(storage, rec)
    return rec


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


def problems_of(rec: DrillRecord) -> list[DrillProblem]:
    return [p for x in rec.layouts for p in x.problems]

