"""Save: snapshot in the caller's thread, hash and upload in the background.

Call order inside :meth:`CheckpointClient.save`:

1. ``build_snapshot`` (caller's thread; this is the training stall): flatten the state dict once
   and plan the save (``ckptd_client._saveplan.plan_save``, from the replica owners), then
   two steps driven by the plan: reuse (the reuse candidates, hashed in place, that ``link`` linked
   into the session it opened: not copied) and copy (the rest, to host memory: into a claimed
   :class:`SnapshotPool` slab when the client has one; from CUDA on a side stream, synchronised
   before returning; objects encoded by ``ckptd_schemas.format.objects``: one that would need an
   unrestricted unpickler raises here).
2. ``upload_snapshot`` (background thread): open-or-join the session unless the stall opened it,
   then ``upload_files``: ``_pack`` runs the plan's order (``Snapshot.order``: with what the save
   linked and lays apart; compress, ``lay_out``, XXH3), yielding each file to stream (with retries)
   while it packs the next; ``_index`` builds the index from the files, which is sent; the service
   commits when the last rank's index arrives. ``Snapshot.release`` (success or failure) gives the
   slab back: nothing but the pool's declared slab outlives the upload.
"""

from __future__ import annotations

import contextlib
import logging
import time
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable, Container, Iterator, Mapping, Sequence

import torch
import xxhash

from ckptd_schemas import (
    AlreadyCommitted, BoxChunk, FlatChunk, Location, ObjectEntry, ParamGroup, RankIndex, SessionStatus, TensorEntry,
    parse_ref,
)

from ckptd_schemas import arrival
from ckptd_schemas.format.encoding import codec_for, encode
from .codec import CompressionPolicy
from ._flatten import Flattened, flatten
from .transport import Transport
from ._placement import LocalPiece, dtype_name, local_piece
from ckptd_schemas.format.objects import SAFE, ObjectPolicy, encode_object
from ._incremental import ChunkHistory, ChunkKey, SaveLinks, bytes_of, chunk_key, digest_source
from ._pool import SlabClaim, SnapshotPool, aligned
from ._saveplan import ALIGN, PlannedChunk, SavePlan, Write, file_prefix, lay_out, plan_save, write_order
from ._presigned import DirectUploads
from ._handover import LocalHandover
from .session_calls import Opened, abort_session, open_session, put_file, put_index, wait_committed

__all__ = ["Compression", "SaveHandle", "SaveWays", "Snapshot", "build_snapshot", "upload_snapshot", "ways_in"]

log = logging.getLogger("ckptd_client")

Compression = str | CompressionPolicy | None
"""``None`` (raw), ``"zstd"`` (always zstd), ``"planes"`` (always ``codec_for``'s codec: byte planes for
multi-byte elements) or a :class:`CompressionPolicy` (per chunk, by measurement, with ``codec_for``'s codec)."""

PIECE = 4 << 20
Link = Callable[[dict[tuple, bytes]], dict[tuple, list]]  # digests of chunks -> those linked, with their pieces
_PAD = bytes(ALIGN)


@dataclass
class _Chunk:
    fqn: str
    data: torch.Tensor | None     # contiguous CPU snapshot; None when ``reused``
    box: tuple[list[int], list[int]] | None
    flat: tuple[int, int] | None
    digest: bytes | None = None   # XXH3-128 of its bytes, when taken in the stall (incremental saves)
    reused: list | None = None    # its pieces in files already linked into the session: not copied
    plan: PlannedChunk | None = None  # the plan's chunk; made from ``data`` for a chunk built without a plan

    def __post_init__(self) -> None:
        if self.plan is None:
            assert self.data is not None
            dtype = dtype_name(self.data.dtype)
            self.plan = PlannedChunk(self.fqn, dtype, self.data.element_size(), tuple(self.data.shape), self.box,
                                     self.flat, chunk_key(self.fqn, dtype, self.box, self.flat))

    @property
    def key(self) -> ChunkKey:
        assert self.plan is not None
        return self.plan.key


@dataclass
class _Object:
    fqn: str
    encoding: str
    value: Any = None
    payload: bytes | None = None


@dataclass
class Snapshot:
    rank: int
    world: int
    tensors: list[TensorEntry] = field(default_factory=list)   # chunks filled at upload
    chunks: dict[str, list[_Chunk]] = field(default_factory=dict)
    objects: list[_Object] = field(default_factory=list)
    param_groups: list[ParamGroup] = field(default_factory=list)
    mesh: dict[str, int] = field(default_factory=dict)
    coords: dict[str, int] = field(default_factory=dict)
    layouts: dict[str, str] = field(default_factory=dict)
    claim: SlabClaim | None = None  # the pool slab the chunks are views of, until release()

    def order(self, linked: Mapping[tuple, list] | None = None, apart: Container[tuple] = ()) -> list[Write]:
        """The upload's order (``write_order``): chunks the stall or ``linked`` linked not written, ``apart`` first."""
        chunks = [c for cs in self.chunks.values() for c in cs]
        stall = {c.key: c.reused for c in chunks if c.reused is not None}
        return write_order(chunks, {**(linked or {}), **stall}, apart)

    def release(self) -> None:
        """Drop the chunks and give the pool's slab back; call once the upload has ended (success or
        failure), never before: the chunks are views of the slab, which the next save overwrites."""
        self.chunks = {}
        if self.claim is not None:
            self.claim.release()
            self.claim = None


def _encode_object(fqn: str, value: Any, policy: ObjectPolicy = SAFE) -> _Object:
    """JSON, or torch.save bytes that load with ``weights_only=True`` (``ckptd_schemas.format.objects``)."""
    enc = encode_object(fqn, value, policy)
    return _Object(fqn, enc.encoding, value=enc.value, payload=enc.payload)


def _to_host(src: torch.Tensor, claim: SlabClaim | None, side: dict[torch.device, Any]) -> torch.Tensor:
    """A contiguous host copy of ``src``: into the claimed slab if it fits, else a fresh tensor.

    A CUDA source is copied on a side stream (one per device, in ``side``), non-blocking into the
    pinned view, so the copy does not queue behind training kernels launched later; the caller
    synchronises ``side`` before training may touch its tensors again. (Untested here: no GPU.)
    A chunk the slab has no allocated room for yet (a first save: the pool pins its segments in the
    background after the upload) goes to fresh pageable memory: a staged, synchronous copy, no pinning.
    """
    dst = claim.take(src.shape, src.dtype) if claim is not None else torch.empty(src.shape, dtype=src.dtype)
    if not src.is_cuda:
        dst.copy_(src)
        return dst
    stream = side.get(src.device)
    if stream is None:
        stream = side[src.device] = torch.cuda.Stream(src.device)
    stream.wait_stream(torch.cuda.current_stream(src.device))  # see every write queued before save()
    with torch.cuda.stream(stream):
        dst.copy_(src, non_blocking=True)
    src.record_stream(stream)  # a temporary source is not reused by the allocator before the copy ran
    return dst


def build_snapshot(state_dict: dict | Flattened, rank: int, world: int, pool: SnapshotPool | None = None, *,
                   owners: Mapping[str, int] | None = None, objects: ObjectPolicy = SAFE,
                   link: Link | None = None, stall_keys: Container[tuple] = ()) -> Snapshot:
    """Copy what this rank writes to host memory; afterwards training may mutate its tensors.

    With ``pool``, the copies go into its slab (claimed until ``snap.release()``, which the uploader
    calls); on failure here the claim is given back before raising. ``owners``: the writer of each
    plain tensor agreed among the ranks (``ReplicaWriters.owners``), else ``plan_save`` balances
    them over all ranks. ``objects`` decides how non-tensor values are stored (an unsafe one raises
    ``UnsafeObject`` here, naming its key). ``link`` (incremental saves) is given the digests of the
    chunks in ``stall_keys`` that this rank holds on the CPU and returns those it linked into the
    session from the previous checkpoint (``ckptd_client._incremental.link_early``): they are not
    copied. ``state_dict`` may come flattened already (``client.save`` flattens once, for the writers'
    agreement and this).
    """
    flat = state_dict if isinstance(state_dict, Flattened) else flatten(state_dict)
    sources = {leaf.fqn: local_piece(leaf.fqn, leaf.value) for leaf in flat.leaves if leaf.kind == "tensor"}
    plan = plan_save(flat, sources, rank, world, owners, stall_keys=stall_keys)
    snap = Snapshot(rank, world, tensors=plan.tensors, param_groups=plan.param_groups, mesh=plan.mesh,
                    coords=plan.coords, layouts=plan.layouts)
    side: dict[torch.device, Any] = {}
    try:
        try:
            digests, held = _reuse(plan, sources, link)
            _copy(snap, plan, sources, digests, held, pool, side, objects)
        finally:  # training may change the sources once we return: the copies must be complete
            for stream in side.values():
                stream.synchronize()
    except BaseException:
        snap.release()
        raise
    return snap


def _reuse(plan: SavePlan, sources: Mapping[str, LocalPiece],
           link: Link | None) -> tuple[dict[tuple, bytes], dict[tuple, list]]:
    """The plan's reuse candidates hashed in place, and those of them ``link`` linked into the session
    (unchanged since the previous save): their pieces, which are not copied."""
    if link is None or not plan.reuse:
        return {}, {}
    digests = {c.key: d for c in plan.chunks if c.candidate and (d := digest_source(sources[c.fqn].local)) is not None}
    return digests, link(digests) if digests else {}


def _copy(snap: Snapshot, plan: SavePlan, sources: Mapping[str, LocalPiece], digests: Mapping[tuple, bytes],
          held: Mapping[tuple, list], pool: SnapshotPool | None, side: dict[torch.device, Any],
          objects: ObjectPolicy) -> None:
    """Copy the plan's chunks not ``held`` to host memory, in the plan's order (the slab laid out for
    exactly those), and encode its objects."""
    if pool is not None:
        sizes = [aligned(c.nbytes) for c in plan.chunks if c.key not in held]
        snap.claim = pool.claim(sizes=sizes)
    for c in plan.chunks:
        data = None if c.key in held else _to_host(sources[c.fqn].local.detach(), snap.claim, side)
        snap.chunks.setdefault(c.fqn, []).append(_Chunk(c.fqn, data, c.box, c.flat, digest=digests.get(c.key),
                                                        reused=held.get(c.key), plan=c))
    snap.objects = [_encode_object(o.fqn, o.value, objects) for o in plan.objects]


# -- upload ----------------------------------------------------------------------------------------

class SaveWays:
    """Which way this rank's bytes of a save went, files and bytes per way: ``socket`` (handed over as a
    sealed memory file, co-located), ``http`` (sent through the service), ``direct`` (presigned, into the
    object store), ``linked`` (an earlier checkpoint's files held, not sent: the bytes of the chunks in
    them). ``upload_files`` adds each file as it is stored; whole once the save's index is accepted
    (``SaveHandle.wait`` returned). ``str()``: the ways used, as the save's finished log line says them."""

    WAYS = ("socket", "http", "direct", "linked")

    def __init__(self) -> None:
        self.files = dict.fromkeys(self.WAYS, 0)
        self.bytes = dict.fromkeys(self.WAYS, 0)
        self._lock = threading.Lock()

    def add(self, way: str, nbytes: int, files: int = 1) -> None:
        with self._lock:
            self.files[way] += files
            self.bytes[way] += nbytes

    def __getstate__(self) -> dict:  # a DCP writer holding it is pickled into an async save's process
        return {"files": self.files, "bytes": self.bytes}

    def __setstate__(self, state: dict) -> None:
        self.files, self.bytes, self._lock = state["files"], state["bytes"], threading.Lock()

    def __str__(self) -> str:
        used = [f"{w} {self.files[w]} file{'s' if self.files[w] != 1 else ''} {self.bytes[w]:,} B"
                for w in self.WAYS if self.files[w]]
        return ", ".join(used) or "no file"

    def __repr__(self) -> str:
        return f"SaveWays({self})"


@dataclass
class _File:
    name: str
    hash: Any  # XXH3-64 of the bytes so far
    parts: list[tuple[memoryview | bytes, int]] = field(default_factory=list)  # (bytes, padding)
    size: int = 0
    pieces: list[tuple[int, BoxChunk | FlatChunk]] = field(default_factory=list)  # (its Write's position, piece)
    objects: list[ObjectEntry] = field(default_factory=list)

    @property
    def xxh3(self) -> str:
        return self.hash.hexdigest()


def _pack(snap: Snapshot, order: Sequence[Write], compression: Compression, file_bytes: int,
          prefix: str | None = None) -> Iterator[_File]:
    """Execute the plan: the chunks of ``order`` not linked (compressed per the policy, ``_frames``),
    then the stored objects, laid out by ``lay_out``, hashing each piece and file; yield each file
    once complete, before the next is packed: the caller starts its upload there, so file k+1 is
    packed while file k streams out. Each file names its pieces, for ``_index``."""
    def stored() -> Iterator[tuple[tuple, int, bool]]:
        for i, w in enumerate(order):
            for data, codec, raw, where in _frames(w.chunk, compression) if w.linked is None else ():
                yield (i, data, codec, raw, where), len(data), w.apart
        for o in snap.objects:
            if o.payload is not None:  # else JSON, in the index
                yield (-1, o.payload, "raw", len(o.payload), o.fqn), len(o.payload), False

    f: _File | None = None
    for (i, data, codec, raw, where), at in lay_out(stored(), prefix or file_prefix(snap.rank), file_bytes):
        if f is None or at.file != f.name:  # a new file: the one before is complete
            if f is not None:
                yield f
            f = _File(at.file, xxhash.xxh3_64())
        pad = (-len(data)) % ALIGN
        f.parts.append((data, pad))
        f.size = at.offset + len(data) + pad
        f.hash.update(data)  # right after the piece is stored: the same bytes, still in cache
        f.hash.update(_PAD[:pad])
        loc = Location(file=at.file, offset=at.offset, length=len(data), codec=codec, raw_length=raw,
                       xxh3=xxhash.xxh3_64_hexdigest(data))
        if i < 0:
            f.objects.append(ObjectEntry(name=where, rank=snap.rank, encoding="torch", location=loc))
        else:
            box, flat = where
            f.pieces.append((i, BoxChunk(rank=snap.rank, offsets=box[0], sizes=box[1], location=loc) if box is not None
                             else FlatChunk(rank=snap.rank, start=flat[0], length=flat[1], location=loc)))
    if f is not None:
        yield f


def _index(snap: Snapshot, order: Sequence[Write], files: Sequence[_File]) -> tuple[RankIndex, dict]:
    """The rank's index from the files ``_pack`` yielded (tensors' pieces in write order, linked files
    after the written ones), and every chunk's pieces by key (``SaveLinks.produced``)."""
    pieces: list[list] = [list(w.linked or ()) for w in order]
    for i, p in (ip for f in files for ip in f.pieces):
        pieces[i].append(p)
    stored: dict[str, list] = {}
    for w, ps in zip(order, pieces):
        stored.setdefault(w.chunk.fqn, []).extend(ps)
    placed = {o.name: o for f in files for o in f.objects}
    objects = [placed[o.fqn] if o.payload is not None else
               ObjectEntry(name=o.fqn, rank=snap.rank, encoding="json", value=o.value) for o in snap.objects]
    linked = dict.fromkeys(p.location.file for w in order for p in w.linked or ())
    index = RankIndex(rank=snap.rank, world_size=snap.world, coords=snap.coords, mesh=snap.mesh, layouts=snap.layouts,
                      tensors=[t.model_copy(update={"chunks": stored.pop(t.name, [])}) for t in snap.tensors],
                      objects=objects, param_groups=snap.param_groups, files=[f.name for f in files] + list(linked))
    return index, {w.chunk.key: ps for w, ps in zip(order, pieces)}


def _frames(c: _Chunk, compression: Compression) -> Iterator[tuple[memoryview | bytes, str, int, tuple]]:
    """One chunk's pieces as stored, ``(bytes, codec, raw length, (box, flat))``: raw whole, or compressed
    frame by frame (the plan's ``frames``: independently decodable, so a ranged read decodes only
    those it overlaps)."""
    assert c.data is not None and c.plan is not None
    raw = bytes_of(c.data)
    isz = c.plan.itemsize
    policy = compression if isinstance(compression, CompressionPolicy) else None
    frames: Sequence[tuple[int, int, Any, Any]]
    if compression is None or (policy is not None and not policy.should_compress(raw, isz)):
        frames, codec = [(0, len(raw) // isz, c.box, c.flat)], None
    else:
        frames, codec = c.plan.frames(), "zstd" if compression == "zstd" else codec_for(isz)
    for lo, n, box, flat in frames:
        data = raw[lo * isz:(lo + n) * isz]
        stored: memoryview | bytes = data
        if codec is not None:
            packed = encode(data, codec, isz)
            # "auto" keeps a frame raw when it did not shrink after all
            stored = data if policy is not None and len(packed) >= len(data) else packed
        yield stored, "raw" if stored is data else codec, len(data), (box, flat)  # type: ignore[misc]


def _declaration(f: _File, order: Sequence[Write]) -> bytes:
    """The declaration of ``f``'s chunks and objects (``ckptd_schemas.arrival``); empty past its limit."""
    rows = [arrival.Declared(p.location.offset, p.location.length, p.location.xxh3, p.location.codec,
                             p.location.raw_length, "tensor", order[i].chunk.fqn) for i, p in f.pieces]
    rows += [arrival.Declared(o.location.offset, o.location.length, o.location.xxh3, o.location.codec,
                              o.location.raw_length, "object", o.name) for o in f.objects if o.location is not None]
    head = arrival.encode(rows)
    return head if len(head) <= arrival.MAX_BYTES else b""


def _pieces(f: _File) -> Iterator[bytes | memoryview]:
    """The file's bytes in order: each chunk's data, then its alignment padding."""
    for data, pad in f.parts:
        yield data
        if pad:
            yield _PAD[:pad]


def _stream(f: _File) -> Iterator[bytes | memoryview]:
    """The same bytes cut into HTTP body pieces of at most PIECE."""
    for p in _pieces(f):
        view = memoryview(p)
        for i in range(0, len(view), PIECE):
            yield view[i:i + PIECE]


def _ours(e: AlreadyCommitted, session: str) -> bool:
    """True when ``e`` says the checkpoint was committed by ``session`` itself, not by another save."""
    return e.details.get("session") == session


def upload_files(transport: Transport, base: str, session: str, snap: Snapshot, *, compression: Compression,
                 file_bytes: int, streams: int, prefix: str | None = None,
                 committed: threading.Event | None = None,
                 links: SaveLinks | None = None, direct: DirectUploads | None = None,
                 local: LocalHandover | None = None, ways: SaveWays | None = None,
                 declare: bool = False) -> RankIndex:
    """Pack the snapshot into files, stream them (several at once), return the rank's index.

    With ``declare`` (the service offers ``arrival_checks``), each file's chunks are declared ahead of
    its bytes over HTTP and the socket (``ckptd_schemas.arrival``), for the service to check each as it
    arrives instead of reading the file back at the commit.

    With ``direct`` (direct uploads, ``ckptd_client._presigned``), each file is PUT straight into the
    object store, until a fallback turns that off. With ``local`` (co-located uploads,
    ``ckptd_client._handover``), each file is handed to the service on this host as a sealed memory
    file, until the socket cannot be reached or its peer does not prove the session's key; otherwise,
    and for a file either sends back, HTTP.
    ``ways`` receives which way each file went (and the files linked). With a :class:`CompressionPolicy`,
    the upload's throughput is fed back to it: the next save decides against the store as it is now.
    Once the service answers that this very session is committed (``committed`` is set, here or by the
    caller), the remaining files are packed and hashed but not sent: the index still comes back whole,
    for the service to compare with the one it committed.
    With ``links`` (incremental saves, ``ckptd_client._incremental``), chunks unchanged since this
    rank's previous save to the run are linked, not written, and those written again laid out apart
    (``Snapshot.order``); ``links.produced`` receives where every chunk's pieces are, for the caller
    to remember once the index is accepted.
    """
    committed = committed if committed is not None else threading.Event()
    starts: list[float] = []  # the upload's rate, for the compression policy, runs from the first PUT
    linked = links.link(transport, base, session, snap.rank) if links is not None and not committed.is_set() else None
    order = snap.order(linked, links.unchanged if links is not None else ())
    ways = ways if ways is not None else SaveWays()
    held = [p.location for w in order for p in w.linked or ()]
    if held:
        ways.add("linked", sum(at.length for at in held), files=len({at.file for at in held}))

    def send(f: _File) -> str:
        starts.append(time.perf_counter())
        if direct is not None and direct.enabled and direct.put(f.name, f.size, lambda: _pieces(f)):
            return "direct"
        head = _declaration(f, order) if declare else b""
        if local is not None and local.enabled and local.put(f.name, f.size, f.xxh3, lambda: _pieces(f), head):
            return "socket"
        put_file(transport, base, session, f.name, lambda: _stream(f), size=f.size, xxh3=f.xxh3, head=head)
        return "http"

    def put(f: _File) -> None:
        if committed.is_set():
            return
        try:
            ways.add(send(f), f.size)
        except AlreadyCommitted as e:
            if not _ours(e, session):
                raise
            committed.set()

    # Each file's upload starts as soon as it is packed and hashed, while the next one is packed.
    with ThreadPoolExecutor(max(1, streams), thread_name_prefix="ckptd-upload") as pool:
        files: list[_File] = []
        sent: list[Future] = []
        try:
            for f in _pack(snap, order, compression, file_bytes, prefix):
                files.append(f)
                sent.append(pool.submit(put, f))
        except BaseException:
            for fut in sent:
                fut.cancel()
            raise
        for fut in sent:
            fut.result()  # the first failure, in file order
    index, produced = _index(snap, order, files)
    if links is not None:
        links.produced, links.written = produced, {f.name: f.size for f in files}
    if isinstance(compression, CompressionPolicy) and starts and not committed.is_set():  # a whole upload's rate
        compression.observe(sum(f.size for f in files), time.perf_counter() - min(starts))
    return index


@contextlib.contextmanager
def ways_in(transport: Transport, base: str, session: str, opened: Opened, *,
            local_uploads: bool = True) -> Iterator[dict[str, Any]]:
    """What ``upload_files`` may send the files through besides HTTP, as the session's answer offers:
    ``direct`` (presigned URLs into the object store) and ``local`` (a sealed memory file handed to
    the service on this host, unless ``local_uploads`` is False); closed at the end."""
    direct = DirectUploads(transport, base, session, transport.timeout) if opened.presigned else None
    ref = parse_ref(base.removeprefix("/v1/checkpoints/"))
    local = LocalHandover.offered(opened.local_socket, opened.local_host, opened.local_key, run=ref.run,
                                  name=ref.name, session=session, timeout=transport.timeout) if local_uploads else None
    try:
        yield {"direct": direct, "local": local, "declare": opened.arrival_checks}
    finally:
        if direct is not None:
            direct.close()


def upload_snapshot(transport: Transport, base: str, session: str, snap: Snapshot, step: int | None, *,
                    compression: Compression, file_bytes: int, streams: int,
                    direct_uploads: bool = False, history: ChunkHistory | None = None,
                    parent: str | None = None, opened: Opened | None = None,
                    local_uploads: bool = True, ways: SaveWays | None = None) -> SessionStatus:
    """Open-or-join (recording ``parent``) unless the stall opened the session (``opened``: what it
    answered), upload files, send the index; return the session status after it.

    A failure before the index is sent aborts the session (best effort): it cannot commit without
    this rank's index, so its staged files are deleted now instead of at the stale-session TTL, and
    the other ranks' waits end with the session gone instead of at their timeout.

    Run again with the same ``session`` (a save resumed after a crash), the upload may find that
    session already committed: the other ranks finished it with this rank's index from the earlier
    attempt. The rank then sends nothing but its index, which the service answers with the committed
    status when it equals the committed one, and refuses (``AlreadyCommitted``) when it differs.

    With ``history`` (incremental saves), unchanged chunks are linked from the rank's previous save
    to the run, and the history learns this save once the service accepted its index.

    ``ways`` (``SaveHandle.ways``) receives which way each file went; once the index is accepted, the
    save's finished line (INFO) says them.
    """
    ways = ways if ways is not None else SaveWays()
    committed = threading.Event()
    ref = parse_ref(base.removeprefix("/v1/checkpoints/"))
    links = history.begin(ref.run, ref.name, snap) if history is not None else None
    try:
        try:
            if opened is None:
                opened = open_session(transport, base, session, snap.world, step, parent=parent,
                                      direct_uploads=direct_uploads)
        except AlreadyCommitted as e:
            if not _ours(e, session):
                raise
            opened = Opened()
            committed.set()
        with ways_in(transport, base, session, opened, local_uploads=local_uploads) as offered:
            index = upload_files(transport, base, session, snap, compression=compression, file_bytes=file_bytes,
                                 streams=streams, committed=committed, links=links, ways=ways, **offered)
    except Exception:
        abort_session(transport, base, session)
        raise
    status = put_index(transport, base, session, index)
    if history is not None and links is not None:
        history.remember(links)
    log.info("saved %s/%s rank %d (session %s, %s): %s", ref.run, ref.name, snap.rank, session, status.state, ways)
    return status


class SaveHandle:
    """A save in flight. ``wait()`` returns once the checkpoint is committed, or raises why not.
    ``ways``: which way this rank's bytes went (:class:`SaveWays`: socket, HTTP, direct, linked)."""

    def __init__(self, ref: str, session: str, future: Future, transport: Transport, base: str,
                 ways: SaveWays | None = None) -> None:
        self.ref, self.session = ref, session
        self.ways = ways if ways is not None else SaveWays()
        self._future, self._transport, self._base = future, transport, base
        self._status: SessionStatus | None = None
        self._observed = False
        self._lock = threading.Lock()

    def _upload(self) -> str:
        """``running``, ``failed``, or the session's state once this rank's upload returned."""
        if not self._future.done():
            return "running"
        return "failed" if self._future.exception() is not None else self._future.result().state

    def done(self) -> bool:
        """True once the save is over: committed, or failed (``wait()`` then returns or raises at once)."""
        waited = self._status is not None and self._status.state != "open"
        return waited or self._upload() not in ("running", "open")

    @property
    def failed_unobserved(self) -> bool:
        return not self._observed and self._upload() == "failed"

    @property
    def unreported(self) -> bool:
        """True while nobody waited and the save is not known to be committed (in flight, or failed)."""
        return not self._observed and self._upload() != "committed"

    def wait(self, timeout: float | None = 1800.0, *, durable: bool = False) -> SessionStatus:
        """Block until the checkpoint is committed (every rank done); raise the typed error otherwise.

        ``durable=True``: also until it is durable. On a service with a durable tier (``ckptd serve
        --durable``) a commit is local to the fast tier until the service has copied it there and
        checked every byte; elsewhere the commit is durable already."""
        with self._lock:
            self._observed = True
            deadline = None if timeout is None else time.monotonic() + timeout
            status: SessionStatus = self._future.result(timeout=timeout)
            self._status = wait_committed(self._transport, self._base, self.ref, status, deadline, durable=durable)
            return self._status
