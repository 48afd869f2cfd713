"""Save: snapshot in the caller's thread, hash and upload in the background.

Call order inside :meth:`CheckpointClient.save`:

1. ``build_snapshot`` (caller's thread; this is the training stall): flatten
   the state dict, decide which chunks this rank writes (replicas once),
   copy them to host memory (into a leased :class:`SnapshotPool` slab when the client has one;
   from CUDA on a side stream, synchronised before returning), encode objects
   (``ckptd_schemas.format.objects``: one that would need an unrestricted unpickler raises here).
2. ``upload_snapshot`` (background thread): open-or-join the session, pack
   chunks into files (64-byte aligned), hash each chunk and file with XXH3,
   stream files with retries, then send the rank's index. The service commits
   when the last rank's index arrives. Then ``Snapshot.release`` (success or failure) gives the
   slab back: nothing but the pool's declared slab outlives the upload.
"""

from __future__ import annotations

import math
import time
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable, Container, Iterator, Mapping

import torch
import xxhash

from ckptd_schemas import (
    AlreadyCommitted, BoxChunk, FlatChunk, Location, ObjectEntry, ParamGroup, RankIndex, SessionStatus, TensorEntry,
    parse_ref,
)

from ckptd_schemas.format.codec import FRAME_BYTES, codec_for, encode, split_frames
from .codec import CompressionPolicy
from ._flatten import flatten_state_dict, param_groups_of
from .transport import Transport
from ._layout import assign_replicated, dtype_name, local_piece, mesh_of
from ckptd_schemas.format.objects import SAFE, ObjectPolicy, encode_object
from ._incremental import ChunkHistory, SaveDelta, chunk_key, digest_source
from ._pool import Lease, SnapshotPool, aligned
from ._presigned import DirectUploads
from .sessions import Opened, abort_session, open_session, put_index, wait_committed

__all__ = ["Compression", "SaveHandle", "Snapshot", "build_snapshot", "upload_snapshot"]

Compression = str | CompressionPolicy | None
"""``None`` (raw), ``"zstd"`` (always zstd), ``"planes"`` (always ``codec_for``'s codec: byte planes for
multi-byte elements) or a :class:`CompressionPolicy` (per chunk, by measurement, with ``codec_for``'s codec)."""

ALIGN = 64
PIECE = 4 << 20
_PAD = bytes(ALIGN)


@dataclass
class _Chunk:
    fqn: str
    data: torch.Tensor | None     # contiguous CPU snapshot; None when ``reused``
    box: tuple[list[int], list[int]] | None
    flat: tuple[int, int] | None
    payload: bytes | None = None  # compressed bytes (zstd)
    digest: bytes | None = None   # XXH3-128 of its bytes, when taken in the stall (incremental saves)
    reused: list | None = None    # its pieces in files already linked into the session: not copied


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
    lease: Lease | None = None    # the pool slab the chunks are views of, until release()

    @property
    def nbytes(self) -> int:
        return sum(c.data.numel() * c.data.element_size() for cs in self.chunks.values() for c in cs
                   if c.data is not None)

    def release(self) -> None:
        """Drop the chunks and give the pool's slab back; call once the upload has ended (success or
        failure), never before: the chunks are views of the slab, which the next save overwrites."""
        self.chunks = {}
        if self.lease is not None:
            self.lease.release()
            self.lease = None


def _describe(v: Any) -> Any:
    """A JSON description of a hyper-parameter for the manifest (the exact value is stored as an object)."""
    if isinstance(v, (list, tuple)):
        return [_describe(x) for x in v]
    if v is None or isinstance(v, (bool, int, str)):
        return v
    if isinstance(v, float):
        return v if math.isfinite(v) else str(v)
    if isinstance(v, torch.Tensor) and v.numel() == 1:
        return v.item()
    return repr(v)


def _encode_object(fqn: str, value: Any, policy: ObjectPolicy = SAFE) -> _Object:
    """JSON, or torch.save bytes that load with ``weights_only=True`` (``ckptd_schemas.format.objects``)."""
    enc = encode_object(fqn, value, policy)
    return _Object(fqn, enc.encoding, value=enc.value, payload=enc.payload)


def _to_host(src: torch.Tensor, lease: Lease | None, side: dict[torch.device, Any]) -> torch.Tensor:
    """A contiguous host copy of ``src``: into the leased slab if it fits, else a fresh tensor.

    A CUDA source is copied on a side stream (one per device, in ``side``), non-blocking into the
    pinned view, so the copy does not queue behind training kernels launched later; the caller
    synchronises ``side`` before training may touch its tensors again. (Untested here: no GPU.)
    A chunk the slab has no allocated room for yet (a first save: the pool pins its segments in the
    background after the upload) goes to fresh pageable memory: a staged, synchronous copy, no pinning.
    """
    dst = lease.take(src.shape, src.dtype) if lease is not None else torch.empty(src.shape, dtype=src.dtype)
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


def build_snapshot(state_dict: dict, rank: int, world: int, pool: SnapshotPool | None = None, *,
                   writers: Mapping[str, int] | None = None, objects: ObjectPolicy = SAFE,
                   link: Callable[[dict[tuple, bytes]], dict[tuple, list]] | None = None,
                   stall_keys: Container[tuple] = ()) -> Snapshot:
    """Copy what this rank writes to host memory; afterwards training may mutate its tensors.

    With ``pool``, the copies go into its slab (leased until ``snap.release()``, which the uploader
    calls); on failure here the lease is given back before raising. ``writers`` names the rank that
    writes each plain tensor (``ReplicaWriters.owners``, agreed among the ranks that hold it);
    without it every rank is assumed to hold the same plain tensors and the writers are balanced
    over all ranks from names and sizes alone. ``objects`` decides how non-tensor values are stored
    (an unsafe one raises ``UnsafeObject`` here, naming its key). ``link`` (incremental saves) is given
    the digests of the chunks in ``stall_keys`` that this rank holds on the CPU and returns those it
    linked into the session from the previous checkpoint (``ckptd_client._incremental.link_early``):
    they are not copied.
    """
    snap = Snapshot(rank, world)
    side: dict[torch.device, Any] = {}
    try:
        try:
            _fill(snap, state_dict, rank, world, side, writers, objects, pool, link, stall_keys)
        finally:  # training may change the sources once we return: the copies must be complete
            for stream in side.values():
                stream.synchronize()
    except BaseException:
        snap.release()
        raise
    return snap


def _fill(snap: Snapshot, state_dict: dict, rank: int, world: int, side: dict[torch.device, Any],
          writers: Mapping[str, int] | None = None, objects: ObjectPolicy = SAFE,
          pool: SnapshotPool | None = None,
          link: Callable[[dict[tuple, bytes]], dict[tuple, list]] | None = None,
          stall_keys: Container[tuple] = ()) -> None:
    leaves = flatten_state_dict(state_dict)
    pieces = {leaf.fqn: local_piece(leaf.fqn, leaf.value) for leaf in leaves if leaf.kind == "tensor"}
    owners = writers if writers is not None else assign_replicated(
        [(n, p.numel * p.local.element_size()) for n, p in pieces.items() if p.replicated], world)
    written = {n: p for n, p in pieces.items() if (owners.get(n) == rank if p.replicated else p.writes)
               and p.numel > 0}
    keys = {n: chunk_key(n, dtype_name(p.dtype), _box_of(p), p.flat) for n, p in written.items()}
    digests: dict[tuple, bytes] = {}
    reused: dict[tuple, list] = {}
    if link is not None:  # unchanged since the previous save and linked now: hashed in place, not copied
        digests = {keys[n]: d for n, p in written.items()
                   if keys[n] in stall_keys and (d := digest_source(p.local)) is not None}
        reused = link(digests) if digests else {}
    if pool is not None:  # the slab, laid out for the chunks this save copies, in the order it copies them
        sizes = [aligned(p.numel * p.local.element_size()) for n, p in written.items() if keys[n] not in reused]
        snap.lease = pool.lease(sum(sizes), sizes=sizes)
    snap.mesh, snap.coords = mesh_of([leaf.value for leaf in leaves], world)
    group_kinds: dict[str, set[str]] = {}
    for leaf in leaves:
        if leaf.kind == "tensor":
            p = pieces[leaf.fqn]
            group_kinds.setdefault(leaf.group, set()).add(p.placement or "")
            snap.tensors.append(TensorEntry(name=leaf.fqn, shape=list(p.shape), dtype=dtype_name(p.dtype),
                                            group=leaf.group, chunks=[], placement=p.placement))
            if leaf.fqn not in written:
                continue
            key = keys[leaf.fqn]
            data = None if key in reused else _to_host(p.local.detach(), snap.lease, side)
            snap.chunks.setdefault(leaf.fqn, []).append(_Chunk(leaf.fqn, data, _box_of(p), p.flat,
                                                               digest=digests.get(key), reused=reused.get(key)))
        else:
            snap.objects.append(_encode_object(leaf.fqn, leaf.value, objects))
    for owner, groups in param_groups_of(state_dict):
        for i, g in enumerate(groups):
            params = [p if isinstance(p, (int, str)) else repr(p) for p in g.get("params", [])]
            snap.param_groups.append(ParamGroup(
                optimizer=owner, index=i, params=params,
                hyperparams={k: _describe(v) for k, v in sorted(g.items()) if k != "params"}))
    for g, kinds in group_kinds.items():
        snap.layouts[g] = _layout_name(kinds, snap.mesh, world)


def _box_of(p: Any) -> tuple[list[int], list[int]] | None:
    return (list(p.box.offsets), list(p.box.sizes)) if p.box is not None else None


def _layout_name(kinds: set[str], mesh: dict[str, int], world: int) -> str:
    if kinds == {"replicate"}:
        return "replicate"
    if kinds <= {"flat", "replicate"}:
        return f"flat:dp={world}"
    if kinds <= {"(Shard(dim=0),)", "replicate"} and len(mesh) == 1:
        return f"fsdp2:dp={world}"
    return "dtensor:" + ",".join(f"{k}={v}" for k, v in mesh.items()) if mesh else "mixed"


# -- upload ----------------------------------------------------------------------------------------

def _bytes_of(t: torch.Tensor) -> memoryview:
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())


@dataclass
class _File:
    name: str
    parts: list[tuple[memoryview | bytes, int]] = field(default_factory=list)  # (bytes, padding)
    size: int = 0
    xxh3: str = ""


def _pack(snap: Snapshot, compression: Compression, file_bytes: int, prefix: str | None = None,
          on_file: Callable[[_File], None] | None = None, reuse: Mapping[tuple, list] | None = None,
          produced: dict[tuple, list] | None = None, apart: Container[tuple] = ()) -> tuple[list[_File], RankIndex]:
    """Lay the snapshot's chunks (compressed per the policy) and objects out in files of about
    ``file_bytes``, hashing each stored chunk and each file; return the files and the rank's index.

    ``on_file`` gets each file as soon as it is complete (hashed), before the next one is packed:
    the caller starts its upload there, so hashing and compressing file k+1 run while file k
    streams out (the pipeline of a save). A chunk in ``reuse`` (incremental saves,
    ``ckptd_client._incremental``) is not packed: its pieces, in files linked from the previous
    checkpoint, go into the index as they are, and those files into its file list. ``produced``
    receives every chunk's pieces as the index holds them. Chunks in ``apart`` (unchanged, yet written)
    are laid out first, in files of their own, so that the next save may link those whole.
    """
    files: list[_File] = []
    prefix = prefix or f"r{snap.rank:06d}"
    hashes: list[Any] = []
    kinds: list[bool] = []  # per file: holds ``apart`` chunks
    alone = False

    def finish(f: _File) -> None:
        f.xxh3 = hashes[-1].hexdigest()
        if on_file is not None:
            on_file(f)

    def current(n: int) -> _File:
        if not files or (files[-1].size and (files[-1].size + n > file_bytes or kinds[-1] != alone)):
            if files:
                finish(files[-1])
            files.append(_File(f"{prefix}-{len(files):04d}.bin"))
            hashes.append(xxhash.xxh3_64())
            kinds.append(alone)
        return files[-1]

    def place(data: memoryview | bytes) -> tuple[str, int]:
        f = current(len(data))
        offset = f.size
        pad = (-len(data)) % ALIGN
        f.parts.append((data, pad))
        f.size += len(data) + pad
        hashes[-1].update(data)  # right after the chunk's own hash: the same bytes, still in cache
        hashes[-1].update(_PAD[:pad])
        return f.name, offset

    policy = compression if isinstance(compression, CompressionPolicy) else None
    entries = []
    linked: dict[str, None] = {}
    order = sorted(snap.tensors, key=lambda t: not any(chunk_key(t.name, t.dtype, c.box, c.flat) in apart
                                                       for c in snap.chunks.get(t.name, []))) if apart else snap.tensors
    for t in order:
        chunks: list = []
        for c in snap.chunks.get(t.name, []):
            key = chunk_key(t.name, t.dtype, c.box, c.flat)
            alone = key in apart
            first = len(chunks)
            held = c.reused if c.reused is not None else reuse.get(key) if reuse is not None else None
            if held is not None:
                chunks += held
                linked.update(dict.fromkeys(p.location.file for p in held))
                if produced is not None:
                    produced[key] = chunks[first:]
                continue
            raw = _bytes_of(c.data)
            isz = c.data.element_size()
            if compression is None or (policy is not None and not policy.should_compress(raw, isz)):
                pieces = [(raw, c.box, c.flat, False)]
            else:  # independently decodable frames: a ranged read decodes only the ones it overlaps
                codec = "zstd" if compression == "zstd" else codec_for(isz)
                pieces = [(raw[lo * isz:(lo + n) * isz], box, flat, True)
                          for lo, n, box, flat in split_frames(isz, c.box, c.flat, FRAME_BYTES)]
            for data, box, flat, compress in pieces:
                stored: memoryview | bytes = data
                if compress:
                    packed = encode(data, codec, isz)
                    # "auto" keeps a frame raw when it did not shrink after all
                    stored = data if policy is not None and len(packed) >= len(data) else packed
                fname, off = place(stored)
                loc = Location(file=fname, offset=off, length=len(stored),
                               codec="raw" if stored is data else codec,
                               raw_length=len(data), xxh3=xxhash.xxh3_64_hexdigest(stored))
                if box is not None:
                    chunks.append(BoxChunk(rank=snap.rank, offsets=box[0], sizes=box[1], location=loc))
                else:
                    assert flat is not None
                    chunks.append(FlatChunk(rank=snap.rank, start=flat[0], length=flat[1], location=loc))
            if produced is not None:
                produced[key] = chunks[first:]
        entries.append(t.model_copy(update={"chunks": chunks}))
    where = {t.name: i for i, t in enumerate(snap.tensors)}
    entries.sort(key=lambda e: where[e.name])  # the snapshot's order, whichever the layout's
    alone = False
    objects = []
    for o in snap.objects:
        if o.encoding == "json":
            objects.append(ObjectEntry(name=o.fqn, rank=snap.rank, encoding="json", value=o.value))
        else:
            assert o.payload is not None
            fname, off = place(o.payload)
            loc = Location(file=fname, offset=off, length=len(o.payload), raw_length=len(o.payload),
                           xxh3=xxhash.xxh3_64_hexdigest(o.payload))
            objects.append(ObjectEntry(name=o.fqn, rank=snap.rank, encoding="torch", location=loc))
    if files:
        finish(files[-1])
    index = RankIndex(rank=snap.rank, world_size=snap.world, coords=snap.coords, mesh=snap.mesh,
                      layouts=snap.layouts, tensors=entries, objects=objects, param_groups=snap.param_groups,
                      files=[f.name for f in files] + list(linked))
    return files, index


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
                 delta: SaveDelta | None = None, direct: DirectUploads | None = None) -> RankIndex:
    """Pack the snapshot into files, stream them (several at once), return the rank's index.

    With ``direct`` (direct uploads, ``ckptd_client._presigned``), each file is PUT straight into the
    object store, until a fallback turns that off.
    With a :class:`CompressionPolicy`, the upload's throughput is fed back to it: the next save
    decides against the store as it is now.
    Once the service answers that this very session is committed (``committed`` is set, here or by the
    caller), the remaining files are packed and hashed but not sent: the index still comes back whole,
    for the service to compare with the one it committed.
    With ``delta`` (incremental saves, ``ckptd_client._incremental``), chunks unchanged since this
    rank's previous save to the run are linked, not written; ``delta.produced`` receives where every
    chunk's pieces are, for the caller to remember once the index is accepted.
    """
    committed = committed if committed is not None else threading.Event()
    starts: list[float] = []  # the upload's rate, for the compression policy, runs from the first PUT
    reuse = delta.link(transport, base, session, snap.rank) if delta is not None and not committed.is_set() \
        else None

    def send(f: _File) -> None:
        starts.append(time.perf_counter())
        if direct is not None and direct.enabled and direct.put(f.name, f.size, lambda: _pieces(f)):
            return
        transport.request("PUT", f"{base}/sessions/{session}/files/{f.name}", content=lambda: _stream(f),
                          headers={"X-Ckptd-Xxh3": f.xxh3, "Content-Length": str(f.size),
                                   "Content-Type": "application/octet-stream"})

    def put(f: _File) -> None:
        if committed.is_set():
            return
        try:
            send(f)
        except AlreadyCommitted as e:
            if not _ours(e, session):
                raise
            committed.set()

    # Each file's upload starts as soon as it is packed and hashed, while the next one is packed.
    with ThreadPoolExecutor(max(1, streams), thread_name_prefix="ckptd-upload") as pool:
        sent: list[Future] = []
        try:
            files, index = _pack(snap, compression, file_bytes, prefix,
                                 on_file=lambda f: sent.append(pool.submit(put, f)), reuse=reuse,
                                 produced=delta.produced if delta is not None else None,
                                 apart=delta.unchanged if delta is not None else ())
        except BaseException:
            for fut in sent:
                fut.cancel()
            raise
        for fut in sent:
            fut.result()  # the first failure, in file order
    if delta is not None:
        delta.written = {f.name: f.size for f in files}
    if isinstance(compression, CompressionPolicy) and starts and not committed.is_set():  # a whole upload's rate
        compression.observe(sum(f.size for f in files), time.perf_counter() - min(starts))
    return index


def upload_snapshot(transport: Transport, base: str, session: str, snap: Snapshot, step: int | None, *,
                    compression: Compression, file_bytes: int, streams: int,
                    direct_uploads: bool = False, history: ChunkHistory | None = None,
                    parent: str | None = None) -> SessionStatus:
    """Open-or-join (recording ``parent``), upload files, send the index; return the session status after it.

    A failure before the index is sent aborts the session (best effort): it cannot commit without
    this rank's index, so its staged files are deleted now instead of at the stale-session TTL, and
    the other ranks' waits end with the session gone instead of at their timeout.

    Run again with the same ``session`` (a save resumed after a crash), the upload may find that
    session already committed: the other ranks finished it with this rank's index from the earlier
    attempt. The rank then sends nothing but its index, which the service answers with the committed
    status when it equals the committed one, and refuses (``AlreadyCommitted``) when it differs.

    With ``history`` (incremental saves), unchanged chunks are linked from the rank's previous save
    to the run, and the history learns this save once the service accepted its index.
    """
    committed = threading.Event()
    ref = parse_ref(base.removeprefix("/v1/checkpoints/"))
    delta = history.begin(ref.run, ref.name, snap) if history is not None else None
    try:
        try:
            opened = open_session(transport, base, session, snap.world, step, parent=parent,
                                  direct_uploads=direct_uploads)
        except AlreadyCommitted as e:
            if not _ours(e, session):
                raise
            opened = Opened()
            committed.set()
        direct = DirectUploads(transport, base, session, transport.timeout) if opened.presigned else None
        try:
            index = upload_files(transport, base, session, snap, compression=compression, file_bytes=file_bytes,
                                 streams=streams, committed=committed, delta=delta,
                                 direct=direct)
        finally:
            if direct is not None:
                direct.close()
    except Exception:
        abort_session(transport, base, session)
        raise
    status = put_index(transport, base, session, index)
    if history is not None and delta is not None:
        history.remember(delta)
    return status


class SaveHandle:
    """A save in flight. ``wait()`` returns once the checkpoint is committed, or raises why not."""

    def __init__(self, ref: str, session: str, future: Future, transport: Transport, base: str) -> None:
        self.ref, self.session = ref, session
        self._future, self._transport, self._base = future, transport, base
        self._status: SessionStatus | None = None
        self._observed = False
        self._lock = threading.Lock()

    def done(self) -> bool:
        """True once the save is over: committed, or failed (``wait()`` then returns or raises at once)."""
        if self._status is not None and self._status.state != "open":
            return True
        if not self._future.done():
            return False
        return self._future.exception() is not None or self._future.result().state != "open"

    @property
    def failed_unobserved(self) -> bool:
        return not self._observed and self._future.done() and self._future.exception() is not None

    @property
    def unreported(self) -> bool:
        """True while nobody waited and the save is not known to be committed (in flight, or failed)."""
        if self._observed:
            return False
        if not self._future.done():
            return True
        return self._future.exception() is not None or self._future.result().state != "committed"

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
