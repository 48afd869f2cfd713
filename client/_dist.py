"""What the client needs from torch.distributed: rank, world size, one broadcast."""

from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["any_rank", "barrier", "broadcast_str", "distributed", "rank_and_world"]


def _active() -> bool:
    return dist.is_available() and dist.is_initialized()


def distributed() -> bool:
    """torch.distributed is initialised with more than one rank."""
    return _active() and dist.get_world_size() > 1


def rank_and_world() -> tuple[int, int]:
    if _active():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def broadcast_str(value: str | None) -> str:
    """Rank 0's ``value`` on every rank (identity without torch.distributed)."""
    if not _active() or dist.get_world_size() == 1:
        assert value is not None
        return value
    box = [value if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)
    return str(box[0])


def barrier() -> None:
    if _active() and dist.get_world_size() > 1:
        dist.barrier()


def any_rank(flag: bool) -> bool:
    """True on every rank iff ``flag`` is true on some rank (identity without torch.distributed)."""
    if not _active() or dist.get_world_size() == 1:
        return flag
    t = torch.tensor([1 if flag else 0], dtype=torch.int32)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())
