"""CheckpointClient: the trainer-side entry point."""

from __future__ import annotations

import contextlib
import threading
import uuid
from typing import TYPE_CHECKING, Sequence
from concurrent.futures import ThreadPoolExecutor

from ckptd_schemas import CommitFailed, InvalidName, SessionStatus, check_new_name, parse_ref

from .catalog import CatalogClient
from .codec import CompressionPolicy, compression_of
from ._dist import agree, any_ranks, check, failure, rank_and_world
from ._join import joined
from .transport import Transport
from ._load import LoadReport, load_into
from ._pool import SnapshotPool
from ._incremental import ChunkHistory, link_early
from .session_calls import Opened, open_session
from ._save import SaveHandle, SaveWays, Snapshot, build_snapshot, upload_snapshot
from ckptd_schemas.format.objects import ObjectPolicy, SafeGlobal
from ._flatten import flatten
from ._saveplan import ReplicaWriters, plain_tensors

if TYPE_CHECKING:
    from .dcp import CkptdStorageReader, CkptdStorageWriter

__all__ = ["CheckpointClient"]


STALL_REQUEST_S = 0.5
"""Timeout of each request a save makes before it returns (incremental saves link unchanged chunks
then, so that they need no copy); past it the chunks are copied and sent as usual."""


def _upload_then_release(transport: Transport, base: str, session: str, snap: Snapshot, step: int | None,
                         **kw: object) -> SessionStatus:
    """The background save: the buffers go back inside the task, before its future completes, so a
    caller that saw ``wait()`` return finds the pool free (a done-callback could run after that)."""
    try:
        return upload_snapshot(transport, base, session, snap, step, **kw)  # type: ignore[arg-type]
    finally:
        snap.release()


def _call(what: str, ref: str, **options: object) -> str:
    """What the ranks of a collective call must agree on, as one line (``save gpt/10``, ``save gpt/10
    parent=pre/9``): the options that are not at their defaults."""
    defaults = {"step": None, "parent": None, "share_replicas": True}
    said = " ".join(f"{k}={v}" for k, v in options.items() if v != defaults.get(k))
    return f"{what} {ref}" + (f" {said}" if said else "")


def _reasons(err: BaseException | str | None, world: int) -> str:
    """Collective (every rank of a failed save calls it): what the lowest failing rank raised, named by
    rank, and how many others failed; a few fixed-size collectives whatever the world size."""
    mine = None if err is None else err if isinstance(err, str) else f"{type(err).__name__}: {err}"
    if world == 1:
        return str(mine)
    first = check(mine is not None)[0]
    if first is None:
        return "no rank says why"
    message, _, count = failure(first, mine)
    return f"rank {first}: {message}" + (f"; {count - 1} other rank{'s' if count > 2 else ''} failed too"
                                         if count > 1 else "")


class CheckpointClient(CatalogClient):
    """Save and load sharded state through a ckptd service.

    ``save`` and ``load`` are collective when torch.distributed is initialised:
    every rank calls them with its own shards, in the same order.

    Args:
        url, token, retry_seconds, timeout: as for :class:`CatalogClient` (the service, or several
            replicas of it; the bearer token; how long transient failures are retried; one request's limit).
        compression: ``None`` (store raw), ``"planes"`` (always: byte planes, Blosc2 shuffle then
            zstd-1, for elements of two bytes or more, zstd-1 for one-byte dtypes), ``"zstd"``
            (always plain zstd-1), or ``"auto"``: per chunk, the ``"planes"`` codec only where a timed
            sample says compressing plus uploading the smaller result beats uploading raw at this
            client's observed upload throughput (so raw on a fast local disk, compressed on a slow
            remote store; see ``ckptd_client.codec``). A ``CompressionPolicy`` instance may be given
            to set the assumed store throughput. Compressed chunks are stored as independently
            decodable frames of at most 4 MiB raw, so ranged reads decode only what they need.
        streams: concurrent HTTP streams per rank for uploads and ranged reads.
        file_bytes: target size of each uploaded data file.
        snapshot_bytes: the host buffer that save snapshots are copied into, kept across saves so
            that ``save()``'s stall is one copy without page faults (pinned when CUDA is available).
            ``None`` (default): sized from what this rank copies at its first save, and again when
            that changes (grown, or replaced by a smaller one once the state is under half of it),
            at most ``snapshot_max_bytes`` (with CUDA, pinning is not done in a save: the first save copies
            into fresh memory and the buffer is pinned in a background thread after its upload, in
            segments). A number: a buffer of that size, allocated here (with CUDA: from here on, in the
            background). ``0``:
            no buffer, fresh memory per save, freed after its upload. The buffer serves one save at
            a time: a save while the previous one still uploads, or chunks that do not fit, use
            fresh memory (see ``ckptd_client._pool``). Freed by ``close()``.
        snapshot_max_bytes: cap of the sized-from-the-save buffer; default ``$CKPTD_SNAPSHOT_MAX_BYTES``,
            else half of this machine's memory (or its container's limit) over ``$LOCAL_WORLD_SIZE``.
        incremental: a chunk this rank saved unchanged at its previous save to the same run (frozen
            weights: a backbone under LoRA or adapters, embeddings) is not written again: the new
            checkpoint links the file that holds it (a hard link on a local root, a copy inside the
            store on S3; the service checks the link) and only changed chunks are sent. Unchanged
            means the same tensor, dtype, region and 128-bit content digest (XXH3-128). Each
            checkpoint stays complete on its own (``ckptd_client._incremental``). ``False``: every
            save writes every chunk.
        direct_reads: when the service's root is a local directory that this host can open (same
            host, or a shared filesystem mounted at the same path), ``load`` reads the data files
            itself instead of through HTTP, verifying the same block digests; a file it cannot open,
            or bytes that fail their digests there but pass over HTTP, fall back to HTTP
            (``ckptd_client._files``). ``False``: always HTTP.
        direct_uploads: where the service offers them (an object store root, opted in there with
            ``CKPTD_DIRECT_UPLOADS``), ``save`` PUTs each data file straight into it through a presigned
            URL with its SHA-256 signed in, and the service reads every byte back at the commit
            (``ckptd_client._presigned``); a presign, PUT or confirmation that fails falls back to
            HTTP through the service. ``False``: always through the service.
        local_uploads: when the service runs on this host (the session's answer names its Unix socket
            and this kernel), ``save`` hands each data file over as a memory file sealed against any
            change, which the service reads once instead of receiving an HTTP body: the same checks,
            less of the service's CPU per byte (``ckptd_client._handover``); a socket it cannot reach
            sends the files over HTTP. ``False``: always HTTP.
        share_replicas: in a distributed load, a region that several ranks of one host need (plain
            replicated tensors, ``Replicate`` DTensor copies) is read by one of them and sent to the
            others over torch.distributed, unless all of that host's ranks read the service's files
            directly (the page cache already shares them). Must be the same on every rank.
        safe_globals: classes and functions added, for this client, to the allow-list of
            ``torch.load(weights_only=True)`` that non-tensor objects are saved for and loaded with
            (as for ``torch.serialization.add_safe_globals``, which is honoured too). Only list what is
            harmless to construct from untrusted data. See ``ckptd_schemas.format.objects`` and docs/security.md.
        trust_objects: ``False`` (default): an object that needs an unrestricted unpickler (a ``pickle``
            payload, or ``torch.save`` data naming anything outside the allow-list) is refused with
            ``UnsafeObject`` naming its key, at save and at load, so loading never runs code from a
            checkpoint. ``True`` loads and saves such objects anyway, with a ``TrustedObjectWarning``:
            only for checkpoints whose writers are trusted like the training code itself.
        join_seconds: how long a collective ``save`` or ``load`` waits for every rank to make the same
            call before raising ``CollectiveMismatch`` on every rank that came, naming the ranks that
            did not (``ckptd_client._join``); longer while a missing rank is still inside the previous
            collective call. Raise it when a rank may reach a save that much later than the others
            (an evaluation that runs on rank 0 alone just before it).
    """

    def __init__(self, url: str | Sequence[str] | None = None, *, token: str | None = None,
                 compression: str | CompressionPolicy | None = None, streams: int = 4,
                 file_bytes: int = 256 << 20, retry_seconds: float = 120.0, timeout: float = 300.0,
                 snapshot_bytes: int | None = None, snapshot_max_bytes: int | None = None,
                 incremental: bool = True, direct_reads: bool = True,
                 direct_uploads: bool = True, local_uploads: bool = True,
                 share_replicas: bool = True,
                 safe_globals: Sequence[SafeGlobal] = (), trust_objects: bool = False,
                 join_seconds: float = 60.0) -> None:
        super().__init__(url, token=token, retry_seconds=retry_seconds, timeout=timeout)
        self.compression = compression
        self._codec = compression_of(compression)  # one policy per client: it learns across saves
        self.streams = streams
        self.file_bytes = file_bytes
        self._uploader = ThreadPoolExecutor(1, thread_name_prefix="ckptd-save")
        self._pending: list[SaveHandle] = []  # saves whose outcome nobody has seen yet
        self._lock = threading.Lock()
        if snapshot_bytes is not None and snapshot_bytes < 0:
            raise ValueError(f"snapshot_bytes must be None, 0 or positive, not {snapshot_bytes}")
        self.snapshot_pool = (SnapshotPool(snapshot_bytes or None, max_bytes=snapshot_max_bytes)
                              if snapshot_bytes != 0 else None)
        self.history = ChunkHistory() if incremental else None  # what this rank stored at its last save
        self.direct_reads = direct_reads
        self.direct_uploads, self.local_uploads = direct_uploads, local_uploads
        self.share_replicas = share_replicas
        self.objects = ObjectPolicy.of(trust_objects, safe_globals)  # warns once when trust_objects=True
        self._writers = ReplicaWriters()  # who writes each plain tensor, kept while no rank's keys change
        self.join_seconds = join_seconds

    # -- save ------------------------------------------------------------------
    def save(self, state_dict: dict, ref: str, *, step: int | None = None, parent: str | None = None) -> SaveHandle:
        """Snapshot this rank's shards and return; the upload continues in the background.

        ``ref`` is ``RUN/NAME``; trainer saves use the step number as NAME, which
        is also the default ``step``. ``parent``: ``RUN/NAME`` of the checkpoint of
        another run this run started from (a fine-tune of a pretrained checkpoint, a
        job resumed under a new run name; ``client.load(...).ref`` names what a load
        resolved to). It is recorded in the marker and the manifest, ``ckptd show``
        prints the chain, and retention keeps the parent while this checkpoint is
        visible. Raises an earlier save's error if it failed and nobody waited on it
        (each failure once).

        Collective: the ranks first check that every one of them saves the same ``ref`` (``step``
        and ``parent`` too) within ``join_seconds``; else every rank that came raises
        ``CollectiveMismatch`` naming each group's call and the ranks that did not join, before any
        session is opened.
        """
        name = str(ref).rsplit("/", 1)[-1]
        implied = int(name) if name.isdigit() else None  # the step a digits NAME gives
        with joined(_call("save", ref, step=None if step == implied else step, parent=parent), self.join_seconds):
            return self._save(state_dict, ref, step=step, parent=parent)

    def _save(self, state_dict: dict, ref: str, *, step: int | None, parent: str | None) -> SaveHandle:
        r = parse_ref(ref)
        check_new_name(r.name)  # not RUN/latest, in any case
        if parent is not None:
            p = parse_ref(parent)
            if p.is_latest or p.run == r.run:
                raise InvalidName(f"parent {parent!r}: name a checkpoint of another run, not RUN/latest "
                                  f"(client.load(...).ref gives the name a load resolved to)", ref=parent)
        if step is None and r.name.isdigit():
            step = int(r.name)
        with self._lock:
            self._pending = [h for h in self._pending if h.unreported]
            failed = next((h for h in self._pending if h.failed_unobserved), None)
            if failed is not None:
                self._pending.remove(failed)
        rank, world = rank_and_world()
        try:
            flat = flatten(state_dict)  # once per save: the writers' agreement and the snapshot's plan
            plain, signature = plain_tensors(flat, rank, world)
            refused: Exception | None = None
        except Exception as e:  # noqa: BLE001 - raised below, once every rank knows
            flat, plain, signature, refused = None, {}, "", e
        # Every rank raises, or none: a rank that raised alone would leave the others blocked in
        # the collectives below. The same all-reduce tells every rank whether some rank's plain
        # tensors changed since their writers were last agreed (``_saveplan.ReplicaWriters``), and gives every rank
        # rank 0's session id.
        (stop, stale), token = agree((failed is not None or refused is not None, self._writers.stale(signature)),
                                     uuid.uuid4().bytes)
        if stop:
            why = _reasons(refused if refused is not None else failed and "an earlier save failed", world)
            if refused is not None:
                raise refused
            if failed is not None:
                failed.wait()  # raises the stored failure
            raise CommitFailed(f"{ref} was not started: {why}", ref=ref)
        session = token.hex()
        owners = self._writers.owners(plain, signature, refresh=stale, rank=rank, world=world)  # the global step
        base = f"/v1/checkpoints/{r.run}/{r.name}"
        link = None
        opened: Opened | None = None  # the session as the stall opened it: the upload does not open it again
        stall_keys = self.history.stall_keys(r.run, r.name) if self.history is not None else frozenset()
        if stall_keys:
            def link(digests: dict) -> dict:
                nonlocal opened
                source, candidates = self.history.candidates(r.run, r.name, digests)  # type: ignore[union-attr]
                if not candidates or source is None:
                    return {}
                opened, linked = link_early(lambda: open_session(
                    self._transport, base, session, world, step, parent=parent, direct_uploads=self.direct_uploads,
                    retry=False, timeout=STALL_REQUEST_S), self._transport, base, session, rank, source, candidates,
                    STALL_REQUEST_S)
                return linked
        try:
            snap = build_snapshot(flat, rank, world, self.snapshot_pool, owners=owners,
                                  objects=self.objects, link=link, stall_keys=stall_keys)
            refused = None
        except Exception as e:  # noqa: BLE001 - raised below, once every rank knows
            refused = e
        # An object refused while snapshotting (``UnsafeObject``) on one rank: every rank raises
        # before any uploads, rather than the others waiting for a session that cannot commit.
        if any_ranks(refused is not None)[0]:
            why = _reasons(refused, world)
            if refused is not None:
                raise refused
            snap.release()
            raise CommitFailed(f"{ref} was not started: {why}", ref=ref)
        ways = SaveWays()
        try:
            future = self._uploader.submit(_upload_then_release, self._transport, base, session, snap, step,
                                           compression=self._codec, file_bytes=self.file_bytes,
                                           streams=self.streams, direct_uploads=self.direct_uploads,
                                           history=self.history, parent=parent, opened=opened,
                                           local_uploads=self.local_uploads, ways=ways)
        except BaseException:
            snap.release()
            raise
        handle = SaveHandle(str(r), session, future, self._transport, base, ways)
        with self._lock:
            self._pending.append(handle)
        return handle

    # -- load ------------------------------------------------------------------
    def load(self, state_dict: dict, ref: str, *, strict: bool = True, cover: bool = False) -> LoadReport:
        """Fill ``state_dict`` in place from ``ref`` (``RUN/latest`` allowed), at any world size.

        ``strict`` (collective in a distributed load): every key of every rank's state dict must be
        in the checkpoint with its shape and dtype. A state dict may hold any subset of the checkpoint
        (the model alone from a checkpoint that also holds optimizer state; a pipeline stage; a ZeRO
        slice), as with DCP; ``LoadReport.uncovered`` lists the checkpoint's keys that no rank
        restored. ``cover=True`` also requires the ranks' keys together to cover every tensor and
        object of the checkpoint. A failure raises on every rank, naming the keys;
        ``LoadReport.coverage_ranks`` says across how many ranks the keys were gathered
        (``ckptd_client._coverage``).

        Objects are decoded without running code (``trust_objects``); a refused one raises ``UnsafeObject``.

        A load whose ranks exchange anything (``strict``, ``cover`` or ``share_replicas``: the
        default) first checks, as ``save`` does, that every rank loads the same ``ref`` (and
        ``share_replicas``) within ``join_seconds`` (``CollectiveMismatch`` on every rank that came,
        otherwise).
        """
        together = self.share_replicas or strict or cover
        call = _call("load", ref, share_replicas=self.share_replicas)  # which collectives it makes
        with joined(call, self.join_seconds) if together else contextlib.nullcontext():
            r = parse_ref(ref)
            return load_into(self._transport, r.run, r.name, state_dict, rank=rank_and_world()[0], strict=strict,
                             cover=cover, streams=self.streams, direct_reads=self.direct_reads,
                             share_replicas=self.share_replicas, objects=self.objects)

    # -- torch.distributed.checkpoint ------------------------------------------------
    def dcp_writer(self, ref: str, *, parent: str | None = None) -> "CkptdStorageWriter":
        """A DCP ``StorageWriter``: ``dcp.save(sd, storage_writer=client.dcp_writer("gpt/1000"))``;
        ``parent`` as for :meth:`save`, recorded by every checkpoint the writer saves."""
        from .dcp import CkptdStorageWriter

        return CkptdStorageWriter(self.url, ref, token=self._token, compression=self._codec, parent=parent,
                                  file_bytes=self.file_bytes, streams=self.streams,
                                  direct_uploads=self.direct_uploads, local_uploads=self.local_uploads,
                                  objects=self.objects)

    def dcp_reader(self, ref: str) -> "CkptdStorageReader":
        """A DCP ``StorageReader``: ``dcp.load(sd, storage_reader=client.dcp_reader("gpt/latest"))``."""
        from .dcp import CkptdStorageReader

        return CkptdStorageReader(self.url, ref, token=self._token, streams=self.streams,
                                  direct_reads=self.direct_reads, objects=self.objects)

    # -- lifecycle -----------------------------------------------------------------
    def close(self, *, wait: bool = True) -> None:
        """Wait for the pending saves (raising the first error among them) and release connections."""
        try:
            if wait:
                with self._lock:
                    pending, self._pending = [h for h in self._pending if h.unreported], []
                first: BaseException | None = None
                for h in pending:
                    try:
                        h.wait()
                    except BaseException as e:  # noqa: BLE001 - every save waited for, the first error raised
                        first = first or e
                if first is not None:
                    raise first
        finally:
            self._uploader.shutdown(wait=wait)
            super().close()
            if self.snapshot_pool is not None:
                self.snapshot_pool.close()

    def __enter__(self) -> "CheckpointClient":
        return self

    def __exit__(self, exc_type, *_: object) -> None:
        self.close(wait=exc_type is None)


