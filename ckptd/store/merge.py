"""Merge the ranks' indexes into one validated manifest (pure, no I/O).

Called once every expected rank has finished. The result is deterministic
(sorted, timestamps taken from the session), so two replicas committing the
same session concurrently write byte-identical manifests.
"""

from __future__ import annotations

from collections import defaultdict
from datetime import datetime
from typing import Sequence

from pydantic import ValidationError

from ckptd_schemas import (
    FileEntry, InvalidIndex, Manifest, ObjectEntry, ParamGroup, RankIndex, RankInfo, TensorEntry,
    Topology, check_tiling,
)

__all__ = ["merge_indexes"]


def _chunk_key(c) -> tuple:
    return (c.rank, c.kind, tuple(getattr(c, "offsets", ())) or (getattr(c, "start", 0),))


def merge_indexes(
    *,
    run: str,
    name: str,
    session: str,
    step: int | None,
    created_at: datetime,
    world_size: int,
    indexes: Sequence[RankIndex],
    files: dict[str, FileEntry],
    derived_from: str | None = None,
) -> Manifest:
    """Validate and merge; raise a typed error naming the tensor and ranks at fault."""
    by_rank = {ix.rank: ix for ix in indexes}
    missing = sorted(set(range(world_size)) - set(by_rank))
    if missing:
        raise InvalidIndex(f"{run}/{name}: no index from ranks {missing[:16]}", ranks=missing[:64])
    ranks = [by_rank[r] for r in range(world_size)]
    mesh = ranks[0].mesh
    for ix in ranks[1:]:
        if ix.mesh != mesh:
            raise InvalidIndex(
                f"{run}/{name}: rank {ix.rank} reports mesh {ix.mesh}, rank 0 reports {mesh}", ranks=[0, ix.rank])

    owners: dict[str, int] = {}
    for ix in ranks:
        for f in ix.files:
            if f in owners:
                raise InvalidIndex(f"{run}/{name}: file {f!r} claimed by ranks {owners[f]} and {ix.rank}",
                                   file=f, ranks=[owners[f], ix.rank])
            owners[f] = ix.rank

    tensors = _merge_tensors(run, name, ranks, owners)
    objects = _merge_objects(ranks, world_size)
    groups = _merge_param_groups(run, name, ranks)
    layouts: dict[str, str] = {}
    for ix in ranks:
        for k, v in ix.layouts.items():
            layouts.setdefault(k, v)
    try:
        topology = Topology(world_size=world_size, mesh=mesh,
                            ranks=[RankInfo(rank=ix.rank, coords=ix.coords) for ix in ranks], layouts=layouts)
        return Manifest(
            run=run, name=name, step=step, session=session, created_at=created_at, derived_from=derived_from,
            topology=topology, tensors=tensors, objects=objects, param_groups=groups,
            files={f: files[f] for f in sorted(owners)},
        )
    except ValidationError as e:
        raise InvalidIndex(f"{run}/{name}: merged manifest is invalid: {e.errors()[0]['msg']}") from e


def _merge_tensors(run: str, name: str, ranks: Sequence[RankIndex], owners: dict[str, int]) -> list[TensorEntry]:
    grouped: dict[str, list[tuple[int, TensorEntry]]] = defaultdict(list)
    for ix in ranks:
        for t in ix.tensors:
            grouped[t.name].append((ix.rank, t))
    out = []
    for tname in grouped:  # first-seen order: rank 0's state-dict order (layouts concatenate in it)
        entries = grouped[tname]
        r0, first = entries[0]
        chunks = []
        for r, t in entries:
            if t.shape != first.shape or t.dtype != first.dtype:
                raise InvalidIndex(
                    f"tensor {tname!r}: rank {r0} saved shape {first.shape} {first.dtype}, "
                    f"rank {r} saved shape {t.shape} {t.dtype}", tensor=tname, ranks=[r0, r])
            if t.digest is not None and first.digest is not None and t.digest != first.digest:
                raise InvalidIndex(f"tensor {tname!r}: ranks {r0} and {r} declare different digests",
                                   tensor=tname, ranks=[r0, r])
            for c in t.chunks:
                if c.rank != r:
                    raise InvalidIndex(f"tensor {tname!r}: rank {r} sent a chunk labelled rank {c.rank}",
                                       tensor=tname, ranks=[r])
                if owners.get(c.location.file) != r:
                    raise InvalidIndex(
                        f"tensor {tname!r}: rank {r} points at file {c.location.file!r}, which it did not upload",
                        tensor=tname, ranks=[r], file=c.location.file)
                chunks.append(c)
        chunks.sort(key=_chunk_key)
        check_tiling(tname, first.shape, [(c.region, c.rank, c.location.xxh3) for c in chunks])
        digest = next((t.digest for _, t in entries if t.digest is not None), None)
        # Every chunk was validated inside its rank's entry, with this shape and dtype (checked above),
        # and the tiling just now: construct without validating each chunk a second time.
        out.append(TensorEntry.model_construct(name=tname, shape=first.shape, dtype=first.dtype, group=first.group,
                                               chunks=chunks, placement=first.placement, digest=digest))
    return out


def _object_identity(o: ObjectEntry) -> tuple:
    return (o.encoding, repr(o.value)) if o.location is None else (o.encoding, o.location.xxh3)


def _merge_objects(ranks: Sequence[RankIndex], world_size: int) -> list[ObjectEntry]:
    """Objects a rank sends with ``rank=None`` are global (kept once). Per-rank objects that
    every rank saved with identical content become one global entry; others stay per rank."""
    global_: dict[str, ObjectEntry] = {}
    grouped: dict[str, list[ObjectEntry]] = defaultdict(list)
    for ix in ranks:
        for o in ix.objects:
            if o.rank is None:
                global_.setdefault(o.name, o)
            else:
                grouped[o.name].append(o.model_copy(update={"rank": ix.rank}))
    out: list[ObjectEntry] = list(global_.values())
    for oname in grouped:
        if oname in global_:
            continue
        entries = sorted(grouped[oname], key=lambda o: o.rank)
        same = len({_object_identity(o) for o in entries}) == 1
        if same and len(entries) == world_size:
            out.append(entries[0].model_copy(update={"rank": None}))
        else:
            out.extend(entries)
    return sorted(out, key=lambda o: (o.name, -1 if o.rank is None else o.rank))


def _merge_param_groups(run: str, name: str, ranks: Sequence[RankIndex]) -> list[ParamGroup]:
    chosen: dict[tuple[str, int], tuple[int, ParamGroup]] = {}
    for ix in ranks:
        for g in ix.param_groups:
            key = (g.optimizer, g.index)
            prev = chosen.get(key)
            if prev is None:
                chosen[key] = (ix.rank, g)
            elif prev[1] != g:
                raise InvalidIndex(
                    f"{run}/{name}: param group {g.index} of {g.optimizer!r} differs between ranks "
                    f"{prev[0]} and {ix.rank}", ranks=[prev[0], ix.rank])
    return [chosen[k][1] for k in sorted(chosen)]
