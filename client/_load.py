"""Load: fill a state dict in place from a checkpoint saved at any world size.

Call order inside :meth:`CheckpointClient.load`:

1. fetch the head of the checkpoint's load tree, checked against the root its
   marker names (``_loadtree``; from a service or checkpoint without load trees,
   the whole manifest, checked against its digest). ``RUN/latest``: the service
   resolves it to the newest trainer checkpoint not known to be bad, and names
   the newer ones it skipped, with why: ``LoadReport.skipped``, logged as a
   warning. Match it against the flattened state dict (strict by default: a key
   missing on either side, a shape or a dtype mismatch raises, naming the key).
   In a distributed load a rank may hold any subset of the checkpoint: each
   rank's keys must exist in it, and the ranks' keys together must cover it,
   checked in two all-reduces whatever the world size (``_coverage``) that also let every rank raise
   when one fails, and tell every rank whether some rank does not read its files directly (step 4);
2. describe the regions this rank's tensors cover (DTensor boxes from their
   placements, FlatShard ranges, whole plain tensors), fetch the load tree's
   pieces they need (chunk rows, files, the objects it restores), check each,
   and plan the reads here: coalesced, block-aligned byte ranges (without a load
   tree, from the whole manifest, checked against its digest);
3. :func:`execute`: fetch the ranges in parallel, every block digest verified, from this host's
   copy of the service's files where the plan names them and it can open them (``_files``), else
   over HTTP; row bands go straight into the destinations (``_scatter``, onto a device through a
   ring of pinned buffers), anything else through a buffer. The service sees none of the direct
   reads (nor the ranks of a distributed load waiting for each other), so the load holds a read
   lease of its own (``LoadLease``, one per load), renewed while it reads: gc spares the checkpoint.
4. in a distributed load where some rank does not read all its bytes from this host's files (as
   step 1's agreement tells every rank alike), regions that several ranks of one host need
   (replicated tensors) are read by one of them and sent to the others (``_share``: a gather within
   the host first); where every rank reads directly the page cache already reads each byte from
   the disk once, and no rank calls ``_share``. Every step that could leave a rank waiting is agreed
   first, so a failure on one rank raises on all of them instead of hanging.
"""

from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable, TypeVar

import httpx

from ckptd_schemas import (
    ChecksumMismatch, CorruptCheckpoint, Fetch, KindMismatch, Manifest, ObjectEntry, ReadPlan, ReadRequest,
    StateDictMismatch,
)

from ._coverage import agree_keys
from ._scatter import BUFFER_BYTES, DeviceStager, Fill, PieceFill, direct_targets, fill_buffer, fill_targets, staged_runs
from ._dist import distributed as _distributed, raise_on_all
from ._files import LocalFiles
from ._share import Sharing, exchange, region_key, share_plan
from ._flatten import Leaf, flatten
from .transport import Transport
from ._placement import LocalPiece, dtype_name, local_piece
from ._damage import reported
from ._lease import LoadLease
from ._loadtree import Pieces, fetch_head, fetch_pieces
from ._manifest import get_manifest
from ckptd_schemas.api import SkippedCheckpoint
from ckptd_schemas.readplan import whole
from ckptd_schemas.format.assemble import Destination, copy_into
from ckptd_schemas.format.objects import SAFE, ObjectPolicy, decode_object

from ckptd_schemas.names import RESERVED

__all__ = ["HttpRanges", "LoadReport", "RESERVED", "execute", "load_into", "local_files", "stored_object"]

log = logging.getLogger("ckptd_client")
T = TypeVar("T")



@dataclass
class LoadReport:
    """What ``load`` restored."""

    ref: str
    tensors: list[str] = field(default_factory=list)
    objects: list[str] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)      # in the state dict, not in the checkpoint
    unexpected: list[str] = field(default_factory=list)   # in the checkpoint, not in the state dict
    bytes_read: int = 0
    bytes_read_direct: int = 0  # of bytes_read, read from the service's files on this host (not HTTP)
    bytes_shared_in: int = 0  # received from the rank of this host that read them (``_share``)
    # metadata fetched before the bytes: the load tree's head and this rank's pieces of it (or, from a
    # service or checkpoint without load trees, the whole manifest)
    metadata_bytes: int = 0
    # how many ranks' keys were gathered to find what the checkpoint holds that none of them restored
    # (1: this rank alone; N: a distributed load, ``_coverage``); 0 when nothing was checked
    coverage_ranks: int = 0
    # the checkpoint's keys (tensors and objects) that no rank's state dict holds: a subset load
    # (``load(..., cover=True)`` refuses one)
    uncovered: list[str] = field(default_factory=list)
    # ``RUN/latest`` only: the newer trainer checkpoints the service skipped as known to be bad (their
    # recorded verification failed), newest first, each with its ref and reason; ``ref`` is what loaded
    skipped: list[SkippedCheckpoint] = field(default_factory=list)


def _check(leaf: Leaf, piece: LocalPiece, ref: str, shape: list[int], dtype: str) -> None:
    if list(piece.shape) != list(shape):
        raise StateDictMismatch(f"tensor {leaf.fqn!r}: checkpoint {ref} has shape {list(shape)}, "
                                f"state_dict has {list(piece.shape)}", tensor=leaf.fqn)
    if dtype_name(piece.dtype) != dtype:
        raise StateDictMismatch(f"tensor {leaf.fqn!r}: checkpoint {ref} has dtype {dtype}, "
                                f"state_dict has {dtype_name(piece.dtype)}", tensor=leaf.fqn)


def _request(fqn: str, piece: LocalPiece) -> ReadRequest:
    if piece.flat is not None:
        return ReadRequest(name=fqn, flat_start=piece.flat[0], flat_length=piece.flat[1])
    assert piece.box is not None
    return ReadRequest(name=fqn, offsets=list(piece.box.offsets), sizes=list(piece.box.sizes))


class HttpRanges:
    """The range source of the service's file route: one GET with a ``Range`` header per fetch;
    ``consume`` gets a :data:`~._scatter.Fill` over the body's pieces, which must hold the fetch's
    bytes and nothing more. A retried request runs ``consume`` again from the first byte."""

    def __init__(self, transport: Transport, base: str) -> None:
        self.transport, self.base = transport, base

    def read(self, f: Fetch, consume: Callable[[Fill], T]) -> T:
        def sink(resp: httpx.Response) -> T:
            body = PieceFill(resp.iter_bytes(), f)
            out = consume(body)
            body.drain()
            return out

        return self.transport.request("GET", f"{self.base}/files/{f.file}",
                                      headers={"Range": f"bytes={f.start}-{f.end - 1}"}, sink=sink)


def stored_object(transport: Transport, base: str, o: ObjectEntry, ref: str) -> bytes | None:
    """The object's stored bytes, checked against its digest (``ObjectEntry.checked``; None for a JSON
    object: its value is inline); the load and the DCP reader decode them without running code
    (``ckptd_schemas.format.objects``)."""
    loc = o.location
    if loc is None:
        return None
    try:
        data = transport.request("GET", f"{base}/files/{loc.file}",
                                 headers={"Range": f"bytes={loc.offset}-{loc.offset + loc.length - 1}"},
                                 sink=lambda r: r.read())
    except ChecksumMismatch as e:  # the service found the file damaged (CorruptCheckpoint)
        raise CorruptCheckpoint(f"object {o.name!r}: {e.message}", **{**e.details, "object": o.name}) from e
    return o.checked(data, ref)


def load_into(transport: Transport, run: str, name: str, state_dict: dict, *, rank: int, strict: bool,
              streams: int, cover: bool = False, direct_reads: bool = True, share_replicas: bool = True,
              objects: ObjectPolicy = SAFE) -> LoadReport:
    with LoadLease(transport, run, name) as lease:  # one read lease for the whole load, released when it returns
        try:
            return _load_into(transport, run, name, state_dict, lease, rank=rank, strict=strict, cover=cover,
                              streams=streams, direct_reads=direct_reads, share_replicas=share_replicas,
                              objects=objects)
        except CorruptCheckpoint as e:  # the service re-checks and records it: `latest` moves past it
            raise reported(transport, lease.base, e) from e


def _load_into(transport: Transport, run: str, name: str, state_dict: dict, lease: LoadLease, *,
               rank: int, strict: bool, cover: bool, streams: int, direct_reads: bool, share_replicas: bool,
               objects: ObjectPolicy) -> LoadReport:
    together = _distributed()
    share = share_replicas and together
    manifest: Manifest | None = None
    held: set[str] = set()
    files: LocalFiles | None = None
    direct = True  # every byte this rank reads comes from this host's files (nothing for ``_share`` to save)
    err: Exception | None = None
    try:
        found = _prepare(transport, run, name, state_dict, strict, cover=cover, rank=rank, alone=not together,
                         direct_reads=direct_reads, hold=lease.hold)
        manifest, report, leaves, pieces = found.manifest, found.report, found.leaves, found.pieces
        objects_by_name = found.objects_by_name
        held = {leaf.fqn for leaf in leaves}
        base = f"/v1/checkpoints/{run}/{manifest.name}"
        plan = found.plan(pieces) if pieces else None
        files = local_files(plan, manifest) if plan is not None else None
        direct = plan is None or (files is not None and all(files.usable(f.file) for f in plan.fetches))
    except Exception as e:
        err = e
    try:
        uncovered: list[str] = []
        if together and (share or strict or cover):  # one collective: no rank waits below for a failed one
            coverage, uncovered, (indirect,) = agree_keys(
                err, None if manifest is None else (manifest.ref, manifest.session),
                found.keys if manifest is not None else [], held, cover=cover, flags=(not direct,))
            share = share and indirect  # on every rank alike: only a rank that reads over HTTP gains from it
        else:
            coverage = 1 if strict or cover else 0
        if err is not None:
            raise err
        report.coverage_ranks = coverage
        report.uncovered = uncovered if together else list(report.unexpected)
        if pieces or share:  # a rank with nothing to read still takes part in the sharing
            _read_tensors(transport, base, pieces, plan, files, report, streams=streams, share=share, direct=direct,
                          replan=found.plan)
    finally:
        if files is not None:
            files.close()
            report.bytes_read_direct = files.bytes_read
    for leaf in leaves:
        if leaf.kind == "tensor" or leaf.fqn not in objects_by_name:
            continue
        entries = objects_by_name[leaf.fqn]
        entry = _pick_object(entries, rank)
        if entry is None:  # saved per rank for other ranks (``strict`` refused it in ``_prepare``)
            report.missing.append(leaf.fqn)
            continue
        leaf.container[leaf.key] = decode_object(entry, stored_object(transport, base, entry, manifest.ref),
                                                 ref=manifest.ref, policy=objects)
        report.objects.append(leaf.fqn)
    return report


def _pick_object(entries: list[ObjectEntry], rank: int) -> ObjectEntry | None:
    """The entry rank ``rank`` restores: the global one; else its own rank's; else the one value that
    every rank which saved it saved (a key that only some ranks held, like a pipeline stage's). None
    when the ranks that saved it saved different values, none of them this rank."""
    entry = next((o for o in entries if o.rank is None), None) or next((o for o in entries if o.rank == rank), None)
    if entry is None and len({o.value_key() for o in entries}) == 1:
        entry = entries[0]
    return entry


@dataclass
class _Prepared:
    """What step 1 found: the checkpoint's manifest (all of it, or only the pieces this rank needs,
    each checked against the load tree's head), and how this rank's reads are planned."""

    manifest: Manifest
    report: LoadReport
    leaves: list[Leaf]
    pieces: list[tuple[Leaf, LocalPiece]]
    objects_by_name: dict[str, list[ObjectEntry]]
    plan: Callable[[list[tuple[Leaf, LocalPiece]]], ReadPlan]
    keys: list[str]  # every key a state dict can restore from the checkpoint, sorted


def _prepare(transport: Transport, run: str, name: str, state_dict: dict, strict: bool, *, cover: bool = False,
             rank: int = 0, alone: bool = True, direct_reads: bool = True,
             hold: Callable[[str], None] | None = None) -> _Prepared:
    """Step 1: what the checkpoint holds, matched against the state dict; the tensor pieces this rank
    fills, and how their reads are planned.

    Through the checkpoint's load tree where the service offers one (``_loadtree``: the head, then
    this rank's pieces, each checked), else the whole manifest (checked against its digest); the
    reads are planned here from either. With ``strict``, a key of the state dict that the checkpoint lacks (or holds
    only per rank, for other ranks) fails this rank. With ``cover``, a key of the checkpoint that the
    state dict lacks fails it when it loads ``alone``; otherwise ``_coverage.agree_keys`` checks that
    some rank holds it. ``lease`` is taken on the checkpoint ``name`` resolved to beside the request
    for the pieces (both need only the head), and held when this returns: before any byte is read."""
    found = fetch_head(transport, run, name)
    manifest: Manifest | None = None
    if found is None:
        raw, skipped = get_manifest(transport, run, name)
        manifest = Manifest.model_validate_json(raw)  # inline objects: checked
        ref, concrete = manifest.ref, manifest.name
        shapes = {t.name: (t.shape, t.dtype) for t in manifest.tensors}
        object_names = {o.name for o in manifest.objects}
    else:
        head, skipped = found.head, found.skipped
        ref, concrete = head.ref, found.name
        shapes = {n: (t["shape"], t["dtype"]) for n, t in head.tensors().items()}
        object_names = set(head.objects())
    object_names = {n for n in object_names if not n.startswith(RESERVED)}  # ckptd's own records (DCP metadata)
    report = LoadReport(ref=ref, skipped=skipped, metadata_bytes=len(raw) if found is None else len(found.head.raw))
    if skipped and rank == 0:
        log.warning("%s/%s resolved to %s, skipping %s", run, name, ref,
                    "; ".join(f"{s.ref} ({s.reason})" for s in skipped))
    leaves = flatten(state_dict).leaves
    tensor_leaves = [leaf for leaf in leaves if leaf.kind == "tensor"]

    present = {leaf.fqn for leaf in leaves}
    for leaf in leaves:  # a key of the other kind is not missing: say which kind each side holds
        stored = "a tensor" if leaf.fqn in shapes else "an object" if leaf.fqn in object_names else None
        held = "a tensor" if leaf.kind == "tensor" else "an object"
        if stored is not None and stored != held:
            raise KindMismatch(f"key {leaf.fqn!r} is stored as {stored} in checkpoint {ref}, the state dict holds "
                               f"{held}", key=leaf.fqn, stored=stored.split()[-1], asked=held.split()[-1], rank=rank)
    report.missing = sorted(leaf.fqn for leaf in tensor_leaves if leaf.fqn not in shapes)
    report.missing += sorted(leaf.fqn for leaf in leaves if leaf.kind != "tensor" and leaf.fqn not in object_names)
    report.unexpected = sorted(set(shapes) - present)
    report.unexpected += sorted(object_names - present)
    if cover and alone and report.unexpected:
        raise StateDictMismatch(
            f"checkpoint {ref} has keys the state_dict does not hold: {report.unexpected[:8]}"
            f"{' ...' if len(report.unexpected) > 8 else ''} (load(..., cover=False) restores the keys it holds)",
            missing_on_all_ranks=report.unexpected[:64])
    if strict and report.missing:
        raise StateDictMismatch(
            f"rank {rank}: state_dict keys missing from checkpoint {ref}: {report.missing[:8]} "
            f"(load(..., strict=False) restores the common keys)", missing=report.missing[:64], rank=rank)

    pieces: list[tuple[Leaf, LocalPiece]] = []
    for leaf in tensor_leaves:
        if leaf.fqn not in shapes:
            continue
        piece = local_piece(leaf.fqn, leaf.value)
        _check(leaf, piece, ref, *shapes[leaf.fqn])
        if piece.numel:
            pieces.append((leaf, piece))
        report.tensors.append(leaf.fqn)

    base = f"/v1/checkpoints/{run}/{concrete}"
    if hold is not None:
        hold(base)  # renewed while the load reads, released at the end
    restores = [leaf.fqn for leaf in leaves if leaf.kind != "tensor" and leaf.fqn in object_names]
    if manifest is None:
        assert found is not None
        got = fetch_pieces(transport, base, found.head, [_request(leaf.fqn, p) for leaf, p in pieces], restores,
                           rank, local_paths=direct_reads)
        manifest = got.manifest
        report.metadata_bytes += got.answer_bytes
        objects_by_name = {n: [o] if o is not None else [] for n, o in got.objects.items()}
    else:
        got = Pieces(manifest, {}, None, 0)
        objects_by_name = {}
        for o in manifest.objects:
            if o.name in object_names:
                objects_by_name.setdefault(o.name, []).append(o)


    def plan(ps: list[tuple[Leaf, LocalPiece]]) -> ReadPlan:
        return got.plan([_request(leaf.fqn, p) for leaf, p in ps])

    for leaf in leaves:
        entries = objects_by_name.get(leaf.fqn) if strict and leaf.kind != "tensor" else None
        if entries is not None and _pick_object(entries, rank) is None:
            raise StateDictMismatch(f"object {leaf.fqn!r} was saved per rank for ranks "
                                    f"{[o.rank for o in entries][:8]}, not for rank {rank}", key=leaf.fqn)
    return _Prepared(manifest, report, leaves, pieces, objects_by_name, plan, sorted({*shapes, *object_names}))


def _key(leaf: Leaf, p: LocalPiece) -> Any:
    box = (p.box.offsets, p.box.sizes) if p.box is not None else None
    return region_key(leaf.fqn, box, p.flat, p.dtype)


def _read_tensors(transport: Transport, base: str, pieces: list[tuple[Leaf, LocalPiece]], plan: ReadPlan | None,
                  files: LocalFiles | None, report: LoadReport, *, streams: int, share: bool, direct: bool,
                  replan: Callable[[list[tuple[Leaf, LocalPiece]]], ReadPlan]) -> None:
    """Step 3 (and 4): agree who reads the regions shared within a host (``share``: some rank of the
    load does not read all its bytes from this host's files, as the agreement said; ``direct``: this
    one does); fetch and verify, from ``files`` where usable; pass the shared regions along. The
    caller closes ``files``."""
    pieces_all = pieces
    sharing = Sharing()
    if share:
        sharing = share_plan({_key(leaf, p): p.numel * p.local.element_size() for leaf, p in pieces}, direct)
        if sharing.skip:  # another rank of this host reads these for us
            pieces_read = [(leaf, p) for leaf, p in pieces if _key(leaf, p) not in sharing.skip]
            plan = replan(pieces_read) if pieces_read else None
            pieces = pieces_read
    err: Exception | None = None
    try:
        if plan is not None:
            execute(transport, base, plan, [_destination(p) for _, p in pieces], streams, files)
            report.bytes_read = plan.bytes_to_read
    except Exception as e:
        err = e
    if not sharing.empty:  # the receivers must not wait for a reader that failed
        raise_on_all(err, group=sharing.group)
    elif err is not None:
        raise err
    if not sharing.empty:
        report.bytes_shared_in = exchange(sharing, {_key(leaf, p): p.local for leaf, p in pieces_all})


def _destination(piece: LocalPiece) -> Destination:
    if piece.flat is not None:
        return Destination(piece.local, piece.shape, flat_start=piece.flat[0])
    assert piece.box is not None
    return Destination(piece.local, piece.shape, box_offsets=piece.box.offsets)


def local_files(plan: ReadPlan, manifest: Manifest) -> LocalFiles | None:
    """The checkpoint's data files on this host, when the plan names them (direct reads)."""
    if not plan.local_paths:
        return None
    return LocalFiles(plan.local_paths, {k: e.size for k, e in manifest.files.items()})


STAGE_CPU = False
"""Route CPU destinations through :class:`DeviceStager` too (tests: the device path, run on the CPU).
Off, a CPU load scatters into its tensors directly, as it always has."""


def _stagers(plan: ReadPlan, dests: list[Destination], streams: int) -> dict[Any, DeviceStager]:
    """One stager per device that destinations live on (not the host, unless ``STAGE_CPU``): a ring
    of at most ``streams + 1`` buffers (2 to 4), none larger than the largest fetch."""
    devices = {d.tensor.device for d in dests if d.tensor.device.type != "cpu" or STAGE_CPU}
    if not devices:
        return {}
    biggest = max((f.end - f.start for f in plan.fetches), default=1)
    size = min(BUFFER_BYTES, 1 << max(0, biggest - 1).bit_length())
    return {dev: DeviceStager(dev, buffers=min(max(streams, 1), 3) + 1, buffer_bytes=size) for dev in devices}


def execute(transport: Transport, base: str, plan: ReadPlan, dests: list[Destination], streams: int,
            files: LocalFiles | None = None) -> None:
    """The one read executor of a load: every fetch of ``plan`` (``streams`` at a time) from one range
    source (``files``, this host's copy, where usable, else :class:`HttpRanges`) into one sink (row
    bands onto a device through a :class:`DeviceStager`, row bands into row bands straight from the
    source, else a verified buffer copied from), every block verified on the way, into ``dests``
    (indexed like the plan's requests). The caller holds the read lease (``LoadLease``: the load,
    the DCP reader). Destinations on a device (CUDA) are filled through the stager (pinned ring,
    side stream); when this returns, the caller's current stream is ordered after every copy, as it
    was after the synchronous copies before."""
    by_fetch: dict[int, list] = {}
    for c in plan.copies:
        by_fetch.setdefault(c.fetch, []).append(c)
    stagers = _stagers(plan, dests, streams)
    http = HttpRanges(transport, base)

    def staged(copies: list) -> tuple[DeviceStager, list] | None:
        """The stager and its runs when every copy of the fetch is a row band onto one staged device."""
        devices = {dests[c.request].tensor.device for c in copies}
        stager = stagers.get(next(iter(devices))) if len(devices) == 1 else None
        runs = staged_runs(copies, dests, stager.device) if stager is not None else None
        return None if runs is None else (stager, runs)  # type: ignore[return-value]

    def sink(f: Fetch, copies: list) -> Callable[[Fill], None]:
        """Where fetch ``f``'s bytes go: row bands onto a device through its stager's ring, row bands
        into row bands straight from the source, else a verified buffer copied from."""
        onto = staged(copies) if stagers and copies else None
        if onto is not None:
            stager, runs = onto
            return lambda fill: whole(f, stager.stream(f, fill, runs))
        targets = direct_targets(copies, dests)
        if targets is not None:
            return lambda fill: fill_targets(f, fill, targets)

        def buffered(fill: Fill) -> None:
            buf = fill_buffer(f, fill)
            for c in copies:
                dest = dests[c.request]
                stager = stagers.get(dest.tensor.device)
                if stager is not None:
                    stager.copy_into(buf, c, dest)
                else:
                    copy_into(buf, c, dest)
        return buffered

    def read(f: Fetch, copies: list) -> None:
        """One fetch from one range source into its sink: this host's file where usable, else HTTP."""
        consume = sink(f, copies)
        if files is not None and files.usable(f.file):
            try:
                files.read(f, consume)
                return
            except ChecksumMismatch:
                http.read(f, consume)  # raises if the service's bytes are bad too
                files.enabled = False  # HTTP passed: this host's file at that path is not the service's
                return
        http.read(f, consume)

    def run(i: int) -> None:
        f, copies = plan.fetches[i], by_fetch.get(i, [])
        try:
            read(f, copies)
        except ChecksumMismatch as e:  # a damaged checkpoint, from the bytes or from the service (422)
            tensors = sorted({c.tensor for c in copies})  # named in the error, which the load reports
            shown = ", ".join(map(repr, tensors[:8])) + (f" and {len(tensors) - 8} more" if len(tensors) > 8 else "")
            raise CorruptCheckpoint(f"{e.message} (bytes [{f.start}, {f.end}) of file {f.file!r}, read for "
                                    f"tensor{'s' if len(tensors) != 1 else ''} {shown or '(none)'})",
                                    **{**e.details, "file": f.file, "tensors": tensors[:64]}) from e

    try:
        if streams > 1 and len(plan.fetches) > 1:
            with ThreadPoolExecutor(min(streams, len(plan.fetches)), thread_name_prefix="ckptd-load") as pool:
                list(pool.map(run, range(len(plan.fetches))))
        else:
            for i in range(len(plan.fetches)):
                run(i)
    finally:
        for stager in stagers.values():
            stager.finish()
