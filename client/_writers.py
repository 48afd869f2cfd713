"""Which rank writes each plain tensor of a save: one of the ranks that hold it.

A plain ``torch.Tensor`` is a replica (``torch.distributed.checkpoint``'s rule too): every rank
that holds its key holds the same bytes (DDP weights, a step counter), and it is written once.
Ranks need not hold the same keys (the layers of pipeline stages, per-stage optimizer state), so
the writer of a key is chosen among the ranks that hold it, largest first onto the holder with the
fewest bytes so far (``lpt_assign``), identically on every rank from what all ranks hold.

Call order inside ``save`` (every rank, collectively):

1. :func:`plain_tensors`: this rank's plain tensors (``{key: nbytes}``) and their signature (keys,
   shapes, dtypes, rank, world);
2. :meth:`ReplicaWriters.stale`: whether the cached assignment was made from another signature.
   The flag rides on the save's first all-reduce (``any_ranks``), so a save whose ranks all hold
   what they held last time runs no collective here at all;
3. :meth:`ReplicaWriters.owners`: after a change on any rank, one ``all_gather_object`` of the
   ranks' signatures; when they all name the same keys, shapes and dtypes (DDP) the balance is over
   every rank, else a second ``all_gather_object`` of each rank's ``{key: nbytes}`` and the balance
   is among each key's holders. The result is kept until the next change.
"""

from __future__ import annotations

import hashlib
from typing import Mapping

import torch
from torch.distributed.tensor import DTensor

from ckptd_schemas.balance import lpt_assign

from ._dist import cpu_group
from ._flatten import Flattened
from ._placement import check_savable

__all__ = ["ReplicaWriters", "plain_tensors"]


def plain_tensors(flat: Flattened, rank: int, world: int) -> tuple[dict[str, int], str]:
    """This rank's plain (replicated) tensors as ``{key: nbytes}``, and a digest of their keys,
    shapes and dtypes with ``rank`` and ``world`` (the cache key of :class:`ReplicaWriters`).

    Every tensor leaf is checked first (``check_savable``): one that cannot be saved raises
    ``InvalidRequest`` naming its key here, where ``save`` makes every rank raise together."""
    sizes: dict[str, int] = {}
    h = hashlib.blake2b(f"{rank}/{world}".encode(), digest_size=16)
    for leaf in flat.leaves:  # the save's one flattening (``_flatten.flatten``)
        v = leaf.value
        if leaf.kind == "tensor":
            check_savable(leaf.fqn, v)
        if leaf.kind == "tensor" and isinstance(v, torch.Tensor) and not isinstance(v, DTensor):
            sizes[leaf.fqn] = v.numel() * v.element_size()
            h.update(f"\0{leaf.fqn}\0{tuple(v.shape)}\0{v.dtype}".encode())
    return sizes, h.hexdigest()


class ReplicaWriters:
    """The writers of plain tensors, cached while no rank's plain tensors change (one per client)."""

    def __init__(self) -> None:
        self._signature: str | None = None
        self._owners: dict[str, int] = {}

    def stale(self, signature: str) -> bool:
        """True when the cached assignment was made for another signature (or none was made)."""
        return signature != self._signature

    def owners(self, sizes: Mapping[str, int], signature: str, *, refresh: bool, rank: int,
               world: int) -> dict[str, int]:
        """Collective when ``refresh`` (which must be the same on every rank): ``{key: writer}``."""
        if refresh or self._signature is None:
            self._owners = self._assign(sizes, rank, world)
            self._signature = signature
        return self._owners

    @staticmethod
    def _assign(sizes: Mapping[str, int], rank: int, world: int) -> dict[str, int]:
        if world == 1:
            return {k: 0 for k in sizes}
        import torch.distributed as dist

        keyset = hashlib.blake2b(repr(sorted(sizes.items())).encode(), digest_size=16).hexdigest()
        sets: list = [None] * world
        dist.all_gather_object(sets, keyset, group=cpu_group())
        if len(set(sets)) == 1:  # every rank holds the same plain tensors: balance over all of them
            return lpt_assign(list(sizes.items()), world)
        held: list = [None] * world
        dist.all_gather_object(held, dict(sizes), group=cpu_group())
        holders: dict[str, list[int]] = {}
        nbytes: dict[str, int] = {}
        for r, their in enumerate(held):
            for k, n in their.items():
                holders.setdefault(k, []).append(r)
                nbytes[k] = max(nbytes.get(k, 0), n)
        return lpt_assign(sorted(nbytes.items()), world, holders=holders)
