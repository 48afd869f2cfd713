"""Co-located uploads (``ckptd.service.local_uploads``, ``ckptd_client._handover``): a rank on the service's
host hands each data file over as a sealed memory file through the Unix socket its session's answer names.

A real ``ckptd serve`` (tokens on, one test without): a save by ``CheckpointClient`` goes through the socket
file by file and loads bit for bit; then, as a writer with a valid token could, raw connections to the socket
try what HTTP would refuse and what only this path could allow: a memory file not sealed (its bytes could
change while they are read), sealed but growable, a plain file, two descriptors, none, a header that is
not JSON, a wrong digest, no token, a token of another run. Each is refused with the typed error, nothing
is stored under the file's name, and the same file then uploads and commits. A connection that never sends
its header does not hold the others up. A socket that cannot be reached sends the files over HTTP.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import tempfile
from pathlib import Path

import httpx
import pytest
import torch
import xxhash

from ckptd.service.auth import hash_token
from ckptd_client import CheckpointClient
from ckptd_schemas.handover import new_nonce, prove, proven, split_key
from support import ServerProcess

WRITER, OTHER = "writer-token-0123456789", "other-token-0123456789"
TOKENS = f"trainer sha256:{hash_token(WRITER)} write:run*\nelse sha256:{hash_token(OTHER)} write:else\n"
SEALS = fcntl.F_SEAL_WRITE | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("local")
    tokens = tmp / "tokens"
    tokens.write_text(TOKENS)
    s = ServerProcess(tmp / "root", env={"CKPTD_TOKENS_FILE": str(tokens)}).start()
    yield s
    s.stop()


def _metric(url: str, name: str) -> dict[str, float]:
    out = {}
    for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
        if line.startswith(name + "{"):
            labels, value = line[len(name) + 1:].split("} ")
            out[labels] = float(value)
    return out


def _open(url: str, run: str, name: str, sid: str, token: str = WRITER) -> dict:
    r = httpx.post(f"{url}/v1/checkpoints/{run}/{name}/sessions", json={"session": sid, "world_size": 1},
                   headers={"Authorization": f"Bearer {token}"}, timeout=30)
    assert r.status_code == 200, r.text
    return r.json()


def _memfd(data: bytes, seals: int = SEALS) -> int:
    fd = os.memfd_create("test", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    os.write(fd, data)
    if seals:
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, seals)
    return fd


def _line(value: dict) -> bytes:
    return json.dumps(value).encode() + b"\n"


def _read(s: socket.socket, buf: bytearray) -> dict | None:
    """The next answer line (None when the service closed first)."""
    while b"\n" not in buf:
        data = s.recv(65536)
        if not data:
            return None
        buf += data
    cut = buf.index(b"\n")
    line = bytes(buf[:cut])
    del buf[:cut + 1]
    return json.loads(line)


def _hand(info: dict, header: dict | bytes, fds: list[int], *, key: str | None = None,
          hello: dict | None = None) -> dict:
    """One raw connection as a rank speaks (``ckptd_schemas.handover``), for the session ``info`` (its
    answer): the hello, then the header with ``fds``, its proof made with ``key`` (the session's own by
    default) over the service's nonce; the service's answer (to the hello, when it refused that)."""
    principal, k = split_key(key or info["local_key"])
    nonce = new_nonce()
    hello = {"principal": principal, "run": info["run"], "name": info["name"], "session": info["session"],
             "nonce": nonce, **(hello or {})}
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(60)
        s.connect(info["local_socket"])
        s.sendall(_line(hello))
        buf = bytearray()
        challenge = _read(s, buf)
        assert challenge is not None
        if "status" in challenge:
            return challenge
        if key is None:  # the service proves the session's key before anything else is sent
            assert proven(k, "service", nonce, challenge["proof"]), challenge
        line = header if isinstance(header, bytes) else _line({"proof": prove(k, "rank", challenge["nonce"]),
                                                               **header})
        socket.send_fds(s, [line], fds)
        answer = _read(s, buf)
    assert answer is not None
    return answer


def _header(file: str, data: bytes, **kw) -> dict:
    return {"file": file, "size": len(data), "xxh3": xxhash.xxh3_64_hexdigest(data), **kw}


def test_a_save_on_the_services_host_hands_its_files_over_and_loads_bit_for_bit(srv):
    before = _metric(srv.url, "ckptd_local_uploads_total").get('status="200"', 0.0)
    want = {"model": {"w": torch.randn(512, 1024), "b": torch.arange(7.0)}, "step": 3}
    with CheckpointClient(srv.url, token=WRITER, file_bytes=1 << 20) as c:
        c.save(want, "run-a/1").wait()
        got = {"model": {"w": torch.zeros(512, 1024), "b": torch.zeros(7)}, "step": 0}
        c.load(got, "run-a/1")
    assert torch.equal(got["model"]["w"], want["model"]["w"]) and got["step"] == 3
    manifest = httpx.get(f"{srv.url}/v1/checkpoints/run-a/1", headers={"Authorization": f"Bearer {WRITER}"},
                         timeout=30).json()
    handed = _metric(srv.url, "ckptd_local_uploads_total")['status="200"'] - before
    assert handed == len(manifest["files"]) >= 2, (handed, manifest["files"])  # every file, none over HTTP
    assert not [k for k in _metric(srv.url, "ckptd_http_requests_total") if 'route="upload_file"' in k]


@pytest.mark.parametrize("case", ["unsealed", "growable", "plain file", "write-only", "two descriptors",
                                  "no descriptor", "not json", "larger than declared", "smaller than declared",
                                  "wrong digest", "wrong proof", "another session's key", "another run's key",
                                  "bad file name"])
def test_what_the_socket_refuses_is_not_stored_and_the_file_then_uploads(srv, case):
    sid = f"{abs(hash(case)):016x}"[:16].ljust(16, "0")
    info = _open(srv.url, "run", "1", sid)
    assert info["local_socket"] and info["local_key"]
    assert info["local_host"] == Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    data = os.urandom(300_000)
    header, fds, key = _header("r000000-0000.bin", data), [], None
    bytes_in = _metric(srv.url, "ckptd_bytes_in_total").get('route="local_upload"', 0.0)
    try:
        if case == "unsealed":
            fds = [_memfd(data, seals=0)]
        elif case == "growable":
            fds = [_memfd(data, seals=fcntl.F_SEAL_WRITE | fcntl.F_SEAL_SHRINK)]
        elif case == "plain file":
            f = tempfile.TemporaryFile()
            f.write(data)
            f.flush()
            fds = [os.dup(f.fileno())]
            f.close()
        elif case == "write-only":  # the same sealed memory file, opened again for writing only
            sealed = _memfd(data)
            fds = [os.open(f"/proc/self/fd/{sealed}", os.O_WRONLY)]
            os.close(sealed)
        elif case == "two descriptors":
            fds = [_memfd(data), _memfd(data)]
        elif case == "no descriptor":
            fds = []
        elif case == "not json":
            fds = [_memfd(data)]
            header = b"{'proof': nope\n"
        elif case in ("larger than declared", "smaller than declared"):
            fds = [_memfd(data)]
            header["size"] = len(data) - 1 if case == "larger than declared" else len(data) + 1
        elif case == "wrong digest":
            fds = [_memfd(data)]
            header["xxh3"] = "0" * 16
        elif case == "wrong proof":
            fds = [_memfd(data)]
            header["proof"] = "0" * 64
        elif case == "another session's key":  # the same writer's key of its other session
            fds = [_memfd(data)]
            key = _open(srv.url, "run", "1", sid[::-1])["local_key"]
        elif case == "another run's key":  # a writer of another run: its key, its name
            fds = [_memfd(data)]
            key = _open(srv.url, "else", "1", sid, token=OTHER)["local_key"]
        elif case == "bad file name":
            fds = [_memfd(data)]
            header["file"] = "../../COMMITTED"
        answer = _hand(info, header, fds, key=key)
    finally:
        for fd in fds:
            os.close(fd)
    want = {"unsealed": (400, "not sealed"), "growable": (400, "not sealed"), "plain file": (400, "not sealed"),
            "write-only": (400, "not open for reading"),
            "two descriptors": (400, "one file descriptor"), "no descriptor": (400, "one file descriptor"),
            "not json": (400, "header"), "larger than declared": (400, "declares"),
            "smaller than declared": (400, "declares"), "wrong digest": (422, "declared"),
            "wrong proof": (401, "does not prove"), "another session's key": (401, "does not prove"),
            "another run's key": (401, "does not prove"), "bad file name": (400, "")}[case]
    assert answer["status"] == want[0] and want[1] in answer["error"]["message"], answer
    session = Path(srv.root) / "runs/run/1/sessions" / sid
    assert not [p for p in session.rglob("r000000-0000.bin*")], list(session.rglob("*"))  # nothing stored
    if case != "wrong digest":  # refused before a byte was read
        assert _metric(srv.url, "ckptd_bytes_in_total").get('route="local_upload"', 0.0) == bytes_in
    # the same file, sealed and declared right, is taken; the checkpoint commits with it
    fd = _memfd(data)
    try:
        ok = _hand(info, _header("r000000-0000.bin", data), [fd])
    finally:
        os.close(fd)
    assert ok["status"] == 200 and ok["result"]["size"] == len(data), ok
    assert Path(session, "files/r000000-0000.bin").read_bytes() == data


def test_a_connection_that_sends_nothing_holds_no_other_upload_up(srv):
    info = _open(srv.url, "run", "2", "a" * 16)
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as idle:
        idle.connect(info["local_socket"])  # says nothing
        data = os.urandom(10_000)
        fd = _memfd(data)
        try:
            ok = _hand(info, _header("r000000-0000.bin", data), [fd])
        finally:
            os.close(fd)
    assert ok["status"] == 200, ok


def test_a_socket_that_cannot_be_reached_sends_the_files_over_http(tmp_path):
    s = ServerProcess(tmp_path / "root").start()
    try:
        sock = _open(s.url, "run", "0", "b" * 16)["local_socket"]
        os.unlink(sock)  # as from another container: the path is not there
        want = {"w": torch.randn(300, 300)}
        with CheckpointClient(s.url) as c:
            c.save(want, "run/1").wait()
            got = {"w": torch.zeros(300, 300)}
            c.load(got, "run/1")
        assert torch.equal(got["w"], want["w"])
        assert not _metric(s.url, "ckptd_local_uploads_total")
        assert [k for k in _metric(s.url, "ckptd_http_requests_total") if 'route="upload_file"' in k]
    finally:
        s.stop()


def test_idle_connections_are_answered_and_cannot_keep_a_save_off_the_socket(srv):
    """A connection that sends no header is answered 400 after a short wait; connections held past the
    service's bound (a local user needs no token to connect) are closed at once, unanswered, so they
    cannot queue up the ranks' handovers; a save meanwhile commits and loads (over HTTP, or handed over
    once a slot is free)."""
    sock = _open(srv.url, "run", "3", "c" * 16)["local_socket"]
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as idle:
        idle.settimeout(60)
        idle.connect(sock)
        answer = json.loads(idle.recv(65536))
    assert answer["status"] == 400 and "hello" in answer["error"]["message"], answer
    held = []
    try:
        for _ in range(80):  # more than the service holds at once (64)
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.connect(sock)  # blocking: waits while the listen backlog is full
            s.settimeout(60)
            held.append(s)
        want = {"w": torch.randn(256, 256)}
        with CheckpointClient(srv.url, token=WRITER) as c:
            c.save(want, "run-b/1").wait()
            got = {"w": torch.zeros(256, 256)}
            c.load(got, "run-b/1")
        assert torch.equal(got["w"], want["w"])
        unanswered = sum(1 for s in held if s.recv(65536) == b"")  # closed at once, or answered 400 later
        assert unanswered >= 80 - 64, unanswered
    finally:
        for s in held:
            s.close()
