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
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from typing import Callable

import httpx
import pytest

from ckptd.storage import LocalStorage, open_storage
from ckptd_client import CheckpointClient
from ckptd_schemas import CorruptCheckpoint, IntegrityError, StorageError
from support import REPO, ServerProcess, assert_bits_equal, blank_like, make_state

ATTACKS = ["truncate", "delete", "garbage", "append", "swap"]
BOUND_S = 15.0  # generous: the typed error comes in well under a second; retries would take RETRY_S
RETRY_S = 40.0  # the clients' retry window for transient failures: longer than BOUND_S
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
