"""Incremental saves: chunks a rank stored at its previous save, unchanged since, are not written again.

Frozen weights (a backbone under LoRA or adapters, embeddings) keep their bytes from save to save;
every saver that writes them again pays for them at every step. Here each rank remembers, after a
save, a 128-bit content digest (XXH3-128) of every chunk it wrote and where that chunk's stored
pieces are (file and locations in that checkpoint). At its next save to the same run:

1. :meth:`ChunkHistory.begin` digests this save's chunks and picks those whose (tensor, dtype,
   region) and digest equal the remembered ones. 128 bits: two different contents sharing one
   digest takes about 2^64 tries to find on purpose, and never happens by chance.
2. :meth:`SaveDelta.link` asks the service to link each earlier file holding such chunks into the new
   session (``POST .../files/<linked_name>/link``): a hard link on a local root, a copy inside the
   store on S3, so no byte of them passes through the rank or the service. A refused link (the
   earlier checkpoint never committed, or was deleted since) leaves its chunks to be written as usual.
3. ``_pack`` places the linked chunks at their stored locations in the linked files
   (:func:`relocated`) and writes the rest; the rank index lists the linked files with its own.
4. Once the index is accepted, :meth:`ChunkHistory.remember` keeps this save's digests and
   locations for the next save.

The service's commit accepts a chunk in a linked file only where the source checkpoint's manifest
placed a chunk it verified, and reads the file otherwise (``ckptd.store.commit_checks``). A
checkpoint holding linked files is complete on its own: its files are ordinary files of its
session, so loading, verifying, resharding and exporting it, and deleting older checkpoints,
need nothing else.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import xxhash

from ckptd_schemas import BoxChunk, CkptdError, FlatChunk, InvalidRequest, NotFound, linked_name

if TYPE_CHECKING:
    from .transport import Transport

__all__ = ["ChunkHistory", "SaveDelta", "chunk_key", "link_files", "relocated"]

log = logging.getLogger("ckptd_client")

ChunkKey = tuple  # (tensor, dtype, ("box", offsets, sizes) | ("flat", start, length))


def chunk_key(tensor: str, dtype: str, box: Any, flat: Any) -> ChunkKey:
    """What identifies one chunk of a rank's save across saves: its tensor, dtype and region."""
    region = ("box", tuple(box[0]), tuple(box[1])) if box is not None else ("flat", *flat)
    return tensor, dtype, region


@dataclass
class _Stored:
    digest: bytes
    pieces: list  # the index's BoxChunk / FlatChunk entries of the chunk, locations in files of ``name``


@dataclass
class SaveDelta:
    """One save's side of it: its chunks' digests, the remembered pieces it may link (in files of
    checkpoint ``source``), and, filled by ``_pack``, every chunk's pieces as its index holds them."""

    run: str
    name: str
    digests: dict[ChunkKey, bytes]
    candidates: dict[ChunkKey, list]
    source: str | None
    produced: dict[ChunkKey, list] = field(default_factory=dict)

    def link(self, transport: "Transport", base: str, session: str, rank: int) -> dict[ChunkKey, list]:
        """Link the files holding the candidates into ``session``; returns the chunks to place in them."""
        if not self.candidates or self.source is None:
            return {}
        files = {p.location.file for pieces in self.candidates.values() for p in pieces}
        linked = link_files(transport, base, session, self.source, files)
        reuse = {}
        for key, pieces in self.candidates.items():
            moved = relocated(pieces, linked, rank)
            if moved is not None:
                reuse[key] = moved
        return reuse


@dataclass
class ChunkHistory:
    """What this rank stored at its last save: per chunk, its digest and stored pieces."""

    run: str | None = None
    name: str | None = None
    chunks: dict[ChunkKey, _Stored] = field(default_factory=dict)

    def begin(self, run: str, name: str, snap: Any) -> SaveDelta:
        """Digest ``snap``'s chunks (a ``Snapshot``) and pick those stored unchanged at the last save to
        ``run`` (none after a save to another run, or before any)."""
        digests = {chunk_key(t.name, t.dtype, c.box, c.flat): digest(_raw(c.data))
                   for t in snap.tensors for c in snap.chunks.get(t.name, [])}
        candidates = {}
        if self.run == run and self.name is not None and self.name != name:
            for key, d in digests.items():
                stored = self.chunks.get(key)
                if stored is not None and stored.digest == d:
                    candidates[key] = stored.pieces
        return SaveDelta(run, name, digests, candidates, self.name if candidates else None)

    def remember(self, delta: SaveDelta) -> None:
        """After a save whose index was accepted: its chunks' digests and where their pieces are."""
        self.run, self.name = delta.run, delta.name
        self.chunks = {k: _Stored(delta.digests[k], pieces) for k, pieces in delta.produced.items()
                       if k in delta.digests}


def digest(data: memoryview) -> bytes:
    return xxhash.xxh3_128_digest(data)


def _raw(t: Any) -> memoryview:
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())


def link_files(transport: "Transport", base: str, session: str, source: str, files: set[str]) -> dict[str, str]:
    """Link each of ``files`` (of checkpoint ``source``, same run) into the session; returns the ones
    the service linked, each to its name in the new checkpoint. A refusal (``InvalidRequest``,
    ``NotFound``) drops that file: its chunks are written instead."""
    linked: dict[str, str] = {}
    for f in sorted(files):
        name = linked_name(source, f)
        try:
            transport.request("POST", f"{base}/sessions/{session}/files/{name}/link",
                              json={"checkpoint": source, "file": f})
        except (InvalidRequest, NotFound) as e:
            log.info("incremental save: %s/%s not linked (%s); its chunks are written again", source, f,
                     e.message if isinstance(e, CkptdError) else e)
            continue
        linked[f] = name
    return linked


def relocated(pieces: list, linked: dict[str, str], rank: int) -> list | None:
    """The pieces with their files renamed to the linked names (written by ``rank`` now); None when
    one of their files was not linked."""
    out = []
    for p in pieces:
        name = linked.get(p.location.file)
        if name is None:
            return None
        loc = p.location.model_copy(update={"file": name})
        if isinstance(p, FlatChunk):
            out.append(FlatChunk.model_construct(kind="flat", rank=rank, start=p.start, length=p.length, location=loc))
        else:
            out.append(BoxChunk.model_construct(kind="box", rank=rank, offsets=p.offsets, sizes=p.sizes, location=loc))
    return out
