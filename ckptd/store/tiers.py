"""Two tiers as one root: a fast tier in front of a durable one (``ckptd serve --durable``).

Every write lands on the **fast** tier (a local NVMe directory): sessions, uploads, manifests
and the ``COMMITTED`` marker, so a save commits at local-disk speed and never waits on, or fails
with, the durable tier. The durable tier (an object store, or any root) receives each committed
checkpoint afterwards, whole and verified, from :mod:`ckptd.store.durable`, which writes it
there directly (``TieredStorage.durable``).

The fast tier holds every checkpoint's marker for good (:mod:`.durable` trims a fast copy's data,
never its marker, and adopts the durable tier's markers), so it answers which checkpoints exist
(:meth:`list`); a name is taken on both tiers at once (:meth:`create_if_absent`).

A read of a key under ``runs/RUN/NAME/`` that the fast tier lacks goes to the durable tier when
the fast tier holds that checkpoint's marker (its fast copy was dropped, or lost): such a
checkpoint is read from the durable tier through the same visibility rule and the same digests.
Both copies of a key are the same verified bytes (the durable copy is hashed against the
manifest as it is written), so which tier answers never changes what a reader gets.

:meth:`delete` and :meth:`delete_tree` of a whole checkpoint or its marker delete from the durable
tier first, then the fast one (retention and ``rm`` remove a checkpoint everywhere; a failure on
the durable tier leaves the fast copy, and the checkpoint, in place for the next attempt), and only
where both tiers hold the same checkpoint (session and manifest digest): a different checkpoint
under the same name is never removed. Every other delete (staging, sessions, leases) concerns the
fast tier alone.

The URL is ``tiered:FAST|DURABLE`` so that worker processes (verification, reshard jobs) reopen
the same two tiers with :func:`open_root`. The tiers are the store's: they know where a
checkpoint's marker lies and what it says (:mod:`.paths`); the storage backends know keys only.
"""

from __future__ import annotations

import logging
from typing import Any

from ckptd_schemas import StorageError

from ..storage import Storage, open_storage
from .paths import Marker, Paths
from .visibility import Visibility

__all__ = ["ADOPTED", "TIERED", "TieredStorage", "open_root", "split_tiered"]

TIERED = "tiered:"
#: On the fast tier, inside ``runs/`` (so it goes with a lost ``runs/``): the fast tier holds every
#: marker of the durable tier (written by ``DurableCopier.adopt``).
ADOPTED = "runs/.adopted"

log = logging.getLogger("ckptd.tiers")


def open_root(url: str, **options: object) -> Storage:
    """The root at ``url``: ``tiered:FAST|DURABLE`` is a :class:`TieredStorage` over the two (``ckptd serve
    --durable``); anything else what :func:`ckptd.storage.open_storage` opens."""
    if url.startswith(TIERED):
        fast, durable = split_tiered(url)
        return TieredStorage(open_storage(fast, **options), open_storage(durable))
    return open_storage(url, **options)


def split_tiered(url: str) -> tuple[str, str]:
    """``tiered:FAST|DURABLE`` -> (FAST, DURABLE)."""
    fast, sep, durable = url[len(TIERED):].rpartition("|")
    if not sep or not fast or not durable:
        raise ValueError(f"a tiered root is 'tiered:FAST|DURABLE', got {url!r}")
    return fast, durable


def _fast(name: str) -> Any:
    """A method of :class:`TieredStorage` that is the fast tier's own."""
    def call(self: "TieredStorage", *args: Any, **kw: Any) -> Any:
        return getattr(self.fast, name)(*args, **kw)
    call.__name__ = name
    return call


class TieredStorage(Storage):
    """The fast tier, with the durable tier behind it for reads (see the module docstring)."""

    def __init__(self, fast: Storage, durable: Storage) -> None:
        self.fast, self.durable = fast, durable
        self.url = f"{TIERED}{fast.url}|{durable.url}"
        self.read_piece = max(fast.read_piece, durable.read_piece)

    def for_probes(self) -> "TieredStorage":
        return TieredStorage(self.fast.for_probes(), self.durable.for_probes())

    def _behind(self, key: str) -> bool:
        """True when ``key`` lies under a checkpoint whose marker the fast tier holds: the durable tier
        may hold the key (the fast copy was dropped); under any other name it holds nothing visible."""
        run, name, rest = Paths.parse(key)
        return rest is not None and self.fast.exists(Paths.marker(run, name))  # type: ignore[arg-type]

    def _holder(self, key: str) -> Storage:
        """The tier a read of ``key`` goes to: the fast one while it holds the key."""
        return self.durable if self.fast.size(key) is None and self._behind(key) else self.fast

    # -- writes, names and listings: the fast tier (a link: within it; a source only the durable tier
    # holds is sent again instead); its temp files, what it holds and its free space (every write lands
    # there; the durable tier's writes are the copier's, checked as it copies) -------------------------
    open_write, list, link = _fast("open_write"), _fast("list"), _fast("link")
    reclaim_temps, walk, free_space = _fast("reclaim_temps"), _fast("walk"), _fast("free_space")
    delete_if_empty = _fast("delete_if_empty")

    def create_if_absent(self, key: str, data: bytes) -> bool:
        """On the fast tier; a checkpoint's marker only while the durable tier holds none under the name
        either (a name is taken on every tier at once: a fast tier that lost its markers never lets a
        save reuse a name the durable tier holds). While the durable tier cannot be asked, the fast tier
        decides alone only if it holds every durable marker (:data:`ADOPTED`, written by the copier's
        adoption into ``runs/``, goes with a lost ``runs/``); otherwise the create fails as transient."""
        if Paths.is_marker(key):
            try:
                if self.durable.exists(key):
                    return False
            except StorageError:
                if not self.fast.exists(ADOPTED):
                    raise StorageError(f"{key}: the durable tier cannot be asked whether the name is taken, and "
                                       f"the fast tier has not taken the durable tier's markers since it was "
                                       f"emptied; retried once either is back", key=key) from None
        return self.fast.create_if_absent(key, data)

    # -- reads: the fast tier, else (for a dropped fast copy) the durable one ---------------------------
    def read(self, key: str, start: int = 0, end: int | None = None) -> bytes:
        return self._holder(key).read(key, start, end)

    def read_into(self, key: str, start: int, view: memoryview, *, uncached: bool = False) -> int:
        return self._holder(key).read_into(key, start, view, uncached=uncached)

    def read_or_none(self, key: str) -> bytes | None:
        data = self.fast.read_or_none(key)
        return data if data is not None or not self._behind(key) else self.durable.read_or_none(key)

    def size(self, key: str) -> int | None:
        n = self.fast.size(key)
        return n if n is not None or not self._behind(key) else self.durable.size(key)

    def stamp(self, key: str) -> str | None:
        s = self.fast.stamp(key)
        if s is not None or not self._behind(key):
            return s
        d = self.durable.stamp(key)
        return None if d is None else f"durable:{d}"

    def local_path(self, key: str) -> str | None:
        """A fast-tier path (also for a key not written yet); for a key only the durable tier holds, its
        path if that is a local root."""
        return self._holder(key).local_path(key)

    # -- deletes: a whole checkpoint, or its marker, from both tiers (the durable one first) ----------
    @staticmethod
    def _durable_too(key: str) -> bool:
        """Whether a delete of ``key`` reaches the durable tier: a run's or a checkpoint's tree
        (``runs/RUN``, ``runs/RUN/NAME``) or a marker, which retention and ``rm`` delete. The durable
        tier holds nothing else a delete names (staging, aborted and stale sessions, leases and records
        live on the fast tier only)."""
        run, _, rest = Paths.parse(key)
        return run is not None and (rest is None or Paths.is_marker(key))

    def _identity(self, tier: Storage, run: str, name: str) -> tuple[str, str] | None:
        """(session, manifest digest) of the marker ``tier`` holds for ``run/name`` (read by the one reader
        of markers); None when it holds none or one that does not parse."""
        m = Visibility(tier).marker(run, name)
        return (m.session, m.manifest_xxh3) if isinstance(m, Marker) else None

    def _delete_durable(self, run: str, name: str, marker_only: bool) -> None:
        """Delete ``run/name`` from the durable tier only where it is the same checkpoint as the fast
        tier's (the same session and manifest digest): a durable checkpoint of another identity under
        the name is never removed. Without a durable marker, what the durable tier holds under the
        name is invisible there (an unfinished copy): the fast checkpoint's own session, or, when the
        fast marker is gone too (a marker deleted before its tree), the whole name."""
        fast = self._identity(self.fast, run, name)
        there = self._identity(self.durable, run, name)
        if fast is None and there is not None:
            return  # not a checkpoint of the fast tier: nothing here decides for the durable tier
        if there is None:
            if not marker_only:
                self.durable.delete_tree(Paths.ckpt(run, name) if fast is None else Paths.session(run, name, fast[0]))
        elif there == fast:
            if marker_only:
                self.durable.delete(Paths.marker(run, name))
            else:
                self.durable.delete_tree(Paths.ckpt(run, name))
        else:
            log.warning("tiers: %s/%s on the durable tier is another checkpoint (session %s, manifest %s) than on "
                        "the fast tier (session %s, manifest %s); the durable one is kept", run, name, *there, *fast)

    def _delete_everywhere(self, key: str) -> None:
        run, name, _ = Paths.parse(key)
        if name is None:  # a whole run: checkpoint by checkpoint
            for n in self.fast.list(key):
                self._delete_durable(run, n, marker_only=False)  # type: ignore[arg-type]
        else:
            self._delete_durable(run, name, marker_only=Paths.is_marker(key))  # type: ignore[arg-type]

    def delete(self, key: str) -> None:
        if self._durable_too(key):
            self._delete_everywhere(key)
        self.fast.delete(key)

    def delete_tree(self, prefix: str) -> None:
        if self._durable_too(prefix):
            self._delete_everywhere(prefix)
        self.fast.delete_tree(prefix)

    # -- presigned uploads: only where the fast tier takes them --------------------------------------
    @property
    def presigns(self) -> bool:  # type: ignore[override]
        return self.fast.presigns

    presign_put, complete_presigned = _fast("presign_put"), _fast("complete_presigned")
    stored_sha256 = _fast("stored_sha256")
