"""Greedy balancing of whole items over ranks (LPT: largest first onto the least loaded).

Pure and deterministic from names and sizes (and, where given, which ranks hold each item),
so every rank (or the planner) computes the same assignment from the same inputs. Used for the
writers of replicated tensors and for whole-matrix ownership (``owner:``).
"""

from __future__ import annotations

import heapq
from typing import Collection, Mapping, Sequence

from .errors import InvalidRequest

__all__ = ["lpt_assign"]


def lpt_assign(items: Sequence[tuple[str, int]], bins: int, *, cap: int | None = None,
               counted: Mapping[str, int] | set[str] | None = None,
               load: Sequence[int] | None = None,
               holders: Mapping[str, Collection[int]] | None = None) -> dict[str, int]:
    """Assign each ``(name, size)`` to one of ``bins`` ranks.

    ``cap`` limits how many counted things one rank may take: an item counts
    ``counted[name]`` (a mapping), 1 if it is in ``counted`` (a set) or 1 for
    every item (None). An assignment the cap makes impossible raises
    InvalidRequest. ``load`` seeds the ranks' starting loads. ``holders`` limits each item to
    the ranks listed for it (an item not listed may go to any rank); with every rank listed for
    every item the assignment is the same as without it.
    """
    def weight(name: str) -> int:
        if counted is None:
            return 1
        if isinstance(counted, Mapping):
            return counted.get(name, 0)
        return 1 if name in counted else 0

    loads = list(load) if load is not None else [0] * bins
    if cap is None and holders is None and loads:  # any rank may take any item: a heap, O(n log bins) whatever bins
        return _lpt_heap(items, loads)
    counts = [0] * bins
    owner: dict[str, int] = {}
    for name, size in sorted(items, key=lambda x: (-x[1], x[0])):
        w = weight(name) if cap is not None else 0
        allowed = sorted(holders[name]) if holders is not None and name in holders else range(bins)
        choices = [r for r in allowed if counts[r] + w <= cap] if w else list(allowed)  # type: ignore[operator]
        if not choices and not w:  # an empty holders entry
            raise InvalidRequest(f"item {name!r} is held by no rank", item=name)
        if not choices:
            n = sum(weight(i) for i, _ in items)
            raise InvalidRequest(
                f"cannot place {n} items on {bins} ranks with at most {cap} per rank "
                f"(capacity {bins * cap}); first item left over: {name!r}", items=n, ranks=bins, cap=cap)
        r = min(choices, key=lambda i: (loads[i], i))
        owner[name] = r
        loads[r] += size
        counts[r] += w
    return owner


def _lpt_heap(items: Sequence[tuple[str, int]], loads: list[int]) -> dict[str, int]:
    """``lpt_assign`` without a cap or holders: the same assignment (the least loaded rank, the lowest
    on a tie), from a heap of (load, rank) instead of a scan of every rank per item."""
    heap = [(n, r) for r, n in enumerate(loads)]
    heapq.heapify(heap)
    owner: dict[str, int] = {}
    for name, size in sorted(items, key=lambda x: (-x[1], x[0])):
        n, r = heap[0]
        owner[name] = r
        heapq.heapreplace(heap, (n + size, r))
    return owner
