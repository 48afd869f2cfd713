"""Fault injection for the crash and fault tests (docs/design.md §2 item 6). Inert unless a test sets it.

One switch, ``CKPTD_FAULTS``, read when this module is imported (or :func:`configure` is called):
clauses separated by ``;``, each ``kind=value``:

* ``crash-at=<point>``: the process SIGKILLs itself when it reaches the named crash point
  (:data:`CRASH_POINTS`): the tests kill the service between the protocol's steps, exactly where
  a real crash could land.
* ``crash-random=<seed>:<probability>[:<point>,<point>...]``: every kill point the process passes
  (the named crash points, and two inside storage writes: ``storage-write-partial``, half of a
  write's bytes in the temp object, and ``storage-before-rename``, the object complete but not yet
  in place), or only those listed, draws from a ``random.Random(seed)`` and SIGKILLs the process
  with that probability. The point is written to stderr first (``ckptd fault: SIGKILL at <point> ...``).
  ``crash-random=@<path>``: the same spec read from a file, re-read (and the generator re-seeded)
  whenever the file is replaced; an empty or missing file kills nothing. A test then arms and
  disarms one server process between saves.
* ``stall=<run>:<seconds>``: every object the session store writes under ``runs/<run>/`` waits
  ``seconds`` first (a slow backend for one run).
* ``fail=<run>``: every such write raises :class:`~ckptd_schemas.StorageError` (a backend that is
  unavailable for one run).
* ``throttle=<MB/s>``: the bytes of every storage write pass one shared link of that rate (a slow
  remote store, for the compression benchmark): each write waits until the link has carried it.

Unset (always, outside tests), :func:`wrap_storage` returns the storage unchanged and a crash
point costs two global lookups.
"""

from __future__ import annotations

import os
import random
import signal
import threading
import time
from collections.abc import Mapping

from ckptd_schemas import StorageError

from ..storage import Storage, Writer

__all__ = ["CRASH_POINTS", "STORAGE_CRASH_POINTS", "configure", "crash_point", "wrap_storage"]

CRASH_POINTS = (
    "upload-mid-stream",      # part of a file received, not yet committed to storage
    "upload-before-digest",   # file committed, its digest sidecar not yet written
    "index-written",          # a rank's index stored, commit not yet attempted
    "commit-before-manifest", # all indexes merged, manifest not yet written
    "commit-before-marker",   # manifest durable, COMMITTED not yet created
    "commit-after-marker",    # COMMITTED created, response not yet sent
)
STORAGE_CRASH_POINTS = (
    "storage-write-partial",  # half of one write's bytes in the temp object
    "storage-before-rename",  # the temp object complete, not yet in place
)


class _RandomKill:
    def __init__(self, spec: str) -> None:
        self.lock = threading.Lock()
        self.path = spec[1:] if spec.startswith("@") else None
        self._seen: tuple | None = None
        self._arm("" if self.path else spec)

    def _arm(self, spec: str) -> None:
        spec = spec.strip()
        self.calls = 0
        self.probability = 0.0
        self.points: frozenset[str] | None = None
        if spec:
            seed, p, *points = spec.split(":")
            self.rng = random.Random(int(seed))
            self.probability = float(p)
            self.points = frozenset(points[0].split(",")) if points and points[0] else None

    def _reload(self) -> None:
        try:
            st = os.stat(self.path)
            key: tuple | None = (st.st_ino, st.st_mtime_ns, st.st_size)
        except FileNotFoundError:
            key = None
        if key != self._seen:
            self._seen = key
            try:
                with open(self.path) as f:
                    self._arm(f.read())
            except FileNotFoundError:
                self._arm("")

    def draw(self, point: str) -> int | None:
        with self.lock:
            if self.path is not None:
                self._reload()
            if self.probability <= 0 or self.points is not None and point not in self.points:
                return None
            self.calls += 1
            return self.calls if self.rng.random() < self.probability else None


_random: _RandomKill | None = None
_crash_at: str | None = None
_stall: tuple[str, float] | None = None   # (runs/<run>/ prefix, seconds)
_fail: str | None = None                  # runs/<run>/ prefix
_throttle: float | None = None             # bytes/s of the shared link
_link_free = 0.0                           # monotonic time at which the link has carried every write so far
_link = threading.Lock()
KINDS = ("crash-at", "crash-random", "stall", "fail", "throttle")


def parse(spec: str) -> dict[str, str]:
    """``"crash-at=index-written;fail=down"`` -> ``{"crash-at": "index-written", "fail": "down"}``;
    an unknown kind or a clause without ``=`` raises ValueError (a typo must not pass silently)."""
    out: dict[str, str] = {}
    for clause in filter(None, (c.strip() for c in spec.split(";"))):
        kind, eq, value = clause.partition("=")
        if not eq or kind.strip() not in KINDS:
            raise ValueError(f"CKPTD_FAULTS: {clause!r} is not one of {', '.join(k + '=...' for k in KINDS)}")
        out[kind.strip()] = value.strip()
    return out


def configure(environ: Mapping[str, str] = os.environ) -> None:
    """(Re)read ``CKPTD_FAULTS`` from ``environ``."""
    global _random, _crash_at, _stall, _fail, _throttle
    faults = parse(environ.get("CKPTD_FAULTS", ""))
    _random = _RandomKill(faults["crash-random"]) if faults.get("crash-random") else None
    _crash_at = faults.get("crash-at") or None
    if faults.get("stall"):
        run, _, seconds = faults["stall"].rpartition(":")
        _stall = (f"runs/{run}/", float(seconds))
    else:
        _stall = None
    _fail = f"runs/{faults['fail']}/" if faults.get("fail") else None
    _throttle = float(faults["throttle"]) * 1e6 if faults.get("throttle") else None


def _carry(nbytes: int) -> None:
    """Wait until the throttled link has carried ``nbytes`` after everything written before."""
    global _link_free
    if _throttle is None or nbytes <= 0:
        return
    with _link:
        _link_free = max(time.monotonic(), _link_free) + nbytes / _throttle
        until = _link_free
    time.sleep(max(0.0, until - time.monotonic()))


_dying = threading.Lock()


def _kill(point: str, how: str) -> None:
    # Taken and never released: when several threads draw a kill at once, one logs and kills, the
    # others wait here for the signal, so the log names exactly one kill point per death.
    _dying.acquire()
    os.write(2, f"ckptd fault: SIGKILL at {point} ({how})\n".encode())
    os.kill(os.getpid(), signal.SIGKILL)


def crash_point(name: str) -> None:
    if _random is not None:
        call = _random.draw(name)
        if call is not None:
            _kill(name, f"random, draw {call}")
    if _crash_at == name:
        _kill(name, "crash-at")


def _before_write(key: str) -> None:
    if _stall is not None and key.startswith(_stall[0]):
        time.sleep(_stall[1])
    if _fail is not None and key.startswith(_fail):
        raise StorageError(f"storage write of {key!r} failed: backend unavailable (injected fault)", key=key)


class _FaultWriter(Writer):
    def __init__(self, inner: Writer) -> None:
        self._inner = inner

    def write(self, data: bytes | memoryview) -> None:
        _carry(len(data))
        if _random is not None and len(data) > 1:
            view = memoryview(data)
            half = len(view) // 2
            self._inner.write(view[:half])
            crash_point("storage-write-partial")
            self._inner.write(view[half:])
        else:
            self._inner.write(data)

    def commit(self) -> bool:
        crash_point("storage-before-rename")
        return self._inner.commit()

    def abort(self) -> None:
        self._inner.abort()


class _FaultStorage(Storage):
    """Delegates to the real storage, with the configured faults on the write path."""

    def __init__(self, inner: Storage) -> None:
        self.inner = inner
        self.url = inner.url

    def open_write(self, key: str, *, once: bool = False) -> Writer:
        _before_write(key)
        return _FaultWriter(self.inner.open_write(key, once=once))

    def create_if_absent(self, key: str, data: bytes) -> bool:
        _before_write(key)
        return self.inner.create_if_absent(key, data)

    def link(self, src: str, dst: str) -> bool:
        _before_write(dst)
        return self.inner.link(src, dst)

    def read(self, key: str, start: int = 0, end: int | None = None) -> bytes:
        return self.inner.read(key, start, end)

    def read_into(self, key: str, start: int, view: memoryview) -> int:
        return self.inner.read_into(key, start, view)

    def size(self, key: str) -> int | None:
        return self.inner.size(key)

    def stamp(self, key: str) -> str | None:
        return self.inner.stamp(key)

    def read_or_none(self, key: str) -> bytes | None:
        return self.inner.read_or_none(key)

    def list(self, prefix: str) -> list[str]:
        return self.inner.list(prefix)

    def delete(self, key: str) -> None:
        self.inner.delete(key)

    def delete_tree(self, prefix: str) -> None:
        self.inner.delete_tree(prefix)

    def reclaim_temps(self, prefix: str, older_than: float) -> int:
        return self.inner.reclaim_temps(prefix, older_than)

    @property
    def presigns(self) -> bool:  # type: ignore[override]
        return self.inner.presigns

    def presign_put(self, key: str, size: int, part_size: int, sha256s: list[str], seconds: float):  # noqa: ANN201
        _before_write(key)
        return self.inner.presign_put(key, size, part_size, sha256s, seconds)

    def complete_presigned(self, key: str, upload_id: str, etags: list[str], sha256s: list[str]) -> None:
        _before_write(key)
        self.inner.complete_presigned(key, upload_id, etags, sha256s)

    def stored_sha256(self, key: str) -> str | None:
        return self.inner.stored_sha256(key)


def wrap_storage(storage: Storage) -> Storage:
    """``storage`` itself, or a fault-injecting wrapper when a fault setting above is present."""
    if _random is None and _stall is None and _fail is None and _throttle is None:
        return storage
    return _FaultStorage(storage)


configure()
