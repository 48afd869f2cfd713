"""Co-located uploads (``ckptd.service.local_uploads``, ``ckptd_client._handover``): a rank on the service's
host hands each data file over as a sealed memory file through the Unix socket its session's answer names,
once the service proved the session's key (``local_key``) and before the rank proves it in turn.

A real ``ckptd serve`` (tokens on, one test without): a save by ``CheckpointClient`` goes through the socket
file by file and loads bit for bit; then, as a writer with a valid key could, raw connections to the socket
try what HTTP would refuse and what only this path could allow: a memory file not sealed (its bytes could
change while they are read), sealed but growable, a plain file, one opened write-only, two descriptors,
none, a header that is not JSON, a size other than the file's, a wrong digest, a wrong proof, the key of
another session or of another run's writer. Each is refused with the typed error, nothing is stored under
the file's name (nor a byte read, but for the wrong digest), and the same file then uploads and commits.
A connection that never sends its hello does not hold the others up; connections past the bound are
closed. A socket that cannot be reached sends the files over HTTP.

Then as another local user (uid 65534 where the tests run as root): a listener at the path a restart
freed, and one planted at the path a service with a private temporary directory advertises, with a
forged proof or one under its own session's key (it holds a write token of another run), receive a hello
and nothing else (no token, no descriptor, no byte); the save commits over HTTP and the client says so
once. Peers that trickle a hello are cut at one deadline for the whole of it while a save hands its
files over; a sparse memory file of 1 GiB costs the service its read window, not the file; a key given
before the tokens file changed holds only what its principal still may.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import pytest
import torch
import xxhash

from ckptd.service.auth import hash_token
from ckptd_client import CheckpointClient
from ckptd_client._handover import PROOF_SECONDS
from ckptd_client._save import build_snapshot, upload_snapshot
from ckptd_client.session_calls import open_session
from ckptd_client.transport import Transport
from ckptd_schemas.handover import new_nonce, prove, proven, split_key
from support import ServerProcess, as_user, scaled

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


def test_a_save_on_the_services_host_hands_its_files_over_and_loads_bit_for_bit(srv, caplog):
    before = _metric(srv.url, "ckptd_local_uploads_total").get('status="200"', 0.0)
    want = {"model": {"w": torch.randn(512, 1024), "b": torch.arange(7.0)}, "step": 3}
    with CheckpointClient(srv.url, token=WRITER, file_bytes=1 << 20) as c, \
            caplog.at_level(logging.INFO, logger="ckptd_client"):
        handle = c.save(want, "run-a/1")
        handle.wait()
        got = {"model": {"w": torch.zeros(512, 1024), "b": torch.zeros(7)}, "step": 0}
        c.load(got, "run-a/1")
    assert torch.equal(got["model"]["w"], want["model"]["w"]) and got["step"] == 3
    manifest = httpx.get(f"{srv.url}/v1/checkpoints/run-a/1", headers={"Authorization": f"Bearer {WRITER}"},
                         timeout=30).json()
    handed = _metric(srv.url, "ckptd_local_uploads_total")['status="200"'] - before
    assert handed == len(manifest["files"]) >= 2, (handed, manifest["files"])  # every file, none over HTTP
    assert not [k for k in _metric(srv.url, "ckptd_http_requests_total") if 'route="upload_file"' in k]
    # the save's handle, and its finished line, say which way its bytes went
    ways = handle.ways
    assert ways.files == {"socket": len(manifest["files"]), "http": 0, "direct": 0, "linked": 0}, ways
    assert ways.bytes["socket"] == sum(f["size"] for f in manifest["files"].values()), ways
    done = [r.getMessage() for r in caplog.records if r.getMessage().startswith("saved run-a/1 rank 0")]
    assert len(done) == 1 and f"socket {len(manifest['files'])} files" in done[0], done
    assert not _fallbacks(caplog)


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


def test_a_socket_that_cannot_be_reached_sends_the_files_over_http(tmp_path, caplog):
    s = ServerProcess(tmp_path / "root").start()
    try:
        sock = _open(s.url, "run", "0", "b" * 16)["local_socket"]
        os.unlink(sock)  # as from another container: the path is not there
        want = {"w": torch.randn(300, 300), "v": torch.randn(300, 300)}
        with CheckpointClient(s.url, file_bytes=256 << 10) as c, caplog.at_level(logging.INFO, logger="ckptd_client"):
            c.save(want, "run/1").wait()
            said = _fallbacks(caplog)
            assert len(said) == 1 and "FileNotFoundError" in said[0].getMessage(), [r.getMessage() for r in said]
            got = {"w": torch.zeros(300, 300), "v": torch.zeros(300, 300)}
            c.load(got, "run/1")
        assert torch.equal(got["w"], want["w"]) and torch.equal(got["v"], want["v"])
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


# -- a local user at the socket's path -----------------------------------------------------------------

NOBODY = 65534
#: A listener of another local user at a path a rank was told (run as that user): it records what each
#: connection sent and how many descriptors came; with a key (``PRINCIPAL:HEX``, its own session's, from a
#: write token of another run) it answers the hello with a proof under that key; ``silent``: never answers;
#: else with a forged proof.
_LISTENER = r"""
import hashlib, hmac, json, os, socket, sys
path, out, key = sys.argv[1], sys.argv[2], sys.argv[3]
srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
srv.bind(path)
srv.listen(64)
srv.settimeout(0.2)
open(out + ".ready", "w").close()
while not os.path.exists(out + ".stop"):
    try:
        conn, _ = srv.accept()
    except (TimeoutError, OSError):
        continue
    got, fds, answered = b"", 0, key == "silent"
    conn.settimeout(300 if answered else 3)
    try:
        while True:
            data, fs, _, _ = socket.recv_fds(conn, 65536, 8)
            fds += len(fs)
            for f in fs:
                os.close(f)
            if not data:
                break
            got += data
            if b"\n" in got and not answered:
                nonce = json.loads(got.split(b"\n")[0])["nonce"]
                k = bytes.fromhex(key.rpartition(":")[2]) if ":" in key else b"forged"
                proof = hmac.new(k, f"ckptd handover service {nonce}".encode(), hashlib.sha256).hexdigest()
                conn.sendall(json.dumps({"proof": proof, "nonce": "1" * 64}).encode() + b"\n")
                answered = True
    except OSError:
        pass
    conn.close()
    with open(out, "a") as f:
        f.write(json.dumps({"got": got.decode("utf-8", "replace"), "fds": fds}) + "\n")
"""


@pytest.fixture
def shared_tmp():
    """A temporary directory any local user may reach and create in (sticky, as /tmp), for the service's
    socket and the other user's listener."""
    d = Path(tempfile.mkdtemp(prefix="ckptd-shared-", dir="/tmp"))
    os.chmod(d, 0o1777)
    yield d
    shutil.rmtree(d, ignore_errors=True)


class _Listener:
    """:data:`_LISTENER` at ``path``, as another user where this test runs as root."""

    def __init__(self, path: str, shared: Path, key: str = "-") -> None:
        out_dir = shared / "listener"
        out_dir.mkdir(exist_ok=True)
        os.chmod(out_dir, 0o777)
        self.out = out_dir / "conns"
        user = NOBODY if os.geteuid() == 0 else None
        self.proc = subprocess.Popen(as_user(user, [sys.executable, "-c", _LISTENER, path, str(self.out), key]))
        deadline = time.monotonic() + scaled(30)
        while not Path(f"{self.out}.ready").exists():
            assert self.proc.poll() is None and time.monotonic() < deadline, "the listener did not start"
            time.sleep(0.05)
        if user is not None:
            assert os.stat(path).st_uid == NOBODY  # the path is the other user's

    def stop(self) -> list[dict]:
        """What every connection gave it."""
        Path(f"{self.out}.stop").touch()
        self.proc.wait(scaled(30))
        return [json.loads(line) for line in self.out.read_text().splitlines()] if self.out.exists() else []


def _gave_nothing(conns: list[dict], info: dict) -> None:
    """Each connection brought a hello of the session and nothing else: no token, no descriptor, no byte."""
    assert conns, "the rank never came to the listener"
    for c in conns:
        assert c["fds"] == 0, c
        assert c["got"].count("\n") == 1 and c["got"].endswith("\n"), c  # the hello alone
        hello = json.loads(c["got"])
        assert set(hello) == {"principal", "run", "name", "session", "nonce"}, hello
        assert hello["session"] == info["session"] and WRITER not in c["got"], hello


def _fallbacks(caplog) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == "ckptd_client" and "co-located uploads off" in r.getMessage()]


def test_a_listener_at_the_path_a_restart_freed_gets_no_token_and_no_byte(tmp_path, shared_tmp, caplog):
    """A rank's session answer names the socket; the service restarts (its path freed, its new socket
    elsewhere); another local user, who holds a write token of another run and so a key of its own,
    binds the old path. The rank, still saving, gives that listener a hello and nothing else, and the
    save commits over HTTP, the fallback said once in the client's log."""
    tokens = tmp_path / "tokens"
    tokens.write_text(TOKENS)
    srv = ServerProcess(tmp_path / "root", env={"CKPTD_TOKENS_FILE": str(tokens),
                                               "TMPDIR": str(shared_tmp)}).start()
    listener = None
    try:
        transport = Transport(srv.url, token=WRITER)
        base, sid = "/v1/checkpoints/run-r/1", "e" * 16
        opened = open_session(transport, base, sid, 1, 1)
        info = {"session": sid}
        srv.stop()
        assert not os.path.exists(opened.local_socket)  # freed: anyone may bind it now
        srv.start()
        own = _open(srv.url, "else", "1", "f" * 16, token=OTHER)
        assert own["local_socket"] != opened.local_socket
        listener = _Listener(opened.local_socket, shared_tmp, key=own["local_key"])
        want = {"w": torch.randn(512, 512), "b": torch.randn(1000)}
        snap = build_snapshot(want, 0, 1)
        with caplog.at_level(logging.INFO, logger="ckptd_client"):
            status = upload_snapshot(transport, base, sid, snap, 1, compression=None, file_bytes=256 << 10,
                                     streams=2, opened=opened)
        assert status.state == "committed", status
        conns = listener.stop()
        listener = None
        _gave_nothing(conns, info)
        said = _fallbacks(caplog)
        assert len(said) == 1 and "did not prove" in said[0].getMessage(), [r.getMessage() for r in said]
        assert not _metric(srv.url, "ckptd_local_uploads_total")  # every file over HTTP
        with CheckpointClient(srv.url, token=WRITER) as c:
            got = {"w": torch.zeros(512, 512), "b": torch.zeros(1000)}
            c.load(got, "run-r/1")
        assert torch.equal(got["w"], want["w"]) and torch.equal(got["b"], want["b"])
    finally:
        if listener is not None:
            listener.stop()
        transport.close()
        srv.stop()


@pytest.mark.parametrize("answer", ["a proof under its own key", "a forged proof",
                                    pytest.param("silence", marks=pytest.mark.slow)])  # waits PROOF_SECONDS
def test_a_listener_planted_at_the_advertised_path_gets_no_token_and_no_byte(tmp_path, shared_tmp, caplog,
                                                                            answer):
    """A service whose temporary directory the ranks do not see (a container; simulated: its socket moved
    aside, so the path it advertises is free on the ranks' side) and another local user bound there first.
    ``CheckpointClient.save`` gives the listener a hello only, commits over HTTP, says so once; a listener
    that never answers costs the save ``PROOF_SECONDS``, not its client's timeout (here an hour)."""
    tokens = tmp_path / "tokens"
    tokens.write_text(TOKENS)
    srv = ServerProcess(tmp_path / "root", env={"CKPTD_TOKENS_FILE": str(tokens),
                                               "TMPDIR": str(shared_tmp)}).start()
    listener = None
    try:
        own = _open(srv.url, "else", "1", "f" * 16, token=OTHER)
        path = own["local_socket"]
        os.rename(path, path + ".private")
        key = {"a proof under its own key": own["local_key"], "a forged proof": "-", "silence": "silent"}[answer]
        listener = _Listener(path, shared_tmp, key=key)
        want = {"w": torch.randn(512, 512)}
        with caplog.at_level(logging.INFO, logger="ckptd_client"), \
                CheckpointClient(srv.url, token=WRITER, file_bytes=256 << 10, timeout=3600) as c:
            handle = c.save(want, "run-p/1")
            handle.wait(PROOF_SECONDS + scaled(120))
            got = {"w": torch.zeros(512, 512)}
            c.load(got, "run-p/1")
        assert torch.equal(got["w"], want["w"])
        conns = listener.stop()
        listener = None
        _gave_nothing(conns, {"session": handle.session})
        assert handle.ways.files["socket"] == 0 and handle.ways.files["http"] >= 1, handle.ways
        said = _fallbacks(caplog)
        assert len(said) == 1 and said[0].levelno == (logging.INFO if answer == "silence" else logging.WARNING), \
            [r.getMessage() for r in said]
        assert not _metric(srv.url, "ckptd_local_uploads_total")
    finally:
        if listener is not None:
            listener.stop()
        srv.stop()


# -- the socket bounded as HTTP is -----------------------------------------------------------------------

def test_trickled_hellos_are_cut_at_one_deadline_and_a_save_meanwhile_hands_its_files_over(srv):
    """More peers than the service has socket workers (16), no key needed, each trickling a hello a byte
    per 0.5 s: each is answered 400 and closed once the deadline for the whole hello passes (a deadline
    per read never would), and a save started meanwhile hands every file over through the socket."""
    path = _open(srv.url, "run", "4", "d" * 16)["local_socket"]
    stop, cut = threading.Event(), {}

    def trickle(i: int) -> None:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.connect(path)
            s.setblocking(False)
            line = b'{"principal": "' + b"x" * 20000
            for n, b in enumerate(line):
                if stop.is_set():
                    return
                try:
                    answer = s.recv(65536)
                    cut[i] = (n, answer)  # answered (or closed: b"") while still trickling
                    return
                except BlockingIOError:
                    pass
                except OSError as e:
                    cut[i] = (n, repr(e))
                    return
                try:
                    s.send(bytes([b]))
                except OSError as e:
                    cut[i] = (n, repr(e))
                    return
                time.sleep(0.5)

    peers = [threading.Thread(target=trickle, args=(i,), daemon=True) for i in range(20)]
    for t in peers:
        t.start()
    try:
        time.sleep(1.0)  # the workers are all the tricklers' now
        before = _metric(srv.url, "ckptd_local_uploads_total").get('status="200"', 0.0)
        want = {"w": torch.randn(512, 512), "v": torch.randn(512, 512)}
        with CheckpointClient(srv.url, token=WRITER, file_bytes=256 << 10, timeout=3600) as c:
            c.save(want, "run-t/1").wait(scaled(60))  # waited for the trickle, the client would time out at 3600 s
            files = len(c.manifest("run-t/1").files)
        handed = _metric(srv.url, "ckptd_local_uploads_total").get('status="200"', 0.0) - before
        assert handed == files >= 2, (handed, files)  # every file through the socket, none over HTTP
        for t in peers:
            t.join(scaled(30))
    finally:
        stop.set()
    assert sorted(cut) == list(range(20)), sorted(cut)  # every trickler was cut while it trickled
    answers = [a for _, a in cut.values() if isinstance(a, bytes) and a]
    assert answers and all(b'"status":400' in a and b"within 2 s" in a for a in answers), answers[:3]


def _vm(pid: int, field: str) -> int:
    """A field of /proc/PID/status, in bytes."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)


def test_a_sparse_memory_file_costs_the_service_its_read_window_not_the_file(tmp_path):
    """A sealed memory file of 1 GiB with nothing resident: declared smaller, it is refused 400 before a
    byte is read; declared at its size, the service reads all of it (a wrong digest: 422, nothing
    stored), its peak resident memory growing by far less than the file, and the file's holes stay
    holes (read, not mapped: nothing allocated for them on the service's behalf)."""
    srv = ServerProcess(tmp_path / "root").start()
    try:
        pid = srv.proc.pid
        info = _open(srv.url, "run", "5", "s" * 16)
        size = 1 << 30
        fd = os.memfd_create("sparse", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(fd, size)
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, SEALS)
            assert os.fstat(fd).st_blocks == 0
            small = _hand(info, {"file": "r000000-0000.bin", "size": 4096, "xxh3": "0" * 16}, [fd])
            assert small["status"] == 400 and "declares 4096" in small["error"]["message"], small
            assert not _metric(srv.url, "ckptd_bytes_in_total").get('route="local_upload"')  # not a byte read
            peak = _vm(pid, "VmHWM")
            whole = _hand(info, {"file": "r000000-0000.bin", "size": size, "xxh3": "0" * 16}, [fd])
            assert whole["status"] == 422, whole  # every byte read and hashed, then refused
            assert _metric(srv.url, "ckptd_bytes_in_total")['route="local_upload"'] == size
            grown = _vm(pid, "VmHWM") - peak
            assert grown < size // 4, (grown, size)  # the window (8 MiB) and the intake's, not the file
            assert os.fstat(fd).st_blocks == 0  # no hole was filled
        finally:
            os.close(fd)
        assert not list((Path(srv.root) / "runs/run/5/sessions").rglob("r000000-0000.bin*"))
    finally:
        srv.stop()


@pytest.mark.slow  # several seconds: with the slow tests, so the default run stays within its budget
def test_a_key_given_before_the_tokens_file_changed_holds_only_what_the_principal_still_may(tmp_path):
    """The key of a session outlives nothing: its principal is looked up again at each handover. The
    token replaced under the same name and scopes (rotated after a leak): 401; scope narrowed to
    reading: 403; the token removed: 401; nothing stored by any."""
    tokens = tmp_path / "tokens"
    tokens.write_text(TOKENS)
    srv = ServerProcess(tmp_path / "root", env={"CKPTD_TOKENS_FILE": str(tokens)}).start()
    try:
        info = _open(srv.url, "run", "6", "k" * 16)
        data = os.urandom(4096)

        def hand_until(want: int, first: int) -> tuple[int, dict]:
            deadline = time.monotonic() + scaled(30)
            for i in range(first, first + 1000):  # a new file each time: the tokens file is re-read every 2 s
                fd = _memfd(data)
                try:
                    # as the key's holder would, whether the service still proves that key or not
                    answer = _hand(info, _header(f"r000000-{i:04d}.bin", data), [fd], key=info["local_key"])
                finally:
                    os.close(fd)
                if answer["status"] == want or time.monotonic() > deadline:
                    return i, answer
                time.sleep(0.2)
            raise AssertionError(f"never answered {want}")

        rotated = f"trainer sha256:{hash_token(WRITER + '-rotated')} write:run*\n"
        for i, (line, want) in enumerate([(rotated, 401), (f"trainer sha256:{hash_token(WRITER)} read:run*\n", 403),
                                          ("", 401)]):
            tokens.write_text(line + f"else sha256:{hash_token(OTHER)} write:else\n")
            os.utime(tokens, (time.time() + 10 * (i + 1),) * 2)  # a new mtime, whatever the clock's grain
            n, answer = hand_until(want, 1000 * i)
            assert answer["status"] == want, answer
            assert not list((Path(srv.root) / "runs/run/6/sessions").rglob(f"r000000-{n:04d}.bin*"))
    finally:
        srv.stop()
