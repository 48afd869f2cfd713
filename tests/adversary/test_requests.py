"""No request can take the service down: an attacker with a valid token, against a real ``ckptd serve``.

* a small read-plan request that names a many-chunk tensor thousands of times is
  refused 413 at once (chunk visits and answer size are budgeted by the request's
  size), while ``/healthz`` answers; normal requests still plan;
* a zstd chunk that decodes to 1 GiB but declares 64 bytes: ``ckptd verify``
  stays small in memory and exits 1 naming the file; the load decoder refuses it;
* a connection that sends half its headers, or nothing, is closed after the head
  deadline; a body that stops arriving is answered 408 and closed;
* 1,500 idle sockets against a 1,024 file-descriptor limit: ``/healthz`` still
  answers, and the idle sockets are closed;
* one token's concurrent uploads are capped (429, retried by the client) while
  another token's upload goes through;
* a client that disconnects mid-upload is one warning and one count of
  ``ckptd_client_disconnects_total``, never a 500 or a traceback;
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

Timeouts are set to 1-3 s in each server's environment so that every test is short.
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import os
import resource
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
import xxhash
import zstandard

from ckptd.service.auth import hash_token
from ckptd_schemas.format.encoding import decode_frame
from ckptd_client.transport import Transport
from ckptd_schemas import ChecksumMismatch
from support import ServerProcess, plant_file, scaled

ALICE, BOB = "alice-token-0123456789abcdef", "bob-token-0123456789abcdef"
#: How soon ``/healthz`` answers while an attack goes on; a probe behind work on the event loop waits
#: for seconds. (A probe once the attack is over only has to answer: that is no measure of speed.)
PROBE_MS = scaled(1000)
TOKENS = f"alice sha256:{hash_token(ALICE)} write:*;bob sha256:{hash_token(BOB)} write:*"


def _server(tmp_path: Path, tokens: str = TOKENS, **env: str) -> ServerProcess:
    """A service over ``tmp_path/root`` with ``tokens`` and 2 s head and body deadlines."""
    base = {"CKPTD_TOKENS": tokens, "CKPTD_HEADER_TIMEOUT_SECONDS": "2", "CKPTD_BODY_IDLE_TIMEOUT_SECONDS": "2"}
    return ServerProcess(tmp_path / "root", env={**base, **env}, log=tmp_path / "server.log")


def _auth(token: str = ALICE) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def _open(url: str, run: str, name: str, sid: str, token: str = ALICE) -> None:
    r = httpx.post(f"{url}/v1/checkpoints/{run}/{name}/sessions", headers=_auth(token),
                   json={"session": sid, "world_size": 1, "step": 1})
    assert r.status_code == 200, r.text


def _commit(url: str, run: str, name: str, data: bytes, tensors: list[dict], token: str = ALICE) -> httpx.Response:
    """Open a session, upload ``data`` as f.bin and send rank 0's index (format-1 tensors)."""
    _open(url, run, name, "s1", token)
    r = httpx.put(f"{url}/v1/checkpoints/{run}/{name}/sessions/s1/files/f.bin", content=data,
                  headers={**_auth(token), "X-Ckptd-Xxh3": xxhash.xxh3_64_hexdigest(data)})
    assert r.status_code == 200, r.text
    index = {"rank": 0, "world_size": 1, "files": ["f.bin"], "tensors": tensors}
    return httpx.put(f"{url}/v1/checkpoints/{run}/{name}/sessions/s1/ranks/0", json=index, headers=_auth(token),
                     timeout=60)


def _chunk(offsets: list[int], sizes: list[int], offset: int, stored: bytes, raw_length: int,
           codec: str = "raw") -> dict:
    return {"kind": "box", "rank": 0, "offsets": offsets, "sizes": sizes,
            "location": {"file": "f.bin", "offset": offset, "length": len(stored), "codec": codec,
                         "raw_length": raw_length, "xxh3": xxhash.xxh3_64_hexdigest(stored)}}


def _healthz_ms(url: str) -> float:
    t0 = time.perf_counter()
    r = httpx.get(f"{url}/healthz", timeout=10)
    assert r.status_code == 200
    return (time.perf_counter() - t0) * 1000


def _never_blocked(probes: list[float], busy_s: float) -> None:
    """Each probe taken while the service worked ``busy_s`` seconds on one request answered in well under
    that work's time (and under :data:`PROBE_MS` or half of it, whichever is longer: on a loaded machine a
    probe waits for the CPU too). A probe queued behind the work on the event loop waits for nearly all of it."""
    assert probes and max(probes) < max(PROBE_MS, busy_s * 1000 / 2), (busy_s, probes)


def _closed(sock: socket.socket, within: float) -> bool:
    """True when the server closes ``sock`` (EOF or reset) within ``within`` seconds."""
    sock.settimeout(within)
    try:
        while True:
            data = sock.recv(65536)
            if not data:
                return True
    except (ConnectionResetError, BrokenPipeError):
        return True
    except socket.timeout:
        return False


def _raw(port: int, head: bytes) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", port), timeout=10)
    s.sendall(head)
    return s


def _put_head(run: str, name: str, sid: str, file: str, length: int, token: str = ALICE) -> bytes:
    return (f"PUT /v1/checkpoints/{run}/{name}/sessions/{sid}/files/{file} HTTP/1.1\r\nHost: t\r\n"
            f"Authorization: Bearer {token}\r\nX-Ckptd-Xxh3: {'0' * 16}\r\nContent-Length: {length}\r\n"
            f"\r\n").encode()


def _metric(url: str, name: str) -> float:
    text = httpx.get(f"{url}/metrics").text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name))


# -- read plans ---------------------------------------------------------------------------------------

def _commit_vector_of_single_chunks(url: str, n: int = 1024) -> int:
    """Commit ``gpt/1``: one int32 tensor ``w`` of ``n`` one-element chunks (what an ``n``-rank save of a
    vector looks like); return ``n``."""
    data = b"".join(i.to_bytes(4, "little") for i in range(n))
    chunks = [_chunk([i], [1], 4 * i, data[4 * i:4 * i + 4], 4) for i in range(n)]
    r = _commit(url, "gpt", "1", data, [{"name": "w", "shape": [n], "dtype": "int32", "group": "model",
                                         "chunks": chunks}])
    assert r.status_code == 200 and r.json()["state"] == "committed", r.text
    return n


def test_exploding_read_plan_is_refused_fast_while_healthz_answers(tmp_path):
    srv = _server(tmp_path).start()
    try:
        n = _commit_vector_of_single_chunks(srv.url)
        plan_url = f"{srv.url}/v1/checkpoints/gpt/1/read-plan"
        # normal loads pass: the whole tensor once, and 500 slices of it (512,000 chunk visits)
        r = httpx.post(plan_url, json={"requests": [{"name": "w"}]}, headers=_auth(), timeout=30)
        assert r.status_code == 200 and len(r.json()["copies"]) == n
        r = httpx.post(plan_url, json={"requests": [{"name": "w", "offsets": [i], "sizes": [1]} for i in range(500)]},
                       headers=_auth(), timeout=30)
        assert r.status_code == 200 and len(r.json()["copies"]) == 500

        attack = json.dumps({"requests": [{"name": "w"}] * 4900}).encode()  # 73 KB: 5 million chunk visits
        assert 70_000 < len(attack) < 80_000
        answer: dict = {}

        def send() -> None:
            t0 = time.perf_counter()
            try:
                resp = httpx.post(plan_url, content=attack, headers={**_auth(), "Content-Type": "application/json"},
                                  timeout=20)
                answer.update(status=resp.status_code, body=resp.json())
            except httpx.TimeoutException:
                answer.update(status="timeout")
            answer["seconds"] = time.perf_counter() - t0

        t = threading.Thread(target=send)
        t.start()
        probes = []
        while t.is_alive() and len(probes) < 200:
            probes.append(_healthz_ms(srv.url))
            time.sleep(0.05)
        t.join()
        assert answer["status"] == 413, answer
        err = answer["body"]["error"]
        assert err["code"] == "payload_too_large" and "chunks visited" in err["message"] and "limit" in err["message"]
        assert err["details"]["limit"] < err["details"]["needed"]
        assert answer["seconds"] < scaled(5), answer
        assert max(probes, default=0) < PROBE_MS, probes

        # under the chunk budget but over the answer's: 100 whole-tensor requests are 102,400 copies
        t0 = time.perf_counter()
        r = httpx.post(plan_url, json={"requests": [{"name": "w"}] * 100}, headers=_auth(), timeout=20)
        assert r.status_code == 413 and "copies" in r.json()["error"]["message"], r.text
        assert time.perf_counter() - t0 < scaled(10)
        assert _metric(srv.url, 'ckptd_limit_refusals_total{limit="read_plan"}') == 2
    finally:
        srv.stop()


def test_a_load_tree_request_is_budgeted_and_answers_only_what_the_checkpoint_holds(tmp_path):
    """The per-rank metadata route with a valid token: the same amplification (4,900 whole-tensor
    requests against a 1,024-chunk tensor) is refused 413 before any work; a tensor the checkpoint
    lacks or a region outside its shape is a typed 4xx; object names it lacks, and a thousand
    repeats of one, answer only its own entries; a rank's band is one row whatever it asks."""
    srv = _server(tmp_path).start()
    try:
        n = _commit_vector_of_single_chunks(srv.url)
        url = f"{srv.url}/v1/checkpoints/gpt/1/load-tree"
        head = httpx.get(url, headers=_auth(BOB), timeout=30)
        assert head.status_code == 200 and head.headers["X-Ckptd-Load-Tree"]
        attack = json.dumps({"requests": [{"name": "w"}] * 4900}).encode()
        r = httpx.post(url, content=attack, headers={**_auth(BOB), "Content-Type": "application/json"}, timeout=30)
        assert r.status_code == 413 and "chunks visited" in r.json()["error"]["message"], r.text[:300]
        r = httpx.post(url, json={"requests": [{"name": "nope"}]}, headers=_auth(BOB), timeout=30)
        assert 400 <= r.status_code < 500 and "nope" in r.json()["error"]["message"], r.text[:300]
        r = httpx.post(url, json={"requests": [{"name": "w", "offsets": [n], "sizes": [1]}]}, headers=_auth(BOB),
                       timeout=30)
        assert 400 <= r.status_code < 500 and r.json()["error"]["code"] == "state_dict_mismatch", r.text[:300]
        r = httpx.post(url, json={"requests": [{"name": "w", "offsets": [7], "sizes": [1]}],
                                  "objects": ["missing"] + ["w"] * 1000, "rank": 5}, headers=_auth(BOB), timeout=30)
        assert r.status_code == 200, r.text[:300]
        answer = r.json()
        assert list(answer["tensors"]["w"]["rows"]) == ["7"] and answer["objects"] == {}
        assert list(answer["files"]) == ["f.bin"]
    finally:
        srv.stop()


# -- decompression bombs --------------------------------------------------------------------------------

def _bomb(raw: int = 1 << 30) -> bytes:
    """A zstd frame of ``raw`` zero bytes (about 32 KB for 1 GiB), without its size in the header."""
    cobj = zstandard.ZstdCompressor(level=1).compressobj()
    piece = bytes(16 << 20)
    return b"".join(cobj.compress(piece) for _ in range(raw // len(piece))) + cobj.flush()


def _verify_rss(root: Path, ref: str) -> tuple[int, str, int]:
    """Run ``ckptd verify`` under a fresh parent; its exit code, output and peak RSS (KiB)."""
    probe = ("import resource, subprocess, sys\n"
             f"p = subprocess.run([sys.executable, '-m', 'ckptd.cli.main', 'verify', '--root', {str(root)!r}, "
             f"{ref!r}], capture_output=True, text=True)\n"
             "print(p.returncode, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)\n"
             "print(p.stdout + p.stderr)\n")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120).stdout
    first, _, rest = out.partition("\n")
    rc, rss = map(int, first.split())
    return rc, rest, rss


def _plant(root: Path, run: str, name: str, stored: bytes) -> None:
    """Replace the one data file of a committed one-chunk checkpoint with ``stored`` on disk, and make its
    manifest and marker agree (digests of the new bytes), as a writer with access to the root could."""
    def edit(manifest: dict) -> None:
        manifest["tensors"][0]["table"].update(length=[len(stored)], xxh3=[xxhash.xxh3_64_hexdigest(stored)])

    plant_file(root, run, name, "f.bin", stored, edit)


def test_zstd_bomb_keeps_verify_small_and_is_refused_by_the_decoder(tmp_path):
    bomb = _bomb()
    assert len(bomb) < 256 << 10
    # the load, reshard and export decoder is the commit's frame check: no content size is refused
    with pytest.raises(ChecksumMismatch, match="tensor 'model.b': zstd frame header declares no content size"):
        decode_frame(bomb, 64, "tensor 'model.b'")
    # a header that lies (64 bytes declared, 1 MiB inside) is refused without writing past 64 bytes
    liar = bytearray(zstandard.ZstdCompressor(level=1, write_content_size=True).compress(bytes(1 << 20)))
    assert zstandard.get_frame_parameters(bytes(liar)).content_size == 1 << 20 and liar[4] >> 6 == 2  # 4-byte size
    at = 5 if (liar[4] >> 5) & 1 else 6  # after the window descriptor, unless the frame is a single segment
    liar[at:at + 4] = (64).to_bytes(4, "little")
    assert zstandard.get_frame_parameters(bytes(liar)).content_size == 64
    with pytest.raises(ChecksumMismatch, match="decodes to more than the 64 bytes|does not decode"):
        decode_frame(bytes(liar), 64, "tensor 'model.b'")
    tensor = {"name": "model.b", "shape": [16], "dtype": "float32", "group": "model"}  # 16 float32: 64 bytes
    srv = _server(tmp_path).start()
    try:
        r = _commit(srv.url, "gpt", "1", bomb, [{**tensor, "chunks": [_chunk([0], [16], 0, bomb, 64, codec="zstd")]}])
        if r.status_code == 200:  # committed through HTTP with a false raw length: verify must catch it
            refs = ["gpt/1"]
        else:  # the commit checks frames; the decoder is tested on a root edited on disk
            assert r.status_code == 422 and "f.bin" in r.json()["error"]["message"], r.text
            frame = zstandard.ZstdCompressor().compress(bytes(64))
            r = _commit(srv.url, "gpt", "2", frame, [{**tensor, "chunks": [_chunk([0], [16], 0, frame, 64, "zstd")]}])
            assert r.status_code == 200, r.text
            refs = ["gpt/2"]
    finally:
        srv.stop()
    if refs == ["gpt/2"]:
        rc, out, _ = _verify_rss(tmp_path / "root", "gpt/2")
        assert rc == 0, out
        _plant(tmp_path / "root", "gpt", "2", bomb)
    rc, out, rss_kib = _verify_rss(tmp_path / "root", refs[0])
    assert rc == 1, out
    assert "f.bin" in out and "zstd frame" in out, out  # the commit's own frame check (one checker)
    assert "XXH3" not in out and "hash to" not in out, out  # the digests agree: only the decode is at fault
    assert rss_kib < 400 << 10, f"ckptd verify peaked at {rss_kib >> 10} MiB on a 32 KB frame"


# -- slow and idle connections --------------------------------------------------------------------------

def test_half_sent_headers_and_endless_bodies_are_closed(tmp_path):
    srv = _server(tmp_path).start()
    try:
        _open(srv.url, "gpt", "1", "s1")
        nothing = _raw(srv.port, b"")
        half = _raw(srv.port, b"GET /healthz HTTP/1.1\r\nHost: t\r\nX-Slow: ")
        body = _raw(srv.port, _put_head("gpt", "1", "s1", "f.bin", 1 << 20) + b"x" * 1000)
        t0 = time.perf_counter()
        for s in (nothing, half):
            assert _closed(s, 6), "a connection without a complete request head was held open"
        assert time.perf_counter() - t0 < 6
        body.settimeout(6)
        got = b""
        try:
            while b"\r\n\r\n" not in got:
                piece = body.recv(65536)
                if not piece:
                    break
                got += piece
        except socket.timeout:
            pass
        assert got.startswith(b"HTTP/1.1 408"), got[:200]
        assert b"request_timeout" in got or _closed(body, 2)
        assert _closed(body, 3)
        _healthz_ms(srv.url)  # still answering
        assert _metric(srv.url, 'ckptd_limit_refusals_total{limit="body_idle"}') == 1
        assert _metric(srv.url, 'ckptd_limit_refusals_total{limit="header_timeout"}') >= 2
        for s in (nothing, half, body):
            s.close()
    finally:
        srv.stop()


def test_idle_connections_under_a_fd_limit_leave_healthz_answering(tmp_path):
    srv = _server(tmp_path, CKPTD_HEADER_TIMEOUT_SECONDS="3")
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 2000:
        pytest.skip(f"the hard descriptor limit ({hard}) leaves no room for 1,500 client sockets")
    resource.setrlimit(resource.RLIMIT_NOFILE, (1024, hard))  # the server inherits `ulimit -n 1024`
    try:
        srv.start(wait=False)
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    socks: list[socket.socket] = []
    try:
        srv.wait_ready()
        with open(f"/proc/{srv.proc.pid}/limits") as f:
            assert any(line.startswith("Max open files") and "1024" in line for line in f)
        for _ in range(1500):
            socks.append(socket.create_connection(("127.0.0.1", srv.port), timeout=10))
        probes = [_healthz_ms(srv.url) for _ in range(3)]
        assert max(probes) < scaled(2000), probes
        deadline = time.monotonic() + scaled(15)
        open_ = list(socks)
        while open_ and time.monotonic() < deadline:
            open_ = [s for s in open_ if not _closed(s, 0.01)]
            time.sleep(0.2)
        assert not open_, f"{len(open_)} idle connections still open after the head deadline"
        _healthz_ms(srv.url)  # still answering
    finally:
        for s in socks:
            s.close()
        srv.stop()


# -- uploads ------------------------------------------------------------------------------------------------

def test_concurrent_uploads_are_capped_per_token(tmp_path):
    srv = _server(tmp_path, CKPTD_MAX_UPLOADS_PER_PRINCIPAL="2", CKPTD_BODY_IDLE_TIMEOUT_SECONDS="30").start()
    try:
        _open(srv.url, "gpt", "1", "s1")
        _open(srv.url, "gpt", "2", "s2", BOB)
        stalled = [_raw(srv.port, _put_head("gpt", "1", "s1", f"f{i}.bin", 1 << 20) + b"x" * 100) for i in range(2)]
        data = b"y" * 1000
        digest = xxhash.xxh3_64_hexdigest(data)
        deadline, k = time.monotonic() + scaled(30), 0
        while True:  # until both are in the handler, each holding one of alice's slots (one upload at a time here)
            r = httpx.put(f"{srv.url}/v1/checkpoints/gpt/1/sessions/s1/files/early-{k}.bin", content=data,
                          headers={**_auth(ALICE), "X-Ckptd-Xxh3": digest}, timeout=10)
            if r.status_code != 200 or time.monotonic() > deadline:
                break
            k += 1
            time.sleep(0.05)
        assert r.status_code == 429, r.text
        assert r.json()["error"]["code"] == "too_many_requests" and r.headers.get("retry-after")
        assert "alice" in r.json()["error"]["message"] and "2" in r.json()["error"]["message"]
        r = httpx.put(f"{srv.url}/v1/checkpoints/gpt/2/sessions/s2/files/f0.bin", content=data,
                      headers={**_auth(BOB), "X-Ckptd-Xxh3": digest})
        assert r.status_code == 200, r.text  # another token still uploads
        assert _healthz_ms(srv.url) < PROBE_MS

        # the client retries a 429 with backoff: it goes through once a slot is free
        result: dict = {}
        t = threading.Thread(target=lambda: result.update(r=Transport(srv.url, token=ALICE, retry_seconds=20).request(
            "PUT", "/v1/checkpoints/gpt/1/sessions/s1/files/f9.bin", content=lambda: data,
            headers={"X-Ckptd-Xxh3": digest})))
        t.start()
        time.sleep(1.0)
        for s in stalled:
            s.close()
        t.join(scaled(30))
        assert result.get("r", {}).get("size") == len(data), result
    finally:
        srv.stop()


def test_client_disconnect_mid_upload_is_counted_not_a_500(tmp_path):
    srv = _server(tmp_path, CKPTD_BODY_IDLE_TIMEOUT_SECONDS="30").start()
    try:
        _open(srv.url, "gpt", "1", "s1")
        s = _raw(srv.port, _put_head("gpt", "1", "s1", "f.bin", 4 << 20) + b"z" * (256 << 10))
        time.sleep(0.3)
        s.close()
        deadline = time.monotonic() + scaled(10)
        while time.monotonic() < deadline and _metric(srv.url, "ckptd_client_disconnects_total") < 1:
            time.sleep(0.1)
        assert _metric(srv.url, 'ckptd_client_disconnects_total{route="upload_file"}') == 1
        assert _metric(srv.url, 'ckptd_http_requests_total{method="PUT",route="upload_file",status="500"}') == 0
        # the same file uploads afterwards: the aborted one left nothing behind
        data = b"z" * 1000
        r = httpx.put(f"{srv.url}/v1/checkpoints/gpt/1/sessions/s1/files/f.bin", content=data,
                      headers={**_auth(), "X-Ckptd-Xxh3": xxhash.xxh3_64_hexdigest(data)})
        assert r.status_code == 200, r.text
    finally:
        srv.stop()
    log = (tmp_path / "server.log").read_text()
    assert "Traceback" not in log and "Exception in ASGI" not in log, log[-3000:]
    assert " 500 " not in log, log[-3000:]
    assert log.count("disconnected before the request body was complete") == 1, log[-3000:]


# == readers that never read, HTTP framing, hostile bodies, the worker pool ==================================

ROOT = "root-token-0123456789abcdef"
ROOT_TOKENS = f"alice sha256:{hash_token(ALICE)} write:*;root sha256:{hash_token(ROOT)} admin"


def _root_server(tmp_path: Path, **env: str) -> ServerProcess:
    return _server(tmp_path, tokens=ROOT_TOKENS, **env)


def _raw_chunk(offsets: list[int], sizes: list[int], offset: int, stored: bytes) -> dict:
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
    chunks = [_raw_chunk([i], [1], 4 * i, data[4 * i:4 * i + 4]) for i in range(n)]
    return json.dumps({"rank": 0, "world_size": 1, "files": ["f.bin"], "tensors": [
        {"name": "w", "shape": [n], "dtype": "float32", "group": "model", "chunks": chunks}]}).encode()


def _commit_n(url: str, run: str, name: str, data: bytes, n: int) -> None:
    _upload(url, run, name, data)
    r = httpx.put(f"{url}/v1/checkpoints/{run}/{name}/sessions/s1/ranks/0", content=_index(n, data), timeout=60,
                  headers={**_auth(), "Content-Type": "application/json"})
    assert r.status_code == 200 and r.json()["state"] == "committed", r.text


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


def test_pipelined_uploads_in_any_pieces_are_framed_by_their_content_length(tmp_path):
    """The guard counts a Content-Length body without parsing it and hands what follows it to a fresh
    parser: three uploads and a probe on one connection, the bodies cut at every kind of boundary
    (a body's last byte and the next head in one write, a head and the start of its body in one, the
    bodies in odd-sized pieces), are answered in order, each file stored with its own bytes; a
    request that follows a body in the same write is still held to the head bound (431)."""
    srv = _root_server(tmp_path).start()
    try:
        r = httpx.post(f"{srv.url}/v1/checkpoints/gpt/1/sessions", headers=_auth(),
                       json={"session": "s1", "world_size": 1, "step": 1})
        assert r.status_code == 200, r.text
        bodies = [os.urandom(300_000), os.urandom(70_001), os.urandom(5)]
        heads = [(f"PUT /v1/checkpoints/gpt/1/sessions/s1/files/p{i}.bin HTTP/1.1\r\nHost: t\r\nAuthorization: "
                  f"Bearer {ALICE}\r\nX-Ckptd-Xxh3: {xxhash.xxh3_64_hexdigest(b)}\r\nContent-Length: {len(b)}"
                  f"\r\n\r\n").encode() for i, b in enumerate(bodies)]
        stream = b"".join(h + b for h, b in zip(heads, bodies)) + b"GET /healthz HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n"
        s = socket.create_connection(("127.0.0.1", srv.port), timeout=10)
        cuts = [len(heads[0]) + 10, len(heads[0]) + 299_999, len(heads[0]) + 300_000 + 7]  # inside, last byte, next head
        pos = 0
        for cut in [*cuts, len(stream)]:
            while pos < cut:
                n = min(cut - pos, 65_537)
                s.sendall(stream[pos:pos + n])
                pos += n
                time.sleep(0.001)
        got, closed = _read_all(s, 10)
        s.close()
        answers = _responses(got)
        assert closed and [st for st, _ in answers] == [200, 200, 200, 200], got[-300:]
        for i, b in enumerate(bodies):
            assert json.loads(answers[i][1])["size"] == len(b)
            stored = next(tmp_path.rglob(f"sessions/s1/files/p{i}.bin"))
            assert stored.read_bytes() == b

        # After a counted body, the next head is parsed and bounded again: the body arrives in writes of
        # its own (counted, not parsed), ending exactly with a write, or with the next head's start.
        for k, (name, tail) in enumerate([("q.bin", 0), ("r.bin", 100)]):
            body = os.urandom(100_000)
            head = (f"PUT /v1/checkpoints/gpt/1/sessions/s1/files/{name} HTTP/1.1\r\nHost: t\r\nAuthorization: "
                    f"Bearer {ALICE}\r\nX-Ckptd-Xxh3: {xxhash.xxh3_64_hexdigest(body)}\r\nContent-Length: "
                    f"{len(body)}\r\n\r\n").encode()
            over = b"GET /healthz HTTP/1.1\r\nHost: t\r\nX-Pad: " + b"a" * 200_000 + b"\r\n\r\n"
            s = socket.create_connection(("127.0.0.1", srv.port), timeout=10)
            for piece in (head, body[:50_000], body[50_000:] + over[:tail], over[tail:]):
                s.sendall(piece)
                time.sleep(0.2)  # each write its own read
            got, _ = _read_all(s, 5)
            s.close()
            assert [st for st, _ in _responses(got)] == [200, 431], (k, got[-300:])
    finally:
        srv.stop()


# -- readers that never read -------------------------------------------------------------------------------

def test_readers_that_never_read_are_shed_and_timed_out_while_healthz_answers(tmp_path):
    srv = _root_server(tmp_path, CKPTD_MAX_CONNECTIONS="16", CKPTD_SEND_IDLE_TIMEOUT_SECONDS="3").start()
    stalled: list[socket.socket] = []
    try:
        data = os.urandom(8 << 20)
        _commit_n(srv.url, "gpt", "1", data, 1)  # the file only needs to exist and be committed
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
        assert max(probes) < PROBE_MS, probes
        r = httpx.get(f"{srv.url}/v1/checkpoints/gpt/1/files/f.bin", headers=_auth(), timeout=30)
        assert r.status_code == 200 and r.content == data  # a reader that reads gets the whole file
        # past the send deadline every stalled response is cut off: what was buffered, then the close
        time.sleep(max(0.0, last_opened + 3 + 1.5 - time.monotonic()))  # reading earlier would make it a reader
        for s in stalled:
            got, closed = _read_all(s, 8)
            assert closed, "a connection whose reader read nothing was held open past the send deadline"
            assert len(got) < len(data)
        assert _metric(srv.url, 'ckptd_limit_refusals_total{limit="send_idle"}') >= 1
        _healthz_ms(srv.url)  # still answering
    finally:
        for s in stalled:
            s.close()
        srv.stop()
    log = (tmp_path / "server.log").read_text()
    assert "Traceback" not in log, log[-3000:]


# -- HTTP framing ---------------------------------------------------------------------------------------------

def test_malformed_framing_is_a_json_400_and_pipelined_requests_are_answered(tmp_path):
    srv = _root_server(tmp_path).start()
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
        _healthz_ms(srv.url)  # still answering
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
    srv = _root_server(tmp_path).start()
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
            assert time.monotonic() - t0 < scaled(6), what

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
        _healthz_ms(srv.url)  # still answering
        assert _metric(srv.url, 'ckptd_limit_refusals_total{limit="header_bytes"}') == 3
    finally:
        srv.stop()


# -- clients that go away ----------------------------------------------------------------------------------------

def test_a_client_gone_mid_body_is_a_disconnect_on_every_json_route(tmp_path):
    srv = _root_server(tmp_path, CKPTD_BODY_IDLE_TIMEOUT_SECONDS="30").start()
    try:
        _commit_n(srv.url, "gpt", "1", os.urandom(4 << 20), 1)
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
        deadline = time.monotonic() + scaled(10)
        while time.monotonic() < deadline and _metric(srv.url, "ckptd_client_disconnects_total") < len(routes):
            time.sleep(0.1)
        for route in routes:
            assert _metric(srv.url, f'ckptd_client_disconnects_total{{route="{route}"}}') == 1, route
        text = httpx.get(f"{srv.url}/metrics").text
        answered = [line for line in text.splitlines() if line.startswith("ckptd_http_requests_total")
                    and any(f'route="{r}"' in line for r in routes) and ('status="4' in line or 'status="5' in line)
                    and 'status="499"' not in line]
        assert answered == [], answered  # no 400 for a body that never arrived, and no 500
        _healthz_ms(srv.url)  # still answering
    finally:
        srv.stop()
    log = (tmp_path / "server.log").read_text()
    assert "Traceback" not in log and " 500 " not in log, log[-3000:]
    assert log.count("disconnected before the request body was complete") == len(routes), log[-3000:]


# -- large and hostile bodies -----------------------------------------------------------------------------------

def test_a_large_rank_index_is_parsed_off_the_event_loop(tmp_path):
    n = 80_000  # 15 MB of JSON: seconds of parsing, validating and checking
    srv = _root_server(tmp_path, CKPTD_BODY_IDLE_TIMEOUT_SECONDS="30").start()
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
        t0 = time.monotonic()
        t.start()
        probes = []
        while t.is_alive():
            probes.append(_healthz_ms(srv.url))
            time.sleep(0.05)
        t.join()
        assert answer["status"] == 200 and answer["body"]["state"] == "committed", answer
        assert len(probes) > 3, probes
        _never_blocked(probes, time.monotonic() - t0)
    finally:
        srv.stop()


def test_a_100_mb_rank_index_is_refused_declared_or_chunked(tmp_path):
    srv = _root_server(tmp_path).start()
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
            assert time.perf_counter() - t0 < scaled(10)
        _healthz_ms(srv.url)  # still answering
    finally:
        srv.stop()


def test_hostile_json_on_every_json_route_is_a_4xx_in_the_error_shape(tmp_path):
    srv = _root_server(tmp_path).start()
    try:
        data = bytes(4096)
        _commit_n(srv.url, "gpt", "1", data, 1)
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
        assert max(slow) < scaled(5), slow
        assert _metric(srv.url, "ckptd_http_requests_total{") > 0
        assert 'status="500"' not in httpx.get(f"{srv.url}/metrics").text
        r = httpx.get(f"{srv.url}/v1/checkpoints/gpt/1", headers=_auth())
        assert r.status_code == 200
        _healthz_ms(srv.url)  # still answering
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
    srv = _root_server(tmp_path).start()
    try:
        _commit_n(srv.url, "gpt", "1", bytes(4096), 1)

        def verify(_: int) -> int:
            return httpx.post(f"{srv.url}/v1/checkpoints/gpt/1/verify", headers=_auth(), timeout=60).status_code

        with cf.ThreadPoolExecutor(40) as ex:
            t0 = time.monotonic()
            futures = [ex.submit(verify, i) for i in range(40)]
            peak, probes = 0, []
            while not all(f.done() for f in futures):
                peak = max(peak, _children(srv.proc.pid))
                probes.append(_healthz_ms(srv.url))
                time.sleep(0.05)
            statuses = [f.result() for f in futures]
            busy = time.monotonic() - t0
        assert statuses == [200] * 40
        assert peak <= 2, f"{peak} child processes for 40 verifies (CKPTD_RESHARD_WORKERS=1, its resource tracker)"
        _never_blocked(probes, busy)
        assert httpx.get(f"{srv.url}/v1/checkpoints/gpt/1/verification", headers=_auth()).json()["ok"] is True
    finally:
        srv.stop()
