"""A reusable host buffer for save snapshots, so that the training stall is one memcpy.

Why: a snapshot copied into fresh ``torch.empty`` tensors pays a page fault on the first touch of
every 4 KiB page (and, on GPU, copies from pageable memory are staged and synchronous). A slab
allocated once, pinned when CUDA is available, and pre-faulted at creation turns the stall into a
copy at memory (or PCIe) bandwidth, and the memory held between saves is exactly the declared size.

Call order (one save)::

    lease = pool.lease()            # caller's thread, in build_snapshot
    t = lease.take(shape, dtype)    # per chunk: a 64-byte aligned view of the slab, or a fresh tensor
    ...copy into t, return to training...
    lease.release()                 # upload thread, after the upload finished (success or failure)

One save holds the slab at a time, because the upload reads the views until it ends. Two choices,
both counted in :attr:`SnapshotPool.stats` so that tests and benchmarks can tell which path ran:

* **busy**: the previous save is still uploading. ``lease`` waits up to ``wait_s`` (default 0:
  a store slower than the save interval must not stall training); if the slab is still taken the
  whole snapshot goes to fresh allocations (today's behaviour: more memory for a while, no wait).
* **too small**: chunks are placed first-fit in order; a chunk that does not fit in what is left
  gets a fresh tensor (``fallback_bytes``), freed when that save's upload ends.

Either way nothing but the slab outlives a save's upload; :meth:`SnapshotPool.close` drops the slab.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch

__all__ = ["ALIGN", "Lease", "PoolStats", "SnapshotPool"]

ALIGN = 64


@dataclass
class PoolStats:
    """Cumulative counts since the pool was made."""

    leases: int = 0          # saves that got the slab
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
            self._off += n + (-n) % ALIGN
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
    """A preallocated, pre-faulted host slab of ``capacity`` bytes, leased to one save at a time.

    Args:
        capacity: bytes; size it to the rank's snapshot (what it writes, replicas once).
        pin: page-locked memory (fast, asynchronous device->host copies); default: when CUDA is available.
        wait_s: how long ``lease`` waits for a previous save's upload to give the slab back.
    """

    def __init__(self, capacity: int, *, pin: bool | None = None, wait_s: float = 0.0) -> None:
        if capacity <= 0:
            raise ValueError(f"snapshot pool capacity must be positive, not {capacity}")
        self.capacity, self.wait_s = capacity, wait_s
        pin = torch.cuda.is_available() if pin is None else pin
        slab = torch.empty(capacity + ALIGN, dtype=torch.uint8, pin_memory=pin)
        slab.zero_()  # pre-fault every page now, once, not during a save
        self._slab: torch.Tensor | None = slab
        self._leased = False
        self._cond = threading.Condition()
        self.stats = PoolStats()

    @property
    def closed(self) -> bool:
        return self._slab is None

    @property
    def leased(self) -> bool:
        return self._leased

    def lease(self, wait_s: float | None = None) -> Lease:
        """The slab for one save, or (busy after ``wait_s``, or closed) a lease that allocates fresh."""
        with self._cond:
            self._cond.wait_for(lambda: not self._leased, self.wait_s if wait_s is None else wait_s)
            if self._leased or self._slab is None:
                self.stats.busy += self._slab is not None
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
            self._slab = None
            self._cond.notify_all()
