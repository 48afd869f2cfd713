"""Attacks on the co-located socket's availability by a local peer that holds no key.

Threat (docs/security.md, Co-located uploads): anyone on the host may connect to the socket (mode 0666:
who may hand a file over is decided by the session key). Such a peer can prove nothing, but it can make
the service hold things before it is refused, and it can make the service's process run out of file
descriptors (each idle TCP connection to the HTTP port costs one). Through a real ``ckptd serve`` whose
descriptor limit is lowered to what a service under systemd gets by default (``LimitNOFILE`` 1024):

* descriptors passed (``SCM_RIGHTS``) with the bytes of a hello that never ends: each ``recvmsg`` takes
  up to four, and before, all of them were held until the deadline, so one connection filled the
  service's table and its HTTP answers failed; now a second descriptor ends the connection (400 ``fd``)
  and a session opens over HTTP meanwhile;
* the service's table filled for a moment (idle TCP connections) while a rank connects: the socket's
  accept failed (``EMFILE``) and, before, its thread ended, so the socket stayed bound but was never
  served again (every later save waited for a proof that never came, then went over HTTP); now it
  accepts again once descriptors are free and the waiting rank's hello is answered;
* a hello nested past the JSON parser's depth: answered 400 ``hello`` (before, a 500 and a traceback).
"""

from __future__ import annotations

import json
import os
import resource
import socket
import time

import httpx
import pytest

from ckptd_schemas.handover import new_nonce
from support import ServerProcess, scaled

LIMIT = 1024  # a systemd service's default soft RLIMIT_NOFILE


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    s = ServerProcess(tmp_path_factory.mktemp("local-socket") / "root").start()
    _soft, hard = resource.prlimit(s.proc.pid, resource.RLIMIT_NOFILE)
    resource.prlimit(s.proc.pid, resource.RLIMIT_NOFILE, (LIMIT, hard))
    yield s
    s.stop()


def _session(url: str, name: str) -> dict:
    r = httpx.post(f"{url}/v1/checkpoints/run-sock/{name}/sessions", json={"session": f"s-{name}", "world_size": 1},
                   timeout=scaled(30))
    assert r.status_code == 200, r.text
    return r.json()


def _fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def _answer(s: socket.socket) -> dict | None:
    buf = b""
    while b"\n" not in buf:
        try:
            data = s.recv(65536)
        except (TimeoutError, ConnectionError):
            return None
        if not data:
            return None
        buf += data
    return json.loads(buf[:buf.index(b"\n")])


def test_descriptors_sent_by_a_peer_without_a_key_never_fill_the_services_table(srv):
    path = _session(srv.url, "1")["local_socket"]
    null = os.open("/dev/null", os.O_RDONLY)
    peers, sent = [], 0
    try:
        for _ in range(2):  # 2 x 600 messages x 4 descriptors: more than the service's whole table
            p = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            p.settimeout(scaled(10))
            p.connect(path)
            peers.append(p)
            try:
                for _ in range(600):
                    socket.send_fds(p, [b"x"], [null] * 4)  # a hello that never ends, descriptors with each byte
                    sent += 4
            except OSError:
                pass  # the service ended the connection
        assert sent >= 8
        held = _fds(srv.proc.pid)
        r = httpx.post(f"{srv.url}/v1/checkpoints/run-sock/2/sessions", json={"session": "s-2", "world_size": 1},
                       timeout=scaled(30))  # while the peers' connections are open, within the hello's deadline
        assert r.status_code == 200, r.text
        assert held < LIMIT // 2, f"the service holds {held} descriptors after {sent} were sent to it"
        answer = _answer(peers[0])
        assert answer is not None and answer["status"] == 400 and answer["error"]["details"]["field"] == "fd", answer
    finally:
        for p in peers:
            p.close()
        os.close(null)


def test_the_socket_accepts_again_after_the_service_ran_out_of_descriptors(srv):
    info = _session(srv.url, "3")
    pid = srv.proc.pid
    idle: list[socket.socket] = []
    rank = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        deadline = time.monotonic() + scaled(30)
        while _fds(pid) < LIMIT - 1 and time.monotonic() < deadline:  # idle TCP connections fill the table
            for _ in range(64):
                c = socket.create_connection(("127.0.0.1", srv.port), timeout=scaled(10))
                idle.append(c)
            time.sleep(0.05)
        assert _fds(pid) >= LIMIT - 1, "the idle connections did not fill the service's table"
        rank.settimeout(scaled(20))
        rank.connect(info["local_socket"])  # queued: the service's accept fails while its table is full
        time.sleep(0.5)
        for c in idle:
            c.close()
        idle.clear()
        rank.sendall(json.dumps({"principal": "anonymous", "run": info["run"], "name": info["name"],
                                 "session": info["session"], "nonce": new_nonce()}).encode() + b"\n")
        challenge = _answer(rank)
        assert challenge is not None and "proof" in challenge, \
            f"the socket no longer serves after the service ran out of descriptors: {challenge}"
    finally:
        rank.close()
        for c in idle:
            c.close()


def test_a_hello_nested_past_the_parsers_depth_is_refused_typed_not_a_500(srv):
    """A peer without a key sends a hello of 10,000 nested arrays (within the header's 16 KiB): before,
    the parser's ``RecursionError`` escaped as a 500 with a traceback in the service's log."""
    path = _session(srv.url, "4")["local_socket"]
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as p:
        p.settimeout(scaled(10))
        p.connect(path)
        p.sendall(b"[" * 10_000 + b"\n")
        answer = _answer(p)
    assert answer is not None and answer["status"] == 400 and answer["error"]["details"]["field"] == "hello", answer
    assert "Traceback" not in srv.log.read_text()
