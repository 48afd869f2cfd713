"""Every rank waiting for a save's commit shares one watch of its session in this process.

A save of R ranks has R long polls of ``GET .../sessions/{sid}?wait=S`` open until it commits. If
each re-read the session's state on every index arrival and every 0.1 s, listing its ranks each
time, they would cost the service O(R) per poll and O(R²) per event, and right after the commit
every waiter would check the new checkpoint at once. Here a session has at most one poller per
process, whatever the number of waiters:

* :meth:`SessionWatches.answer` joins (or starts) the watch of a session and waits for it to settle
  (committed or failed; with ``durable``, durable or refused), or for the caller's deadline;
* the watch reads the session's **state** (``SessionStore.status(..., list_ranks=False)``: the
  marker, the session's record and its failure record, O(1) reads, no listing), every
  ``interval`` seconds (another replica may commit the session) or at once when :meth:`wake` says
  this process just stored an index that settled it;
* the answer is built once and shared: every waiter gets the same :class:`SessionStatus` (it names
  no ranks: ``ranks_done`` is empty; a status read without ``wait`` lists them), serialized once per
  read of the state (the JSON bytes every waiter is sent as they are);
* a waiter parks on the watch's one future (``asyncio.wait``: no task, no shield of its own) and the
  settling read wakes them all at once: a waiting rank costs its request, one wake-up and a send;
* the watch ends when its last waiter leaves.

A read that fails (the session is gone: 404) fails every waiter with that error, once. Before its
first read a watch runs ``precheck`` (the upload routes: the session's record read once, tried
once, ``Storage.for_probes``): a store that answers errors fails the waiters 503 at once, which
clients retry, where the state's reads would retry for minutes first; so a long poll on a session
that does not exist answers 404 at once, or 503 at once while the store fails.
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass, field
from typing import Callable

from starlette.concurrency import run_in_threadpool

from ckptd_schemas import SessionStatus

__all__ = ["SessionWatches"]

#: Seconds between two reads of an open session's state by its watch.
OPEN_INTERVAL = 0.1
#: Seconds between two reads of a committed session's durability (a read of the durable tier).
DURABLE_INTERVAL = 0.25

Key = tuple[str, str, str, bool]  # run, name, session, durable


@dataclass
class _Watch:
    durable: bool = False
    waiters: int = 0
    status: SessionStatus | None = None
    error: BaseException | None = None
    first_read: asyncio.Event = field(default_factory=asyncio.Event)
    done: asyncio.Future = field(default_factory=lambda: asyncio.get_running_loop().create_future())  # settled
    woken: asyncio.Event = field(default_factory=asyncio.Event)
    task: asyncio.Task | None = None
    reads: int = 0  # reads of the state so far (a durability read may update the same status object)
    answer: tuple[int, bytes] | None = None  # the JSON of the status as of that many reads

    @property
    def settled(self) -> bool:
        return self.error is not None or (self.status is not None and self.status.settled(self.durable))


class SessionWatches:
    """The watches of this process's waiting sessions (see the module's docstring).

    ``read_state(run, name, sid)`` reads a session's state without listing its ranks;
    ``with_durability(status)`` adds whether a committed checkpoint is durable. Both run in a
    worker thread, one at a time per watch.
    """

    def __init__(self, read_state: Callable[[str, str, str], SessionStatus],
                 with_durability: Callable[[SessionStatus], SessionStatus],
                 precheck: Callable[[str, str, str], None] | None = None) -> None:
        self._read_state, self._with_durability, self._precheck = read_state, with_durability, precheck
        self._watches: dict[Key, _Watch] = {}

    async def _wait(self, run: str, name: str, sid: str, *, seconds: float, durable: bool
                    ) -> tuple[SessionStatus, _Watch]:
        key = (run, name, sid, durable)
        watch = self._watches.get(key)
        if watch is None:
            watch = self._watches[key] = _Watch(durable=durable)
            watch.task = asyncio.create_task(self._poll(key, watch))
        watch.waiters += 1
        try:
            # woken once: when the session settles or its read fails, not at every read of an open one
            await asyncio.wait((watch.done,), timeout=seconds)
            if watch.status is None and watch.error is None:  # out of time before the first read ended
                await watch.first_read.wait()
            if watch.error is not None:
                raise watch.error
            assert watch.status is not None
            return watch.status, watch
        finally:
            watch.waiters -= 1
            if watch.waiters == 0 and self._watches.get(key) is watch:
                del self._watches[key]
                if watch.task is not None and not watch.task.done():
                    watch.task.cancel()

    async def answer(self, run: str, name: str, sid: str, *, seconds: float, durable: bool) -> bytes:
        """The session's status once it settles, or the last one read when ``seconds`` pass, as JSON bytes:
        serialized once per read of the state and sent as they are to every waiter of the watch."""
        st, watch = await self._wait(run, name, sid, seconds=seconds, durable=durable)
        if watch.answer is None or watch.answer[0] != watch.reads:
            watch.answer = (watch.reads, st.model_dump_json().encode())
        return watch.answer[1]

    def wake(self, sid: str) -> None:
        """This process just stored an index of session ``sid`` that settled it: read its state now."""
        for (_, _, s, _), watch in list(self._watches.items()):
            if s == sid:
                watch.woken.set()

    async def _poll(self, key: Key, watch: _Watch) -> None:
        run, name, sid, durable = key
        while True:
            watch.woken.clear()  # before the read: a wake during it reads again at once
            try:
                st = watch.status
                if st is None and self._precheck is not None:  # once per watch, whatever its waiters
                    await run_in_threadpool(self._precheck, run, name, sid)
                if st is None or st.state == "open":  # once committed, only its durability is read again
                    st = await run_in_threadpool(self._read_state, run, name, sid)
                if durable:
                    st = await run_in_threadpool(self._with_durability, st)
                watch.status = st
                watch.reads += 1
            except Exception as e:  # noqa: BLE001 - handed to every waiter, which raises it
                watch.error = e
            watch.first_read.set()
            if watch.settled:
                watch.done.set_result(None)
                return
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(watch.woken.wait(),
                                       OPEN_INTERVAL if watch.status is None or watch.status.state == "open"
                                       else DURABLE_INTERVAL)
