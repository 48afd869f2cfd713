"""``ckptd.store.sweep``: the sweep reclaims what will not commit, recovers what should have, and never
touches a committed checkpoint.

Over a real local root, sessions staged through the session store and a ``Sweeper`` wired as the
store wires it (``staging.Parts``: another process over the same root), swept at chosen times:

* a session with no live writer past ``dead_after`` is deleted, one heard from recently is kept, and the
  observers hear what was deleted;
* a committed checkpoint's session is never deleted, however late the sweep, and the checkpoint stays
  visible with its bytes; a losing session of the same ref is reclaimed like any other;
* a complete session left without its marker is committed by the sweep, unless its commit was refused;
* a folder that is not a session this store made is left alone; one without its record is deleted
  only on the second sweep that finds it (it may be being opened);
* under a marker that does not parse, nothing is touched;
* ``abort`` deletes an open session, refuses a committed one (``AlreadyCommitted``) and one under a
  marker that does not parse (``Conflict``).
"""

from __future__ import annotations

import json
import logging
import time

import pytest

from ckptd.storage import LocalStorage
from ckptd.store import SessionStore
from ckptd.store.paths import Paths
from ckptd.store.session_reads import read_meta
from ckptd.store.sweep import Sweeper
from ckptd_schemas import AlreadyCommitted, Conflict, InvalidName

from .staging import Parts, data, file_of, index, put_indexes, stage, store_index

DEAD = 300.0
TTL = 6 * 3600.0


@pytest.fixture
def store(tmp_path) -> SessionStore:
    return SessionStore(LocalStorage(tmp_path), dead_after=DEAD)


def _sweeper(tmp_path) -> tuple[Sweeper, Parts]:
    parts = Parts(LocalStorage(tmp_path), dead_after=DEAD)
    return parts.sweeper, parts


def _exists(tmp_path, run: str, name: str, sid: str) -> bool:
    return (tmp_path / Paths.session(run, name, sid)).is_dir()


def test_a_session_with_no_live_writer_is_reclaimed_and_a_recent_one_is_kept(store, tmp_path):
    stage(store, "r", "idle", "s-idle")
    sweeper, parts = _sweeper(tmp_path)
    assert sweeper.reclaim_stale(TTL, now=time.time() + DEAD - 60) == []  # heard from less than DEAD ago
    assert _exists(tmp_path, "r", "idle", "s-idle") and parts.heard.reclaims == []
    assert sweeper.reclaim_stale(TTL, now=time.time() + DEAD + 60) == ["r/idle/s-idle"]
    assert not _exists(tmp_path, "r", "idle", "s-idle")
    assert parts.heard.reclaims == [["r/idle/s-idle"]]


def test_a_committed_checkpoint_is_never_swept(store, tmp_path):
    stage(store, "r", "1", "s-won", world=2)
    stage(store, "r", "1", "s-lost", world=2, ranks=[0])  # a second attempt that lost the race
    put_indexes(store, "r", "1", "s-won", world=2)
    committed = sorted(p.relative_to(tmp_path) for p in (tmp_path / Paths.session("r", "1", "s-won")).rglob("*"))
    sweeper, parts = _sweeper(tmp_path)
    ten_years = time.time() + 10 * 365 * 86400.0
    assert sweeper.reclaim_stale(TTL, now=ten_years) == ["r/1/s-lost"]
    assert sweeper.reclaim_stale(TTL, now=ten_years + 1) == []
    assert sorted(p.relative_to(tmp_path) for p in (tmp_path / Paths.session("r", "1", "s-won")).rglob("*")) \
        == committed
    c = parts.visibility.check("r", "1")
    assert c is not None and c.session == "s-won"
    for r in range(2):
        assert (tmp_path / Paths.file("r", "1", "s-won", file_of(r))).read_bytes() == data(r)


def test_a_complete_session_left_without_its_marker_is_committed(store, tmp_path):
    stage(store, "r", "2", "s-a", world=2)
    put_indexes(store, "r", "2", "s-a", world=2, ranks=[0])
    # the last index was stored, and the process died before the commit
    store_index(store.storage, "r", "2", "s-a", index(1, 2))
    sweeper, parts = _sweeper(tmp_path)
    assert parts.visibility.check("r", "2") is None
    assert sweeper.reclaim_stale(TTL, now=time.time()) == []
    c = parts.visibility.check("r", "2")
    assert c is not None and c.session == "s-a"
    assert [(e.run, e.name, e.session) for e in parts.heard.commits] == [("r", "2", "s-a")]
    assert sweeper.reclaim_stale(TTL, now=time.time() + 10 * TTL) == []  # and then never swept


def test_a_session_still_missing_indexes_is_left_to_its_writers(store, tmp_path, caplog):
    stage(store, "r", "2", "s-a", world=2)
    put_indexes(store, "r", "2", "s-a", world=2, ranks=[0])
    sweeper, parts = _sweeper(tmp_path)
    with caplog.at_level(logging.INFO, logger="ckptd.store"):
        assert sweeper.reclaim_stale(TTL, now=time.time()) == []
    assert caplog.records == []  # no commit tried (and failed) on it
    assert parts.visibility.marker("r", "2") is None and parts.heard.refusals == []
    assert not (tmp_path / Paths.failed("r", "2", "s-a")).exists()
    put_indexes(store, "r", "2", "s-a", world=2, ranks=[1])  # the last rank arrives: it commits
    assert parts.visibility.check("r", "2").session == "s-a"


def test_a_complete_session_whose_commit_was_refused_is_not_recovered_but_reclaimed(store, tmp_path):
    stage(store, "r", "3", "s-a")
    bad = index(0, 1, payload=b"\x01" * 1000)  # a chunk digest the stored bytes do not have
    store_index(store.storage, "r", "3", "s-a", bad)
    sweeper, parts = _sweeper(tmp_path)
    assert sweeper.reclaim_stale(TTL, now=time.time()) == []
    assert parts.visibility.marker("r", "3") is None
    failed = json.loads((tmp_path / Paths.failed("r", "3", "s-a")).read_text())
    assert failed["error"]["code"] == "checksum_mismatch"
    assert failed["error"]["details"]["tensor"] == "model.x" and failed["error"]["details"]["file"] == file_of(0)
    assert [(r, n, s) for r, n, s, _ in parts.heard.refusals] == [("r", "3", "s-a")]
    again, parts2 = _sweeper(tmp_path)  # a later sweep does not try the refused commit again
    assert again.reclaim_stale(TTL, now=time.time()) == [] and parts2.heard.refusals == []
    assert again.reclaim_stale(TTL, now=time.time() + DEAD + 60) == ["r/3/s-a"]


def test_folders_that_are_not_sessions_of_this_store(store, tmp_path):
    stage(store, "r", "4", "s-a")
    foreign = tmp_path / Paths.sessions("r", "4") / "not.a.session"  # no session id has dots
    foreign.mkdir()
    (foreign / "keep.txt").write_text("someone else's")
    orphan = tmp_path / Paths.session("r", "4", "s-orphan")  # no SESSION.json: maybe being opened now
    orphan.mkdir()
    (orphan / "files").mkdir()
    sweeper, _ = _sweeper(tmp_path)
    late = time.time() + 10 * TTL
    assert sweeper.reclaim_stale(TTL, now=late) == ["r/4/s-a"]
    assert orphan.is_dir() and foreign.is_dir()
    assert sweeper.reclaim_stale(TTL, now=late) == ["r/4/s-orphan"]  # still without a record: gone
    assert not orphan.exists() and (foreign / "keep.txt").read_text() == "someone else's"


def test_nothing_is_touched_under_a_marker_that_does_not_parse(store, tmp_path):
    stage(store, "r", "5", "s-a")
    stage(store, "r", "5", "s-b")
    (tmp_path / Paths.marker("r", "5")).write_text("{garbage")
    stage(store, "r", "6", "s-c")  # another checkpoint of the run is swept as usual
    sweeper, _ = _sweeper(tmp_path)
    assert sweeper.reclaim_stale(TTL, now=time.time() + 10 * TTL) == ["r/6/s-c"]
    assert _exists(tmp_path, "r", "5", "s-a") and _exists(tmp_path, "r", "5", "s-b")
    with pytest.raises(Conflict) as info:
        sweeper.abort("r", "5", "s-a")
    assert not isinstance(info.value, AlreadyCommitted) and info.value.details == {"ref": "r/5"}
    assert _exists(tmp_path, "r", "5", "s-a")


def test_nothing_is_touched_under_a_marker_whose_manifest_is_gone(store, tmp_path):
    stage(store, "r", "10", "s-a")
    stage(store, "r", "10", "s-b")
    put_indexes(store, "r", "10", "s-a")
    sweeper, parts = _sweeper(tmp_path)
    marker = parts.visibility.marker("r", "10")
    (tmp_path / Paths.session("r", "10", "s-a") / marker.manifest).unlink()  # the checkpoint is invisible now
    assert sweeper.reclaim_stale(TTL, now=time.time() + 10 * TTL) == []
    assert _exists(tmp_path, "r", "10", "s-a") and _exists(tmp_path, "r", "10", "s-b")
    assert (tmp_path / Paths.file("r", "10", "s-a", file_of(0))).read_bytes() == data(0)


def test_abort(store, tmp_path):
    stage(store, "r", "7", "s-open")
    stage(store, "r", "8", "s-done")
    put_indexes(store, "r", "8", "s-done")
    sweeper, parts = _sweeper(tmp_path)
    sweeper.abort("r", "7", "s-open")
    assert not _exists(tmp_path, "r", "7", "s-open")
    sweeper.abort("r", "7", "s-open")  # again: nothing left, no error
    with pytest.raises(AlreadyCommitted) as info:
        sweeper.abort("r", "8", "s-done")
    assert info.value.details == {"ref": "r/8"}
    assert parts.visibility.check("r", "8") is not None
    for bad in (("R", "8", "s-done"), ("r", "../8", "s-done"), ("r", "8", "s.done")):
        with pytest.raises(InvalidName):
            sweeper.abort(*bad)


def test_reclaim_of_says_when_and_why(store, tmp_path):
    stage(store, "r", "9", "s-a")
    sweeper, parts = _sweeper(tmp_path)
    meta = read_meta(parts.storage, "r", "9", "s-a")
    last = parts.activity.last("r", "9", "s-a")
    r = sweeper.reclaim_of("r", "9", "s-a", meta, TTL)
    assert (r.reason, r.last) == ("idle", last) and (r.at - last).total_seconds() == DEAD
    r = sweeper.reclaim_of("r", "9", "s-a", meta, 60.0)  # a TTL shorter than the idle window
    assert r.reason == "expired" and (r.at - meta.created_at).total_seconds() == 60.0
