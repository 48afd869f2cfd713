"""Incremental saves: chunks a rank stored at its previous save, unchanged since, are not written again.

Four words name the whole feature, in code and docs alike: an **incremental** save; a chunk
**unchanged** since the rank's last save; the file holding it **linked** into the new checkpoint;
the **parent**, the earlier checkpoint it is linked from.

Frozen weights (a backbone under LoRA or adapters, embeddings) keep their bytes from save to save;
every saver that writes them again pays for them at every step. Here each rank remembers, after a
save, a 128-bit content digest (XXH3-128) of every chunk it wrote and where that chunk's stored
pieces are (file and locations in that checkpoint). At its next save to the same run:

1. In the save's stall, each chunk a rank holds on the CPU that did not change at the last save
   (:meth:`ChunkHistory.stall_keys`) is digested in place (:func:`digest_source`); those whose
   (tensor, dtype, region) and digest equal the remembered ones (:meth:`ChunkHistory.candidates`),
   in files they fill at least half of (:func:`worth_linking`),
   have their files linked into the new session at once (:func:`link_early`, which opens the session
   for the upload; ``POST .../files/<linked_name>/link``, a hard link on a local root, a copy inside
   the store on S3, so no byte of them passes through the rank or the service), and are not copied:
   the stall is a hash of the frozen part and a copy of the rest. Each request is made once with a
   short timeout; whatever is not linked then is copied as usual. 128 bits: two different contents
   sharing one digest takes about 2^64 tries to find on purpose, and never happens by chance.
2. In the upload, :meth:`ChunkHistory.begin` digests the copied chunks (GPU tensors, and chunks that
   changed at the last save, among them) and
   :meth:`SaveLinks.link` links what is unchanged among them the same way. A refused link (the
   earlier checkpoint never committed, or was deleted since) leaves its chunks to be written.
3. The upload's order (``_saveplan.write_order``) holds the linked chunks at their stored
   locations in the linked files (:func:`relocated`); ``_pack`` writes the rest and the rank index
   lists the linked files with its own. Unchanged chunks written again (``SaveLinks.unchanged``:
   their file was not worth linking, or its link was refused) are laid out first, in files of their
   own, which the next save can link whole.
4. Once the index is accepted, :meth:`ChunkHistory.remember` keeps this save's digests,
   locations and file sizes for the next save.

Links pay for themselves (:func:`worth_linking`): a linked file keeps all its bytes alive as long
as the new checkpoint lives, so an earlier file is linked only when the chunks reused from it fill
at least half of it; the stale rest then never outweighs what the link saves. One unchanged scalar
beside a tensor that changes is written again (a few bytes) rather than pinning the whole earlier
file at every save (twice the state kept, and on S3 a copy of the stale file at every save). The
service refuses a commit that breaks the rule (``ckptd.store.links.check_links``).

The service links a file only while the source checkpoint's verification record still vouches for
it (its stamp unchanged; else the saver sends the bytes), and its commit reads and checks every
linked byte like any other (``ckptd.store.checker``). A
checkpoint holding linked files is complete on its own: its files are ordinary files of its
session, so loading, verifying, resharding and exporting it, and deleting older checkpoints,
need nothing else.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Iterable, Mapping

import torch
import xxhash

from ckptd_schemas import CkptdError, InvalidRequest, NotFound, linked_name

if TYPE_CHECKING:
    from .transport import Transport

__all__ = ["SLOT", "ChunkHistory", "SaveLinks", "bytes_of", "chunk_key", "digest_source", "link_early", "link_files", "relocated",
           "worth_linking"]

log = logging.getLogger("ckptd_client")

ChunkKey = tuple  # (tensor, dtype, ("box", offsets, sizes) | ("flat", start, length))
SLOT = 64  # the alignment of stored chunks in a data file (``_save.ALIGN``)
_OFFERED_KEPT = 16  # saves whose linked files' sizes are kept until they are remembered (or fail)


def chunk_key(tensor: str, dtype: str, box: Any, flat: Any) -> ChunkKey:
    """What identifies one chunk of a rank's save across saves: its tensor, dtype and region."""
    region = ("box", tuple(box[0]), tuple(box[1])) if box is not None else ("flat", *flat)
    return tensor, dtype, region


@dataclass
class _Stored:
    digest: bytes
    pieces: list  # the index's BoxChunk / FlatChunk entries of the chunk, locations in files of ``name``
    changed: bool = False  # its bytes differed from the save before: not hashed in the next stall


@dataclass(frozen=True)
class _Last:
    run: str
    name: str
    chunks: dict[ChunkKey, _Stored]
    sizes: dict[str, int] = field(default_factory=dict)  # the checkpoint's files that hold the chunks: size


def _slot(piece: Any) -> int:
    """What a stored piece takes of its file: its bytes and the alignment padding after them, which is
    what writing it again would take of a new file."""
    n = piece.location.length
    return n + (-n) % SLOT


def worth_linking(candidates: Mapping[ChunkKey, list], sizes: Mapping[str, int],
                  held: Mapping[str, int] | None = None) -> dict[ChunkKey, list]:
    """The rule that makes links pay for themselves: of ``candidates`` (chunk -> its stored pieces in
    files of the earlier checkpoint), those whose every file is filled at least half by the chunks
    reused from it; the others are written again.

    A file is filled by the slots (:func:`_slot`) of the kept candidates' pieces in it, plus
    ``held[file]`` (slot bytes this save already placed in its link: those linked in the stall). A
    linked file keeps all of its ``sizes[file]`` bytes alive, so at half full or more its stale bytes
    never outnumber the bytes the link saves writing; a file of unknown size is never linked. Dropping
    a chunk empties its other files too (a chunk's frames may span two files), so the rule is applied
    until nothing more drops. Pure: the stall and the upload call it (:meth:`ChunkHistory.candidates`).
    """
    kept = dict(candidates)
    while True:
        filled = dict(held or {})
        for pieces in kept.values():
            for p in pieces:
                filled[p.location.file] = filled.get(p.location.file, 0) + _slot(p)
        short = {f for f, n in filled.items() if f not in sizes or 2 * n < sizes[f]}
        left = {k: pieces for k, pieces in kept.items() if not any(p.location.file in short for p in pieces)}
        if len(left) == len(kept):
            return kept
        kept = left


@dataclass
class SaveLinks:
    """One save's side of it: its chunks' digests, the remembered pieces it may link (in files of
    checkpoint ``source``), and, filled by the upload, every chunk's pieces as its index holds them."""

    run: str
    name: str
    digests: dict[ChunkKey, bytes]
    candidates: dict[ChunkKey, list]
    source: str | None
    produced: dict[ChunkKey, list] = field(default_factory=dict)
    unchanged: frozenset = frozenset()  # chunks whose digest the last save stored: written apart when not linked
    written: dict[str, int] = field(default_factory=dict)  # filled by the upload: each file it wrote, its size

    def link(self, transport: "Transport", base: str, session: str, rank: int) -> dict[ChunkKey, list]:
        """Link the files holding the candidates into ``session``; returns the chunks to place in them."""
        if not self.candidates or self.source is None:
            return {}
        return _relocate_all(self.candidates, link_files(transport, base, session, self.source,
                                                         _files_of(self.candidates)), rank)


class ChunkHistory:
    """What this rank stored at its last save: per chunk, its digest and stored pieces. Read by the
    next save's stall while the previous save's upload may :meth:`remember`: the state is one
    object, replaced whole. The sizes of the files offered for linking to each save in flight are kept
    apart (``_offered``, under a lock) until that save is remembered: a linked file has the size of
    the file it links, and the next save's rule needs it."""

    def __init__(self) -> None:
        self._last: _Last | None = None
        self._offered: dict[tuple[str, str], dict[str, int]] = {}
        self._lock = threading.Lock()

    def stall_keys(self, run: str, name: str) -> frozenset[ChunkKey]:
        """The chunks worth hashing in the stall of a save to ``run/name``: those of the last save to the
        run that did not change at it. A chunk that changed then (trained weights, optimizer state)
        most likely changed again: it is copied without a hash in the stall, and hashed in the upload."""
        last, _ = self._matching(run, name, {})
        return frozenset() if last is None else frozenset(k for k, s in last.chunks.items() if not s.changed)

    def _matching(self, run: str, name: str, digests: Mapping[ChunkKey, bytes]) -> tuple[_Last | None, dict]:
        """The last save, when it was to ``run`` under another name than ``name`` (what a save there may
        link from), and the chunks of ``digests`` it stored with the same digest, with their pieces."""
        last = self._last
        if last is None or last.run != run or last.name == name:
            return None, {}
        same = {k: s.pieces for k, d in digests.items() if (s := last.chunks.get(k)) is not None and s.digest == d}
        return last, same

    def candidates(self, run: str, name: str, digests: dict[ChunkKey, bytes],
                   placed: Iterable[list] = ()) -> tuple[str | None, dict[ChunkKey, list]]:
        """The checkpoint of the last save to ``run`` and, of ``digests``, the chunks stored unchanged in it
        in files worth linking (:func:`worth_linking`; nothing after a save to another run, or before
        any). ``placed``: pieces this save already placed in linked files (in the stall), which fill
        their files too. The sizes of the files offered are kept for :meth:`remember`."""
        last, out = self._matching(run, name, digests)
        if last is None or not out:
            return None, {}
        names = {linked_name(last.name, f): f for f in last.sizes}
        held: dict[str, int] = {}
        for pieces in placed:
            for p in pieces:
                f = names.get(p.location.file)
                if f is not None:
                    held[f] = held.get(f, 0) + _slot(p)
        out = worth_linking(out, last.sizes, held)
        if not out:
            return None, {}
        with self._lock:
            offered = self._offered.setdefault((run, name), {})
            offered.update({linked_name(last.name, f): last.sizes[f] for f in _files_of(out)})
            while len(self._offered) > _OFFERED_KEPT:  # saves that failed before they were remembered
                del self._offered[next(iter(self._offered))]
        return last.name, out

    def begin(self, run: str, name: str, snap: Any) -> SaveLinks:
        """Digest ``snap``'s chunks (a ``Snapshot``, keyed by its plan; those digested in the stall keep
        that digest) and pick, among the chunks it copied, those stored unchanged at the last save to ``run``."""
        digests: dict[ChunkKey, bytes] = {}
        copied: dict[ChunkKey, bytes] = {}
        placed: list[list] = []
        for c in (c for cs in snap.chunks.values() for c in cs):
            digests[c.key] = c.digest if c.digest is not None else xxhash.xxh3_128_digest(bytes_of(c.data))
            if c.reused is None:
                copied[c.key] = digests[c.key]
            else:
                placed.append(c.reused)
        source, candidates = self.candidates(run, name, copied, placed)
        unchanged = frozenset(self._matching(run, name, copied)[1])
        return SaveLinks(run, name, digests, candidates, source, unchanged=unchanged)

    def remember(self, links: SaveLinks) -> None:
        """After a save whose index was accepted: its chunks' digests, where their pieces are, and which
        of them changed since the save before."""
        last = self._last
        before = last.chunks if last is not None and last.run == links.run else {}
        with self._lock:
            offered = self._offered.pop((links.run, links.name), {})
        chunks = {}
        sizes: dict[str, int] = {}
        for k, pieces in links.produced.items():
            if k in links.digests:
                previous = before.get(k)
                chunks[k] = _Stored(links.digests[k], pieces,
                                    changed=previous is not None and previous.digest != links.digests[k])
                for p in pieces:  # a file of unknown size is never linked (worth_linking)
                    size = links.written.get(p.location.file, offered.get(p.location.file))
                    if size is not None:
                        sizes[p.location.file] = size
        self._last = _Last(links.run, links.name, chunks, sizes)


def bytes_of(t: torch.Tensor) -> memoryview:
    """A contiguous CPU tensor's bytes, in place."""
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())


def digest_source(t: torch.Tensor) -> bytes | None:
    """The digest of a tensor the rank holds, read in place: a contiguous CPU tensor; else None (a
    GPU tensor is digested once copied to the host)."""
    if t.device.type != "cpu" or not t.is_contiguous():
        return None
    return xxhash.xxh3_128_digest(bytes_of(t.detach()))


def _files_of(candidates: dict[ChunkKey, list]) -> set[str]:
    return {p.location.file for pieces in candidates.values() for p in pieces}


def _relocate_all(candidates: dict[ChunkKey, list], linked: dict[str, str], rank: int) -> dict[ChunkKey, list]:
    reuse = {}
    for key, pieces in candidates.items():
        moved = relocated(pieces, linked, rank)
        if moved is not None:
            reuse[key] = moved
    return reuse


def link_early(open_session: Callable[[], Any], transport: "Transport", base: str, session: str, rank: int,
               source: str, candidates: dict[ChunkKey, list], timeout: float) -> tuple[Any, dict[ChunkKey, list]]:
    """In a save's stall: open the session (``open_session``) and link the files holding ``candidates``,
    each request once and within ``timeout`` seconds; returns what the opening answered (None if it
    failed: the upload opens it then) and the chunks now held by the session, which need no copy. A
    file the service refuses is left out; any other failure (the service slow or down) links nothing:
    those chunks are then copied and written as usual, and the stall never waits long."""
    opened = None
    try:
        opened = open_session()
        linked = link_files(transport, base, session, source, _files_of(candidates), retry=False, timeout=timeout)
    except Exception as e:  # noqa: BLE001 - the slow path is always there
        log.info("incremental save: nothing linked before the copy (%s: %s)", type(e).__name__, e)
        return opened, {}
    return opened, _relocate_all(candidates, linked, rank)


def link_files(transport: "Transport", base: str, session: str, source: str, files: set[str], *,
               retry: bool = True, timeout: float | None = None) -> dict[str, str]:
    """Link each of ``files`` (of checkpoint ``source``, same run) into the session; returns the ones
    the service linked, each to its name in the new checkpoint. A refusal (``InvalidRequest``,
    ``NotFound``) drops that file: its chunks are written instead."""
    linked: dict[str, str] = {}
    for f in sorted(files):
        name = linked_name(source, f)
        try:
            transport.request("POST", f"{base}/sessions/{session}/files/{name}/link",
                              json={"checkpoint": source, "file": f}, retry=retry, timeout=timeout)
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
        out.append(p.model_copy(update={"rank": rank, "location": p.location.model_copy(update={"file": name})}))
    return out
