"""What the client needs from torch.distributed: rank, world size, a few small collectives.

Every collective here moves CPU tensors or pickled objects, so it runs on a group with a CPU
backend: the default group when it has one (gloo, or ``cpu:gloo,cuda:nccl``), else a gloo group
made once for the default group (a trainer that called ``init_process_group("nccl")``), whose
creation is itself collective: the first save or load, which every rank calls, makes it.

:func:`solo` turns all of that off for the calls made inside it, on the thread that makes them: a
trainer that saves from one rank only (Lightning's DDP calls its ``CheckpointIO`` on rank 0 alone)
saves as rank 0 of a world of one, so that no collective waits for ranks that never call.
"""

from __future__ import annotations

import contextlib
from contextvars import ContextVar
from typing import Iterator

import torch
import torch.distributed as dist

__all__ = ["any_rank", "any_ranks", "barrier", "broadcast_str", "cpu_group", "distributed", "rank_and_world", "solo"]

_SOLO: ContextVar[bool] = ContextVar("ckptd_solo", default=False)


@contextlib.contextmanager
def solo() -> Iterator[None]:
    """Saves and loads made inside the block act as one process (rank 0 of 1, no collectives), even
    when torch.distributed is initialised: for state that one rank holds whole and saves alone (DDP's
    replicated weights saved from rank 0), or that each rank loads whole by itself. DTensor and
    ``FlatShard`` state, which other ranks hold parts of, is not for a solo save. Per thread and per
    ``contextvars`` context; the background upload of a save started inside needs no collectives."""
    token = _SOLO.set(True)
    try:
        yield
    finally:
        _SOLO.reset(token)


def _active() -> bool:
    return dist.is_available() and dist.is_initialized() and not _SOLO.get()


_gloo: dict[int, object] = {}  # id of the default group -> a gloo group over the same ranks


def cpu_group() -> object | None:
    """The group for the client's CPU collectives (None: the default group)."""
    if "gloo" in dist.get_backend_config():
        return None
    key = id(dist.group.WORLD)
    if key not in _gloo:
        _gloo[key] = dist.new_group(backend="gloo")
    return _gloo[key]


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
    dist.broadcast_object_list(box, src=0, group=cpu_group())
    return str(box[0])


def barrier() -> None:
    if _active() and dist.get_world_size() > 1:
        dist.barrier()


def any_rank(flag: bool) -> bool:
    """True on every rank iff ``flag`` is true on some rank (identity without torch.distributed)."""
    return any_ranks(flag)[0]


def agree(flags: tuple[bool, ...], token: bytes) -> tuple[tuple[bool, ...], bytes]:
    """Each flag true on every rank iff it is true on some rank, and rank 0's ``token`` (a few bytes)
    on every rank: one all-reduce of small integers, where ``any_ranks`` then ``broadcast_str``
    would be two collectives and a pickle (a save's stall pays for each)."""
    if not _active() or dist.get_world_size() == 1:
        return tuple(flags), token
    mine = list(token) if dist.get_rank() == 0 else [0] * len(token)
    t = torch.tensor([1 if f else 0 for f in flags] + mine, dtype=torch.int32)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=cpu_group())
    values = t.tolist()
    return tuple(bool(x) for x in values[:len(flags)]), bytes(values[len(flags):])


def any_ranks(*flags: bool) -> tuple[bool, ...]:
    """Each flag true on every rank iff it is true on some rank: one all-reduce for all of them."""
    return agree(flags, b"")[0]
