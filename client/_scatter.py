"""Fetched bytes straight into the destination tensors: no fetch-sized buffer.

The usual load at another world size copies row bands into row bands: every
region of every copy is one contiguous run of the fetched bytes *and* one
contiguous run of the destination's memory. For such a fetch the response is
scattered as it arrives into those runs (the bytes between them are only
hashed), and every block digest is checked on the stream. That saves the
fetch-sized buffer (allocated and page-faulted per fetch, a large share of a
loading rank's time in the profile: BENCHMARKS.md, Figures behind the code) and
one copy of every byte.

Destinations on a device (CUDA) go through a :class:`DeviceStager`: the bytes are
read, window by window, into a small ring of reused pinned host buffers, hashed
there, and copied to the device asynchronously on a side stream, an event per
buffer telling when it may be refilled, so that the disk (or socket) reads and
the host-to-device copies overlap; a profile showed them serialised before
(pageable buffers, a synchronous ``.to("cuda")`` per piece, then a copy).
Row bands go from the ring straight into the destination runs
(:func:`staged_runs`); anything else is fetched and verified whole as on the
host, then each copy's source bytes go through the ring into a device buffer and
are copied (strided, cast) from it on the device (:meth:`DeviceStager.copy_into`).

Anything else on the host (compressed frames, column shards, casts) returns
``None`` from :func:`direct_targets` and takes the buffered path.
A digest mismatch raises :class:`ChecksumMismatch` as the buffered path does;
the destination may then hold part of the bad block, as a failed load leaves
the state dict partly restored either way.
"""

from __future__ import annotations

import contextlib
import threading
from collections import deque
from dataclasses import dataclass
from typing import Callable, Iterable, Iterator, Sequence

import torch

from ckptd_schemas import ChecksumMismatch, Copy, Fetch
from ckptd_schemas.readplan import BlockVerifier, whole

from ckptd_schemas.format.assemble import Destination, torch_dtype
from ckptd_schemas.format.encoding import source_bytes

__all__ = ["BUFFER_BYTES", "DeviceStager", "Fill", "PieceFill", "direct_targets", "fill_buffer", "fill_targets",
           "staged_runs"]

Target = tuple[int, int, memoryview]  # [lo, hi) of the fetch -> the destination's bytes
Run = tuple[int, int, torch.Tensor]   # [lo, hi) of the fetch -> the destination's bytes, a uint8 tensor on its device


def _row_major(sizes: Sequence[int], strides: Sequence[int]) -> bool:
    want = 1
    for n, s in zip(reversed(sizes), reversed(strides)):
        if n != 1 and s != want:
            return False
        want *= n
    return True


def staged_runs(copies: Iterable[Copy], dests: Sequence[Destination], device: torch.device) -> list[Run] | None:
    """Byte runs of the fetch and the memory of the destinations on ``device`` each lands in, sorted and
    disjoint (for :meth:`DeviceStager.stream`); or None when some copy needs the buffered path."""
    out: list[Run] = []
    for c in copies:
        dest = dests[c.request]
        dtype = torch_dtype(c.dtype)
        if c.codec != "raw" or dest.tensor.device != device or dest.tensor.dtype != dtype:
            return None
        isz = dtype.itemsize
        for offsets, sizes in c.regions:
            n = 1
            for z in sizes:
                n *= z
            if n == 0:
                continue
            if not _row_major(sizes, c.strides):
                return None
            view = dest.view(offsets, sizes)
            if not view.is_contiguous():
                return None
            lo = c.byte_start + c.source_offset(offsets) * isz
            out.append((lo, lo + n * isz, view.detach().reshape(-1).view(torch.uint8)))
    out.sort(key=lambda t: t[0])
    if any(a[1] > b[0] for a, b in zip(out, out[1:])):
        return None  # two copies read the same bytes: let the buffered path handle it
    return out


def direct_targets(copies: Iterable[Copy], dests: Sequence[Destination]) -> list[Target] | None:
    """:func:`staged_runs` of host destinations, each as the memory it lands in."""
    runs = staged_runs(copies, dests, torch.device("cpu"))
    return None if runs is None else [(lo, hi, memoryview(t.numpy())) for lo, hi, t in runs]


# -- staging onto a device ---------------------------------------------------------------------------

BUFFER_BYTES = 32 << 20
"""Bytes per ring buffer: large enough that a host-to-device copy is a fraction of the read that
filled it, small enough that a few of them, pinned once per load, cost little."""

Fill = Callable[[memoryview, BlockVerifier], int]
"""``fill(view, check)``: write the fetch's next bytes into ``view``, hashing them with ``check``
as they land; return how many (fewer than ``len(view)`` only where the bytes end)."""


class PieceFill:
    """A :data:`Fill` from an HTTP body's pieces: each piece is hashed as it arrives, then copied
    into the windows; :meth:`drain` checks that nothing follows the fetch's bytes."""

    def __init__(self, pieces: Iterable[bytes], fetch: Fetch) -> None:
        self._it: Iterator[bytes] = iter(pieces)
        self._rest = memoryview(b"")
        self._fetch = fetch
        self._size = fetch.end - fetch.start
        self._got = 0

    def _more(self) -> None:
        raise ChecksumMismatch(f"file {self._fetch.file!r}: server sent more than the {self._size} bytes asked",
                               file=self._fetch.file)

    def _next(self, check: BlockVerifier) -> bool:
        for raw in self._it:
            piece = memoryview(raw).cast("B")
            if not piece:
                continue
            self._got += len(piece)
            if self._got > self._size:
                self._more()
            check.update(piece)
            self._rest = piece
            return True
        return False

    def __call__(self, view: memoryview, check: BlockVerifier) -> int:
        n = 0
        while n < len(view) and (self._rest or self._next(check)):
            k = min(len(self._rest), len(view) - n)
            view[n:n + k] = self._rest[:k]
            self._rest = self._rest[k:]
            n += k
        return n

    def drain(self) -> None:
        """After the fetch's bytes: raise if the body holds more."""
        if self._rest or any(len(raw) for raw in self._it):
            self._more()


def fill_buffer(fetch: Fetch, fill: Fill) -> bytearray:
    """The buffered sink: the fetch's bytes in a fresh buffer, every block verified."""
    buf = bytearray(fetch.end - fetch.start)
    whole(fetch, fill(memoryview(buf), BlockVerifier(fetch)))
    return buf


_scratch = threading.local()
SCRATCH_BYTES = 4 << 20


def fill_targets(fetch: Fetch, fill: Fill, targets: list[Target]) -> None:
    """The scattering sink: the fetch's bytes straight into its targets (sorted, disjoint byte runs of
    the fetch); the bytes between them go through a small per-thread scratch buffer, only to be hashed."""
    check = BlockVerifier(fetch)
    pos = 0
    for lo, hi, dst in [*targets, (check.size, check.size, memoryview(b""))]:
        while pos < lo:
            gap = getattr(_scratch, "buf", None)
            if gap is None:
                gap = _scratch.buf = memoryview(bytearray(SCRATCH_BYTES))
            n = fill(gap[:min(lo - pos, SCRATCH_BYTES)], check)
            if n == 0:
                whole(fetch, pos)
            pos += n
        if hi > lo:
            n = fill(dst, check)
            if n != hi - lo:
                whole(fetch, lo + n)
            pos = hi


@dataclass
class StagerStats:
    buffers: int = 0   # ring buffers allocated (at most ``DeviceStager.buffers`` per load)
    windows: int = 0   # buffer fills: each one reused a buffer or made one of the ring
    waits: int = 0     # fills that found their buffer's previous copy still running (CUDA)


def _host_buffer(nbytes: int, pin: bool) -> torch.Tensor:
    """One ring buffer: page-locked for CUDA (asynchronous copies; tests replace it to run the CUDA
    branch's ordering on the CPU)."""
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin)


class _Slot:
    __slots__ = ("event", "tensor", "view")

    def __init__(self, tensor: torch.Tensor, event: object | None) -> None:
        self.tensor, self.view, self.event = tensor, memoryview(tensor.numpy()), event


class DeviceStager:
    """Host-to-device copies of verified bytes through a ring of at most ``buffers`` reused host
    buffers of ``buffer_bytes``, made on first need and kept until :meth:`finish` (one load).

    On CUDA the buffers are pinned and every copy is ``non_blocking`` on a side stream that first
    waits for the caller's current stream (whatever was queued before the load, e.g. the
    destinations' initialisation); each buffer records an event after its copies, and is refilled
    only once that event has completed, so reads into the next buffers overlap the copies.
    :meth:`finish` makes the caller's current stream wait for the side stream. On any other device
    (the CPU in tests) the same ring and windows run with plain copies and no ``torch.cuda`` call.

    Call order (one load; the fetch threads share it)::

        stager = DeviceStager(device)          # caller's thread, before any copy
        stager.stream(fetch, fill, runs)       # per fetch of row bands: read, hash, copy, window by window
        stager.copy_into(buf, copy, dest)      # per other copy, from its fetch's verified host bytes
        stager.finish()                        # caller's thread, after the last copy (also on failure)
    """

    def __init__(self, device: torch.device | str, *, buffers: int = 3, buffer_bytes: int = BUFFER_BYTES) -> None:
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.buffers, self.buffer_bytes = max(1, buffers), max(1, buffer_bytes)
        self.stats = StagerStats()
        self._free: deque[_Slot] = deque()
        self._made = 0
        self._cond = threading.Condition()
        self._stream = None
        if self.cuda:
            self._stream = torch.cuda.Stream(self.device)
            self._stream.wait_stream(torch.cuda.current_stream(self.device))

    def _acquire(self) -> _Slot:
        """A buffer for the next window: a new one while the ring is not full (so that a read never
        waits for the copy just queued from the buffer before), then the free one released first,
        once its copies have finished."""
        with self._cond:
            self._cond.wait_for(lambda: self._free or self._made < self.buffers)
            self.stats.windows += 1
            slot = self._free.popleft() if self._made >= self.buffers else None
            if slot is None:
                self._made += 1
                self.stats.buffers += 1
        if slot is None:
            try:
                return _Slot(_host_buffer(self.buffer_bytes, self.cuda), torch.cuda.Event() if self.cuda else None)
            except BaseException:
                with self._cond:
                    self._made -= 1
                    self._cond.notify()
                raise
        if slot.event is not None and not slot.event.query():  # type: ignore[attr-defined]
            with self._cond:
                self.stats.waits += 1
            slot.event.synchronize()  # type: ignore[attr-defined]
        return slot

    def _release(self, slot: _Slot) -> None:
        if slot.event is not None:
            slot.event.record(self._stream)  # type: ignore[attr-defined]
        with self._cond:
            self._free.append(slot)
            self._cond.notify()

    def _on_stream(self) -> contextlib.AbstractContextManager:
        return torch.cuda.stream(self._stream) if self.cuda else contextlib.nullcontext()

    def stream(self, fetch: Fetch, fill: Fill, runs: Sequence[Run]) -> int:
        """Read ``fetch`` through the ring, window by window (``fill``), every block hashed before its
        window is copied; copy each window's overlap with ``runs`` (sorted, disjoint) into place.
        Returns the bytes read (the caller checks it against the fetch's size)."""
        check = BlockVerifier(fetch)
        pos, k = 0, 0
        while pos < check.size:
            slot = self._acquire()
            try:
                hi = pos + fill(slot.view[:min(self.buffer_bytes, check.size - pos)], check)
                with self._on_stream(), torch.no_grad():
                    while k < len(runs) and runs[k][1] <= pos:
                        k += 1
                    j = k
                    while j < len(runs) and runs[j][0] < hi:
                        lo_, hi_, dst = runs[j]
                        a, b = max(lo_, pos), min(hi_, hi)
                        dst[a - lo_:b - lo_].copy_(slot.tensor[a - pos:b - pos], non_blocking=self.cuda)
                        j += 1
            finally:
                self._release(slot)
            if hi == pos:
                break
            pos = hi
        return pos

    def copy_into(self, buf: bytearray | memoryview, c: Copy, dest: Destination) -> None:
        """As ``assemble.copy_into`` from the fetch's verified host bytes ``buf``: the copy's source
        bytes (decoded) go through the ring into one device buffer, then every region is copied (and
        cast) from it on the device."""
        raw = memoryview(source_bytes(buf, c)).cast("B")
        with self._on_stream(), torch.no_grad():
            src = torch.empty(len(raw), dtype=torch.uint8, device=self.device)
            for pos in range(0, len(raw), self.buffer_bytes):
                n = min(self.buffer_bytes, len(raw) - pos)
                slot = self._acquire()
                try:
                    slot.view[:n] = raw[pos:pos + n]
                    src[pos:pos + n].copy_(slot.tensor[:n], non_blocking=self.cuda)
                finally:
                    self._release(slot)
            src = src.view(torch_dtype(c.dtype))
            for offsets, sizes in c.regions:
                dest.view(offsets, sizes).copy_(src.as_strided(sizes, c.strides, c.source_offset(offsets)))

    def finish(self) -> None:
        """The caller's current stream waits for every copy queued (CUDA); the ring is dropped
        (torch's pinned allocator keeps a buffer until the copies recorded on it are done)."""
        if self.cuda:
            torch.cuda.current_stream(self.device).wait_stream(self._stream)
        with self._cond:
            self._free.clear()
