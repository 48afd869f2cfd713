"""Request and response bodies of the HTTP API (``/v1``)."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, model_validator

from .chunks import HEX64, NonNeg
from .chunktable import ChunkColumns, index_rows_valid
from .dtypes import ITEMSIZE, DType
from .manifest import Fqn, ObjectEntry, ParamGroup, TensorEntry
from .names import SESSION_RE

__all__ = [
    "LinkFile",
    "CheckpointSummary",
    "ConfirmUpload",
    "OpenSession",
    "PresignUpload",
    "PresignedUpload",
    "RankIndex",
    "RunSummary",
    "LEASE_HEADER",
    "LOAD_TREE_HEADER",
    "NEXT_HEADER",
    "MAX_READ_REQUESTS",
    "READ_REQUEST_BYTES",
    "SKIPPED_HEADER",
    "SessionInfo",
    "SessionStatus",
    "SkippedCheckpoint",
    "TensorColumns",
    "UploadResult",
]

SessionId = Annotated[str, Field(pattern=SESSION_RE.pattern.join("^$"))]


class _Body(BaseModel):
    # defer_build: validators are built on first use, so a process that reads one manifest (`ckptd verify`)
    # does not build every model at import (a quarter of the CLI's start-up).
    model_config = ConfigDict(extra="forbid", defer_build=True)


class _Answer(_Body):
    """What the service answers (never a request body): fields it does not know are ignored, so a client
    of an earlier release keeps working against a service that added fields to its answers (the
    service is upgraded first): such fields are offers and facts a client may use, never a change in what
    bytes mean. What a client sends stays strict (an unknown request field is refused), and so do the
    answers that describe bytes (a manifest, an index, a read plan): a field there a client does not
    know could change how bytes are read, and it must refuse rather than misread."""

    model_config = ConfigDict(extra="ignore", defer_build=True)


class OpenSession(_Body):
    """Open or join the upload session ``session`` of a ref.

    Every rank of one save attempt sends the same ``session`` (the client's
    rank 0 draws it and broadcasts it), so the call is idempotent across ranks,
    retries and replicas; a new attempt after a crash uses a new id and never
    mixes its ranks with the dead attempt's.
    """

    # Built at import, not deferred: FastAPI takes it as a request body, and a deferred model makes
    # pydantic warn about FastAPI's body alias when the route is first called.
    model_config = ConfigDict(extra="forbid", defer_build=False)

    session: SessionId
    world_size: Annotated[int, Field(ge=1, le=1 << 20)]
    step: Annotated[int, Field(ge=0)] | None = None
    derived_from: str | None = Field(None, max_length=300, description="source ref of a derived checkpoint")
    parent: str | None = Field(None, max_length=300, description=(
        "RUN/NAME of the visible checkpoint of another run this run started from (lineage across runs); "
        "recorded in the marker and the manifest, and protected from retention while this checkpoint is visible"))
    direct_uploads: bool = Field(False, description=(
        "the client can upload its data files straight to the object store with presigned URLs: the "
        "answer's `presigned` says whether this service offers them (see PresignUpload)"))


class SessionInfo(_Answer):
    run: str
    name: str
    session: str
    world_size: int
    step: int | None = None
    created_at: datetime
    presigned: bool | None = Field(None, description="true when the request asked for direct uploads and the "
                                   "service's root is an object store that takes presigned uploads")
    keepalive_seconds: float | None = Field(
        None, description="how often a rank that joined the session sends POST .../sessions/{session}/alive, from "
        "opening it until it is committed, refused or gone; a session no rank was heard from for ten such "
        "intervals is reclaimed")
    local_socket: str | None = Field(
        None, description="a Unix socket through which a rank on the service's host (local_host) hands each data "
        "file over as a sealed memory file instead of sending it (co-located uploads)")
    local_host: str | None = Field(None, description="the boot id of the service's host, for local_socket")
    local_key: str | None = Field(
        None, description="for local_socket: PRINCIPAL:KEY, the key through which this principal and the service "
        "prove themselves to each other before a file is handed over (ckptd_schemas.handover); it authorizes "
        "only this principal's uploads to this session")
    arrival_checks: bool | None = Field(
        None, description="true when the service checks each file's chunks as they arrive, from the declaration a "
        "rank sends ahead of the file's bytes (ckptd_schemas.arrival, header X-Ckptd-Chunks)")


_SHA256 = Annotated[str, Field(pattern=r"^[A-Za-z0-9+/]{43}=$")]  # base64, as S3's x-amz-checksum-sha256
MIN_PART_BYTES = 5 << 20  # S3's smallest part (but the last)
MAX_PARTS = 10_000  # S3's most parts of one upload


class PresignUpload(_Body):
    """Ask for presigned URLs that upload one data file of the session straight to the object store.

    Call order: ``POST .../files/<file>/presign`` (this body: the file's size, its part size and the
    SHA-256 of each part) -> ``PUT`` each part to its URL with exactly its headers (the store checks
    the length and SHA-256 signed in: a part of other bytes is refused where the store enforces
    additional checksums) -> ``POST .../files/<file>/confirm`` (:class:`ConfirmUpload`, with the
    ETag the store answered each part's PUT with). No byte passes through the service; the commit
    reads every byte of the file and checks it against the digests the confirmation declared before
    anything is visible. One part is one PUT; more are one multipart upload.
    """

    model_config = ConfigDict(extra="forbid", defer_build=False)  # a FastAPI body

    size: Annotated[int, Field(ge=0, le=5 << 40)]
    part_size: Annotated[int, Field(ge=MIN_PART_BYTES, le=5 << 30)]
    sha256: Annotated[list[_SHA256], Field(min_length=1, max_length=MAX_PARTS)]

    @model_validator(mode="after")
    def _parts(self) -> "PresignUpload":
        want = max(1, -(-self.size // self.part_size))
        if len(self.sha256) != want:
            raise ValueError(f"{self.size} bytes in parts of {self.part_size} are {want} parts, "
                             f"not {len(self.sha256)} SHA-256 values")
        return self


class PresignedUpload(_Answer):
    upload_id: str | None = Field(description="the multipart upload the parts belong to (None: one PUT)")
    urls: list[str] = Field(description="one presigned URL per part, in order")
    headers: list[dict[str, str]] = Field(description="per part: send exactly these with its PUT (they are signed)")
    expires_in: float = Field(description="seconds the URLs stay valid")
    block_size: int = Field(description="block size of the digest record the confirmation declares")


class ConfirmUpload(PresignUpload):
    """The file uploaded with presigned URLs is in place: what :class:`PresignUpload` said, the ETag of
    each part's PUT (a multipart upload, which the service then completes), and the file's digest
    record (whole-file XXH3 and per-block XXH3 in ``block_size`` blocks). The service checks the size
    and, where the store keeps one, the checksum now; the commit checks every digest by reading it."""

    upload_id: Annotated[str, Field(max_length=1024)] | None = None
    etags: Annotated[list[Annotated[str, Field(max_length=200)]], Field(max_length=MAX_PARTS)] = Field(
        default_factory=list)
    xxh3: Annotated[str, Field(pattern=r"^[0-9a-f]{16}$")]
    block_size: Annotated[int, Field(ge=4096)]
    blocks: Annotated[list[Annotated[str, Field(pattern=r"^[0-9a-f]{16}$")]], Field(max_length=1 << 22)]


class LinkFile(_Body):
    """Hold ``file`` of the earlier checkpoint ``checkpoint`` of the same run as a file of the upload session,
    without sending its bytes (incremental saves). The URL's file must be
    ``linked_name(checkpoint, file)``. The service links the stored file (a hard link on a local
    root, a server-side copy on an object store) and records the source's digests for it; the
    commit accepts chunks in it only at locations the source's manifest verified, or re-reads it.
    """

    model_config = ConfigDict(extra="forbid", defer_build=False)  # a FastAPI body

    checkpoint: Annotated[str, Field(max_length=200)]  # checked: names.check_name
    file: Annotated[str, Field(max_length=200)]  # checked: names.check_file


class UploadResult(_Answer):
    file: str
    size: int
    xxh3: str


class TensorColumns(_Body):
    """The tensors a rank index describes, one column per field (no chunks: those are in ``chunk_table``)."""

    name: list[Fqn]
    shape: list[tuple[NonNeg, ...]]  # tuples parse in half the time of lists
    dtype: list[DType]
    group: list[str]
    placement: list[str | None] | None = None
    digest: list[Annotated[str, Field(pattern=HEX64)] | None] | None = None


class RankIndex(_Body):
    """What one rank wrote: its chunks (pointing into files it uploaded) and objects.

    On the wire the tensors and chunks are columns (``tensor_table``,
    ``chunk_table`` with a ``tensor`` column giving each chunk's tensor), so
    the service parses 1,024 ranks x 500 tensors in well under a second.
    ``RankIndex(tensors=[TensorEntry, ...])`` builds the columns, and
    ``index.tensors`` gives the entries back (built on first use). Bounds of
    chunks against their tensors' shapes are checked by :meth:`check_chunks`
    when the index is uploaded, and again when the manifest is merged.
    """

    rank: Annotated[int, Field(ge=0)]
    world_size: Annotated[int, Field(ge=1)]
    coords: dict[str, int] = Field(default_factory=dict)
    mesh: dict[str, int] = Field(default_factory=dict)
    layouts: dict[str, str] = Field(default_factory=dict)
    tensor_table: TensorColumns = Field(default_factory=lambda: TensorColumns(name=[], shape=[], dtype=[], group=[]))
    chunk_table: ChunkColumns = Field(
        default_factory=lambda: ChunkColumns(tensor=[], offsets=[], sizes=[], file=[], offset=[], length=[], xxh3=[]))
    objects: list[ObjectEntry] = Field(default_factory=list)
    param_groups: list[ParamGroup] = Field(default_factory=list)
    files: list[str] = Field(default_factory=list)
    tensors_in: list[TensorEntry] | None = Field(default=None, alias="tensors", exclude=True, description=(
        "input only: the tensors as entries with chunk lists, converted to the two tables"))
    _tensors: list[TensorEntry] | None = PrivateAttr(default=None)

    @model_validator(mode="after")
    def _columns_agree(self) -> "RankIndex":
        if self.tensors_in is not None:  # built from entries (in code, or a format-1 body)
            if "tensor_table" in self.model_fields_set or "chunk_table" in self.model_fields_set:
                raise ValueError("give tensors or tensor_table/chunk_table, not both")
            tt, ct = _columns_of_entries(self.tensors_in, self.rank)
            self.__dict__.update(tensor_table=TensorColumns(**tt), chunk_table=ChunkColumns(**ct), tensors_in=None)
        tt, ct = self.tensor_table, self.chunk_table
        n = len(tt.name)
        for k in ("shape", "dtype", "group", "placement", "digest"):
            col = getattr(tt, k)
            if col is not None and len(col) != n:
                raise ValueError(f"rank {self.rank}: tensor column {k!r} has {len(col)} rows, name has {n}")
        if ct.rank is not None or ct.tensor is None:
            raise ValueError(f"rank {self.rank}: the chunk table needs a tensor column (and no rank column)")
        if len(ct.tensor) != len(ct) or (ct.tensor and max(ct.tensor) >= n):
            raise ValueError(f"rank {self.rank}: chunk table's tensor column does not index its {n} tensors")
        return self

    def check_chunks(self) -> None:
        """Raise ``ValueError`` naming the tensor unless every chunk lies inside its tensor's shape and
        every raw chunk's length is ``numel * itemsize`` (one pass over the rows)."""
        tt = self.tensor_table
        index_rows_valid(self.rank, tt.name, tt.shape, [ITEMSIZE[d] for d in tt.dtype], tt.dtype, self.chunk_table)

    @property
    def tensors(self) -> list[TensorEntry]:
        """The tensors as entries with their chunks (built once, without re-validation)."""
        if self._tensors is None:
            tt, ct = self.tensor_table, self.chunk_table
            rows: list[list[int]] = [[] for _ in tt.name]
            for i, p in enumerate(ct.tensor or ()):
                rows[p].append(i)
            self._tensors = [
                TensorEntry.model_construct(
                    name=tt.name[p], shape=list(tt.shape[p]), dtype=tt.dtype[p], group=tt.group[p],
                    table=ChunkColumns.model_construct(**ct.take(rows[p], rank=self.rank)),
                    placement=tt.placement[p] if tt.placement else None,
                    digest=tt.digest[p] if tt.digest else None)
                for p in range(len(tt.name))]
        return self._tensors

    def model_copy(self, *, update: dict | None = None, deep: bool = False) -> "RankIndex":
        """As pydantic's, and ``update={"tensors": [...]}`` replaces both tables."""
        if update and "tensors" in update:
            update = dict(update)
            tt, ct = _columns_of_entries(update.pop("tensors"), self.rank)
            update["tensor_table"], update["chunk_table"] = TensorColumns(**tt), ChunkColumns(**ct)
        out = super().model_copy(update=update, deep=deep)
        out._tensors = None
        return out

    def __eq__(self, other: object) -> bool:  # fields only: the entry cache is not part of the value
        return type(other) is type(self) and self.__dict__ == other.__dict__  # type: ignore[union-attr]


def _columns_of_entries(entries: list | tuple, rank: object) -> tuple[dict, dict]:
    tt: dict[str, list] = {"name": [], "shape": [], "dtype": [], "group": [], "placement": [], "digest": []}
    ct: dict[str, list | None] = {"tensor": [], "flat": [], "offsets": [], "sizes": [], "file": [], "offset": [],
                                  "length": [], "codec": [], "xxh3": []}
    for p, e in enumerate(entries):
        for k in tt:
            tt[k].append(getattr(e, k))
        tab = e.table
        if tab.rank and any(r != rank for r in tab.rank):
            bad = next(r for r in tab.rank if r != rank)
            raise ValueError(f"tensor {e.name!r}: rank {rank} sent a chunk labelled rank {bad}")
        n = len(tab)
        ct["tensor"] += [p] * n  # type: ignore[operator]
        ct["flat"] += tab.flat or [False] * n  # type: ignore[operator]
        ct["codec"] += tab.codec or ["raw"] * n  # type: ignore[operator]
        for k in ("offsets", "sizes", "file", "offset", "length", "xxh3"):
            ct[k] += getattr(tab, k)  # type: ignore[operator]
    if not any(ct["flat"] or ()):
        ct["flat"] = None
    if all(c == "raw" for c in ct["codec"] or ()):
        ct["codec"] = None
    for k in ("placement", "digest"):
        if all(v is None for v in tt[k]):
            tt[k] = None  # type: ignore[assignment]
    return tt, ct


class SessionStatus(_Answer):
    run: str
    name: str
    session: str
    state: Literal["open", "committed", "failed"]
    world_size: int
    ranks_done: list[int]
    error: dict[str, Any] | None = None
    manifest_xxh3: str | None = None
    #: once committed, when asked (``?durable=true``): whether the checkpoint is durable (on a service with a
    #: durable tier, copied there and checked; otherwise the root is the durable store, and a commit is
    #: durable). None: not asked.
    durable: bool | None = None
    #: why the checkpoint cannot become durable (its fast copy does not match its manifest), as an error body
    durable_error: dict[str, Any] | None = None

    def settled(self, durable: bool = False) -> bool:
        """Whether a wait for this session is over: failed, or committed (with ``durable``: and durable,
        or refused that). The service's long poll and the client's wait both end on it."""
        return self.state == "failed" or (self.state == "committed" and (
            not durable or self.durable is True or self.durable_error is not None))


class CheckpointSummary(_Answer):
    run: str
    name: str
    step: int | None
    derived_from: str | None
    parent: str | None = None
    session: str
    committed_at: datetime
    manifest_xxh3: str
    #: ``verified``, ``pending`` (no verification of this manifest recorded yet) or ``known bad`` (its
    #: recorded verification failed: ``RUN/latest`` skips it), with ``status_reason`` saying why; None
    #: from a service that does not say
    status: Literal["verified", "pending", "known bad"] | None = None
    status_reason: str | None = None


class RunSummary(_Answer):
    run: str
    checkpoints: int
    latest: str | None


#: Header of the answer to ``GET /v1/checkpoints/{run}/latest`` (the manifest ``latest`` resolved to,
#: named in ``X-Ckptd-Name``) when newer trainer checkpoints were passed over as known to be bad: a
#: JSON array (ASCII) of :class:`SkippedCheckpoint`, newest first, at most ``MAX_SKIPPED_SENT``.
SKIPPED_HEADER = "X-Ckptd-Skipped"
MAX_SKIPPED_SENT = 16

#: The most regions (and, apart, object names) a client puts in one ``POST .../read-plan`` or
#: ``POST .../load-tree`` request: a rank with more pieces sends several, under the service's limit
#: (``CKPTD_READ_PLAN_MAX_REQUESTS``, by default this), whose answers it merges.
MAX_READ_REQUESTS = 16384
#: Bytes of body per region the service reads of such a request at most (a region names its tensor in
#: about 40 to 200 bytes): its body limit is this times its limit of regions, 4 MiB by default.
READ_REQUEST_BYTES = 256

#: Header of a listing's answer (``GET /v1/runs``, ``GET /v1/runs/{run}/checkpoints``) when more follow:
#: the name the next page starts after (``?after=NAME``). Pages are cut in name order; the body stays a
#: JSON list, so a client of an earlier release reads the first page as it read the whole listing.
NEXT_HEADER = "X-Ckptd-Next"

#: Sent by a reader with each request made under its own read lease (the lease's holder name): the
#: service renews that lease on the read instead of leasing the checkpoint for a while on its own, so
#: a finished load (which releases its lease) leaves nothing that keeps the checkpoint from ``rm``.
LEASE_HEADER = "X-Ckptd-Lease"

#: Header of the answer to ``GET /v1/checkpoints/{run}/{name}/load-tree``: the load tree's root as the
#: checkpoint's ``COMMITTED`` marker names it (``ckptd_schemas.loadtree``), which the head's bytes hash to.
LOAD_TREE_HEADER = "X-Ckptd-Load-Tree"


class SkippedCheckpoint(_Answer):
    """A trainer checkpoint newer than the one ``RUN/latest`` resolved to, skipped because it is known
    to be bad: its recorded verification of the manifest committed under that name failed."""

    ref: str = Field(description="RUN/NAME of the skipped checkpoint")
    reason: str = Field(description="why: 'verification failed at <time>: <first problem>'")
