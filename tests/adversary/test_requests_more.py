"""No request can take the service down, continued: more attacks by a client with a valid token.

* readers that request a large file and never read the response: over the connection cap
  they are shed before a probe is refused, and past ``CKPTD_SEND_IDLE_TIMEOUT_SECONDS``
  their connections are aborted; ``/healthz`` answers throughout and another reader
  downloads the file;
* malformed HTTP framing (a ``Content-Length`` shorter than the body followed by junk,
  ``Content-Length`` with ``Transfer-Encoding: chunked``, a bad chunk size) is answered
  400 in the service's one error shape, and pipelined requests are answered in order;
* a rank index of tens of thousands of chunks is parsed off the event loop: ``/healthz``
  keeps answering within a second while it is parsed and committed; a 100 MB index (which
  would take a minute and 2 GB to check) is refused 413, whether its length is declared or
  it arrives chunked;
* hostile JSON (nesting 100,000 deep, numbers of 5,000 digits, 60,000-character
  strings) on every JSON route is a 4xx in the error shape, never a 500;
* verify requests in a loop queue on the fixed worker pool: no process per request;
* a client that goes away in the middle of a JSON body (rank index, read plan, adopt, session,
  reshard job) is one warning and one ``ckptd_client_disconnects_total`` on that route, never
  a 400 or a 500.

Timeouts are set to 2-3 s in each server's environment so that every test is short.
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import os
import socket
import threading
import time
from pathlib import Path

import httpx
import xxhash

from ckptd.service.auth import hash_token
from adversary.test_requests import ALICE, _auth, _open, _put_head, _server as server_with_deadlines
from support import ServerProcess

ROOT = "root-token-0123456789abcdef"
TOKENS = f"alice sha256:{hash_token(ALICE)} write:*;root sha256:{hash_token(ROOT)} admin"


def _server(tmp_path: Path, **env: str) -> ServerProcess:
    return server_with_deadlines(tmp_path, tokens=TOKENS, **env)


def _chunk(offsets: list[int], sizes: list[int], offset: int, stored: bytes) -> dict:
    return {"kind": "box", "rank": 0, "offsets": offsets, "sizes": sizes,
            "location": {"file": "f.bin", "offset": offset, "length": len(stored), "codec": "raw",
                         "raw_length": len(stored), "xxh3": xxhash.xxh3_64_hexdigest(stored)}}


def _upload(url: str, run: str, name: str, data: bytes) -> None:
    r = httpx.post(f"{url}/v1/checkpoints/{run}/{name}/sessions", headers=_auth(),
                   json={"session": "s1", "world_size": 1, "step": int(name)})
    assert r.status_code == 200, r.text
    r = httpx.put(f"{url}/v1/checkpoints/{run}/{name}/sessions/s1/files/f.bin", content=data, timeout=60,
                  headers={**_auth(), "X-Ckptd-Xxh3": xxhash.xxh3_64_hexdigest(data)})
    assert r.status_code == 200, r.text


def _index(n: int, data: bytes) -> bytes:
    """Rank 0's index of one float32 vector of ``n`` one-element chunks (4 bytes each of ``data``)."""
    chunks = [_chunk([i], [1], 4 * i, data[4 * i:4 * i + 4]) for i in range(n)]
    return json.dumps({"rank": 0, "world_size": 1, "files": ["f.bin"], "tensors": [
        {"name": "w", "shape": [n], "dtype": "float32", "group": "model", "chunks": chunks}]}).encode()


def _commit(url: str, run: str, name: str, data: bytes, n: int) -> None:
    _upload(url, run, name, data)
    r = httpx.put(f"{url}/v1/checkpoints/{run}/{name}/sessions/s1/ranks/0", content=_index(n, data), timeout=60,
                  headers={**_auth(), "Content-Type": "application/json"})
    assert r.status_code == 200 and r.json()["state"] == "committed", r.text


def _healthz_ms(url: str) -> float:
    t0 = time.perf_counter()
    r = httpx.get(f"{url}/healthz", timeout=10)
    assert r.status_code == 200
    return (time.perf_counter() - t0) * 1000


def _metric(url: str, name: str) -> float:
    text = httpx.get(f"{url}/metrics").text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name))


def _one_error_shape(r: httpx.Response, what: str) -> dict:
    assert 400 <= r.status_code < 500, f"{what}: {r.status_code} {r.text[:300]}"
    err = r.json()["error"]
    assert {"code", "message", "details"} <= set(err) and err["message"], f"{what}: {r.text[:300]}"
    return err


def _read_all(sock: socket.socket, within: float) -> tuple[bytes, bool]:
    """What the server sends on ``sock`` until it closes it (True) or ``within`` seconds pass (False)."""
    sock.settimeout(within)
    got = b""
    try:
        while True:
            piece = sock.recv(1 << 20)
            if not piece:
                return got, True
            got += piece
    except (ConnectionResetError, BrokenPipeError):
        return got, True
    except socket.timeout:
        return got, False


def _responses(raw: bytes) -> list[tuple[int, bytes]]:
    """(status, body) of each HTTP/1.1 response in ``raw`` (bodies framed by Content-Length)."""
    out = []
    while raw.startswith(b"HTTP/1.1 "):
        head, _, rest = raw.partition(b"\r\n\r\n")
        length = next(int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")
                      if line.lower().startswith(b"content-length:"))
        out.append((int(head[9:12]), rest[:length]))
        raw = rest[length:]
    return out


# -- readers that never read -------------------------------------------------------------------------------

def test_readers_that_never_read_are_shed_and_timed_out_while_healthz_answers(tmp_path):
    srv = _server(tmp_path, CKPTD_MAX_CONNECTIONS="16", CKPTD_SEND_IDLE_TIMEOUT_SECONDS="3").start()
    stalled: list[socket.socket] = []
    try:
        data = os.urandom(8 << 20)
        _commit(srv.url, "gpt", "1", data, 1)  # the file only needs to exist and be committed
        head = (f"GET /v1/checkpoints/gpt/1/files/f.bin HTTP/1.1\r\nHost: t\r\n"
                f"Authorization: Bearer {ALICE}\r\n\r\n").encode()
        for _ in range(20):  # more than the cap, each a response of 8 MiB that is never read
            s = socket.socket()
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            s.connect(("127.0.0.1", srv.port))
            s.sendall(head)
            stalled.append(s)
            time.sleep(0.02)
        last_opened = time.monotonic()
        time.sleep(0.5)  # every response has filled its socket and waits for its reader
        t0 = time.monotonic()
        probes = []
        while time.monotonic() - t0 < 1.5:
            probes.append(_healthz_ms(srv.url))
            time.sleep(0.1)
        assert max(probes) < 1000, probes
        r = httpx.get(f"{srv.url}/v1/checkpoints/gpt/1/files/f.bin", headers=_auth(), timeout=30)
        assert r.status_code == 200 and r.content == data  # a reader that reads gets the whole file
        # past the send deadline every stalled response is cut off: what was buffered, then the close
        time.sleep(max(0.0, last_opened + 3 + 1.5 - time.monotonic()))  # reading earlier would make it a reader
        for s in stalled:
            got, closed = _read_all(s, 8)
            assert closed, "a connection whose reader read nothing was held open past the send deadline"
            assert len(got) < len(data)
        assert _metric(srv.url, 'ckptd_limit_refusals_total{limit="send_idle"}') >= 1
        assert _healthz_ms(srv.url) < 1000
    finally:
        for s in stalled:
            s.close()
        srv.stop()
    log = (tmp_path / "server.log").read_text()
    assert "Traceback" not in log, log[-3000:]


# -- HTTP framing ---------------------------------------------------------------------------------------------

def test_malformed_framing_is_a_json_400_and_pipelined_requests_are_answered(tmp_path):
    srv = _server(tmp_path).start()
    try:
        _upload(srv.url, "gpt", "1", b"abc")
        put = (f"PUT /v1/checkpoints/gpt/1/sessions/s1/files/{{f}} HTTP/1.1\r\nHost: t\r\nAuthorization: Bearer "
               f"{ALICE}\r\nX-Ckptd-Xxh3: {xxhash.xxh3_64_hexdigest(b'abc')}\r\n")
        attacks = {
            "Content-Length shorter than the body, junk after it":
                put.format(f="a.bin") + "Content-Length: 3\r\n\r\nabcGARBAGE\r\n\r\n",
            "Content-Length and chunked together":
                put.format(f="b.bin") + "Content-Length: 3\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n0\r\n\r\n",
            "a chunk size that is not hex": put.format(f="c.bin") + "Transfer-Encoding: chunked\r\n\r\nzz\r\nabc\r\n",
            "a request line that is not HTTP": "GET /healthz HTTP/9\x00\r\n\r\n",
        }
        for what, raw in attacks.items():
            s = socket.create_connection(("127.0.0.1", srv.port), timeout=10)
            s.sendall(raw.encode())
            got, closed = _read_all(s, 5)
            s.close()
            assert closed, what
            statuses = _responses(got)
            assert statuses and statuses[-1][0] == 400, f"{what}: {got[:300]!r}"
            err = json.loads(statuses[-1][1])["error"]
            assert err["code"] == "invalid_request" and "malformed HTTP request" in err["message"], what

        # 50 probes and a manifest request in one write: 51 answers, in order, on one connection
        s = socket.create_connection(("127.0.0.1", srv.port), timeout=10)
        s.sendall(b"GET /healthz HTTP/1.1\r\nHost: t\r\n\r\n" * 50 +
                  f"GET /v1/runs HTTP/1.1\r\nHost: t\r\nAuthorization: Bearer {ALICE}\r\nConnection: close"
                  f"\r\n\r\n".encode())
        got, closed = _read_all(s, 10)
        s.close()
        answers = _responses(got)
        assert closed and len(answers) == 51 and all(st == 200 for st, _ in answers), got[-300:]
        assert [r["run"] for r in json.loads(answers[-1][1])] == ["gpt"]
        assert _healthz_ms(srv.url) < 1000
    finally:
        srv.stop()


def _stream_header(s: socket.socket, total: int) -> bool:
    """Send one header of ``total`` bytes in 8 KiB pieces; False when the server stopped taking them."""
    try:
        s.sendall(b"X-Endless: ")
        for _ in range(total // 8192):
            s.sendall(b"a" * 8192)
    except (ConnectionResetError, BrokenPipeError):
        return False
    return True


def test_every_head_on_a_kept_alive_connection_is_bounded_in_bytes_and_time(tmp_path):
    """The head bound (431) and the head deadline hold for the second request on a connection as for the
    first: after a request with a body the app read, after one without a body, and after one refused
    without reading its body (whose rest is discarded, never counted as a head)."""
    srv = _server(tmp_path).start()
    try:
        _open(srv.url, "gpt", "1", "s1")
        small = b"abc"
        cases = {
            "after a body the app read": _put_head("gpt", "1", "s1", "a.bin", 3).replace(
                b"0" * 16, xxhash.xxh3_64_hexdigest(small).encode()) + small,
            "after a request without a body": b"GET /healthz HTTP/1.1\r\nHost: t\r\n\r\n",
        }
        for what, first in cases.items():
            s = socket.create_connection(("127.0.0.1", srv.port), timeout=10)
            s.sendall(first + b"GET /healthz HTTP/1.1\r\nHost: t\r\n")
            _stream_header(s, 1 << 20)
            got, closed = _read_all(s, 10)
            s.close()
            answers = _responses(got)
            assert closed and [st for st, _ in answers] == [200, 431], f"{what}: {got[-300:]!r}"
            assert json.loads(answers[-1][1])["error"]["code"] == "payload_too_large", what

            s = socket.create_connection(("127.0.0.1", srv.port), timeout=10)
            s.sendall(first + b"GET /heal")  # a second head that never ends: closed by the deadline
            t0 = time.monotonic()
            got, closed = _read_all(s, 8)
            s.close()
            assert closed and [st for st, _ in _responses(got)] == [200], f"{what}: {got[-300:]!r}"
            assert time.monotonic() - t0 < 6, what

        # Refused without reading its body (no token): the client, still sending 4 MiB, is not reset; the endless
        # header it sends after the body is refused 431.
        s = socket.create_connection(("127.0.0.1", srv.port), timeout=10)
        s.sendall(_put_head("gpt", "1", "s1", "b.bin", 4 << 20).replace(f"Bearer {ALICE}".encode(), b"Bearer nope"))
        sent = 0
        try:
            while sent < 4 << 20:
                s.sendall(b"z" * 65536)
                sent += 65536
        except (ConnectionResetError, BrokenPipeError):
            pass
        assert sent == 4 << 20, "the connection was reset while the client sent the refused body"
        s.sendall(b"GET /healthz HTTP/1.1\r\nHost: t\r\n")
        _stream_header(s, 1 << 20)
        got, closed = _read_all(s, 10)
        s.close()
        answers = _responses(got)
        assert closed and [st for st, _ in answers] == [401, 431], got[-300:]
        assert _healthz_ms(srv.url) < 1000
        assert _metric(srv.url, 'ckptd_limit_refusals_total{limit="header_bytes"}') == 3
    finally:
        srv.stop()


# -- clients that go away ----------------------------------------------------------------------------------------

def test_a_client_gone_mid_body_is_a_disconnect_on_every_json_route(tmp_path):
    srv = _server(tmp_path, CKPTD_BODY_IDLE_TIMEOUT_SECONDS="30").start()
    try:
        _commit(srv.url, "gpt", "1", os.urandom(4 << 20), 1)
        r = httpx.post(f"{srv.url}/v1/checkpoints/gpt/2/sessions", headers=_auth(),
                       json={"session": "s1", "world_size": 1, "step": 2})
        assert r.status_code == 200, r.text
        routes = {"put_index": ("PUT", "/v1/checkpoints/gpt/2/sessions/s1/ranks/0", ALICE),
                  "read_plan": ("POST", "/v1/checkpoints/gpt/1/read-plan", ALICE),
                  "link_file": ("POST", "/v1/checkpoints/gpt/2/sessions/s1/files/x.bin/link", ALICE),
                  "open_session": ("POST", "/v1/checkpoints/gpt/3/sessions", ALICE),
                  "create_job": ("POST", "/v1/reshard", ROOT)}
        for method, path, token in routes.values():
            s = socket.create_connection(("127.0.0.1", srv.port), timeout=10)
            s.sendall(f"{method} {path} HTTP/1.1\r\nHost: t\r\nAuthorization: Bearer {token}\r\n"
                      f"Content-Type: application/json\r\nContent-Length: 5000\r\n\r\n{{\"a\": ".encode())
            time.sleep(0.3)  # the handler is waiting for the rest of the body
            s.close()
        s = socket.create_connection(("127.0.0.1", srv.port), timeout=10)  # a download cut off mid-stream
        s.sendall(f"GET /v1/checkpoints/gpt/1/files/f.bin HTTP/1.1\r\nHost: t\r\nAuthorization: Bearer {ALICE}"
                  f"\r\n\r\n".encode())
        s.recv(65536)
        s.close()
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and _metric(srv.url, "ckptd_client_disconnects_total") < len(routes):
            time.sleep(0.1)
        for route in routes:
            assert _metric(srv.url, f'ckptd_client_disconnects_total{{route="{route}"}}') == 1, route
        text = httpx.get(f"{srv.url}/metrics").text
        answered = [line for line in text.splitlines() if line.startswith("ckptd_http_requests_total")
                    and any(f'route="{r}"' in line for r in routes) and ('status="4' in line or 'status="5' in line)
                    and 'status="499"' not in line]
        assert answered == [], answered  # no 400 for a body that never arrived, and no 500
        assert _healthz_ms(srv.url) < 1000
    finally:
        srv.stop()
    log = (tmp_path / "server.log").read_text()
    assert "Traceback" not in log and " 500 " not in log, log[-3000:]
    assert log.count("disconnected before the request body was complete") == len(routes), log[-3000:]


# -- large and hostile bodies -----------------------------------------------------------------------------------

def test_a_large_rank_index_is_parsed_off_the_event_loop(tmp_path):
    n = 80_000  # 15 MB of JSON: seconds of parsing, validating and checking
    srv = _server(tmp_path, CKPTD_BODY_IDLE_TIMEOUT_SECONDS="30").start()
    try:
        data = os.urandom(4 * n)
        _upload(srv.url, "gpt", "1", data)
        body = _index(n, data)
        answer: dict = {}

        def send() -> None:
            r = httpx.put(f"{srv.url}/v1/checkpoints/gpt/1/sessions/s1/ranks/0", content=body, timeout=60,
                          headers={**_auth(), "Content-Type": "application/json"})
            answer.update(status=r.status_code, body=r.json())

        t = threading.Thread(target=send)
        t.start()
        probes = []
        while t.is_alive():
            probes.append(_healthz_ms(srv.url))
            time.sleep(0.05)
        t.join()
        assert answer["status"] == 200 and answer["body"]["state"] == "committed", answer
        assert len(probes) > 3 and max(probes) < 1000, probes
    finally:
        srv.stop()


def test_a_100_mb_rank_index_is_refused_declared_or_chunked(tmp_path):
    srv = _server(tmp_path).start()
    try:
        _upload(srv.url, "gpt", "1", b"abc")
        head = (f"PUT /v1/checkpoints/gpt/1/sessions/s1/ranks/0 HTTP/1.1\r\nHost: t\r\nAuthorization: Bearer "
                f"{ALICE}\r\nContent-Type: application/json\r\n")
        piece = b" " * (1 << 20)  # JSON whitespace: the body is refused for its size, not its content
        for framing in ("declared", "chunked"):
            s = socket.create_connection(("127.0.0.1", srv.port), timeout=10)
            t0 = time.perf_counter()
            sent = 0
            try:
                if framing == "declared":
                    s.sendall(f"{head}Content-Length: {100 << 20}\r\n\r\n".encode() + piece)
                    sent = len(piece)
                else:
                    s.sendall(f"{head}Transfer-Encoding: chunked\r\n\r\n".encode())
                    for _ in range(100):
                        s.sendall(b"%x\r\n%s\r\n" % (len(piece), piece))
                        sent += len(piece)
                    s.sendall(b"0\r\n\r\n")
            except (BrokenPipeError, ConnectionResetError):
                pass  # the service answered and closed before the whole body was sent
            got, _ = _read_all(s, 10)
            s.close()
            answers = _responses(got)
            assert answers and answers[0][0] == 413, f"{framing}: {got[:300]!r}"
            err = json.loads(answers[0][1])["error"]
            assert err["code"] == "payload_too_large" and err["details"]["limit"] < 100 << 20, err
            assert sent <= err["details"]["limit"] + (8 << 20), f"{framing}: {sent} bytes taken in"
            assert time.perf_counter() - t0 < 10
        assert _healthz_ms(srv.url) < 1000
    finally:
        srv.stop()


def test_hostile_json_on_every_json_route_is_a_4xx_in_the_error_shape(tmp_path):
    srv = _server(tmp_path).start()
    try:
        data = bytes(4096)
        _commit(srv.url, "gpt", "1", data, 1)
        deep = b"[" * 100_000 + b"]" * 100_000
        deep_obj = b'{"a":' * 20_000 + b"1" + b"}" * 20_000
        huge = b"1" + b"0" * 5000
        long = b'"' + b"a" * 60_000 + b'"'
        base = f"{srv.url}/v1/checkpoints/gpt"
        routes = {  # (method, url, token, body template with X where the hostile value goes)
            "open session": ("POST", f"{base}/2/sessions", ALICE, b'{"session": "s1", "world_size": 1, "step": X}'),
            "rank index": ("PUT", f"{base}/1/sessions/s1/ranks/0", ALICE,
                           b'{"rank": 0, "world_size": 1, "files": [], "tensors": X}'),
            "read plan": ("POST", f"{base}/1/read-plan", ALICE, b'{"requests": [{"name": "w", "offsets": [X], '
                                                                b'"sizes": [1]}]}'),
            "link": ("POST", f"{base}/1/sessions/s1/files/g.bin/link", ALICE, b'{"checkpoint": X, "file": "g.bin"}'),
            "reshard": ("POST", f"{srv.url}/v1/reshard", ROOT, b'{"source": "gpt/1", "to": X}'),
            "reshard preview": ("POST", f"{srv.url}/v1/reshard/preview", ROOT, b'{"source": "gpt/1", "to": X}'),
        }
        slow = []
        for what, (method, url, token, template) in routes.items():
            for hostile_name, hostile in (("deep array", deep), ("deep object", deep_obj), ("5,000 digits", huge),
                                          ("60,000 characters", long), ("1e400", b"1e400")):
                t0 = time.perf_counter()
                r = httpx.request(method, url, content=template.replace(b"X", hostile), timeout=30,
                                  headers={**_auth(token), "Content-Type": "application/json"})
                slow.append(time.perf_counter() - t0)
                _one_error_shape(r, f"{what} with {hostile_name}")
        assert max(slow) < 5, slow
        assert _metric(srv.url, "ckptd_http_requests_total{") > 0
        assert 'status="500"' not in httpx.get(f"{srv.url}/metrics").text
        r = httpx.get(f"{srv.url}/v1/checkpoints/gpt/1", headers=_auth())
        assert r.status_code == 200 and _healthz_ms(srv.url) < 1000
    finally:
        srv.stop()
    log = (tmp_path / "server.log").read_text()
    assert "Traceback" not in log, log[-3000:]


# -- work queued on the worker processes -------------------------------------------------------------------------

def _children(pid: int) -> int:
    """Live processes whose parent is ``pid``."""
    n = 0
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    n += int(f.read().rsplit(")", 1)[1].split()[1]) == pid
            except (OSError, IndexError, ValueError):
                pass
    return n


def test_verify_requests_in_a_loop_queue_on_the_worker_pool_and_fork_nothing_more(tmp_path):
    srv = _server(tmp_path).start()
    try:
        _commit(srv.url, "gpt", "1", bytes(4096), 1)

        def verify(_: int) -> int:
            return httpx.post(f"{srv.url}/v1/checkpoints/gpt/1/verify", headers=_auth(), timeout=60).status_code

        with cf.ThreadPoolExecutor(40) as ex:
            futures = [ex.submit(verify, i) for i in range(40)]
            peak, probes = 0, []
            while not all(f.done() for f in futures):
                peak = max(peak, _children(srv.proc.pid))
                probes.append(_healthz_ms(srv.url))
                time.sleep(0.05)
            statuses = [f.result() for f in futures]
        assert statuses == [200] * 40
        assert peak <= 2, f"{peak} child processes for 40 verifies (CKPTD_RESHARD_WORKERS=1, its resource tracker)"
        assert max(probes) < 1000, probes
        assert httpx.get(f"{srv.url}/v1/checkpoints/gpt/1/verification", headers=_auth()).json()["ok"] is True
    finally:
        srv.stop()
