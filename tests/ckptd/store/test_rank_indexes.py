"""The stored form of rank indexes (``ckptd.store.rank_indexes``), on a real local root.

Names say what an object holds, and junk never counts; indexes arriving together are stored in fewer
objects than ranks; a write that fails fails each index it held, and none is listed; an object that is
not what its name says is refused at the commit; an index sent again keeps one object per rank here.
"""

from __future__ import annotations

import json
import os
import threading
import time

import pytest

from ckptd.storage import LocalStorage
from ckptd.store import SessionStore
from ckptd.store.paths import Paths, RankBatch, rank_batch
from ckptd.store import rank_indexes
from ckptd.store.rank_indexes import BatchWriter, kept_key, ranks_done, stored
from ckptd.store.session_reads import read_meta
from ckptd.store.visibility import Visibility
from ckptd_schemas import InvalidIndex, RankIndex, StorageError

from support import scaled
from .staging import index, put_indexes, stage


class SlowPuts(LocalStorage):
    """A local root whose object writes under ``ranks/`` wait for ``go`` (or fail while ``fail`` is set)."""

    def __init__(self, root) -> None:
        super().__init__(root)
        self.go, self.fail, self.puts = threading.Event(), threading.Event(), []
        self.go.set()

    def put(self, key: str, data: bytes) -> None:
        if "/ranks/" in key:
            self.puts.append(key)
            assert self.go.wait(scaled(30))
            if self.fail.is_set():
                raise StorageError("the store refused the write", key=key)
        super().put(key, data)


def _incarnation(store: SessionStore, sid: str, name: str = "1") -> str:
    return read_meta(store.storage, "r", name, sid).created_at.isoformat()


def test_a_name_says_its_window_stamp_and_ranks_and_nothing_else_parses():
    b = RankBatch(window=3, stamp=1765000000123, nonce="0a1b2c3d", tag="deadbeef", ranks=(1536, 1540, 2047))
    key = Paths.rank_batch("r", "1", "s", b)
    rel = key.split("/ranks/", 1)[1]
    assert rel.startswith("00003/1765000000123-0a1b2c3d-deadbeef-") and len(rel.rsplit("/", 1)[1]) < 200
    assert rank_batch(rel) == b
    for junk in ["00003/.1765000000123-0a1b2c3d-deadbeef-11.json.tmp-1", "00003/1765000000123-0a1b2c3d-deadbeef-0.json",
                 "00003/1765000000123-0a1b2c3d-deadbeef-11.json.part", "0000003.json", "00003/notes.json",
                 "00003/1765000000123-0a1b2c3d-deadbeef-" + "f" * 129 + ".json", "3/1765000000123-0a1b2c3d-deadbeef-1.json"]:
        assert rank_batch(junk) is None, junk


def test_ranks_done_lists_this_incarnations_stored_indexes_and_nothing_else(tmp_path):
    store = SessionStore(LocalStorage(tmp_path))
    stage(store, "r", "1", "s-a", world=12)
    inc = _incarnation(store, "s-a")
    assert ranks_done(store.storage, "r", "1", "s-a", inc) == []  # no ranks folder yet
    put_indexes(store, "r", "1", "s-a", world=12, ranks=[10, 0, 3])
    window = tmp_path / Paths.rank_window("r", "1", "s-a", 0)
    (window / ".1765000000000-00000000-00000000-10.json.tmp-0123456789ab").write_text("{}")  # killed mid-write
    (window / "1765000000000-00000000-00000000-20.json.part").write_text("{}")
    (window / "notes.json").write_text("{}")
    other = f"1765000000000-00000000-{'0' * 7}1-40.json"  # rank 6, but of another incarnation of the session
    (window / other).write_text("{}")
    assert ranks_done(store.storage, "r", "1", "s-a", inc) == [0, 3, 10]
    assert ranks_done(store.storage, "r", "1", "s-b", inc) == []


def test_indexes_arriving_together_are_stored_in_fewer_objects_and_commit(tmp_path):
    storage = SlowPuts(tmp_path)
    store = SessionStore(storage)
    stage(store, "r", "1", "s", world=16)
    storage.go.clear()  # the first write waits: the others arrive meanwhile and share the next one
    answers: dict[int, str] = {}
    threads = [threading.Thread(target=lambda r=r: answers.__setitem__(r, store.put_index("r", "1", "s", index(r, 16)).state))
               for r in range(16)]
    for t in threads:
        t.start()
    pause, deadline = threading.Event(), time.monotonic() + scaled(30)  # pause: never set, a sleep
    kept = lambda: [store._indexes.state(kept_key("r", "1", "s", r)) for r in range(16)]  # noqa: E731
    while (len(storage.puts) < 1 or None in kept()) and time.monotonic() < deadline:
        pause.wait(0.01)  # every index checked and kept: the other 15 wait behind the first write
    pause.wait(0.05)
    storage.go.set()
    for t in threads:
        t.join(scaled(60))
    assert sorted(answers) == list(range(16)) and list(answers.values()).count("committed") >= 1, answers
    assert 2 <= len(storage.puts) <= 4, storage.puts  # 16 with one object per rank
    c = Visibility(storage).check("r", "1")
    assert c is not None
    assert [t.name for t in Visibility(storage).manifest(c).tensors] == ["model.x"]


def test_a_write_that_fails_fails_each_index_it_held_and_none_is_listed(tmp_path):
    storage = SlowPuts(tmp_path)
    store = SessionStore(storage)
    stage(store, "r", "1", "s", world=4)
    storage.fail.set()
    for r in (0, 1):
        with pytest.raises(StorageError):
            store.put_index("r", "1", "s", index(r, 4))
    assert ranks_done(storage, "r", "1", "s", _incarnation(store, "s")) == []
    storage.fail.clear()
    put_indexes(store, "r", "1", "s", world=4)  # sent again: stored, and the session commits
    assert Visibility(storage).check("r", "1") is not None


@pytest.mark.parametrize("edit", ["garbage", "other incarnation", "another rank", "too large", "fifo"])
def test_an_object_that_is_not_what_its_name_says_is_refused_at_the_commit(tmp_path, monkeypatch, edit):
    storage = LocalStorage(tmp_path)
    a, b = SessionStore(storage), SessionStore(storage)
    stage(a, "r", "1", "s", world=2)
    a.put_index("r", "1", "s", index(0, 2))
    [key] = stored(storage, "r", "1", "s", _incarnation(a, "s")).values()
    body = json.loads(storage.read(key))
    if edit == "garbage":
        raw = b"{not json"
    elif edit == "other incarnation":
        raw = json.dumps({**body, "incarnation": "2020-01-01T00:00:00+00:00"}).encode()
    elif edit == "another rank":
        body["ranks"][0]["index"]["rank"] = 1
        raw = json.dumps(body).encode()
    elif edit == "too large":  # a valid object, larger than any written: refused for its size (read whole,
        # it would commit)
        monkeypatch.setattr(rank_indexes, "MAX_OBJECT_BYTES", 64 << 10)
        raw = storage.read(key) + b" " * (1 << 20)
    else:  # never opened for a blocking read, and not a store error to retry: refused
        raw = None
        (tmp_path / key).unlink()
        os.mkfifo(tmp_path / key)
    if raw is not None:
        (tmp_path / key).write_bytes(raw)
    with pytest.raises(InvalidIndex) as info:
        b.put_index("r", "1", "s", index(1, 2))  # the commit at b reads rank 0's object
    assert key.rsplit("/", 1)[1] in info.value.message
    assert ("holds more than 65536 bytes" in info.value.message) == (edit == "too large"), info.value.message
    assert ("is not a regular file" in info.value.message) == (edit == "fifo"), info.value.message
    assert Visibility(storage).check("r", "1") is None


def test_an_index_whose_object_would_be_larger_than_any_read_is_refused_and_stores_nothing(tmp_path, monkeypatch):
    """The bound a commit reads an object by holds for what is written too: an index that, with its
    files' records, would make a larger object is refused naming its rank, and nothing is stored."""
    store = SessionStore(LocalStorage(tmp_path))
    stage(store, "r", "1", "s", world=1)
    monkeypatch.setattr(rank_indexes, "MAX_OBJECT_BYTES", 256)
    with pytest.raises(InvalidIndex) as info:
        store.put_index("r", "1", "s", index(0, 1))
    assert info.value.details["rank"] == 0 and "more than an object of rank indexes holds (256)" in info.value.message
    assert ranks_done(store.storage, "r", "1", "s", _incarnation(store, "s")) == []
    monkeypatch.undo()
    assert store.put_index("r", "1", "s", index(0, 1)).state == "committed"  # nothing of the refusal kept


def test_an_index_sent_again_unchanged_stores_nothing_and_changed_replaces_what_held_it(tmp_path):
    """A rank's index sent again (a retry whose answer was lost) stores nothing more when it is the same;
    sent again with other content, it is stored anew and the object that held it before, holding nothing
    current any more, is deleted: however often a writer sends it, one object holds the rank here (the
    root's reserve takes indexes, bounded by one per rank)."""
    storage = LocalStorage(tmp_path)
    store = SessionStore(storage)
    stage(store, "r", "1", "s", world=3)
    inc = _incarnation(store, "s")
    objects = lambda: sorted(k for k, _ in storage.walk(Paths.ranks("r", "1", "s")))  # noqa: E731
    store.put_index("r", "1", "s", index(0, 3))
    first = objects()
    for _ in range(3):
        store.put_index("r", "1", "s", index(0, 3))
    assert objects() == first
    raw = json.loads(index(0, 3).model_dump_json())
    raw["coords"] = {"dp": 0}
    changed = [RankIndex.model_validate(raw), index(0, 3)]  # the last sent is the first again
    for k in range(4):
        store.put_index("r", "1", "s", changed[k % 2])
        assert len(objects()) == 1, objects()
    assert objects() != first and list(stored(storage, "r", "1", "s", inc)) == [0]
    put_indexes(store, "r", "1", "s", world=3, ranks=[1, 2])
    assert Visibility(storage).check("r", "1") is not None


def test_a_session_forgotten_after_its_commit_keeps_what_was_written_for_it(tmp_path):
    """What a writer remembers of a session (which object holds each rank's index) ends with the session:
    after ``forget`` (the commit's, whether it committed or failed) nothing written for it is deleted."""
    storage = LocalStorage(tmp_path)
    store = SessionStore(storage)
    stage(store, "r", "1", "s", world=2)
    inc = _incarnation(store, "s")
    writer = BatchWriter(storage)
    raw = index(0, 2).model_dump_json().encode()
    writer.store("r", "1", "s", inc, 0, raw, {})
    first = set(stored(storage, "r", "1", "s", inc).values())
    writer.store("r", "1", "s", inc, 0, raw, {})  # replaced: the first object goes
    second = set(stored(storage, "r", "1", "s", inc).values())
    assert len(second) == 1 and second != first and len(list(storage.walk(Paths.ranks("r", "1", "s")))) == 1
    writer.forget("r", "1", "s")
    writer.store("r", "1", "s", inc, 0, raw, {})  # after forget: nothing written before is deleted
    assert len(list(storage.walk(Paths.ranks("r", "1", "s")))) == 2
