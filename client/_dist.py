"""What the client needs from torch.distributed: rank, world size, a few small collectives.

Every collective here moves CPU tensors or pickled objects, so it runs on a group with a CPU
backend: the default group when it has one (gloo, or ``cpu:gloo,cuda:nccl``), else a gloo group
made once for the default group (a trainer that called ``init_process_group("nccl")``), whose
creation is itself collective: the first save or load, which every rank calls, makes it.

The client's agreements cost each rank the same whatever the world size: :func:`check` is one
all-reduce of ten integers (the lowest rank that failed, whether every rank passed the same digest)
and of a few flags or-ed over the ranks (a load's: some rank does not read the files directly), and
only when it finds a failure does :func:`failure`, a rare second round, tell every rank what the
failing rank raised (a broadcast from it). No common path gathers an object from every rank.

:func:`solo` turns all of that off for the calls made inside it, on the thread that makes them: a
trainer that saves from one rank only (Lightning's DDP calls its ``CheckpointIO`` on rank 0 alone)
saves as rank 0 of a world of one, so that no collective waits for ranks that never call.
"""

from __future__ import annotations

import contextlib
import hashlib
from contextvars import ContextVar
from typing import Iterator

import torch
import torch.distributed as dist

from ckptd_schemas import CkptdError, StateDictMismatch

__all__ = ["agree", "any_ranks", "check", "cpu_backend", "cpu_group", "distributed", "failure", "raise_on_all",
           "rank_and_world", "reduce_max", "solo"]

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


def cpu_backend() -> str:
    """The backend of the default group for CPU tensors (``gloo``; a test's ``fake``), else ``gloo``."""
    config = dist.get_backend_config()
    for part in config.split(","):
        device, _, name = part.rpartition(":")
        if device in ("", "cpu") and name in ("gloo", "fake"):
            return name
    return "gloo"


def cpu_group() -> object | None:
    """The group for the client's CPU collectives (None: the default group)."""
    config = dist.get_backend_config()
    if "gloo" in config or "cpu:fake" in config:
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


def agree(flags: tuple[bool, ...], token: bytes) -> tuple[tuple[bool, ...], bytes]:
    """Each flag true on every rank iff it is true on some rank, and rank 0's ``token`` (a few bytes)
    on every rank: one all-reduce of small integers, where a broadcast after it would be a second
    collective and a pickle (a save's stall pays for each)."""
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


_CPU = object()  # the ``group`` default of the helpers below: :func:`cpu_group`
_NONE = -(1 << 62)  # below any value a rank contributes to a MAX


def reduce_max(values: list[int], *, group: object = _CPU) -> list[int]:
    """Collective: the element-wise maximum over the ranks of ``values`` (int64), one all-reduce."""
    t = torch.tensor(values, dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=cpu_group() if group is _CPU else group)
    return t.tolist()


def check(failed: bool, digest: bytes = b"", *, flags: tuple[bool, ...] = (),
          group: object = _CPU) -> tuple[int | None, bool, tuple[bool, ...]]:
    """Collective, one all-reduce of ten int64 (and one per flag) whatever the world size: the lowest
    (global) rank of ``group`` on which ``failed`` is true (None: none), whether every rank that did
    not fail passed the same ``digest`` (hashed to 128 bits: their maximum and minimum agree), and
    each of ``flags`` true iff some rank that did not fail passed it true (every rank passes as many)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    h = hashlib.blake2b(digest, digest_size=16).digest()
    parts = [int.from_bytes(h[i:i + 4], "little") for i in range(0, 16, 4)]
    mine = [_NONE] * 8 if failed else parts + [-p for p in parts]
    raised = [0 if failed else int(bool(f)) for f in flags]
    got = reduce_max([1 if failed else 0, world - rank if failed else 0, *mine, *raised], group=group)
    same = all(got[2 + i] == -got[6 + i] for i in range(4)) or got[2] == _NONE
    return (world - got[1] if got[0] else None), same, tuple(bool(x) for x in got[10:])


def failure(src: int, err: BaseException | str | None, *, group: object = _CPU) -> tuple[str, tuple[str, ...], int]:
    """Collective, the rare round after :func:`check` found a failure: on every rank of ``group``, what
    rank ``src`` raised (``Type: message``), the names of its error's classes (``type(err).__mro__``)
    and how many ranks failed. Two small collectives whatever the world size: a sum, a broadcast."""
    g = cpu_group() if group is _CPU else group
    count = torch.tensor([0 if err is None else 1], dtype=torch.int64)
    dist.all_reduce(count, op=dist.ReduceOp.SUM, group=g)
    if dist.get_rank() != src:
        box: list = [None]
    elif isinstance(err, BaseException):
        box = [(f"{type(err).__name__}: {err}", tuple(c.__name__ for c in type(err).__mro__))]
    else:
        box = [(str(err), ())]
    dist.broadcast_object_list(box, src=src, group=g)
    message, kinds = box[0]
    return message, tuple(kinds), int(count.item())


def raise_on_all(err: BaseException | None, digest: bytes = b"", *, flags: tuple[bool, ...] = (),
                 group: object = _CPU) -> tuple[bool, tuple[bool, ...]]:
    """Collective (a load's ranks, or a host's): when some rank failed, raise on every one of them, the
    failing ranks their own error, the others one naming the lowest failing rank (``StateDictMismatch``
    where it raised one, else ``CkptdError``), so that no rank waits in a later collective for one that
    stopped; else whether every rank passed the same ``digest``, and each of ``flags`` or-ed over the
    ranks (:func:`check`, then :func:`failure`)."""
    first, same, agreed = check(err is not None, digest, flags=flags, group=group)
    if first is None:
        return same, agreed
    message, kinds, _ = failure(first, err, group=group)
    if err is not None:
        raise err
    kind = StateDictMismatch if "StateDictMismatch" in kinds else CkptdError
    raise kind(f"load failed on rank {first} ({message}); rank {dist.get_rank()} stops as well", rank=first)
