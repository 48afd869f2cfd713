"""An attacker edits the storage root of a committed checkpoint while the service runs.

Each attack (truncate a data file, delete it, overwrite it with garbage of the same size, append
bytes, swap two files of one checkpoint) is made on a local root (loads with direct reads on and
off) and on S3 (moto on loopback). What must hold: ``client.load`` raises
:class:`CorruptCheckpoint` naming the file and the tensors within seconds (never minutes of retries);
the service stays up and answers ``/healthz`` with no unhandled error in its log; an intact older
checkpoint still loads bit for bit; ``ckptd verify --root``, ``--server`` and ``--server --in-service``
all exit 1 naming the file, with the same problems. And the converse: a transient storage error is still
retried (a failing backend read with the file intact is not corruption), and a manifest whose bytes
differ from the digest the service declares is refused.

More damage, read through every path that restores the checkpoint. The checkpoint holds zstd chunks,
raw chunks and a stored (``torch``) object. The attacks: a byte of a zstd chunk flipped; a byte of the
stored object flipped, read alone (the load fetches only the object's bytes); the data file truncated;
and a flipped byte with the session's digest record (``sessions/<sid>/digests/<file>``) rewritten to
the damaged bytes, which nothing may trust once the manifest is written. Each must fail typed
(:class:`CorruptCheckpoint`, naming the file and what it would fill) within seconds on every path:
``client.load`` with direct reads and over HTTP, DCP through ``client.dcp_reader``, ``ckptd export``,
``ckptd reshard`` and ``ckptd verify``, each exiting 1 with a message and no traceback.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

import httpx
import pytest
import torch

from ckptd.storage import LocalStorage, open_storage
from ckptd_client import CheckpointClient
from ckptd_schemas import CorruptCheckpoint, FileEntry, IntegrityError, StorageError
from ckptd_schemas.filedigest import StreamDigest
from support import REPO, ServerProcess, assert_bits_equal, blank_like, make_state, scaled

ATTACKS = ["truncate", "delete", "garbage", "append", "swap"]
BOUND_S = scaled(25.0)  # generous (a busy machine took 17 s): the typed error comes in a second or two alone; retries would take RETRY_S
RETRY_S = scaled(40.0)  # the clients' retry window for transient failures: longer than BOUND_S
MiB = 1 << 20


def _state(seed: int) -> dict:
    return make_state(seed, mib=2.0)


def _save_two(url: str) -> dict:
    """``c/1`` (stays intact) and ``c/2`` (attacked), each of at least two data files."""
    with CheckpointClient(url, file_bytes=MiB) as c:
        c.save(_state(1), "c/1").wait()
        c.save(_state(2), "c/2").wait()
        files = sorted(c.manifest("c/2").files)
    assert len(files) >= 2, files
    return {"files": files}


def _attack(kind: str, read: Callable[[str], bytes], write: Callable[[str, bytes], None],
            delete: Callable[[str], None], keys: list[str]) -> str:
    """Damage the checkpoint through the storage's own primitives; return the file attacked."""
    a, b = keys[0], keys[1]
    data = read(a)
    if kind == "truncate":
        write(a, data[:len(data) // 2])
    elif kind == "delete":
        delete(a)
    elif kind == "garbage":
        write(a, os.urandom(len(data)))
    elif kind == "append":
        write(a, data + b"appended by the attacker")
    elif kind == "swap":
        other = read(b)
        write(a, other)
        write(b, data)
    return a.rsplit("/", 1)[1]


def _cli(env: dict | None, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ckptd.cli.main", *args], capture_output=True, text=True,
                          cwd=REPO, env=env, timeout=300)


def _check_attack(srv: ServerProcess, root_url: str, env: dict | None, attacked: str, files: list[str],
                  direct: tuple[bool, ...]) -> dict:
    """The load fails typed and fast, the service stays up, c/1 still loads, verify agrees."""
    times = {}
    for d in direct:
        t0 = time.monotonic()
        with CheckpointClient(srv.url, direct_reads=d, retry_seconds=RETRY_S) as c:
            with pytest.raises(CorruptCheckpoint) as info:
                c.load(blank_like(_state(2)), "c/2")
        times[d] = time.monotonic() - t0
        err = info.value
        assert isinstance(err, IntegrityError) and times[d] < BOUND_S, (times, err)
        assert attacked in str(err) and err.details.get("tensors"), err
        assert any(f"'{t}'" in str(err) for t in err.details["tensors"]), err
    assert httpx.get(f"{srv.url}/healthz", timeout=5).status_code == 200
    with CheckpointClient(srv.url, retry_seconds=RETRY_S) as c:
        got = blank_like(_state(1))
        c.load(got, "c/1")
    assert_bits_equal(got["model"], _state(1)["model"])
    reports = {}
    for where in (["--root", root_url], ["--server", srv.url], ["--in-service", "--server", srv.url]):
        p = _cli(env, "verify", "c/2", "--json", *where)
        assert p.returncode == 1, (where, p.stdout, p.stderr)
        reports[where[0]] = json.loads(p.stdout)
        assert not reports[where[0]]["ok"] and any(attacked in x for x in reports[where[0]]["problems"]), reports
    assert reports["--root"]["problems"] == reports["--server"]["problems"] == reports["--in-service"]["problems"], \
        reports
    log = srv.log.read_text()
    assert "Traceback" not in log and "Content-Length" not in log, log[-3000:]
    return times


@pytest.mark.parametrize("attack", ATTACKS)
def test_attacked_local_root_fails_fast_and_typed(tmp_path, attack):
    srv = ServerProcess(tmp_path / "root").start()
    try:
        files = _save_two(srv.url)["files"]
        st = LocalStorage(tmp_path / "root")
        keys = [str(p.relative_to(st.root)) for f in files for p in st.root.glob(f"runs/c/2/sessions/*/files/{f}")]
        attacked = _attack(attack, st.read, st.put, st.delete, keys)
        times = _check_attack(srv, str(tmp_path / "root"), None, attacked, files, (True, False))
        print(f"\n{attack} local: typed error after {times[True]:.2f}s (direct reads), {times[False]:.2f}s (HTTP)")
    finally:
        srv.stop()


@pytest.fixture
def s3_root(moto_s3, s3_env):
    st = open_storage(moto_s3.url())
    yield st
    moto_s3.clear(st._prefix)


@pytest.mark.parametrize("attack", ATTACKS)
def test_attacked_s3_root_fails_fast_and_typed(moto_s3, s3_root, tmp_path, attack):
    from s3_server import aws_env, child_env

    env = child_env(aws_env(moto_s3.endpoint))
    srv = ServerProcess(s3_root.url, env=aws_env(moto_s3.endpoint), log=tmp_path / "server.log").start()
    try:
        files = _save_two(srv.url)["files"]
        sid = s3_root.list("runs/c/2/sessions")[0]
        keys = [f"runs/c/2/sessions/{sid}/files/{f}" for f in files]
        attacked = _attack(attack, s3_root.read, s3_root.put, s3_root.delete, keys)
        times = _check_attack(srv, s3_root.url, env, attacked, files, (False,))
        print(f"\n{attack} s3: typed error after {times[False]:.2f}s")
    finally:
        srv.stop()


def test_a_transient_s3_read_failure_is_retried_not_corruption(moto_s3, s3_root, tmp_path, caplog):
    """The service's GET of a data file fails (500, past the service's own S3 retries) a few times with
    the object intact: the service answers 503, the client retries, and the load succeeds bit for bit."""
    from s3_server import FaultProxy, FaultRule, aws_env

    with FaultProxy(moto_s3) as proxy:
        env = {**aws_env(proxy.endpoint), "AWS_MAX_ATTEMPTS": "1"}
        srv = ServerProcess(s3_root.url, env=env, log=tmp_path / "server.log").start()
        try:
            _save_two(srv.url)
            rule = proxy.add(FaultRule(lambda m, p, q: m == "GET" and "/runs/c/2/" in p and "/files/" in p,
                                       500, "InternalError", times=6))
            got = blank_like(_state(2))
            with caplog.at_level("WARNING", logger="ckptd_client"):
                with CheckpointClient(srv.url, retry_seconds=RETRY_S) as c:
                    c.load(got, "c/2")
            assert rule.hits == 6
            assert any("retrying" in r.getMessage() for r in caplog.records)
            assert_bits_equal(got["model"], _state(2)["model"])
        finally:
            srv.stop()


class _FlakyStorage(LocalStorage):
    """A local root whose reads fail ``fails`` times (the backend, not the bytes)."""

    fails = 0

    def read(self, key: str, start: int = 0, end: int | None = None) -> bytes:
        if self.fails:
            self.fails -= 1
            raise StorageError(f"storage read of {key!r} failed: injected", key=key)
        return super().read(key, start, end)


def test_storage_tells_damage_from_a_failing_backend(tmp_path):
    st = _FlakyStorage(tmp_path)
    st.put("f", b"x" * 100)
    assert st.read_committed("f", 10, 20, 100) == b"x" * 10
    st.fails = 1  # the file is whole: the failure stays a StorageError, which callers retry
    with pytest.raises(StorageError) as info:
        st.read_committed("f", 0, 100, 100)
    assert not isinstance(info.value, IntegrityError)
    with pytest.raises(CorruptCheckpoint, match="holds 100 bytes, its manifest says 120"):
        st.read_committed("f", 100, 120, 120, file="f")
    st.fails = 1
    with pytest.raises(CorruptCheckpoint, match="holds 100 bytes"):
        st.read_committed("f", 0, 10, 120)
    st.delete("f")
    with pytest.raises(CorruptCheckpoint, match="missing") as missing:
        st.read_committed("f", 0, 10, 100, file="f")
    assert missing.value.details["file"] == "f"
    view = memoryview(bytearray(10))
    with pytest.raises(CorruptCheckpoint, match="missing"):
        st.read_committed_into("f", 0, view, 100)


def test_a_manifest_that_does_not_hash_to_its_declared_digest_is_refused():
    """Every byte a load restores is found through the manifest (inline objects are in it): the
    bytes received are checked against the digest the service declares before they are parsed, by
    the load and by the catalog (``ckptd verify --server``)."""
    import xxhash

    body = b'{"not": "a manifest"}'

    def handler(req: httpx.Request) -> httpx.Response:
        digest = xxhash.xxh3_64_hexdigest(b"what was committed")
        return httpx.Response(200, content=body, headers={"X-Ckptd-Manifest-Xxh3": digest, "X-Ckptd-Name": "1"})

    with CheckpointClient("http://ckptd.invalid", retry_seconds=0) as c:
        c._transport._clients = [httpx.Client(base_url="http://ckptd.invalid", transport=httpx.MockTransport(handler))]
        with pytest.raises(CorruptCheckpoint, match="manifest of bad/1"):
            c.manifest("bad/1")
        with pytest.raises(CorruptCheckpoint, match="manifest of bad/1"):
            c.load({"x": None}, "bad/1")


# == damaged data, read through every path that restores it ==================================================

READ_BOUND_S = scaled(10.0)  # well under RETRY_S, which a retried corruption would take
_n = iter(range(1, 1 << 20))


def _zstd_state() -> dict:
    return {"model": {"w": torch.zeros(512, 1024), "b": torch.arange(1000.0)},  # w: 2 MiB, compresses well
            "extra": {"rng": (1, "tuple-pickled", 2.5)}}


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    base = tmp_path_factory.mktemp("corruption-more")
    s = ServerProcess(base / "root", log=base / "server.log").start()
    yield s
    s.kill()


def _timed_cli(*args: str) -> tuple[subprocess.CompletedProcess, float]:
    t0 = time.monotonic()
    p = subprocess.run([sys.executable, "-m", "ckptd.cli.main", *args], capture_output=True, text=True, cwd=REPO,
                       timeout=120)
    return p, time.monotonic() - t0


def _flip(path: Path, at: int) -> None:
    data = bytearray(path.read_bytes())
    data[at] ^= 0x01
    path.chmod(0o644)
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("attack", ["flip-zstd-chunk", "flip-object", "truncate", "flip-and-rewrite-digest-record"])
def test_damaged_data_fails_typed_and_fast_on_every_read_path(srv, tmp_path, attack):
    ref = f"m{next(_n)}/1"
    run = ref.split("/")[0]
    with CheckpointClient(srv.url, compression="zstd") as c:
        assert c.save(_zstd_state(), ref).wait(timeout=60).state == "committed"
        m = c.manifest(ref)
    w = m.tensor("model.w").chunks[0].location
    obj = next(o for o in m.objects if o.name == "extra.rng").location
    assert w.codec == "zstd" and obj is not None and w.file == obj.file
    session = Path(srv.root) / "runs" / run / "1" / "sessions" / m.session
    path = session / "files" / w.file
    if attack in ("flip-zstd-chunk", "flip-and-rewrite-digest-record"):
        _flip(path, w.offset + w.length // 2)
    elif attack == "flip-object":
        _flip(path, obj.offset + obj.length // 2)
    else:
        path.chmod(0o644)
        path.write_bytes(path.read_bytes()[:path.stat().st_size // 2])
    if attack == "flip-and-rewrite-digest-record":  # the record now vouches for the damaged bytes
        record = session / "digests" / w.file
        old = FileEntry.model_validate_json(record.read_bytes())
        d = StreamDigest(old.block_size)
        d.update(memoryview(path.read_bytes()))
        whole, blocks = d.finish()
        record.chmod(0o644)
        record.write_text(json.dumps({**old.model_dump(), "xxh3": whole, "blocks": blocks}))
    what = "object" if attack == "flip-object" else "tensors"
    names = ["extra.rng"] if attack == "flip-object" else ["model.w"]

    def target() -> dict:  # what the load restores: the object alone, or the whole state
        return {"extra": {"rng": None}} if attack == "flip-object" else {
            "model": {"w": torch.full((512, 1024), 7.0), "b": torch.zeros(1000)}, "extra": {"rng": None}}

    for direct in (True, False):
        t0 = time.monotonic()
        with CheckpointClient(srv.url, direct_reads=direct, retry_seconds=RETRY_S) as c:
            with pytest.raises(CorruptCheckpoint) as info:
                c.load(target(), ref, strict=attack != "flip-object")
        assert time.monotonic() - t0 < READ_BOUND_S
        err = info.value
        assert w.file in str(err), err
        got = err.details.get(what)
        assert got and set(names) <= set([got] if isinstance(got, str) else got), err.details
        assert all(f"'{n}'" in str(err) for n in names), err

    import torch.distributed.checkpoint as dcp

    t0 = time.monotonic()
    with CheckpointClient(srv.url, retry_seconds=RETRY_S) as c:
        with pytest.raises(BaseException) as info:  # DCP wraps a rank's error in a CheckpointException
            dcp.load(target(), storage_reader=c.dcp_reader(ref))
    assert time.monotonic() - t0 < READ_BOUND_S
    failures = getattr(info.value, "failures", None)
    err = next(iter(failures.values()))[0] if failures else info.value
    assert isinstance(err, CorruptCheckpoint), repr(info.value)
    assert w.file in str(err) and any(f"'{n}'" in str(err) for n in [*names, "extra.rng"]), err

    root = str(srv.root)
    for args in (["export", ref, str(tmp_path / "out"), "--root", root],
                 ["export", ref, str(tmp_path / "out.pt"), "--format", "torch", "--server", srv.url],
                 ["reshard", ref, "--to", "fsdp2:dp=2", "--root", root],
                 ["verify", ref, "--root", root], ["verify", ref, "--server", srv.url]):
        if attack == "flip-object" and args[0] != "verify":
            continue  # they read tensors; the object is the load's and the DCP reader's
        p, took = _timed_cli(*args)
        assert p.returncode == 1 and took < READ_BOUND_S + 10, (args, p.returncode, p.stdout, p.stderr)
        out = p.stdout + p.stderr
        assert "Traceback" not in out and w.file in out, (args, out)
        if args[0] in ("export", "reshard"):
            assert "tensor 'model.w'" in out or "tensors stored there: 'model.b', 'model.w'" in out, out
        if args[0] == "verify":
            assert not (Path(root) / "runs" / run / "1-fsdp2-dp2" / "COMMITTED").exists()
    assert not (tmp_path / "out.pt").exists()
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())  # no shard, no index
