"""Where the files an incremental save linked came from (``FileEntry.linked``), one rule for all.

A file a save linked from an earlier checkpoint of its run keeps the digests its own commit recorded.
Two places rely on the source still holding exactly those bytes: the commit accepts the chunks the
source's commit verified without reading them (``SessionStore._linked_locations``), and the durable
copy links the file inside the durable tier instead of sending it (``DurableCopier``). Both ask
:func:`linked_sources`, each through its own :class:`~.visibility.Visibility` (the root's, or the
durable tier's).
"""

from __future__ import annotations

from dataclasses import dataclass

from ckptd_schemas import FileEntry, Manifest

from .visibility import Committed, Visibility

__all__ = ["LinkedSource", "linked_sources"]


@dataclass(frozen=True)
class LinkedSource:
    """A linked file's source: the visible checkpoint, its manifest, and the file's name in it."""

    checkpoint: Committed
    manifest: Manifest
    file: str


def linked_sources(vis: Visibility, run: str, files: dict[str, FileEntry]) -> dict[str, LinkedSource]:
    """Per linked file of ``files``, its source, where that source is visible to ``vis`` and its
    manifest records the file with the same size, XXH3 and block digests; files whose source is gone
    or holds other bytes are left out (their bytes are read, or sent, instead)."""
    out: dict[str, LinkedSource] = {}
    sources: dict[str, tuple[Committed, Manifest] | None] = {}
    for f, entry in files.items():
        if entry.linked is None:
            continue
        src_name, src_file = entry.linked.split("/", 1)
        if src_name not in sources:
            c = vis.check(run, src_name)
            sources[src_name] = (c, vis.manifest(c)) if c is not None else None
        found = sources[src_name]
        src = found[1].files.get(src_file) if found is not None else None
        if src is not None and (src.size, src.xxh3, src.blocks) == (entry.size, entry.xxh3, entry.blocks):
            out[f] = LinkedSource(found[0], found[1], src_file)
    return out
