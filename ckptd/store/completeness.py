"""Whether every rank's index of a session is stored: what one process learns between the calls.

Call order: ``SessionStore.put_index`` stores a rank's index, then ``Committer.if_complete`` asks
:meth:`Looks.missing_since` whether some rank's index is still missing (the session stays open) or none
is (it commits). Only a listing says none is: any replica's call that stores the last index, a retried
index or the sweep commits, and what is remembered here is a hint that saves looks, never a verdict.

Listing every rank at every call costs O(ranks) each, O(ranks^2) over a session (and a LIST request
per 1,000 keys on an object store). Instead, per session, the process remembers:

* the ranks its last listing did not show and no look since found (``_Look.missing``), looked at in
  rank order for one still missing, each forgotten once found stored. A rank checked and kept here needs
  no HEAD (``IndexCache.state``): stored, it is forgotten; its write not answered yet, it is missing
  now and its own call looks after the write. Any other is probed (a request): a call makes at most one
  failing probe, and at most :data:`PROBES` in all before a listing decides (a replica whose ranks are
  few, where other replicas store most: node-local replicas). A probe is a listing of the rank's window
  (:func:`.rank_indexes.in_window`): it answers for every rank of the window found stored;
* the last rank a look found missing, and when that look began (``_Look.seen``). A rank whose index
  was missing at a look begun after this call's own index was stored is stored after it, and its own
  call then looks and finds this one: this call may answer "open" without a look of its own. Looks are
  one at a time per session here, so the calls arriving together wait for one look and most answer from
  it (a group commit of the check): with two replicas of 32 ranks each on S3, each call walking its own
  way made 300-500 HEADs between the last byte and the marker.

A session aborted and opened again under its id (a stale hint) costs a listing, never a commit.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Callable, Collection

__all__ = ["Looks", "PROBES"]

PROBES = 16
"""The most ranks one call probes one by one before a listing decides (a listing is one request per
1,000 ranks)."""
MISSING_KEPT = 4096
"""The most missing ranks remembered per session (past them, a listing decides again)."""


@dataclass
class _Look:
    lock: threading.Lock = field(default_factory=threading.Lock)
    missing: dict[int, None] | None = None  # ordered set; None: no listing here yet
    seen: tuple[int, float] | None = None  # a rank found missing, and when that look began (monotonic)


class Looks:
    """Per session (a prefix), what this process learnt of its stored indexes (module docstring)."""

    def __init__(self, max_sessions: int = 4096) -> None:
        self.max_sessions = max_sessions
        self._sessions: OrderedDict[str, _Look] = OrderedDict()
        self._lock = threading.Lock()

    def missing_since(self, prefix: str, since: float, world_size: int, kept: Callable[[int], str | None],
                      probe: Callable[[int], Collection[int]], listing: Callable[[], list[int]]) -> bool:
        """Whether some rank's index of session ``prefix`` was missing at a look begun at or after
        ``since`` (``time.monotonic()`` once the caller's own index was stored). ``kept(r)``: rank r's
        index is checked and kept here, its write ``"pending"`` or ``"stored"`` (else None); ``probe(r)``:
        the ranks found stored by a look at r (r among them, or not: it is missing; the others a hint,
        since only a listing says none is missing); ``listing()``: the ranks stored."""
        look = self._of(prefix)
        with look.lock:
            if look.seen is not None and look.seen[1] >= since:
                return True
            probes = 0
            while look.missing and probes < PROBES:
                r, t = next(iter(look.missing)), time.monotonic()
                state = kept(r)
                if state is None:
                    probes += 1
                    found = probe(r)
                    missing = r not in found
                    for x in found:  # a window's ranks: one look answers for them all
                        look.missing.pop(x, None)
                else:  # pending: its write is answered after t, and its own call looks then
                    missing = state == "pending"
                if missing:
                    look.seen = (r, t)
                    return True
                look.missing.pop(r, None)
            t = time.monotonic()
            done = set(listing())
            gaps = [r for r in range(world_size) if r not in done]
            look.missing = dict.fromkeys(gaps[:MISSING_KEPT])
            look.seen = (gaps[0], t) if gaps else None
            return bool(gaps)

    def forget(self, prefix: str) -> None:
        """A session that committed or failed."""
        with self._lock:
            self._sessions.pop(prefix, None)

    def _of(self, prefix: str) -> _Look:
        with self._lock:
            look = self._sessions.get(prefix)
            if look is None:
                look = self._sessions[prefix] = _Look()
                while len(self._sessions) > self.max_sessions:
                    self._sessions.popitem(last=False)
            self._sessions.move_to_end(prefix)
            return look
