"""A listing costs the service a page's work, never the whole store's. Against a real ``ckptd serve``
with ``CKPTD_LIST_MAX_ITEMS=2``, a run of five checkpoints (named against their step order) and a
planted name whose ``COMMITTED`` marker does not parse:

* ``ckptd ls RUN --server`` and ``CatalogClient.list_checkpoints`` list the run whole, oldest first,
  by following the pages ``X-Ckptd-Next`` names; ``ckptd ls --server`` and ``list_runs`` list every run;
* one page reads only its names' markers: the planted marker, in the last page, is found malformed
  (``ckptd_invisible_checkpoints_total{reason="marker_malformed"}`` on ``/metrics``) only once that
  page is asked for, not by the pages before it (the whole run's markers were read per request before);
* a ``limit`` past the setting is refused 413 naming the parameter and the setting; 0 is refused 400;
* what summarizes a run (``GET /v1/runs``, the web view's runs and run pages) shares one listing of
  it: 48 such requests at once read the run's markers once per ``LISTING_SECONDS``, not once each
  (``ckptd_first_looks_total{what="listing"}``), and a commit shows in the next summary at once.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import xxhash

from adversary.test_requests import ALICE, _auth, _chunk, _metric, _server
from ckptd_client import CatalogClient
from ckptd_schemas.api import NEXT_HEADER
from ckptd.store.visibility import LISTING_SECONDS

#: checkpoint names and their steps: name order is the reverse of step order
STEPS = {"a": 5, "b": 4, "c": 3, "d": 2, "e": 1}
MALFORMED = 'ckptd_invisible_checkpoints_total{reason="marker_malformed"}'


def _commit(url: str, run: str, name: str, step: int) -> None:
    data = step.to_bytes(4, "little")
    sid = f"s{step}"
    r = httpx.post(f"{url}/v1/checkpoints/{run}/{name}/sessions", headers=_auth(),
                   json={"session": sid, "world_size": 1, "step": step})
    assert r.status_code == 200, r.text
    r = httpx.put(f"{url}/v1/checkpoints/{run}/{name}/sessions/{sid}/files/f.bin", content=data,
                  headers={**_auth(), "X-Ckptd-Xxh3": xxhash.xxh3_64_hexdigest(data)})
    assert r.status_code == 200, r.text
    index = {"rank": 0, "world_size": 1, "files": ["f.bin"], "tensors": [
        {"name": "w", "shape": [1], "dtype": "int32", "group": "model", "chunks": [_chunk([0], [1], 0, data, 4)]}]}
    r = httpx.put(f"{url}/v1/checkpoints/{run}/{name}/sessions/{sid}/ranks/0", json=index, headers=_auth(), timeout=60)
    assert r.status_code == 200 and r.json()["state"] == "committed", r.text


def _ckptd(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ckptd.cli.main", *args], capture_output=True, text=True,
                          timeout=120, env={**os.environ, "CKPTD_TOKEN": ALICE})


def test_listings_are_paged_bounded_and_followed_whole(tmp_path: Path) -> None:
    srv = _server(tmp_path, CKPTD_LIST_MAX_ITEMS="2").start()
    try:
        for name, step in STEPS.items():
            _commit(srv.url, "r", name, step)
        runs = tmp_path / "root" / "runs"
        (runs / "r" / "z").mkdir()
        (runs / "r" / "z" / "COMMITTED").write_text("not a marker")
        for run in ("p", "q", "s"):
            (runs / run).mkdir()
        oldest_first = sorted(STEPS, key=STEPS.get)

        # one page at a time: names in name order, each page oldest first, a cursor to the next
        url = f"{srv.url}/v1/runs/r/checkpoints"
        first = httpx.get(url, headers=_auth())
        assert first.status_code == 200 and [c["name"] for c in first.json()] == ["b", "a"], first.text
        assert first.headers[NEXT_HEADER] == "b"
        second = httpx.get(url, params={"after": "b"}, headers=_auth())
        assert [c["name"] for c in second.json()] == ["d", "c"] and second.headers[NEXT_HEADER] == "d"
        assert _metric(srv.url, MALFORMED) == 0  # the planted marker, past these pages, was never read
        last = httpx.get(url, params={"after": "d"}, headers=_auth())
        assert [c["name"] for c in last.json()] == ["e"] and NEXT_HEADER not in last.headers
        assert _metric(srv.url, MALFORMED) == 1  # its own page read it
        one = httpx.get(url, params={"limit": 1, "after": "a"}, headers=_auth())
        assert [c["name"] for c in one.json()] == ["b"] and one.headers[NEXT_HEADER] == "b"

        # every item, through the client and the command line, which follow the pages
        catalog = CatalogClient(srv.url, token=ALICE)
        assert [c.name for c in catalog.list_checkpoints("r")] == oldest_first
        assert [r.run for r in catalog.list_runs()] == ["p", "q", "r", "s"]
        assert next(r for r in catalog.list_runs() if r.run == "r").checkpoints == 5
        out = _ckptd("ls", "r", "--server", srv.url)
        assert out.returncode == 0, out.stderr
        assert [line.split("\t")[0] for line in out.stdout.splitlines()] == [f"r/{n}" for n in oldest_first]
        out = _ckptd("ls", "--server", srv.url)
        assert out.returncode == 0, out.stderr
        assert [line.split("\t")[0] for line in out.stdout.splitlines()] == ["p", "q", "r", "s"]
        runs_page = httpx.get(f"{srv.url}/v1/runs", params={"limit": 1, "after": "p"}, headers=_auth())
        assert [r["run"] for r in runs_page.json()] == ["q"] and runs_page.headers[NEXT_HEADER] == "q"

        # past the setting: refused, typed, naming the parameter and the setting
        for path in ("/v1/runs", "/v1/runs/r/checkpoints"):
            r = httpx.get(f"{srv.url}{path}", params={"limit": 3}, headers=_auth())
            assert r.status_code == 413, r.text
            err = r.json()["error"]
            assert err["code"] == "payload_too_large" and "CKPTD_LIST_MAX_ITEMS" in err["message"]
            assert err["details"]["field"] == "limit" and err["details"]["setting"] == "CKPTD_LIST_MAX_ITEMS"
            assert err["details"]["limit"] == 2
            r = httpx.get(f"{srv.url}{path}", params={"limit": 0}, headers=_auth())
            assert r.status_code == 400 and r.json()["error"]["details"]["field"] == "limit", r.text
        assert _metric(srv.url, 'ckptd_limit_refusals_total{limit="list"}') == 2
        r = httpx.get(url, params={"after": "../x"}, headers=_auth())
        assert r.status_code == 400, r.text
    finally:
        srv.stop()


def test_a_storm_of_summaries_reads_a_run_once(tmp_path: Path) -> None:
    srv = _server(tmp_path).start()
    try:
        for name, step in STEPS.items():
            _commit(srv.url, "r", name, step)
        listings = 'ckptd_first_looks_total{what="listing"}'
        before = _metric(srv.url, listings)
        paths = ["/v1/runs", "/v1/ui/runs", "/v1/ui/runs/r/checkpoints", "/v1/ui/runs/r/steps"] * 12
        with httpx.Client(headers=_auth(), timeout=120) as http, ThreadPoolExecutor(16) as pool:
            t0 = time.monotonic()
            answers = list(pool.map(lambda p: http.get(f"{srv.url}{p}"), paths))
            elapsed = time.monotonic() - t0
        assert all(a.status_code == 200 for a in answers), [a.text for a in answers if a.status_code != 200]
        assert next(r for r in answers[0].json() if r["run"] == "r")["checkpoints"] == 5
        read = _metric(srv.url, listings) - before
        # one listing per window the storm lasted (the old summaries read the run's markers per request)
        assert 1 <= read <= 1 + elapsed / LISTING_SECONDS, (read, elapsed)

        _commit(srv.url, "r", "f", 6)  # committed here: the next summary lists it, without waiting
        summary = next(r for r in httpx.get(f"{srv.url}/v1/runs", headers=_auth()).json() if r["run"] == "r")
        assert summary["checkpoints"] == 6 and summary["latest"] == "f", summary
    finally:
        srv.stop()
