"""Replicated regions read once per host, then passed along between its ranks.

Several ranks of one host often load the very same region: a plain (DDP-replicated) tensor, or the
shard of a DTensor that is ``Replicate`` over some mesh dimension (the data-parallel copies of a TP
shard). Over HTTP, or from an object store behind the service, each of them would fetch it. Here
each such region is read by one rank of the host, chosen to balance bytes (largest region first,
to the rank with the fewest bytes so far), and sent to the others with ``torch.distributed``
point-to-point calls.

Call order inside ``load`` (every rank, collectively, like the load itself):

1. :func:`host_group`, once per process group: this host's ranks and a group over them. From the
   launcher (``torchrun``'s ``LOCAL_RANK`` and ``LOCAL_WORLD_SIZE``: ranks ``[rank - LOCAL_RANK,
   + LOCAL_WORLD_SIZE)``) when every rank's values fit that layout, checked by one all-reduce of three
   integers; else by one ``all_gather_object`` of host names. The group is made among its own ranks
   only (``use_local_synchronization``): nothing here grows with the world size after that;
2. :func:`share_plan`: one ``all_gather_object`` within the host of (host name, whether this rank
   reads the service's files directly, the regions it needs). Hosts whose ranks all read directly
   are left alone: the page cache already reads each byte from the disk once. Returns who reads what.
   A load calls it (and step 1) only when its key agreement (``_coverage``) found some rank that
   does not read directly; where every rank does, nothing here runs;
3. each rank drops the regions another rank reads for it, and loads the rest; ``_dist.raise_on_all``
   (within the host) makes every rank of the host raise when one of them failed;
4. :func:`exchange`: the readers send, the others receive, in one order within the host (every rank
   walks the same list, so the earliest unfinished transfer always has both ends ready: no deadlock).

:func:`assign_readers` is pure and holds the policy.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass, field
from typing import Hashable, Mapping, Sequence

import torch

from ._dist import cpu_backend, cpu_group, reduce_max

__all__ = ["Sharing", "assign_readers", "exchange", "host_group", "launcher_ranks", "region_key", "share_plan"]

Key = Hashable


def region_key(fqn: str, box: tuple[Sequence[int], Sequence[int]] | None, flat: tuple[int, int] | None,
               dtype: torch.dtype) -> Key:
    """Two ranks need the same bytes iff their keys are equal."""
    if flat is not None:
        return (fqn, "flat", flat[0], flat[1], str(dtype))
    assert box is not None
    return (fqn, "box", tuple(box[0]), tuple(box[1]), str(dtype))


@dataclass
class Sharing:
    """One rank's part of the exchange: regions it reads for others, and regions it receives."""

    transfers: list[tuple[Key, int, int]] = field(default_factory=list)  # (region, src, dst): the host's order
    skip: set = field(default_factory=set)  # regions another rank reads for this one
    group: object = None  # the host's group (None: the default group)

    @property
    def empty(self) -> bool:
        return not self.transfers


def assign_readers(wants: Sequence[Mapping[Key, int]], hosts: Sequence[str],
                   shared_hosts: set[str]) -> list[tuple[Key, int, list[int]]]:
    """(region, reader, receivers) for every region that two or more ranks of a host in
    ``shared_hosts`` need; ``wants[r]`` maps rank r's regions to their bytes. Deterministic, and
    linear in the regions wanted."""
    by_host: dict[str, list[int]] = {}
    for r, h in enumerate(hosts):
        if h in shared_hosts:
            by_host.setdefault(h, []).append(r)
    out: list[tuple[Key, int, list[int]]] = []
    for host in sorted(by_host):
        ranks = by_host[host]
        holders: dict[Key, list[int]] = {}
        for r in ranks:
            for k in wants[r]:
                holders.setdefault(k, []).append(r)
        multi = [(wants[rs[0]][k], repr(k), k, rs) for k, rs in holders.items() if len(rs) > 1]
        load = {r: 0 for r in ranks}
        for nbytes, _, k, rs in sorted(multi, key=lambda x: (-x[0], x[1])):  # largest first (LPT)
            reader = min(rs, key=lambda r: (load[r], r))
            load[reader] += nbytes
            out.append((k, reader, [r for r in rs if r != reader]))
    return out


_hosts: dict[int, tuple[object, list[int]]] = {}  # id of the default group -> (this host's group, its ranks)


def launcher_ranks(rank: int, world: int, env: Mapping[str, str]) -> list[int] | None:
    """This host's ranks as the launcher lays them out (``torchrun``: ``LOCAL_RANK`` within blocks of
    ``LOCAL_WORLD_SIZE``), or None when ``env`` does not say or does not fit that layout."""
    try:
        size, local = int(env["LOCAL_WORLD_SIZE"]), int(env["LOCAL_RANK"])
    except (KeyError, ValueError):
        return None
    if size < 1 or world % size or local != rank % size:
        return None
    return list(range(rank - local, rank - local + size))


def host_group() -> tuple[object, list[int]]:
    """Collective over the world the first time per process group (see the module docstring): a
    group over this host's ranks (None: the default group) and those ranks, sorted."""
    import torch.distributed as dist

    key = id(dist.group.WORLD)
    if key not in _hosts:
        rank, world = dist.get_rank(), dist.get_world_size()
        ranks = launcher_ranks(rank, world, os.environ)
        n = len(ranks) if ranks is not None else 0
        bad, most, least = reduce_max([int(ranks is None), n, -n])
        if bad or most != -least:  # some rank's launcher says nothing, or hosts of other sizes
            names: list = [None] * world
            dist.all_gather_object(names, socket.gethostname(), group=cpu_group())
            ranks = [r for r, h in enumerate(names) if h == names[rank]]
        assert ranks is not None
        if len(ranks) == world:
            group = cpu_group()
        elif len(ranks) == 1:
            group = None  # alone on its host: shares nothing
        else:
            group = dist.new_group(ranks, backend=cpu_backend(), use_local_synchronization=True)
        _hosts[key] = (group, ranks)
    return _hosts[key]


def share_plan(regions: Mapping[Key, int], direct: bool, *, host: str | None = None) -> Sharing:
    """Collective: agree on who reads each region shared within a host (see the module docstring)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return Sharing()
    group, ranks = host_group()
    if len(ranks) < 2:
        return Sharing()
    me = dist.get_rank()
    gathered: list = [None] * len(ranks)
    dist.all_gather_object(gathered, (host or socket.gethostname(), direct, dict(regions)), group=group)
    hosts = [g[0] for g in gathered]
    shared_hosts = {h for h in hosts if not all(g[1] for g in gathered if g[0] == h)}
    sharing = Sharing(group=group)
    for k, reader, receivers in assign_readers([g[2] for g in gathered], hosts, shared_hosts):
        for dst in receivers:
            sharing.transfers.append((k, ranks[reader], ranks[dst]))
        if me in (ranks[r] for r in receivers):
            sharing.skip.add(k)
    return sharing


def exchange(sharing: Sharing, tensors: Mapping[Key, torch.Tensor]) -> int:
    """Send what this rank read for others and receive what they read for it; every rank of the host
    walks the same ordered list. Returns the bytes received."""
    import torch.distributed as dist

    me, got = dist.get_rank(), 0
    for k, src, dst in sharing.transfers:
        if me not in (src, dst):
            continue
        t = tensors[k]
        buf = t if t.is_contiguous() and t.device.type == "cpu" else torch.empty(t.shape, dtype=t.dtype)
        raw = buf.reshape(-1).view(torch.uint8)  # bytes: every dtype travels, whatever the backend supports
        if me == src:
            if buf is not t:
                buf.copy_(t)
            dist.send(raw, dst, group=sharing.group)
        else:
            dist.recv(raw, src, group=sharing.group)
            if buf is not t:
                t.copy_(buf)
            got += raw.numel()
    return got
