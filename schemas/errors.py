"""One typed exception hierarchy, shared by the service, the CLI and the client.

The service maps every exception to an HTTP status in one handler
(``ckptd.service.errors``); the client maps the JSON error body back to the
same class with :func:`error_from_body`, so ``except ChecksumMismatch`` works
identically on either side of the wire.

::

    CkptdError                        500 internal
    ├── Unauthorized                  401 unauthorized        no valid bearer token
    ├── Forbidden                     403 forbidden           the token's scopes do not cover the request
    ├── InvalidRequest                400 invalid_request
    │   ├── InvalidName               400 invalid_name        run, name, file or ref unsafe or malformed
    │   ├── InvalidIndex              422 invalid_index       a rank's index is inconsistent
    │   ├── StateDictMismatch         422 state_dict_mismatch load: keys, shapes or dtypes differ
    │   │   └── KindMismatch          422 kind_mismatch       load: a key stored as a tensor asked for as
    │   │                                                     an object, or the other way round
    │   ├── CollectiveMismatch        422 collective_mismatch the ranks of a collective save or load make
    │   │                                                     different calls (ref, save or load), or some
    │   │                                                     do not join in time (raised by the client,
    │   │                                                     on every rank that came, naming the ranks)
    │   └── UnsafeObject              422 unsafe_object       an object only an unrestricted unpickler reads
    ├── NotFound                      404 not_found
    │   ├── CheckpointNotFound        404 checkpoint_not_found
    │   └── SessionNotFound           404 session_not_found
    ├── Conflict                      409 conflict
    │   ├── AlreadyCommitted          409 already_committed   committed refs are immutable
    │   ├── SessionConflict           409 session_conflict    e.g. world size disagrees
    │   ├── CheckpointLeased          409 checkpoint_leased   rm of a checkpoint a lease holds (names the
    │   │                                                     holders and until when)
    │   └── CheckpointBeingDeleted    409 checkpoint_being_deleted  a lease (or a second rm) asked while
    │                                                     a deletion of the checkpoint is under way
    ├── IntegrityError                422 integrity
    │   ├── ChecksumMismatch          422 checksum_mismatch   bytes differ from their digest
    │   │   └── CorruptCheckpoint     422 corrupt_checkpoint  a committed file is missing, resized or fails
    │   │                                                     its digests (names the file, and the tensors
    │   │                                                     or object it fills on the client)
    │   ├── TilingError               422 tiling              chunks do not cover a tensor exactly once
    │   └── DcpImportError            422 dcp_import          a DCP directory is missing or truncated files
    ├── CommitFailed                  422 commit_failed       the session was refused at commit
    ├── PayloadTooLarge               413 payload_too_large   a body, or the work it asks for, over a limit
    ├── RequestTimeout                408 request_timeout     the request's body stalled (connection closed)
    ├── TooManyRequests               429 too_many_requests   e.g. this token's concurrent uploads (retried)
    ├── Unavailable                   503 unavailable         server unreachable after retries
    │   └── Unreachable               503 unreachable         the client cannot reach the service in a way
    │                                                         waiting will not change (a TLS handshake that
    │                                                         fails, a host name that does not resolve):
    │                                                         raised at once, never retried
    └── StorageError                  503 storage             the storage backend failed (retried)
        └── StoragePermanent          507 storage_permanent   storage refused in a way that waiting will not
            │                                                 change (e.g. the service may not read a file):
            │                                                 not retried
            ├── StorageFull           507 storage_full        no space left (ENOSPC, EDQUOT): staging dropped
            │   ├── QuotaExceeded     507 quota_exceeded      the token holds its quota (names the token,
            │   │                                             its quota and what it holds): not retried
            │   └── ReserveReached    507 reserve_reached     the root's free space is down to its reserve:
            │                                                 new staged bytes are refused, commits go on
            └── StorageReadOnly       507 storage_read_only   the root cannot be written: a read-only
                                                              filesystem (EROFS), or one the service's user
                                                              may not write (EACCES, EPERM; S3 AccessDenied)

Every error carries ``message`` (a sentence naming the tensor, rank, file or
field at fault) and ``details`` (machine-readable context).
"""

from __future__ import annotations

from typing import Any, ClassVar



class CkptdError(Exception):
    """Base of every ckptd error; ``code`` and ``status`` are stable API."""

    code: ClassVar[str] = "internal"
    status: ClassVar[int] = 500

    def __init_subclass__(cls, *, code: str, status: int | None = None) -> None:
        """``class X(Parent, code=..., status=...)``: the code is the class's own; the status, the parent's
        unless named."""
        cls.code = code
        if status is not None:
            cls.status = status

    def __init__(self, message: str, **details: Any) -> None:
        super().__init__(message)
        self.message = message
        self.details = details
        self.request_id: str | None = None  # set on the client side from the error body

    def to_body(self) -> dict[str, Any]:
        return {"error": {"code": self.code, "message": self.message, "details": self.details}}


class Unauthorized(CkptdError, code="unauthorized", status=401):
    """No bearer token, or one the service does not know (never retried by the client)."""


class Forbidden(CkptdError, code="forbidden", status=403):
    """A known token whose scopes do not cover the request (never retried by the client)."""


class InvalidRequest(CkptdError, code="invalid_request", status=400): ...


class InvalidName(InvalidRequest, code="invalid_name"): ...


class InvalidIndex(InvalidRequest, code="invalid_index", status=422): ...


class StateDictMismatch(InvalidRequest, code="state_dict_mismatch", status=422): ...


class KindMismatch(StateDictMismatch, code="kind_mismatch"):
    """A load asks for a key as a tensor that the checkpoint holds as an object (or the other way round):
    the message says which kind each side holds. ``details``: ``key``, ``stored``, ``asked``."""


class CollectiveMismatch(InvalidRequest, code="collective_mismatch", status=422):
    """The ranks of a collective ``save`` or ``load`` did not all make the same call: another ref,
    a save beside a load, other options, or no call within the client's ``join_seconds``. Raised on
    every rank that came, before any session is opened; ``details``: ``calls`` (each call and its
    ranks), ``missing`` (the ranks that did not join)."""


class UnsafeObject(InvalidRequest, code="unsafe_object", status=422):
    """A non-tensor object that only an unrestricted unpickler can rebuild (so loading it could run code):
    refused at save and at load unless the client trusts objects; ``details`` name the key (and ref)."""


class NotFound(CkptdError, code="not_found", status=404): ...


class CheckpointNotFound(NotFound, code="checkpoint_not_found"): ...


class SessionNotFound(NotFound, code="session_not_found"): ...


class Conflict(CkptdError, code="conflict", status=409): ...


class AlreadyCommitted(Conflict, code="already_committed"): ...


class SessionConflict(Conflict, code="session_conflict"): ...


class CheckpointLeased(Conflict, code="checkpoint_leased"):
    """``rm`` (or gc) of a checkpoint that an unexpired lease holds: it stays (``details["holders"]``)."""


class CheckpointBeingDeleted(Conflict, code="checkpoint_being_deleted"):
    """A lease asked for, or a second ``rm``, while a deletion of the checkpoint is under way: no lease
    is granted on a checkpoint about to go (retry: it is then gone, or still there and leasable)."""


class IntegrityError(CkptdError, code="integrity", status=422): ...


class ChecksumMismatch(IntegrityError, code="checksum_mismatch"): ...


class CorruptCheckpoint(ChecksumMismatch, code="corrupt_checkpoint"):
    """A data file of a committed checkpoint is absent, of another size than its manifest says, or its
    bytes fail their digests. Committed files never change, so waiting will not help: raised at once,
    never retried. ``details``: ``file``, and on the client ``tensors`` (or ``object``) it would fill."""


class TilingError(IntegrityError, code="tiling"): ...


class DcpImportError(IntegrityError, code="dcp_import"):
    """The directory is not an importable DCP checkpoint; the message names the files at fault."""


class CommitFailed(CkptdError, code="commit_failed", status=422): ...


class PayloadTooLarge(CkptdError, code="payload_too_large", status=413): ...


class RequestTimeout(CkptdError, code="request_timeout", status=408):
    """The request's body stopped arriving for longer than the service waits; the connection is closed."""


class TooManyRequests(CkptdError, code="too_many_requests", status=429):
    """Over a concurrency limit (e.g. a token's uploads at once): the client retries with backoff.
    ``details["limit_name"]`` names the limit (``uploads``, ``requests``, ``read_leases``, ``damage_rechecks``),
    as the service's ``ckptd_limit_refusals_total{limit}`` counts it."""


class Unavailable(CkptdError, code="unavailable", status=503): ...


class Unreachable(Unavailable, code="unreachable"):
    """Raised by the client, never sent: the service's address cannot be reached in a way that waiting
    will not change, so it is final at once, not after the retry budget: its TLS handshake fails (a
    certificate not verified, ``https://`` spoken to a plain-HTTP server, or the other way round) or its
    host name does not resolve. ``details``: ``url``, ``cause`` (``tls`` or ``dns``). A refused
    connection is not this: a restarting service refuses for a moment."""


class StorageError(CkptdError, code="storage", status=503): ...


class StoragePermanent(StorageError, code="storage_permanent", status=507):
    """The storage refused an operation in a way that waiting will not change (a permission, a
    read-only filesystem, no space): answered 507, which clients do not retry, so the cause arrives
    at once instead of after the client's retry budget. ``details``: ``key``, and ``root`` (the
    storage root) with ``errno`` (a local root) or ``s3_code`` (an object store)."""


class StorageFull(StoragePermanent, code="storage_full"):
    """The storage has no space left (ENOSPC, EDQUOT). Waiting will not help, so clients do not retry it."""


class QuotaExceeded(StorageFull, code="quota_exceeded"):
    """The writer's token holds its quota (``quota=`` in its tokens line): the bytes of the runs it
    may write, staged and committed, plus this file would exceed it. Not retried (507): the writer
    frees space (``ckptd gc``, ``rm``) or is given a larger quota; other tokens keep saving.
    ``details``: ``token``, ``quota``, ``held`` (bytes), ``run``, ``file``."""


class ReserveReached(StorageFull, code="reserve_reached"):
    """The storage root's free space is down to its reserve (``CKPTD_ROOT_RESERVE``): new staged bytes
    are refused so that the saves in progress can still commit (their manifests, markers and indexes
    are written into the reserve). Not retried (507). ``details``: ``root``, ``free``, ``reserve``,
    ``file``."""


class StorageReadOnly(StoragePermanent, code="storage_read_only"):
    """The storage root cannot be written: a read-only filesystem (EROFS), or a root the service's user
    may not write (EACCES, EPERM: e.g. a root-owned bind mount in a container; S3 AccessDenied on a
    write). Saves fail at once at session open with it; committed checkpoints can still be read."""


def _all_subclasses(cls: type[CkptdError]) -> list[type[CkptdError]]:
    out = [cls]
    for sub in cls.__subclasses__():
        out.extend(_all_subclasses(sub))
    return out


_BY_CODE: dict[str, type[CkptdError]] = {c.code: c for c in _all_subclasses(CkptdError)}
# A body without a code (FastAPI's own 422, a proxy's answer): the class its status stands for.
_BY_STATUS: dict[int, tuple[type[CkptdError], str]] = {
    401: (Unauthorized, "unauthorized"), 403: (Forbidden, "forbidden"), 400: (InvalidRequest, "request refused"),
    422: (InvalidRequest, "request refused"), 404: (NotFound, "not found"), 429: (TooManyRequests, "too many requests"),
    507: (StoragePermanent, "the storage refused the request")}
__all__ = [c.__name__ for c in _all_subclasses(CkptdError)] + ["error_from_body"]


def error_from_body(body: Any, status: int) -> CkptdError:
    """Rebuild the typed error from a service response body (client side)."""
    err = body.get("error") if isinstance(body, dict) else None
    if isinstance(err, dict) and isinstance(err.get("code"), str):
        cls = _BY_CODE.get(err["code"], CkptdError)
        details = err.get("details") if isinstance(err.get("details"), dict) else {}
        exc = cls(str(err.get("message", "")))
        exc.details = dict(details)  # as sent: a detail named like a parameter ("message") cannot clash
        if isinstance(err.get("request_id"), str):
            exc.request_id = err["request_id"]  # the service's log lines for this request carry it
        return exc
    cls, what = _BY_STATUS.get(status, (CkptdError, "server answered"))
    return cls(f"{what} ({status}): {body}")
