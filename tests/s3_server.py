"""A real S3 protocol server on loopback for the tests: moto in server mode, plus a fault proxy.

:class:`MotoServer` runs ``python -m moto.server`` on 127.0.0.1 at a free port,
creates a bucket and gives the standard AWS environment that points a client
at it (:attr:`MotoServer.env`). :class:`FaultProxy` sits between a client and
the server and answers chosen requests with S3 errors (503 SlowDown, 500
InternalError, 409 ...) a set number of times, forwarding everything else.
"""

from __future__ import annotations

import http.client
import os
import socket
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Callable

from support import stop_process

__all__ = ["FaultProxy", "FaultRule", "MotoServer", "aws_env", "pending_uploads"]

BUCKET = "ckptd-test"


def pending_uploads(st, prefix: str = "") -> list[str]:
    """Keys (relative to the root) of the multipart uploads in flight under ``prefix`` of the S3 root ``st``:
    what a finished or aborted write must leave none of (the tests' few, on one page of the listing)."""
    root = f"{st._prefix}/" if st._prefix else ""
    out = st.fs.call_s3("list_multipart_uploads", Bucket=st.bucket, Prefix=st._dir(prefix))
    assert not out.get("IsTruncated")
    return sorted(u["Key"][len(root):] for u in out.get("Uploads") or ())


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def aws_env(endpoint: str, *, var: str = "AWS_ENDPOINT_URL_S3") -> dict[str, str]:
    """The standard AWS environment for a test endpoint: fixed credentials, no profile, no IMDS."""
    return {
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
        var: endpoint,
        "AWS_CONFIG_FILE": os.devnull,
        "AWS_SHARED_CREDENTIALS_FILE": os.devnull,
        "AWS_EC2_METADATA_DISABLED": "true",
    }


# Variables that would point a client elsewhere than the test server.
AWS_VARS_TO_CLEAR = ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_SECURITY_TOKEN", "AWS_ENDPOINT_URL",
                     "AWS_ENDPOINT_URL_S3", "AWS_IGNORE_CONFIGURED_ENDPOINT_URLS", "AWS_MAX_ATTEMPTS",
                     "AWS_RETRY_MODE", "AWS_REGION")


def child_env(extra: dict[str, str]) -> dict[str, str]:
    """os.environ without stray AWS settings, plus ``extra``: for subprocesses."""
    env = {k: v for k, v in os.environ.items() if k not in AWS_VARS_TO_CLEAR}
    env.update(extra)
    return env


class MotoServer:
    """``python -m moto.server`` on 127.0.0.1, with one bucket created."""

    def __init__(self, log: Path, bucket: str = BUCKET) -> None:
        self.log = Path(log)
        self.bucket = bucket
        self.port = 0
        self.proc: subprocess.Popen | None = None

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def env(self) -> dict[str, str]:
        return aws_env(self.endpoint)

    def url(self, prefix: str | None = None) -> str:
        """``s3://bucket/<prefix>``; a fresh unique prefix by default."""
        return f"s3://{self.bucket}/{prefix or 'p-' + uuid.uuid4().hex[:12]}"

    def start(self, timeout: float = 60.0) -> "MotoServer":
        self.log.parent.mkdir(parents=True, exist_ok=True)
        last = ""
        for _ in range(3):  # the free port may be taken between the probe and moto's bind
            self.port = _free_port()
            logf = open(self.log, "ab")
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)],
                stdout=logf, stderr=subprocess.STDOUT, env=child_env({}), start_new_session=True)
            logf.close()
            try:
                self._wait_ready(timeout)
                self.client().create_bucket(Bucket=self.bucket)
            except Exception as e:  # noqa: BLE001 - retried on another port, reported below
                last = f"{type(e).__name__}: {e}"
                self.stop()
                continue
            self._check_conditional_put()
            return self
        raise RuntimeError(f"moto server did not start: {last}\n{self.log.read_text()[-3000:]}")

    def _check_conditional_put(self) -> None:
        """The commit marker relies on ``If-None-Match: *``; older moto releases ignore it."""
        from botocore.exceptions import ClientError

        c, key = self.client(), f"probe-{uuid.uuid4().hex}"
        c.put_object(Bucket=self.bucket, Key=key, Body=b"1", IfNoneMatch="*")
        try:
            c.put_object(Bucket=self.bucket, Key=key, Body=b"2", IfNoneMatch="*")
        except ClientError as e:
            if e.response["ResponseMetadata"]["HTTPStatusCode"] == 412:
                c.delete_object(Bucket=self.bucket, Key=key)
                return
            raise
        import moto

        self.stop()
        raise RuntimeError(f"moto {moto.__version__} does not enforce PutObject If-None-Match: * (a conditional "
                           f"PUT overwrote the object); upgrade moto")

    def _wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise RuntimeError(f"moto server exited with {self.proc.returncode}")
            try:
                conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=2)
                conn.request("GET", "/moto-api/")
                conn.getresponse().read()
                conn.close()
                return
            except OSError:
                time.sleep(0.1)
        raise TimeoutError(f"moto server on port {self.port} not ready in {timeout}s")

    def client(self, endpoint: str | None = None):
        """A plain boto3 client on the server (for checks and set-up, not the code under test)."""
        import boto3
        from botocore.config import Config

        return boto3.client("s3", endpoint_url=endpoint or self.endpoint, aws_access_key_id="testing",
                            aws_secret_access_key="testing", region_name="us-east-1",
                            config=Config(retries={"max_attempts": 1, "mode": "standard"}))

    def clear(self, prefix: str) -> None:
        """Delete every object and multipart upload under ``prefix`` (a test's root)."""
        c = self.client()
        pages = c.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=prefix.rstrip("/") + "/")
        for page in pages:
            keys = [{"Key": o["Key"]} for o in page.get("Contents") or ()]
            if keys:
                c.delete_objects(Bucket=self.bucket, Delete={"Objects": keys, "Quiet": True})
        for u in c.list_multipart_uploads(Bucket=self.bucket, Prefix=prefix.rstrip("/") + "/").get("Uploads") or ():
            c.abort_multipart_upload(Bucket=self.bucket, Key=u["Key"], UploadId=u["UploadId"])

    def stop(self) -> None:
        stop_process(self.proc)
        self.proc = None


# -- fault injection ----------------------------------------------------------------------------

@dataclass
class FaultRule:
    """Answer up to ``times`` requests that ``match(method, path, query)`` with ``status``/``code``.

    ``forward``: the request reaches the server first and only its response is replaced (a
    success the client never hears of, as when a connection drops after the server acted).
    """

    match: Callable[[str, str, str], bool]
    status: int = 503
    code: str = "SlowDown"
    times: int = 1
    forward: bool = False
    hits: int = 0
    seen: list[str] = field(default_factory=list)


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: "_ProxyServer"

    def log_message(self, *_: object) -> None:  # quiet
        pass

    def _body(self) -> bytes:
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            out = bytearray()
            while True:
                size = int(self.rfile.readline().split(b";")[0].strip() or b"0", 16)
                if size == 0:
                    while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                        pass
                    return bytes(out)
                out += self.rfile.read(size)
                self.rfile.readline()
        n = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(n) if n else b""

    def _handle(self) -> None:
        body = self._body()
        if self.server.delay:
            time.sleep(self.server.delay)  # a remote store's round trip
        path, _, query = self.path.partition("?")
        copy = " copy-source=" + self.headers["x-amz-copy-source"] if "x-amz-copy-source" in self.headers else ""
        self.server.log.append(f"{self.command} {self.path}{copy}")
        with self.server.lock:
            rule = next((r for r in self.server.rules if r.hits < r.times and r.match(self.command, path, query)),
                        None)
            if rule is not None:
                rule.hits += 1
                rule.seen.append(f"{self.command} {self.path}")
        if rule is not None:
            if rule.forward:
                self._forward(body)
            xml = (f'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>{rule.code}</Code>'
                   f'<Message>injected by the test proxy</Message><RequestId>fault</RequestId></Error>').encode()
            self.send_response(rule.status)
            self.send_header("Content-Type", "application/xml")
            self.send_header("Content-Length", str(len(xml)))
            self.send_header("Connection", "close")
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(xml)
            self.close_connection = True
            return
        status, reason, resp_headers, data = self._forward(body)
        self.send_response(status, reason)
        for k, v in resp_headers:
            if k.lower() not in ("transfer-encoding", "connection", "content-length", "server", "date"):
                self.send_header(k, v)
        # HEAD: the object's length, as the server said; otherwise the body's.
        length = dict((k.lower(), v) for k, v in resp_headers).get("content-length", "0") \
            if self.command == "HEAD" else str(len(data))
        self.send_header("Content-Length", length)
        self.send_header("Connection", "close")
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(data)
        self.close_connection = True

    def _forward(self, body: bytes) -> tuple[int, str, list[tuple[str, str]], bytes]:
        headers = {k: v for k, v in self.headers.items() if k.lower() not in ("transfer-encoding", "connection")}
        if body or self.command in ("PUT", "POST"):
            headers["Content-Length"] = str(len(body))
        conn = http.client.HTTPConnection("127.0.0.1", self.server.upstream_port, timeout=60)
        try:
            conn.request(self.command, self.path, body=body, headers=headers)
            resp = conn.getresponse()
            return resp.status, resp.reason, resp.getheaders(), resp.read()
        finally:
            conn.close()

    do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _handle


class _ProxyServer(ThreadingHTTPServer):
    daemon_threads = True
    upstream_port: int
    rules: list[FaultRule]
    log: list[str]
    lock: threading.Lock
    delay: float


class FaultProxy:
    """A loopback HTTP proxy in front of :class:`MotoServer` that injects S3 errors by rule, and
    ``delay`` seconds before every request it forwards (a remote store's round trip)."""

    def __init__(self, upstream: MotoServer, *, delay: float = 0.0) -> None:
        self._srv = _ProxyServer(("127.0.0.1", 0), _Handler)
        self._srv.upstream_port = upstream.port
        self._srv.delay = delay
        self._srv.rules = []
        self._srv.log = []
        self._srv.lock = threading.Lock()
        self._thread = threading.Thread(target=self._srv.serve_forever, name="s3-fault-proxy", daemon=True)

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self._srv.server_address[1]}"

    @property
    def log(self) -> list[str]:
        return self._srv.log

    def add(self, rule: FaultRule) -> FaultRule:
        self._srv.rules.append(rule)
        return rule

    def __enter__(self) -> "FaultProxy":
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._srv.shutdown()
        self._srv.server_close()
