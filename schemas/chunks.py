"""The chunk models: where one piece of a tensor is stored (a box or a flat range, and its location).

Shared by the manifest (``ckptd_schemas.manifest``) and the column form of chunks
(``ckptd_schemas.chunktable``), which turns rows into these objects and back. Pure: no I/O, no torch.
"""

from __future__ import annotations

from math import prod
from typing import Annotated, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, model_validator

from .geometry import Box, Region
from .names import FILE_RE

__all__ = ["HEX64", "BoxChunk", "Chunk", "Codec", "FileName", "FlatChunk", "Hex64", "Location", "NonNeg"]

HEX64 = r"^[0-9a-f]{16}$"
NonNeg = Annotated[int, Field(ge=0, le=2**62)]
FileName = Annotated[str, Field(pattern=FILE_RE.pattern.join("^$"))]
Hex64 = Annotated[str, Field(pattern=HEX64)]
Codec = Literal["raw", "zstd", "blosc2"]


class _Model(BaseModel):
    # defer_build: validators are built on first use, so a process that reads one manifest (`ckptd verify`)
    # does not build every model at import (a quarter of the CLI's start-up).
    model_config = ConfigDict(extra="forbid", frozen=True, defer_build=True)


class Location(_Model):
    """Where a chunk's bytes are: a byte range of one data file of the checkpoint."""

    file: FileName
    offset: NonNeg
    length: NonNeg = Field(description="stored (possibly compressed) byte length")
    codec: Codec = Field("raw", description="raw; zstd (zstd-1); blosc2 (a Blosc2 chunk: byte planes, then zstd-1)")
    raw_length: NonNeg = Field(description="decoded byte length: numel * itemsize")
    xxh3: Annotated[str, Field(pattern=HEX64)] = Field(description="XXH3-64 of the stored bytes")

    @model_validator(mode="after")
    def _raw_matches(self) -> "Location":
        if self.codec == "raw" and self.length != self.raw_length:
            raise ValueError(f"raw chunk in file {self.file!r}: length {self.length} != raw_length {self.raw_length}")
        return self


class BoxChunk(_Model):
    """A piece of a tensor given by per-dimension offsets and sizes (DTensor shards, TP slices)."""

    kind: Literal["box"] = "box"
    rank: NonNeg = Field(description="rank that wrote the chunk")
    offsets: list[NonNeg]
    sizes: list[NonNeg]
    location: Location

    @property
    def region(self) -> Region:
        return Region(box=Box(tuple(self.offsets), tuple(self.sizes)))

    @property
    def numel(self) -> int:
        return prod(self.sizes)


class FlatChunk(_Model):
    """Elements ``[start, start + length)`` of the tensor's row-major flattening (ZeRO, FSDP1)."""

    kind: Literal["flat"] = "flat"
    rank: NonNeg
    start: NonNeg
    length: NonNeg
    location: Location

    @property
    def region(self) -> Region:
        return Region(flat=(self.start, self.length))

    @property
    def numel(self) -> int:
        return self.length


Chunk = Annotated[Union[BoxChunk, FlatChunk], Field(discriminator="kind")]
