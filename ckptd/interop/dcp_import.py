"""Import a ``torch.distributed.checkpoint`` directory (``FileSystemWriter``) as a committed checkpoint.

Call order (:func:`import_dcp` does all of it):

1. :func:`inspect_dcp` (reads nothing but ``.metadata`` and file sizes): the pickle DCP's
   ``FileSystemReader(DIR).read_metadata()`` reads, unpickled with only DCP's metadata classes
   allowed (``ckptd_schemas.format.objects.load_dcp_file_metadata``); every tensor chunk and object of the
   metadata must have a storage entry, every data file must exist and hold the bytes its
   entries point at. A missing ``.metadata``, a missing or truncated data file is refused
   with the files named (:class:`DcpImportError`, exit 1) before anything is written.
2. Open an upload session (one rank) on the target (:class:`ImportTarget`, from the command's
   backend, ``ckptd.cli.backends``): a storage root (the store's session code) or a running
   service (HTTP, each data file spooled to a temporary file, hashed, then streamed).
3. Stream item by item, file by file in offset order: DCP's own ``FileSystemReader.read_data``
   decodes each item (``torch.save`` per item, stream transforms included) into a buffer
   the size of that one item; the bytes are hashed (XXH3 per chunk; the store hashes each
   file and its blocks) and appended to the current ckptd data file. Objects (DCP's
   ``BYTE_IO`` items) are kept as the ``torch.save`` bytes DCP wrote, global.
4. Store DCP's metadata (without its storage entries) as the reserved object
   ``__ckptd.dcp_metadata``, so ``client.dcp_reader(REF)`` returns it; send the index; the
   store merges, validates the tiling and commits. Any failure aborts the session:
   nothing becomes visible.
"""

from __future__ import annotations

import dataclasses
import io
import os
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Protocol

import torch
import xxhash

from ckptd_schemas.names import DCP_METADATA
from ckptd_schemas import (
    ITEMSIZE, BoxChunk, DcpImportError, Location, ObjectEntry, RankIndex, TensorEntry,
    parse_ref,
)

__all__ = ["DcpDirectory", "DcpImportError", "FileOut", "ImportResult", "ImportTarget", "import_dcp",
           "inspect_dcp"]

METADATA_FILE = ".metadata"
ALIGN = 64
_PAD = bytes(ALIGN)


@dataclass(frozen=True)
class DcpItem:
    """One stored item of a DCP checkpoint: a tensor chunk or an object."""

    index: Any                    # torch.distributed.checkpoint.metadata.MetadataIndex
    file: str                     # relative path inside the directory
    offset: int
    length: int
    dtype: str | None = None      # tensors only
    offsets: tuple[int, ...] = ()
    sizes: tuple[int, ...] = ()

    @property
    def is_tensor(self) -> bool:
        return self.dtype is not None


@dataclass
class DcpDirectory:
    path: Path
    metadata: Any                 # torch.distributed.checkpoint.metadata.Metadata
    items: list[DcpItem]          # sorted by (file, offset)
    file_sizes: dict[str, int]

    @property
    def total_bytes(self) -> int:
        return sum(i.length for i in self.items)


def _refuse(message: str, files: list[str]) -> DcpImportError:
    return DcpImportError(message, file=files[0] if files else None, files=files[:64])


def inspect_dcp(path: str | os.PathLike) -> DcpDirectory:
    """Read and check a DCP directory's metadata and file sizes; raise :class:`DcpImportError` naming the files."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, MetadataIndex, \
        TensorStorageMetadata

    from ckptd_schemas.format.objects import load_dcp_file_metadata

    root = Path(path)
    meta_path = root / METADATA_FILE
    if not root.is_dir():
        raise _refuse(f"{root} is not a directory: expected a DCP checkpoint directory", [str(root)])
    if not meta_path.is_file():
        raise _refuse(f"{meta_path} is missing: {root} is not a DCP checkpoint (or its save never finished); "
                      f"nothing was imported", [str(meta_path)])
    try:  # not FileSystemReader.read_metadata: that unpickles without restriction
        with open(meta_path, "rb") as f:
            md = load_dcp_file_metadata(f)
    except Exception as e:  # noqa: BLE001 - a damaged metadata file, or one naming classes DCP does not write
        raise _refuse(f"{meta_path} is unreadable ({type(e).__name__}: {e}); nothing was imported",
                      [str(meta_path)]) from e
    if not isinstance(md, Metadata) or not isinstance(getattr(md, "storage_data", None), dict):
        raise _refuse(f"{meta_path} holds no DCP storage entries (not written by FileSystemWriter?); "
                      f"nothing was imported", [str(meta_path)])
    storage = md.storage_data
    items: list[DcpItem] = []
    problems: list[str] = []
    for fqn, entry in md.state_dict_metadata.items():
        if isinstance(entry, TensorStorageMetadata):
            dtype = str(entry.properties.dtype).removeprefix("torch.")
            if dtype not in ITEMSIZE:
                raise _refuse(f"{meta_path}: tensor {fqn!r} has dtype {dtype}, which ckptd does not store",
                              [str(meta_path)])
            keys = [(MetadataIndex(fqn, c.offsets), tuple(c.offsets), tuple(c.sizes)) for c in entry.chunks]
        elif isinstance(entry, BytesStorageMetadata):
            dtype, keys = None, [(MetadataIndex(fqn), (), ())]
        else:
            raise _refuse(f"{meta_path}: entry {fqn!r} has unknown kind {type(entry).__name__}", [str(meta_path)])
        for key, offsets, sizes in keys:
            info = storage.get(key)
            if info is None:
                problems.append(f"{fqn} at {list(offsets)} has no storage entry")
                continue
            rel = str(info.relative_path)
            if Path(rel).is_absolute() or ".." in Path(rel).parts:
                raise _refuse(f"{meta_path}: item {fqn!r} points outside the directory ({rel!r})", [str(meta_path)])
            items.append(DcpItem(key, rel, int(info.offset), int(info.length), dtype, offsets, sizes))
    if problems:
        raise _refuse(f"{meta_path} is inconsistent: {len(problems)} items without storage "
                      f"({'; '.join(problems[:5])}); nothing was imported", [str(meta_path)])

    need: dict[str, int] = {}
    for it in items:
        need[it.file] = max(need.get(it.file, 0), it.offset + it.length)
    sizes: dict[str, int] = {}
    bad: list[str] = []
    reasons: list[str] = []
    for rel in sorted(need):
        p = root / rel
        if not p.is_file():
            bad.append(str(p))
            reasons.append(f"{p} is missing")
            continue
        sizes[rel] = p.stat().st_size
        if sizes[rel] < need[rel]:
            bad.append(str(p))
            reasons.append(f"{p} is truncated: {sizes[rel]} bytes, its items need {need[rel]}")
    if bad:
        raise _refuse(f"DCP checkpoint {root} is damaged: {'; '.join(reasons[:8])}; nothing was imported", bad)
    items.sort(key=lambda i: (i.file, i.offset))
    return DcpDirectory(root, md, items, sizes)


# -- targets ----------------------------------------------------------------------------------------

class FileOut(Protocol):
    size: int

    def write(self, data: bytes | memoryview) -> None: ...
    def finish(self) -> None: ...
    def abort(self) -> None: ...


class ImportTarget(Protocol):
    """Where an import writes: one upload session (one rank). ``ckptd.cli``'s backends give one over a
    root (the store's own session code) and one through a service (``CatalogClient.upload``)."""

    def open(self, run: str, name: str, session: str, step: int | None) -> None: ...
    def begin_file(self, file: str) -> FileOut: ...
    def commit(self, index: RankIndex) -> str: ...
    def abort(self) -> None: ...


# -- streaming --------------------------------------------------------------------------------------

class _Packer:
    """Appends chunks to data files of about ``file_bytes`` each, 64-byte aligned."""

    def __init__(self, target: ImportTarget, file_bytes: int) -> None:
        self.target, self.file_bytes = target, file_bytes
        self.files: list[str] = []
        self.written = 0
        self._cur: FileOut | None = None

    def place(self, data: memoryview | bytes) -> Location:
        if self._cur is None or (self._cur.size and self._cur.size + len(data) > self.file_bytes):
            self.close()
            name = f"r000000-{len(self.files):04d}.bin"
            self._cur = self.target.begin_file(name)
            self.files.append(name)
        cur = self._cur
        offset = cur.size
        cur.write(data)
        pad = (-len(data)) % ALIGN
        if pad:
            cur.write(_PAD[:pad])
        self.written += len(data)
        return Location(file=self.files[-1], offset=offset, length=len(data), raw_length=len(data),
                        xxh3=xxhash.xxh3_64_hexdigest(data))

    def close(self, abort: bool = False) -> None:
        """Finish the current file (``abort``: drop it)."""
        cur, self._cur = self._cur, None
        if cur is not None and abort:
            cur.abort()
        elif cur is not None:
            cur.finish()


class _Capture:
    """A minimal DCP LoadPlanner: hands each item to ``emit`` as FileSystemReader decodes it."""

    def __init__(self, items: list[DcpItem], emit: Callable[[DcpItem, Any], None]) -> None:
        self.items = {it.index: it for it in items}
        self.emit = emit
        self.done = 0

    def resolve_tensor(self, read_item: Any) -> torch.Tensor:
        it = self.items[read_item.storage_index]
        return torch.empty(it.sizes, dtype=getattr(torch, it.dtype))

    def commit_tensor(self, read_item: Any, tensor: torch.Tensor) -> None:
        self.emit(self.items[read_item.storage_index], tensor)
        self.done += 1

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        self.emit(self.items[read_item.storage_index], value.getvalue())
        self.done += 1


def _read_item(it: DcpItem) -> Any:
    from torch.distributed.checkpoint.planner import LoadItemType, ReadItem

    if it.is_tensor:
        zeros = torch.Size([0] * len(it.sizes))
        return ReadItem(type=LoadItemType.TENSOR, dest_index=it.index, dest_offsets=zeros, storage_index=it.index,
                        storage_offsets=zeros, lengths=torch.Size(it.sizes))
    empty = torch.Size([])
    return ReadItem(type=LoadItemType.BYTE_IO, dest_index=it.index, dest_offsets=empty, storage_index=it.index,
                    storage_offsets=empty, lengths=empty)


@dataclass
class ImportResult:
    ref: str
    manifest_xxh3: str
    tensors: int
    chunks: int
    objects: int
    files: int
    bytes_read: int
    bytes_written: int
    seconds: float
    source: str = ""


def import_dcp(path: str | os.PathLike | DcpDirectory, ref: str, target: ImportTarget, *,
               file_bytes: int = 256 << 20, progress: Callable[[int], None] | None = None) -> ImportResult:
    """Ingest a DCP directory as the committed checkpoint ``ref``; nothing is visible unless all of it commits."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata
    from torch.distributed.checkpoint.planner import LoadPlan

    t0 = time.monotonic()
    r = parse_ref(ref)  # its name is checked as a new checkpoint's by the target's open
    src = path if isinstance(path, DcpDirectory) else inspect_dcp(path)  # refuses damage before any write
    md = src.metadata
    fs = FileSystemReader(str(src.path))
    fs.set_up_storage_reader(md, True)

    chunks: dict[str, list[BoxChunk]] = {}
    objects: list[ObjectEntry] = []
    session = uuid.uuid4().hex
    target.open(r.run, r.name, session, int(r.name) if r.name.isdigit() else None)
    packer = _Packer(target, file_bytes)

    def emit(it: DcpItem, value: Any) -> None:
        fqn = it.index.fqn
        if it.is_tensor:
            t: torch.Tensor = value.contiguous()
            if t.numel():  # an empty chunk holds no element: not stored
                loc = packer.place(memoryview(t.reshape(-1).view(torch.uint8).numpy()))
                chunks.setdefault(fqn, []).append(
                    BoxChunk(rank=0, offsets=list(it.offsets), sizes=list(it.sizes), location=loc))
        else:
            objects.append(ObjectEntry(name=fqn, rank=None, encoding="torch", location=packer.place(value)))
        if progress:
            progress(it.length)

    try:
        by_file: dict[str, list[DcpItem]] = {}
        for it in src.items:
            by_file.setdefault(it.file, []).append(it)
        for rel, file_items in by_file.items():
            cap = _Capture(file_items, emit)
            try:
                fs.read_data(LoadPlan([_read_item(it) for it in file_items]), cap).wait()  # type: ignore[arg-type]
            except DcpImportError:
                raise
            except Exception as e:
                bad = file_items[min(cap.done, len(file_items) - 1)]
                raise _refuse(f"{src.path / rel}: item {bad.index.fqn!r} at byte {bad.offset} ({bad.length} bytes) "
                              f"cannot be decoded ({type(e).__name__}: {e}); nothing was imported",
                              [str(src.path / rel)]) from e
        buf = io.BytesIO()
        torch.save(dataclasses.replace(md, storage_data=None), buf)
        objects.append(ObjectEntry(name=DCP_METADATA, rank=None, encoding="torch",
                                   location=packer.place(buf.getvalue())))
        packer.close()
        tensors = []
        for fqn, entry in md.state_dict_metadata.items():
            if isinstance(entry, TensorStorageMetadata):
                tensors.append(TensorEntry(name=fqn, shape=list(entry.size),
                                           dtype=str(entry.properties.dtype).removeprefix("torch."),
                                           group=fqn.split(".", 1)[0], chunks=chunks.get(fqn, [])))
        index = RankIndex(rank=0, world_size=1, tensors=tensors, objects=objects, files=packer.files)
        digest = target.commit(index)
    except BaseException:
        packer.close(abort=True)
        try:
            target.abort()
        except Exception:  # noqa: BLE001 - best effort: an uncommitted session stays invisible anyway
            pass
        raise
    return ImportResult(ref=str(r), manifest_xxh3=digest, tensors=len(tensors),
                        chunks=sum(len(c) for c in chunks.values()), objects=len(objects) - 1,
                        files=len(packer.files), bytes_read=src.total_bytes, bytes_written=packer.written,
                        seconds=time.monotonic() - t0, source=str(src.path))
