"""The storage interface: a few primitives, everything else derived.

Keys are ``/``-separated paths relative to the storage root. Primitives:

* :meth:`Storage.open_write` -> a :class:`Writer` whose bytes become visible at the key, whole and
  durable, only on :meth:`Writer.commit` (temp file + rename + fsync locally; single PUT or multipart
  completion on object stores); :meth:`Writer.abort` leaves nothing behind. With ``once=True`` the
  commit creates the key only if it is absent (a hard link of the temp file locally; ``If-None-Match:
  *`` on object stores): a data file of a session is written once, and nothing replaces it, and
  :meth:`Storage.create_if_absent` writes a small object exactly once (the commit marker's primitive).
* :meth:`Storage.read` a byte range, :meth:`Storage.size` (None if absent), :meth:`Storage.list` the
  immediate children of a prefix, :meth:`Storage.delete` and :meth:`Storage.delete_tree`.

Derived, overridden where a backend does better, or optional, each saying so where it is not there
(:meth:`Storage.local_path`, :meth:`Storage.link`, presigned uploads): each method's docstring says what.

Errors from the backend surface as :class:`ckptd_schemas.StorageError`
naming the key (transient: callers retry), except those that waiting cannot change: a read-only
root, a permission the service lacks, no space left. Those are a
:class:`ckptd_schemas.StoragePermanent` (``StorageReadOnly``, ``StorageFull``) naming the root's
cause, final at once (:mod:`ckptd.storage.failures` classifies them). Data files of committed checkpoints are read
through :meth:`Storage.read_committed` and :meth:`Storage.check_committed`, which know the size
the manifest gives: such a file absent, of another size or read short is damage, not a passing
failure, and raises :class:`ckptd_schemas.CorruptCheckpoint` at once.
"""

from __future__ import annotations

import contextlib
import json
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Callable, Iterator

from ckptd_schemas import CorruptCheckpoint, InvalidName, StorageError

from .failures import classify

__all__ = ["Presigned", "Storage", "Writer", "check_key"]


def check_key(key: str) -> str:
    """Refuse keys that could leave the root (defence in depth under name validation)."""
    parts = key.split("/")
    if not key or key.startswith("/") or any(p in ("", ".", "..") for p in parts) or "\x00" in key or "\\" in key:
        raise InvalidName(f"unsafe storage key {key!r}", field="key", value=key[:200])
    return key


class Writer(ABC):
    """A pending object: bytes appear at the key only on ``commit``."""

    @abstractmethod
    def write(self, data: bytes | memoryview) -> None: ...

    def write_parts(self, parts: list[bytes]) -> None:
        """Append several pieces; backends that can gather them in one call override this."""
        for p in parts:
            self.write(p)

    @abstractmethod
    def commit(self) -> bool:
        """Make the object durable and visible; True. A writer opened with ``once=True`` creates
        the key only if it is absent: False (nothing written, the temp dropped) when it exists."""

    @abstractmethod
    def abort(self) -> None:
        """Drop what was written; never raises for an already-closed writer."""

    @contextlib.contextmanager
    def _aborting(self, op: str, key: str, root: str, catch: type[BaseException] = Exception) -> Iterator[None]:
        """A backend failure (``catch``) inside drops what was written (:meth:`abort`) and is raised as
        :func:`~.failures.classify` names it: every writer's one error path."""
        try:
            yield
        except catch as e:
            self.abort()
            raise classify(op, key, e, root) from e


@dataclass(frozen=True)
class Presigned:
    """A presigned upload: one URL per part (with the headers signed into it), and the multipart
    upload they belong to (None for a single PUT)."""

    upload_id: str | None
    urls: list[str]
    headers: list[dict[str, str]]


class Storage(ABC):
    """Minimal storage interface; see the module docstring for the contract."""

    url: str
    #: Bytes per read when a long range is streamed out (``GET .../files``): bounds the memory of one
    #: response. Object stores raise it: each read is a request, and a request per MiB is slow.
    read_piece: int = 1 << 20

    # -- primitives ---------------------------------------------------------
    @abstractmethod
    def open_write(self, key: str, *, once: bool = False) -> Writer:
        """A pending object at ``key``; ``once``: its commit never replaces an existing object."""

    @abstractmethod
    def read(self, key: str, start: int = 0, end: int | None = None) -> bytes: ...

    @abstractmethod
    def size(self, key: str) -> int | None: ...

    @abstractmethod
    def list(self, prefix: str) -> list[str]:
        """Sorted names of the immediate children (files and folders) of ``prefix``; [] if none."""

    @abstractmethod
    def delete(self, key: str) -> None:
        """Delete one object; absent is fine."""

    @abstractmethod
    def delete_tree(self, prefix: str) -> None:
        """Delete everything under ``prefix``; absent is fine."""

    # -- derived ------------------------------------------------------------
    def put(self, key: str, data: bytes) -> None:
        self._write_whole(key, data, once=False)

    def create_if_absent(self, key: str, data: bytes) -> bool:
        """Create ``key`` with ``data`` unless it exists; True when this call created it (a writer opened
        ``once``: first writer wins; backends with a cheaper conditional create override it)."""
        return self._write_whole(key, data, once=True)

    def _write_whole(self, key: str, data: bytes, once: bool) -> bool:
        w = self.open_write(key, once=once)
        try:
            w.write(data)
        except BaseException:
            w.abort()
            raise
        return w.commit()

    def read_into(self, key: str, start: int, view: memoryview, *, uncached: bool = False) -> int:
        """Read up to ``len(view)`` bytes from ``start`` into ``view``; return how many arrived.
        ``uncached``: bytes read once (the commit's check of what was just received), read from the
        device past any page cache where the store can (local disks: page-aligned ``view`` only)."""
        data = self.read(key, start, start + len(view))
        view[:len(data)] = data
        return len(data)

    def exists(self, key: str) -> bool:
        return self.size(key) is not None

    def check_committed(self, key: str, size: int, **details: Any) -> None:
        """Raise :class:`CorruptCheckpoint` unless ``key`` holds exactly ``size`` bytes (a data file of a
        committed checkpoint, which never changes once committed)."""
        stored = self.size(key)
        if stored is None:
            raise CorruptCheckpoint(f"committed file {key!r} is missing from storage", key=key, size=size, **details)
        if stored != size:
            raise CorruptCheckpoint(f"committed file {key!r} holds {stored} bytes, its manifest says {size}",
                                    key=key, size=size, stored_size=stored, **details)

    def read_committed(self, key: str, start: int, end: int, size: int, **details: Any) -> bytes:
        """Bytes ``[start, end)`` of a committed data file of ``size`` bytes. Absent, resized or read
        short: :class:`CorruptCheckpoint`; any other failure stays a (transient) :class:`StorageError`."""
        return self._committed(lambda: self.read(key, start, end), key, start, end - start, size, details)

    def read_committed_into(self, key: str, start: int, view: memoryview, size: int, **details: Any) -> None:
        """:meth:`read_committed` into a caller's buffer: all of ``view`` is filled, or it raises."""
        self._committed(lambda: self.read_into(key, start, view), key, start, len(view), size, details)

    def _committed(self, read: Callable[[], Any], key: str, start: int, want: int, size: int, details: dict) -> Any:
        """``read()`` (bytes, or a count of bytes read) of ``want`` bytes at ``start`` of a committed file,
        judged by the rule of :meth:`read_committed`."""
        try:
            got = read()
        except StorageError:
            self.check_committed(key, size, **details)  # there, whole: the failure was the backend's
            raise
        n = got if isinstance(got, int) else len(got)
        if n != want:
            self.check_committed(key, size, **details)
            raise CorruptCheckpoint(f"committed file {key!r} gave {n} of the {want} bytes at {start}", key=key,
                                    size=size, **details)
        return got

    def read_or_none(self, key: str) -> bytes | None:
        """The whole object, or None when it is absent."""
        return self.read(key) if self.exists(key) else None

    def read_head(self, key: str, n: int) -> bytes | None:
        """At most the first ``n`` bytes of the object, or None when it is absent: a reader of a small
        record refuses a large one without holding it whole (an object store: one ranged GET)."""
        data = self.read_or_none(key)
        return None if data is None else data[:n]

    def stamp(self, key: str) -> str | None:
        """None when ``key`` is absent; else a token that changes whenever its bytes may have changed
        (local files: inode, size, mtime and ctime; S3: ETag and size), or ``""`` where the backend
        has none (the caller must then read the bytes to know)."""
        return "" if self.exists(key) else None

    def listed_stamps(self, prefix: str) -> dict[str, str] | None:
        """The :meth:`stamp` of every object under ``prefix``, by key, from one listing where the backend's
        listing says what a stamp does (S3: ETag and size; a request per thousand objects instead of a
        HEAD each); None where it does not (a local file's stamp is its ``stat``, per file)."""
        return None

    def for_probes(self) -> "Storage":
        """This root as the readiness probe reads it: each call tried once, within a short timeout, so
        that a probe says at once what the store answers now (``ckptd.service.readiness``); a backend
        that retries (S3) overrides it."""
        return self

    def local_path(self, key: str) -> str | None:
        """An absolute path that opens ``key`` on this host, or None (an object store): offered to
        loading clients for direct reads (``ReadPlan.local_paths``)."""
        return None

    def free_space(self) -> tuple[int, int] | None:
        """(bytes an unprivileged writer may still write, total bytes) of the filesystem holding the
        root; None where there is no disk to fill (an object store)."""
        return None

    def link(self, src: str, dst: str, stamp: str | None = None) -> bool:
        """Make ``dst`` hold ``src``'s bytes without this process reading them: a hard link on a local
        root, a copy inside the store on an object store (incremental saves). False when it cannot:
        no such ``src``, or a backend (or filesystem) with neither; the caller then has the bytes
        sent. A repeat after success finds ``dst`` already the same file and is not an error. With
        ``stamp`` (:meth:`stamp` of ``src`` when its bytes were checked), False too, and nothing
        linked, where ``src`` is no longer that object: the linked bytes are the checked ones."""
        return False

    def delete_if_empty(self, prefix: str) -> None:
        """Remove the folder ``prefix`` if it holds nothing (a local root's, left by :meth:`delete_tree` of
        its last child); an object store has no folders: nothing to do."""

    def reclaim_temps(self, prefix: str, older_than: float) -> int:
        """Delete what writes that never committed left under ``prefix`` (a process killed mid-write:
        temp files on a local root, unfinished multipart uploads on an object store), begun or last
        changed before ``older_than`` (epoch seconds; ``math.inf``: all of them); return how many."""
        return 0

    def walk(self, prefix: str) -> list[tuple[str, int]]:
        """Every key stored under ``prefix`` (recursively) and its size, what :meth:`list` leaves out
        included (a local root's hidden files: temp files of unfinished writes); sorted. An object
        store's unfinished multipart upload is not an object: it is not walked."""
        out: list[tuple[str, int]] = []
        for n in self.list(prefix):
            key = f"{prefix}/{n}"
            below = self.walk(key)
            size = None if below else self.size(key)
            out += below if below else [(key, size)] if size is not None else []
        return sorted(out)

    presigns = False  # whether presign_put gives URLs (an object store that takes presigned uploads)

    def presign_put(self, key: str, size: int, part_size: int, sha256s: list[str],
                    seconds: float) -> Presigned | None:
        """URLs (and the headers to send with each) through which a client PUTs exactly ``size`` bytes
        at ``key``: one part of ``part_size`` bytes per SHA-256 in ``sha256s`` (base64; the last part
        shorter), valid for ``seconds``. None where the store takes no presigned uploads (then the
        client sends the bytes through the service)."""
        return None

    def complete_presigned(self, key: str, upload_id: str, etags: list[str], sha256s: list[str]) -> None:
        """Assemble a multipart presigned upload from its parts (the ETags the store answered each PUT with)."""
        raise StorageError(f"{self.url}: no presigned uploads", key=key)

    def stored_sha256(self, key: str) -> str | None:
        """The SHA-256 (base64) the store verified and kept for ``key``'s object, where it keeps one."""
        return None

    def read_json_or_none(self, key: str) -> Any:
        """The object parsed as JSON, or None when it is absent (one read: :meth:`read_or_none`)."""
        raw = self.read_or_none(key)
        if raw is None:
            return None
        try:
            return json.loads(raw)
        except json.JSONDecodeError as e:
            raise StorageError(f"{self.url}/{key} is not valid JSON: {e}", key=key) from e

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.url!r})"
