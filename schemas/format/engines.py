"""The copy engines: tensor bytes assembled from verified fetches, by numpy on the host or by torch on a
device (the format's torch kernel, :mod:`ckptd_schemas.format.assemble`, underneath). The service's
reshard, drills, digests and export use them; they live with the byte format, below the store.

A reshard work unit fills one target chunk at a time from verified source
bytes (``ckptd_schemas.Copy`` regions), then hands its bytes to the writer;
:func:`iter_slabs` (digests, export) fills row-major slabs
the same way. The two engines do exactly that and nothing else:

* :class:`HostEngine` - numpy views over the unit's buffer, one strided copy
  per region. Bytes only, so any dtype (bf16 and fp8 included) moves as an
  unsigned integer of its width; it cannot cast. It needs no torch, whose import
  is a large part of a whole ``ckptd reshard --root`` run (BENCHMARKS.md, Figures behind the code).
* :class:`TorchEngine` - the same copies with ``torch.as_strided`` on a device
  (``cuda``, or ``cpu`` so CI runs the GPU code), and casts (``--dtype``).

:func:`pick_engine` chooses: ``cuda`` -> torch on the GPU; ``cpu`` -> the host
engine, or torch on the CPU when the plan casts; ``auto`` -> ``cuda`` when a
GPU is present, else as ``cpu``. Call order per unit: ``engine.buffer(nbytes)``
once (the largest target chunk: fresh pages cost more to fault in than bytes to
copy), then per chunk ``buf.begin(...)``, ``buf.copy(...)`` per copy,
``buf.result(dtype)``.
"""

from __future__ import annotations

import os
import sys
from contextlib import AbstractContextManager, contextmanager
from math import prod
from typing import TYPE_CHECKING, Iterator, Protocol, Sequence

import numpy as np
from numpy.lib.stride_tricks import as_strided

from ckptd_schemas import (
    Copy, IntegrityError, InvalidRequest, Manifest, ReadRequest, TensorEntry, dest_region, itemsize, plan_reads,
    row_major_strides, run_fetches,
)
from ckptd_schemas.readplan import ReadFn
from ckptd_schemas.format.encoding import source_bytes

if TYPE_CHECKING:
    import torch

__all__ = ["ChunkBuffer", "Engine", "HostEngine", "TorchEngine", "cuda_present", "iter_slabs", "pick_engine"]


class ChunkBuffer(Protocol):
    """One unit's target-chunk memory, reused chunk after chunk."""

    def begin(self, dtype: str, numel: int, global_shape: Sequence[int], *, sizes: Sequence[int] | None = None,
              offsets: Sequence[int] | None = None, flat_start: int | None = None) -> None:
        """Start a chunk of ``numel`` elements of ``dtype``: a box (``offsets``, ``sizes``) of the global
        tensor, or the flat range from ``flat_start``."""

    def copy(self, data: memoryview, c: Copy) -> None:
        """Copy every region of ``c`` from a verified fetch into the chunk."""

    def result(self, dtype: str) -> memoryview:
        """The chunk's bytes on the host, as ``dtype`` (a cast when it differs from ``begin``'s)."""


class Engine(Protocol):
    name: str

    def buffer(self, nbytes: int) -> ChunkBuffer:
        """Memory for target chunks of up to ``nbytes`` (a larger one reallocates)."""

    def running(self) -> AbstractContextManager[None]:
        """Held while a plan's units run (threads included)."""


# -- host (numpy) ------------------------------------------------------------------------------------------

def _host_dtype(name: str) -> np.dtype:
    """An unsigned integer (or opaque) numpy dtype as wide as ``name``: the host engine moves bytes."""
    n = itemsize(name)
    return np.dtype(f"u{n}") if n in (1, 2, 4, 8) else np.dtype((np.void, n))


def _region(arr: np.ndarray, offset: int, sizes: Sequence[int], strides: Sequence[int], what: str) -> np.ndarray:
    """A checked strided view of the 1-D ``arr``: numpy's as_strided trusts its arguments, so a region
    that would reach outside the buffer is refused here (torch's as_strided checks this itself)."""
    if 0 in sizes:
        return arr[:0]
    last = offset + sum((s - 1) * st for s, st in zip(sizes, strides))
    low = offset + sum((s - 1) * st for s, st in zip(sizes, strides) if st < 0)
    if offset < 0 or low < 0 or last >= arr.size:
        raise IntegrityError(f"{what}: region at element {offset}, sizes {list(sizes)}, strides {list(strides)} "
                             f"reaches outside a buffer of {arr.size} elements")
    return as_strided(arr[offset:], shape=tuple(sizes), strides=tuple(s * arr.itemsize for s in strides),
                      writeable=arr.flags.writeable)


class _HostBuffer:
    def __init__(self, nbytes: int) -> None:
        self.raw = np.empty(max(nbytes, 1), dtype=np.uint8)
        self.arr = self.raw[:0]
        self.dtype, self.geom = "", {}

    def begin(self, dtype: str, numel: int, global_shape: Sequence[int], *, sizes: Sequence[int] | None = None,
              offsets: Sequence[int] | None = None, flat_start: int | None = None) -> None:
        dt = _host_dtype(dtype)
        if numel * dt.itemsize > self.raw.size:
            self.raw = np.empty(numel * dt.itemsize, dtype=np.uint8)
        self.arr = self.raw[:numel * dt.itemsize].view(dt)
        own = row_major_strides(sizes) if sizes is not None else (1,)
        self.dtype = dtype
        self.geom = {"strides": own, "global_shape": global_shape, "box_offsets": offsets, "flat_start": flat_start}

    def copy(self, data: memoryview, c: Copy) -> None:
        if itemsize(c.dtype) != self.arr.itemsize:
            raise IntegrityError(f"tensor {c.tensor!r}: source dtype {c.dtype} is not the chunk's {self.dtype}")
        src = np.frombuffer(source_bytes(data, c), dtype=self.arr.dtype)
        for offsets, sizes in c.regions:
            s = _region(src, c.source_offset(offsets), sizes, c.strides, f"tensor {c.tensor!r} source")
            strides, rel = dest_region(offsets, **self.geom)
            np.copyto(_region(self.arr, rel, sizes, strides, f"tensor {c.tensor!r} target"), s)

    def result(self, dtype: str) -> memoryview:
        if dtype != self.dtype:
            raise InvalidRequest(f"the host engine does not cast ({self.dtype} -> {dtype}): use torch", dtype=dtype)
        return memoryview(self.arr.view(np.uint8))


class HostEngine:
    """Copies with numpy on the host; no torch import. Cannot cast."""

    name = "host"

    def buffer(self, nbytes: int) -> ChunkBuffer:
        return _HostBuffer(nbytes)

    @contextmanager
    def running(self) -> Iterator[None]:
        yield  # numpy copies are single-threaded and release the GIL: the unit threads are the parallelism


# -- torch (any device) ------------------------------------------------------------------------------------

class _TorchBuffer:
    def __init__(self, nbytes: int, device: "torch.device") -> None:
        import torch
        self.torch, self.device = torch, device
        self.staging = torch.empty(max(nbytes, 1), dtype=torch.uint8, device=device)
        self.buf = self.staging[:0]
        self.dest = None

    def begin(self, dtype: str, numel: int, global_shape: Sequence[int], *, sizes: Sequence[int] | None = None,
              offsets: Sequence[int] | None = None, flat_start: int | None = None) -> None:
        from ckptd_schemas.format.assemble import Destination, torch_dtype
        dt = torch_dtype(dtype)
        if numel * dt.itemsize > self.staging.numel():
            self.staging = self.torch.empty(numel * dt.itemsize, dtype=self.torch.uint8, device=self.device)
        self.buf = self.staging[:numel * dt.itemsize].view(dt)
        if sizes is not None:
            self.dest = Destination(self.buf.view(list(sizes)), global_shape, box_offsets=offsets)
        else:
            self.dest = Destination(self.buf, global_shape, flat_start=flat_start)

    def copy(self, data: memoryview, c: Copy) -> None:
        from ckptd_schemas.format.assemble import copy_into
        if data.readonly:  # torch.frombuffer wants writable memory (it warns otherwise)
            data = memoryview(bytearray(data))
        copy_into(data, c, self.dest)

    def result(self, dtype: str) -> memoryview:
        from ckptd_schemas.format.assemble import torch_dtype
        out = self.buf if self.buf.dtype == torch_dtype(dtype) else self.buf.to(torch_dtype(dtype))
        host = out.cpu() if out.device.type != "cpu" else out
        return memoryview(host.view(self.torch.uint8).numpy()) if host.numel() else memoryview(b"")


class TorchEngine:
    """Copies (and casts) with torch on ``device``: the GPU path, and the same code on the CPU."""

    def __init__(self, device: "str | torch.device") -> None:
        import torch
        self.device = torch.device(device)
        self.name = f"torch-{self.device.type}"

    def buffer(self, nbytes: int) -> ChunkBuffer:
        return _TorchBuffer(nbytes, self.device)

    @contextmanager
    def running(self) -> Iterator[None]:
        """On CPU, torch's intra-op threads are set to 1 while the units run, and restored after.

        The units' own threads are the parallelism, and one memcpy-speed thread per copy outruns the disk. An
        intra-op team, by contrast, makes each copy wait for its slowest thread: on shared cores a copy
        took, at random, many times longer with 2 threads than with 1 (BENCHMARKS.md, Figures behind the
        code). Threads that start while this is in effect (the unit pool's) take the setting; the caller's
        thread gets its own value back.
        """
        if self.device.type != "cpu":
            yield
            return
        import torch
        prev = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            yield
        finally:
            torch.set_num_threads(prev)


def cuda_present() -> bool:
    """Whether a CUDA (or ROCm) GPU can be used, without importing torch when no GPU driver is loaded:
    importing torch costs seconds of start-up, and without ``/dev/nvidiactl`` or ``/dev/kfd`` it would
    answer no anyway."""
    if "torch" not in sys.modules and not any(os.path.exists(p) for p in ("/dev/nvidiactl", "/dev/kfd")):
        return False
    import torch
    return torch.cuda.is_available()


def pick_engine(device: str, *, casts: bool = False) -> Engine:
    """``auto`` -> the GPU when present, else as ``cpu``; ``cpu`` -> the host engine, or torch on the CPU
    when the plan casts; ``cuda`` without a GPU is refused."""
    if device not in ("auto", "cpu", "cuda"):
        raise InvalidRequest(f"device must be auto, cpu or cuda, not {device!r}", device=device)
    if device == "cuda" and not cuda_present():
        raise InvalidRequest("--device cuda asked for, but no CUDA device is available", device=device)
    if device == "cuda" or (device == "auto" and cuda_present()):
        return TorchEngine("cuda")
    return TorchEngine("cpu") if casts else HostEngine()


def iter_slabs(manifest: Manifest, t: TensorEntry, read: ReadFn, *, slab_elems: int, buffer: ChunkBuffer,
               dtype: str | None = None) -> Iterator[tuple[memoryview, memoryview]]:
    """The tensor's row-major flattening in slabs of at most ``slab_elems`` elements, each assembled in
    ``buffer`` from whatever chunks hold it and block-verified: bounded memory for any layout.

    Yields (the slab's stored bytes, the same slab as ``dtype``), views valid until the next slab; a
    ``dtype`` other than the stored one needs a buffer that casts (``TorchEngine``)."""
    numel = prod(t.shape)
    step = max(1, slab_elems)
    for start in range(0, numel, step):
        n = min(step, numel - start)
        plan = plan_reads(manifest, [ReadRequest(name=t.name, flat_start=start, flat_length=n)])
        buffer.begin(t.dtype, n, t.shape, flat_start=start)
        run_fetches(plan, lambda f: read(f.file, f.start, f.end), buffer.copy)  # no copy: the engine copies out
        stored = buffer.result(t.dtype)
        yield stored, (stored if dtype is None or dtype == t.dtype else buffer.result(dtype))
