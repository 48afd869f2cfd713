"""Every request is bounded in time, and no token holder can keep the probes from answering.

Against a real ``ckptd serve``, through raw sockets, with valid tokens (a read-only one included):

* request bodies trickled a byte at a time, from their start or after a fast start, are answered
  408 (``request_timeout``) once they fall ``CKPTD_BODY_RATE_GRACE_SECONDS`` behind
  ``CKPTD_BODY_MIN_BYTES_PER_SECOND``, although the gap between their bytes never reaches the
  idle timeout; a slow body above the minimum rate uploads;
* more trickled bodies than the connection cap: each new connection sheds the body furthest
  behind (503 ``unavailable``, ``Retry-After``), ``/healthz`` and ``/readyz`` answer within a
  couple of seconds throughout, and every trickle left is answered 408 within the bound;
* one token's flood of slow requests of other kinds (status long-polls, downloads it never reads)
  is answered 429 past ``CKPTD_MAX_REQUESTS_PER_PRINCIPAL``, naming the token and the setting,
  while another token's requests and the probes pass; the client's retry goes through once a
  request ends;
* every connection busy with a request whose body has arrived (long polls, with no per-token
  limit): a new connection is kept for probes, which answer; any other request on it is 503.

Limits are set to seconds in each server's environment so that every test is short.
"""

from __future__ import annotations

import json
import os
import select
import socket
import threading
import time
from pathlib import Path

import httpx
import xxhash

from adversary.test_requests import ALICE, BOB, _commit_n, _open, _put_head
from ckptd.service.auth import hash_token
from ckptd_client.transport import Transport
from support import ServerProcess, scaled

READER = "reader-token-0123456789abcdef"
TOKENS = (f"alice sha256:{hash_token(ALICE)} write:*;bob sha256:{hash_token(BOB)} write:*;"
          f"reader sha256:{hash_token(READER)} read:*")
RATE, GRACE, IDLE = 200, 2.0, 4.0  # bytes/s, seconds: a byte every 0.25 s is 4 bytes/s, far behind
#: How soon a probe answers while the attacks go on ("within a couple of seconds"): well below what a
#: probe waiting for a connection to free would take (the 8 s grace, the 6 s long polls).
PROBE_S = scaled(2.0)


def _server(tmp_path: Path, **env: str) -> ServerProcess:
    base = {"CKPTD_TOKENS": TOKENS, "CKPTD_HEADER_TIMEOUT_SECONDS": "5",
            "CKPTD_BODY_IDLE_TIMEOUT_SECONDS": str(IDLE), "CKPTD_BODY_MIN_BYTES_PER_SECOND": str(RATE),
            "CKPTD_BODY_RATE_GRACE_SECONDS": str(GRACE)}
    return ServerProcess(tmp_path / "root", env={**base, **env}, log=tmp_path / "server.log")


def _auth(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def _plan_head(length: int, token: str = READER) -> bytes:
    """A read-plan request (a read scope is enough) declaring a body of ``length`` bytes."""
    return (f"POST /v1/checkpoints/gpt/1/read-plan HTTP/1.1\r\nHost: t\r\nAuthorization: Bearer {token}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {length}\r\n\r\n").encode()


def _poll_head(sid: str = "s1", wait: float = 6, token: str = ALICE) -> bytes:
    return (f"GET /v1/checkpoints/gpt/1/sessions/{sid}?wait={wait} HTTP/1.1\r\nHost: t\r\n"
            f"Authorization: Bearer {token}\r\n\r\n").encode()


def _parse(raw: bytes) -> tuple[int | None, dict[str, str], bytes]:
    """Status, headers and body of the one HTTP/1.1 response in ``raw`` (None: no response)."""
    if not raw.startswith(b"HTTP/1.1 "):
        return None, {}, b""
    head, _, body = raw.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
    return int(lines[0][9:12]), headers, body


def _response(sock: socket.socket) -> bytes:
    """One whole response read from ``sock`` (its body framed by Content-Length)."""
    got = b""
    while b"\r\n\r\n" not in got and (piece := sock.recv(65536)):
        got += piece
    length = int(_parse(got)[1].get("content-length", 0))
    while len(got.partition(b"\r\n\r\n")[2]) < length and (piece := sock.recv(65536)):
        got += piece
    return got


def _error(raw: bytes) -> tuple[int | None, dict[str, str], dict]:
    status, headers, body = _parse(raw)
    return status, headers, json.loads(body)["error"] if status else {}


def _timed_probe(url: str, path: str) -> float:
    t0 = time.perf_counter()
    r = httpx.get(f"{url}{path}", timeout=10)
    assert r.status_code == 200, (path, r.status_code, r.text)
    return time.perf_counter() - t0


def _refused(url: str, token: str, deadline: float) -> httpx.Response:
    """``GET /v1/runs`` as ``token`` until it is refused 429 or ``deadline`` (monotonic) passes; the last
    answer. The requests ``token`` just sent count once the service has taken them in, however loaded it is."""
    while True:
        r = httpx.get(f"{url}/v1/runs", headers=_auth(token), timeout=10)
        if r.status_code == 429 or time.monotonic() > deadline:
            return r
        time.sleep(0.05)


def _metric(url: str, name: str) -> float:
    text = httpx.get(f"{url}/metrics").text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name))


class Trickle:
    """One request whose body is sent a byte at a time (after ``first``), until the server answers or closes."""

    def __init__(self, port: int, head: bytes, first: bytes = b"x") -> None:
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=10)
        self.sock.sendall(head + first)
        self.started = time.monotonic()
        self.got = b""
        self.ended: float | None = None  # when the server answered or closed

    def step(self) -> None:
        """Take the server's answer if one came (then read to the close), or send one more byte."""
        if self.ended is not None:
            return
        readable, _, _ = select.select([self.sock], [], [], 0)
        if readable:
            self.ended = time.monotonic()
            self.sock.settimeout(3)
            try:
                while piece := self.sock.recv(65536):
                    self.got += piece
            except OSError:
                pass
            return
        try:
            self.sock.sendall(b"x")
        except OSError:
            self.ended = time.monotonic()

    def close(self) -> None:
        self.sock.close()


def _drive(trickles: list[Trickle], seconds: float, period: float = 0.25) -> None:
    """Step every trickle each ``period`` until each is answered or ``seconds`` pass."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and any(t.ended is None for t in trickles):
        for t in trickles:
            t.step()
        time.sleep(period)


# -- bodies bounded in rate --------------------------------------------------------------------------------------

def test_trickled_bodies_are_answered_408_once_behind_the_minimum_rate(tmp_path):
    srv = _server(tmp_path).start()
    steady: dict = {}
    try:
        _open(srv.url, "gpt", "1", "s1")
        from_start = [Trickle(srv.port, _plan_head(100_000)),  # a read-only token
                      Trickle(srv.port, _put_head("gpt", "1", "s1", "a.bin", 1 << 20))]  # a write token
        fast_start = Trickle(srv.port, _put_head("gpt", "1", "s1", "b.bin", 1 << 20), first=b"y" * (64 << 10))

        # beside them a slow but steady upload, 50 bytes every 0.15 s (330 bytes/s, above the minimum)
        data = os.urandom(1500)

        def upload() -> None:
            s = socket.create_connection(("127.0.0.1", srv.port), timeout=30)
            head = _put_head("gpt", "1", "s1", "c.bin", len(data)).replace(
                b"X-Ckptd-Xxh3: " + b"0" * 16, b"X-Ckptd-Xxh3: " + xxhash.xxh3_64_hexdigest(data).encode())
            s.sendall(head)
            for i in range(0, len(data), 50):
                s.sendall(data[i:i + 50])
                time.sleep(0.15)
            steady["status"] = _parse(_response(s))[0]
            s.close()

        t = threading.Thread(target=upload)
        t.start()
        everyone = [*from_start, fast_start]
        _drive(everyone, scaled(GRACE + IDLE + 6))
        t.join(scaled(30))
        for tr in everyone:
            status, headers, err = _error(tr.got)
            assert status == 408, tr.got[:300]
            assert err["code"] == "request_timeout" and "CKPTD_BODY_MIN_BYTES_PER_SECOND" in err["message"], err
            assert headers.get("connection") == "close"
        # the gaps between bytes (0.25 s) never reach the idle bound: the rate sheds them, after the grace
        for tr in from_start:
            assert GRACE * 0.8 <= tr.ended - tr.started <= scaled(GRACE + 3), tr.ended - tr.started
        # 64 KiB at once buys at most the idle bound of lead; then it trickles and is shed too
        assert IDLE * 0.8 <= fast_start.ended - fast_start.started <= scaled(IDLE + 3)
        assert steady.get("status") == 200, steady
        assert _metric(srv.url, 'ckptd_limit_refusals_total{limit="body_rate"}') == 3
        assert _metric(srv.url, 'ckptd_limit_refusals_total{limit="body_idle"}') == 0
        _timed_probe(srv.url, "/healthz")  # still answering
        for tr in everyone:
            tr.close()
    finally:
        srv.stop()
    log = (tmp_path / "server.log").read_text()
    assert "Traceback" not in log and "disconnected before the request body" not in log, log[-3000:]


# -- the connection cap sheds trickled bodies, probes answer -------------------------------------------------------

def test_trickled_bodies_over_the_cap_are_shed_and_probes_answer(tmp_path):
    grace = 8.0  # the probes below run well inside it: only the cap sheds the trickles meanwhile
    srv = _server(tmp_path, CKPTD_MAX_CONNECTIONS="16", CKPTD_BODY_RATE_GRACE_SECONDS=str(grace),
                  CKPTD_BODY_IDLE_TIMEOUT_SECONDS="30", CKPTD_MAX_REQUESTS_PER_PRINCIPAL="0").start()
    trickles: list[Trickle] = []
    try:
        for _ in range(24):  # a read-only token's bodies, more than the cap; each new one sheds one
            trickles.append(Trickle(srv.port, _plan_head(100_000)))
            time.sleep(0.1)  # its head is in, so it is busy receiving a body
        driver = threading.Thread(target=_drive, args=(trickles, scaled(grace + 8)))
        driver.start()
        time.sleep(0.5)
        probes = []
        for _ in range(4):  # each probe connection is over the cap too
            probes += [_timed_probe(srv.url, "/healthz"), _timed_probe(srv.url, "/readyz")]
            time.sleep(0.2)
        assert max(probes) < PROBE_S, probes
        probed = time.monotonic()
        driver.join()
        shed, timed_out = [], []
        for tr in trickles:
            status, headers, err = _error(tr.got)
            if status == 503:
                assert err["code"] == "unavailable" and "furthest behind" in err["message"], err
                assert headers.get("retry-after") == "1"
                # the rate bound would shed it at grace (408): seconds after the probes, not right after them
                assert tr.ended < probed + scaled(3), "a body shed after the probes: the cap shed it, not the rate"
                shed.append(tr)
            else:
                assert status == 408 and err["code"] == "request_timeout", tr.got[:300]
                assert tr.ended - tr.started <= scaled(grace + 3)
                timed_out.append(tr)
        assert len(shed) >= 8, f"{len(shed)} bodies shed for 8 connections over the cap and 8 probes"
        assert timed_out, "every trickle was shed: none was left to the rate bound"
        # the oldest (furthest behind) went first
        assert max(t.started for t in shed) < min(t.started for t in timed_out)
        assert _metric(srv.url, 'ckptd_limit_refusals_total{limit="connections"}') >= 8
        _timed_probe(srv.url, "/healthz")  # still answering
    finally:
        for tr in trickles:
            tr.close()
        srv.stop()
    log = (tmp_path / "server.log").read_text()
    assert "Traceback" not in log and "disconnected before the request body" not in log, log[-3000:]


# -- requests in progress, per token ----------------------------------------------------------------------------

def test_one_tokens_flood_of_slow_requests_is_429_while_another_token_and_probes_pass(tmp_path):
    srv = _server(tmp_path, CKPTD_MAX_REQUESTS_PER_PRINCIPAL="4").start()
    socks: list[socket.socket] = []
    try:
        data = os.urandom(8 << 20)
        _commit_n(srv.url, "gpt", "0", data, 1)  # a file to download
        _open(srv.url, "gpt", "1", "s1")  # a session to long-poll
        t0 = time.monotonic()
        for _ in range(4):  # alice: 4 status long-polls of 3 s
            socks.append(socket.create_connection(("127.0.0.1", srv.port), timeout=10))
            socks[-1].sendall(_poll_head(wait=3))
        get = f"GET /v1/checkpoints/gpt/0/files/f.bin HTTP/1.1\r\nHost: t\r\nAuthorization: Bearer {READER}\r\n\r\n"
        readers = []
        for _ in range(4):  # the read-only token: 4 downloads of 8 MiB it never reads
            s = socket.socket()
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            s.connect(("127.0.0.1", srv.port))
            s.sendall(get.encode())
            readers.append(s)
        socks += readers

        for token, name in ((ALICE, "alice"), (READER, "reader")):
            r = _refused(srv.url, token, deadline=t0 + 3 * 0.9)  # while alice's long polls are still waiting
            assert r.status_code == 429, r.text
            err = r.json()["error"]
            assert err["code"] == "too_many_requests" and r.headers.get("retry-after") == "1", r.text
            assert repr(name) in err["message"] and "CKPTD_MAX_REQUESTS_PER_PRINCIPAL" in err["message"], err
            assert err["details"] == {"limit": 4, "token": name, "in_progress": 4, "limit_name": "requests"}, err
        # a body on a refused request is not read: its connection is closed
        s = socket.create_connection(("127.0.0.1", srv.port), timeout=10)
        s.sendall(_plan_head(100_000) + b"x" * 10)
        got = b""
        while piece := s.recv(65536):
            got += piece
        status, headers, err = _error(got)
        assert status == 429 and headers.get("connection") == "close" and err["details"]["token"] == "reader"
        s.close()

        r = httpx.get(f"{srv.url}/v1/runs", headers=_auth(BOB), timeout=10)  # another token passes
        assert r.status_code == 200, r.text
        for _ in range(3):  # probes are never counted
            assert _timed_probe(srv.url, "/healthz") < PROBE_S and _timed_probe(srv.url, "/readyz") < PROBE_S

        # the client retries a 429; alice's long polls end after 3 s and its request goes through
        result: dict = {}
        t = threading.Thread(target=lambda: result.update(
            runs=Transport(srv.url, token=ALICE, retry_seconds=20).request("GET", "/v1/runs")))
        t.start()
        t.join(scaled(20))
        assert "gpt" in json.dumps(result.get("runs")), result
        assert time.monotonic() - t0 >= 3 * 0.9  # it waited for a long poll to end
        for s in socks[:4]:
            status, _, body = _parse(_response(s))
            assert status == 200 and b'"open"' in body
        assert _metric(srv.url, 'ckptd_limit_refusals_total{limit="requests"}') >= 4
    finally:
        for s in socks:
            s.close()
        srv.stop()
    log = (tmp_path / "server.log").read_text()
    assert "Traceback" not in log, log[-3000:]


def test_probes_answer_when_every_connection_is_busy_with_a_request_whose_body_arrived(tmp_path):
    # no per-token limit: one token holds every connection of the cap with long polls (nothing to shed)
    srv = _server(tmp_path, CKPTD_MAX_CONNECTIONS="16", CKPTD_MAX_REQUESTS_PER_PRINCIPAL="0").start()
    polls: list[socket.socket] = []
    try:
        _open(srv.url, "gpt", "1", "s1")
        for _ in range(16):
            polls.append(socket.create_connection(("127.0.0.1", srv.port), timeout=10))
            polls[-1].sendall(_poll_head(wait=6))
            time.sleep(0.02)
        opened = time.monotonic()
        time.sleep(0.5)
        times: list[float] = []
        threads = [threading.Thread(target=lambda p=p: times.append(_timed_probe(srv.url, p)))
                   for p in ("/healthz", "/readyz") * 4]  # 8 probes at once, each on a connection over the cap
        for th in threads:
            th.start()
        for th in threads:
            th.join(scaled(10))
        assert len(times) == 8 and max(times) < PROBE_S, times
        # any other request on a connection kept for probes is refused, in the error shape
        r = httpx.get(f"{srv.url}/v1/runs", headers=_auth(BOB), timeout=10)
        assert r.status_code == 503 and r.headers.get("retry-after") == "1", r.text
        err = r.json()["error"]
        assert err["code"] == "unavailable" and "/healthz and /readyz only" in err["message"], err
        assert time.monotonic() - opened < scaled(6), "the long polls ended before the probes were tried"
        for s in polls:  # the long polls were never shed
            s.settimeout(scaled(10))
            status, _, body = _parse(_response(s))
            assert status == 200 and b'"open"' in body
        r = httpx.get(f"{srv.url}/v1/runs", headers=_auth(BOB), timeout=10)
        assert r.status_code == 200, r.text
    finally:
        for s in polls:
            s.close()
        srv.stop()
    log = (tmp_path / "server.log").read_text()
    assert "Traceback" not in log, log[-3000:]
