"""Fetched bytes straight into the destination tensors: no intermediate buffer.

The usual load at another world size copies row bands into row bands: every
region of every copy is one contiguous run of the fetched bytes *and* one
contiguous run of the destination's memory. For such a fetch the response is
scattered as it arrives into those runs (the bytes between them are only
hashed), and every block digest is checked on the stream. That saves the
fetch-sized buffer (allocated and page-faulted per fetch: 30% of a loading
rank's time in the profile) and one copy of every byte.

Anything else (compressed frames, column shards, casts, GPU destinations)
returns ``None`` from :func:`direct_targets` and takes the buffered path.
A digest mismatch raises :class:`ChecksumMismatch` as the buffered path does;
the destination may then hold part of the bad block, as a failed load leaves
the state dict partly restored either way.
"""

from __future__ import annotations

from typing import Iterable, Sequence

import torch
import xxhash

from ckptd_schemas import ChecksumMismatch, Copy, Fetch

from ckptd_schemas.format.assemble import Destination, torch_dtype

__all__ = ["BlockVerifier", "direct_targets", "scatter"]

Target = tuple[int, int, memoryview]  # [lo, hi) of the fetch -> the destination's bytes


def _row_major(sizes: Sequence[int], strides: Sequence[int]) -> bool:
    want = 1
    for n, s in zip(reversed(sizes), reversed(strides)):
        if n != 1 and s != want:
            return False
        want *= n
    return True


def direct_targets(copies: Iterable[Copy], dests: Sequence[Destination]) -> list[Target] | None:
    """Byte runs of the fetch and the destination memory each lands in, sorted and disjoint; or
    None when some copy needs the buffered path."""
    out: list[Target] = []
    for c in copies:
        dest = dests[c.request]
        dtype = torch_dtype(c.dtype)
        if c.codec != "raw" or dest.tensor.device.type != "cpu" or dest.tensor.dtype != dtype:
            return None
        isz = dtype.itemsize
        for offsets, sizes in c.regions:
            n = 1
            for z in sizes:
                n *= z
            if n == 0:
                continue
            if not _row_major(sizes, c.strides):
                return None
            view = dest.view(offsets, sizes)
            if not view.is_contiguous():
                return None
            lo = c.byte_start + c.source_offset(offsets) * isz
            out.append((lo, lo + n * isz, memoryview(view.detach().reshape(-1).view(torch.uint8).numpy())))
    out.sort(key=lambda t: t[0])
    if any(a[1] > b[0] for a, b in zip(out, out[1:])):
        return None  # two copies read the same bytes: let the buffered path handle it
    return out


class BlockVerifier:
    """Checks a fetch's block digests on the stream (blocks start at ``fetch.start``)."""

    def __init__(self, fetch: Fetch) -> None:
        self.fetch = fetch
        self.size = fetch.end - fetch.start
        self.got = 0
        self._block = 0
        self._h = xxhash.xxh3_64()

    def update(self, piece: memoryview) -> None:
        bs, pos = self.fetch.block_size, 0
        while pos < len(piece):
            room = bs - (self.got % bs)
            take = min(room, len(piece) - pos)
            self._h.update(piece[pos:pos + take])
            pos += take
            self.got += take
            if self.got % bs == 0 or self.got == self.size:
                self._check()

    def _check(self) -> None:
        i, f = self._block, self.fetch
        got = self._h.hexdigest()
        if i >= len(f.blocks) or got != f.blocks[i]:
            start = f.start + i * f.block_size
            raise ChecksumMismatch(
                f"file {f.file!r}: bytes [{start}, {min(start + f.block_size, f.end)}) hash to {got}, "
                f"manifest says {f.blocks[i] if i < len(f.blocks) else 'nothing'}: the checkpoint is corrupt",
                file=f.file, offset=start)
        self._block += 1
        self._h.reset()


def scatter(pieces: Iterable[bytes], fetch: Fetch, targets: list[Target]) -> int:
    """Consume the response body: verify every block, copy each target's bytes into place.
    Returns the bytes received (the caller checks it against the fetch's size)."""
    check = BlockVerifier(fetch)
    size, k = check.size, 0
    for raw in pieces:
        piece = memoryview(raw)
        lo = check.got
        hi = lo + len(piece)
        if hi > size:
            raise ChecksumMismatch(f"file {fetch.file!r}: server sent more than the {size} bytes asked", file=fetch.file)
        check.update(piece)
        while k < len(targets) and targets[k][1] <= lo:
            k += 1
        j = k
        while j < len(targets) and targets[j][0] < hi:
            t_lo, t_hi, dst = targets[j]
            a, b = max(t_lo, lo), min(t_hi, hi)
            dst[a - t_lo:b - t_lo] = piece[a - lo:b - lo]
            j += 1
    return check.got
