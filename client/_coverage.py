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
2. :func:`agree_keys`: one ``all_gather_object`` of (that failure, the checkpoint the rank
   resolved, a bitmap over the checkpoint's keys of those the rank holds). Every rank then
   raises, or none: the failing rank its own error, the others a :class:`StateDictMismatch` (or
   :class:`CkptdError` for other failures) naming the rank and its keys; the checkpoint's keys
   that no rank holds are returned (``LoadReport.uncovered``), and with ``cover`` they fail every
   rank, naming them. No rank is left waiting in a later collective for a rank that stopped.
"""

from __future__ import annotations

from ckptd_schemas import CkptdError, StateDictMismatch

from ._dist import cpu_group

__all__ = ["agree_keys"]


def _bitmap(keys: list[str], held: set[str]) -> int:
    """Bit i set iff this rank holds ``keys[i]`` (an int: the ranks' bitmaps are OR-ed at C speed)."""
    bits = bytearray((len(keys) + 7) // 8)
    for i, k in enumerate(keys):
        if k in held:
            bits[i >> 3] |= 1 << (i & 7)
    return int.from_bytes(bits, "little")


def _unset(keys: list[str], bits: int) -> list[str]:
    raw = bits.to_bytes((len(keys) + 7) // 8, "little")
    return [k for i, k in enumerate(keys) if not raw[i >> 3] & (1 << (i & 7))]


def agree_keys(err: BaseException | None, ckpt: tuple[str, str] | None, keys: list[str], held: set[str], *,
               cover: bool) -> tuple[int, list[str]]:
    """Collective (see the module docstring); returns the number of ranks whose keys were gathered
    and the checkpoint's keys that none of them holds. ``ckpt``: the checkpoint this rank resolved
    (ref and session; None when it failed first), ``keys``: every key a state dict can restore from
    it, sorted. Raises on every rank, or on none."""
    import torch.distributed as dist

    world, me = dist.get_world_size(), dist.get_rank()
    mine: dict = {"error": None if err is None else f"{type(err).__name__}: {err}",
                  "mismatch": isinstance(err, StateDictMismatch),
                  "ckpt": ckpt, "bits": _bitmap(keys, held) if ckpt is not None else 0}
    gathered: list = [None] * world
    dist.all_gather_object(gathered, mine, group=cpu_group())
    failed = [(r, g) for r, g in enumerate(gathered) if g["error"] is not None]
    if failed:
        if err is not None:
            raise err
        r, g = failed[0]
        kind = StateDictMismatch if g["mismatch"] else CkptdError
        raise kind(f"load failed on rank {r} ({g['error']}); rank {me} stops as well", rank=r)
    ckpts = {g["ckpt"] for g in gathered}
    if len(ckpts) > 1:
        raise CkptdError(f"the ranks resolved different checkpoints: {sorted(ckpts)[:4]}; "
                         f"load a named checkpoint instead of RUN/latest while saves commit", checkpoints=len(ckpts))
    if ckpt is None:
        return 0, []
    union = 0
    for g in gathered:
        union |= g["bits"]
    uncovered = _unset(keys, union)
    if cover and uncovered:
        raise StateDictMismatch(
            f"checkpoint {ckpt[0]} has keys that no rank's state_dict holds (checked across {world} "
            f"ranks): {uncovered[:8]}{' ...' if len(uncovered) > 8 else ''} "
            f"(load(..., cover=False) restores the keys the ranks hold)", missing_on_all_ranks=uncovered[:64])
    return world, uncovered
