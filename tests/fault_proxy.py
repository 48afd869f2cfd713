"""A loopback TCP proxy that cuts one connection on purpose, for the fault tests.

:class:`CutProxy` relays bytes between clients and an upstream ``host:port``
unchanged, one thread per connection. It watches the request lines that go
upstream; the first request whose line matches ``pattern`` is cut once:

* ``mode="request"``: after ``after_bytes`` bytes of that request went
  upstream (the connection dies mid-stream, the server never sees the end of
  the body);
* ``mode="response"``: when the server's answer to that request arrives (the
  request was served in full, the client never hears about it).

Cutting closes both sockets with ``SO_LINGER`` 0 (a TCP reset). Every other
connection, and every later request, is relayed as is.
"""

from __future__ import annotations

import re
import select
import socket
import struct
import threading

__all__ = ["CutProxy"]

_REQUEST_LINE = re.compile(rb"(GET|PUT|POST|DELETE|HEAD) (/[^ \r\n]*) HTTP/1\.[01]\r\n")


class CutProxy:
    def __init__(self, upstream_port: int, pattern: str, *, mode: str = "request", after_bytes: int = 0,
                 upstream_host: str = "127.0.0.1") -> None:
        assert mode in ("request", "response")
        self.upstream = (upstream_host, upstream_port)
        self.pattern = re.compile(pattern)
        self.mode, self.after_bytes = mode, after_bytes
        self.requests: list[str] = []     # "METHOD /path" of every request relayed (or cut)
        self.cuts: list[str] = []         # the request that was cut, with where
        self._lock = threading.Lock()
        self._armed = True
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._closing = False
        self._threads: list[threading.Thread] = []
        self._accept = threading.Thread(target=self._accept_loop, name="cut-proxy", daemon=True)

    @property
    def port(self) -> int:
        return self._listener.getsockname()[1]

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> "CutProxy":
        self._accept.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._closing = True
        self._listener.close()
        for t in self._threads:
            t.join(5)

    # -- internals ---------------------------------------------------------------------------
    def _accept_loop(self) -> None:
        while not self._closing:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            t = threading.Thread(target=self._relay, args=(client,), daemon=True)
            self._threads.append(t)
            t.start()

    def _take(self, line: str) -> bool:
        """Record a request line; True when it is the one to cut (only once)."""
        with self._lock:
            self.requests.append(line)
            if self._armed and self.pattern.search(line):
                self._armed = False
                return True
            return False

    def _relay(self, client: socket.socket) -> None:
        try:
            upstream = socket.create_connection(self.upstream)
        except OSError:
            client.close()
            return
        window = b""            # the tail of the upstream bytes not yet scanned for request lines
        target: str | None = None
        sent_of_target = 0
        try:
            while not self._closing:
                ready, _, _ = select.select([client, upstream], [], [], 0.2)
                for sock in ready:
                    data = sock.recv(1 << 16)
                    if not data:
                        return
                    if sock is client:
                        buf = window + data
                        end, in_chunk = 0, None
                        for m in _REQUEST_LINE.finditer(buf):
                            line = f"{m.group(1).decode()} {m.group(2).decode()}"
                            if self._take(line):
                                target, sent_of_target, in_chunk = line, 0, len(buf) - m.end()
                            elif target is not None:
                                target = None  # the target request ended whole; this is the next one
                            end = m.end()
                        window = buf[end:][-4096:]
                        if target is not None and self.mode == "request":
                            of_target = len(data) if in_chunk is None else in_chunk
                            if sent_of_target + of_target > self.after_bytes:
                                self.cuts.append(f"{target} after {sent_of_target} bytes of it went upstream")
                                return
                            sent_of_target += of_target
                        upstream.sendall(data)
                    else:
                        if target is not None and self.mode == "response":
                            self.cuts.append(f"{target}: its response dropped")
                            return
                        client.sendall(data)
        except OSError:
            return
        finally:
            for s in (client, upstream):
                try:
                    s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                except OSError:
                    pass
                s.close()
