"""Test support: whole tensors written as a one-rank checkpoint and read back, without a service.

Through the store's own session and commit code (``SessionStore``: the commit runs the one checker)
and its own read path (``CheckpointReader.read_range``, a read plan, every block verified), so a
checkpoint made here is one the service would have made. Used by tests and ``bench/reshard.py``.
"""

from __future__ import annotations

import uuid
from typing import Mapping

import torch
import xxhash

from ckptd.store import CheckpointReader, SessionStore
from ckptd_schemas import (
    BoxChunk, CheckpointNotFound, Location, OpenSession, RankIndex, ReadRequest, TensorEntry, parse_ref, plan_reads,
    run_fetches,
)
from ckptd_schemas.format.assemble import Destination, copy_into, torch_dtype

__all__ = ["read_tensor", "write_tensors"]

ALIGN = 64
FILE = "r000000-0000.bin"


def write_tensors(sessions: SessionStore, ref: str, tensors: Mapping[str, torch.Tensor], *,
                  step: int | None = None) -> str:
    """Commit ``tensors`` (whole, CPU) as a one-rank checkpoint; return the manifest digest."""
    r = parse_ref(ref)
    sid = uuid.uuid4().hex
    sessions.open(r.run, r.name, OpenSession(session=sid, world_size=1, step=step))
    sink = sessions.intake.receive(r.run, r.name, sid, FILE)
    entries = []
    try:
        for name, t in tensors.items():
            t = t.detach().cpu().contiguous()
            raw = memoryview(t.reshape(-1).view(torch.uint8).numpy()) if t.numel() else memoryview(b"")
            offset = sink.size
            sink.write(raw)
            if len(raw) % ALIGN:
                sink.write(bytes(-len(raw) % ALIGN))
            loc = Location(file=FILE, offset=offset, length=len(raw), raw_length=len(raw),
                           xxh3=xxhash.xxh3_64_hexdigest(raw))
            chunks = [BoxChunk(rank=0, offsets=[0] * t.dim(), sizes=list(t.shape), location=loc)] if t.numel() else []
            entries.append(TensorEntry(name=name, shape=list(t.shape), dtype=str(t.dtype).removeprefix("torch."),
                                       group=name.split(".", 1)[0], chunks=chunks))
        sink.finish(None)
    except BaseException:
        sink.abort()
        raise
    index = RankIndex(rank=0, world_size=1, tensors=entries, files=[FILE])
    return sessions.put_index(r.run, r.name, sid, index).manifest_xxh3 or ""


def read_tensor(reader: CheckpointReader, ref: str, name: str) -> torch.Tensor:
    """One whole tensor of a committed checkpoint, assembled from any layout, verified."""
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
