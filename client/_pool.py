"""A reusable host buffer for save snapshots, so that the training stall is one memcpy.

Why: a snapshot copied into fresh ``torch.empty`` tensors pays a page fault on the first touch of
every 4 KiB page (and, on GPU, copies from pageable memory are staged and synchronous). A slab
allocated once, pinned when CUDA is available, and pre-faulted at creation turns the stall into a
copy at memory (or PCIe) bandwidth.

Sizing: a fixed ``capacity``, or (the default client's) sized from the save: each ``lease(need)``
is told the bytes the save will copy, and, while nobody holds the slab, a slab smaller than that
need, or more than twice it (the state shrank), is replaced by one of exactly the need (at most
``max_bytes``). A steady training loop saves the same shards each time, so the slab is allocated
once, at the first save, and the memory held between saves is what one save copies.

Call order (one save)::

    lease = pool.lease(need)        # caller's thread, in build_snapshot, once the bytes are known
    t = lease.take(shape, dtype)    # per chunk: a 64-byte aligned view of the slab, or a fresh tensor
    ...copy into t, return to training...
    lease.release()                 # upload thread, after the upload finished (success or failure)

One save holds the slab at a time, because the upload reads the views until it ends. Two choices,
both counted in :attr:`SnapshotPool.stats` so that tests and benchmarks can tell which path ran:

* **busy**: the previous save is still uploading. ``lease`` waits up to ``wait_s`` (default 0:
  a store slower than the save interval must not stall training); if the slab is still taken the
  whole snapshot goes to fresh allocations (more memory for a while, no wait).
* **too small**: chunks are placed first-fit in order; a chunk that does not fit in what is left
  (a fixed capacity below the need, or the ``max_bytes`` cap) gets a fresh tensor
  (``fallback_bytes``), freed when that save's upload ends.

Either way nothing but the slab outlives a save's upload; :meth:`SnapshotPool.close` drops the slab.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass

import torch

__all__ = ["ALIGN", "Lease", "PoolStats", "SnapshotPool", "aligned", "default_max_bytes"]

ALIGN = 64


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

    leases: int = 0          # saves that got the slab
    allocations: int = 0     # slabs allocated (sized from the save: at the first save, and when the state changed)
    busy: int = 0            # saves that found it leased (after waiting) and used fresh memory only
    pooled_bytes: int = 0    # bytes copied into the slab
    fallback_bytes: int = 0  # bytes copied into fresh tensors (busy, or did not fit)


class Lease:
    """One save's use of the slab: a bump allocator over it. ``slab`` is ``None`` when busy."""

    def __init__(self, pool: "SnapshotPool", slab: torch.Tensor | None) -> None:
        self._pool, self._slab = pool, slab
        self._off = 0 if slab is None else (-slab.data_ptr()) % ALIGN  # first 64-byte boundary
        self._end = self._off + pool.capacity
        self._released = False

    @property
    def pinned(self) -> bool:
        return self._slab is not None and self._slab.is_pinned()

    def take(self, shape: tuple[int, ...] | torch.Size, dtype: torch.dtype) -> torch.Tensor:
        """A contiguous CPU tensor for one chunk: a 64-byte aligned slab view if it fits, else fresh."""
        n = torch.Size(shape).numel() * dtype.itemsize
        if self._slab is not None and self._off + n <= self._end:
            view = self._slab[self._off:self._off + n].view(dtype).view(shape)
            self._off += aligned(n)
            self._pool.stats.pooled_bytes += n
            return view
        self._pool.stats.fallback_bytes += n
        return torch.empty(shape, dtype=dtype, device="cpu")

    def release(self) -> None:
        """Give the slab back (idempotent). The views taken must not be read after this."""
        if not self._released:
            self._released = True
            if self._slab is not None:
                self._pool._give_back()
            self._slab = None


class SnapshotPool:
    """A preallocated, pre-faulted host slab, leased to one save at a time.

    Args:
        capacity: bytes, fixed; ``None``: sized from each save's need (see the module docstring).
        max_bytes: the most a sized-from-the-save slab holds (default :func:`default_max_bytes`).
        pin: page-locked memory (fast, asynchronous device->host copies); default: when CUDA is available.
        wait_s: how long ``lease`` waits for a previous save's upload to give the slab back.
    """

    def __init__(self, capacity: int | None = None, *, max_bytes: int | None = None, pin: bool | None = None,
                 wait_s: float = 0.0) -> None:
        if capacity is not None and capacity <= 0:
            raise ValueError(f"snapshot pool capacity must be positive, not {capacity}")
        self.sized = capacity is None
        self.max_bytes = default_max_bytes() if max_bytes is None else max_bytes
        self.capacity, self.wait_s = 0, wait_s
        self.pin = torch.cuda.is_available() if pin is None else pin
        self._slab: torch.Tensor | None = None
        self._closed = False
        self._leased = False
        self._cond = threading.Condition()
        self.stats = PoolStats()
        if capacity is not None:
            self._allocate(capacity)

    def _allocate(self, capacity: int) -> None:
        self._slab = None  # the old slab's memory goes before the new one is taken
        slab = torch.empty(capacity + ALIGN, dtype=torch.uint8, pin_memory=self.pin)
        slab.zero_()  # pre-fault every page now, once, not page by page during the copies
        self._slab, self.capacity = slab, capacity
        self.stats.allocations += 1

    def _fit(self, need: int) -> None:
        """Sized from the save: a slab of ``need`` (capped) when the current one is too small or over twice it."""
        want = min(need, self.max_bytes)
        if want <= 0:
            return
        if self._slab is None or self.capacity < want or self.capacity > 2 * want:
            self._allocate(want)

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def leased(self) -> bool:
        return self._leased

    def lease(self, need: int | None = None, wait_s: float | None = None) -> Lease:
        """The slab for one save that copies ``need`` bytes (chunks :func:`aligned`), or (busy after
        ``wait_s``, or closed) a lease that allocates fresh."""
        with self._cond:
            self._cond.wait_for(lambda: not self._leased, self.wait_s if wait_s is None else wait_s)
            if self._leased or self._closed:
                self.stats.busy += not self._closed
                return Lease(self, None)
            if self.sized and need is not None:
                self._fit(need)
            if self._slab is None:
                return Lease(self, None)
            self._leased = True
            self.stats.leases += 1
            return Lease(self, self._slab)

    def _give_back(self) -> None:
        with self._cond:
            self._leased = False
            self._cond.notify_all()

    def close(self) -> None:
        """Drop the slab. A save still uploading keeps its views alive until its lease is released."""
        with self._cond:
            self._slab, self._closed, self.capacity = None, True, 0
            self._cond.notify_all()
