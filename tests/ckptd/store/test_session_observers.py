"""The write side tells what happened through one channel, and no observer changes what happened.

A :class:`~ckptd.store.sessions.SessionStore`'s observers (``ckptd.store.events``: the service's
metrics, and each action after a commit as an ``AfterCommit``) hear every hook in the order they
were added: a session opened, every commit that created a marker here whichever path committed (a
rank's index, the sweep), a refusal, what a sweep reclaimed. An observer that raises is logged; the
save goes on as if it were not there: the checkpoint is committed and visible, a refusal is the same
refusal, the sweep still sweeps, and the observers after it still hear.
"""

from __future__ import annotations

import logging
import time

import pytest
import xxhash

from ckptd.storage import LocalStorage
from ckptd.store.events import AfterCommit, CommitEvent, SessionEvents
from ckptd.store.paths import Paths

from .staging import store_index
from ckptd.store.sessions import SessionStore
from ckptd_schemas import CkptdError, OpenSession, RankIndex

DATA = bytes(range(250)) * 4  # 1,000 bytes: 250 float32 values
FILE = "r000000-0000.bin"


def _index(xxh3: str = xxhash.xxh3_64_hexdigest(DATA)) -> RankIndex:
    return RankIndex.model_validate({"rank": 0, "world_size": 1, "files": [FILE], "tensors": [{
        "name": "model.x", "shape": [250], "dtype": "float32", "group": "model", "chunks": [{
            "kind": "box", "rank": 0, "offsets": [0], "sizes": [250], "location": {
                "file": FILE, "offset": 0, "length": len(DATA), "raw_length": len(DATA), "xxh3": xxh3}}]}]})


def _stage(store: SessionStore, name: str, sid: str = "s0000001") -> None:
    store.open("r", name, OpenSession(session=sid, world_size=1, step=1))
    sink = store.intake.receive("r", name, sid, FILE)
    sink.write(DATA)
    sink.finish(xxhash.xxh3_64_hexdigest(DATA))


class Failing(SessionEvents):
    """An observer whose every hook raises."""

    def opened(self, *args: object) -> None:
        raise RuntimeError("observer down")

    committed = refused = reclaimed = opened


class Heard(SessionEvents):
    def __init__(self) -> None:
        self.heard: list[tuple[str, object]] = []

    def opened(self, run: str, name: str, sid: str) -> None:
        self.heard.append(("opened", f"{run}/{name}/{sid}"))

    def committed(self, event: CommitEvent, seconds: float) -> None:
        self.heard.append(("committed", f"{event.run}/{event.name}/{event.session}"))

    def refused(self, run: str, name: str, sid: str, error: CkptdError) -> None:
        self.heard.append(("refused", error.code))

    def reclaimed(self, keys: list[str]) -> None:
        self.heard.append(("reclaimed", keys))


def test_a_failing_observer_never_changes_a_commit_and_the_others_still_hear(tmp_path, caplog):
    heard, after = Heard(), []
    store = SessionStore(LocalStorage(tmp_path), observers=[Failing(), AfterCommit(after.append)])
    store.observers.add(heard)
    caplog.set_level(logging.ERROR, logger="ckptd.store")
    _stage(store, "1")
    assert store.put_index("r", "1", "s0000001", _index()).state == "committed"
    assert store.visibility.check("r", "1") is not None  # visible: nothing the failing observer did undid it
    assert [(e.run, e.name, e.session) for e in after] == [("r", "1", "s0000001")]
    assert heard.heard == [("opened", "r/1/s0000001"), ("committed", "r/1/s0000001")]
    logged = [r.getMessage() for r in caplog.records if "Failing" in r.getMessage()]
    assert [m.split(":")[0] for m in logged] == ["session event opened", "session event committed"], logged
    # A retried index is answered from the commit: no second commit, no second event.
    assert store.put_index("r", "1", "s0000001", _index()).state == "committed"
    assert len(after) == 1 and heard.heard.count(("committed", "r/1/s0000001")) == 1


def test_the_sweeps_commit_and_reclaim_and_a_refusal_are_told_on_the_same_channel(tmp_path):
    heard, after = Heard(), []
    storage = LocalStorage(tmp_path)
    writer = SessionStore(storage)  # a replica that died after the last index, before the marker
    _stage(writer, "2")
    store_index(storage, "r", "2", "s0000001", _index())
    _stage(writer, "3")  # a session whose writer is gone
    store = SessionStore(LocalStorage(tmp_path), dead_after=300, observers=[Failing(), heard, AfterCommit(after.append)])
    assert store.sweeper.reclaim_stale(3600, now=time.time() + 1000) == ["r/3/s0000001"]
    assert store.visibility.check("r", "2") is not None
    assert heard.heard == [("committed", "r/2/s0000001"), ("reclaimed", ["r/3/s0000001"])]
    assert [(e.name, e.session) for e in after] == [("2", "s0000001")]

    _stage(store, "4")
    with pytest.raises(CkptdError) as refused:
        store.put_index("r", "4", "s0000001", _index(xxh3="0" * 16))  # the stored bytes say otherwise
    assert heard.heard[-2:] == [("opened", "r/4/s0000001"), ("refused", refused.value.code)]
    assert store.visibility.check("r", "4") is None and store.status("r", "4", "s0000001").state == "failed"
    assert len(after) == 1
