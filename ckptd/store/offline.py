"""Offline access to checkpoints without a service: write whole tensors as a one-rank
checkpoint, read whole tensors back. Used by tests, import/export and tools; it goes
through the same session and commit code as the service."""

from __future__ import annotations

import uuid
from math import prod
from typing import TYPE_CHECKING, Callable, Iterator, Mapping

import xxhash

from ckptd_schemas import (
    BoxChunk, CheckpointNotFound, Location, Manifest, OpenSession, RankIndex, ReadRequest, TensorEntry,
    parse_ref, plan_reads, run_fetches,
)

from ckptd_schemas.format.engines import ChunkBuffer
from .reader import CheckpointReader
from .sessions import SessionStore

if TYPE_CHECKING:
    import torch

__all__ = ["ReadFn", "iter_slabs", "read_tensor", "write_tensors"]

ALIGN = 64
ReadFn = Callable[[str, int, int], bytes]  # (file, start, end) -> bytes of a data file


def write_tensors(sessions: SessionStore, ref: str, tensors: Mapping[str, torch.Tensor], *,
                  step: int | None = None) -> str:
    """Commit ``tensors`` (whole, CPU) as a one-rank checkpoint; return the manifest digest."""
    import torch
    r = parse_ref(ref)
    sid = uuid.uuid4().hex
    sessions.open(r.run, r.name, OpenSession(session=sid, world_size=1, step=step))
    sink = sessions.begin_file(r.run, r.name, sid, "r000000-0000.bin")
    entries = []
    try:
        for name, t in tensors.items():
            t = t.detach().cpu().contiguous()
            raw = memoryview(t.reshape(-1).view(torch.uint8).numpy()) if t.numel() else memoryview(b"")
            offset = sink.size
            sink.write(raw)
            if len(raw) % ALIGN:
                sink.write(bytes(-len(raw) % ALIGN))
            loc = Location(file="r000000-0000.bin", offset=offset, length=len(raw), raw_length=len(raw),
                           xxh3=xxhash.xxh3_64_hexdigest(raw))
            chunks = [BoxChunk(rank=0, offsets=[0] * t.dim(), sizes=list(t.shape), location=loc)] if t.numel() else []
            entries.append(TensorEntry(name=name, shape=list(t.shape), dtype=str(t.dtype).removeprefix("torch."),
                                       group=name.split(".", 1)[0], chunks=chunks))
        sink.finish(None)
    except BaseException:
        sink.abort()
        raise
    index = RankIndex(rank=0, world_size=1, tensors=entries, files=["r000000-0000.bin"])
    return sessions.put_index(r.run, r.name, sid, index).manifest_xxh3 or ""


def read_tensor(reader: CheckpointReader, ref: str, name: str) -> torch.Tensor:
    """One whole tensor of a committed checkpoint, assembled from any layout, verified."""
    import torch

    from ckptd_schemas.format.assemble import Destination, copy_into, torch_dtype
    r = parse_ref(ref)
    manifest = reader.manifest(r.run, r.name)
    t = manifest.tensor(name)
    if t is None:
        raise CheckpointNotFound(f"checkpoint {manifest.ref} has no tensor {name!r}", tensor=name)
    out = torch.empty(t.shape, dtype=torch_dtype(t.dtype))
    if out.numel() == 0:
        return out
    dest = Destination(out, t.shape, box_offsets=[0] * len(t.shape))
    run_fetches(plan_reads(manifest, [ReadRequest(name=name)]),
                lambda f: bytearray(reader.read_range(manifest.run, manifest.name, f.file, f.start, f.end)),
                lambda data, c: copy_into(data, c, dest))
    return out


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
