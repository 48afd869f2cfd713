"""Ranks waiting for a commit share one watch of the session (``ckptd.service.session_watch``): the
service's reads while R ranks wait do not grow with R, every waiter gets the one answer built, a
local index that settles the session wakes them at once, and a failed read fails each of them.

Then through a real ``ckptd serve``: 48 ranks long-poll one open session while its indexes arrive;
none of their answers lists the ranks (an O(world size) read and answer per poll)."""

from __future__ import annotations

import asyncio
import threading
import time

import httpx
import pytest

from ckptd.service import session_watch
from ckptd.service.session_watch import SessionWatches
from ckptd_schemas import SessionNotFound, SessionStatus
from support import ServerProcess, scaled


def _status(state: str) -> SessionStatus:
    return SessionStatus(run="r", name="1", session="s", state=state, world_size=4, ranks_done=[],
                         manifest_xxh3="0" * 16 if state == "committed" else None)


class _Session:
    def __init__(self) -> None:
        self.reads, self.state = 0, "open"
        self.lock = threading.Lock()

    def read(self, run: str, name: str, sid: str) -> SessionStatus:
        with self.lock:
            self.reads += 1
        if self.state == "gone":
            raise SessionNotFound("no upload session 's'", session=sid)
        return _status(self.state)


def test_two_hundred_waiters_cost_the_reads_of_one() -> None:
    session = _Session()

    async def main() -> tuple[list[SessionStatus], float]:
        watches = SessionWatches(session.read, lambda st: st)
        t0 = time.monotonic()
        waiters = [asyncio.create_task(watches.wait("r", "1", "s", seconds=scaled(30), durable=False))
                   for _ in range(200)]
        await asyncio.sleep(0.6)
        session.state = "committed"
        out = await asyncio.gather(*waiters)
        assert not watches._watches  # the watch ends with its last waiter
        return out, time.monotonic() - t0

    answers, elapsed = asyncio.run(main())
    assert all(a.state == "committed" for a in answers)
    assert len({id(a) for a in answers}) == 1, "each waiter got an answer built for it"
    # one read per interval of the one watch (a slow machine reads less often, never more)
    assert session.reads <= elapsed / session_watch.OPEN_INTERVAL + 3, (session.reads, elapsed)


def test_every_waiter_is_sent_the_bytes_serialized_once_and_a_durability_read_is_sent_anew() -> None:
    """200 waiters of a committed session get one body, serialized once; waiters for durability get the
    status the durability read changed in place (not the bytes of the read before it)."""
    session = _Session()
    session.state = "committed"
    durable_reads = []

    def with_durability(st: SessionStatus) -> SessionStatus:  # as the route's: updates the same object
        durable_reads.append(1)
        st.durable = len(durable_reads) >= 3
        return st

    async def main() -> tuple[list[bytes], list[bytes], bytes]:
        watches = SessionWatches(session.read, with_durability)
        many = await asyncio.gather(*(watches.answer("r", "1", "s", seconds=scaled(10), durable=False)
                                      for _ in range(200)))
        settled = [asyncio.create_task(watches.answer("r", "1", "s", seconds=scaled(10), durable=True))
                   for _ in range(20)]
        # one watch: a waiter out of time is sent the first read's status (not durable yet) ...
        early = await watches.answer("r", "1", "s", seconds=0.05, durable=True)
        return many, await asyncio.gather(*settled), early  # ... the others the third's, in the same watch

    many, settled, early = asyncio.run(main())
    assert len({id(b) for b in many}) == 1, "each waiter's answer was serialized for it"
    assert SessionStatus.model_validate_json(many[0]) == _status("committed")
    assert SessionStatus.model_validate_json(early).durable is False
    assert len({id(b) for b in settled}) == 1
    assert SessionStatus.model_validate_json(settled[0]).durable is True, settled[0]


def test_an_index_that_settles_the_session_wakes_its_waiters_at_once(monkeypatch) -> None:
    monkeypatch.setattr(session_watch, "OPEN_INTERVAL", 3600.0)  # no timed read: only the wake can tell them
    session = _Session()

    async def main() -> list[SessionStatus]:
        watches = SessionWatches(session.read, lambda st: st)
        waiters = [asyncio.create_task(watches.wait("r", "1", "s", seconds=scaled(20), durable=False))
                   for _ in range(5)]
        await asyncio.sleep(0.2)
        session.state = "committed"
        watches.wake("other")  # another session's index: not this one
        await asyncio.sleep(0.2)
        assert not any(w.done() for w in waiters)
        watches.wake("s")
        return await asyncio.gather(*waiters)

    assert [a.state for a in asyncio.run(main())] == ["committed"] * 5
    assert session.reads == 2


def test_a_session_that_is_gone_fails_every_waiter_with_its_error() -> None:
    session = _Session()
    session.state = "gone"

    async def main() -> list:
        watches = SessionWatches(session.read, lambda st: st)
        return await asyncio.gather(*(watches.wait("r", "1", "s", seconds=scaled(10), durable=False)
                                      for _ in range(3)), return_exceptions=True)

    out = asyncio.run(main())
    assert all(isinstance(e, SessionNotFound) for e in out), out
    assert session.reads == 1


def test_a_waiter_past_its_deadline_gets_the_open_status() -> None:
    session = _Session()

    async def main() -> SessionStatus:
        return await SessionWatches(session.read, lambda st: st).wait("r", "1", "s", seconds=0.3, durable=False)

    assert asyncio.run(main()).state == "open"


@pytest.mark.slow
def test_ranks_waiting_on_a_real_service_list_no_ranks(tmp_path) -> None:
    """48 long polls of one session's status while its 48 indexes arrive one by one through a real
    ``ckptd serve``: every waiter gets the committed answer and no answer lists the ranks; a plain
    status read still says committed."""
    world = 48
    srv = ServerProcess(tmp_path / "root", log=tmp_path / "server.log").start()
    try:
        base = f"{srv.url}/v1/checkpoints/w/1"
        sid = "watched-1"
        r = httpx.post(f"{base}/sessions", json={"world_size": world, "session": sid}, timeout=30)
        assert r.status_code == 200, r.text
        answers: list = []

        def wait() -> None:
            with httpx.Client(timeout=scaled(60)) as c:
                while True:
                    r = c.get(f"{base}/sessions/{sid}", params={"wait": 20})
                    answers.append(r.json())
                    if r.json()["state"] != "open":
                        return

        threads = [threading.Thread(target=wait) for _ in range(world)]
        for t in threads:
            t.start()
        with httpx.Client(timeout=30) as c:
            for rank in range(world):
                body = {"rank": rank, "world_size": world, "objects": [
                    {"name": f"rank{rank}", "rank": rank, "encoding": "json", "value": rank}]}
                r = c.put(f"{base}/sessions/{sid}/ranks/{rank}", json=body)
                assert r.status_code == 200, r.text
        for t in threads:
            t.join(scaled(60))
        finals = [a for a in answers if a["state"] != "open"]
        assert len(finals) == world and all(a["state"] == "committed" for a in finals), finals[:2]
        assert all(a["ranks_done"] == [] for a in answers), "a long poll's answer listed the ranks"
        plain = httpx.get(f"{base}/sessions/{sid}", timeout=30).json()
        assert plain["state"] == "committed"
    finally:
        srv.stop()
