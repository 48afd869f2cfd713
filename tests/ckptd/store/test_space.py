"""``ckptd.store.space``: a writer's quota is asked on every way bytes come into a session.

Over a real local root (and moto's S3 for presigned uploads), a session store wired with a
:class:`Space`; the writer is the service's own ``Principal`` with a quota:

* received bytes are charged batch by batch: the batch that would pass the quota is refused
  (``QuotaExceeded`` naming token, quota, holding, run, file), and no file or record is left;
* a link is charged the linked file's size before it is made, a presign its declared size before
  any claim or URL exists, a rank index its size (to the quota only: the reserve takes indexes,
  manifests and markers, so a save whose data has arrived commits);
* what the writer holds is measured on the root: the runs its write scopes match and no others,
  committed checkpoints included; bytes deleted since the last measure stop counting before a refusal;
* the sizes of the tokens file and of ``CKPTD_ROOT_RESERVE`` parse, or name the grammar.
"""

from __future__ import annotations

import threading
import time

import pytest

from ckptd.service.auth import Principal
from ckptd.storage import LocalStorage, open_storage
from ckptd.store import SessionStore
from ckptd.store import space as space_mod
from ckptd.store.intake import recorded_file
from ckptd.store.paths import Paths
from ckptd.store.space import OPEN_BYTES, SESSION_DIRS_BYTES, Space, on_disk, parse_reserve, parse_size
from ckptd_schemas import (
    InvalidIndex, LinkFile, OpenSession, PresignUpload, QuotaExceeded, RankIndex, ReserveReached, linked_name,
)
from support import scaled

from .staging import data, file_of, index, put_indexes, stage


def _store(storage) -> SessionStore:
    return SessionStore(storage, space=Space(storage))


def _held(storage, run: str) -> int:
    """What the rule counts: every session of the run's checkpoints, its directories and its files' blocks."""
    return sum(SESSION_DIRS_BYTES + sum(on_disk(size) for _, size in storage.walk(Paths.session(run, name, sid)))
               for name in storage.list(Paths.run(run)) for sid in storage.list(Paths.sessions(run, name)))


def test_received_bytes_past_the_quota_are_refused_and_leave_nothing(tmp_path):
    storage = LocalStorage(tmp_path)
    store = _store(storage)
    stage(store, "r", "src", "s-src")  # staged bytes in run r, which the writer may write: counted
    stage(store, "other", "1", "s-o")  # ... and in a run it may not: never counted
    store.open("r", "2", OpenSession(session="s-b", world_size=1))
    writer = Principal("w", write=("r",), quota=_held(storage, "r") + on_disk(0) + 1000)  # + the file written: a block
    sink = store.intake.receive("r", "2", "s-b", "a.bin", writer)
    sink.write(b"x" * 600)  # within the quota
    with pytest.raises(QuotaExceeded) as info:
        sink.write_parts([b"y" * 400, b"z" * 400])
    err = info.value
    assert err.status == 507 and err.details["token"] == "w" and err.details["quota"] == writer.quota
    assert err.details["run"] == "r" and err.details["file"] == "a.bin", err.details
    assert "'w'" in err.message and str(writer.quota) in err.message and "'a.bin'" in err.message
    sink.abort()  # as the routes do on any failure
    assert recorded_file(storage, "r", "2", "s-b", "a.bin") is None
    assert not (tmp_path / Paths.file("r", "2", "s-b", "a.bin")).exists()
    # The same writer without a quota, and another writer, are not limited by it.
    for other in (Principal("w", write=("r",)), Principal("v", write=("r",), quota=1 << 30), None):
        sink = store.intake.receive("r", "2", "s-b", "a.bin", other)
        sink.write(b"x" * 2000)
        sink.abort()


def test_a_link_is_charged_its_size_before_it_is_made(tmp_path):
    storage = LocalStorage(tmp_path)
    store = _store(storage)
    stage(store, "r", "src", "s-src")
    put_indexes(store, "r", "src", "s-src")
    stage(store, "r", "2", "s-b", ranks=[])
    held = _held(storage, "r")
    name = linked_name("src", file_of(0))
    with pytest.raises(QuotaExceeded):
        store.intake.place("r", "2", "s-b", name, LinkFile(checkpoint="src", file=file_of(0)),
                           Principal("w", write=("r*",), quota=held + len(data(0)) - 1))
    assert not (tmp_path / Paths.file("r", "2", "s-b", name)).exists()
    res = store.intake.place("r", "2", "s-b", name, LinkFile(checkpoint="src", file=file_of(0)),
                             Principal("w", write=("r*",), quota=held + len(data(0))))
    assert res.size == len(data(0))


def test_a_rank_index_is_charged_to_its_writer_but_not_to_the_reserve(tmp_path):
    storage = LocalStorage(tmp_path)
    writer = Principal("w", write=("r",), quota=1 << 30)
    full = SessionStore(storage, space=Space(storage, "99.99%"))  # a reserve no data file can pass
    with pytest.raises(ReserveReached):  # nor a new session ...
        full.open("r", "1", OpenSession(session="s-1", world_size=1, step=1), writer)
    assert not (tmp_path / Paths.ckpt("r", "1")).exists()
    _store(storage).open("r", "1", OpenSession(session="s-1", world_size=1, step=1), writer)
    full.open("r", "1", OpenSession(session="s-1", world_size=1, step=1), writer)  # ... a rank joining one is
    sink = full.intake.receive("r", "1", "s-1", file_of(0), writer)
    with pytest.raises(ReserveReached):  # data files are refused at the reserve ...
        sink.write(data(0))
    sink.abort()
    stage(_store(storage), "r", "1", "s-1")
    full.put_index("r", "1", "s-1", index(0, 1), writer)  # ... an index, the manifest, the marker are not
    assert full.status("r", "1", "s-1").state == "committed"
    store = _store(storage)
    stage(store, "r", "2", "s-2")
    tight = Principal("w", write=("r",), quota=_held(storage, "r"))
    with pytest.raises(QuotaExceeded) as info:  # an index is bytes its writer brings, like a data file
        store.put_index("r", "2", "s-2", index(0, 1), tight)
    assert info.value.details["file"] == "ranks/0000000.json", info.value.details
    assert not (tmp_path / Paths.ranks("r", "2", "s-2")).exists()


def test_what_a_writer_holds_is_measured_and_deletions_count_before_a_refusal(tmp_path, monkeypatch):
    storage = LocalStorage(tmp_path)
    store = _store(storage)
    stage(store, "r", "1", "s-1")
    put_indexes(store, "r", "1", "s-1")  # committed: its bytes count
    store.open("r", "2", OpenSession(session="s-2", world_size=1))
    sink = store.intake.receive("r", "2", "s-2", "a.bin")
    held = _held(storage, "r")  # the file being written (a block) included
    writer = Principal("w", write=("r",), quota=held + 100)
    sink.abort()
    sink = store.intake.receive("r", "2", "s-2", "a.bin", writer)
    sink.write(b"x" * 100)  # exactly the quota
    with pytest.raises(QuotaExceeded) as info:
        sink.write(b"y")
    assert info.value.details["held"] == held + 100
    sink.abort()
    storage.delete_tree(Paths.ckpt("r", "1"))  # deleted behind the count (gc, another replica)
    monkeypatch.setattr(space_mod, "RECHECK_SECONDS", 0.0)  # the next refusal measures again at once
    time.sleep(0.01)
    sink = store.intake.receive("r", "2", "s-2", "a.bin", writer)
    sink.write(b"x" * 100)  # the deleted checkpoint no longer counts
    sink.abort()


def test_a_presign_is_charged_its_declared_size_before_any_claim(moto_s3, s3_env):
    storage = open_storage(moto_s3.url())
    try:
        store = _store(storage)
        store.open("r", "1", OpenSession(session="s-1", world_size=1))
        body = PresignUpload(size=10 << 20, part_size=5 << 20, sha256=["A" * 43 + "="] * 2)
        with pytest.raises(QuotaExceeded) as info:
            store.intake.presign("r", "1", "s-1", "big.bin", body, 60.0, Principal("w", write=("r",), quota=1 << 20))
        assert info.value.details["file"] == "big.bin"
        assert storage.read_or_none(Paths.presign_claim("r", "1", "s-1", "big.bin")) is None
        signed = store.intake.presign("r", "1", "s-1", "big.bin", body, 60.0, Principal("w", write=("r",), quota=1 << 30))
        assert len(signed.urls) == 2
    finally:
        moto_s3.clear(storage._prefix)


def test_a_new_session_is_charged_its_blocks_and_a_rank_joining_it_nothing(tmp_path, monkeypatch):
    storage = LocalStorage(tmp_path)
    store = _store(storage)
    writer = Principal("w", write=("r",), quota=2 * OPEN_BYTES)
    for name in ("1", "2"):
        store.open("r", name, OpenSession(session="s", world_size=4), writer)
    with pytest.raises(QuotaExceeded) as info:
        store.open("r", "3", OpenSession(session="s", world_size=4), writer)
    assert info.value.details["file"] == "3/sessions/s" and info.value.details["held"] == 2 * OPEN_BYTES
    assert not (tmp_path / Paths.ckpt("r", "3")).exists()
    store.open("r", "1", OpenSession(session="s", world_size=4), writer)  # the other ranks join: not charged
    monkeypatch.setattr(space_mod, "RECHECK_SECONDS", 0.0)
    time.sleep(0.01)
    with pytest.raises(QuotaExceeded):  # the measure counts the opens as they were charged
        store.open("r", "3", OpenSession(session="s", world_size=4), writer)
    assert _held(storage, "r") == 2 * OPEN_BYTES
    # A session holds one index per rank of its declared world size, no more: its exposure is bounded.
    with pytest.raises(InvalidIndex) as bad:
        store.put_index("r", "1", "s", RankIndex.model_validate({"rank": 4, "world_size": 4, "files": [], "tensors": []}),
                        writer)
    assert bad.value.details["rank"] == 4


def test_one_thread_measures_a_writer_and_its_other_writes_are_answered_at_once(tmp_path, monkeypatch):
    """A measure walks the writer's runs on the root (seconds for many sessions); the writer's other
    writes are answered from its last measure meanwhile, never queued behind it, and other writers'
    writes are not touched."""
    entered, release = threading.Event(), threading.Event()

    class SlowRoot(LocalStorage):
        slow = False

        def walk(self, prefix):
            if self.slow:
                entered.set()
                assert release.wait(scaled(60))
            return super().walk(prefix)

    storage = SlowRoot(tmp_path)
    store = _store(storage)
    stage(store, "r", "1", "s-1")
    space = store.intake.space
    writer = Principal("w", write=("r",), quota=_held(storage, "r") + 100)
    space.charge(writer, "r", "a.bin", 100, on_root=False)  # measured, then counted: exactly the quota
    monkeypatch.setattr(space_mod, "RECHECK_SECONDS", 0.0)
    storage.slow = True
    errors: list[BaseException] = []

    def write(who: Principal) -> None:
        try:
            space.charge(who, "r", "b.bin", 1, on_root=False)
        except QuotaExceeded as e:
            errors.append(e)

    measuring = threading.Thread(target=write, args=(writer,), daemon=True)
    measuring.start()  # past the quota: measures again before refusing, and the walk hangs
    assert entered.wait(scaled(30))
    others = [threading.Thread(target=write, args=(writer,), daemon=True) for _ in range(20)]
    others.append(threading.Thread(target=write, args=(Principal("v", write=("q",), quota=1 << 20),), daemon=True))
    for t in others:
        t.start()
    for t in others:
        t.join(scaled(30))
    assert not any(t.is_alive() for t in others), "a write waited on another thread's measure"
    assert len(errors) == 20 and all(e.details["token"] == "w" for e in errors)  # refused from the last measure
    assert measuring.is_alive()
    release.set()
    measuring.join(scaled(30))
    assert not measuring.is_alive() and len(errors) == 20  # measured: the 100 bytes counted were never stored


@pytest.mark.parametrize("text, size", [
    ("4096", 4096), ("500GiB", 500 << 30), ("2TB", 2 * 10 ** 12), ("1.5TiB", int(1.5 * (1 << 40))),
    ("64k", 64_000), ("8 MiB", 8 << 20), ("3Gi", 3 << 30), ("1b", 1)])
def test_sizes_parse(text, size):
    assert parse_size(text) == size


@pytest.mark.parametrize("text", ["", "lots", "-5GiB", "5XB", "1e9", "GiB"])
def test_bad_sizes_name_the_grammar(text):
    with pytest.raises(ValueError, match="is not a size: a number of bytes with an optional unit"):
        parse_size(text)


def test_the_reserve_is_a_size_or_a_percentage():
    assert parse_reserve("0") == (0, 0.0) and parse_reserve("5%") == (0, 0.05)
    assert parse_reserve("2GiB") == (2 << 30, 0.0) and parse_reserve(" 0.5 % ") == (0, 0.005)
    for bad in ("100%", "-1%", "x%", "lots"):
        with pytest.raises(ValueError):
            parse_reserve(bad)
