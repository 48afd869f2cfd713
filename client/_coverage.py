"""Distributed loads: every rank's keys exist in the checkpoint (``strict``), and, only when asked
(``cover``), all ranks' keys together cover it.

A rank may hold any subset of a checkpoint: a pipeline stage its layers, a ZeRO partition at
another dp size only the parameters its slice touches, an evaluation job only the model of a
checkpoint that also holds optimizer state. So a load of a subset works by default, as in DCP;
"every key of the checkpoint restored by some rank" is an explicit option, and reported either way.

Call order inside ``load`` (every rank, collectively):

1. each rank matches its own keys (``_load._prepare``): with ``strict`` (the default) a key of its
   state dict that the checkpoint lacks, a shape or dtype that differs, an object saved per rank
   for other ranks only, fails that rank;
2. :func:`agree_keys`, whose cost per rank does not grow with the world size: one all-reduce of a
   fixed size (``_dist.check``: whether some rank failed, and the lowest that did; whether every rank
   resolved the same checkpoint, as a digest of its ref, session and key count; whether some rank
   does not read its files directly, so that ``_share`` has something to share), then one bitwise-or
   all-reduce of a bitmap over the checkpoint's keys (a bit per key: those some rank holds). Every
   rank then raises, or none: the failing rank its own error, the others a
   :class:`StateDictMismatch` (or :class:`CkptdError` for other failures) naming the rank and its
   keys, told in a rare second round (``_dist.failure``: a broadcast from the failing rank); ranks
   that resolved different checkpoints are named by a rare round that gathers each rank's ref. The
   checkpoint's keys that no rank holds are returned (``LoadReport.uncovered``), and with ``cover``
   they fail every rank, naming them. No rank is left waiting in a later collective for a rank that
   stopped.
"""

from __future__ import annotations

from ckptd_schemas import CkptdError, StateDictMismatch

from ._dist import cpu_group, raise_on_all

__all__ = ["agree_keys"]


def _bitmap(keys: list[str], held: set[str]) -> bytearray:
    """Bit i set iff this rank holds ``keys[i]`` (the ranks' bitmaps are or-ed in one all-reduce)."""
    bits = bytearray((len(keys) + 7) // 8)
    for i, k in enumerate(keys):
        if k in held:
            bits[i >> 3] |= 1 << (i & 7)
    return bits


def agree_keys(err: BaseException | None, ckpt: tuple[str, str] | None, keys: list[str], held: set[str], *,
               cover: bool, flags: tuple[bool, ...] = ()) -> tuple[int, list[str], tuple[bool, ...]]:
    """Collective (see the module docstring); returns the number of ranks whose keys were checked,
    the checkpoint's keys that none of them holds, and each of ``flags`` or-ed over the ranks (carried
    in the first all-reduce). ``ckpt``: the checkpoint this rank resolved (ref and session; None when
    it failed first), ``keys``: every key a state dict can restore from it, sorted. Raises on every
    rank, or on none."""
    import torch
    import torch.distributed as dist

    world = dist.get_world_size()
    # the rare round: what the failing rank raised
    same, agreed = raise_on_all(err, repr((ckpt, len(keys))).encode(), flags=flags)
    assert ckpt is not None
    if not same:  # the rare round: which checkpoints the ranks resolved (a short ref each)
        gathered: list = [None] * world
        dist.all_gather_object(gathered, ckpt, group=cpu_group())
        ckpts = set(gathered)
        raise CkptdError(f"the ranks resolved different checkpoints: {sorted(ckpts)[:4]}; "
                         f"load a named checkpoint instead of RUN/latest while saves commit", checkpoints=len(ckpts))
    bits = _bitmap(keys, held)
    if bits:
        t = torch.frombuffer(bits, dtype=torch.uint8)
        dist.all_reduce(t, op=dist.ReduceOp.BOR, group=cpu_group())
        bits = bytearray(t.numpy().tobytes())
    uncovered = [k for i, k in enumerate(keys) if not bits[i >> 3] & (1 << (i & 7))]  # no rank holds them
    if cover and uncovered:
        raise StateDictMismatch(
            f"checkpoint {ckpt[0]} has keys that no rank's state_dict holds (checked across {world} "
            f"ranks): {uncovered[:8]}{' ...' if len(uncovered) > 8 else ''} "
            f"(load(..., cover=False) restores the keys the ranks hold)", missing_on_all_ranks=uncovered[:64])
    return world, uncovered, agreed
