"""Read plans: which byte ranges of which files fill which requested regions.

Pure (no I/O). The service answers ``POST .../read-plan`` with
:func:`plan_reads`; offline readers call it directly. A plan has two lists:

* ``fetches``: coalesced, block-aligned byte ranges of data files, each with
  the block digests that verify it, so a partial read is still checksummed;
* ``copies``: for each (request, chunk) overlap, where in which fetch the
  chunk's elements start and which global boxes to copy.

A copy addresses the chunk's elements by an affine map: element at global
index ``g`` is at chunk position ``dot(g, strides) - base`` (box chunks use
the chunk's own row-major strides, flat chunks the tensor's). The reader maps
``[pos0, pos0 + npos)`` of the chunk onto the fetched bytes and copies each
box of ``regions`` with one strided view on each side.

A region finds the chunks it meets through its tensor's interval index
(:mod:`ckptd_schemas.chunkindex`, built once per parsed manifest): O(log n) and
the candidates, so a rank's plan costs what it reads, not the world size. A
plan's cost is still not bounded by its request's size (a dozen bytes asking
for a whole tensor of 100,000 chunks meet all of them): a :class:`PlanBudget`
bounds the candidates visited (counted before any work, two bisections per
region) and the entries of the answer (copies and fetches, counted as they
are made); over either, :func:`plan_reads` raises ``PayloadTooLarge``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from math import prod
from typing import Callable, Sequence

import json

import xxhash
from pydantic import Field, model_validator

from .api import MAX_READ_REQUESTS, READ_REQUEST_BYTES, _Body
from .dtypes import itemsize
from .errors import ChecksumMismatch, PayloadTooLarge, StateDictMismatch
from .geometry import Box, Region, box_flat_span, intersect_regions, row_major_strides
from .manifest import FileEntry, Manifest, TensorEntry

__all__ = ["BlockVerifier", "Copy", "Fetch", "PlanBudget", "ReadFn", "ReadPlan", "ReadRequest", "dest_region", "plan_reads",
           "request_batches", "run_fetches", "verify_fetch", "wanted_region", "whole"]


ReadFn = Callable[[str, int, int], bytes]
"""The one byte source every reader of stored bytes takes: ``read(file, start, end)``, bytes ``[start, end)``
of a data file (the store's, the service's over HTTP, a drill's sink); short only at the file's end."""


class ReadRequest(_Body):
    """A region of one tensor that a reader needs: a box, a flat range, or (neither) all of it."""

    name: str
    offsets: list[int] | None = None
    sizes: list[int] | None = None
    flat_start: int | None = None
    flat_length: int | None = None

    @model_validator(mode="after")
    def _one_kind(self) -> "ReadRequest":
        box = self.offsets is not None or self.sizes is not None
        flat = self.flat_start is not None or self.flat_length is not None
        if box and flat:
            raise ValueError(f"read request for {self.name!r}: give a box or a flat range, not both")
        if box and (self.offsets is None or self.sizes is None or len(self.offsets) != len(self.sizes)):
            raise ValueError(f"read request for {self.name!r}: offsets and sizes must both be given, same length")
        if flat and (self.flat_start is None or self.flat_length is None):
            raise ValueError(f"read request for {self.name!r}: flat_start and flat_length must both be given")
        return self

    def region(self, shape: Sequence[int]) -> Region:
        if self.offsets is not None and self.sizes is not None:
            return Region(box=Box(tuple(self.offsets), tuple(self.sizes)))
        if self.flat_start is not None and self.flat_length is not None:
            return Region(flat=(self.flat_start, self.flat_length))
        return Region(box=Box.full(shape))


class Fetch(_Body):
    file: str
    start: int
    end: int
    block_size: int
    first_block: int
    blocks: list[str] = Field(description="XXH3-64 of each block in [start, end)")


class BlockVerifier:
    """The one block-verify rule: a fetch's bytes, fed in any pieces (blocks start at ``fetch.start``),
    each block's XXH3-64 compared with the manifest's as soon as its last byte has passed."""

    def __init__(self, fetch: Fetch) -> None:
        self.fetch = fetch
        self.size = fetch.end - fetch.start
        self.got = 0
        self._block = 0
        self._h = xxhash.xxh3_64()

    def update(self, piece: memoryview) -> None:
        bs, pos = self.fetch.block_size, 0
        while pos < len(piece):
            take = min(bs - (self.got % bs), len(piece) - pos)
            self._h.update(piece[pos:pos + take])
            pos += take
            self.got += take
            if self.got % bs == 0 or self.got == self.size:
                self._check()

    def _check(self) -> None:
        i, f = self._block, self.fetch
        got = self._h.hexdigest()
        if i >= len(f.blocks) or got != f.blocks[i]:
            start = f.start + i * f.block_size
            raise ChecksumMismatch(
                f"file {f.file!r}: bytes [{start}, {min(start + f.block_size, f.end)}) hash to {got}, "
                f"manifest says {f.blocks[i] if i < len(f.blocks) else 'nothing'}: the checkpoint is corrupt",
                file=f.file, offset=start)
        self._block += 1
        self._h.reset()


def whole(fetch: Fetch, got: int) -> None:
    """Raise unless ``got`` is every byte of ``fetch`` (what a reader received, or holds)."""
    if got != fetch.end - fetch.start:
        raise ChecksumMismatch(f"file {fetch.file!r}: got {got} of {fetch.end - fetch.start} bytes at offset "
                               f"{fetch.start}", file=fetch.file)


def verify_fetch(buf: bytes | bytearray | memoryview, fetch: Fetch) -> None:
    """Raise ChecksumMismatch unless ``buf`` is the fetch's bytes, every block matching its digest.

    Call it on a fetch's bytes before any copy reads them: the copies trust what they are given."""
    mv = memoryview(buf)
    whole(fetch, len(mv))
    BlockVerifier(fetch).update(mv)


def run_fetches(plan: "ReadPlan", read: Callable[[Fetch], bytes | bytearray | memoryview],
                copy: Callable[[memoryview, "Copy"], None],
                fetched: Callable[[Fetch, memoryview], None] | None = None) -> None:
    """Execute ``plan`` where its bytes are whole in memory (the service's reshard, drill, export and
    offline reads): each fetch read (``read``, a range of a data file), block-verified
    (:func:`verify_fetch`: a damaged one raises before any copy reads it), shown to ``fetched`` (the
    source digest's parts), then each of its copies handed to ``copy`` with the fetched bytes. Copies
    are grouped once by fetch, so the work is linear in fetches plus copies. (A loading rank streams
    its fetches into their destinations instead: ``ckptd_client``'s read executor.)"""
    by_fetch: dict[int, list[Copy]] = {}
    for c in plan.copies:
        by_fetch.setdefault(c.fetch, []).append(c)
    for i, f in enumerate(plan.fetches):
        data = memoryview(read(f))
        verify_fetch(data, f)
        if fetched is not None:
            fetched(f, data)
        for c in by_fetch.get(i, ()):
            copy(data, c)


class Copy(_Body):
    request: int
    tensor: str
    dtype: str
    fetch: int
    codec: str
    byte_start: int = Field(description="offset in the fetch where chunk position pos0 (raw) or the frame (zstd) starts")
    byte_length: int = Field(description="bytes from byte_start: npos*itemsize (raw) or the frame length (zstd)")
    pos0: int
    npos: int
    strides: list[int]
    base: int
    chunk_xxh3: str
    regions: list[list[list[int]]] = Field(description="boxes as [offsets, sizes] in global coordinates")

    def source_offset(self, offsets: Sequence[int]) -> int:
        """Where the region starting at global ``offsets`` begins in the decoded source, in elements from
        ``pos0`` (the source's element strides are ``strides``)."""
        return sum(o * s for o, s in zip(offsets, self.strides)) - self.base - self.pos0


def dest_region(offsets: Sequence[int], strides: Sequence[int], *, global_shape: Sequence[int],
                box_offsets: Sequence[int] | None = None, flat_start: int | None = None) -> tuple[list[int], int]:
    """(element strides, element offset) of the region at global ``offsets`` inside a destination buffer.

    The destination holds either a box of the global tensor starting at ``box_offsets`` (its own
    ``strides``, one per dimension) or, with ``flat_start``, the row-major flat range starting there
    (``strides``: the buffer's one stride). Each backend (torch on any device, numpy on the host) makes its
    view from these two numbers, so the arithmetic lives once.
    """
    if flat_start is not None:
        g = row_major_strides(global_shape)
        s = strides[0]
        return [x * s for x in g], (sum(o * x for o, x in zip(offsets, g)) - flat_start) * s
    base = box_offsets or [0] * len(offsets)
    return list(strides), sum((o - b) * s for o, b, s in zip(offsets, base, strides))


class ReadPlan(_Body):
    fetches: list[Fetch]
    copies: list[Copy]
    local_paths: dict[str, str] | None = Field(
        None, description="each fetched file's absolute path on the service's filesystem, when the request "
        "asked for them and the service's root is a local directory: a reader that can open them (same host, "
        "shared filesystem) may read the bytes itself, verifying the same block digests")

    @property
    def bytes_to_read(self) -> int:
        return sum(f.end - f.start for f in self.fetches)


def request_batches(requests: Sequence[ReadRequest], most: int | None = None,
                    body_bytes: int | None = None) -> list[tuple[int, int]]:
    """``[start, end)`` of consecutive ``requests``, each at most ``most`` of them whose JSON takes at most
    ``body_bytes`` (by default the service's limits: ``api.MAX_READ_REQUESTS`` regions, ``api.READ_REQUEST_BYTES``
    each on average): what a client sends as one read-plan or load-tree request. One batch for a rank's
    usual few thousand; none for none."""
    most = most or MAX_READ_REQUESTS
    body_bytes = (body_bytes or most * READ_REQUEST_BYTES) - 1024  # room for the body's other keys
    out: list[tuple[int, int]] = []
    start, size = 0, 0
    for i, r in enumerate(requests):
        n = len(json.dumps(r.model_dump(exclude_none=True))) + 2  # at least what the client's encoder sends
        if i > start and (i - start >= most or size + n > body_bytes):
            out.append((start, i))
            start, size = i, 0
        size += n
    if start < len(requests):
        out.append((start, len(requests)))
    return out


@dataclass(frozen=True)
class PlanBudget:
    """The most work one :func:`plan_reads` call may do.

    ``max_chunks``: chunks visited, the sum over the requests of the candidates each region's
    interval index returns (checked before planning); ``max_answer``: copies plus fetches in the plan (checked while
    planning, before the answer's objects are built). ``setting`` names what raises them, for the
    refusal's message.
    """

    max_chunks: int
    max_answer: int
    setting: str = ""

    def check_visits(self, wanted: Sequence[tuple[TensorEntry, Region]]) -> None:
        """Refuse, before any work, regions whose candidates (two bisections each) exceed ``max_chunks``."""
        visits = sum(t.index.count(want) for t, want in wanted)
        if visits > self.max_chunks:
            raise self.refuse("chunks visited (the chunks each requested region may meet)", visits, self.max_chunks)

    def refuse(self, what: str, needed: int, limit: int, *, at_least: bool = False) -> PayloadTooLarge:
        hint = f"; split the request or raise {self.setting}" if self.setting else "; split the request"
        count = f"more than {limit}" if at_least else str(needed)
        return PayloadTooLarge(f"read plan: {count} {what}, over the limit of {limit} for a request of this "
                               f"size{hint}", limit=limit, needed=needed, what=what)


def _overlaps(c_offsets: Sequence[int], c_sizes: Sequence[int], want: Box) -> bool:
    """Whether a box chunk meets the wanted box (the cheap test before :func:`intersect_regions`)."""
    return all(max(a, b) < min(a + sa, b + sb)
               for a, sa, b, sb in zip(c_offsets, c_sizes, want.offsets, want.sizes))


@dataclass
class _Span:
    file: str
    start: int
    end: int
    copies: list[dict] = field(default_factory=list)


def wanted_region(manifest: Manifest, req: ReadRequest) -> tuple[TensorEntry, Region]:
    """The tensor a request names and the region it asks for, checked against the tensor's shape."""
    t = manifest.tensor(req.name)
    if t is None:
        raise StateDictMismatch(f"tensor {req.name!r} is not in checkpoint {manifest.ref}", tensor=req.name)
    want = req.region(t.shape)
    if not want.inside(t.shape):
        asked = (f"offsets {req.offsets} sizes {req.sizes} do not fit global shape {t.shape}" if want.box is not None
                 else f"flat range [{req.flat_start}, {sum(want.flat)}) exceeds {prod(t.shape)} elements")
        raise StateDictMismatch(f"tensor {t.name!r}: requested {asked}", tensor=t.name)
    return t, want


def plan_reads(manifest: Manifest, requests: Sequence[ReadRequest], *, coalesce_gap: int = 1 << 20,
               budget: PlanBudget | None = None) -> ReadPlan:
    """Plan the reads that fill ``requests`` from ``manifest`` (pure).

    The chunks a region meets are found through the tensor's interval index
    (:attr:`TensorEntry.index`: O(log n) and the candidates, no object per chunk); replicated
    chunks (identical regions on several ranks) are read once. Byte ranges of one file closer than
    ``coalesce_gap`` are merged, then widened to the file's verification blocks. With a
    ``budget``, a request over it raises ``PayloadTooLarge`` (:class:`PlanBudget`): the candidates
    it would visit are counted before any work, the answer's entries as they are made.
    """
    wanted = [wanted_region(manifest, req) for req in requests]
    if budget is not None:
        budget.check_visits(wanted)
    max_answer = budget.max_answer if budget is not None else None
    spans: list[_Span] = []
    for ri, (t, want) in enumerate(wanted):
        rows = t.index.candidates(want)
        size = itemsize(t.dtype)
        gstrides = row_major_strides(t.shape)
        tab = t.table
        assert tab is not None
        for i in rows:
            offs, sizes = tab.offsets[i], tab.sizes[i]
            flat = tab.is_flat(i)
            if not flat and want.box is not None and not _overlaps(offs, sizes, want.box):
                continue
            boxes = intersect_regions(t.shape, tab.region(i), want)
            if not boxes:
                continue
            if flat:
                strides, base, numel = gstrides, offs[0], sizes[0]
            else:
                strides = row_major_strides(sizes)
                base, numel = sum(o * s for o, s in zip(offs, strides)), prod(sizes)
            spans_pos = [box_flat_span(b, strides, base) for b in boxes]
            pos0 = min(s for s, _ in spans_pos)
            pos1 = max(e for _, e in spans_pos)
            codec, at, length = tab.codec_of(i), tab.offset[i], tab.length[i]
            if codec == "raw":
                start, end = at + pos0 * size, at + pos1 * size
            else:
                start, end = at, at + length
                pos0, pos1 = 0, numel
            spans.append(_Span(tab.file[i], start, end, [dict(
                request=ri, tensor=t.name, dtype=t.dtype, codec=codec, byte_start=start,
                byte_length=(pos1 - pos0) * size if codec == "raw" else length,
                pos0=pos0, npos=pos1 - pos0, strides=list(strides), base=base, chunk_xxh3=tab.xxh3[i],
                regions=[[list(b.offsets), list(b.sizes)] for b in boxes],
            )]))
            if max_answer is not None and len(spans) > max_answer:
                assert budget is not None
                raise budget.refuse("copies in the answer", len(spans), max_answer, at_least=True)
    return _coalesce(manifest.files, spans, coalesce_gap, budget)


def _coalesce(files: dict[str, FileEntry], spans: list[_Span], gap: int, budget: PlanBudget | None = None) -> ReadPlan:
    merged: list[_Span] = []
    for s in sorted(spans, key=lambda s: (s.file, s.start)):
        fe = files[s.file]
        bs = fe.block_size
        s.start = (s.start // bs) * bs
        s.end = min(-(-s.end // bs) * bs, fe.size)
        last = merged[-1] if merged else None
        if last is not None and last.file == s.file and s.start <= last.end + gap:
            last.end = max(last.end, s.end)
            last.copies.extend(s.copies)
        else:
            merged.append(_Span(s.file, s.start, s.end, list(s.copies)))
    if budget is not None and len(merged) + len(spans) > budget.max_answer:
        raise budget.refuse("copies and fetches in the answer", len(merged) + len(spans), budget.max_answer)
    fetches: list[Fetch] = []
    copies: list[Copy] = []
    for i, s in enumerate(merged):
        fe = files[s.file]
        bs = fe.block_size
        first = s.start // bs
        last_block = -(-s.end // bs)
        fetches.append(Fetch(file=s.file, start=s.start, end=s.end, block_size=bs, first_block=first,
                             blocks=fe.blocks[first:last_block]))
        for c in s.copies:
            c = dict(c, fetch=i, byte_start=c["byte_start"] - s.start)
            copies.append(Copy(**c))
    copies.sort(key=lambda c: (c.request, c.fetch))
    return ReadPlan(fetches=fetches, copies=copies)
