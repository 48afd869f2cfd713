"""Which rank writes each plain tensor of a save: one of the ranks that hold it.

A plain ``torch.Tensor`` is a replica (``torch.distributed.checkpoint``'s rule too): every rank
that holds its key holds the same bytes (DDP weights, a step counter), and it is written once.
Ranks need not hold the same keys (the layers of pipeline stages, per-stage optimizer state), so
the writer of a key is chosen among the ranks that hold it, largest first onto the holder with the
fewest bytes so far (``lpt_assign``), from what all ranks hold.

Call order inside ``save`` (every rank, collectively):

1. :func:`plain_tensors`: this rank's plain tensors (``{key: nbytes}``) and their signature (keys,
   shapes, dtypes, rank, world);
2. :meth:`ReplicaWriters.stale`: whether the cached assignment was made from another signature.
   The flag rides on the save's first all-reduce (``any_ranks``), so a save whose ranks all hold
   what they held last time runs no collective here at all;
3. :meth:`ReplicaWriters.owners`: after a change on any rank, one all-reduce of a fixed size
   (``_dist.check``) says whether every rank holds the same plain tensors (keys and sizes, as a
   digest). When they do (DDP, FSDP's replicated buffers and step) every rank computes the same
   balance over all ranks from what it holds: no rank's cost grows with the world size beyond that
   all-reduce. When they do not (pipeline stages), rank 0 plans, as DCP's coordinator does: it
   gathers each rank's ``{key: nbytes}`` (``gather_object``), balances each key among its holders,
   and scatters to each rank the writers of its own keys (``scatter_object_list``). The result is
   kept until the next change.
"""

from __future__ import annotations

import hashlib
from typing import Mapping

import torch
from torch.distributed.tensor import DTensor

from ckptd_schemas.balance import lpt_assign

from ._dist import check, cpu_group
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
        _, same = check(False, repr(sorted(sizes.items())).encode())
        if same:  # every rank holds the same plain tensors: balance over all of them, each rank alike
            return lpt_assign(list(sizes.items()), world)
        return _coordinated(dict(sizes), rank, world)


def _coordinated(sizes: dict[str, int], rank: int, world: int) -> dict[str, int]:
    """The writers when ranks hold different plain tensors: rank 0 gathers every rank's sizes, balances
    each key among its holders (``lpt_assign``) and scatters to each rank the writers of its own keys."""
    import torch.distributed as dist

    held: list | None = [None] * world if rank == 0 else None
    dist.gather_object(sizes, held, dst=0, group=cpu_group())
    plans: list | None = None
    if held is not None:
        holders: dict[str, list[int]] = {}
        nbytes: dict[str, int] = {}
        for r, their in enumerate(held):
            for k, n in their.items():
                holders.setdefault(k, []).append(r)
                nbytes[k] = max(nbytes.get(k, 0), n)
        owners = lpt_assign(sorted(nbytes.items()), world, holders=holders)
        plans = [{k: owners[k] for k in their} for their in held]
    mine: list = [None]
    dist.scatter_object_list(mine, plans, src=0, group=cpu_group())
    return mine[0]
