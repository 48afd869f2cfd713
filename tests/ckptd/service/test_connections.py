"""Connection-level limits (:mod:`ckptd.service.connections`) in front of a real uvicorn, in this process
(a server thread on loopback, the guard wired as ``ckptd serve`` wires it), driven by raw sockets.

* the connection cap is the setting, lowered to the descriptor limit less an eighth of it (64 at
  least), never below 8; with no descriptor limit it is the setting;
* a request head over its bound is answered 431 in the service's error body and the connection
  closed; a connection that sends no complete head in time is closed; a request line the parser
  refuses is answered 400 in the service's error body (not the parser's plain text); each limit is
  counted by name;
* over the cap, a new connection closes the longest-idle other one; when every other connection
  has a request in progress whose body has arrived, the new one is kept for probes only: a probe is
  answered there and the connection closed, any other request is 503 ``Unavailable`` with
  ``Retry-After``.
"""

from __future__ import annotations

import asyncio
import json
import resource
import socket
import threading
import time

import pytest
import uvicorn
from fastapi import FastAPI, Request
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from ckptd.service import connections
from ckptd.service.connections import PROBE_PATHS, ConnectionGuard, connection_cap
from ckptd.service.errors import install_error_handlers
from ckptd.service.metrics import Metrics
from ckptd_schemas import InvalidRequest, PayloadTooLarge, Unavailable, error_from_body
from support import scaled

HEAD_BYTES = 2048
CAP = 8  # the lowest cap there is: 8 connections fill it


@pytest.mark.parametrize("soft, setting, cap", [
    (1 << 20, 10_000, 10_000),  # many descriptors: the setting
    (1024, 10_000, 1024 - 128),  # an eighth kept free
    (256, 10_000, 256 - 64),  # at least 64 kept free
    (60, 10_000, 8),  # never below 8
    (resource.RLIM_INFINITY, 123, 123),
])
def test_the_cap_is_the_setting_within_the_descriptor_limit(monkeypatch, soft, setting, cap):
    monkeypatch.setattr(connections.resource, "getrlimit", lambda _: (soft, resource.RLIM_INFINITY))
    assert connection_cap(setting) == cap


class _Server:
    """uvicorn on 127.0.0.1 with the guard, in a thread; ``/hold`` answers once ``release`` is set."""

    def __init__(self, header_timeout: float) -> None:
        self.metrics = Metrics()
        self.release = threading.Event()
        self.holding = 0
        app = FastAPI()
        install_error_handlers(app)

        @app.get("/healthz")
        async def healthz() -> dict:
            return {"status": "ok"}

        @app.get("/other")
        async def other() -> dict:
            return {}

        @app.post("/hold")
        async def hold(request: Request) -> dict:
            body = await request.body()  # the whole body has arrived: the request is busy, not receiving
            self.holding += 1
            while not self.release.is_set():
                await asyncio.sleep(0.01)
            return {"bytes": len(body)}

        self.guard = ConnectionGuard(header_timeout=header_timeout, send_timeout=scaled(30),
                                     max_header_bytes=HEAD_BYTES, max_connections=CAP, metrics=self.metrics)
        assert self.guard.cap == CAP
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        config = uvicorn.Config(self.guard.track(app), loop="asyncio", http=self.guard.protocol(HttpToolsProtocol),
                                log_config=None, log_level="warning", access_log=False, timeout_keep_alive=30,
                                lifespan="off")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    def __enter__(self) -> "_Server":
        self.thread.start()
        _until(lambda: self.server.started)
        return self

    def __exit__(self, *_: object) -> None:
        self.release.set()
        self.server.should_exit = True
        self.thread.join(scaled(10))
        self.sock.close()

    def connect(self) -> socket.socket:
        s = socket.create_connection(("127.0.0.1", self.port), timeout=scaled(10))
        _until(lambda: len(self.guard.open) >= 1)
        return s

    def refused(self, limit: str) -> float:
        return self.metrics.registry.get_sample_value("ckptd_limit_refusals_total", {"limit": limit}) or 0.0


def _until(what, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + scaled(timeout)
    while not what():
        assert time.monotonic() < deadline, "not reached in time"
        time.sleep(0.01)


def _read_all(s: socket.socket) -> bytes:
    """Everything until the server closes the connection (the test fails if it does not)."""
    out = b""
    while chunk := s.recv(65536):
        out += chunk
    return out


def _response(raw: bytes) -> tuple[int, dict[str, str], bytes]:
    head, _, body = raw.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = dict((k.lower(), v.strip()) for k, _, v in (x.partition(":") for x in lines[1:]))
    return int(lines[0].split()[1]), headers, body


@pytest.fixture
def srv():
    with _Server(header_timeout=scaled(30)) as s:  # no connection of these tests is closed for its head's time
        yield s


def test_a_head_over_the_bound_is_431_in_the_error_body(srv):
    with srv.connect() as s:
        s.sendall(b"GET /healthz HTTP/1.1\r\nHost: t\r\nX-Big: " + b"a" * (2 * HEAD_BYTES) + b"\r\n\r\n")
        status, headers, body = _response(_read_all(s))
    err = error_from_body(json.loads(body), status)
    assert status == 431 and type(err) is PayloadTooLarge and err.details == {"limit": HEAD_BYTES}
    assert headers["connection"] == "close" and srv.refused("header_bytes") == 1


def test_a_connection_without_a_complete_head_in_time_is_closed():
    with _Server(header_timeout=0.3) as srv:
        with srv.connect() as s:
            s.sendall(b"GET /healthz HTTP/1.1\r\nHost: t\r\n")  # the head never ends
            assert _read_all(s) == b""  # closed, nothing answered
        assert srv.refused("header_timeout") == 1


def test_a_request_the_parser_refuses_is_400_in_the_error_body(srv):
    with srv.connect() as s:
        s.sendall(b"NOT A REQUEST\x00\r\n\r\n")
        status, _, body = _response(_read_all(s))
    err = error_from_body(json.loads(body), status)
    assert status == 400 and type(err) is InvalidRequest and err.message.startswith("malformed HTTP request")


def test_over_the_cap_the_longest_idle_connection_makes_room(srv):
    idle = [srv.connect()]
    time.sleep(0.05)  # the first is the longest idle
    idle += [socket.create_connection(("127.0.0.1", srv.port), timeout=scaled(10)) for _ in range(CAP - 1)]
    _until(lambda: len(srv.guard.open) == CAP)
    with socket.create_connection(("127.0.0.1", srv.port), timeout=scaled(10)) as new:
        assert _read_all(idle[0]) == b""  # closed for the new one
        new.sendall(b"GET /healthz HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n")
        assert _response(_read_all(new))[0] == 200
    assert srv.refused("connections") == 1
    for s in idle:
        s.close()


def test_when_every_connection_is_busy_a_new_one_serves_probes_only(srv):
    body = b"x" * 100
    busy = [socket.create_connection(("127.0.0.1", srv.port), timeout=scaled(10)) for _ in range(CAP)]
    for s in busy:
        s.sendall(b"POST /hold HTTP/1.1\r\nHost: t\r\nContent-Length: 100\r\n\r\n" + body)
    _until(lambda: srv.holding == CAP)
    with socket.create_connection(("127.0.0.1", srv.port), timeout=scaled(10)) as probe:
        probe.sendall(b"GET /healthz HTTP/1.1\r\nHost: t\r\n\r\n")  # keep-alive asked: closed anyway
        status, headers, _ = _response(_read_all(probe))
        assert status == 200 and headers["connection"] == "close"
    with socket.create_connection(("127.0.0.1", srv.port), timeout=scaled(10)) as other:
        other.sendall(b"GET /other HTTP/1.1\r\nHost: t\r\n\r\n")
        status, headers, body = _response(_read_all(other))
        assert status == 503 and headers["retry-after"] == "1"
        assert type(error_from_body(json.loads(body), 503)) is Unavailable
    assert "/healthz" in PROBE_PATHS and srv.refused("connections") == 1  # the refused request, not the probe
    srv.release.set()
    for s in busy:
        assert _response(s.recv(65536))[0] == 200  # every request in progress was answered
        s.close()
