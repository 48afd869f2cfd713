"""Bad input is refused with a clear typed error, and never harms what is committed.

A real ``ckptd serve`` on 127.0.0.1; handcrafted requests go over real HTTP
(httpx, and a raw socket where httpx would normalise the path), saves and
loads through the real CheckpointClient. Every test ends by checking that the
good checkpoint committed first still loads bit for bit and that
``ckptd verify`` (its own process) passes on it.
"""

from __future__ import annotations

import copy
import itertools
import json
import os
import socket
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
import xxhash

from ckptd_client import (AlreadyCommitted, CheckpointNotFound, ChecksumMismatch, CheckpointClient, CorruptCheckpoint,
                          IntegrityError, InvalidName)
from support import ServerProcess, assert_bits_equal, blank_like, make_state, verified



# -- helpers -------------------------------------------------------------------------------------------

def cli(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ckptd.cli.main", *args], capture_output=True, text=True,
                          timeout=timeout)


def tree(path: Path) -> dict[str, tuple[int, int]]:
    """Every file and folder under ``path`` (hidden ones included) with size and mtime."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(path):
        for n in dirnames + filenames:
            p = Path(dirpath) / n
            st = p.stat()
            out[str(p.relative_to(path))] = (st.st_size if p.is_file() else 0, st.st_mtime_ns)
    return out


def files_in(d: Path) -> list[str]:
    return sorted(os.listdir(d)) if d.exists() else []


@dataclass
class Env:
    """The shared server over ``box/root``, and this test's run with ``<run>/1`` committed."""

    srv: ServerProcess
    box: Path          # the root's parent: nothing may appear here
    root: Path
    client: CheckpointClient
    http: httpx.Client
    sd1: dict
    run: str           # this test's own run on the shared server; <run>/1 is its good checkpoint

    def session_dir(self, name: str, sid: str, run: str | None = None) -> Path:
        return self.root / "runs" / (run or self.run) / name / "sessions" / sid

    def error(self, r: httpx.Response, status: int, code: str) -> dict:
        assert r.status_code == status, f"{r.status_code} {r.text}"
        err = r.json()["error"]
        assert err["code"] == code, err
        assert err["message"], err
        return err

    def open(self, name: str, sid: str, world: int = 1, run: str | None = None) -> None:
        r = self.http.post(f"/v1/checkpoints/{run or self.run}/{name}/sessions",
                           json={"session": sid, "world_size": world})
        assert r.status_code == 200, r.text

    def upload(self, name: str, sid: str, file: str, data: bytes, digest: str | None = None) -> httpx.Response:
        return self.http.put(f"/v1/checkpoints/{self.run}/{name}/sessions/{sid}/files/{file}", content=data,
                             headers={"X-Ckptd-Xxh3": digest or xxhash.xxh3_64_hexdigest(data)})

    def put_index(self, name: str, sid: str, index: dict) -> httpx.Response:
        return self.http.put(f"/v1/checkpoints/{self.run}/{name}/sessions/{sid}/ranks/{index['rank']}",
                             content=json.dumps(index).encode(), headers={"Content-Type": "application/json"})

    def committed_names(self) -> list[str]:
        return [c.name for c in self.client.list_checkpoints(self.run)]

    def assert_intact(self) -> None:
        """The server is healthy, run/1 loads bit for bit and verifies in its own process."""
        assert self.http.get("/healthz").status_code == 200
        assert self.http.get("/readyz").status_code == 200
        got = blank_like(self.sd1)
        self.client.load(got, f"{self.run}/1")
        assert_bits_equal(got, self.sd1)
        p = cli("verify", f"{self.run}/1", "--root", str(self.root))
        assert p.returncode == 0 and p.stdout.startswith(f"OK {self.run}/1"), p.stdout + p.stderr


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """One ``ckptd serve`` for the module (starting one takes seconds); each test gets its own run."""
    base = tmp_path_factory.mktemp("refusals")
    srv = ServerProcess(base / "box" / "root", log=base / "logs" / "server.log",
                        env={"CKPTD_WRITE_BATCH_BYTES": str(64 << 10)}).start()
    yield srv
    srv.kill()


_runs = itertools.count()


@pytest.fixture
def env(server):
    assert server.proc is not None and server.proc.poll() is None, "the shared server died in an earlier test"
    root = Path(server.root)
    run = f"t{next(_runs)}"
    client = CheckpointClient(server.url, retry_seconds=5)
    http = httpx.Client(base_url=server.url, timeout=30)
    sd1 = make_state(1)
    try:
        assert client.save(sd1, f"{run}/1").wait(timeout=60).state == "committed"
        verified(server.url, f"{run}/1")  # the re-read after the commit has written its record
        yield Env(server, root.parent, root, client, http, sd1, run)
    finally:
        http.close()
        client.close(wait=False)


# -- checksums -------------------------------------------------------------------------------------------

def test_wrong_declared_checksum_is_refused_and_partial_data_dropped(env):
    env.open("2", "s1")
    data = os.urandom((1 << 20) + 123)  # many write batches reach the disk before the digest is known
    wrong = xxhash.xxh3_64_hexdigest(data + b"x")
    r = env.upload("2", "s1", "data.bin", data, digest=wrong)
    err = env.error(r, 422, "checksum_mismatch")
    assert "'data.bin'" in err["message"] and wrong in err["message"] and "dropped" in err["message"]
    assert err["details"]["file"] == "data.bin" and err["details"]["size"] == len(data)
    assert err["details"]["actual"] == xxhash.xxh3_64_hexdigest(data)
    assert files_in(env.session_dir("2", "s1") / "files") == []   # no file, no temp file
    assert files_in(env.session_dir("2", "s1") / "digests") == []

    # A malformed digest header is refused before any byte is stored.
    r = env.upload("2", "s1", "data.bin", data, digest="not-hex")
    err = env.error(r, 422, "invalid_request")
    assert "x-ckptd-xxh3" in err["message"].lower()
    assert files_in(env.session_dir("2", "s1") / "files") == []

    # An index cannot refer to the refused file.
    index = {"rank": 0, "world_size": 1, "files": ["data.bin"]}
    err = env.error(env.put_index("2", "s1", index), 422, "invalid_index")
    assert "'data.bin'" in err["message"] and "rank 0" in err["message"]

    # Re-sending with the right digest succeeds, twice (idempotent), with the exact bytes.
    for _ in range(2):
        r = env.upload("2", "s1", "data.bin", data)
        assert r.status_code == 200 and r.json()["xxh3"] == xxhash.xxh3_64_hexdigest(data)
    assert files_in(env.session_dir("2", "s1") / "files") == ["data.bin"]
    assert (env.session_dir("2", "s1") / "files" / "data.bin").read_bytes() == data
    assert env.committed_names() == ["1"]
    env.assert_intact()


@pytest.mark.parametrize("local_uploads", [False, True])
def test_a_save_whose_upload_is_refused_aborts_its_session(env, monkeypatch, local_uploads):
    """The bytes sent differ from the digest declared (corrupted in flight, over HTTP or in the memory
    file handed over on this host): the service refuses the file, and the client deletes its session
    instead of leaving it staged until the TTL."""
    import ckptd_client._save as save_mod

    real = save_mod._pieces

    def corrupted(f):
        for i, piece in enumerate(real(f)):
            yield bytes([bytes(piece)[0] ^ 1]) + bytes(piece)[1:] if i == 0 else piece

    monkeypatch.setattr(save_mod, "_pieces", corrupted)
    with CheckpointClient(env.srv.url, retry_seconds=5, local_uploads=local_uploads) as client:
        handle = client.save(make_state(2), f"{env.run}/2")
        with pytest.raises(ChecksumMismatch):
            handle.wait(timeout=60)
    sessions = env.root / "runs" / env.run / "2" / "sessions"
    assert not sessions.exists() or not any(sessions.iterdir()), list(sessions.iterdir())
    assert "2" not in env.committed_names()
    monkeypatch.setattr(save_mod, "_pieces", real)
    env.assert_intact()


@pytest.mark.parametrize("target", ["data", "manifest"])
def test_corrupt_byte_on_disk_is_detected(env, target):
    sd2 = make_state(2)
    env.client.save(sd2, f"{env.run}/2").wait(timeout=60)
    marker = json.loads((env.root / "runs" / env.run / "2" / "COMMITTED").read_text())
    sdir = env.session_dir("2", marker["session"])
    if target == "data":
        (path,) = (sdir / "files").iterdir()
        offset = 4096 + 17  # inside model.w, the first chunk of the file
    else:
        path = sdir / marker["manifest"]
        offset = path.stat().st_size // 2
    raw = bytearray(path.read_bytes())
    raw[offset] ^= 0x01
    path.write_bytes(bytes(raw))

    p = cli("verify", f"{env.run}/2", "--root", str(env.root))
    assert p.returncode == 1, p.stdout + p.stderr
    assert p.stdout.startswith(f"FAIL {env.run}/2")
    with pytest.raises(IntegrityError if target == "data" else CheckpointNotFound) as ei:
        env.client.load(blank_like(sd2), f"{env.run}/2")
    if target == "data":
        assert f"'{path.name}'" in p.stdout and "'model.w'" in p.stdout
        # One family for committed bytes that fail their digests: typed, never retried.
        assert type(ei.value) is CorruptCheckpoint and isinstance(ei.value, ChecksumMismatch)
        assert f"'{path.name}'" in ei.value.message and "corrupt" in ei.value.message
        # The service path reads the same bytes and fails the same way.
        p = cli("verify", f"{env.run}/2", "--server", env.srv.url)
        assert p.returncode == 1 and f"'{path.name}'" in p.stdout, p.stdout + p.stderr
    else:
        assert "not visible" in p.stdout and "manifest" in p.stdout and "COMMITTED" in p.stdout
        assert "not visible" in ei.value.message and f"{env.run}/2" in ei.value.message
    env.assert_intact()


# -- rank indexes that do not describe one whole tensor ------------------------------------------------------

def _chunk(rank: int, file: str, data: bytes, offset: int = 0, **region: Any) -> dict:
    kind = "flat" if "start" in region else "box"
    return {"kind": kind, "rank": rank, **region,
            "location": {"file": file, "offset": offset, "length": len(data), "raw_length": len(data),
                         "xxh3": xxhash.xxh3_64_hexdigest(data)}}


def _tensor(name: str, shape: list[int], dtype: str, chunks: list[dict]) -> dict:
    return {"name": name, "shape": shape, "dtype": dtype, "group": name.split(".")[0], "chunks": chunks}


def _rows(t: torch.Tensor, lo: int, hi: int) -> bytes:
    return t[lo:hi].contiguous().numpy().tobytes()


W = "model.layers.0.w"
FULL = torch.arange(4 * 3, dtype=torch.float32).reshape(4, 3)


def _case(case: str) -> tuple[list[tuple[bytes, dict]], str, list[str]]:
    """Per rank (file bytes, tensor entry); the expected error code; phrases its message must hold."""
    f32 = lambda lo, hi: _rows(FULL, lo, hi)  # noqa: E731
    if case == "overlap":
        a, b = f32(0, 3), f32(2, 4)
        b = bytes(reversed(b))  # rows 2..3 again, different contents
        return [(a, _tensor(W, [4, 3], "float32", [_chunk(0, "r0.bin", a, offsets=[0, 0], sizes=[3, 3])])),
                (b, _tensor(W, [4, 3], "float32", [_chunk(1, "r1.bin", b, offsets=[2, 0], sizes=[2, 3])]))], \
            "tiling", ["overlap", "rank 0", "rank 1"]
    if case == "gap":
        a, b = f32(0, 1), f32(2, 4)
        return [(a, _tensor(W, [4, 3], "float32", [_chunk(0, "r0.bin", a, offsets=[0, 0], sizes=[1, 3])])),
                (b, _tensor(W, [4, 3], "float32", [_chunk(1, "r1.bin", b, offsets=[2, 0], sizes=[2, 3])]))], \
            "tiling", ["cover 9 of 12", "missing flat elements [3, 6)", "ranks [0, 1]"]
    if case == "flat-overlap":
        flat = FULL.reshape(-1)
        a, b = flat[0:7].numpy().tobytes(), flat[5:12].numpy().tobytes()
        b = bytes(reversed(b))
        return [(a, _tensor(W, [4, 3], "float32", [_chunk(0, "r0.bin", a, start=0, length=7)])),
                (b, _tensor(W, [4, 3], "float32", [_chunk(1, "r1.bin", b, start=5, length=7)]))], \
            "tiling", ["rank 0", "rank 1"]
    if case == "shape":
        a, b = f32(0, 2), _rows(torch.zeros(5, 3), 2, 5)
        return [(a, _tensor(W, [4, 3], "float32", [_chunk(0, "r0.bin", a, offsets=[0, 0], sizes=[2, 3])])),
                (b, _tensor(W, [5, 3], "float32", [_chunk(1, "r1.bin", b, offsets=[2, 0], sizes=[3, 3])]))], \
            "invalid_index", ["rank 0 saved shape [4, 3]", "rank 1 saved shape [5, 3]"]
    if case == "dtype":
        a, b = f32(0, 2), _rows(FULL.half(), 2, 4)
        return [(a, _tensor(W, [4, 3], "float32", [_chunk(0, "r0.bin", a, offsets=[0, 0], sizes=[2, 3])])),
                (b, _tensor(W, [4, 3], "float16", [_chunk(1, "r1.bin", b, offsets=[2, 0], sizes=[2, 3])]))], \
            "invalid_index", ["rank 0", "float32", "rank 1", "float16"]
    if case == "foreign-file":  # rank 1 lists and points into the file rank 0 uploaded
        a, b = f32(0, 2), f32(2, 4)
        return [(a + b, _tensor(W, [4, 3], "float32", [_chunk(0, "r0.bin", a, offsets=[0, 0], sizes=[2, 3])])),
                (b, _tensor(W, [4, 3], "float32", [_chunk(1, "r0.bin", b, offset=len(a), offsets=[2, 0],
                                                          sizes=[2, 3])]))], \
            "invalid_index", ["file 'r0.bin' claimed by ranks 0 and 1"]
    raise AssertionError(case)


def _index(rank: int, tensor: dict, files: list[str]) -> dict:
    return {"rank": rank, "world_size": 2, "tensors": [tensor], "files": files}


@pytest.mark.parametrize("case", ["overlap", "gap", "flat-overlap", "shape", "dtype", "foreign-file"])
def test_inconsistent_rank_indexes_refused_at_commit(env, case):
    ranks, code, phrases = _case(case)
    env.open("2", "bad", world=2)
    for r, (data, _) in enumerate(ranks):
        assert env.upload("2", "bad", f"r{r}.bin", data).status_code == 200
    files = {0: ["r0.bin"], 1: ["r1.bin", "r0.bin"] if case == "foreign-file" else ["r1.bin"]}
    r = env.put_index("2", "bad", _index(0, ranks[0][1], files[0]))
    assert r.status_code == 200 and r.json()["state"] == "open" and r.json()["ranks_done"] == [0], r.text
    err = env.error(env.put_index("2", "bad", _index(1, ranks[1][1], files[1])), 422, code)
    for phrase in phrases:
        assert phrase in err["message"], (phrase, err["message"])
    if case == "foreign-file":  # a file-level fault: the file and both ranks are named
        assert err["details"]["file"] == "r0.bin" and err["details"]["ranks"] == [0, 1]
    else:
        assert f"'{W}'" in err["message"] and err["details"]["tensor"] == W, err
        assert set(err["details"]["ranks"]) <= {0, 1} and err["details"]["ranks"]

    st = env.http.get(f"/v1/checkpoints/{env.run}/2/sessions/bad").json()
    assert st["state"] == "failed" and st["error"]["code"] == code and st["ranks_done"] == [0, 1]
    assert st["error"]["message"] == err["message"]
    # Nothing visible; the refused session takes no more input.
    assert env.committed_names() == ["1"]
    assert not (env.root / "runs" / env.run / "2" / "COMMITTED").exists()
    env.error(env.http.get(f"/v1/checkpoints/{env.run}/2"), 404, "checkpoint_not_found")
    err = env.error(env.put_index("2", "bad", _index(1, ranks[1][1], files[1])), 409, "session_conflict")
    assert "new session" in err["message"]
    assert cli("verify", f"{env.run}/2", "--root", str(env.root)).returncode == 1  # not found

    # A new attempt with a correct tiling commits the same ref.
    a, b = _rows(FULL, 0, 3), _rows(FULL, 3, 4)
    env.open("2", "good", world=2)
    assert env.upload("2", "good", "r0.bin", a).status_code == 200
    assert env.upload("2", "good", "r1.bin", b).status_code == 200
    assert env.put_index("2", "good", _index(
        0, _tensor(W, [4, 3], "float32", [_chunk(0, "r0.bin", a, offsets=[0, 0], sizes=[3, 3])]), ["r0.bin"])
    ).json()["state"] == "open"
    st = env.put_index("2", "good", _index(
        1, _tensor(W, [4, 3], "float32", [_chunk(1, "r1.bin", b, offsets=[3, 0], sizes=[1, 3])]), ["r1.bin"]))
    assert st.status_code == 200 and st.json()["state"] == "committed", st.text
    got = {"model": {"layers": {"0": {"w": torch.zeros(4, 3)}}}}
    env.client.load(got, f"{env.run}/2")
    assert torch.equal(got["model"]["layers"]["0"]["w"], FULL)
    assert cli("verify", f"{env.run}/2", "--root", str(env.root)).returncode == 0
    env.assert_intact()


@pytest.mark.parametrize("case", ["not-uploaded", "beyond-file", "world-size", "unlisted-file", "outside-shape",
                                  "rank-mismatch"])
def test_bad_rank_index_refused_when_sent(env, case):
    data = _rows(FULL, 0, 4)
    env.open("2", "s", world=2)
    assert env.upload("2", "s", "r0.bin", data).status_code == 200
    good = _tensor(W, [4, 3], "float32", [_chunk(0, "r0.bin", data, offsets=[0, 0], sizes=[4, 3])])
    index = _index(0, copy.deepcopy(good), ["r0.bin"])
    status, code, phrases = 422, "invalid_index", ["rank 0"]
    if case == "not-uploaded":
        index["files"] = ["r0.bin", "ghost.bin"]
        phrases += ["'ghost.bin'", "not uploaded"]
    elif case == "beyond-file":
        index["tensors"][0]["chunks"][0]["location"]["offset"] = 64
        phrases += [f"'{W}'", "'r0.bin'", "exceed"]
    elif case == "world-size":
        index["world_size"] = 3
        phrases += ["world size 3", "2"]
    elif case == "unlisted-file":
        index["files"] = []
        phrases += [f"'{W}'", "'r0.bin'", "not among its files"]
    elif case == "outside-shape":  # the body itself is invalid: pydantic names the tensor and rank
        index["tensors"][0]["chunks"][0]["offsets"] = [1, 0]
        status, code, phrases = 422, "invalid_index", ["index of rank 0", f"'{W}'", "outside global shape"]
    elif case == "rank-mismatch":
        status, code, phrases = 400, "invalid_request", ["rank 0", "rank 1"]
        r = env.http.put(f"/v1/checkpoints/{env.run}/2/sessions/s/ranks/1", content=json.dumps(index).encode())
        err = env.error(r, status, code)
        for phrase in phrases:
            assert phrase in err["message"], (phrase, err["message"])
        index = None
    if index is not None:
        err = env.error(env.put_index("2", "s", index), status, code)
        for phrase in phrases:
            assert phrase in err["message"], (phrase, err["message"])
    # Refused before it was stored: the session is still open and takes the corrected index.
    assert files_in(env.session_dir("2", "s") / "ranks") == []
    st = env.http.get(f"/v1/checkpoints/{env.run}/2/sessions/s").json()
    assert st["state"] == "open" and st["ranks_done"] == []
    r = env.put_index("2", "s", _index(0, good, ["r0.bin"]))
    assert r.status_code == 200 and r.json()["ranks_done"] == [0]
    assert env.committed_names() == ["1"]
    env.assert_intact()


# -- committed refs are immutable ---------------------------------------------------------------------------------

def test_resave_of_committed_ref_is_refused(env):
    marker = (env.root / "runs" / env.run / "1" / "COMMITTED").read_bytes()
    with pytest.raises(AlreadyCommitted) as ei:
        env.client.save(make_state(99), f"{env.run}/1").wait(timeout=30)
    assert f"{env.run}/1" in ei.value.message and "immutable" in ei.value.message

    err = env.error(env.http.post(f"/v1/checkpoints/{env.run}/1/sessions", json={"session": "again", "world_size": 1}),
                    409, "already_committed")
    assert f"{env.run}/1" in err["message"]
    # A session opened before the commit cannot write into the committed ref afterwards.
    env.open("3", "early")
    sd3 = make_state(3)
    env.client.save(sd3, f"{env.run}/3").wait(timeout=30)
    err = env.error(env.upload("3", "early", "late.bin", b"late"), 409, "already_committed")
    assert f"{env.run}/3" in err["message"]
    err = env.error(env.put_index("3", "early", {"rank": 0, "world_size": 1}), 409, "already_committed")
    assert f"{env.run}/3" in err["message"]
    assert files_in(env.session_dir("3", "early") / "files") == []
    assert (env.root / "runs" / env.run / "1" / "COMMITTED").read_bytes() == marker
    assert env.committed_names() == ["1", "3"]
    got = blank_like(sd3)
    env.client.load(got, f"{env.run}/3")
    assert_bits_equal(got, sd3)
    env.assert_intact()


# -- names that could reach outside the root ----------------------------------------------------------------------

LONG = "a" * 200
BAD_SEGMENTS = ["%2e%2e", "%2E%2E", ".hidden", "a%2Fb", "..%2F..%2Fescape", "a%00b", "a%5Cb", LONG, "%20x",
                "x%0Ay"]


def _raw_request(port: int, method: str, path: str, body: bytes = b"", headers: dict[str, str] | None = None
                 ) -> tuple[int, bytes]:
    """HTTP/1.1 over a plain socket, the path sent byte for byte (httpx would normalise '..')."""
    head = [f"{method} {path} HTTP/1.1", f"Host: 127.0.0.1:{port}", f"Content-Length: {len(body)}",
            "Connection: close", *(f"{k}: {v}" for k, v in (headers or {}).items())]
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(("\r\n".join(head) + "\r\n\r\n").encode() + body)
        chunks = []
        while True:
            c = s.recv(65536)
            if not c:
                break
            chunks.append(c)
    raw = b"".join(chunks)
    status = int(raw.split(b" ", 2)[1])
    return status, raw.split(b"\r\n\r\n", 1)[1]


def _requests(run: str, seg: str) -> list[tuple[str, str, str, dict[str, Any]]]:
    """(field, method, path, kwargs) putting ``seg`` in each name field of each route."""
    d = xxhash.xxh3_64_hexdigest(b"payload")
    put = {"content": b"payload", "headers": {"X-Ckptd-Xxh3": d}}
    idx = {"content": json.dumps({"rank": 0, "world_size": 1}).encode()}
    opn = {"json": {"session": "s1", "world_size": 1}}
    return [
        ("run", "POST", f"/v1/checkpoints/{seg}/2/sessions", opn),
        ("name", "POST", f"/v1/checkpoints/{run}/{seg}/sessions", opn),
        ("run", "PUT", f"/v1/checkpoints/{seg}/2/sessions/s1/files/f.bin", put),
        ("name", "PUT", f"/v1/checkpoints/{run}/{seg}/sessions/s1/files/f.bin", put),
        ("session", "PUT", f"/v1/checkpoints/{run}/2/sessions/{seg}/files/f.bin", put),
        ("file", "PUT", f"/v1/checkpoints/{run}/2/sessions/s1/files/{seg}", put),
        ("session", "PUT", f"/v1/checkpoints/{run}/2/sessions/{seg}/ranks/0", idx),
        ("session", "GET", f"/v1/checkpoints/{run}/2/sessions/{seg}", {}),
        ("session", "DELETE", f"/v1/checkpoints/{run}/2/sessions/{seg}", {}),
        ("run", "GET", f"/v1/runs/{seg}/checkpoints", {}),
        ("run", "GET", f"/v1/checkpoints/{seg}/1", {}),
        ("name", "GET", f"/v1/checkpoints/{run}/{seg}", {}),
        ("file", "GET", f"/v1/checkpoints/{run}/1/files/{seg}", {}),
        ("name", "POST", f"/v1/checkpoints/{run}/{seg}/read-plan", {"json": {"requests": []}}),
    ]


def _check_refusal(field: str, status: int, body: bytes, what: str, *, routed: bool = True) -> str:
    """A typed 4xx: ``invalid_name`` naming the field, or (a '/' inside a segment) no such route."""
    assert 400 <= status < 500, f"{what}: {status} {body[:300]!r}"
    err = json.loads(body)["error"]
    if routed:
        assert status == 400 and err["code"] == "invalid_name", f"{what}: {status} {err}"
        assert err["details"]["field"] == field and err["message"].startswith(f"invalid {field} "), f"{what}: {err}"
    else:
        assert status == 404 and err["code"] == "not_found" and "no route" in err["message"], f"{what}: {err}"
    return err["code"]


def test_unsafe_names_are_refused_and_nothing_escapes_the_root(env):
    # An open session of run/2 whose files, indexes and status the requests aim at.
    env.open("2", "s1")
    before = tree(env.box)
    seen_codes: set[str] = set()
    for seg in BAD_SEGMENTS:
        for field, method, path, kw in _requests(env.run, seg):
            r = env.http.request(method, path, **kw)
            seen_codes.add(_check_refusal(field, r.status_code, r.content, f"{method} {path}",
                                          routed="%2F" not in seg))
    # Literal dot segments and other raw bytes, exactly as sent (no client-side normalisation).
    raw_paths = [
        ("run", "POST", "/v1/checkpoints/../2/sessions", json.dumps({"session": "s1", "world_size": 1})),
        ("name", "POST", f"/v1/checkpoints/{env.run}/../sessions", json.dumps({"session": "s1", "world_size": 1})),
        ("file", "PUT", f"/v1/checkpoints/{env.run}/2/sessions/s1/files/..", "payload"),
        ("session", "PUT", f"/v1/checkpoints/{env.run}/2/sessions/../files/f.bin", "payload"),
        ("file", "GET", f"/v1/checkpoints/{env.run}/1/files/..", ""),
        ("name", "GET", f"/v1/checkpoints/{env.run}/.", ""),
    ]
    for field, method, path, body in raw_paths:
        status, resp = _raw_request(env.srv.port, method, path, body.encode(),
                                    {"Content-Type": "application/json",
                                     "X-Ckptd-Xxh3": xxhash.xxh3_64_hexdigest(body.encode())})
        seen_codes.add(_check_refusal(field, status, resp, f"raw {method} {path}"))
    assert seen_codes == {"invalid_name", "not_found"}

    # Names inside bodies: the session id when opening, file names in an index and in chunk locations.
    for sid in ["..", "../../x", ".hidden", "a/b", "a\x00b", "ok\n", "s" * 65, ""]:
        r = env.http.post(f"/v1/checkpoints/{env.run}/4/sessions", json={"session": sid, "world_size": 1})
        err = env.error(r, 422, "invalid_request")
        assert "session" in err["message"], err
    for bad in ["../../escape", ".hidden", "a/b", "a\x00b", LONG]:
        err = env.error(env.put_index("2", "s1", {"rank": 0, "world_size": 1, "files": [bad]}), 400, "invalid_name")
        assert "invalid file" in err["message"] and err["details"]["field"] == "file"
        data = b"x" * 12
        tensor = _tensor(W, [3], "float32", [_chunk(0, "f.bin", data, offsets=[0], sizes=[3])])
        tensor["chunks"][0]["location"]["file"] = bad
        err = env.error(env.put_index("2", "s1", {"rank": 0, "world_size": 1, "tensors": [tensor], "files": []}),
                        422, "invalid_index")
        assert "index of rank 0" in err["message"] and "location.file" in err["message"], err
    # The client refuses unsafe refs before sending anything.
    for ref in ["../1", "run/..", "run/.x", "run/a/b", "Run/1", f"run/{LONG}"]:
        with pytest.raises(InvalidName) as ei:
            env.client.save(env.sd1, ref)
        assert ei.value.message.startswith("invalid "), ei.value.message

    assert tree(env.box) == before, "a refused request wrote something"
    assert sorted(os.listdir(env.box)) == ["root"]
    st = env.http.get(f"/v1/checkpoints/{env.run}/2/sessions/s1").json()
    assert st["state"] == "open" and st["ranks_done"] == []
    assert env.committed_names() == ["1"]
    env.assert_intact()
