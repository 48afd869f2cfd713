"""``ckptd serve`` with faults wrapped around its storage: the crash and fault tests' server.

The product holds no fault injection. This module wraps the storage the service is given
(``ckptd.service.server.serve(settings, storage=...)``) and reads the storage calls the service makes:
each step of the commit protocol is a write of a known key (``ckptd.store.paths``), so a crash
"between two steps" is a kill before or after that write, made from outside the service.
:class:`tests.support.ServerProcess` runs this module instead of ``ckptd serve`` when the server's
environment sets ``CKPTD_FAULTS``; the service's own settings come from the environment as usual
(``CKPTD_ROOT``, ``CKPTD_PORT``, ``CKPTD_DURABLE``...).

``CKPTD_FAULTS``: clauses separated by ``;``, each ``kind=value``:

* ``crash-at=<point>``: the process SIGKILLs itself when it reaches the named point
  (:data:`CRASH_POINTS`, a point of the durable tier's copy, :data:`DURABLE_CRASH_POINTS`, or of the
  re-read after a marker, :data:`REREAD_CRASH_POINTS`).
* ``crash-random=<seed>:<probability>[:<point>,<point>...]``: every kill point the process passes
  (the named points, and two inside every storage write: ``storage-write-partial``, half of a
  write's bytes in the temp object, and ``storage-before-rename``, the object complete but not yet
  in place), or only those listed, draws from a ``random.Random(seed)`` and SIGKILLs the process
  with that probability. The point is written to stderr first (``ckptd fault: SIGKILL at <point> ...``).
  ``crash-random=@<path>``: the same spec read from a file, re-read (and the generator re-seeded)
  whenever the file is replaced; an empty or missing file kills nothing. A test then arms and
  disarms one server process between saves.
* ``stall=<run>:<seconds>``: every object written under ``runs/<run>/`` waits ``seconds`` first
  (a slow backend for one run).
* ``stall-reread=<seconds>``: every share's record of a re-read after a marker (``reread/.../part-<i>``)
  waits ``seconds`` before it is stored (a checker slow to report: its claim held, its part not stored).
* ``stall-indexes=<seconds>``: every object of rank indexes (``sessions/<sid>/ranks/...``) waits ``seconds``
  before it is stored (a slow write, while more indexes arrive).
* ``fail=<run>``: every such write raises :class:`~ckptd_schemas.StorageError` (a backend that is
  unavailable for one run).
* ``throttle=<MB/s>``: the bytes of every storage write pass one shared link of that rate (a slow
  remote store, for the compression benchmark): each write waits until the link has carried it.

Run: ``CKPTD_FAULTS=crash-at=index-written CKPTD_ROOT=/tmp/r python tests/fault_server.py`` (with the
repository root on ``PYTHONPATH``: ``tests/ckptd`` must not stand in for the package).
"""

from __future__ import annotations

import os
import random
import signal
import threading
import time
from collections.abc import Mapping

from ckptd.storage import Storage, Writer
from ckptd.store.paths import Paths
from ckptd.store.tiers import TieredStorage
from ckptd_schemas import StorageError

__all__ = ["CRASH_POINTS", "DURABLE_CRASH_POINTS", "REREAD_CRASH_POINTS", "STORAGE_CRASH_POINTS", "FaultStorage",
           "Faults", "main", "wrap"]

CRASH_POINTS = (
    "upload-mid-stream",      # part of a data file written to its temp object, not yet in place
    "upload-before-digest",   # a data file in place, its digest record not yet created
    "index-written",          # a rank's index stored, commit not yet attempted
    "commit-before-manifest", # all indexes merged, manifest not yet written
    "commit-before-marker",   # manifest durable, COMMITTED not yet created
    "commit-after-marker",    # COMMITTED created, response not yet sent
)
DURABLE_CRASH_POINTS = (
    "durable-before-marker",  # every file and the manifest on the durable tier, its marker not yet
)
REREAD_CRASH_POINTS = (
    "reread-part-stored",     # a share of the re-read after a marker checked and stored, its other claims held
)
STORAGE_CRASH_POINTS = (
    "storage-write-partial",  # half of one write's bytes in the temp object
    "storage-before-rename",  # the temp object complete, not yet in place
)
KINDS = ("crash-at", "crash-random", "stall", "stall-reread", "stall-indexes", "fail", "throttle")


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


class RandomKill:
    """The ``crash-random`` draw: a seeded generator, optionally re-armed from a control file."""

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
        """The draw's number when this pass at ``point`` kills, else None."""
        with self.lock:
            if self.path is not None:
                self._reload()
            if self.probability <= 0 or self.points is not None and point not in self.points:
                return None
            self.calls += 1
            return self.calls if self.rng.random() < self.probability else None


_dying = threading.Lock()


def _kill(point: str, how: str) -> None:
    # Taken and never released: when several threads draw a kill at once, one logs and kills, the
    # others wait here for the signal, so the log names exactly one kill point per death.
    _dying.acquire()
    os.write(2, f"ckptd fault: SIGKILL at {point} ({how})\n".encode())
    os.kill(os.getpid(), signal.SIGKILL)


class Faults:
    """One ``CKPTD_FAULTS`` setting, parsed: what :class:`FaultStorage` does on each write."""

    def __init__(self, spec: str = "") -> None:
        faults = parse(spec)
        self.random = RandomKill(faults["crash-random"]) if faults.get("crash-random") else None
        self.crash_at = faults.get("crash-at") or None
        self.stall: tuple[str, float] | None = None  # (runs/<run>/ prefix, seconds)
        if faults.get("stall"):
            run, _, seconds = faults["stall"].rpartition(":")
            self.stall = (f"{Paths.run(run)}/", float(seconds))
        self.stall_reread = float(faults["stall-reread"]) if faults.get("stall-reread") else None
        self.stall_indexes = float(faults["stall-indexes"]) if faults.get("stall-indexes") else None
        self.fail = f"{Paths.run(faults['fail'])}/" if faults.get("fail") else None
        self.throttle = float(faults["throttle"]) * 1e6 if faults.get("throttle") else None  # bytes/s
        self._link_free = 0.0  # monotonic time at which the link has carried every write so far
        self._link = threading.Lock()

    @classmethod
    def from_env(cls, environ: Mapping[str, str] = os.environ) -> "Faults":
        return cls(environ.get("CKPTD_FAULTS", ""))

    @property
    def active(self) -> bool:
        return any(f is not None for f in (self.random, self.crash_at, self.stall, self.stall_reread,
                                           self.stall_indexes, self.fail, self.throttle))

    def reached(self, point: str) -> None:
        """The process passes the kill point ``point``: die here if the setting says so."""
        if self.random is not None:
            call = self.random.draw(point)
            if call is not None:
                _kill(point, f"random, draw {call}")
        if self.crash_at == point:
            _kill(point, "crash-at")

    def before_write(self, key: str) -> None:
        """The stall or failure of a write of ``key``, before the backend sees it."""
        if self.stall is not None and key.startswith(self.stall[0]):
            time.sleep(self.stall[1])
        if self.stall_reread is not None and key.startswith("reread/") and "/part-" in key:
            time.sleep(self.stall_reread)
        if self.stall_indexes is not None and "/sessions/" in key and "/ranks/" in key:
            time.sleep(self.stall_indexes)
        if self.fail is not None and key.startswith(self.fail):
            raise StorageError(f"storage write of {key!r} failed: backend unavailable (injected fault)", key=key)

    def carry(self, nbytes: int) -> None:
        """Wait until the throttled link has carried ``nbytes`` after everything written before."""
        if self.throttle is None or nbytes <= 0:
            return
        with self._link:
            self._link_free = max(time.monotonic(), self._link_free) + nbytes / self.throttle
            until = self._link_free
        time.sleep(max(0.0, until - time.monotonic()))


def _kind(key: str) -> str | None:
    """Which protocol object ``key`` is: ``file``, ``digest``, ``index``, ``manifest``, ``marker``, or None."""
    _, _, rest = Paths.parse(key)
    if rest is None:
        return None
    if rest == "COMMITTED":
        return "marker"
    parts = rest.split("/")
    if len(parts) >= 4 and parts[0] == "sessions":
        return {"files": "file", "digests": "digest", "ranks": "index"}.get(parts[2])
    if len(parts) == 3 and parts[0] == "sessions" and parts[2].startswith("manifest-"):
        return "manifest"
    return None


class _FaultWriter(Writer):
    def __init__(self, inner: Writer, storage: "FaultStorage", key: str) -> None:
        self._inner, self._storage, self._key = inner, storage, key
        self._wrote = False

    def _written(self) -> None:
        if not self._wrote:
            self._wrote = True
            self._storage._after_first_write(self._key)

    def write(self, data: bytes | memoryview) -> None:
        faults = self._storage.faults
        faults.carry(len(data))
        if faults.random is not None and len(data) > 1:
            view = memoryview(data)
            half = len(view) // 2
            self._inner.write(view[:half])
            faults.reached("storage-write-partial")
            self._inner.write(view[half:])
        else:
            self._inner.write(data)
        self._written()

    def write_parts(self, parts: list[bytes]) -> None:
        if self._storage.faults.random is not None or self._storage.faults.throttle is not None:
            super().write_parts(parts)  # piece by piece, each through write(): its draw, its share of the link
            return
        self._inner.write_parts(parts)
        self._written()

    def commit(self) -> bool:
        self._storage.faults.reached("storage-before-rename")
        created = self._inner.commit()
        self._storage._after_commit(self._key)
        return created

    def abort(self) -> None:
        self._inner.abort()


class FaultStorage(Storage):
    """Delegates to the real storage, with the configured faults on the write path and the protocol's
    kill points read off the keys it writes (``durable=True``: the durable tier's copy)."""

    def __init__(self, inner: Storage, faults: Faults, *, durable: bool = False) -> None:
        self.inner, self.faults, self.durable_tier = inner, faults, durable
        self.url, self.read_piece = inner.url, inner.read_piece

    # -- the protocol's steps, as writes of its keys ------------------------------------------------------
    def _before(self, key: str) -> None:
        self.faults.before_write(key)
        kind = _kind(key)
        if self.durable_tier:
            if kind == "marker":
                self.faults.reached("durable-before-marker")
        elif kind == "digest":
            self.faults.reached("upload-before-digest")
        elif kind == "manifest":
            self.faults.reached("commit-before-manifest")
        elif kind == "marker":
            self.faults.reached("commit-before-marker")

    def _after_first_write(self, key: str) -> None:
        if not self.durable_tier and _kind(key) == "file":
            self.faults.reached("upload-mid-stream")

    def _after_commit(self, key: str) -> None:
        if not self.durable_tier and _kind(key) == "index":
            self.faults.reached("index-written")
        elif key.startswith("reread/") and "/part-" in key:
            self.faults.reached("reread-part-stored")

    # -- writes ----------------------------------------------------------------------------------------
    def open_write(self, key: str, *, once: bool = False) -> Writer:
        self._before(key)
        return _FaultWriter(self.inner.open_write(key, once=once), self, key)

    def create_if_absent(self, key: str, data: bytes) -> bool:
        self._before(key)
        created = self.inner.create_if_absent(key, data)
        if created and not self.durable_tier and _kind(key) == "marker":
            self.faults.reached("commit-after-marker")
        return created

    def link(self, src: str, dst: str, stamp: str | None = None) -> bool:
        self._before(dst)
        return self.inner.link(src, dst, stamp)

    @property
    def presigns(self) -> bool:  # type: ignore[override]
        return self.inner.presigns

    def presign_put(self, key: str, size: int, part_size: int, sha256s: list[str], seconds: float):  # noqa: ANN201
        self._before(key)
        return self.inner.presign_put(key, size, part_size, sha256s, seconds)

    def complete_presigned(self, key: str, upload_id: str, etags: list[str], sha256s: list[str]) -> None:
        self._before(key)
        self.inner.complete_presigned(key, upload_id, etags, sha256s)

    # -- everything else: the backend's own ---------------------------------------------------------------
    def read(self, key: str, start: int = 0, end: int | None = None) -> bytes:
        return self.inner.read(key, start, end)

    def read_into(self, key: str, start: int, view: memoryview, *, uncached: bool = False) -> int:
        return self.inner.read_into(key, start, view, uncached=uncached)

    def size(self, key: str) -> int | None:
        return self.inner.size(key)

    def stamp(self, key: str) -> str | None:
        return self.inner.stamp(key)

    def local_path(self, key: str) -> str | None:
        return self.inner.local_path(key)

    def read_or_none(self, key: str) -> bytes | None:
        return self.inner.read_or_none(key)

    def list(self, prefix: str) -> list[str]:
        return self.inner.list(prefix)

    def delete(self, key: str) -> None:
        self.inner.delete(key)

    def delete_tree(self, prefix: str) -> None:
        self.inner.delete_tree(prefix)

    def delete_if_empty(self, prefix: str) -> None:
        self.inner.delete_if_empty(prefix)

    def reclaim_temps(self, prefix: str, older_than: float) -> int:
        return self.inner.reclaim_temps(prefix, older_than)

    def walk(self, prefix: str) -> list[tuple[str, int]]:
        return self.inner.walk(prefix)

    def stored_sha256(self, key: str) -> str | None:
        return self.inner.stored_sha256(key)


def wrap(storage: Storage, faults: Faults) -> Storage:
    """``storage`` itself when ``faults`` sets nothing; else wrapped, tier by tier for a tiered root (the
    durable copier still finds its :class:`TieredStorage`)."""
    if not faults.active:
        return storage
    if isinstance(storage, TieredStorage):
        return TieredStorage(FaultStorage(storage.fast, faults), FaultStorage(storage.durable, faults, durable=True))
    return FaultStorage(storage, faults)


def main() -> None:
    """Serve the root of the environment's settings, its storage wrapped with ``CKPTD_FAULTS``."""
    from ckptd.service.server import serve
    from ckptd.service.settings import Settings
    from ckptd.store.tiers import open_root

    settings = Settings()
    serve(settings, storage=wrap(open_root(settings.storage_url()), Faults.from_env()))


if __name__ == "__main__":
    main()
