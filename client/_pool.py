"""A reusable host buffer for save snapshots, so that the training stall is one memcpy.

Why: a snapshot copied into fresh ``torch.empty`` tensors pays a page fault on the first touch of
every 4 KiB page (and, on GPU, copies from pageable memory are staged and synchronous). A slab
allocated once, pinned when CUDA is available, and pre-faulted at creation turns the stall into a
copy at memory (or PCIe) bandwidth.

Sizing: a fixed ``capacity``, or (the default client's) sized from the save: each ``claim`` is told
the bytes of the chunks the save will copy, and, while nobody holds the slab, a slab that places
fewer of them than a new one would, or that is over twice a new one's size (the state shrank), is
replaced (at most ``max_bytes``). A steady training loop saves the same shards each time, so the
slab is laid out once, at the first save, and the memory held between saves is what one save copies.

Segments: the slab is a list of segments (views are 64-byte aligned, each within one segment).
Without ``background`` (the default without CUDA) it is one segment, allocated inside ``claim``.
With ``background`` (the default with CUDA) pinning it inside the first save's stall is what made
that stall long (many times the later stalls: BENCHMARKS.md, Figures behind the code), so ``claim`` only lays the
segments out (at most ``segment_bytes`` each, or one chunk's size, packed first-fit in the chunks'
order; pinned sizes are powers of two, which is what torch's pinned allocator rounds every pinned
allocation up to anyway) and a background thread allocates them one by one while no save holds the
slab: after the first save's upload, whose copies went to fresh memory, freed by then. A later save
copies into the segments ready by then, the rest into fresh memory. So no stall waits for pinning
or competes with it, the first save's fresh copies and the slab are never held together, and one
segment at a time keeps each pinning call short and the slab within ``max_bytes`` (plus the one
segment in flight when a layout is replaced).

Call order (one save)::

    claim = pool.claim(sizes=[...]) # caller's thread, in build_snapshot, once the chunks are known
    t = claim.take(shape, dtype)    # per chunk: a 64-byte aligned view of a segment, or a fresh tensor
    ...copy into t, return to training...
    claim.release()                 # upload thread, after the upload finished (success or failure);
                                    # background: the missing segments are allocated from now on

One save holds the slab at a time, because the upload reads the views until it ends. Two choices,
both counted in :attr:`SnapshotPool.stats` so that tests and benchmarks can tell which path ran:

* **busy**: the previous save is still uploading. ``claim`` waits up to ``wait_s`` (default 0:
  a store slower than the save interval must not stall training); if the slab is still taken the
  whole snapshot goes to fresh allocations (more memory for a while, no wait).
* **too small**: chunks are placed first-fit in order; a chunk that does not fit in what is left
  (a fixed capacity below the need, the ``max_bytes`` cap, or segments not allocated yet:
  ``unready_bytes``) gets a fresh tensor (``fallback_bytes``), freed when that save's upload ends.

Either way nothing but the slab outlives a save's upload; :meth:`SnapshotPool.close` drops the slab.
"""

from __future__ import annotations

import logging
import os
import threading
import warnings
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

__all__ = ["ALIGN", "SEGMENT_BYTES", "Allocator", "PoolStats", "SlabClaim", "SnapshotPool", "aligned", "allocate",
           "default_max_bytes", "placed_bytes", "plan_segments"]

ALIGN = 64
SEGMENT_BYTES = 256 << 20
"""Largest background segment, unless one chunk needs more: one pinning call of this size takes a
fraction of a second, and at most this much is in flight beside the slab when a layout is replaced."""

log = logging.getLogger("ckptd_client")

Allocator = Callable[[int, bool], torch.Tensor]
"""``(nbytes, pin) -> uint8 CPU tensor`` of at least ``nbytes``, every page resident."""


def aligned(nbytes: int) -> int:
    """``nbytes`` rounded up to the slab's alignment: what one chunk takes of it."""
    return nbytes + (-nbytes) % ALIGN


def default_max_bytes() -> int:
    """The most a sized-from-the-save slab may hold: ``$CKPTD_SNAPSHOT_MAX_BYTES``, else half of
    this machine's memory (or of the container's limit, if lower) shared among the ranks that
    ``torchrun`` started on it (``$LOCAL_WORLD_SIZE``)."""
    env = os.environ.get("CKPTD_SNAPSHOT_MAX_BYTES")
    if env:
        return int(env)
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        total = 1 << 40
    try:
        with open("/sys/fs/cgroup/memory.max") as f:
            limit = f.read().strip()
        if limit.isdigit():
            total = min(total, int(limit))
    except OSError:
        pass
    local = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1))
    return total // (2 * local)


@dataclass
class PoolStats:
    """Cumulative counts since the pool was made."""

    claims: int = 0          # saves that got the slab
    allocations: int = 0     # slabs laid out (sized from the save: at the first save, and when the state changed)
    segments: int = 0        # segments allocated (one per slab without ``background``)
    busy: int = 0            # saves that found it claimed (after waiting) and used fresh memory only
    pooled_bytes: int = 0    # bytes copied into the slab
    fallback_bytes: int = 0  # bytes copied into fresh tensors (busy, did not fit, or not allocated yet)
    unready_bytes: int = 0   # of fallback_bytes: while some segment was still to be allocated

    @property
    def leases(self) -> int:
        """The former name of :attr:`claims` (a lease in ckptd is a read lease on a checkpoint)."""
        warnings.warn("PoolStats.leases is PoolStats.claims", DeprecationWarning, stacklevel=2)
        return self.claims


def allocate(nbytes: int, pin: bool) -> torch.Tensor:
    """The default :data:`Allocator`: pinned memory is resident once allocated; pageable memory is
    pre-faulted by zeroing it (every page now, once, not page by page during the copies)."""
    t = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin)
    if not pin:
        t.zero_()
    return t


def _pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def _first_fit(room: list[int], n: int) -> int | None:
    return next((i for i, r in enumerate(room) if r >= n), None)


def placed_bytes(segments: Sequence[int], sizes: Sequence[int]) -> int:
    """Bytes of chunks ``sizes`` (aligned, in copy order) that first-fit places in ``segments``."""
    room, got = list(segments), 0
    for n in sizes:
        i = _first_fit(room, n) if n > 0 else None
        if i is not None:
            room[i] -= n
            got += n
    return got


def plan_segments(sizes: Sequence[int], cap: int, segment: int, pin: bool) -> list[int]:
    """Segment sizes for chunks ``sizes`` (aligned, in copy order), at most ``cap`` in all: first-fit
    into the segments so far, else a new one of ``segment`` bytes (or the chunk's, if larger; only the
    chunk's where the cap leaves no more), each cut at the end to what it holds. Pinned sizes are
    rounded up to powers of two (torch's pinned allocator rounds so; counting it keeps the cap true).
    ``SlabClaim.take`` places the same chunks exactly so: first-fit makes the same choices in segments cut
    to their contents."""
    size_of = _pow2 if pin else (lambda n: n)
    segs: list[int] = []
    used: list[int] = []
    for n in sizes:
        if n <= 0:
            continue
        i = _first_fit([s - u for s, u in zip(segs, used)], n)
        if i is not None:
            used[i] += n
            continue
        for want in (size_of(max(segment, n)), size_of(n)):
            if sum(segs) + want <= cap:
                segs.append(want)
                used.append(n)
                break
    return [size_of(u) for u in used]


class _Segment:
    """One piece of the slab: its planned size, and its aligned bytes once allocated."""

    __slots__ = ("size", "view")

    def __init__(self, size: int) -> None:
        self.size = size
        self.view: torch.Tensor | None = None  # set once, by whoever allocates it


class SlabClaim:
    """One save's use of the slab: a first-fit bump allocator over its segments (``None``: busy). A
    claim, not a lease: in ckptd a lease is a read lease on a checkpoint (``ckptd_client._lease``)."""

    def __init__(self, pool: SnapshotPool, segments: list[_Segment] | None) -> None:
        self._pool, self._segs = pool, segments
        self._used = [0] * len(segments or ())
        self._released = False

    def take(self, shape: tuple[int, ...] | torch.Size, dtype: torch.dtype) -> torch.Tensor:
        """A contiguous CPU tensor for one chunk: a 64-byte aligned view of the first allocated
        segment it fits in, else fresh."""
        n = torch.Size(shape).numel() * dtype.itemsize
        stats, unready = self._pool.stats, False
        for i, seg in enumerate(self._segs or ()):
            view = seg.view
            if view is None:
                unready = True
                continue
            off = self._used[i]
            if off + n <= view.numel():
                self._used[i] = off + aligned(n)
                stats.pooled_bytes += n
                return view[off:off + n].view(dtype).view(shape)
        stats.fallback_bytes += n
        stats.unready_bytes += n if unready else 0
        return torch.empty(shape, dtype=dtype, device="cpu")

    def release(self) -> None:
        """Give the slab back (idempotent). The views taken must not be read after this."""
        if not self._released:
            self._released = True
            if self._segs is not None:
                self._segs = None
                self._pool._give_back()


class SnapshotPool:
    """A preallocated, pre-faulted host slab, claimed by one save at a time.

    Args:
        capacity: bytes, fixed; ``None``: sized from each save's need (see the module docstring).
        max_bytes: the most a sized-from-the-save slab holds (default :func:`default_max_bytes`).
        pin: page-locked memory (fast, asynchronous device->host copies); default: when CUDA is available.
        wait_s: how long ``claim`` waits for a previous save's upload to give the slab back.
        background: segments allocated by a background thread while no save holds the slab, never
            inside a save; default: ``pin`` (pinning is what is slow). A fixed ``capacity`` is then one
            segment, whose allocation starts here.
        segment_bytes: the largest background segment, unless a chunk needs more.
        allocator: makes each segment (:func:`allocate`; tests inject slow or counting ones).
    """

    def __init__(self, capacity: int | None = None, *, max_bytes: int | None = None, pin: bool | None = None,
                 wait_s: float = 0.0, background: bool | None = None, segment_bytes: int = SEGMENT_BYTES,
                 allocator: Allocator = allocate) -> None:
        if capacity is not None and capacity <= 0:
            raise ValueError(f"snapshot pool capacity must be positive, not {capacity}")
        self.sized = capacity is None
        self.max_bytes = default_max_bytes() if max_bytes is None else max_bytes
        self.capacity, self.wait_s = 0, wait_s
        self.pin = torch.cuda.is_available() if pin is None else pin
        self.background = self.pin if background is None else background
        self.segment_bytes = segment_bytes
        self._alloc = allocator
        self._segs: list[_Segment] | None = None
        self._gen = 0                                  # bumped when the layout is replaced or dropped
        self._halted = False                           # background: an allocation failed; again after a save
        self._worker: threading.Thread | None = None   # background: allocating, one segment at a time
        self._closed = False
        self._claimed = False
        self._cond = threading.Condition()
        self.stats = PoolStats()
        if capacity is not None:
            with self._cond:
                self._replace([capacity])
                self._kick()

    # -- layout and allocation (under self._cond) --------------------------------------------------
    def _plan(self, sizes: Sequence[int]) -> list[int]:
        if not self.background:  # one segment of what the save copies (capped)
            want = min(sum(sizes), self.max_bytes)
            return [want] if want > 0 else []
        return plan_segments(sizes, self.max_bytes, self.segment_bytes, self.pin)

    def _replace(self, layout: list[int]) -> None:
        """Drop the slab, lay out a new one; without ``background``, allocate it now."""
        self._segs, self.capacity = None, 0  # the old slab's memory goes before the new one is taken
        self._gen += 1
        segs = [_Segment(n) for n in layout]
        if not self.background:
            for seg in segs:
                self._install(seg, self._alloc(seg.size, self.pin))
        self._segs, self.capacity = segs, sum(layout)
        self.stats.allocations += 1

    def _install(self, seg: _Segment, t: torch.Tensor) -> None:
        off = (-t.data_ptr()) % ALIGN
        seg.view = t[off:off + seg.size]
        self.stats.segments += 1

    def _fit(self, sizes: Sequence[int]) -> None:
        """Sized from the save: lay out anew when the slab places less of ``sizes`` than a new one
        would, or is over twice a new one's size."""
        fresh = self._plan(sizes)
        if not fresh:
            return
        if self._segs is not None:
            now = [s.size for s in self._segs]
            if placed_bytes(now, sizes) >= placed_bytes(fresh, sizes) and sum(now) <= 2 * sum(fresh):
                return
        self._replace(fresh)

    def _next(self) -> tuple[int, _Segment] | None:
        if self._closed or self._claimed or self._halted or self._segs is None:
            return None
        seg = next((s for s in self._segs if s.view is None), None)
        return None if seg is None else (self._gen, seg)

    def _kick(self) -> None:
        if self._worker is None and self._next() is not None:
            self._worker = threading.Thread(target=self._allocate_all, name="ckptd-snapshot-pool", daemon=True)
            self._worker.start()

    def _allocate_all(self) -> None:
        """Background thread: allocate the current layout's missing segments one by one; a segment
        of a layout replaced meanwhile is dropped before the next is allocated."""
        while True:
            with self._cond:
                job = self._next()
                if job is None:
                    self._worker = None
                    self._cond.notify_all()
                    return
            gen, seg = job
            try:
                t = self._alloc(seg.size, self.pin)  # outside the lock: claims go on meanwhile
            except Exception as e:  # noqa: BLE001 - e.g. out of pinned memory: fresh memory meanwhile, tried after the next save
                log.warning("snapshot pool: allocating a %d-byte segment failed (%s); saves copy into fresh "
                            "memory meanwhile", seg.size, e)
                with self._cond:
                    self._halted, self._worker = True, None
                    self._cond.notify_all()
                return
            with self._cond:
                if gen == self._gen and not self._closed:
                    self._install(seg, t)
                    self._cond.notify_all()
            del t

    # -- public ----------------------------------------------------------------------------------------
    @property
    def segments(self) -> list[torch.Tensor | None]:
        """The slab's segments: a tensor each once allocated, ``None`` while still to be."""
        return [s.view for s in self._segs or ()]

    @property
    def ready(self) -> bool:
        """Every segment of the current slab is allocated."""
        return all(v is not None for v in self.segments)

    def wait_ready(self, timeout: float | None = None) -> bool:
        """Wait until the background thread has nothing left to allocate; True when the slab is ready
        (benchmarks and tests; a save never waits for it)."""
        with self._cond:
            self._cond.wait_for(lambda: self._worker is None, timeout)
        return self.ready

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def claimed(self) -> bool:
        return self._claimed

    @property
    def leased(self) -> bool:
        """The former name of :attr:`claimed`."""
        warnings.warn("SnapshotPool.leased is SnapshotPool.claimed", DeprecationWarning, stacklevel=2)
        return self._claimed

    def claim(self, wait_s: float | None = None, *, sizes: Sequence[int] | None = None) -> SlabClaim:
        """The slab for one save that copies chunks of ``sizes`` bytes (each :func:`aligned`, in copy
        order), or (busy after ``wait_s``, or closed) a claim that allocates fresh. Never waits for an
        allocation made in the background."""
        with self._cond:
            self._cond.wait_for(lambda: not self._claimed, self.wait_s if wait_s is None else wait_s)
            if self._claimed or self._closed:
                self.stats.busy += not self._closed
                return SlabClaim(self, None)
            if self.sized and sizes is not None:
                self._fit(sizes)
            if self._segs is None:
                return SlabClaim(self, None)
            self._claimed = True  # background: no new segment until it is given back
            self.stats.claims += 1
            return SlabClaim(self, self._segs)

    def _give_back(self) -> None:
        with self._cond:
            self._claimed = self._halted = False
            self._kick()
            self._cond.notify_all()

    def close(self, timeout: float | None = 60.0) -> None:
        """Drop the slab and stop allocating (waiting up to ``timeout`` for a segment in flight). A
        save still uploading keeps its views alive until its claim is released."""
        with self._cond:
            self._segs, self._closed, self.capacity = None, True, 0
            self._gen += 1
            self._cond.notify_all()
            worker = self._worker
        if worker is not None and worker is not threading.current_thread():
            worker.join(timeout)
