"""Two tiers as one root: a fast tier in front of a durable one (``ckptd serve --durable``).

Every write lands on the **fast** tier (a local NVMe directory): sessions, uploads, manifests
and the ``COMMITTED`` marker, so a save commits at local-disk speed and never waits on, or fails
with, the durable tier. The durable tier (an object store, or any root) receives each committed
checkpoint afterwards, whole and verified, from :mod:`ckptd.store.durable`, which writes it
there directly (``TieredStorage.durable``).

The fast tier holds the marker of every checkpoint committed through it, for good: dropping a
fast copy (``DurableCopier.trim``) removes its data and keeps its marker, and a new or emptied
fast tier first takes the durable tier's markers (``DurableCopier.adopt``). So the fast tier alone
answers which names are taken and which checkpoints exist (:meth:`list`, :meth:`create_if_absent`),
and a save needs nothing from the durable tier.

A read of a key under ``runs/RUN/NAME/`` that the fast tier lacks goes to the durable tier when
the fast tier holds that checkpoint's marker (its fast copy was dropped, or lost): such a
checkpoint is read from the durable tier through the same visibility rule and the same digests.
Both copies of a key are the same verified bytes (the durable copy is hashed against the
manifest as it is written), so which tier answers never changes what a reader gets.

:meth:`delete` and :meth:`delete_tree` of a whole checkpoint or its marker delete from the durable
tier first, then the fast one (retention and ``rm`` remove a checkpoint everywhere; a failure on
the durable tier leaves the fast copy, and the checkpoint, in place for the next attempt); every
other delete (staging, sessions, leases) concerns the fast tier alone.

The URL is ``tiered:FAST|DURABLE`` so that worker processes (verification, reshard jobs) reopen
the same two tiers with :func:`ckptd.storage.open_storage`.
"""

from __future__ import annotations

from .base import Adopted, Presigned, Storage, Writer

__all__ = ["TIERED", "TieredStorage", "split_tiered"]

TIERED = "tiered:"


def split_tiered(url: str) -> tuple[str, str]:
    """``tiered:FAST|DURABLE`` -> (FAST, DURABLE)."""
    fast, sep, durable = url[len(TIERED):].rpartition("|")
    if not sep or not fast or not durable:
        raise ValueError(f"a tiered root is 'tiered:FAST|DURABLE', got {url!r}")
    return fast, durable


class TieredStorage(Storage):
    """The fast tier, with the durable tier behind it for reads (see the module docstring)."""

    def __init__(self, fast: Storage, durable: Storage) -> None:
        self.fast, self.durable = fast, durable
        self.url = f"{TIERED}{fast.url}|{durable.url}"
        self.read_piece = max(fast.read_piece, durable.read_piece)

    def _behind(self, key: str) -> bool:
        """True when ``key`` lies under a checkpoint whose marker the fast tier holds: the durable tier
        may hold the key (the fast copy was dropped); under any other name it holds nothing visible."""
        parts = key.split("/")
        return len(parts) > 3 and parts[0] == "runs" and self.fast.exists(f"runs/{parts[1]}/{parts[2]}/COMMITTED")

    def _holder(self, key: str) -> Storage:
        """The tier a read of ``key`` goes to: the fast one while it holds the key."""
        return self.durable if self.fast.size(key) is None and self._behind(key) else self.fast

    # -- writes, names and listings: the fast tier ---------------------------------------------------
    def open_write(self, key: str) -> Writer:
        return self.fast.open_write(key)

    def put(self, key: str, data: bytes) -> None:
        self.fast.put(key, data)

    def create_if_absent(self, key: str, data: bytes) -> bool:
        return self.fast.create_if_absent(key, data)

    def adopt(self, key: str, staged: str) -> Adopted | None:
        return self.fast.adopt(key, staged)

    def link(self, src: str, dst: str) -> bool:
        """A link inside the fast tier; a source only the durable tier holds is sent again instead."""
        return self.fast.link(src, dst)

    def list(self, prefix: str) -> list[str]:
        return self.fast.list(prefix)

    # -- reads: the fast tier, else (for a dropped fast copy) the durable one ---------------------------
    def read(self, key: str, start: int = 0, end: int | None = None) -> bytes:
        return self._holder(key).read(key, start, end)

    def read_into(self, key: str, start: int, view: memoryview) -> int:
        return self._holder(key).read_into(key, start, view)

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

    def content_stamp(self, key: str) -> str | None:
        return self.fast.content_stamp(key)  # what a link (fast tier only) relies on

    def local_path(self, key: str) -> str | None:
        """A fast-tier path (also for a key not written yet: direct writes create it there); for a key
        only the durable tier holds, its path if that is a local root."""
        if self._holder(key) is self.durable:
            return self.durable.local_path(key)
        return self.fast.local_path(key)

    def reclaim_temps(self, prefix: str, older_than: float) -> int:
        return self.fast.reclaim_temps(prefix, older_than)  # the durable tier's writes are the copier's

    # -- deletes: a whole checkpoint, or its marker, from both tiers (the durable one first) ----------
    @staticmethod
    def _durable_too(key: str) -> bool:
        """Whether a delete of ``key`` reaches the durable tier: a checkpoint's tree (``runs/RUN/NAME``)
        or its marker, which retention and ``rm`` delete. The durable tier holds nothing else a delete
        names (staging, aborted and stale sessions, leases and records live on the fast tier only)."""
        parts = key.split("/")
        return parts[0] == "runs" and (len(parts) in (2, 3) or (len(parts) == 4 and parts[3] == "COMMITTED"))

    def delete(self, key: str) -> None:
        if self._durable_too(key):
            self.durable.delete(key)
        self.fast.delete(key)

    def delete_tree(self, prefix: str) -> None:
        if self._durable_too(prefix):
            self.durable.delete_tree(prefix)
        self.fast.delete_tree(prefix)

    # -- presigned uploads: only where the fast tier takes them --------------------------------------
    @property
    def presigns(self) -> bool:  # type: ignore[override]
        return self.fast.presigns

    def presign_put(self, key: str, size: int, part_size: int, sha256s: list[str],
                    seconds: float) -> Presigned | None:
        return self.fast.presign_put(key, size, part_size, sha256s, seconds)

    def complete_presigned(self, key: str, upload_id: str, etags: list[str], sha256s: list[str]) -> None:
        self.fast.complete_presigned(key, upload_id, etags, sha256s)

    def stored_sha256(self, key: str) -> str | None:
        return self.fast.stored_sha256(key)
