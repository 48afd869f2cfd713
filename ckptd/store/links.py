"""The commit's rule for linked files: a link pays for itself, or the commit is refused.

An incremental save links an earlier checkpoint's whole data file into its session
(``POST .../files/<name>/link``) to reuse some chunks in it. The link keeps every byte of that file
alive as long as the new checkpoint lives (and on S3 copies all of them), so a file that holds a
few reused chunks and much stale data costs more than writing those chunks again: one unchanged
4-byte scalar would pin the whole earlier file at every save. The client links a file only when
the chunks it reuses fill at least half of it (``ckptd_client._incremental.worth_linking``);
:func:`check_links` holds any writer to the same rule, so that a stale or hostile client cannot
pin files either.

Call order: the commit merges the ranks' indexes into a manifest (``ckptd.store.merge``), then calls
:func:`check_links` on it before the bytes are checked and the manifest is written; a refusal fails
the session like any other invalid index.

What fills a file: each chunk's and stored object's bytes, ``[offset, offset + length)``, with the
alignment padding after them up to the next multiple of :data:`SLOT` (what writing them again would
take of a new file), counted once however many entries refer to them. Pure: no I/O.
"""

from __future__ import annotations

from ckptd_schemas import InvalidIndex, Manifest

__all__ = ["SLOT", "check_links", "filled_bytes"]

SLOT = 64  # the alignment of stored chunks and objects in a data file


def filled_bytes(manifest: Manifest, files: set[str] | None = None) -> dict[str, tuple[int, int | None]]:
    """Per file of ``files`` (default: every linked file of ``manifest``): the bytes its chunks and
    stored objects fill (their union, slots rounded up to :data:`SLOT`, within the file) and the
    lowest rank whose entries are in it (None when no entry refers to the file)."""
    if files is None:
        files = {f for f, e in manifest.files.items() if e.linked is not None}
    spans: dict[str, list[tuple[int, int]]] = {f: [] for f in files}
    ranks: dict[str, int] = {}

    def add(file: str, offset: int, length: int, rank: int | None) -> None:
        out = spans.get(file)
        if out is None:
            return
        end = offset + length
        out.append((offset, min(end + (-end) % SLOT, manifest.files[file].size)))
        if rank is not None:
            ranks[file] = min(rank, ranks.get(file, rank))

    if not files:
        return {}
    for t in manifest.tensors:
        tab = t.table
        if files.isdisjoint(tab.file):  # most tensors, at C speed
            continue
        for f, off, n, r in zip(tab.file, tab.offset, tab.length, tab.rank or [None] * len(tab)):
            add(f, off, n, r)
    for o in manifest.objects:
        if o.location is not None:
            add(o.location.file, o.location.offset, o.location.length, o.rank)
    out: dict[str, tuple[int, int | None]] = {}
    for f, s in spans.items():
        filled, reach = 0, 0
        for lo, hi in sorted(s):
            lo = max(lo, reach)
            if hi > lo:
                filled += hi - lo
                reach = hi
        out[f] = (filled, ranks.get(f))
    return out


def check_links(manifest: Manifest) -> None:
    """Refuse (:class:`~ckptd_schemas.InvalidIndex`) a manifest holding a linked file
    (``files[f].linked`` set) that its chunks and stored objects fill less than half of; the error
    names the file, the rank whose entries are in it, the source file and the filled/total bytes.
    Files the save wrote are not concerned (their bytes were sent and paid for)."""
    for f, (filled, rank) in sorted(filled_bytes(manifest).items()):
        entry = manifest.files[f]
        if 2 * filled < entry.size:
            who = f"rank {rank}" if rank is not None else "no rank"
            raise InvalidIndex(
                f"linked file {f!r} (from {manifest.run}/{entry.linked}, {who}) is filled by {filled} of its "
                f"{entry.size} bytes: a linked file must be at least half filled by the chunks reused from it; "
                f"write the chunks again instead",
                file=f, rank=rank, linked=entry.linked, referenced_bytes=filled, file_bytes=entry.size)
