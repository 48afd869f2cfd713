"""Independent verification of a committed checkpoint (docs/design.md §2 item 5).

Re-reads every byte of every file in order (bounded memory: one read buffer per file in flight),
recomputes file and block digests, recomputes every chunk's digest and
decodes it (zstd frames are decompressed as they are read, counted and dropped:
a frame that decodes past its chunk's size, numel x itemsize, is stopped there
and reported, so a decompression bomb costs one small buffer), and checks
dtype, shape and exact tiling of every tensor. The bytes come from a
:class:`ByteSource`: storage directly (``--root``) or the service over HTTP
(``--server``), so ``ckptd verify`` never trusts the process that wrote them.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable, Protocol

import xxhash
import zstandard

from ckptd_schemas import CkptdError, FileEntry, Location, Manifest
from ckptd_schemas.chunktable import check_columns_tiling

from .frames import Blosc2Check
from ckptd_schemas.filedigest import StreamDigest

__all__ = ["ByteSource", "VerifyReport", "verify_manifest"]

# Reads no larger than the device's read-ahead window (read_ahead_kb, often 8 MiB or less), so the
# kernel keeps reading ahead while a block is hashed; 16 MiB reads each waited for their own I/O, and
# a fresh 16 MiB buffer (a new mmap from malloc) was page-faulted in on every read (BENCHMARKS.md, Verify).
READ_SIZE = 4 << 20


class ByteSource(Protocol):
    def read(self, file: str, start: int, end: int) -> bytes: ...


@dataclass
class VerifyReport:
    ref: str
    files: int = 0
    tensors: int = 0
    chunks: int = 0
    bytes_read: int = 0
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems


class _FrameTooLong(Exception):
    pass


class _DecodedCount:
    """The sink of a chunk's streamed decode: counts the bytes, keeps none, and stops the decoder once
    they pass the chunk's size (a frame that decodes to 1 GiB costs one ``write_size`` buffer)."""

    def __init__(self, limit: int) -> None:
        self.limit, self.n = limit, 0

    def write(self, data: bytes) -> int:
        self.n += len(data)
        if self.n > self.limit:
            raise _FrameTooLong
        return len(data)


DECODE_WRITE_SIZE = 1 << 17  # bytes the decoder hands the counter at a time


class _ChunkCheck:
    def __init__(self, what: str, loc: Location) -> None:
        self.what, self.loc = what, loc
        self.hash = xxhash.xxh3_64()
        self.count = _DecodedCount(loc.raw_length) if loc.codec == "zstd" else None
        self.blosc2 = Blosc2Check(loc.raw_length) if loc.codec == "blosc2" else None
        self.decoder = (zstandard.ZstdDecompressor().stream_writer(self.count, write_size=DECODE_WRITE_SIZE)
                        if self.count is not None else None)
        self.error: str | None = None

    @property
    def decoded(self) -> int:
        return self.count.n if self.count is not None else 0

    def feed(self, data: memoryview) -> None:
        self.hash.update(data)
        if self.blosc2 is not None:
            self.blosc2.feed(data)
        if self.decoder is not None and self.error is None:
            try:
                self.decoder.write(data)
            except _FrameTooLong:
                self.error = (f"zstd frame in file {self.loc.file!r} at byte {self.loc.offset} decodes to more "
                              f"than the {self.loc.raw_length} bytes its chunk holds (stopped there)")
            except zstandard.ZstdError as e:
                self.error = f"zstd frame in file {self.loc.file!r} at byte {self.loc.offset} does not decode: {e}"

    def problems(self) -> list[str]:
        out = []
        if self.hash.hexdigest() != self.loc.xxh3:
            out.append(f"{self.what}: bytes [{self.loc.offset}, {self.loc.offset + self.loc.length}) of file "
                       f"{self.loc.file!r} hash to {self.hash.hexdigest()}, manifest says {self.loc.xxh3}")
        if self.blosc2 is not None and self.error is None:
            why = self.blosc2.problem()
            if why is not None:
                self.error = f"{why} (file {self.loc.file!r} at byte {self.loc.offset})"
        if self.error:
            out.append(f"{self.what}: {self.error}")
        elif self.decoder is not None and self.decoded != self.loc.raw_length:
            out.append(f"{self.what}: zstd frame in file {self.loc.file!r} at byte {self.loc.offset} decodes to "
                       f"{self.decoded} bytes, expected {self.loc.raw_length}")
        return out


def verify_manifest(
    manifest: Manifest, source: ByteSource, *, progress: Callable[[int], None] | None = None, jobs: int = 2,
) -> VerifyReport:
    """Check every file, chunk and tensor of ``manifest`` against the bytes ``source`` returns.

    Files are checked ``jobs`` at a time: a read waits on the device without the GIL, so a
    second file's reads keep the disk busy while the first one's pieces are hashed (one thread
    leaves it idle during every hash). Problems are reported in file order whatever finishes first.
    """
    report = VerifyReport(ref=manifest.ref, files=len(manifest.files), tensors=len(manifest.tensors))
    for t in manifest.tensors:
        try:
            check_columns_tiling(t.name, t.shape, t.table)
        except CkptdError as e:
            report.problems.append(e.message)
    checks: dict[str, list[_ChunkCheck]] = {}
    for t in manifest.tensors:
        for c in t.chunks:
            checks.setdefault(c.location.file, []).append(_ChunkCheck(f"tensor {t.name!r} (rank {c.rank})", c.location))
    for o in manifest.objects:
        if o.location is not None:
            checks.setdefault(o.location.file, []).append(_ChunkCheck(f"object {o.name!r}", o.location))
    report.chunks = sum(len(v) for v in checks.values())

    def one(item: tuple[str, FileEntry]) -> tuple[list[str], int]:
        fname, entry = item
        return _verify_file(fname, entry, sorted(checks.get(fname, []), key=lambda c: c.loc.offset), source,
                            progress)

    files = sorted(manifest.files.items())
    if jobs > 1 and len(files) > 1:
        with ThreadPoolExecutor(min(jobs, len(files)), thread_name_prefix="ckptd-verify") as pool:
            results = list(pool.map(one, files))
    else:
        results = [one(f) for f in files]
    for problems, nbytes in results:
        report.problems.extend(problems)
        report.bytes_read += nbytes
    return report


def _verify_file(fname: str, entry: FileEntry, pending: list[_ChunkCheck], source: ByteSource,
                 progress: Callable[[int], None] | None) -> tuple[list[str], int]:
    """One file, read in order once: its whole and block digests, and the chunks it holds
    (``pending``, sorted by offset). Returns the problems found and the bytes read."""
    problems: list[str] = []
    digest = StreamDigest(entry.block_size)
    pos = first = 0  # pending[:first] all end at or before pos
    try:
        while pos < entry.size:
            end = min(pos + READ_SIZE, entry.size)
            data = source.read(fname, pos, end)
            if len(data) != end - pos:
                problems.append(f"file {fname!r}: short read at byte {pos + len(data)} of {entry.size}")
                break
            view = memoryview(data)
            digest.update(view)
            while first < len(pending) and pending[first].loc.offset + pending[first].loc.length <= pos:
                first += 1
            for i in range(first, len(pending)):  # sorted by offset: O(reads + chunks), not O(reads x chunks)
                chk = pending[i]
                lo = chk.loc.offset
                if lo >= end:
                    break
                hi = lo + chk.loc.length
                if hi > pos:
                    chk.feed(view[max(lo, pos) - pos: min(hi, end) - pos])
            if progress:
                progress(len(data))
            pos = end
    except CkptdError as e:
        return [*problems, f"file {fname!r}: {e.message}"], pos
    whole, blocks = digest.finish()
    if digest.size == entry.size and whole != entry.xxh3:
        bad = [i for i, (a, b) in enumerate(zip(blocks, entry.blocks)) if a != b]
        where = f" (bytes [{bad[0] * entry.block_size}, {(bad[0] + 1) * entry.block_size}) differ)" if bad else ""
        problems.append(f"file {fname!r}: XXH3 {whole} != manifest {entry.xxh3}{where}")
    for chk in pending:
        problems.extend(chk.problems())
    return problems, pos
