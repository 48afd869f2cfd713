"""The manifest: one global, self-validating description of a checkpoint.

A manifest is built by the service when every rank's index has arrived
(``ckptd.store.merge``), written once, and named by digest in the
``COMMITTED`` marker. Models validate at construction: a chunk outside its
tensor's shape, a location outside its file or a malformed name is refused
with the tensor, rank and file named. Whole-tensor tiling (every element
exactly once) needs all chunks at once and lives in
:func:`ckptd_schemas.geometry.check_tiling`.
"""

from __future__ import annotations

from datetime import datetime
from math import prod
from operator import add, le
from typing import Annotated, Literal, Union

import xxhash
from pydantic import (
    Field, JsonValue, PrivateAttr, SerializerFunctionWrapHandler, ValidationInfo,
    field_validator, model_serializer, model_validator,
)

from .chunks import HEX64, BoxChunk, Chunk, FileName, FlatChunk, Location, NonNeg, _Model
from .chunkindex import ChunkIndex
from .chunktable import ChunkColumns, check_columns, columns_of
from .dtypes import ITEMSIZE, DType, itemsize
from .errors import CorruptCheckpoint

__all__ = [
    "FORMAT_VERSION",
    "BoxChunk",
    "Chunk",
    "ChunkColumns",
    "FileEntry",
    "FlatChunk",
    "Location",
    "Manifest",
    "ObjectEntry",
    "ParamGroup",
    "RankInfo",
    "TensorEntry",
    "Topology",
]

FORMAT_VERSION = 2  # chunks stored as columns (ckptd_schemas.chunktable)
Fqn = Annotated[str, Field(min_length=1, max_length=1024, pattern=r"^[^\x00]+$")]


class TensorEntry(_Model):
    """A tensor's global description and the chunks that hold it.

    The chunks are stored as columns (``table``, see :mod:`ckptd_schemas.chunktable`);
    ``chunks`` gives them as objects, built on first use. Constructing with
    ``chunks=[...]`` (in code, or a rank index that lists its chunks as objects)
    converts to columns.
    """

    name: Fqn
    shape: list[NonNeg]
    dtype: DType
    group: str = Field(description="state group, the first component of the name (model, optim, ...)")
    table: ChunkColumns | None = Field(default=None, description="the chunks, one column per field, with a rank column")
    chunks_in: list[Chunk] | None = Field(default=None, alias="chunks", exclude=True, description=(
        "input only: the chunks as a list of objects, converted to table"))
    digest: Annotated[str, Field(pattern=HEX64)] | None = Field(
        default=None, description="layout-independent digest of the tensor's row-major bytes: XXH3-64 of the "
        "XXH3-64 values of its 64 KiB blocks (ckptd_schemas.digest)"
    )
    placement: str | None = Field(default=None, description="source layout hint, e.g. DTensor placements")
    _chunks: list[Chunk] | None = PrivateAttr(default=None)
    _index: ChunkIndex | None = PrivateAttr(default=None)

    @field_validator("dtype", mode="before")
    @classmethod
    def _known_dtype(cls, v: object, info: ValidationInfo) -> object:
        if isinstance(v, str) and v not in ITEMSIZE:  # name the tensor; other types fail the Literal check
            raise ValueError(f"tensor {info.data.get('name')!r}: unknown dtype {v!r} (known: {', '.join(ITEMSIZE)})")
        return v

    @field_validator("table")
    @classmethod
    def _chunks_inside(cls, table: ChunkColumns | None, info: ValidationInfo) -> ChunkColumns | None:
        # A field check, not a model one: it runs when a tensor is parsed or built, not again when an
        # existing entry is put into a manifest (the merge builds 500 entries of 1,024 chunks each).
        name, shape, dtype = (info.data.get(k) for k in ("name", "shape", "dtype"))
        if table is None:
            return table
        if table.rank is None or table.tensor is not None:
            raise ValueError(f"tensor {name!r}: the chunk table needs a rank column (and no tensor column)")
        if name is not None and shape is not None and dtype is not None:  # else their own errors are reported
            check_columns(name, shape, dtype, itemsize(dtype), table)
        return table

    @model_validator(mode="after")
    def _one_table(self) -> "TensorEntry":
        # After, not before: a before validator would make pydantic build every manifest's tensors
        # as Python dicts first. Cheap when the entry already has its table.
        if self.chunks_in is None:
            if self.table is None:
                raise ValueError(f"tensor {self.name!r}: needs its chunks (table)")
            return self
        if self.table is not None:
            raise ValueError(f"tensor {self.name!r}: give chunks or table, not both")
        table = ChunkColumns(**columns_of(self.chunks_in, self.dtype, name=self.name))
        check_columns(self.name, self.shape, self.dtype, itemsize(self.dtype), table)
        self.__dict__.update(table=table, chunks_in=None)
        return self

    @property
    def chunks(self) -> list[Chunk]:
        """The chunks as objects, in table order (built once; do not mutate)."""
        if self._chunks is None:
            self._chunks = self.table.materialize(itemsize(self.dtype))
        return self._chunks

    @property
    def index(self) -> ChunkIndex:
        """The chunks' interval index (:mod:`ckptd_schemas.chunkindex`), built on first use, kept with
        the entry (a manifest cached by digest keeps it for every read plan of that checkpoint)."""
        private = self.__pydantic_private__  # directly: a read plan asks once per region
        index = private["_index"]
        if index is None:
            index = private["_index"] = ChunkIndex(self.shape, self.table)
        return index

    def model_copy(self, *, update: dict | None = None, deep: bool = False) -> "TensorEntry":
        """As pydantic's, and ``update={"chunks": [...]}`` replaces the table."""
        if update and "chunks" in update:
            update = dict(update)
            dtype = update.get("dtype", self.dtype)
            cols = columns_of(update.pop("chunks"), dtype, name=self.name)
            update["table"] = ChunkColumns(**cols)
        out = super().model_copy(update=update, deep=deep)
        out._chunks = out._index = None
        return out

    def __eq__(self, other: object) -> bool:  # fields only: the chunk cache is not part of the value
        return type(other) is type(self) and self.__dict__ == other.__dict__  # type: ignore[union-attr]

    __hash__ = None  # type: ignore[assignment]


class ObjectEntry(_Model):
    """Non-tensor state: JSON inline, or torch.save bytes in a data file."""

    name: Fqn
    rank: NonNeg | None = Field(default=None, description="None when every rank saved the same value")
    encoding: Literal["json", "torch", "pickle"] = Field(
        description="json: inline value; torch: torch.save bytes (as DCP writes them); pickle: pickle bytes")
    value: JsonValue = None
    location: Location | None = None

    @model_validator(mode="after")
    def _one_home(self) -> "ObjectEntry":
        if (self.encoding != "json") != (self.location is not None):
            raise ValueError(f"object {self.name!r}: {self.encoding} objects need a location, json objects an "
                             f"inline value")
        return self

    def value_key(self) -> tuple:
        """What two entries of one object share when they hold the same value (a load restores the one
        value that every rank which saved it saved: ``ckptd_client._load``, ``loadtree``)."""
        return (self.encoding, repr(self.value)) if self.location is None else (self.encoding, self.location.xxh3)

    def checked(self, data: bytes, ref: str) -> bytes:
        """``data``, this object's stored bytes, once they hash to the digest its location records; else
        :class:`~ckptd_schemas.CorruptCheckpoint` naming the object and its file. Every reader of a stored
        object asks (a load, the DCP reader, a conversion, an export)."""
        loc = self.location
        assert loc is not None
        if xxhash.xxh3_64_hexdigest(data) != loc.xxh3:
            raise CorruptCheckpoint(f"object {self.name!r} of {ref} in file {loc.file!r} fails its checksum",
                                    file=loc.file, object=self.name)
        return data


class ParamGroup(_Model):
    """One optimizer param group: its parameters and hyper-parameters."""

    optimizer: str = Field(description="state-dict key of the optimizer state (e.g. 'optim')")
    index: NonNeg
    params: list[Union[str, int]]
    hyperparams: dict[str, JsonValue]


class RankInfo(_Model):
    rank: NonNeg
    coords: dict[str, NonNeg] = Field(default_factory=dict)


class Topology(_Model):
    """World size, named mesh dimensions, each rank's coordinates, per-group layouts."""

    world_size: Annotated[int, Field(ge=1, le=1 << 20)]
    mesh: dict[str, Annotated[int, Field(ge=1)]] = Field(default_factory=dict)
    ranks: list[RankInfo] = Field(default_factory=list)
    layouts: dict[str, str] = Field(default_factory=dict, description="state group -> layout spec")

    @model_validator(mode="after")
    def _consistent(self) -> "Topology":
        if self.mesh and prod(self.mesh.values()) != self.world_size:
            raise ValueError(f"mesh {self.mesh} has {prod(self.mesh.values())} ranks, world size is {self.world_size}")
        seen = [r.rank for r in self.ranks]
        if len(set(seen)) != len(seen) or any(r >= self.world_size for r in seen):
            raise ValueError(f"rank list {seen} is not a set of distinct ranks below {self.world_size}")
        return self


class FileEntry(_Model):
    """A data file: size, whole-file digest, and per-block digests for ranged reads.

    ``linked`` names the earlier checkpoint's file (``NAME/FILE``, same run) whose stored bytes this file is,
    linked rather than written (incremental saves); it stays in the manifest, so that what a save
    wrote and what it reused can be told apart."""

    size: NonNeg
    xxh3: Annotated[str, Field(pattern=HEX64)]
    block_size: Annotated[int, Field(ge=4096)]
    blocks: list[Annotated[str, Field(pattern=HEX64)]]
    linked: Annotated[str, Field(max_length=260, pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*$")] \
        | None = None

    @model_serializer(mode="wrap")
    def _omit_unset(self, handler: SerializerFunctionWrapHandler) -> dict:
        out = handler(self)
        if out.get("linked", 0) is None:  # absent, not null: the same bytes as without the field
            del out["linked"]
        return out

    @model_validator(mode="after")
    def _block_count(self) -> "FileEntry":
        want = -(-self.size // self.block_size)
        if len(self.blocks) != want:
            raise ValueError(f"{len(self.blocks)} block digests for {self.size} bytes in blocks of {self.block_size}")
        return self


class Manifest(_Model):
    """The global description of one committed checkpoint (docs/design.md §1)."""

    format_version: Literal[2] = FORMAT_VERSION
    run: str
    name: str
    step: NonNeg | None = None
    session: str
    created_at: datetime
    derived_from: str | None = None
    #: ``RUN/NAME`` of the checkpoint of another run this run started from (fine-tuning, a resumed job
    #: under a new run name): lineage across runs, which retention protects (docs/retention.md)
    parent: str | None = None
    topology: Topology
    tensors: list[TensorEntry]
    objects: list[ObjectEntry] = Field(default_factory=list)
    param_groups: list[ParamGroup] = Field(default_factory=list)
    files: dict[FileName, FileEntry]
    _by_name: dict[str, TensorEntry] | None = PrivateAttr(default=None)

    @field_validator("tensors")
    @classmethod
    def _unique_tensors(cls, v: list[TensorEntry]) -> list[TensorEntry]:
        names = [t.name for t in v]
        if len(set(names)) != len(names):
            dup = sorted({n for n in names if names.count(n) > 1})
            raise ValueError(f"tensor names appear more than once: {dup[:5]}")
        return v

    @model_validator(mode="after")
    def _locations_inside_files(self) -> "Manifest":
        sizes = {name: f.size for name, f in self.files.items()}
        for t in self.tensors:  # whole-column passes; the per-chunk message only on failure
            tab = t.table
            limit = list(map(sizes.get, tab.file))
            if None in limit or not all(map(le, map(add, tab.offset, tab.length), limit)):
                self._check_locations([(f"tensor {t.name!r}", c.location) for c in t.chunks])
        self._check_locations([(f"object {o.name!r}", o.location) for o in self.objects if o.location is not None])
        return self

    def _check_locations(self, locs: list[tuple[str, Location]]) -> None:
        for what, loc in locs:
            f = self.files.get(loc.file)
            if f is None:
                raise ValueError(f"{what} refers to file {loc.file!r}, which is not in the manifest")
            if loc.offset + loc.length > f.size:
                raise ValueError(
                    f"{what}: bytes [{loc.offset}, {loc.offset + loc.length}) exceed file {loc.file!r} of {f.size} bytes"
                )

    def __eq__(self, other: object) -> bool:  # fields only: the name lookup table is not part of the value
        return type(other) is type(self) and self.__dict__ == other.__dict__  # type: ignore[union-attr]

    __hash__ = None  # type: ignore[assignment]

    @property
    def ref(self) -> str:
        return f"{self.run}/{self.name}"

    def tensor(self, name: str) -> TensorEntry | None:
        private = self.__pydantic_private__  # directly: pydantic's attribute fallback costs ~5 us a call
        by_name = private["_by_name"]
        if by_name is None:
            by_name = private["_by_name"] = {t.name: t for t in self.tensors}
        return by_name.get(name)

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files.values())

    @property
    def linked_bytes(self) -> int:
        """Bytes of files held from earlier checkpoints of the run (incremental saves), not written."""
        return sum(f.size for f in self.files.values() if f.linked is not None)

    @property
    def unchanged_bytes(self) -> int:
        """Bytes of the chunks and stored objects placed in linked files (incremental saves): what the
        save reused unchanged, as opposed to :attr:`linked_bytes`, the linked files' whole sizes (the
        rest of a linked file is bytes no entry of this checkpoint refers to). What ``ckptd show`` and
        the web view report as unchanged."""
        linked = {name for name, f in self.files.items() if f.linked is not None}
        if not linked:
            return 0
        n = 0
        for t in self.tensors:
            tab = t.table
            if not linked.isdisjoint(tab.file):
                n += sum(length for f, length in zip(tab.file, tab.length) if f in linked)
        return n + sum(o.location.length for o in self.objects if o.location is not None and o.location.file in linked)
