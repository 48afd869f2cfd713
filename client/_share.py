"""Replicated regions read once per host, then passed along between its ranks.

Several ranks of one host often load the very same region: a plain (DDP-replicated) tensor, or the
shard of a DTensor that is ``Replicate`` over some mesh dimension (the data-parallel copies of a TP
shard). Over HTTP, or from an object store behind the service, each of them would fetch it. Here
each such region is read by one rank of the host, chosen to balance bytes (largest region first,
to the rank with the fewest bytes so far), and sent to the others with ``torch.distributed``
point-to-point calls.

Call order inside ``load`` (every rank, collectively, like the load itself):

1. :func:`share_plan`: one ``all_gather_object`` of (host, whether this rank reads the service's
   files directly, the regions it needs). Hosts whose ranks all read directly are left alone:
   the page cache already reads each byte from the disk once. Returns who reads what;
2. each rank drops the regions another rank reads for it, and loads the rest;
3. :func:`exchange`: the readers send, the others receive, in one global order (every rank walks
   the same list, so the earliest unfinished transfer always has both ends ready: no deadlock).

:func:`assign_readers` is pure and holds the policy.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass, field
from typing import Hashable, Mapping, Sequence

import torch

from ckptd_schemas import CkptdError

from ._dist import cpu_group

__all__ = ["Sharing", "agree", "assign_readers", "exchange", "region_key", "share_plan"]

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

    transfers: list[tuple[Key, int, int]] = field(default_factory=list)  # (region, src, dst), global order
    skip: set = field(default_factory=set)  # regions another rank reads for this one

    @property
    def empty(self) -> bool:
        return not self.transfers


def assign_readers(wants: Sequence[Mapping[Key, int]], hosts: Sequence[str],
                   shared_hosts: set[str]) -> list[tuple[Key, int, list[int]]]:
    """(region, reader, receivers) for every region that two or more ranks of a host in
    ``shared_hosts`` need; ``wants[r]`` maps rank r's regions to their bytes. Deterministic."""
    out: list[tuple[Key, int, list[int]]] = []
    for host in sorted(shared_hosts):
        ranks = [r for r, h in enumerate(hosts) if h == host]
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


def share_plan(regions: Mapping[Key, int], direct: bool, *, host: str | None = None) -> Sharing:
    """Collective: agree on who reads each region shared within a host (see the module docstring)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return Sharing()
    me = dist.get_rank()
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (host or socket.gethostname(), direct, dict(regions)), group=cpu_group())
    hosts = [g[0] for g in gathered]
    shared_hosts = {h for h in hosts if not all(g[1] for g in gathered if g[0] == h)}
    sharing = Sharing()
    for k, reader, receivers in assign_readers([g[2] for g in gathered], hosts, shared_hosts):
        for dst in receivers:
            sharing.transfers.append((k, reader, dst))
        if me in receivers:
            sharing.skip.add(k)
    return sharing


def exchange(sharing: Sharing, tensors: Mapping[Key, torch.Tensor]) -> int:
    """Send what this rank read for others and receive what they read for it; every rank walks the
    same ordered list. Returns the bytes received."""
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
            dist.send(raw, dst, group=cpu_group())
        else:
            dist.recv(raw, src, group=cpu_group())
            if buf is not t:
                t.copy_(buf)
            got += raw.numel()
    return got


def agree(err: BaseException | None) -> None:
    """Collective: when any rank failed, raise on every rank (a rank's own error where it has one),
    so that no rank waits for a transfer from a rank that stopped."""
    import torch.distributed as dist

    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, None if err is None else f"{type(err).__name__}: {err}", group=cpu_group())
    failed = [(r, m) for r, m in enumerate(gathered) if m is not None]
    if not failed:
        return
    if err is not None:
        raise err
    r, msg = failed[0]
    raise CkptdError(f"load failed on rank {r} ({msg}); rank {dist.get_rank()} stops as well", rank=r)
