"""The service's first look at a checkpoint is built once per process, whatever the number of ranks asking.

After a restart every rank of a resume asks for the same checkpoint's load tree at once. Each request
that found no verdict used to read and hash the whole manifest (20 MB here, 134 MB at 10,000 ranks)
and hold those bytes while it waited for the one parse, and each answer built the interval indexes it
met when they were not built yet: 64 first loaders took the service to 3x the memory of one. Through a
real ``ckptd serve`` restarted on a committed root, as a resuming job would:

* 32 loaders at once (head and pieces, as ``ckptd_client._loadtree`` asks) make one build of each
  kind, counted in ``ckptd_first_looks_total`` on ``/metrics``, and every one gets its pieces;
* the service's peak RSS (``VmHWM``) with 32 first loaders is within 1.5x of its peak with one, on a
  fresh process each (the bound is memory, never time);
* ``ckptd_manifest_cache_bytes`` and ``_entries`` report what is kept: one manifest, within
  ``CKPTD_MANIFEST_CACHE_BYTES``.
"""

from __future__ import annotations

import re
import threading
from pathlib import Path

import httpx
import pytest

from ckptd_schemas.api import LOAD_TREE_HEADER
from ckptd_schemas.loadtree import LoadHead

from bench.manifest import COLS, ROWS_PER_RANK, RUN, _rank
from support import ServerProcess, scaled

pytestmark = pytest.mark.slow

WORLD, TENSORS, LOADERS = 2048, 100, 32


def _commit(root: Path) -> None:
    """A committed WORLD x TENSORS checkpoint ``scale/big`` (about 20 MB of manifest JSON), as a save's
    ranks leave it (``SessionStore.put_index``, the last index commits)."""
    from ckptd.storage.local import LocalStorage
    from ckptd.store.sessions import SessionStore
    from ckptd_schemas import OpenSession, RankIndex

    store = SessionStore(LocalStorage(root))
    store.open(RUN, "big", OpenSession(session="s-big", world_size=WORLD, step=1))
    for r in range(WORLD):
        file, data, body = _rank(r, WORLD, TENSORS)
        sink = store.intake.receive(RUN, "big", "s-big", file)
        sink.write(data)
        sink.finish(None)
        st = store.put_index(RUN, "big", "s-big", RankIndex.model_validate_json(body))
    assert st.state == "committed", st


def _load(url: str, rank: int, barrier: threading.Barrier, out: dict) -> None:
    with httpx.Client(base_url=url, timeout=scaled(120)) as c:
        barrier.wait(scaled(60))
        head = c.get(f"/v1/checkpoints/{RUN}/big/load-tree")
        head.raise_for_status()
        names = list(LoadHead.parse(head.content, head.headers[LOAD_TREE_HEADER]).tensors())  # checked
        reqs = [{"name": n, "offsets": [rank * ROWS_PER_RANK, 0], "sizes": [ROWS_PER_RANK, COLS]} for n in names]
        got = c.post(f"/v1/checkpoints/{RUN}/big/load-tree", json={"requests": reqs, "rank": rank})
        got.raise_for_status()
        out[rank] = len(got.json()["tensors"])


def _first_loaders(srv: ServerProcess, n: int) -> tuple[int, dict[str, float]]:
    """Start the service afresh, let ``n`` ranks load at once: its peak RSS and its /metrics."""
    srv.start()
    try:
        barrier, out = threading.Barrier(n), {}
        threads = [threading.Thread(target=_load, args=(srv.url, r * (WORLD // n), barrier, out)) for r in range(n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(scaled(300))
        assert len(out) == n and set(out.values()) == {TENSORS}, out
        with open(f"/proc/{srv.proc.pid}/status") as f:  # type: ignore[union-attr]
            peak = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))
        text = httpx.get(f"{srv.url}/metrics").text
    finally:
        srv.stop()
    series = {m[1]: float(m[2]) for m in re.finditer(r"^(ckptd_(?:first_looks_total|manifest_cache)\S*) (\S+)$",
                                                     text, re.M)}
    return peak, series


def test_first_loaders_at_once_make_one_build_and_cost_what_one_does(tmp_path) -> None:
    root = tmp_path / "root"
    _commit(root)
    srv = ServerProcess(root, env={"CKPTD_VERIFY_AFTER_COMMIT": "false"}, log=tmp_path / "server.log")
    one_peak, one = _first_loaders(srv, 1)
    many_peak, many = _first_loaders(srv, LOADERS)
    for series in (one, many):
        assert series['ckptd_first_looks_total{what="manifest"}'] == 1, series
        assert series['ckptd_first_looks_total{what="load_tree"}'] == 1, series
        assert series["ckptd_manifest_cache_entries"] == 1, series
        assert 0 < series["ckptd_manifest_cache_bytes"] <= 1 << 30, series
    assert many_peak <= 1.5 * one_peak, (f"{LOADERS} first loaders at once: peak RSS {many_peak / 2**20:.0f} MiB, "
                                         f"one loader {one_peak / 2**20:.0f} MiB")
