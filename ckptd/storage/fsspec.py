"""Storage on any fsspec filesystem without a backend of its own (``memory://``, ``gs://``, ``az://``...;
:func:`ckptd.storage.open_storage` opens ``file://`` as :class:`~ckptd.storage.local.LocalStorage` and ``s3://``
as :class:`ckptd.storage.s3.S3Storage`, its own backend over s3fs's client).

Object stores (no rename) write the object in place: it becomes visible only
when the upload completes (single PUT or multipart completion), which is the
writer's commit. Filesystems with rename use a temporary key and ``mv``.
"""

from __future__ import annotations

import contextlib
import threading
import uuid
from typing import Any

import fsspec

from ckptd_schemas import StorageError

from .base import Storage, Writer, check_key
from .failures import classified

__all__ = ["FsspecStorage"]

# memory:// is not one: its files appear in the store as soon as they are opened
# for writing (and stay after discard), so it needs the temp key + mv path.
_OBJECT_STORES = {"gs", "gcs", "az", "abfs"}


class _FsspecWriter(Writer):
    def __init__(self, fs: Any, final: str, key: str, in_place: bool, root: str) -> None:
        self._fs, self._final, self._key, self._root = fs, final, key, root
        self._path = final if in_place else f"{final}.tmp-{uuid.uuid4().hex[:12]}"
        self._in_place = in_place
        self._closed = False
        with classified("open", key, root):  # any backend error becomes StorageError
            if not in_place:
                fs.makedirs(final.rsplit("/", 1)[0], exist_ok=True)
            self._f = fs.open(self._path, "wb")

    def write(self, data: bytes | memoryview) -> None:
        with self._aborting("write", self._key, self._root):  # any backend error becomes StorageError
            self._f.write(data)

    def commit(self) -> bool:
        with self._aborting("commit", self._key, self._root):
            self._f.close()
            self._closed = True
            if not self._in_place:
                self._fs.mv(self._path, self._final)
            return True

    def abort(self) -> None:
        if not self._closed:
            self._closed = True
            discard = getattr(self._f, "discard", None)
            try:
                discard() if discard is not None and self._in_place else self._f.close()
            except Exception:  # noqa: BLE001
                pass
        if not self._in_place:
            try:
                self._fs.rm(self._path)
            except Exception:  # noqa: BLE001
                pass


class _OnceWriter(Writer):
    """``open_write(once=True)`` on a backend without a conditional create: the bytes are kept in
    memory and created with :meth:`FsspecStorage.create_if_absent` (exactly once within this process)."""

    def __init__(self, st: "FsspecStorage", key: str) -> None:
        self._st, self._key, self._buf = st, key, bytearray()

    def write(self, data: bytes | memoryview) -> None:
        self._buf += data

    def commit(self) -> bool:
        data, self._buf = bytes(self._buf), bytearray()
        return self._st.create_if_absent(self._key, data)

    def abort(self) -> None:
        self._buf = bytearray()


class FsspecStorage(Storage):
    """Storage rooted at an fsspec URL such as ``memory://ckpt`` or ``gs://bucket/prefix``."""

    def __init__(self, url: str, **storage_options: Any) -> None:
        self.url = url.rstrip("/")
        self.fs, root = fsspec.url_to_fs(self.url, **storage_options)
        self.root = root.rstrip("/")
        protocol = self.fs.protocol if isinstance(self.fs.protocol, str) else self.fs.protocol[0]
        self._in_place = protocol in _OBJECT_STORES
        self._create_lock = threading.Lock()
        if not self._in_place:
            self.fs.makedirs(self.root, exist_ok=True)

    def _path(self, key: str) -> str:
        return f"{self.root}/{check_key(key)}"

    def open_write(self, key: str, *, once: bool = False) -> Writer:
        if once:  # no native conditional create here: exactly-once within this process only
            return _OnceWriter(self, key)
        return _FsspecWriter(self.fs, self._path(key), key, self._in_place, self.url)

    def read(self, key: str, start: int = 0, end: int | None = None) -> bytes:
        with classified("read", key, self.url):
            try:
                return self.fs.cat_file(self._path(key), start=start, end=end)
            except FileNotFoundError as e:
                raise StorageError(f"storage object {key!r} does not exist", key=key) from e

    def size(self, key: str) -> int | None:
        with classified("stat", key, self.url):
            try:
                info = self.fs.info(self._path(key))
            except FileNotFoundError:
                return None
        return int(info.get("size") or 0) if info.get("type") != "directory" else 0

    def list(self, prefix: str) -> list[str]:
        path = self._path(prefix) if prefix else self.root
        with classified("list", prefix, self.url):
            try:
                entries = self.fs.ls(path, detail=False, refresh=True) if self.fs.exists(path) else []
            except FileNotFoundError:
                return []
        names = {str(e).rstrip("/").rsplit("/", 1)[-1] for e in entries}
        return sorted(n for n in names if n and not n.startswith(".") and ".tmp-" not in n)

    def walk(self, prefix: str) -> list[tuple[str, int]]:
        path = self._path(prefix)
        with classified("list", prefix, self.url):
            try:
                found = self.fs.find(path, detail=True) if self.fs.exists(path) else {}
            except FileNotFoundError:
                return []
        return sorted((str(p)[len(self.root) + 1:].lstrip("/"), int(i.get("size") or 0)) for p, i in found.items()
                      if i.get("type") != "directory")

    def create_if_absent(self, key: str, data: bytes) -> bool:
        """Exactly once within this process only (no native conditional create; S3's is ``S3Storage``'s)."""
        with self._create_lock:
            if self.size(key) is not None:
                return False
            self.put(key, data)
            return True

    def link(self, src: str, dst: str, stamp: str | None = None) -> bool:
        if stamp is not None:
            return False  # a copy here is not conditional: the bytes are sent and checked
        with classified("link", dst, self.url):
            try:
                self.fs.copy(self._path(src), self._path(dst))  # an object store: a server-side copy
            except FileNotFoundError:
                return False
        return True

    def delete(self, key: str) -> None:
        path = self._path(key)
        with classified("delete", key, self.url), contextlib.suppress(FileNotFoundError):
            self.fs.rm_file(path)

    def delete_tree(self, prefix: str) -> None:
        path = self._path(prefix)
        with classified("delete", prefix, self.url), contextlib.suppress(FileNotFoundError):
            if self.fs.exists(path):
                self.fs.rm(path, recursive=True)
