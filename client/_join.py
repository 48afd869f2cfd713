"""Before a collective save or load, the ranks check that they all make the same call, in bounded time.

Ranks that do not all make a collective call alike (step counters that drifted: ranks 0 and 1 save
``gpt/10`` while ranks 2 and 3 save ``gpt/11``; a rank that skips the save; one that loads while the
others save) used to block in the client's collectives, or in sessions that could never commit, for
as long as torch's own timeout (30 minutes on gloo) or the save's wait. :func:`joined` runs first in
``CheckpointClient.save`` and in a collective ``load``, before any collective and before any session is
opened, and raises :class:`~ckptd_schemas.CollectiveMismatch` on every rank that came, naming what
each group of ranks called and which ranks did not come within ``timeout`` seconds. The ranks meet in
the store torch.distributed was initialised with (its rendezvous store), whose waits take a timeout
and leave no collective half done when they give up: a process group stays usable after the error.

Round k, the k-th joined call of this process (the ranks count alike while they are in step), keys
under ``ckptd/join/k/``; each rank, in order:

1. ``append(who, [rank, world, call])``: who came, and with what (read only to name the ranks at fault);
2. ``compare_set(call, "", mine)``: the first rank's call; a rank whose own differs counts a mismatch;
3. ``add(n, 1 + (mismatch << 32))``: arrivals and mismatches in one counter;
4. the rank that completes the count, or the first whose wait times out, claims the verdict
   (``compare_set(claim)``) and writes it: ``ok``, or the error (it alone reads ``who``); the others
   wait on ``get(verdict)`` for ``timeout`` seconds, and longer while some rank is still inside the
   previous joined call (a long load: it is busy, not absent);
5. on leaving the call, raised or returned, ``add(left, 1)``: what step 4 reads of the previous round.

Five store requests per rank whatever the world size (the store serves O(R) per call). A rank that
comes after the verdict reads it and raises the same error; the ranks then count alike again. The keys
of round k-2 are deleted once round k is ``ok`` (every rank has left k-1 by then). The waits go through
a clone of the store (one more connection per rank): a store client serves one request at a time,
and torch's own threads use the default one (a store that cannot clone is used itself, briefly).
"""

from __future__ import annotations

import contextlib
import json
import threading
from datetime import timedelta
from typing import Any, Iterator, Mapping, Sequence

import torch.distributed as dist

from ckptd_schemas import CollectiveMismatch

from ._dist import distributed

__all__ = ["joined", "mismatch", "rank_list"]

_MASK = (1 << 32) - 1
_OK = b"ok"
_KEYS = ("who", "call", "n", "claim", "verdict", "left")
_lock = threading.Lock()
_state: dict[str, Any] = {"group": None, "store": None, "owned": False, "next": 0}


def rank_list(ranks: Sequence[int], limit: int = 16) -> str:
    """``rank 2``, ``ranks 0,1``, ``ranks 0-7,9`` (runs of three or more as ranges; ``limit`` runs shown)."""
    rs = sorted(set(ranks))
    runs: list[str] = []
    i = 0
    while i < len(rs):
        j = i
        while j + 1 < len(rs) and rs[j + 1] == rs[j] + 1:
            j += 1
        runs.extend([f"{rs[i]}-{rs[j]}"] if j - i >= 2 else [str(r) for r in rs[i:j + 1]])
        i = j + 1
    shown = ",".join(runs[:limit]) + (f",... ({len(rs)} ranks)" if len(runs) > limit else "")
    return f"rank {shown}" if len(rs) == 1 else f"ranks {shown}"


def mismatch(calls: Mapping[str, Sequence[int]], missing: Sequence[int] = (), waited: float = 0.0,
             **details: Any) -> CollectiveMismatch:
    """The error every rank raises: one sentence, what each group of ranks called (the largest groups
    first, 8 at most) and who did not come; and the ranks of each call and the missing ones (64 each)."""
    order = sorted(calls.items(), key=lambda kv: (-len(kv[1]), min(kv[1])))
    said = ", ".join(f"{rank_list(rs)} {call}" for call, rs in order[:8])
    if len(order) > 8:
        said += f", and {len(order) - 8} other calls"
    if missing:
        said += f"; {rank_list(missing)} did not join within {waited:g} s"
    return CollectiveMismatch(f"the ranks do not make the same collective call: {said}",
                              calls={c: sorted(rs)[:64] for c, rs in calls.items()},
                              missing=sorted(missing)[:64], missing_count=len(missing), **details)


@contextlib.contextmanager
def joined(call: str, timeout: float) -> Iterator[None]:
    """Check that every rank makes ``call`` now (``save gpt/10``), then run the block; raise
    ``CollectiveMismatch`` on every rank that came when they do not. Nothing without torch.distributed
    or with one rank (and inside ``solo()``)."""
    if not distributed():
        yield
        return
    store, owned, k = _next_round()
    r = _Round(store, owned, k, dist.get_rank(), dist.get_world_size(), call, timeout)
    try:
        r.join()
        yield
    finally:
        r.leave()


def _next_round() -> tuple[dist.Store, bool, int]:
    """This process's store clone (and whether it is a clone, its own), and its next round; both start
    afresh with a new default group."""
    world = dist.group.WORLD
    with _lock:
        if _state["group"] is not world:
            base = dist.distributed_c10d._get_default_store()
            try:
                store, owned = base.clone(), True
            except RuntimeError:  # a store that cannot clone: torch's own client, shared with its threads
                store, owned = base, False
            _state.update(group=world, store=store, owned=owned, next=0)
        k = _state["next"]
        _state["next"] = k + 1
        return _state["store"], _state["owned"], k


class _Round:
    """One rank's part of round ``k`` (the steps of the module docstring)."""

    def __init__(self, store: dist.Store, owned: bool, k: int, rank: int, world: int, call: str,
                 timeout: float) -> None:
        self.store, self.owned, self.k, self.rank, self.world, self.call = store, owned, k, rank, world, call
        self.timeout = max(0.001, timeout)

    def key(self, name: str, k: int | None = None) -> str:
        return f"ckptd/join/{self.k if k is None else k}/{name}"

    def join(self) -> None:
        s = self.store
        s.append(self.key("who"), json.dumps([self.rank, self.world, self.call]) + "\n")
        mine = json.dumps([self.world, self.call])
        differs = s.compare_set(self.key("call"), "", mine) != mine.encode()
        n = s.add(self.key("n"), 1 + (int(differs) << 32))
        verdict = self._decide() if n & _MASK == self.world else self._await()
        if verdict != _OK:
            raise self._error(verdict)

    def leave(self) -> None:
        with contextlib.suppress(Exception):  # only what the next round's wait reads; a lost store is moot
            self.store.add(self.key("left"), 1)

    def _get(self, name: str) -> bytes:
        """The key's value once it is set, waiting at most ``timeout`` (a RuntimeError past it)."""
        if self.owned:  # one request: the clone's timeout is this module's to set
            self.store.set_timeout(timedelta(seconds=self.timeout))
        else:  # torch's own client keeps its timeout: wait, then read
            self.store.wait([self.key(name)], timedelta(seconds=self.timeout))
        return self.store.get(self.key(name))

    def _await(self) -> bytes:
        while True:
            try:
                return self._get("verdict")
            except dist.DistNetworkError:
                raise
            except RuntimeError:  # the wait timed out (DistStoreError; a FileStore's RuntimeError)
                if not self._previous_busy():
                    return self._decide()

    def _previous_busy(self) -> bool:
        """Some rank came to the previous round and has not left it yet (the missing one, busy)."""
        if self.k == 0:
            return False
        came = self.store.add(self.key("n", self.k - 1), 0) & _MASK
        return came > self.store.add(self.key("left", self.k - 1), 0)

    def _decide(self) -> bytes:
        """Claim the verdict and write it, or read the one the claimant writes."""
        me = str(self.rank).encode()
        if self.store.compare_set(self.key("claim"), "", me) != me:
            try:
                return self._get("verdict")
            except RuntimeError as e:
                return json.dumps({"message": f"no verdict from the rank that claimed it ({e})"}).encode()
        verdict = self._verdict()
        self.store.set(self.key("verdict"), verdict)
        if verdict == _OK and self.k >= 2:
            for name in _KEYS:
                with contextlib.suppress(Exception):  # a store without deletes keeps them
                    self.store.delete_key(self.key(name, self.k - 2))
        return verdict

    def _verdict(self) -> bytes:
        n = self.store.add(self.key("n"), 0)
        if n & _MASK == self.world and not n >> 32:
            return _OK
        came: dict[int, tuple[int, str]] = {}
        for line in self.store.get(self.key("who")).decode().splitlines():
            rank, world, call = json.loads(line)
            came.setdefault(rank, (world, call))
        worlds = {w for w, _ in came.values()}
        calls: dict[str, list[int]] = {}
        for rank, (world, call) in sorted(came.items()):
            calls.setdefault(call if len(worlds) == 1 else f"{call} (world {world})", []).append(rank)
        missing = sorted(set(range(self.world)) - set(came))
        if not missing and len(calls) == 1:  # the last came while this rank's wait ran out: all in step
            return _OK
        err = mismatch(calls, missing, self.timeout if missing else 0.0, round=self.k)
        return json.dumps({"message": err.message, "details": err.details}).encode()

    def _error(self, verdict: bytes) -> CollectiveMismatch:
        body = json.loads(verdict)
        details = dict(body.get("details") or {})
        message = body["message"]
        if self.rank in details.get("missing", ()):
            message += f" (rank {self.rank} called {self.call} after the others had stopped waiting)"
        return CollectiveMismatch(message, **{**details, "rank": self.rank, "call": self.call})
