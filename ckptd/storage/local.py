"""Local-filesystem storage: temp file + fsync + rename, fsync of directories."""

from __future__ import annotations

import contextlib
import errno
import os
import re
import shutil
import stat
import uuid
from pathlib import Path
from typing import Iterator

from ckptd_schemas import StorageError, StorageFull  # noqa: F401 - StorageFull: also reached through this module

from .base import Storage, Writer, check_key
from .direct import DirectWriter, open_direct, open_regular, write_all
from .direct import read_into as _read_direct
from .failures import classified, classify

__all__ = ["LocalStorage", "fsync_dir"]

_IOV_MAX = min(os.sysconf("SC_IOV_MAX"), 1024) if hasattr(os, "sysconf") else 1024
#: A durable file's written bytes are handed to write-back in windows of this size (see
#: ``_LocalWriter._early_writeback``).
WRITEBACK_BYTES = 32 << 20
_FADVISE = hasattr(os, "posix_fadvise")


def fsync_dir(path: Path) -> None:
    """fsync a directory: a rename or create in it is durable once this returns."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


_TEMP = re.compile(r"\..+\.tmp-[0-9a-f]{12}")  # what _LocalWriter and put() write before the rename


class _LocalWriter(Writer):
    """A temp file renamed (or, ``once``, linked) into place at commit. A durable file is written past
    the page cache (:mod:`.direct`); one that is not (tests, benchmarks that say so) through it."""

    def __init__(self, final: Path, key: str, durable: bool, once: bool = False, root: str = "") -> None:
        self._final = final
        self._key = key
        self._root = root
        self._durable = durable
        self._once = once
        self._tmp = final.with_name(f".{final.name}.tmp-{uuid.uuid4().hex[:12]}")
        self._written = self._flushed = 0  # bytes written; bytes handed to write-back early
        self._fd = -1
        self._direct: DirectWriter | None = None
        with self._aborting("open", key, root, OSError):
            try:
                self._open()
            except FileNotFoundError:  # a folder emptied and removed between the two (delete_if_empty): again
                self._open()

    def _open(self) -> None:
        """Make the folders and open the temp file."""
        self._final.parent.mkdir(parents=True, exist_ok=True)
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC
        if self._durable:
            self._fd, direct = open_direct(self._tmp, flags)
            if direct:
                self._direct = DirectWriter(self._fd, True)
        else:
            self._fd = os.open(self._tmp, flags, 0o644)

    def _early_writeback(self, n: int) -> None:
        """Every WRITEBACK_BYTES of a durable file written through the page cache (where the filesystem
        refuses ``O_DIRECT``), start writing the range back now (``posix_fadvise(DONTNEED)`` starts
        write-back of dirty pages and drops the clean ones), so that the fsync at commit waits for the
        last window only instead of the whole file, and a checkpoint does not push the trainer's
        working set out of the page cache."""
        self._written += n
        if not self._durable or self._written - self._flushed < WRITEBACK_BYTES or not _FADVISE:
            return
        with contextlib.suppress(OSError):  # advice only: the fsync at commit is what makes it durable
            os.posix_fadvise(self._fd, self._flushed, self._written - self._flushed, os.POSIX_FADV_DONTNEED)
        self._flushed = self._written

    def write(self, data: bytes | memoryview) -> None:
        with self._aborting("write", self._key, self._root, OSError):
            if self._direct is not None:
                self._direct.write(data)
                return
            write_all(self._fd, memoryview(data))
            self._early_writeback(len(data))

    def write_parts(self, parts: list[bytes]) -> None:
        """Past the page cache: each piece into the aligned window. Through it: ``os.writev`` of the
        pieces (at most IOV_MAX at a time), finishing any short write."""
        if self._direct is not None:
            for p in parts:
                self.write(p)
            return
        with self._aborting("write", self._key, self._root, OSError):
            for i in range(0, len(parts), _IOV_MAX):
                group = parts[i:i + _IOV_MAX]
                n = os.writev(self._fd, group)
                self._early_writeback(n)  # the rest of a short write is counted by self.write
                if n < sum(map(len, group)):  # a short write (rare on regular files): the rest piece by piece
                    for p in group:
                        if n >= len(p):
                            n -= len(p)
                            continue
                        self.write(memoryview(p)[n:])
                        n = 0

    def commit(self) -> bool:
        with self._aborting("commit", self._key, self._root, OSError):
            if self._direct is not None:
                self._direct.close_tail()
                self._direct = None
            if self._durable:
                os.fsync(self._fd)
            os.close(self._fd)
            self._fd = -1
            if self._once:
                try:
                    os.link(self._tmp, self._final)  # atomic, fails if the key exists: never replaced
                except FileExistsError:
                    self.abort()
                    return False
                self._tmp.unlink()
            else:
                os.replace(self._tmp, self._final)
            if self._durable:
                fsync_dir(self._final.parent)
            return True

    def abort(self) -> None:
        if self._direct is not None:
            self._direct.release()
            self._direct = None
        if self._fd >= 0:
            with contextlib.suppress(OSError):
                os.close(self._fd)
            self._fd = -1
        try:
            self._tmp.unlink(missing_ok=True)
        except OSError:
            pass


class LocalStorage(Storage):
    """A directory on a local (POSIX) filesystem.

    ``durable=False`` skips fsync; only for tests and benchmarks that say so.
    """

    def __init__(self, root: str | os.PathLike[str], *, durable: bool = True) -> None:
        self.root = Path(root).resolve()
        self.url = str(self.root)
        self.durable = durable
        try:
            self.root.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise classify("create", self.url, e, self.url) from e

    def _path(self, key: str) -> Path:
        return self.root.joinpath(*check_key(key).split("/"))

    def open_write(self, key: str, *, once: bool = False) -> Writer:
        return _LocalWriter(self._path(key), key, self.durable, once, self.url)

    @contextlib.contextmanager
    def _reading(self, key: str) -> Iterator[None]:
        """A read of an object that must be there: absent is a :class:`StorageError` (``ENOENT``)."""
        with classified("read", key, self.url, OSError):
            try:
                yield
            except FileNotFoundError as e:
                raise StorageError(f"storage object {key!r} does not exist", key=key, errno=errno.ENOENT) from e

    def read(self, key: str, start: int = 0, end: int | None = None) -> bytes:
        with self._reading(key), open(open_regular(self._path(key)), "rb", buffering=0) as f:
            if start:
                f.seek(start)
            if end is None:
                return f.read()
            want = end - start
            data = f.read(want)  # unbuffered: one bytes object, read into in place (no second copy)
            if 0 < len(data) < want:  # a short read (rare on regular files): read on to the end or EOF
                parts = [data]
                got = len(data)
                while got < want and (more := f.read(want - got)):
                    parts.append(more)
                    got += len(more)
                data = b"".join(parts)
            return data

    def read_into(self, key: str, start: int, view: memoryview, *, uncached: bool = False) -> int:
        with self._reading(key):
            if uncached:
                return _read_direct(self._path(key), start, view)
            with open(open_regular(self._path(key)), "rb", buffering=0) as f:
                f.seek(start)
                got = 0
                while got < len(view):
                    n = f.readinto(view[got:])
                    if not n:
                        break
                    got += n
                return got

    def local_path(self, key: str) -> str | None:
        return str(self._path(key))

    def link(self, src: str, dst: str, stamp: str | None = None) -> bool:
        """A hard link; with ``stamp``, kept only when the inode linked has that stamp's inode, size and
        mtime (the link itself moves its ctime) and had all of it just before."""
        source, target = self._path(src), self._path(dst)
        if stamp is not None and self.stamp(src) != stamp:
            return False
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
            try:
                os.link(source, target, follow_symlinks=False)
            except FileExistsError:
                if not os.path.samefile(source, target):
                    return False  # the name holds another file (an upload under it): nothing is replaced
            now = self.stamp(dst)
            if stamp is not None and (now or "").split(":")[:3] != stamp.split(":")[:3]:
                target.unlink(missing_ok=True)  # changed between the look and the link
                return False
        except (FileNotFoundError, NotADirectoryError):
            return False
        except OSError as e:
            if e.errno in (errno.EXDEV, errno.EPERM, errno.EMLINK, errno.ENOTSUP, errno.EOPNOTSUPP):
                return False  # another filesystem, or one without hard links: the bytes are sent instead
            raise classify("link", dst, e, self.url) from e
        if self.durable:
            fsync_dir(target.parent)
        return True

    def _stat(self, key: str) -> os.stat_result | None:
        with classified("stat", key, self.url, OSError), contextlib.suppress(FileNotFoundError):
            return self._path(key).stat()
        return None

    def stamp(self, key: str) -> str | None:
        """Inode, size, mtime and ctime: ctime moves on every write, rename or ``utime``, and no
        process can set it back."""
        st = self._stat(key)
        return None if st is None else f"{st.st_ino}:{st.st_size}:{st.st_mtime_ns}:{st.st_ctime_ns}"

    def read_or_none(self, key: str) -> bytes | None:
        with classified("read", key, self.url, OSError), \
                contextlib.suppress(FileNotFoundError, NotADirectoryError, IsADirectoryError):
            with open(open_regular(self._path(key)), "rb", buffering=0) as f:
                return f.read()
        return None

    def size(self, key: str) -> int | None:
        st = self._stat(key)
        return None if st is None else 0 if stat.S_ISDIR(st.st_mode) else st.st_size

    def free_space(self) -> tuple[int, int] | None:
        """``statvfs`` of the root: the blocks an unprivileged writer may still use, and the size."""
        with classified("statvfs", "", self.url, OSError):
            st = os.statvfs(self.root)
        return st.f_bavail * st.f_frsize, st.f_blocks * st.f_frsize

    def reclaim_temps(self, prefix: str, older_than: float) -> int:
        """The hidden ``.NAME.tmp-XXXXXXXXXXXX`` files a killed writer left under ``prefix``."""
        n = 0
        for dirpath, _, names in os.walk(self._path(prefix)):
            for name in names:
                path = os.path.join(dirpath, name)
                with contextlib.suppress(FileNotFoundError):
                    if _TEMP.fullmatch(name) and os.lstat(path).st_mtime < older_than:
                        os.unlink(path)
                        n += 1
        return n

    def walk(self, prefix: str) -> list[tuple[str, int]]:
        """Every file (and link) under ``prefix``, hidden ones included; a link is not followed."""
        out: list[tuple[str, int]] = []
        top = self._path(prefix)
        for dirpath, dirs, names in os.walk(top):
            rel = os.path.relpath(dirpath, self.root).replace(os.sep, "/")
            for name in names + [d for d in dirs if os.path.islink(os.path.join(dirpath, d))]:
                with contextlib.suppress(FileNotFoundError):
                    out.append((f"{rel}/{name}", os.lstat(os.path.join(dirpath, name)).st_size))
        return sorted(out)

    def list(self, prefix: str) -> list[str]:
        path = self._path(prefix) if prefix else self.root
        with classified("list", prefix, self.url, OSError):
            try:
                return sorted(n for n in os.listdir(path) if not n.startswith("."))
            except (FileNotFoundError, NotADirectoryError):
                return []

    def delete(self, key: str) -> None:
        path = self._path(key)
        try:
            path.unlink(missing_ok=True)
        except OSError as e:
            if not os.path.lexists(path):  # a read-only filesystem answers EROFS before it looks: absent is fine
                return
            raise classify("delete", key, e, self.url) from e

    def delete_if_empty(self, prefix: str) -> None:
        """``rmdir``: only an empty folder goes, atomically (a writer that makes it again meanwhile: see
        :class:`_LocalWriter`); one absent or holding anything stays as it is."""
        with classified("delete", prefix, self.url, OSError):
            try:
                os.rmdir(self._path(prefix))
            except OSError as e:
                if e.errno not in (errno.ENOENT, errno.ENOTDIR, errno.ENOTEMPTY, errno.EEXIST):
                    raise

    def delete_tree(self, prefix: str) -> None:
        """Delete ``prefix`` and everything under it; a file another writer creates there meanwhile (a
        record written beside a checkpoint being deleted) is deleted with it (ENOTEMPTY: walk again)."""
        path = self._path(prefix)
        for attempt in range(3):
            try:
                shutil.rmtree(path)
                return
            except FileNotFoundError:
                return
            except NotADirectoryError:
                path.unlink(missing_ok=True)
                return
            except OSError as e:
                if e.errno != errno.ENOTEMPTY or attempt == 2:
                    raise classify("delete", prefix, e, self.url) from e
