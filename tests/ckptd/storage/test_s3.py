"""S3 through s3fs against a real S3 protocol server on loopback (moto in server mode).

The storage conformance suite runs on S3 too (test_storage.py, backend ``s3``).
Here: the environment (endpoint, credentials, retry settings), streaming
multipart uploads, the conditional PUT across instances and processes, retries
with backoff on throttling and 5xx through a fault-injecting proxy, and end to
end: ``ckptd serve --root s3://...`` with FSDP2 saving on 2 gloo ranks and
loading on 3, then ``ckptd verify`` and ``ckptd reshard`` offline on the same
``s3://`` root.
"""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from ckptd.storage import open_storage
from ckptd.storage.s3 import DEFAULT_BLOCK_SIZE, DEFAULT_MAX_ATTEMPTS, S3Storage, s3_options_from_env
from ckptd_schemas import StorageError
from s3_server import pending_uploads
from support import scaled

MiB = 1 << 20


@pytest.fixture
def s3(moto_s3, s3_env):
    """A fresh ``s3://bucket/prefix`` root opened from the environment."""
    st = open_storage(moto_s3.url())
    assert isinstance(st, S3Storage)
    yield st
    moto_s3.clear(st._prefix)


# -- environment -----------------------------------------------------------------------------------


def test_options_from_the_standard_aws_environment():
    assert s3_options_from_env({}) == {
        "config_kwargs": {"retries": {"mode": "standard", "total_max_attempts": DEFAULT_MAX_ATTEMPTS},
                          "signature_version": "s3v4"}}
    env = {"AWS_ENDPOINT_URL": "http://generic:9000", "AWS_MAX_ATTEMPTS": "4", "AWS_RETRY_MODE": "adaptive"}
    assert s3_options_from_env(env) == {"endpoint_url": "http://generic:9000",
                                        "config_kwargs": {"retries": {"mode": "adaptive", "total_max_attempts": 4},
                                                          "signature_version": "s3v4"}}
    env["AWS_ENDPOINT_URL_S3"] = "http://s3-only:9000"  # the service-specific variable wins
    assert s3_options_from_env(env)["endpoint_url"] == "http://s3-only:9000"
    env["AWS_IGNORE_CONFIGURED_ENDPOINT_URLS"] = "true"
    assert "endpoint_url" not in s3_options_from_env(env)


def test_generic_endpoint_variable_and_root_at_the_bucket(moto_s3, s3_env, monkeypatch):
    monkeypatch.delenv("AWS_ENDPOINT_URL_S3")
    monkeypatch.setenv("AWS_ENDPOINT_URL", moto_s3.endpoint)
    st = open_storage(f"s3://{moto_s3.bucket}")  # no prefix: keys sit at the bucket's top level
    key = f"top-{os.getpid()}-{time.monotonic_ns()}"
    try:
        st.put(f"{key}/obj", b"at the root")
        assert moto_s3.client().get_object(Bucket=moto_s3.bucket, Key=f"{key}/obj")["Body"].read() == b"at the root"
        assert key in st.list("")
        assert st.block_size == DEFAULT_BLOCK_SIZE
    finally:
        st.delete_tree(key)
    assert st.list(key) == []


def test_unreachable_endpoint_errors_name_the_key(moto_s3, s3_env, monkeypatch):
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", "http://127.0.0.1:9")  # nothing listens on the discard port
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "2")
    st = open_storage(moto_s3.url())
    with pytest.raises(StorageError, match="run/ck/data-0"):
        st.put("run/ck/data-0", b"x")
    with pytest.raises(StorageError, match="run/ck/COMMITTED"):
        st.create_if_absent("run/ck/COMMITTED", b"x")


# -- streaming multipart uploads ---------------------------------------------------------------------


def test_streaming_multipart_upload_larger_than_a_block(moto_s3, s3):
    small = open_storage(s3.url, default_block_size=5 * MiB)  # S3's smallest part size
    assert isinstance(small, S3Storage) and small.block_size == 5 * MiB
    data = os.urandom(12 * MiB + 12345)
    w = small.open_write("big/data-0")
    for i in range(0, len(data), MiB):
        w.write(memoryview(data)[i:i + MiB])
    # Two full parts went out while streaming; the object is not there until commit.
    assert pending_uploads(small, "big") == ["big/data-0"]
    assert small.size("big/data-0") is None and small.list("big") == []
    w.commit()
    assert pending_uploads(small, "big") == []
    assert small.size("big/data-0") == len(data)
    head = moto_s3.client().head_object(Bucket=moto_s3.bucket, Key=f"{small._prefix}/big/data-0")
    assert head["ETag"].strip('"').endswith("-3")  # completed from 3 parts: 5 + 5 + 2 MiB
    assert small.read("big/data-0") == data
    for start, end in [(0, 10), (5 * MiB - 3, 5 * MiB + 3), (10 * MiB - 1, 12 * MiB + 1), (len(data) - 5, None)]:
        assert small.read("big/data-0", start, end) == data[start:end], (start, end)
    buf = bytearray(3 * MiB)
    assert small.read_into("big/data-0", 4 * MiB, memoryview(buf)) == len(buf)
    assert bytes(buf) == data[4 * MiB:7 * MiB]


def test_default_block_size_upload_through_the_service_path(s3):
    """A shard larger than the default block (32 MiB) streams through the protocol's FileSink."""
    from ckptd.store.intake import FileSink
    from ckptd_schemas.filedigest import xxh3_hex

    data = os.urandom(DEFAULT_BLOCK_SIZE + 3 * MiB + 1)
    sink = FileSink(s3, "run/ck/files/data-0", "run/ck/digests/data-0", "data-0", MiB)
    for i in range(0, len(data), 4 * MiB):
        sink.write(data[i:i + 4 * MiB])
    assert pending_uploads(s3, "run") == ["run/ck/files/data-0"]
    res = sink.finish(xxh3_hex(data))
    assert res.size == len(data)
    assert pending_uploads(s3, "run") == [] and s3.size("run/ck/files/data-0") == len(data)
    assert s3.read("run/ck/files/data-0", DEFAULT_BLOCK_SIZE - 7, DEFAULT_BLOCK_SIZE + 7) == \
        data[DEFAULT_BLOCK_SIZE - 7:DEFAULT_BLOCK_SIZE + 7]
    # A mismatching digest drops the upload: nothing at the key, no parts left.
    sink = FileSink(s3, "run/ck/files/data-1", "run/ck/digests/data-1", "data-1", MiB)
    for i in range(0, len(data), 4 * MiB):
        sink.write(data[i:i + 4 * MiB])
    with pytest.raises(Exception, match="declared"):
        sink.finish("0" * 16)
    assert s3.size("run/ck/files/data-1") is None and pending_uploads(s3, "run") == []


def test_part_size_grows_so_that_10000_parts_hold_large_shards(s3):
    w = s3.open_write("never/committed")
    sizes = []
    for n in range(10_000):
        w._parts = [None] * n  # type: ignore[attr-defined]
        sizes.append(w.part_size())  # type: ignore[attr-defined]
    w._parts = []  # type: ignore[attr-defined]
    w.abort()
    assert sizes[0] == DEFAULT_BLOCK_SIZE and sizes == sorted(sizes)
    assert sum(sizes) > (1 << 40)  # a shard over 1 TiB still fits in S3's 10,000 parts


def test_multipart_abort_leaves_nothing_and_keeps_the_previous_object(s3):
    small = open_storage(s3.url, default_block_size=5 * MiB)
    small.put("ab/obj", b"committed")
    w = small.open_write("ab/obj")
    w.write(os.urandom(11 * MiB))
    assert pending_uploads(small, "ab") == ["ab/obj"]
    w.abort()
    w.abort()
    assert pending_uploads(small, "ab") == [] and small.read("ab/obj") == b"committed"


def test_a_dropped_writer_publishes_nothing_and_delete_tree_reaps_its_parts(s3):
    small = open_storage(s3.url, default_block_size=5 * MiB)
    w = small.open_write("sess/s1/files/data-0")
    w.write(os.urandom(6 * MiB))  # one part uploaded, 1 MiB buffered
    del w
    gc.collect()
    assert small.size("sess/s1/files/data-0") is None
    assert pending_uploads(small, "sess") == ["sess/s1/files/data-0"]
    small.delete_tree("sess/s1")  # reclaiming a session also aborts its unfinished uploads
    assert pending_uploads(small, "sess") == [] and small.list("sess") == []


def test_the_commit_aborts_the_unfinished_uploads_of_killed_writers_and_verify_walks_objects(s3):
    """What a writer killed mid-upload leaves on S3 is no object (invisible to reads, listings and a
    walk) but an unfinished multipart upload whose parts stay stored until aborted: the commit aborts
    every one under its session."""
    from ckptd.store import SessionStore
    from ckptd.store.verification import verify_unrecorded
    from ckptd_schemas import OpenSession
    from store.staging import file_of, put_indexes, stage  # tests/ckptd/store: sessions on a store

    small = open_storage(s3.url, default_block_size=5 * MiB)
    store = SessionStore(small)
    store.open("r", "1", OpenSession(session="s1", world_size=2, step=1))
    killed = store.intake.receive("r", "1", "s1", file_of(1))  # never finished nor aborted: a killed writer
    killed.write(os.urandom(6 * MiB))  # one part uploaded
    assert pending_uploads(small, "runs") == [f"runs/r/1/sessions/s1/files/{file_of(1)}"]
    assert not [k for k, _ in small.walk("runs") if k.endswith(file_of(1))]
    stage(store, "r", "1", "s1", world=2)  # the retries
    put_indexes(store, "r", "1", "s1", world=2)
    assert small.exists("runs/r/1/COMMITTED") and pending_uploads(small, "runs") == []
    rec = verify_unrecorded(small, "r", "1")
    assert rec.ok and rec.strays == []
    small.put("runs/r/1/sessions/s1/files/planted", b"x" * 10)
    assert [(x.key, x.size) for x in verify_unrecorded(small, "r", "1").strays] == \
        [("runs/r/1/sessions/s1/files/planted", 10)]
    del killed


# -- presigned uploads ------------------------------------------------------------------------------


def test_presign_put_is_the_first_call_of_a_fresh_storage(s3):
    """A root opened just now (its own s3fs instance, not connected yet) presigns a single ``PutObject``
    and a multipart upload as its first call; the signed bytes PUT to the URLs are stored. (Before, the
    presign asked s3fs for a client it had not made yet: AttributeError on ``None``, answered as a
    storage error.)"""
    import base64
    import hashlib

    import httpx

    def sha(data: bytes) -> str:
        return base64.b64encode(hashlib.sha256(data).digest()).decode()

    one = b"a" * 4096
    got = open_storage(s3.url, skip_instance_cache=True).presign_put("runs/p/one.bin", len(one), 5 * MiB,
                                                                     [sha(one)], 60)
    assert got.upload_id is None and len(got.urls) == 1
    assert httpx.put(got.urls[0], content=one, headers=got.headers[0], timeout=30).status_code == 200
    assert s3.read("runs/p/one.bin") == one
    parts = [b"b" * (5 * MiB), b"c" * MiB]
    fresh = open_storage(s3.url, skip_instance_cache=True)
    got = fresh.presign_put("runs/p/two.bin", 6 * MiB, 5 * MiB, [sha(p) for p in parts], 60)
    assert got.upload_id is not None and len(got.urls) == 2
    etags = []
    for url, headers, part in zip(got.urls, got.headers, parts):
        r = httpx.put(url, content=part, headers=headers, timeout=30)
        assert r.status_code == 200, r.text
        etags.append(r.headers["ETag"])
    fresh.complete_presigned("runs/p/two.bin", got.upload_id, etags, [sha(p) for p in parts])
    assert s3.read("runs/p/two.bin") == b"".join(parts)


# -- create_if_absent: a conditional PUT ----------------------------------------------------------


def test_create_if_absent_across_independent_instances(s3):
    # Separate s3fs instances (no shared cache, no shared lock): only the server decides.
    a = open_storage(s3.url, skip_instance_cache=True)
    b = open_storage(s3.url, skip_instance_cache=True)
    assert a.fs is not b.fs
    assert a.create_if_absent("run/ck/COMMITTED", b"from a") is True
    assert b.create_if_absent("run/ck/COMMITTED", b"from b") is False
    assert b.read("run/ck/COMMITTED") == b"from a"


_RACER = textwrap.dedent("""
    import sys, time
    from ckptd.storage import open_storage
    st = open_storage(sys.argv[1])
    st.size("warm-up")  # connected
    print("ready", flush=True)
    t0, n, me = float(sys.stdin.readline()), int(sys.argv[2]), sys.argv[3]
    out = []
    for i in range(n):
        while time.time() < t0 + i * 0.03:  # every process tries key i at the same moment
            pass
        out.append("1" if st.create_if_absent(f"race/{i}/COMMITTED", f"{me}:{i}".encode()) else "0")
    print("".join(out), flush=True)
""")


def test_create_if_absent_is_exactly_once_across_processes(moto_s3, s3):
    n, procs = 40, 3
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    ps = [subprocess.Popen([sys.executable, "-c", _RACER, s3.url, str(n), f"p{j}"], env=env, stdin=subprocess.PIPE,
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for j in range(procs)]
    try:
        for p in ps:
            assert p.stdout.readline().strip() == "ready", p.stderr.read() if p.poll() is not None else "no ready"
        t0 = time.time() + 0.3
        for p in ps:
            p.stdin.write(f"{t0}\n")
            p.stdin.flush()
        outs = []
        for p in ps:
            out, err = p.communicate(timeout=120)
            assert p.returncode == 0, err
            outs.append(out.strip())
    finally:
        for p in ps:
            if p.poll() is None:
                p.kill()
    for i in range(n):
        winners = [j for j in range(procs) if outs[j][i] == "1"]
        assert len(winners) == 1, (i, outs)
        assert s3.read(f"race/{i}/COMMITTED") == f"p{winners[0]}:{i}".encode()


# -- retries with backoff on throttling and 5xx ----------------------------------------------------


@pytest.fixture
def proxied(moto_s3, s3, monkeypatch):
    """(storage through the fault proxy, proxy, the same root's key prefix on the server)."""
    from s3_server import FaultProxy

    with FaultProxy(moto_s3) as proxy:
        monkeypatch.setenv("AWS_ENDPOINT_URL_S3", proxy.endpoint)
        monkeypatch.setenv("AWS_MAX_ATTEMPTS", "3")
        st = open_storage(s3.url, default_block_size=5 * MiB)
        yield st, proxy, f"/{moto_s3.bucket}/{st._prefix}/"


def _on(method: str, path_end: str = "", query_has: str | None = None):
    def match(m: str, path: str, query: str) -> bool:
        return m == method and path.endswith(path_end) and (query_has is None or query_has in query)
    return match


def test_throttling_and_5xx_are_retried(proxied):
    from s3_server import FaultRule

    st, proxy, _ = proxied
    put = proxy.add(FaultRule(_on("PUT", "/t/a"), status=503, code="SlowDown", times=2))
    st.put("t/a", b"payload")
    assert put.hits == 2
    get = proxy.add(FaultRule(_on("GET", "/t/a"), status=500, code="InternalError", times=1))
    assert st.read("t/a", 1, 4) == b"ayl"
    assert get.hits == 1
    head = proxy.add(FaultRule(_on("HEAD", "/t/a"), status=503, code="SlowDown", times=1))
    assert st.size("t/a") == 7 and head.hits == 1
    lst = proxy.add(FaultRule(_on("GET", query_has="list-type=2"), status=502, code="BadGateway", times=1))
    assert st.list("t") == ["a"] and lst.hits == 1
    # A part of a streaming multipart upload, and its completion.
    part = proxy.add(FaultRule(_on("PUT", "/t/big", query_has="partNumber=2"), status=500, code="InternalError"))
    done = proxy.add(FaultRule(_on("POST", "/t/big", query_has="uploadId"), status=503, code="ServiceUnavailable"))
    data = os.urandom(11 * MiB)
    st.put("t/big", data)
    assert part.hits == 1 and done.hits == 1
    assert st.read("t/big") == data
    # The conditional PUT: throttled, then a 409 ConditionalRequestConflict, then it wins once.
    cond = proxy.add(FaultRule(_on("PUT", "/t/COMMITTED"), status=503, code="SlowDown", times=1))
    conflict = proxy.add(FaultRule(_on("PUT", "/t/COMMITTED"), status=409, code="ConditionalRequestConflict"))
    assert st.create_if_absent("t/COMMITTED", b"m") is True
    assert cond.hits == 1 and conflict.hits == 1
    assert st.create_if_absent("t/COMMITTED", b"other") is False
    assert st.read("t/COMMITTED") == b"m"
    deleted = proxy.add(FaultRule(_on("POST", query_has="delete"), status=500, code="InternalError"))
    st.delete_tree("t")
    assert deleted.hits == 1 and st.list("t") == []


def test_errors_after_the_retries_are_storage_errors_naming_the_key(proxied, monkeypatch):
    from s3_server import FaultRule

    st, proxy, _ = proxied
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "2")
    st = open_storage(st.url, default_block_size=5 * MiB)
    st.put("f/obj", b"data")
    get = proxy.add(FaultRule(_on("GET", "/f/obj"), status=500, code="InternalError", times=1000))
    t0 = time.monotonic()
    with pytest.raises(StorageError) as ei:
        st.read("f/obj", 0, 2)
    assert "f/obj" in ei.value.message and ei.value.details.get("key") == "f/obj"
    assert get.hits == 2  # AWS_MAX_ATTEMPTS
    get.times = 0
    put = proxy.add(FaultRule(_on("PUT", "/f/new"), status=503, code="SlowDown", times=1000))
    with pytest.raises(StorageError) as ei:
        st.put("f/new", b"x")
    assert "f/new" in ei.value.message
    assert put.hits >= 2  # botocore's attempts (s3fs re-runs a call still throttled after them)
    put.times = 0
    assert time.monotonic() - t0 < scaled(60)
    # A part that still fails after the retries, sent while the next block was being received: the write
    # or the commit raises, naming the key, and the upload is aborted once its other parts are answered.
    part = proxy.add(FaultRule(_on("PUT", "/f/big", query_has="partNumber=1"), status=500, code="InternalError",
                               times=1000))
    w = st.open_write("f/big")
    with pytest.raises(StorageError, match="f/big"):
        for _ in range(4):
            w.write(os.urandom(5 * MiB))
        w.commit()
    assert part.hits >= 2 and pending_uploads(st, "f") == [] and st.size("f/big") is None
    slots = [st._in_flight.acquire(blocking=False) for _ in range(st.parts_in_flight)]
    assert all(slots)  # every part's slot came back
    for _ in slots:
        st._in_flight.release()
    part.times = 0
    cond = proxy.add(FaultRule(_on("PUT", "/f/COMMITTED"), status=500, code="InternalError", times=1000))
    with pytest.raises(StorageError, match="f/COMMITTED"):
        st.create_if_absent("f/COMMITTED", b"m")
    assert cond.hits == 2
    cond.times = 0
    assert st.size("f/COMMITTED") is None


# -- end to end: ckptd serve --root s3://, FSDP2 on 2 ranks -> 3 ranks, verify and reshard offline ----


def load_job(rank: int, world: int, url: str, refs: list[str]) -> dict:
    from fsdp_job import load_job as load_one

    return {ref: load_one(rank, world, url, ref) for ref in refs}


def _cli(env: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ckptd.cli.main", *args], capture_output=True, text=True,
                          env=env, timeout=180)


@pytest.mark.slow
def test_fsdp2_save_2_load_3_verify_and_reshard_on_s3(moto_s3, s3, tmp_path):
    from fsdp_job import LR, save_job
    from s3_server import FaultProxy, FaultRule, aws_env, child_env
    from support import ServerProcess, run_ranks

    t0 = time.monotonic()
    proxy = FaultProxy(moto_s3).__enter__()  # the service reaches S3 through the fault proxy
    # Rank files throttled twice; the marker's conditional PUT succeeds but its answer is lost
    # (a 500 after the server acted): the retry reads 412 and the commit must still succeed.
    throttled = proxy.add(FaultRule(lambda m, p, q: m == "PUT" and "/files/" in p, 503, "SlowDown", times=2))
    lost = proxy.add(FaultRule(lambda m, p, q: m == "PUT" and p.endswith("/COMMITTED"), 500, "InternalError",
                               forward=True))
    server = ServerProcess(s3.url, env=aws_env(proxy.endpoint), log=tmp_path / "server.log").start()
    try:
        saved = run_ranks(save_job, 2, server.url, "gpt/3", tmp=tmp_path)[0]["result"]
        t_saved = time.monotonic()
        assert any(k.endswith("exp_avg_sq") for k in saved["tensors"])
        assert throttled.hits == 2 and lost.hits == 1
        # Everything is in the bucket: the marker, the manifest, the rank files; no upload left over,
        # and nothing was ever copied (no rename emulation).
        assert s3.exists("runs/gpt/3/COMMITTED") and pending_uploads(s3, "") == []
        assert not [line for line in proxy.log if "copy-source" in line]

        # Offline, in their own processes, on the same s3:// root (endpoint from AWS_ENDPOINT_URL this time).
        cli_env = child_env(aws_env(moto_s3.endpoint, var="AWS_ENDPOINT_URL"))
        v = _cli(cli_env, "verify", "gpt/3", "--root", s3.url, "--json")
        assert v.returncode == 0, v.stdout + v.stderr
        rep = json.loads(v.stdout)
        assert rep["ok"] and rep["files"] >= 2 and rep["bytes_read"] > 0 and rep["strays"] == []
        r = _cli(cli_env, "reshard", "gpt/3", "--to", "fsdp2:dp=3", "--root", s3.url, "--json", "--device", "cpu")
        assert r.returncode == 0, r.stdout + r.stderr
        res = json.loads(r.stdout)
        assert res["ref"] == "gpt/3-fsdp2-dp3" and len(res["per_rank_bytes"]) == 3
        ls = _cli(cli_env, "ls", "gpt", "--root", s3.url)
        assert ls.returncode == 0 and "3-fsdp2-dp3" in ls.stdout, ls.stdout + ls.stderr
        t_cli = time.monotonic()

        # 3 ranks load the 2-rank checkpoint and the resharded one through the service, bit for bit.
        records = run_ranks(load_job, 3, server.url, ["gpt/latest", "gpt/3-fsdp2-dp3"], tmp=tmp_path)
        t_loaded = time.monotonic()
        for ref, got in records[0]["result"].items():
            assert got["lr"] == LR and got["restored"] == len(saved["tensors"]), ref
            assert set(got["tensors"]) == set(saved["tensors"]), ref
            for name, t in saved["tensors"].items():
                assert torch.equal(got["tensors"][name].view(-1).view(torch.uint8), t.view(-1).view(torch.uint8)), \
                    f"{name} differs after loading {ref} at world size 3"
            assert got["loss_next"] == pytest.approx(saved["loss_next"], rel=1e-6, abs=1e-7), ref
            assert got["loss_after"] == pytest.approx(saved["loss_after"], rel=1e-5, abs=1e-6), ref
    finally:
        server.stop()
        proxy.__exit__()

    # verify reads every byte from S3: one flipped byte in a rank's file is caught (exit 1).
    from ckptd.store import CheckpointReader

    key, _ = CheckpointReader(s3).file_key("gpt", "3", sorted(CheckpointReader(s3).manifest("gpt", "3").files)[0])
    data = bytearray(s3.read(key))
    data[len(data) // 2] ^= 0xFF
    s3.put(key, bytes(data))
    bad = _cli(cli_env, "verify", "gpt/3", "--root", s3.url)
    assert bad.returncode == 1, bad.stdout + bad.stderr
    assert "FAIL" in bad.stdout
    print(f"\ns3 e2e: save {t_saved - t0:.1f}s, verify+reshard+ls {t_cli - t_saved:.1f}s, "
          f"load x2 at 3 ranks {t_loaded - t_cli:.1f}s, total {time.monotonic() - t0:.1f}s")


def test_incremental_saves_copy_unchanged_files_inside_the_store(moto_s3, s3, tmp_path):
    """On S3 a link is a copy inside the store (no byte of the frozen part passes the rank or the
    service), conditional on the checked object's ETag, and the commit rests on that check instead of
    reading the copy; the later checkpoint loads bit for bit after the earlier one is deleted."""
    from s3_server import aws_env
    from support import ServerProcess, assert_bits_equal, blank_like

    from ckptd_client import CheckpointClient

    g = torch.Generator().manual_seed(3)
    frozen = {f"layer{i}": torch.randn(256, 256, generator=g) for i in range(4)}
    states = [{"model": {**frozen, "adapter": torch.full((1000,), float(s))}} for s in (1, 2)]
    server = ServerProcess(s3.url, env=aws_env(moto_s3.endpoint), log=tmp_path / "server.log").start()
    try:
        import httpx
        from support import verified

        def read_back() -> float:
            text = httpx.get(f"{server.url}/metrics").text
            return sum(float(line.split()[-1]) for line in text.splitlines()
                       if line.startswith('ckptd_commit_checked_bytes_total{how="read back"'))

        client = CheckpointClient(server.url, file_bytes=MiB)
        client.save(states[0], "inc/1").wait()
        verified(server.url, "inc/1")  # a file is linked only as its last check found it
        before = read_back()
        client.save(states[1], "inc/2").wait()
        from ckptd_schemas import Manifest

        m = Manifest.model_validate_json(httpx.get(f"{server.url}/v1/checkpoints/inc/2").content)
        frozen_bytes = sum(t.numel() * 4 for t in frozen.values())
        assert m.linked_bytes >= frozen_bytes and m.total_bytes - m.linked_bytes < frozen_bytes / 4
        assert read_back() - before < frozen_bytes / 4, (before, read_back())
        s3.delete_tree("runs/inc/1")
        got = blank_like(states[1])
        client.load(got, "inc/2")
        assert_bits_equal(got, states[1])
        client.close()
    finally:
        server.stop()


def test_a_link_under_a_stamp_the_source_no_longer_has_copies_nothing(s3):
    """A source replaced after its stamp was taken (by another writer of the bucket) is not copied, and
    the destination is never created (the copy is conditional on the checked ETag as well, which moto
    does not enforce: the look before it refuses here)."""
    s3.put("ln/src", b"checked bytes")
    checked = s3.stamp("ln/src")
    s3.put("ln/src", b"other bytes!!")  # the same size: only the ETag tells
    assert s3.link("ln/src", "ln/dst", checked) is False and not s3.exists("ln/dst")
    assert s3.link("ln/src", "ln/dst", s3.stamp("ln/src")) is True and s3.read("ln/dst") == b"other bytes!!"


def test_a_small_record_is_read_in_one_ranged_get_and_a_planted_large_one_never_whole(s3):
    """A marker or verification record on S3 is read up to one byte past its limit (``read_head``, one
    ranged GET): a 64 MiB object planted under a record's key is refused from its first bytes, an empty
    one reads empty, an absent one is None."""
    from ckptd.store.paths import read_small

    s3.put("runs/r/1/COMMITTED", b"m" * (64 << 20))
    s3.put("runs/r/2/COMMITTED", b"")
    s3.put("runs/r/3/COMMITTED", b'{"ref": "r/3"}')
    assert len(s3.read_head("runs/r/1/COMMITTED", 65537)) == 65537
    assert read_small(s3, "runs/r/1/COMMITTED", 65536) == (None, "holds more than 65536 bytes")
    assert read_small(s3, "runs/r/2/COMMITTED", 65536) == (b"", None)
    assert read_small(s3, "runs/r/3/COMMITTED", 65536) == (b'{"ref": "r/3"}', None)
    assert read_small(s3, "runs/r/4/COMMITTED", 65536) == (None, None)
