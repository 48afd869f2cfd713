"""Co-located uploads, the rank's side: a data file handed to a service on this host as a sealed memory file.

Used by ``upload_files`` when the session's answer names a Unix socket (``SessionInfo.local_socket``)
and this rank runs on the service's host (``local_host``, the boot id, is this kernel's). Per file:
the bytes written into a fresh memory file (``memfd_create``: one copy, as into a socket), sealed
against every change (``F_SEAL_WRITE | F_SEAL_SHRINK | F_SEAL_GROW``, then ``F_SEAL_SEAL``), its
descriptor passed over the socket with a one-line header (the bearer token, the session and the
file's XXH3); the service answers as ``PUT .../files/{file}`` does (``ckptd.service.local_uploads``;
the wire: ``ckptd_schemas.handover``).

Why: over HTTP the service copies every byte twice inside its HTTP stack and once out of the socket;
handed over, it maps the file and reads it once (``BENCHMARKS.md``: the service's CPU per GiB).
Fallbacks, so that this path never fails a save that HTTP would pass: a socket that cannot be reached
(another container, the service restarted) turns it off for the rest of the save; an answer that
HTTP would retry (429, 5xx) sends that file over HTTP; any other refusal is the service's verdict on
the file and is raised as its typed error, as over HTTP.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import socket
from typing import Callable, Iterable

from ckptd_schemas import CkptdError, error_from_body
from ckptd_schemas.handover import SEALS, boot_id

from .transport import RETRY_STATUS

__all__ = ["LocalHandover"]

log = logging.getLogger("ckptd_client")

_SEALS = SEALS | fcntl.F_SEAL_SEAL  # and no seal taken off: none can be
_IOV = 512  # pieces per pwritev


class LocalHandover:
    """One save's co-located uploads, shared by the rank's upload threads; ``enabled`` turns False when
    the socket cannot be reached."""

    def __init__(self, socket_path: str, run: str, name: str, session: str, token: str | None,
                 timeout: float) -> None:
        self.path, self.run, self.name, self.session = socket_path, run, name, session
        self.token, self.timeout = token, timeout
        self.enabled = hasattr(os, "memfd_create")

    @classmethod
    def offered(cls, socket_path: str | None, host: str | None, run: str, name: str, session: str,
                token: str | None, timeout: float) -> "LocalHandover | None":
        """The handover the session's answer offers, when this rank shares the service's kernel."""
        if not socket_path or not host or host != boot_id():
            return None
        return cls(socket_path, run, name, session, token, timeout)

    def put(self, file: str, size: int, xxh3: str, pieces: Callable[[], Iterable[bytes | memoryview]]) -> bool:
        """Hand ``file`` over; True when the service stored it, False when it goes over HTTP instead."""
        try:
            fd = os.memfd_create(f"ckptd-{file}", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        except OSError as e:
            return self._off(f"no memory file: {e}")
        try:
            os.ftruncate(fd, size)
            at, batch = 0, []
            for p in pieces():
                batch.append(p)
                if len(batch) == _IOV:
                    at = _write(fd, batch, at)
                    batch = []
            at = _write(fd, batch, at)
            if at != size:
                raise CkptdError(f"file {file!r}: {at} bytes packed, {size} declared")
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, _SEALS)
            reply = self._send(file, xxh3, fd)
        except OSError as e:  # the socket or the memory: this save's other files go over HTTP too
            return self._off(f"{type(e).__name__}: {e}")
        finally:
            os.close(fd)
        status = int(reply.get("status", 500)) if isinstance(reply, dict) else 500
        if status == 200:
            return True
        if status in RETRY_STATUS:  # what the HTTP transport would retry: that file goes over HTTP
            log.info("co-located upload of %s answered %d: sent over HTTP", file, status)
            return False
        raise error_from_body(reply, status)

    def _send(self, file: str, xxh3: str, fd: int) -> dict:
        header = {"token": self.token, "run": self.run, "name": self.name, "session": self.session, "file": file,
                  "xxh3": xxh3}
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(self.timeout)
            s.connect(self.path)
            socket.send_fds(s, [json.dumps(header).encode() + b"\n"], [fd])
            buf = bytearray()
            while b"\n" not in buf:
                data = s.recv(1 << 16)
                if not data:
                    raise ConnectionResetError("the service closed the socket before it answered")
                buf += data
        return json.loads(bytes(buf[:buf.index(b"\n")]))

    def _off(self, why: str) -> bool:
        if self.enabled:
            log.info("co-located uploads off for this save (%s): files go over HTTP", why)
        self.enabled = False
        return False


def _write(fd: int, batch: list, at: int) -> int:
    """``batch`` written at ``at`` (whole: ``pwritev`` may write less), the offset after it."""
    views = [memoryview(p).cast("B") for p in batch]
    while views:
        n = os.pwritev(fd, views, at)
        at += n
        while views and n >= len(views[0]):
            n -= len(views[0])
            views.pop(0)
        if views and n:
            views[0] = views[0][n:]
    return at
