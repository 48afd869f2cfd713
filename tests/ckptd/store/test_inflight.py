"""Requests in flight against a store (``ckptd.store.inflight``): one at a time on a local root, several
on a remote one, for the stamps, the commit's reads of indexes and digest records, and the files its
check reads at once; the results are those of one request at a time."""

from __future__ import annotations

import threading
import time
import uuid

import pytest
import xxhash

from ckptd.storage import LocalStorage, open_storage
from ckptd.store.checker import JOBS, REMOTE_JOBS, jobs_for
from ckptd.store.inflight import REMOTE_REQUESTS, SharedCalls, ordered_map
from ckptd.store.records import file_stamps
from ckptd.store.sessions import SessionStore
from ckptd_schemas import OpenSession, RankIndex
from support import TIME_SCALE


class _Remote(LocalStorage):
    """A local root that says it has no local paths (as an object store), each stamp and read a round
    trip, counting the calls in flight by kind (``stamp``, ``index``, ``file``)."""

    def __init__(self, *a, **kw) -> None:
        super().__init__(*a, **kw)
        self.now: dict[str, int] = {}
        self.most: dict[str, int] = {}
        self.lock = threading.Lock()

    def _call(self, kind: str, fn, *args, **kw):
        with self.lock:
            self.now[kind] = self.now.get(kind, 0) + 1
            self.most[kind] = max(self.most.get(kind, 0), self.now[kind])
        time.sleep(0.005)
        try:
            return fn(*args, **kw)
        finally:
            with self.lock:
                self.now[kind] -= 1

    def local_path(self, key: str) -> str | None:
        return None

    def stamp(self, key: str) -> str | None:
        return self._call("stamp", super().stamp, key)

    def read(self, key: str, start: int = 0, end: int | None = None) -> bytes:
        kind = "index" if "/ranks/" in key else "other"
        return self._call(kind, super().read, key, start, end)

    def read_or_none(self, key: str) -> bytes | None:
        kind = "index" if "/ranks/" in key else "other"
        return self._call(kind, super().read_or_none, key)

    def read_into(self, key: str, start: int, view: memoryview, **kw) -> int:
        return self._call("file", super().read_into, key, start, view, **kw)


def _key(f: str) -> str:
    return f"runs/r/1/sessions/s/files/{f}"


def test_ordered_map_keeps_order_bounds_what_runs_and_raises_in_place():
    running, most, lock = [0], [0], threading.Lock()

    def slow(x: int) -> int:
        with lock:
            running[0] += 1
            most[0] = max(most[0], running[0])
        time.sleep(0.002 * (x % 3))
        with lock:
            running[0] -= 1
        if x == 25:
            raise ValueError("item 25")
        return x * x

    got = []
    with pytest.raises(ValueError, match="item 25"):
        for y in ordered_map(slow, range(40), 4):
            got.append(y)
    assert got == [x * x for x in range(25)] and 1 < most[0] <= 4
    assert list(ordered_map(lambda x: threading.current_thread(), range(3), 1)) == [threading.current_thread()] * 3


def test_shared_reads_answer_the_calls_that_came_before_a_read_began_with_its_value_or_error():
    """A read of a key in progress answers nobody who came after it began; those share the next one,
    its error too; another key is read on its own, at once."""
    shared, release, ran, got = SharedCalls(wait_ahead=60 * TIME_SCALE), threading.Event(), [], {}

    def call(key: str, name: str) -> None:
        def fn() -> str:
            ran.append(name)
            if key == "k":
                release.wait(10 * TIME_SCALE)
            if name == "second":
                raise ValueError("the store said no")
            return name
        try:
            got[name] = shared.call(key, fn)
        except ValueError as e:
            got[name] = e

    threads = [threading.Thread(target=call, args=("k", "first"))]
    threads[0].start()
    while not ran:
        time.sleep(0.001)
    for name in ("second", "third", "fourth"):  # the second leads the next read, the others join it
        threads.append(threading.Thread(target=call, args=("k", name)))
        threads[-1].start()
        time.sleep(0.05 * TIME_SCALE)
    call("other", "alone")  # not held up by the reads of "k"
    assert ran == ["first", "alone"] and got["alone"] == "alone"
    release.set()
    for t in threads:
        t.join(10 * TIME_SCALE)
    assert ran == ["first", "alone", "second"] and got["first"] == "first"
    assert all(isinstance(got[n], ValueError) for n in ("second", "third", "fourth")), got


def test_a_shared_read_that_stalls_holds_the_next_back_a_bounded_time():
    """A read the store does not answer delays the calls that came after it by ``wait_ahead`` at most:
    the next read begins beside it and answers them."""
    shared, stalled, later, first_got = SharedCalls(wait_ahead=0.05), threading.Event(), [], []
    first = threading.Thread(target=lambda: first_got.append(shared.call("k", lambda: stalled.wait(30 * TIME_SCALE))))
    first.start()
    try:
        time.sleep(0.01)
        threads = [threading.Thread(target=lambda: later.append(shared.call("k", lambda: "fresh"))) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(10 * TIME_SCALE)
        assert later == ["fresh"] * 4 and not stalled.is_set() and first.is_alive()
    finally:
        stalled.set()
        first.join(10 * TIME_SCALE)
    assert first_got == [True]  # its own answer, when it came
    assert shared.call("k", lambda: "after") == "after"  # the stalled read's end left the key clean


def test_a_remote_store_is_stamped_several_files_at_a_time_a_local_one_file_by_file(tmp_path):
    files = [f"f{i}" for i in range(40)]
    remote, local = _Remote(tmp_path / "remote", durable=False), LocalStorage(tmp_path / "local", durable=False)
    for st in (remote, local):
        for i, f in enumerate(files):
            st.put(_key(f), b"x" * i)
    got = file_stamps(remote, _key, files + ["absent"])
    assert list(got) == files + ["absent"] and got["absent"] is None
    assert got == {f: LocalStorage.stamp(remote, _key(f)) for f in files + ["absent"]}
    assert 1 < remote.most["stamp"] <= REMOTE_REQUESTS
    assert file_stamps(local, _key, files) == {f: local.stamp(_key(f)) for f in files}


def _commit(store: SessionStore, world: int) -> None:
    sid = uuid.uuid4().hex
    store.open("r", "1", OpenSession(session=sid, world_size=world, step=1))
    for r in range(world):
        for k in range(2):
            sink = store.intake.receive("r", "1", sid, f"r{r}-{k}.bin")
            data = f"rank {r} file {k}".encode() * 100
            sink.write(data)
            sink.finish(xxhash.xxh3_64_hexdigest(data))
    for r in range(world):
        st = store.put_index("r", "1", sid, RankIndex(rank=r, world_size=world, files=[f"r{r}-{k}.bin" for k in range(2)]))
        store._indexes.drop_under("runs/")  # the commit reads every index back, as another replica would
    assert st.state == "committed", st


def test_a_commit_on_a_remote_store_reads_ahead_and_checks_several_files_at_once(tmp_path):
    remote, local = _Remote(tmp_path / "remote", durable=False), LocalStorage(tmp_path / "local", durable=False)
    manifests = []
    for st in (remote, local):
        _commit(SessionStore(st), 12)
        vis = SessionStore(st).visibility
        manifests.append(vis.manifest(vis.resolve("r", "1")))
    assert remote.most["index"] > 1 and remote.most["file"] > JOBS and remote.most["stamp"] > 1
    assert manifests[0].files == manifests[1].files and len(manifests[0].files) == 24  # the same, rank by rank
    assert jobs_for(manifests[0], remote, lambda f: f) == REMOTE_JOBS
    assert jobs_for(manifests[1], local, lambda f: f) == JOBS


class _Replacing(_Remote):
    """While the commit checks its first file, another file is put again with the same bytes: a new
    object (new inode and ctime), as an outsider editing the root would leave it."""

    replaced = False

    def read_into(self, key: str, start: int, view: memoryview, **kw) -> int:
        if not self.replaced and "/files/" in key:
            self.replaced = True
            other = key.rsplit("/", 1)[0] + ("/r1-1.bin" if not key.endswith("/r1-1.bin") else "/r0-0.bin")
            LocalStorage.put(self, other, LocalStorage.read(self, other))
        return super().read_into(key, start, view, **kw)


@pytest.mark.parametrize("replace", [False, True])
def test_a_file_replaced_while_a_remote_commit_checks_it_leaves_a_record_that_vouches_for_nothing(tmp_path, replace):
    """The stamps before and after the check, taken several at a time, still catch a file that changed in
    between: the commit's record then vouches for no stored byte (a later link or conversion reads again)."""
    from ckptd.store.records import record_holds, record_of

    st = (_Replacing if replace else _Remote)(tmp_path / "root", durable=False)
    _commit(SessionStore(st), 4)
    vis = SessionStore(st).visibility
    c = vis.resolve("r", "1")
    rec = record_of(st, c)
    assert rec is not None and rec.ok  # the bytes are right either way
    assert record_holds(st, c, rec, sorted(vis.manifest(c).files)) is (not replace)
    assert len(rec.stamps) == (0 if replace else 8)  # the commit's own before/after comparison saw the move
    assert getattr(st, "replaced", False) is replace


def test_stamps_on_s3_are_those_of_one_head_each(moto_s3, s3_env):
    st = open_storage(moto_s3.url("stamps"))
    try:
        files = [f"f{i}" for i in range(24)]
        for i, f in enumerate(files):
            st.put(_key(f), bytes([i]) * (i + 1))
        got = file_stamps(st, _key, files + ["absent"])
        assert got == {f: st.stamp(_key(f)) for f in files} | {"absent": None}
        assert len(set(got.values())) == len(files) + 1  # every file its own ETag and size
    finally:
        moto_s3.clear("stamps")
