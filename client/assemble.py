"""Assembly of tensors from fetched byte ranges: verify, decode, copy (shared by
``CheckpointClient.load`` and the reshard executor, on any device).

A :class:`ckptd_schemas.ReadPlan` lists fetches (byte ranges with block
digests) and copies (which global boxes of which chunk land where). For each
fetch: :func:`verify_fetch`, then for each of its copies :func:`copy_into`
with a destination described by :class:`Destination`.
"""

from __future__ import annotations

import io
import pickle
import threading
from dataclasses import dataclass
from typing import Sequence

import torch
import xxhash
import zstandard

from ckptd_schemas import ChecksumMismatch, Copy, Fetch, row_major_strides

__all__ = ["Destination", "copy_into", "decode_object", "torch_dtype", "verify_fetch"]

_LOCAL = threading.local()


def _dctx() -> zstandard.ZstdDecompressor:
    """One decompressor per thread: a ZstdDecompressor must not be used by two threads at once
    (loads decode frames on several fetch threads; a shared one corrupts its output)."""
    d = getattr(_LOCAL, "dctx", None)
    if d is None:
        d = _LOCAL.dctx = zstandard.ZstdDecompressor()
    return d


def torch_dtype(name: str) -> torch.dtype:
    dt = getattr(torch, name, None)
    if not isinstance(dt, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}")
    return dt


def verify_fetch(buf: bytes | bytearray | memoryview, fetch: Fetch) -> None:
    """Raise ChecksumMismatch unless every block of the fetched range matches its digest."""
    mv = memoryview(buf)
    size = fetch.end - fetch.start
    if len(mv) != size:
        raise ChecksumMismatch(f"file {fetch.file!r}: got {len(mv)} of {size} bytes at offset {fetch.start}",
                               file=fetch.file)
    for i, want in enumerate(fetch.blocks):
        lo = i * fetch.block_size
        got = xxhash.xxh3_64_hexdigest(mv[lo:lo + fetch.block_size])
        if got != want:
            start = fetch.start + lo
            raise ChecksumMismatch(
                f"file {fetch.file!r}: bytes [{start}, {start + min(fetch.block_size, size - lo)}) hash to {got}, "
                f"manifest says {want}: the checkpoint is corrupt", file=fetch.file, offset=start)


@dataclass
class Destination:
    """Where a requested region lives in memory: a tensor holding a box of the global
    tensor (shaped like the box) or a 1-D tensor holding a flat range."""

    tensor: torch.Tensor
    global_shape: Sequence[int]
    box_offsets: Sequence[int] | None = None
    flat_start: int | None = None

    def view(self, offsets: Sequence[int], sizes: Sequence[int]) -> torch.Tensor:
        dst = self.tensor
        if self.flat_start is not None:
            g = row_major_strides(self.global_shape)
            s = dst.stride(0)
            pos = sum(o * x for o, x in zip(offsets, g)) - self.flat_start
            return dst.as_strided(list(sizes), [x * s for x in g], dst.storage_offset() + pos * s)
        base = self.box_offsets or [0] * len(offsets)
        rel = sum((o - b) * s for o, b, s in zip(offsets, base, dst.stride()))
        return dst.as_strided(list(sizes), dst.stride(), dst.storage_offset() + rel)


def _source(buf: bytearray | memoryview, c: Copy, device: torch.device | None) -> torch.Tensor:
    dtype = torch_dtype(c.dtype)
    if c.codec == "zstd":
        raw = bytearray(_dctx().decompress(bytes(memoryview(buf)[c.byte_start:c.byte_start + c.byte_length])))
        src = torch.frombuffer(raw, dtype=dtype) if raw else torch.empty(0, dtype=dtype)
    else:
        src = torch.frombuffer(buf, dtype=dtype, offset=c.byte_start, count=c.npos)
    if device is not None and src.device != device:
        src = src.to(device, non_blocking=False)
    return src


def copy_into(buf: bytearray | memoryview, c: Copy, dest: Destination) -> None:
    """Copy every region of ``c`` from the fetched bytes into ``dest`` (cast if dtypes differ)."""
    src = _source(buf, c, dest.tensor.device)
    with torch.no_grad():
        for offsets, sizes in c.regions:
            rel = sum(o * s for o, s in zip(offsets, c.strides)) - c.base - c.pos0
            view = src.as_strided(sizes, c.strides, src.storage_offset() + rel)
            dest.view(offsets, sizes).copy_(view)


def decode_object(encoding: str, data: bytes, name: str) -> object:
    """A non-tensor value from its stored bytes (``torch``: torch.save, as DCP writes them)."""
    if encoding == "torch":
        return torch.load(io.BytesIO(data), weights_only=False)
    if encoding == "pickle":
        return pickle.loads(data)
    raise ValueError(f"object {name!r}: unknown encoding {encoding!r}")
