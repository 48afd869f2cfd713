"""The service's worker threads (:func:`ckptd.service.limits.widen_threads`): a real ``ckptd serve``
(the fault server, tests/fault_server.py) on a local root.

A rank's index waits, in a worker thread, for the one write that stores the indexes arriving together
at the replica (:mod:`ckptd.store.rank_indexes`); that write takes in every index waiting for it when it
begins. With anyio's default of 40 threads, the 41st index of a save waited for a thread instead, so no
object held more than 40 indexes, and each write took in only the few that had got one.
"""

from __future__ import annotations

import asyncio

import httpx

from adversary.test_ingest_s3 import _index_body, _ranks_with_files
from ckptd.store.paths import rank_batch
from support import ServerProcess, scaled


def test_a_hundred_indexes_arriving_at_once_wait_for_the_store_together(tmp_path):
    """While each object of rank indexes takes a second to store, a hundred indexes arriving at once are
    stored with more than 40 in one object (never, with 40 threads: an index in a write is one waiting for
    it in a thread), and the save commits."""
    world, root = 100, tmp_path / "root"
    srv = ServerProcess(root, env={"CKPTD_FAULTS": f"stall-indexes={scaled(1.0)}"}, log=tmp_path / "server.log").start()
    bodies = [_index_body(r, world) for r in range(world)]

    async def all_at_once() -> list[str]:
        base = f"{srv.url}/v1/checkpoints/wide/1/sessions/s1/ranks"
        async with httpx.AsyncClient(timeout=scaled(60), limits=httpx.Limits(max_connections=world)) as c:
            answers = await asyncio.gather(*(c.put(f"{base}/{r}", json=bodies[r]) for r in range(world)))
        assert all(a.status_code == 200 for a in answers), [a.text for a in answers if a.status_code != 200]
        return [a.json()["state"] for a in answers]

    try:
        _ranks_with_files(srv, "wide", world)
        assert "committed" in asyncio.run(all_at_once())
    finally:
        srv.kill()
    ranks = root / "runs" / "wide" / "1" / "sessions" / "s1" / "ranks"
    objects = [rank_batch(p.relative_to(ranks).as_posix()) for p in ranks.rglob("*.json")]
    assert sorted(r for o in objects for r in o.ranks) == list(range(world)), objects  # type: ignore[union-attr]
    assert max(len(o.ranks) for o in objects) > 40, objects  # type: ignore[union-attr]
