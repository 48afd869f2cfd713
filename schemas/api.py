"""Request and response bodies of the HTTP API (``/v1``)."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from .manifest import ObjectEntry, ParamGroup, TensorEntry
from .names import SESSION_RE

__all__ = [
    "CheckpointSummary",
    "OpenSession",
    "RankIndex",
    "RunSummary",
    "SessionInfo",
    "SessionStatus",
    "UploadResult",
]

SessionId = Annotated[str, Field(pattern=SESSION_RE.pattern.join("^$"))]


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")


class OpenSession(_Body):
    """Open or join the upload session ``session`` of a ref.

    Every rank of one save attempt sends the same ``session`` (the client's
    rank 0 draws it and broadcasts it), so the call is idempotent across ranks,
    retries and replicas; a new attempt after a crash uses a new id and never
    mixes its ranks with the dead attempt's.
    """

    session: SessionId
    world_size: Annotated[int, Field(ge=1, le=1 << 20)]
    step: Annotated[int, Field(ge=0)] | None = None
    derived_from: str | None = Field(None, max_length=300, description="source ref of a derived checkpoint")


class SessionInfo(_Body):
    run: str
    name: str
    session: str
    world_size: int
    step: int | None = None
    created_at: datetime


class UploadResult(_Body):
    file: str
    size: int
    xxh3: str


class RankIndex(_Body):
    """What one rank wrote: its chunks (pointing into files it uploaded) and objects."""

    rank: Annotated[int, Field(ge=0)]
    world_size: Annotated[int, Field(ge=1)]
    coords: dict[str, int] = Field(default_factory=dict)
    mesh: dict[str, int] = Field(default_factory=dict)
    layouts: dict[str, str] = Field(default_factory=dict)
    tensors: list[TensorEntry] = Field(default_factory=list)
    objects: list[ObjectEntry] = Field(default_factory=list)
    param_groups: list[ParamGroup] = Field(default_factory=list)
    files: list[str] = Field(default_factory=list)


class SessionStatus(_Body):
    run: str
    name: str
    session: str
    state: Literal["open", "committed", "failed"]
    world_size: int
    ranks_done: list[int]
    error: dict[str, Any] | None = None
    manifest_xxh3: str | None = None


class CheckpointSummary(_Body):
    run: str
    name: str
    step: int | None
    derived_from: str | None
    session: str
    committed_at: datetime
    manifest_xxh3: str


class RunSummary(_Body):
    run: str
    checkpoints: int
    latest: str | None
