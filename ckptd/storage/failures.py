"""Which storage failures are permanent, and the typed error each one becomes.

A backend's failure is transient (:class:`ckptd_schemas.StorageError`, answered 503, which clients
retry) unless waiting cannot change it. Those are final at once (a
:class:`ckptd_schemas.StoragePermanent`, answered 507, never retried) and name the root's cause:

====================================================  =========  =====================
cause (the exception, or one in its cause chain)      operation  error
====================================================  =========  =====================
``ENOSPC``, ``EDQUOT``                                any        ``StorageFull``
``EROFS`` (a read-only filesystem)                    any        ``StorageReadOnly``
``EACCES``, ``EPERM`` (``PermissionError``)           a write    ``StorageReadOnly``
``EACCES``, ``EPERM`` (``PermissionError``)           a read     ``StoragePermanent``
S3 ``AccessDenied``, ``InvalidAccessKeyId``, ... 403  a write    ``StorageReadOnly``
the same                                              a read     ``StoragePermanent``
====================================================  =========  =====================

A read is ``read``, ``stat`` or ``list``; every other operation writes. Each backend passes its
failures through :func:`permanent_error` before wrapping what is left as a transient
:class:`~ckptd_schemas.StorageError` (:func:`classify` does both).
"""

from __future__ import annotations

import contextlib
import errno
import os
from typing import Iterator

from ckptd_schemas import CkptdError, StorageError, StorageFull, StoragePermanent, StorageReadOnly

__all__ = ["READ_OPS", "S3_DENIED", "classified", "classify", "client_errors", "permanent_error"]

#: Operations that only read; a permission refused to any other is a root that cannot be written.
READ_OPS = frozenset({"read", "stat", "list"})
_FULL = {errno.ENOSPC: "disk full", errno.EDQUOT: "disk quota exceeded"}
_DENIED = frozenset({errno.EACCES, errno.EPERM})
#: S3 error codes that no retry changes: the credentials may not do this (403 is a HEAD's bare status).
S3_DENIED = frozenset({"AccessDenied", "AllAccessDisabled", "AccountProblem", "InvalidAccessKeyId",
                       "SignatureDoesNotMatch", "NotSignedUp", "403"})


def _chain(e: BaseException) -> Iterator[BaseException]:
    seen: set[int] = set()
    cur: BaseException | None = e
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        yield cur
        cur = cur.__cause__ or cur.__context__


def client_errors(e: BaseException) -> Iterator[tuple[str, int | None]]:
    """(error code, HTTP status) of every botocore ClientError response in ``e``'s cause chain."""
    for cur in _chain(e):
        resp = getattr(cur, "response", None)
        if isinstance(resp, dict):
            yield str((resp.get("Error") or {}).get("Code") or ""), (resp.get("ResponseMetadata") or {}).get(
                "HTTPStatusCode")


def _errno(e: BaseException) -> tuple[int, str] | None:
    """(errno, strerror) of the first permanent OS error in ``e``'s chain; a ``PermissionError``
    without an errno (a backend's translation of a 403) counts as ``EACCES``."""
    for cur in _chain(e):
        if not isinstance(cur, OSError):
            continue
        code = cur.errno
        if code is None and isinstance(cur, PermissionError):
            code = errno.EACCES
        if code in _FULL or code == errno.EROFS or code in _DENIED:
            return code, cur.strerror or os.strerror(code) or str(cur)
    return None


def _who(root: str) -> str:
    """Who was refused: the service's user on a local root (by uid), its credentials elsewhere."""
    if "://" in root or not hasattr(os, "geteuid"):
        return "the service's credentials"
    return f"the service's user (uid {os.geteuid()})"


def permanent_error(op: str, key: str, e: BaseException, root: str) -> StoragePermanent | None:
    """The permanent error that the failure ``e`` of ``op`` on ``key`` (under ``root``, the storage's
    URL) stands for, naming the root's cause; None when waiting may change it (transient)."""
    where = f"storage {op} of {key!r} failed"
    verb = "read" if op in READ_OPS else "write"
    s3 = next((code for code, _ in client_errors(e) if code in S3_DENIED), None)
    if s3 is not None:
        cls = StoragePermanent if op in READ_OPS else StorageReadOnly
        return cls(f"{where}: {_who(root)} may not {verb} under the storage root {root} ({s3}: {e})",
                   key=key, root=root, s3_code=s3)
    found = _errno(e)
    if found is None:
        return None
    code, text = found
    details = {"key": key, "root": root, "errno": code}
    if code in _FULL:
        return StorageFull(f"{where}: {_FULL[code]} ({text}) on the storage root {root}", **details)
    if code == errno.EROFS:
        return StorageReadOnly(f"{where}: the storage root {root} is read-only ({text}, EROFS): nothing can be "
                               f"saved there", **details)
    name = errno.errorcode.get(code, str(code))
    if op in READ_OPS:
        return StoragePermanent(f"{where}: {_who(root)} may not read it under the storage root {root} "
                                f"({text}, {name})", **details)
    return StorageReadOnly(f"{where}: {_who(root)} may not write under the storage root {root} ({text}, {name})",
                           **details)


@contextlib.contextmanager
def classified(op: str, key: str, root: str, catch: type[BaseException] = Exception) -> Iterator[None]:
    """A backend call's one error wrapper: a failure (``catch``) becomes :func:`classify`'s error naming
    ``op`` and ``key``; a missing object (``FileNotFoundError``, which each call answers its own way)
    and the project's own errors (an unsafe key's ``InvalidName``) pass as they are."""
    try:
        yield
    except (FileNotFoundError, CkptdError):
        raise
    except catch as e:
        raise classify(op, key, e, root) from e


def classify(op: str, key: str, e: BaseException, root: str) -> StorageError:
    """:func:`permanent_error`, or else a transient :class:`StorageError` naming ``op``, ``key`` and the
    cause (an OS error's text and errno, any other exception's type and text): every backend's one wrapping."""
    if (perm := permanent_error(op, key, e, root)) is not None:
        return perm
    if isinstance(e, OSError) and e.errno is not None:
        return StorageError(f"storage {op} of {key!r} failed: {e.strerror or e}", key=key, errno=e.errno)
    return StorageError(f"storage {op} of {key!r} failed: {type(e).__name__}: {e}", key=key)
