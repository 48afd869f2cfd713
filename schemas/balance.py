"""Greedy balancing of whole items over ranks (LPT: largest first onto the least loaded).

Pure and deterministic from names and sizes alone, so every rank (or the
planner) computes the same assignment without communicating. Used for the
writers of replicated tensors and for whole-matrix ownership (``owner:``).
"""

from __future__ import annotations

from typing import Sequence

from .errors import InvalidRequest

__all__ = ["lpt_assign"]


def lpt_assign(items: Sequence[tuple[str, int]], bins: int, *, cap: int | None = None,
               counted: set[str] | None = None, load: Sequence[int] | None = None) -> dict[str, int]:
    """Assign each ``(name, size)`` to one of ``bins`` ranks.

    ``cap`` limits how many of the ``counted`` items (all, when None) one rank
    may take; an assignment the cap makes impossible raises InvalidRequest.
    ``load`` seeds the ranks' starting loads.
    """
    loads = list(load) if load is not None else [0] * bins
    counts = [0] * bins
    owner: dict[str, int] = {}
    for name, size in sorted(items, key=lambda x: (-x[1], x[0])):
        limited = cap is not None and (counted is None or name in counted)
        choices = [r for r in range(bins) if not limited or counts[r] < cap]  # type: ignore[operator]
        if not choices:
            n = sum(1 for i, _ in items if counted is None or i in counted)
            raise InvalidRequest(
                f"cannot place {n} items on {bins} ranks with at most {cap} per rank "
                f"(capacity {bins * cap}); first item left over: {name!r}", items=n, ranks=bins, cap=cap)
        r = min(choices, key=lambda i: (loads[i], i))
        owner[name] = r
        loads[r] += size
        if limited:
            counts[r] += 1
    return owner
