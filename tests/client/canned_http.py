"""A loopback HTTP peer that answers what a test tells it to: the far end of the client's unit tests.

The client modules under test talk to the service through a real ``Transport`` over real HTTP; this
peer stands where the service (or a proxy that damages its answers) would, so that a test can give
the client answers a correct service never sends: a manifest whose bytes do not hash to its
declared digest, a header that does not parse, a load tree's head that was changed. Each request is
recorded (method, path, headers, body).

Use: ``with CannedPeer(answer) as peer: Transport(peer.url, retry_seconds=0, token="")``, where
``answer(method, path, body) -> (status, headers, body)``.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Callable

Answer = Callable[[str, str, bytes], tuple[int, dict[str, str], bytes]]

__all__ = ["Answer", "CannedPeer", "Seen"]


@dataclass
class Seen:
    method: str
    path: str
    headers: dict[str, str]
    body: bytes


class CannedPeer:
    def __init__(self, answer: Answer) -> None:
        self.answer = answer
        self.seen: list[Seen] = []
        peer = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def _serve(self) -> None:
                n = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(n) if n else b""
                peer.seen.append(Seen(self.command, self.path, dict(self.headers), body))
                status, headers, out = peer.answer(self.command, self.path, body)
                self.send_response(status)
                for k, v in headers.items():
                    self.send_header(k, v)
                self.send_header("Content-Length", str(len(out)))
                self.end_headers()
                self.wfile.write(out)

            do_GET = do_POST = do_PUT = do_DELETE = _serve

            def log_message(self, *args: object) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, args=(0.05,), name="canned-peer",
                                        daemon=True)

    def __enter__(self) -> "CannedPeer":
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._server.shutdown()
        self._server.server_close()
