"""Several ``ckptd serve`` replicas on one storage root (docs/design.md §7, §2 item 6).

Sessions, indexes, manifests and markers live in storage, so the ranks of one
checkpoint may talk to different replicas: whichever replica stores the last
index (or answers a status poll after it) commits, ``COMMITTED`` is created
exactly once (first writer wins), and every replica serves the result. A
replica that dies mid-checkpoint costs only a retry: the client fails over to
the next URL it was given (``CheckpointClient([url_a, url_b])``), and files
the dead replica had fully received (data plus digest sidecar) are used as
they are: the client never re-sends a file whose upload was answered, and the
file it was streaming when the replica died is sent again, whole, to the next.

Everything is real: ``ckptd serve`` subprocesses, gloo ranks, SIGKILL; the
spread save and the commit race also run on an ``s3://`` root (moto in server
mode, tests/s3_server.py), where the marker is a conditional PUT.
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import httpx
import pytest
import torch
import torch.distributed as dist
import xxhash

from ckptd.storage import LocalStorage, Storage, open_storage
from ckptd.store import SessionStore
from fault_server import CRASH_POINTS
from ckptd.store.paths import Paths
from ckptd_client import CheckpointClient, FlatShard
from ckptd_schemas import AlreadyCommitted, OpenSession, RankIndex
from fsdp_job import build, full_tensors, load_job, state, train_step
from support import ServerProcess, assert_bits_equal, blank_like, run_ranks, scaled, server_errors, store_index

pytestmark = pytest.mark.slow

RUN = "rep"


# -- servers and what they show ------------------------------------------------------------------------

@pytest.fixture(params=["local", "s3"])
def replicas(request, tmp_path):
    """Two ``ckptd serve`` processes, different ports, one root (a directory, or ``s3://`` on moto);
    yields them and this process's :class:`Storage` on the same root."""
    moto = None
    if request.param == "local":
        root, env = str(tmp_path / "root"), {}
        storage = LocalStorage(root, durable=False)
    else:
        from s3_server import aws_env

        moto = request.getfixturevalue("moto_s3")
        request.getfixturevalue("s3_env")  # this process's AWS environment points at moto too
        root, env = moto.url(), aws_env(moto.endpoint)
        storage = open_storage(root)
    a = ServerProcess(root, env=env, log=tmp_path / "a.log")
    b = ServerProcess(root, env=env, log=tmp_path / "b.log")
    try:
        a.start(wait=False), b.start(wait=False)
        a.wait_ready(), b.wait_ready()
        yield a, b, storage
    finally:
        a.kill(), b.kill()
        if moto is not None:
            moto.clear(storage._prefix)


def ckpt_dir(root: Path, name: str) -> Path:
    return root / "runs" / RUN / name


def backend(storage: Storage) -> str:
    return "local" if isinstance(storage, LocalStorage) else "s3"


def cli(*args: str, env: dict[str, str] | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ckptd.cli.main", *args], capture_output=True, text=True,
                          timeout=timeout, env=env)


def assert_verifies(ref: str, *where: str) -> None:
    """``ckptd verify REF --root R`` / ``--server URL``: every byte re-read and re-hashed."""
    p = cli("verify", ref, *where)
    assert p.returncode == 0 and p.stdout.startswith(f"OK {ref}"), f"verify {ref} {where}:\n{p.stdout}{p.stderr}"


class CommitWatcher:
    """Polls, from this process, what both replicas list and what ``COMMITTED`` holds in storage.

    ``digests[name]``: every manifest digest any replica ever listed for ``name``;
    ``markers[name]``: every distinct marker content ever read. Exactly-once commit means one of each.
    """

    def __init__(self, storage: Storage, urls: list[str], period: float = 0.02) -> None:
        self.storage, self.urls, self.period = storage, urls, period
        self.digests: dict[str, set[str]] = {}
        self.markers: dict[str, set[bytes]] = {}
        self.problems: list[str] = []
        self.polls = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._http = httpx.Client(timeout=5)

    def __enter__(self) -> "CommitWatcher":
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join(30)
        self.poll()
        self._http.close()

    def _loop(self) -> None:
        while not self._stop.is_set():
            self.poll()
            self._stop.wait(self.period)

    def poll(self) -> None:
        self.polls += 1
        try:
            for name in self.storage.list(f"runs/{RUN}"):
                key = f"runs/{RUN}/{name}/COMMITTED"
                if self.storage.size(key) is not None:
                    self.markers.setdefault(name, set()).add(self.storage.read(key))
        except Exception as e:  # noqa: BLE001 - recorded, the test fails on it
            self.problems.append(f"reading markers: {type(e).__name__}: {e}")
        for url in self.urls:
            try:
                r = self._http.get(f"{url}/v1/runs/{RUN}/checkpoints")
            except httpx.TransportError:
                continue  # a replica killed on purpose
            if r.status_code != 200:
                self.problems.append(f"{url} listed with {r.status_code}: {r.text[:200]}")
                continue
            for row in r.json():
                self.digests.setdefault(row["name"], set()).add(row["manifest_xxh3"])

    def assert_once(self, name: str, session: str, digest: str) -> None:
        assert not self.problems, self.problems
        assert self.digests.get(name) == {digest}, f"{name}: digests listed {self.digests.get(name)}"
        assert len(self.markers.get(name, ())) == 1, f"{name}: marker contents seen {self.markers.get(name)}"
        seen = next(iter(self.markers[name]))
        marker = json.loads(seen)
        assert marker["session"] == session and marker["manifest_xxh3"] == digest
        st, d = self.storage, f"runs/{RUN}/{name}"
        assert st.list(f"{d}/sessions") == [session]
        assert [n for n in st.list(f"{d}/sessions/{session}") if n.startswith("manifest-")] == [marker["manifest"]]
        assert st.size(f"{d}/sessions/{session}/FAILED.json") is None
        assert st.read(f"{d}/COMMITTED") == seen, "the marker was rewritten"


def assert_served_alike(urls: list[str], name: str, session: str, digest: str) -> None:
    """Every replica: lists it, answers the session as committed, serves the same manifest bytes."""
    listings, manifests = [], []
    for url in urls:
        listings.append(httpx.get(f"{url}/v1/runs/{RUN}/checkpoints").json())
        st = httpx.get(f"{url}/v1/checkpoints/{RUN}/{name}/sessions/{session}").json()
        assert st["state"] == "committed" and st["manifest_xxh3"] == digest, (url, st)
        r = httpx.get(f"{url}/v1/checkpoints/{RUN}/{name}")
        assert r.status_code == 200, r.text
        assert xxhash.xxh3_64_hexdigest(r.content) == digest
        manifests.append(r.content)
    assert all(x == listings[0] for x in listings) and name in [row["name"] for row in listings[0]]
    assert all(m == manifests[0] for m in manifests)


# -- 0. the store core alone: two SessionStores (two replicas) race to commit, in one process -------------

class _CountingStorage(LocalStorage):
    """A local root that records every ``COMMITTED`` it created (shared between the two "replicas")."""

    def __init__(self, root: Path, created: list[str], tried: list[str]) -> None:
        super().__init__(root, durable=False)
        self.created, self.tried = created, tried

    def create_if_absent(self, key: str, data: bytes) -> bool:
        ok = super().create_if_absent(key, data)
        if key.endswith("/COMMITTED"):
            self.tried.append(key)
            if ok:
                self.created.append(key)
        return ok


def _hand_index(rank: int, world: int, full: torch.Tensor) -> tuple[bytes, RankIndex]:
    rows = full.shape[0] // world
    lo, hi = rank * rows, (full.shape[0] if rank == world - 1 else (rank + 1) * rows)
    data = full[lo:hi].contiguous().numpy().tobytes()
    loc = {"file": f"r{rank}.bin", "offset": 0, "length": len(data), "raw_length": len(data),
           "xxh3": xxhash.xxh3_64_hexdigest(data)}
    chunk = {"kind": "box", "rank": rank, "offsets": [lo, 0], "sizes": [hi - lo, full.shape[1]], "location": loc}
    return data, RankIndex.model_validate({
        "rank": rank, "world_size": world, "files": [f"r{rank}.bin"],
        "tensors": [{"name": "model.w", "shape": list(full.shape), "dtype": "float32", "group": "model",
                     "chunks": [chunk]}]})


def test_two_session_stores_racing_on_the_last_indexes_commit_once(tmp_path):
    """Per round: indexes 0, 1 stored; then, released by one barrier, index 2 through store A, index 3
    through store B, and a status poll on each store (a waiter): four callers that may each commit."""
    created: list[str] = []
    tried: list[str] = []  # every attempt at the marker: more than one per round = a real race
    stores = [SessionStore(_CountingStorage(tmp_path, created, tried)) for _ in range(2)]
    world, rounds = 4, 30
    for n in range(rounds):
        name, sid = str(n), f"s{n}"
        full = torch.randn(37, 5, generator=torch.Generator().manual_seed(n))
        stores[0].open(RUN, name, OpenSession(session=sid, world_size=world, step=n))
        stores[1].open(RUN, name, OpenSession(session=sid, world_size=world, step=n))  # joins
        indexes = []
        for r in range(world):
            data, ix = _hand_index(r, world, full)
            sink = stores[r % 2].intake.receive(RUN, name, sid, f"r{r}.bin")
            sink.write(data)
            sink.finish(xxhash.xxh3_64_hexdigest(data))
            indexes.append(ix)
        assert stores[0].put_index(RUN, name, sid, indexes[0]).state == "open"
        assert stores[1].put_index(RUN, name, sid, indexes[1]).state == "open"
        gate = threading.Barrier(4)
        results: list = [None] * 4

        def call(i: int) -> None:
            gate.wait()
            try:
                if i < 2:
                    results[i] = stores[i].put_index(RUN, name, sid, indexes[2 + i])
                else:
                    time.sleep(0.0005 * n % 0.003)  # the waiters poll a little after, by varying amounts
                    results[i] = stores[i - 2].status(RUN, name, sid)
            except Exception as e:  # noqa: BLE001 - the test fails on it below
                results[i] = e

        threads = [threading.Thread(target=call, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        errors = [r for r in results if isinstance(r, Exception)]
        assert not errors, f"round {n}: {errors!r}"
        digests = {(r.state, r.manifest_xxh3) for r in results if r.state != "open"}
        assert len(digests) == 1 and next(iter(digests))[0] == "committed", f"round {n}: {results}"
        assert created.count(f"runs/{RUN}/{name}/COMMITTED") == 1
        sdir = ckpt_dir(tmp_path, name) / "sessions" / sid
        assert len(list(sdir.glob("manifest-*.json"))) == 1 and not (sdir / "FAILED.json").exists()
        for st in stores:
            after = st.status(RUN, name, sid)
            assert after.state == "committed" and after.manifest_xxh3 == next(iter(digests))[1]
    assert len(created) == rounds
    print(f"{rounds} rounds: {len(tried)} attempts at COMMITTED, {len(created)} created")


class _CommitInBetween(SessionStore):
    """A store where, once, another request's index commits the session right before this request's
    look at the marker (the write gate's): the moment a rank's retried index loses the race to the commit."""

    def __init__(self, storage: LocalStorage) -> None:
        super().__init__(storage)
        self.other: RankIndex | None = None  # armed by the test
        marker = self.visibility.marker

        def look(run: str, name: str):
            if self.other is not None:
                other, self.other = self.other, None
                assert self.put_index(run, name, "s", other).state == "committed"
            return marker(run, name)

        self.visibility.marker = look  # type: ignore[method-assign]


def test_an_index_retry_that_loses_the_race_to_the_commit_is_answered_not_refused(tmp_path):
    """Both indexes were stored before the replica died between them and the marker; the ranks retry
    at the other replica at once. Rank 1's retry commits right before rank 0's looks at the marker
    (the write gate's look): rank 0 gets the committed status, not a 409 (the race
    ``test_replica_dying_at_a_crash_point_the_other_finishes[commit-before-marker]`` can meet). An index
    that differs from the committed one is still refused, and the marker stays as it was."""
    full = torch.randn(9, 4, generator=torch.Generator().manual_seed(3))
    (d0, ix0), (d1, ix1) = _hand_index(0, 2, full), _hand_index(1, 2, full)
    store = _CommitInBetween(LocalStorage(tmp_path, durable=False))
    store.open(RUN, "5", OpenSession(session="s", world_size=2, step=5))
    for r, data in enumerate((d0, d1)):
        sink = store.intake.receive(RUN, "5", "s", f"r{r}.bin")
        sink.write(data)
        sink.finish(xxhash.xxh3_64_hexdigest(data))
    for r, ix in enumerate((ix0, ix1)):  # as the dead replica stored them
        store_index(store.storage, RUN, "5", "s", ix)
    assert store.storage.read_json_or_none(Paths.marker(RUN, "5")) is None
    store.other = ix1
    st = store.put_index(RUN, "5", "s", ix0)
    assert store.other is None, "the commit did not land in between"
    marker = store.storage.read(Paths.marker(RUN, "5"))
    assert st.state == "committed" and st.manifest_xxh3 == json.loads(marker)["manifest_xxh3"]
    changed = ix0.model_copy(update={"coords": {"dp": 0}})
    with pytest.raises(AlreadyCommitted):
        store.put_index(RUN, "5", "s", changed)
    assert store.storage.read(Paths.marker(RUN, "5")) == marker


# -- 1. one FSDP2 checkpoint, ranks split over two replicas ----------------------------------------------

def split_save_job(rank: int, world: int, urls: list[str], ref: str) -> dict:
    """fsdp_job.save_job, but each rank talks to its own replica and reports its status."""
    model, opt = build(world, seed=0)
    for step in range(3):
        train_step(model, opt, step, rank, world)
    with CheckpointClient(urls[rank]) as client:
        status = client.save(state(model, opt), ref).wait(timeout=120)
    saved = full_tensors(state(model, opt))
    return {"status": status.model_dump(mode="json"), "tensors": saved if rank == 0 else None,
            "url": urls[rank]}


def test_ranks_spread_over_two_replicas_commit_once_and_both_serve_it(replicas, tmp_path):
    a, b, storage = replicas
    urls = [a.url, a.url, b.url, b.url]
    t0 = time.monotonic()
    with CommitWatcher(storage, [a.url, b.url]) as watch:
        records = run_ranks(split_save_job, 4, urls, f"{RUN}/3", tmp=tmp_path)
    statuses = [r["result"]["status"] for r in records]
    assert {s["state"] for s in statuses} == {"committed"}
    session, digest = statuses[0]["session"], statuses[0]["manifest_xxh3"]
    assert all(s["session"] == session and s["manifest_xxh3"] == digest for s in statuses), statuses
    watch.assert_once("3", session, digest)
    assert watch.polls > 5
    assert_served_alike([a.url, b.url], "3", session, digest)

    saved = records[0]["result"]["tensors"]
    assert any(k.endswith("exp_avg_sq") for k in saved)
    for world, url in ((3, b.url), (2, a.url)):  # through B only, then through A only
        got = run_ranks(load_job, world, url, f"{RUN}/latest", tmp=tmp_path)[0]["result"]["tensors"]
        assert set(got) == set(saved)
        for k, t in saved.items():
            assert torch.equal(got[k].view(-1).view(torch.uint8), t.view(-1).view(torch.uint8)), \
                f"{k} differs loading at world size {world} through {url}"
    assert_verifies(f"{RUN}/3", "--server", a.url)
    assert_verifies(f"{RUN}/3", "--server", b.url)
    assert not server_errors(a, b), server_errors(a, b)
    print(f"{backend(storage)}: save over 2 replicas, 2 loads, 2 verifies in {time.monotonic() - t0:.1f}s")


# -- flat-partitioned test state over 4 ranks --------------------------------------------------------------

SHAPES = [(384, 129), (255, 130), (97, 77)]  # each rank's piece of each: one 64 KiB file or less
CUTS = (0.19, 0.51, 0.77)                    # uneven 4-way split of every flat tensor


def full_state(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    model = {f"w{i}": torch.randn(s, generator=g) for i, s in enumerate(SHAPES)}
    model["b"] = torch.randn(129, generator=g)
    return {"model": model, "extra": {"seed": seed}}


def rank_state(rank: int, world: int, seed: int) -> dict:
    assert world == 4
    full = full_state(seed)
    model: dict = {"b": full["model"]["b"]}  # replicated: written once, by one rank
    for i, s in enumerate(SHAPES):
        flat = full["model"][f"w{i}"].reshape(-1)
        bounds = [0, *(int(c * flat.numel()) for c in CUTS), flat.numel()]
        lo, hi = bounds[rank], bounds[rank + 1]
        model[f"w{i}"] = FlatShard(flat[lo:hi].clone(), s, lo)
    return {"model": model, "extra": full["extra"]}


def assert_loads(url: str | list[str], ref: str, want: dict) -> None:
    got = blank_like(want)
    with CheckpointClient(url, retry_seconds=10) as client:
        client.load(got, ref)
    assert_bits_equal(got, want)


class _Warnings(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def _phased_save(client: CheckpointClient, rank: int, world: int, ref: str, seed: int, first: tuple[int, ...],
                 settle: bool = False):
    """One save, its protocol steps spelled out: upload; barrier; ``first`` ranks send their index;
    barrier; the others send theirs at (nearly) the same moment; everyone waits for the commit
    (``settle``: only once every index was answered, so no status poll races the last index)."""
    from ckptd_client._dist import agree
    from ckptd_client._save import build_snapshot, open_session, put_index, upload_files, wait_committed

    run, name = ref.split("/")
    t, base = client._transport, f"/v1/checkpoints/{run}/{name}"
    session = agree((), uuid.uuid4().bytes)[1].hex()  # rank 0's
    snap = build_snapshot(rank_state(rank, world, seed), rank, world)
    open_session(t, base, session, world, int(name))
    index = upload_files(t, base, session, snap, compression=None, file_bytes=client.file_bytes, streams=1)
    dist.barrier()
    status = put_index(t, base, session, index) if rank in first else None
    dist.barrier()
    if rank not in first:
        status = put_index(t, base, session, index)
    assert status is not None
    if settle:
        dist.barrier()
    return wait_committed(t, base, ref, status, time.monotonic() + scaled(120)), status.state


# -- 2. the last two indexes at both replicas at once, many times -------------------------------------------

def race_job(rank: int, world: int, urls: list[str], n: int, seed: int) -> dict:
    warn = _Warnings()
    logging.getLogger("ckptd_client").addHandler(warn)
    out = []
    with CheckpointClient(urls[rank], retry_seconds=30, file_bytes=64 << 10) as client:
        for i in range(n):
            st, answered = _phased_save(client, rank, world, f"{RUN}/{i + 1}", seed + i, first=(0, 2))
            out.append({**st.model_dump(mode="json"), "put_index_state": answered})
    return {"statuses": out, "warnings": warn.lines}


def test_last_indexes_race_at_both_replicas_commit_exactly_once(replicas, tmp_path):
    a, b, storage = replicas
    n, seed = (10 if isinstance(storage, LocalStorage) else 5), 40  # moto is slow on 2 cores
    # Ranks 0, 1 on A and 2, 3 on B; 0 and 2 send their indexes first, then 1 (at A) and 3 (at B) together.
    t0 = time.monotonic()
    with CommitWatcher(storage, [a.url, b.url]) as watch:
        records = run_ranks(race_job, 4, [a.url, a.url, b.url, b.url], n, seed, tmp=tmp_path, timeout=240)
    elapsed = time.monotonic() - t0
    print(f"{backend(storage)}: {n} checkpoints with racing last indexes in {elapsed:.1f}s")
    assert all(not r["result"]["warnings"] for r in records), [r["result"]["warnings"] for r in records]
    # Both racing indexes answered "committed": each replica saw the full set and went through commit.
    both = sum(all(records[r]["result"]["statuses"][i]["put_index_state"] == "committed" for r in (1, 3))
               for i in range(n))
    print(f"{both} of {n} rounds: the last index was answered 'committed' at both replicas")
    for i in range(n):
        sts = [r["result"]["statuses"][i] for r in records]
        assert {s["state"] for s in sts} == {"committed"}, sts
        assert len({(s["session"], s["manifest_xxh3"]) for s in sts}) == 1, sts
        watch.assert_once(str(i + 1), sts[0]["session"], sts[0]["manifest_xxh3"])
    assert not server_errors(a, b), server_errors(a, b)
    names = [c["name"] for c in httpx.get(f"{b.url}/v1/runs/{RUN}/checkpoints").json()]
    assert names == [str(i + 1) for i in range(n)]
    for i in range(n):
        assert_loads(a.url if i % 2 else b.url, f"{RUN}/{i + 1}", full_state(seed + i))
    assert_verifies(f"{RUN}/{n}", "--server", a.url)


# -- 3. a replica dies mid-checkpoint; its ranks fail over ------------------------------------------------

FILE_BYTES = 64 << 10


def _wait_for(path: Path, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} never appeared")
        time.sleep(0.01)


def failover_job(rank: int, world: int, urls: list[list[str]], ref: str, seed: int, sync: str) -> dict:
    """Ranks 2, 3 save through B. Ranks 0, 1 through A until the test kills it: rank 0 after all its
    files were received (before its index), rank 1 in the middle of streaming its last file."""
    from ckptd_client._dist import agree
    from ckptd_client._save import _index, _pack, _stream, build_snapshot, open_session, put_index, wait_committed

    sync_dir = Path(sync)
    run, name = ref.split("/")
    with CheckpointClient(urls[rank], retry_seconds=60, streams=1, file_bytes=FILE_BYTES) as client:
        t, base = client._transport, f"/v1/checkpoints/{run}/{name}"
        session = agree((), uuid.uuid4().bytes)[1].hex()  # rank 0's
        snap = build_snapshot(rank_state(rank, world, seed), rank, world)
        open_session(t, base, session, world, int(name))
        files = list(_pack(snap, snap.order(), None, FILE_BYTES))
        index, _ = _index(snap, snap.order(), files)

        def put(f, content) -> None:
            t.request("PUT", f"{base}/sessions/{session}/files/{f.name}", content=content,
                      headers={"X-Ckptd-Xxh3": f.xxh3, "Content-Length": str(f.size)})

        attempts = []

        def slow_then_whole(f):
            """First attempt: 4 KiB, tell the test, wait until A is dead, then the rest. Later: all."""
            def gen():
                attempts.append(t.url)
                data = b"".join(bytes(x) for x in _stream(f))
                if len(attempts) == 1:
                    yield data[:4096]
                    (sync_dir / f"streaming-{rank}").touch()
                    _wait_for(sync_dir / "killed")
                    yield data[4096:]
                else:
                    yield data
            return gen

        if rank in (0, 1):
            assert len(files) >= 2, [f.name for f in files]
            for f in files[:-1]:
                put(f, lambda f=f: _stream(f))
            if rank == 0:
                put(files[-1], lambda: _stream(files[-1]))
                (sync_dir / "uploaded-0").touch()
                _wait_for(sync_dir / "killed")
            else:
                put(files[-1], slow_then_whole(files[-1]))
        else:
            for f in files:
                put(f, lambda f=f: _stream(f))
        status = put_index(t, base, session, index)
        status = wait_committed(t, base, ref, status, time.monotonic() + scaled(120))
        return {"status": status.model_dump(mode="json"), "files": [f.name for f in files],
                "url_at_end": t.url, "attempts": attempts}


def test_replica_killed_mid_checkpoint_ranks_fail_over_and_it_commits_once(tmp_path):
    root = tmp_path / "root"
    a, b = ServerProcess(root, log=tmp_path / "a.log"), ServerProcess(root, log=tmp_path / "b.log")
    try:
        a.start(wait=False), b.start(wait=False)
        a.wait_ready(), b.wait_ready()
        _killed_mid_checkpoint(tmp_path, root, a, b)
    finally:
        a.kill(), b.kill()


def _killed_mid_checkpoint(tmp_path: Path, root: Path, a: ServerProcess, b: ServerProcess) -> None:
    sync = tmp_path / "sync"
    sync.mkdir()
    name, seed = "5", 55
    # The killed files: which ones A fully received, and their identity on disk before the kill.
    before: dict[str, tuple[int, int]] = {}

    def killer() -> None:
        try:
            _wait_for(sync / "uploaded-0"), _wait_for(sync / "streaming-1")
            for p in (ckpt_dir(root, name) / "sessions").glob("*/digests/[!.]*"):
                st = (p.parent.parent / "files" / p.name).stat()
                before[p.name] = (st.st_ino, st.st_mtime_ns)
        finally:
            a.kill()  # SIGKILL, rank 1 mid-stream, rank 0 before its index
            (sync / "killed").touch()

    th = threading.Thread(target=killer, daemon=True)
    th.start()
    urls = [[a.url, b.url], [a.url, b.url], [b.url, a.url], [b.url, a.url]]
    with CommitWatcher(LocalStorage(root, durable=False), [a.url, b.url]) as watch:
        records = run_ranks(failover_job, 4, urls, f"{RUN}/{name}", seed, str(sync), tmp=tmp_path, timeout=180)
    th.join(5)
    res = [r["result"] for r in records]
    sts = [r["status"] for r in res]
    assert {s["state"] for s in sts} == {"committed"}, sts
    session, digest = sts[0]["session"], sts[0]["manifest_xxh3"]
    assert all(s["session"] == session and s["manifest_xxh3"] == digest for s in sts)
    assert [r["url_at_end"] for r in res] == [b.url] * 4
    assert res[1]["attempts"][0] == a.url and res[1]["attempts"][-1] == b.url  # re-streamed, whole, to B
    watch.assert_once(name, session, digest)

    # Files A had fully received (digest written) were used as they were, not sent again: same inode,
    # same mtime (a re-upload replaces the file by rename). Rank 1's interrupted file came whole from B.
    sdir = ckpt_dir(root, name) / "sessions" / session
    rank0_files, rank1_files = res[0]["files"], res[1]["files"]
    assert set(rank0_files) | set(rank1_files[:-1]) <= set(before), sorted(before)
    assert rank1_files[-1] not in before
    for f, ident in before.items():
        st = (sdir / "files" / f).stat()
        assert (st.st_ino, st.st_mtime_ns) == ident, f"{f} was rewritten after the kill"
    # The partial stream A was writing when it died stays as a hidden temp file in the session folder
    # (FileSink never committed it); readers never see it and verify ignores it.
    leftovers = [p.name for p in (sdir / "files").iterdir() if p.name.startswith(".")]
    print("temp files left by the killed replica:", leftovers)

    assert_served_alike([b.url], name, session, digest)
    assert_loads(b.url, f"{RUN}/{name}", full_state(seed))
    # Reads fail over too, and $CKPTD_URL-style "A,B" works: A is still dead, the first call moves to B
    # at once, not after retrying A for its budget (60 s: the bound below is far from it).
    with CheckpointClient(f"{a.url},{b.url}", retry_seconds=60) as c:
        t0 = time.monotonic()
        assert [x.name for x in c.list_checkpoints(RUN)] == [name]
        assert time.monotonic() - t0 < scaled(15) and c._transport.url == b.url
    assert_loads(f"{a.url},{b.url}", f"{RUN}/{name}", full_state(seed))
    assert_verifies(f"{RUN}/{name}", "--root", str(root))
    a.start()  # the killed replica comes back and serves it too
    assert_served_alike([a.url, b.url], name, session, digest)
    assert_loads([a.url, b.url], f"{RUN}/{name}", full_state(seed))
    assert not server_errors(b), server_errors(b)


def crash_job(rank: int, world: int, urls: list[list[str]], ref: str, seed: int) -> dict:
    warn = _Warnings()
    logging.getLogger("ckptd_client").addHandler(warn)
    with CheckpointClient(urls[rank], retry_seconds=60, file_bytes=FILE_BYTES) as client:
        st, _ = _phased_save(client, rank, world, ref, seed, first=(2, 3), settle=True)  # last indexes: A
        return {"status": st.model_dump(mode="json"), "url_at_end": client._transport.url,
                "warnings": warn.lines}


@pytest.mark.parametrize("point", ["upload-mid-stream", "upload-before-digest", "index-written",
                                   "commit-before-marker", "commit-after-marker"])
def test_replica_dying_at_a_crash_point_the_other_finishes(tmp_path, point):
    """A SIGKILLs itself at ``point`` while ranks 0, 1 use it (their indexes are the last to come, so the
    commit points are reached on A); they fail over to B, which finishes the same session."""
    assert point in CRASH_POINTS
    root = tmp_path / "root"
    a = ServerProcess(root, log=tmp_path / "a.log", env={"CKPTD_FAULTS": f"crash-at={point}",
                                                         "CKPTD_WRITE_BATCH_BYTES": str(16 << 10)})
    b = ServerProcess(root, log=tmp_path / "b.log")
    try:
        a.start(wait=False), b.start(wait=False)
        a.wait_ready(), b.wait_ready()
        urls = [[a.url, b.url], [a.url, b.url], [b.url, a.url], [b.url, a.url]]
        seed = 70 + CRASH_POINTS.index(point)
        with CommitWatcher(LocalStorage(root, durable=False), [a.url, b.url]) as watch:
            records = run_ranks(crash_job, 4, urls, f"{RUN}/7", seed, tmp=tmp_path, timeout=180)
        assert a.proc is not None and a.proc.wait(10) < 0, "replica A did not reach its crash point"
        res = [r["result"] for r in records]
        sts = [r["status"] for r in res]
        assert {s["state"] for s in sts} == {"committed"}, sts
        session, digest = sts[0]["session"], sts[0]["manifest_xxh3"]
        assert all(s["session"] == session and s["manifest_xxh3"] == digest for s in sts)
        ends = [r["url_at_end"] for r in res]
        assert ends[2:] == [b.url] * 2, ends  # ranks 2, 3 started on B
        # The rank whose index made A commit lost its answer and moved to B. The other A rank may have
        # learned of the commit from A itself (its status poll sees the marker before A's crash point).
        if point == "commit-after-marker":
            assert b.url in ends[:2], ends
        else:
            assert ends[:2] == [b.url] * 2, ends
        assert any("failing over" in w for w in res[0]["warnings"] + res[1]["warnings"])
        watch.assert_once("7", session, digest)
        assert_loads(b.url, f"{RUN}/7", full_state(seed))
        assert_verifies(f"{RUN}/7", "--root", str(root))
        assert not server_errors(b), server_errors(b)
    finally:
        a.kill(), b.kill()
