"""``torch.distributed.checkpoint`` storage writer and reader backed by ckptd.

``dcp.save`` / ``dcp.async_save`` / ``dcp.load`` run unchanged on top of the
commit protocol::

    dcp.save(sd, storage_writer=client.dcp_writer("gpt/1000"))
    dcp.load(sd, storage_reader=client.dcp_reader("gpt/latest"))

Writer call order (DCP's): ``set_up_storage_writer`` -> ``prepare_local_plan``
(carries the rank's ref) -> ``prepare_global_plan`` (coordinator: checks that every
rank saves the same ref, else ``CollectiveMismatch`` on every rank naming the ranks
of each; draws the session id all ranks use)
-> ``write_data`` (every rank: snapshot, hash, stream its files; returns its
chunk index inside the WriteResults) -> ``finish`` (coordinator: stores DCP's
own metadata, sends every rank's index; the last one commits atomically).
Objects (DCP's ``BYTE_IO`` items: one value per key after DCP's dedup) are
stored as global, so any rank at any world size loads them, through DCP or
``CheckpointClient.load``. ``dcp.async_save`` works with both executors: the
writer pickles without its connection (process executor). Give async saves
their own process group (``dist.new_group(backend="gloo")``) so that their
collectives never interleave with training's.

Reader: ``read_metadata`` returns the DCP metadata saved with the checkpoint,
or one synthesised from the manifest (so checkpoints saved by
``CheckpointClient.save`` load through DCP too); ``read_data`` plans the byte
ranges of exactly the regions DCP's planner wants (any world size) as the load
does (``_loadtree``), verifies them block by block and copies them in place. Every
rank reads the checkpoint the coordinator resolved (``RUN/latest`` is pinned
through the load plan), once the coordinator has checked that every rank asked for
the same ref (``CollectiveMismatch`` otherwise). Nothing is unpickled without restriction: the stored
metadata is loaded with ``weights_only=True`` and DCP's metadata classes
allowed, and each object is decoded under the reader's object policy
(``ckptd_schemas.format.objects``) and re-encoded before DCP's planner (which calls
``torch.load(weights_only=False)``) sees it. The writer refuses, at save, an
object that would need an unrestricted unpickler.
"""

from __future__ import annotations

import dataclasses
import io
import logging
import uuid
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata, ChunkStorageMetadata, Metadata, StorageMeta, TensorProperties, TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import (
    LoadItemType, LoadPlan, LoadPlanner, SavePlan, SavePlanner, WriteItemType,
)
from torch.distributed.checkpoint.storage import StorageReader, StorageWriter, WriteResult
from torch.futures import Future

from ckptd_schemas import (
    Box, CkptdError, CorruptCheckpoint, IntegrityError, InvalidRequest, Manifest,
    ObjectEntry, RankIndex, ReadRequest, StateDictMismatch, TensorEntry, check_new_name, parse_ref,
)

from .codec import CompressionPolicy, compression_of
from .transport import Transport
from ._placement import dtype_name
from ._manifest import get_manifest
from ._save import SaveWays, Snapshot, _Chunk, _Object, upload_files, ways_in
from .session_calls import open_session, put_index, wait_committed
from ._damage import reported
from ._lease import LoadLease
from ._load import execute, local_files, stored_object
from ._loadtree import Pieces, fetch_head, fetch_pieces
from ._join import mismatch
from ._dist import rank_and_world
from ckptd_schemas.names import DCP_METADATA
from ckptd_schemas.format.assemble import Destination, torch_dtype
from ckptd_schemas.format.objects import SAFE, ObjectPolicy, check_payload, load_dcp_metadata, reencode_for_dcp

__all__ = ["DCP_METADATA", "CkptdStorageReader", "CkptdStorageWriter"]

log = logging.getLogger("ckptd_client")



@dataclasses.dataclass(frozen=True)
class _PlanData:
    session: str
    rank: int
    world: int


@dataclasses.dataclass(frozen=True)
class _RankResult:
    """Carried from each rank's write_data to the coordinator's finish inside a WriteResult."""

    session: str
    index_json: str


class _Endpoint:
    """Connection settings that survive pickling (``dcp.async_save`` with a process executor)."""

    def __init__(self, url: str, ref: str, token: str | None, streams: int) -> None:
        self.url, self.ref, self.token, self.streams = url, ref, token, streams
        self._transport: Transport | None = None

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_transport": None}

    @property
    def transport(self) -> Transport:
        if self._transport is None:
            self._transport = Transport(self.url, token=self.token)
        return self._transport

    def set_ref(self, checkpoint_id: Any) -> None:
        if checkpoint_id is not None:
            self.ref = str(checkpoint_id)
        r = parse_ref(self.ref)
        if isinstance(self, CkptdStorageWriter):
            check_new_name(r.name)  # not RUN/latest, in any case

    @property
    def base(self) -> str:
        r = parse_ref(self.ref)
        return f"/v1/checkpoints/{r.run}/{r.name}"


def _done(value: Any) -> Future:
    fut: Future = Future()
    fut.set_result(value)
    return fut


class CkptdStorageWriter(_Endpoint, StorageWriter):
    """DCP ``StorageWriter``; ``compression``, ``direct_uploads``, ``local_uploads`` and ``parent`` as for
    :class:`CheckpointClient` (``compression``: ``None``, ``"zstd"``, ``"auto"`` or a
    ``CompressionPolicy``, which then learns this writer's upload throughput). ``ways``: which way this
    rank's bytes of the last save went (:class:`~ckptd_client._save.SaveWays`, as ``SaveHandle.ways``)."""

    def __init__(self, url: str, ref: str, *, token: str | None = None,
                 compression: str | CompressionPolicy | None = None, file_bytes: int = 256 << 20,
                 streams: int = 4, direct_uploads: bool = True, local_uploads: bool = True,
                 objects: ObjectPolicy = SAFE, parent: str | None = None) -> None:
        _Endpoint.__init__(self, url, ref, token, streams)
        self.parent = parent  # recorded by every checkpoint this writer saves (CheckpointClient.save's ``parent``)
        self.compression, self.file_bytes = compression_of(compression), file_bytes
        self.direct_uploads, self.local_uploads = direct_uploads, local_uploads
        self.objects = objects
        self.is_coordinator = False
        self.ways = SaveWays()
        self.set_ref(None)

    def reset(self, checkpoint_id: Any = None) -> None:
        self.set_ref(checkpoint_id)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
        try:
            return not parse_ref(str(checkpoint_id)).is_latest
        except CkptdError:
            return False

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        if kwargs.get("use_collectives", True) is False:
            raise InvalidRequest(f"{self.ref}: dcp.save(..., use_collectives=False) is not supported by ckptd: "
                                 f"the ranks must agree on one upload session", ref=self.ref)
        self.is_coordinator = is_coordinator

    def storage_meta(self) -> StorageMeta | None:
        return StorageMeta(checkpoint_id=self.ref)

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        return dataclasses.replace(plan, storage_data=self.ref)  # for the coordinator to compare

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        _same_ref("save", [p.storage_data for p in plans])
        session = uuid.uuid4().hex
        return [dataclasses.replace(p, storage_data=_PlanData(session, i, len(plans))) for i, p in enumerate(plans)]

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        pd: _PlanData = plan.storage_data
        snap = Snapshot(pd.rank, pd.world)
        sizes: list[tuple[Any, int]] = []
        for item in plan.items:
            fqn = item.index.fqn
            if item.type == WriteItemType.BYTE_IO:
                data = planner.resolve_data(item)
                payload = data.getvalue() if isinstance(data, io.BytesIO) else bytes(data.read())
                check_payload(fqn, payload, self.objects)  # loads with weights_only=True, or UnsafeObject now
                snap.objects.append(_Object(fqn, "torch", payload=payload))
                sizes.append((item.index, len(payload)))
                continue
            td = item.tensor_data
            assert td is not None
            t = planner.resolve_data(item).detach()
            if t.device.type == "cpu" and t.is_contiguous() and tuple(t.shape) == tuple(td.chunk.sizes):
                data = t  # uploaded before write_data returns (async_save hands over its own staged copy)
            else:
                data = torch.empty(tuple(td.chunk.sizes), dtype=t.dtype, device="cpu")
                data.copy_(t)
            snap.tensors.append(TensorEntry(name=fqn, shape=list(td.size), dtype=dtype_name(td.properties.dtype),
                                            group=fqn.split(".", 1)[0], chunks=[]))
            if data.numel():
                snap.chunks.setdefault(fqn, []).append(
                    _Chunk(fqn, data, (list(td.chunk.offsets), list(td.chunk.sizes)), None))
            sizes.append((item.index, data.numel() * data.element_size()))
        name = parse_ref(self.ref).name  # a NAME of digits is the step
        opened = open_session(self.transport, self.base, pd.session, pd.world, int(name) if name.isdigit() else None,
                              parent=self.parent, direct_uploads=self.direct_uploads)
        self.ways = SaveWays()
        with ways_in(self.transport, self.base, pd.session, opened, local_uploads=self.local_uploads) as offered:
            index = upload_files(self.transport, self.base, pd.session, snap, compression=self.compression,
                                 file_bytes=self.file_bytes, streams=self.streams, ways=self.ways, **offered)
        log.info("uploaded %s rank %d (session %s): %s", self.ref, pd.rank, pd.session, self.ways)
        # DCP keeps one value per key (its planner dedups replicated items), so every object is global:
        # any rank, at any world size, may load it (client.load included).
        index = index.model_copy(update={"tensors": _merge_entries(index.tensors),
                                         "objects": [o.model_copy(update={"rank": None}) for o in index.objects]})
        carried = _RankResult(pd.session, index.model_dump_json())
        results = [WriteResult(index=ix, size_in_bytes=n, storage_data=None) for ix, n in sizes]
        if results:
            results[0] = dataclasses.replace(results[0], storage_data=carried)
        else:
            results = [WriteResult(index=None, size_in_bytes=0, storage_data=carried)]  # type: ignore[arg-type]
        return _done(results)

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        """Coordinator: store DCP's metadata, send every rank's index, wait for the commit."""
        carried: list[_RankResult] = []
        for rank_results in results:
            found = next((r.storage_data for r in rank_results if isinstance(r.storage_data, _RankResult)), None)
            if found is None:
                raise CkptdError(f"{self.ref}: a rank returned no ckptd index from write_data")
            carried.append(found)
        indexes = [RankIndex.model_validate_json(c.index_json) for c in carried]
        session = carried[0].session
        buf = io.BytesIO()
        torch.save(dataclasses.replace(metadata, storage_data=None), buf)
        meta_snap = Snapshot(0, len(indexes), objects=[_Object(DCP_METADATA, "torch", payload=buf.getvalue())])
        meta_index = upload_files(self.transport, self.base, session, meta_snap, compression=None,
                                  file_bytes=self.file_bytes, streams=1, prefix="dcp-metadata")
        extra = [o.model_copy(update={"rank": None}) for o in meta_index.objects]
        indexes[0] = indexes[0].model_copy(update={"objects": indexes[0].objects + extra,
                                                   "files": indexes[0].files + meta_index.files})
        status = None
        for ix in indexes:
            status = put_index(self.transport, self.base, session, ix)
        assert status is not None
        wait_committed(self.transport, self.base, self.ref, status, None)


def _same_ref(call: str, refs: list[Any]) -> None:
    """Coordinator, in ``prepare_global_plan``: every rank's local plan carries the checkpoint that rank
    was given; when they differ, raise ``CollectiveMismatch`` naming the ranks of each, which DCP
    raises on every rank (in its ``CheckpointException``) before any session is opened."""
    calls: dict[str, list[int]] = {}
    for rank, ref in enumerate(refs):
        if isinstance(ref, str):
            calls.setdefault(f"{call} {ref}", []).append(rank)
    if len(calls) > 1:
        raise mismatch(calls)


def _merge_entries(entries: list[TensorEntry]) -> list[TensorEntry]:
    """DCP may give one rank several chunks of a tensor: one entry per tensor."""
    out: dict[str, TensorEntry] = {}
    for e in entries:
        prev = out.get(e.name)
        out[e.name] = e if prev is None else prev.model_copy(update={"chunks": prev.chunks + e.chunks})
    return list(out.values())


# -- reader -----------------------------------------------------------------------------------------

def _synthesise(manifest: Manifest) -> Metadata:
    """DCP metadata for a checkpoint ckptd's client saved (flat ranges become boxes)."""
    md: dict[str, Any] = {}
    for t in manifest.tensors:
        boxes: dict[Box, None] = {}
        for c in t.chunks:
            for b in c.region.boxes(t.shape):
                boxes[b] = None
        md[t.name] = TensorStorageMetadata(
            properties=TensorProperties(dtype=torch_dtype(t.dtype)), size=torch.Size(t.shape),
            chunks=[ChunkStorageMetadata(offsets=torch.Size(b.offsets), sizes=torch.Size(b.sizes)) for b in boxes])
    for o in manifest.objects:  # every object, also one that only some ranks saved (a pipeline stage's)
        if o.name != DCP_METADATA:
            md[o.name] = BytesStorageMetadata()
    return Metadata(state_dict_metadata=md)


def _reconcile(md: Metadata, manifest: Manifest) -> Metadata:
    """The stored DCP metadata, with dtypes taken from the manifest (``ckptd reshard --dtype`` casts the data
    but carries the objects, this one included, unchanged)."""
    for t in manifest.tensors:
        entry = md.state_dict_metadata.get(t.name)
        if isinstance(entry, TensorStorageMetadata) and dtype_name(entry.properties.dtype) != t.dtype:
            entry.properties = dataclasses.replace(entry.properties, dtype=torch_dtype(t.dtype))
    return md


class CkptdStorageReader(_Endpoint, StorageReader):
    def __init__(self, url: str, ref: str, *, token: str | None = None, streams: int = 4,
                 direct_reads: bool = True, objects: ObjectPolicy = SAFE) -> None:
        _Endpoint.__init__(self, url, ref, token, streams)
        self.direct_reads = direct_reads
        self.objects = objects
        self._manifest: Manifest | None = None
        self._rank: int | None = None
        self._lease: LoadLease | None = None  # this rank's read lease, first request to end of read_data
        self.set_ref(None)
        self._asked = self.ref  # as given (``RUN/latest`` too): what the ranks must agree on

    def __getstate__(self) -> dict:
        return {**super().__getstate__(), "_lease": None}

    def reset(self, checkpoint_id: Any = None) -> None:
        self._release()
        self.set_ref(checkpoint_id)
        if checkpoint_id is not None:
            self._asked = self.ref
        self._manifest = None

    def _release(self) -> None:
        """End this rank's read lease: the checkpoint is no longer pinned by this load (``rm`` and gc may
        take it at once). DCP's reader has no closing call; ``read_data``, a rank's last, ends it."""
        if self._lease is not None:
            lease, self._lease = self._lease, None
            lease.close()

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
        try:
            parse_ref(str(checkpoint_id))
            return True
        except CkptdError:
            return False

    def _get_manifest(self) -> Manifest:
        """The manifest, under one read lease this rank holds until its ``read_data`` returns: named from
        the first request (the manifest of ``latest`` included), renewed while it reads, so the service
        leases nothing on its own account beyond this load (``ckptd_client._lease.LoadLease``)."""
        if self._manifest is None:
            r = parse_ref(self.ref)
            if self._lease is None:
                self._lease = LoadLease(self.transport, r.run, r.name)
            self._manifest = Manifest.model_validate_json(get_manifest(self.transport, r.run, r.name)[0])
            self.ref = f"{r.run}/{self._manifest.name}"  # pin RUN/latest to what it resolved to
            self._lease.hold(self.base)
        return self._manifest

    def _pin(self, ref: Any) -> None:
        """Use the checkpoint the coordinator resolved (``RUN/latest`` may move between ranks' reads)."""
        if isinstance(ref, str) and ref != self.ref and not parse_ref(ref).is_latest:
            self._release()
            self.ref, self._manifest = ref, None

    def read_metadata(self) -> Metadata:
        m = self._get_manifest()
        stored = next((o for o in m.objects if o.name == DCP_METADATA), None)
        if stored is not None:
            data = stored_object(self.transport, self.base, stored, self.ref)
            md = None if data is None else load_dcp_metadata(data, key=DCP_METADATA, ref=self.ref, policy=self.objects)
            if not isinstance(md, Metadata):
                raise IntegrityError(f"{self.ref}: object {DCP_METADATA!r} is not DCP metadata "
                                     f"({type(md).__name__})", ref=self.ref, key=DCP_METADATA)
            md = _reconcile(md, m)
        else:
            md = _synthesise(m)
        md.storage_meta = StorageMeta(checkpoint_id=self.ref)
        return md

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self.is_coordinator = is_coordinator
        self._rank = kwargs.get("rank")
        if metadata.storage_meta is not None:
            self._pin(metadata.storage_meta.checkpoint_id)

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return dataclasses.replace(plan, storage_data=self._asked)  # for the coordinator to compare

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        _same_ref("load", [p.storage_data for p in plans])
        return [dataclasses.replace(p, storage_data=self.ref) for p in plans]  # the coordinator's checkpoint

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        try:
            return self._read_data(plan, planner)
        except CorruptCheckpoint as e:  # the service re-checks and records it: `latest` moves past it
            raise reported(self.transport, self.base, e) from e
        finally:
            self._release()  # the rank's last call: its lease ends with its reads

    def _read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        self._pin(plan.storage_data)
        m = self._get_manifest()
        rank = self._rank if self._rank is not None else rank_and_world()[0]
        objects: dict[str, ObjectEntry] = {}
        for o in m.objects:
            if o.rank is None or o.rank == rank or o.name not in objects:
                objects[o.name] = o
        tensor_items = [it for it in plan.items if it.type != LoadItemType.BYTE_IO]
        for it in plan.items:
            if it.type == LoadItemType.BYTE_IO:
                o = objects.get(it.storage_index.fqn)
                if o is None:
                    raise StateDictMismatch(f"checkpoint {m.ref} has no object {it.storage_index.fqn!r}",
                                            key=it.storage_index.fqn)
                # torch.save bytes for DCP's planner (which unpickles them without restriction), decoded
                # under this reader's object policy first: they hold nothing the policy refuses
                data = stored_object(self.transport, self.base, o, self.ref)
                planner.load_bytes(it, io.BytesIO(reencode_for_dcp(o, data, ref=self.ref, policy=self.objects)))
        if not tensor_items:
            return _done(None)
        requests, dests, targets = [], [], []
        for it in tensor_items:
            t = m.tensor(it.storage_index.fqn)
            if t is None:
                raise StateDictMismatch(f"checkpoint {m.ref} has no tensor {it.storage_index.fqn!r}",
                                        tensor=it.storage_index.fqn)
            base = list(it.storage_index.offset or [0] * len(t.shape))
            offsets = [b + o for b, o in zip(base, it.storage_offsets)]
            target = planner.resolve_tensor(it).detach()
            requests.append(ReadRequest(name=t.name, offsets=offsets, sizes=list(it.lengths)))
            dests.append(Destination(target, t.shape, box_offsets=offsets))
            targets.append(target)
        # planned here as the load plans, from rows checked against the marker (the load tree's, where the
        # checkpoint has one: with this host's file paths for direct reads), never from the service's word
        found = fetch_head(self.transport, parse_ref(self.ref).run, m.name)
        rp = (Pieces(m, {}, None, 0) if found is None else fetch_pieces(
            self.transport, self.base, found.head, requests, [], rank, local_paths=self.direct_reads)).plan(requests)
        files = local_files(rp, m)
        try:  # every block verified, from this host's files (direct reads) or over HTTP
            execute(self.transport, self.base, rp, dests, self.streams, files)
        finally:
            if files is not None:
                files.close()
        for it, target in zip(tensor_items, targets):
            planner.commit_tensor(it, target)
        return _done(None)
