"""A dead save is reclaimed within minutes, a slow one never is.

A session is alive while a rank that joined it is heard from: its writes, and the keep-alives the
client sends from opening the session until it is committed, refused or gone
(``SessionInfo.keepalive_seconds``). With no live writer for ``CKPTD_DEAD_SESSION_AFTER`` seconds
the sweep aborts the session and deletes its staged bytes, well before the 6-hour TTL; the TTL still
bounds a writer that keeps a session alive without ever finishing it. One rule decides
(``ckptd.store.activity.reclaim_at``): the sweep and the web view ask it.

The end-to-end test runs real writer processes against ``ckptd serve``: one is SIGKILLed after
staging a file, one stays alive (between writes, for several idle windows) and commits.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from datetime import datetime, timedelta, timezone
from pathlib import Path

import httpx
import pytest
import xxhash

from ckptd.storage import LocalStorage
from ckptd.store import SessionStore
from ckptd.store.activity import reclaim_at
from ckptd.store.paths import Paths

from .staging import store_index
from ckptd_schemas import OpenSession, RankIndex
from support import REPO, ServerProcess, scaled

DATA = bytes(range(250)) * 4  # 1,000 bytes: 250 float32 values


def _index(rank: int = 0, world: int = 1) -> RankIndex:
    """Rank ``rank``'s part of tensor ``model.x`` (250 float32 per rank), in its file ``r<rank>-0000.bin``."""
    file = f"r{rank:06d}-0000.bin"
    return RankIndex.model_validate({"rank": rank, "world_size": world, "files": [file], "tensors": [{
        "name": "model.x", "shape": [250 * world], "dtype": "float32", "group": "model", "chunks": [{
            "kind": "box", "rank": rank, "offsets": [250 * rank], "sizes": [250], "location": {
                "file": file, "offset": 0, "length": len(DATA), "raw_length": len(DATA),
                "xxh3": xxhash.xxh3_64_hexdigest(DATA)}}]}]})


def _stage(store: SessionStore, name: str, sid: str, world: int = 1) -> None:
    store.open("r", name, OpenSession(session=sid, world_size=world, step=1))
    sink = store.intake.receive("r", name, sid, "r000000-0000.bin")
    sink.write(DATA)
    sink.finish(xxhash.xxh3_64_hexdigest(DATA))


def _set(root: Path, name: str, sid: str, *, opened_ago: float, active_ago: float | None) -> datetime:
    """Move the opening and the last writer activity of session ``sid`` of ``r/name`` into the past;
    return 'now'."""
    return _set_run(root, "r", name, sid, opened_ago=opened_ago, active_ago=active_ago)


def _set_run(root: Path, run: str, name: str, sid: str, *, opened_ago: float, active_ago: float | None) -> datetime:
    now = datetime.now(timezone.utc)
    sdir = root / "runs" / run / name / "sessions" / sid
    meta = json.loads((sdir / "SESSION.json").read_text())
    meta["created_at"] = (now - timedelta(seconds=opened_ago)).isoformat()
    (sdir / "SESSION.json").write_text(json.dumps(meta))
    if active_ago is None:
        (sdir / "ACTIVE.json").unlink(missing_ok=True)
    else:
        (sdir / "ACTIVE.json").write_text(json.dumps({"at": (now - timedelta(seconds=active_ago)).isoformat()}))
    return now


# -- the rule ------------------------------------------------------------------------------------------

def test_the_rule_is_the_earlier_of_idle_and_expired():
    t0 = datetime(2026, 1, 1, tzinfo=timezone.utc)
    r = reclaim_at(t0, None, ttl=3600, idle=300)
    assert (r.at, r.reason, r.last) == (t0 + timedelta(seconds=300), "idle", t0)  # counted from the opening
    r = reclaim_at(t0, t0 + timedelta(seconds=1000), ttl=3600, idle=300)
    assert (r.at, r.reason) == (t0 + timedelta(seconds=1300), "idle")
    r = reclaim_at(t0, t0 + timedelta(seconds=3500), ttl=3600, idle=300)  # alive, but the TTL bounds it
    assert (r.at, r.reason) == (t0 + timedelta(seconds=3600), "expired")
    r = reclaim_at(t0, t0 - timedelta(seconds=50), ttl=3600, idle=300)  # a record older than the opening
    assert r.last == t0


# -- the sweep, over a root ------------------------------------------------------------------------------

def test_a_session_with_no_live_writer_is_reclaimed_long_before_the_ttl(tmp_path):
    store = SessionStore(LocalStorage(tmp_path), dead_after=300)
    _stage(store, "dead", "s-dead")
    _stage(store, "slow", "s-slow")
    _stage(store, "new", "s-new")
    _set(tmp_path, "dead", "s-dead", opened_ago=900, active_ago=400)  # its ranks stopped 400 s ago
    _set(tmp_path, "slow", "s-slow", opened_ago=900, active_ago=100)  # a rank heard from 100 s ago
    now = _set(tmp_path, "new", "s-new", opened_ago=60, active_ago=None)  # just opened, no write recorded
    removed = store.sweeper.reclaim_stale(6 * 3600, now=now.timestamp())
    assert removed == ["r/dead/s-dead"]
    assert not (tmp_path / "runs" / "r" / "dead" / "sessions" / "s-dead").exists()
    assert (tmp_path / "runs" / "r" / "slow" / "sessions" / "s-slow" / "files" / "r000000-0000.bin").exists()
    # each goes once its writer was silent for the window (the new one: since its opening), not before
    def at(seconds: float) -> list[str]:
        return store.sweeper.reclaim_stale(6 * 3600, now=(now + timedelta(seconds=seconds)).timestamp())

    assert at(199) == []
    assert at(201) == ["r/slow/s-slow"]
    assert at(239) == []
    assert at(241) == ["r/new/s-new"]


def test_a_writer_that_keeps_a_session_alive_forever_is_still_bounded_by_the_ttl(tmp_path):
    store = SessionStore(LocalStorage(tmp_path), dead_after=300)
    _stage(store, "hog", "s-hog")
    now = _set(tmp_path, "hog", "s-hog", opened_ago=6 * 3600 + 5, active_ago=1)
    store.keep_alive("r", "hog", "s-hog")  # a valid token's keep-alive: accepted, but it cannot outlive the TTL
    assert store.sweeper.reclaim_stale(6 * 3600, now=now.timestamp()) == ["r/hog/s-hog"]


def test_a_rank_index_is_a_live_writer(tmp_path):
    """Ranks putting their indexes are writers: a save whose files all went in before a long stretch of
    index puts (at 100,000 ranks, minutes of them) is not reclaimed while they arrive."""
    store = SessionStore(LocalStorage(tmp_path), dead_after=300)
    _stage(store, "idx", "s-idx", world=2)
    _set(tmp_path, "idx", "s-idx", opened_ago=900, active_ago=400)  # the last file went in 400 s ago
    ranks = SessionStore(LocalStorage(tmp_path), dead_after=300)  # another process: it has touched nothing yet
    assert ranks.put_index("r", "idx", "s-idx", _index(0, 2)).state == "open"
    assert ranks.sweeper.reclaim_stale(6 * 3600, now=datetime.now(timezone.utc).timestamp()) == []


def test_a_complete_session_whose_ranks_died_is_committed_not_deleted(tmp_path):
    store = SessionStore(LocalStorage(tmp_path), dead_after=300)
    _stage(store, "done", "s-done")
    now = _set(tmp_path, "done", "s-done", opened_ago=900, active_ago=800)
    store_index(store.storage, "r", "done", "s-done", _index())  # then the writer died
    assert store.sweeper.reclaim_stale(6 * 3600, now=now.timestamp()) == []
    assert store.visibility.check("r", "done") is not None


def test_an_in_process_writer_is_kept_alive_between_writes(tmp_path):
    """A reshard job or an import writes through the store in the service's process, with no client to
    send keep-alives: while it holds the session, a thread records activity (every tenth of a second
    here); once it lets go, the session is reclaimed a window later."""
    dead_after = 2.0
    store = SessionStore(LocalStorage(tmp_path), dead_after=dead_after)
    _stage(store, "job", "s-job")
    with store.activity.held("r", "job", "s-job"):
        first = store.activity.last("r", "job", "s-job")
        deadline = time.monotonic() + scaled(30)
        while store.activity.last("r", "job", "s-job") == first:  # touched again with no write in between
            assert time.monotonic() < deadline, "the holder's thread never recorded activity"
            time.sleep(0.05)
        assert store.sweeper.reclaim_stale(3600, now=time.time() + dead_after / 2) == []
    deadline = time.monotonic() + scaled(dead_after + 30)
    while not (removed := store.sweeper.reclaim_stale(3600)):  # no longer held: it goes once its window has passed
        assert time.monotonic() < deadline, "a session nobody holds was never reclaimed"
        time.sleep(0.1)
    assert removed == ["r/job/s-job"]


def test_an_unreadable_activity_record_counts_as_none(tmp_path):
    store = SessionStore(LocalStorage(tmp_path), dead_after=300)
    _stage(store, "x", "s-x")
    now = _set(tmp_path, "x", "s-x", opened_ago=30, active_ago=None)
    (tmp_path / "runs" / "r" / "x" / "sessions" / "s-x" / "ACTIVE.json").write_text("{not json")
    assert store.activity.last("r", "x", "s-x") is None
    assert store.sweeper.reclaim_stale(6 * 3600, now=now.timestamp()) == []  # counted from its opening: 30 s ago


# -- end to end: writer processes against ckptd serve --------------------------------------------------

WRITER = textwrap.dedent("""
    import sys, time
    from ckptd_client.transport import Transport
    from ckptd_client.session_calls import open_session, put_index
    from ckptd_schemas import RankIndex
    url, name, world, late, hold, linger, data_hex, xxh3, index_json = sys.argv[1:10]
    data, index = bytes.fromhex(data_hex), RankIndex.model_validate_json(index_json)
    t = Transport(url)
    base = f"/v1/checkpoints/r/{name}"
    time.sleep(float(late))  # a rank whose upload queue is longer: it joins late
    open_session(t, base, "s-" + name, int(world), 1)
    t.request("PUT", f"{base}/sessions/s-{name}/files/{index.files[0]}", content=lambda: data,
              headers={"X-Ckptd-Xxh3": xxh3, "Content-Length": str(len(data)),
                       "Content-Type": "application/octet-stream"})
    print("staged", flush=True)
    time.sleep(float(hold))  # a rank between writes: its keep-alives go on
    print(put_index(t, base, "s-" + name, index).state, flush=True)
    time.sleep(float(linger))  # done with its part, alive while the others catch up
""")


def _writer(url: str, name: str, *, rank: int = 0, world: int = 1, late: float = 0, hold: float = 0,
            linger: float = 0, wait_staged: bool = True) -> subprocess.Popen:
    p = subprocess.Popen([sys.executable, "-c", WRITER, url, name, str(world), str(late), str(hold), str(linger),
                          DATA.hex(), xxhash.xxh3_64_hexdigest(DATA), _index(rank, world).model_dump_json()],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO)
    if wait_staged:
        line = p.stdout.readline()
        assert line.strip() == "staged", (line, p.stderr.read() if p.poll() is not None else "")
    return p


@pytest.mark.timeout(300)
def test_a_killed_save_is_reclaimed_within_the_window_and_a_live_one_commits(tmp_path):
    dead_after = scaled(3.0)  # keep-alives every tenth of it: nine may be late or lost before it matters
    root = tmp_path / "root"
    srv = ServerProcess(root, log=tmp_path / "server.log",
                        env={"CKPTD_DEAD_SESSION_AFTER": str(dead_after), "CKPTD_RECLAIM_INTERVAL": "0.5"}).start()
    live = dead = first = second = None
    try:
        live = _writer(srv.url, "live", hold=4 * dead_after)  # silent but for keep-alives: four windows
        dead = _writer(srv.url, "dead", hold=3600)
        # two ranks of one save, the second joining three windows after the first sent its index
        first = _writer(srv.url, "apart", rank=0, world=2, linger=6 * dead_after)
        second = _writer(srv.url, "apart", rank=1, world=2, late=3 * dead_after, wait_staged=False)
        ddir = root / "runs" / "r" / "dead" / "sessions" / "s-dead"
        assert (ddir / "files" / "r000000-0000.bin").exists()
        time.sleep(2 * dead_after)  # both alive through two windows: kept
        assert ddir.exists()
        # its last recorded activity: the keep-alives after this read (until the kill) only make it later
        heard = datetime.fromisoformat(json.loads((ddir / "ACTIVE.json").read_text())["at"])
        os.kill(dead.pid, signal.SIGKILL)
        dead.wait()
        killed = time.monotonic()
        while ddir.exists():
            assert time.monotonic() - killed < scaled(dead_after + 30), "a dead session was not reclaimed"
            time.sleep(0.1)
        silent = (datetime.now(timezone.utc) - heard).total_seconds()
        assert silent >= dead_after, f"reclaimed {silent:.1f} s after its writer was last heard: it was not dead yet"
        metrics = httpx.get(f"{srv.url}/metrics", timeout=10).text
        assert "ckptd_sessions_reclaimed_total 1.0" in metrics, metrics[-3000:]
        st = httpx.get(f"{srv.url}/v1/checkpoints/r/dead/sessions/s-dead", timeout=10)
        assert st.status_code == 404 and st.json()["error"]["code"] == "session_not_found", st.text
        # the live writer, silent but alive, commits after four windows
        out, err = live.communicate(timeout=scaled(60))
        assert live.returncode == 0 and out.strip() == "committed", err[-2000:]
        assert httpx.get(f"{srv.url}/v1/checkpoints/r/live", timeout=10).status_code == 200
        # the rank done first kept the session alive until the late one joined and committed it
        out, err = second.communicate(timeout=scaled(60))
        assert second.returncode == 0 and out.split() == ["staged", "committed"], out + err[-2000:]
        assert first.stdout.readline().strip() == "open"  # its index, before the other rank's
        assert httpx.get(f"{srv.url}/v1/checkpoints/r/apart", timeout=10).json()["topology"]["world_size"] == 2
        # a keep-alive for a session that is gone, or committed, is told so (and ends the client's keep-alives)
        gone = httpx.post(f"{srv.url}/v1/checkpoints/r/dead/sessions/s-dead/alive", timeout=10)
        assert gone.status_code == 404 and gone.json()["error"]["code"] == "session_not_found", gone.text
        done = httpx.post(f"{srv.url}/v1/checkpoints/r/live/sessions/s-live/alive", timeout=10)
        assert done.status_code == 409 and done.json()["error"]["code"] == "already_committed", done.text
    finally:
        for p in (live, dead, first, second):
            if p is not None and p.poll() is None:
                p.kill()
        srv.stop()


def test_the_client_keeps_a_session_alive_until_it_is_over_and_no_longer(tmp_path):
    from ckptd_client._keepalive import KEEPALIVE
    from ckptd_client.session_calls import open_session, put_index
    from ckptd_client.transport import Transport

    srv = ServerProcess(tmp_path / "root", env={"CKPTD_DEAD_SESSION_AFTER": "2"}).start()
    t = Transport(srv.url)
    try:
        def held(name: str) -> bool:
            return f"/v1/checkpoints/r/{name}/sessions/s-{name}" in KEEPALIVE.held()

        def gone(name: str) -> None:
            deadline = time.monotonic() + scaled(10)
            while held(name):
                assert time.monotonic() < deadline, f"keep-alives of {name} never stopped"
                time.sleep(0.05)

        for name in ("c", "x"):
            open_session(t, f"/v1/checkpoints/r/{name}", f"s-{name}", 1, 1)
            assert held(name)
        active = tmp_path / "root" / "runs" / "r" / "c" / "sessions" / "s-c" / "ACTIVE.json"
        deadline = time.monotonic() + scaled(10)
        while not active.exists():  # the keep-alive, before any write
            assert time.monotonic() < deadline, "no keep-alive arrived"
            time.sleep(0.05)
        t.request("PUT", "/v1/checkpoints/r/c/sessions/s-c/files/r000000-0000.bin", content=lambda: DATA,
                  headers={"X-Ckptd-Xxh3": xxhash.xxh3_64_hexdigest(DATA), "Content-Length": str(len(DATA))})
        assert put_index(t, "/v1/checkpoints/r/c", "s-c", _index()).state == "committed"
        gone("c")  # the service answered 409 committed: nothing left to keep
        t.close()
        gone("x")  # its client closed: nobody here writes it any more
    finally:
        t.close()
        srv.stop()


def test_a_burst_of_keep_alives_costs_the_store_one_write(tmp_path):
    """A thousand ranks' keep-alives within one recording interval: one write of the activity record
    and no read at all after the first (the process remembers when it last recorded)."""
    calls: list[str] = []

    class Counting(LocalStorage):
        def read_or_none(self, key: str):  # noqa: ANN201
            calls.append(f"read {key}")
            return super().read_or_none(key)

        def put(self, key: str, data: bytes) -> None:
            calls.append(f"put {key}")
            super().put(key, data)

    store = SessionStore(Counting(tmp_path), dead_after=300)
    _stage(store, "big", "s-big")
    calls.clear()
    store.keep_alive("r", "big", "s-big")  # recorded moments ago by the upload: nothing to do
    assert calls == []
    store.activity._written.clear()  # this process has not recorded it (another replica did)
    for _ in range(1000):
        store.keep_alive("r", "big", "s-big")
    writes = [c for c in calls if c.startswith("put")]
    assert writes == [f"put {Paths.activity('r', 'big', 's-big')}"], writes
    assert len(calls) < 10, calls  # the first keep-alive's checks (session, marker, refusal), then none
    with pytest.raises(Exception) as e:  # a session that is not there is told so, and nothing is written
        store.keep_alive("r", "big", "s-nope")
    assert type(e.value).__name__ == "SessionNotFound"
    assert not (tmp_path / "runs" / "r" / "big" / "sessions" / "s-nope").exists()


def test_gc_reclaims_dead_staging_offline_and_through_the_service(tmp_path):
    """``ckptd gc`` sweeps too: through the service it runs the service's own sweep (its settings, its
    metric), offline the same rule with ``--dead-after``. A session whose writer is still heard from stays."""
    root = tmp_path / "root"
    store = SessionStore(LocalStorage(root), dead_after=300)
    probe = root / "runs" / "z" / "probe" / "sessions" / "s-probe"
    store.open("z", "probe", OpenSession(session="s-probe", world_size=1, step=1))
    _set_run(root, "z", "probe", "s-probe", opened_ago=1200, active_ago=900)
    srv = ServerProcess(root, env={"CKPTD_RECLAIM_INTERVAL": "86400"}).start()  # one sweep at start, then gc's
    try:
        deadline = time.monotonic() + scaled(30)
        while probe.exists():  # the start-up sweep is done (run r did not exist when it listed the runs)
            assert time.monotonic() < deadline, "the start-up sweep never ran"
            time.sleep(0.05)
        _stage(store, "dead", "s-dead")
        _stage(store, "live", "s-live")
        _set(root, "dead", "s-dead", opened_ago=1200, active_ago=900)  # its writers stopped 15 minutes ago
        _set(root, "live", "s-live", opened_ago=1200, active_ago=10)
        out = subprocess.run([sys.executable, "-m", "ckptd.cli.main", "gc", "r", "--keep-last", "1", "--server",
                              srv.url, "--json"], capture_output=True, text=True, timeout=scaled(120), cwd=REPO)
        assert out.returncode == 0, out.stderr
        assert json.loads(out.stdout)["reclaimed_sessions"] == ["r/dead/s-dead"], out.stdout
        # counted by the service: the probe by its start-up sweep, the dead session by gc's (the same sweep)
        assert "ckptd_sessions_reclaimed_total 2.0" in httpx.get(f"{srv.url}/metrics", timeout=10).text
    finally:
        srv.stop()
    assert (root / "runs" / "r" / "live" / "sessions" / "s-live" / "files" / "r000000-0000.bin").exists()
    _set(root, "live", "s-live", opened_ago=1200, active_ago=120)  # its writer stopped two minutes ago
    offline = [sys.executable, "-m", "ckptd.cli.main", "gc", "r", "--keep-last", "1", "--root", str(root), "--json"]
    out = subprocess.run(offline, capture_output=True, text=True, timeout=scaled(120), cwd=REPO)
    assert out.returncode == 0 and json.loads(out.stdout)["reclaimed_sessions"] == [], out.stdout + out.stderr
    out = subprocess.run(offline + ["--dead-after", "60"], capture_output=True, text=True, timeout=scaled(120),
                         cwd=REPO)
    assert out.returncode == 0 and json.loads(out.stdout)["reclaimed_sessions"] == ["r/live/s-live"], out.stdout


def test_a_keep_alive_right_after_the_commit_or_abort_is_told_so(tmp_path):
    """The keep-alive that comes moments after this process recorded the session's activity is not
    answered from that memory once the session ended: committed is 409, aborted 404, as documented."""
    from ckptd_schemas import AlreadyCommitted, SessionNotFound

    store = SessionStore(LocalStorage(tmp_path))
    _stage(store, "k", "s-k")
    store.keep_alive("r", "k", "s-k")  # recorded just now: the next one would be "fresh"
    assert store.put_index("r", "k", "s-k", _index()).state == "committed"
    with pytest.raises(AlreadyCommitted):
        store.keep_alive("r", "k", "s-k")
    _stage(store, "a", "s-a")
    store.keep_alive("r", "a", "s-a")
    store.sweeper.abort("r", "a", "s-a")
    with pytest.raises(SessionNotFound):
        store.keep_alive("r", "a", "s-a")
