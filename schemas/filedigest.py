"""Streaming XXH3-64 digests of a whole stream and of its fixed-size blocks: a data file's digest
record (``FileEntry.xxh3`` and ``blocks``). The service computes it as bytes arrive; a client that
uploads straight to the object store (presigned URLs) computes it too and the commit checks it
against the stored bytes, so both sides use this one definition."""

from __future__ import annotations

import xxhash

__all__ = ["BLOCK_SIZE", "StreamDigest", "xxh3_hex"]

BLOCK_SIZE = 1 << 20


def xxh3_hex(data: bytes | memoryview) -> str:
    return xxhash.xxh3_64_hexdigest(data)


class StreamDigest:
    """Feed bytes in any pieces; get the whole digest and per-block digests."""

    def __init__(self, block_size: int = BLOCK_SIZE) -> None:
        self.block_size = block_size
        self.size = 0
        self._whole = xxhash.xxh3_64()
        self._block = xxhash.xxh3_64()
        self._fill = 0
        self.blocks: list[str] = []

    def update(self, data: bytes | memoryview) -> None:
        view = memoryview(data)
        self._whole.update(view)
        self.size += len(view)
        bs = self.block_size
        while view:
            take = min(bs - self._fill, len(view))
            self._block.update(view[:take])
            self._fill += take
            view = view[take:]
            if self._fill == bs:
                self.blocks.append(self._block.hexdigest())
                self._block.reset()
                self._fill = 0

    def finish(self) -> tuple[str, list[str]]:
        if self._fill:
            self.blocks.append(self._block.hexdigest())
            self._block.reset()
            self._fill = 0
        return self._whole.hexdigest(), self.blocks
