"""Co-located uploads, the rank's side: a data file handed to a service on this host as a sealed memory file.

Used by ``upload_files`` when the session's answer names a Unix socket (``SessionInfo.local_socket``)
and its key (``local_key``) and this rank runs on the service's host (``local_host``, the boot id, is
this kernel's). Per file: the bytes written into a fresh memory file (``memfd_create``: one copy, as
into a socket), sealed against every change (``F_SEAL_WRITE | F_SEAL_SHRINK | F_SEAL_GROW``, then
``F_SEAL_SEAL``); then a connection: a hello (the session, a nonce; no token), the peer's proof of the
session's key checked, and only then the header (this rank's proof, the file, its size and XXH3) with
the descriptor; the service answers as ``PUT .../files/{file}`` does (``ckptd.service.local_uploads``;
the wire: ``ckptd_schemas.handover``).

Why: over HTTP the service copies every byte twice inside its HTTP stack and once out of the socket;
handed over, it reads the file once (``BENCHMARKS.md``: the service's CPU per GiB).
Fallbacks, so that this path never fails a save that HTTP would pass nor gives anything to a peer that
is not the service: a socket that cannot be reached (another container, the service restarted), or a
peer that does not prove the key (a listener planted at the path), turns it off for the rest of the
save, said once in the log; an answer that HTTP would retry (429, 5xx) sends that file over HTTP; any
other refusal is the service's verdict on the file and is raised as its typed error, as over HTTP.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import socket
import threading
import time
from typing import Callable, Iterable

from ckptd_schemas import CkptdError, error_from_body
from ckptd_schemas.handover import SEALS, boot_id, is_nonce, new_nonce, prove, proven, split_key

from .transport import RETRY_STATUS

__all__ = ["PROOF_SECONDS", "LocalHandover"]

log = logging.getLogger("ckptd_client")

_SEALS = SEALS | fcntl.F_SEAL_SEAL  # and no seal taken off: none can be
_IOV = 512  # pieces per pwritev
#: The longest a rank waits for the service's proof (its answer to the hello, queued behind the service's
#: other handovers): a listener at the path that never answers costs a save this much once, not its timeout.
PROOF_SECONDS = 30.0


class _NotTheService(Exception):
    """The peer at the socket's path did not prove the session's key: it gets nothing more."""


class LocalHandover:
    """One save's co-located uploads, shared by the rank's upload threads; ``enabled`` turns False when
    the socket cannot be reached or its peer is not the service."""

    def __init__(self, socket_path: str, run: str, name: str, session: str, principal: str, key: str,
                 timeout: float) -> None:
        self.path, self.run, self.name, self.session = socket_path, run, name, session
        self.principal, self.key, self.timeout = principal, key, timeout
        self.enabled = hasattr(os, "memfd_create")
        self._lock = threading.Lock()

    @classmethod
    def offered(cls, socket_path: str | None, host: str | None, key: str | None, run: str, name: str,
                session: str, timeout: float) -> "LocalHandover | None":
        """The handover the session's answer offers, when this rank shares the service's kernel and the
        answer gave a key (a service without one would ask for a token: HTTP instead)."""
        if not socket_path or not host or host != boot_id() or not key or (keyed := split_key(key)) is None:
            return None
        return cls(socket_path, run, name, session, *keyed, timeout)

    def put(self, file: str, size: int, xxh3: str, pieces: Callable[[], Iterable[bytes | memoryview]],
            declared: bytes = b"") -> bool:
        """Hand ``file`` over, its chunks' ``declared`` bytes first (``ckptd_schemas.arrival``); True when the
        service stored it, False when it goes over HTTP instead."""
        try:
            fd = os.memfd_create(f"ckptd-{file}", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        except OSError as e:
            return self._off(f"no memory file: {e}")
        try:
            os.ftruncate(fd, len(declared) + size)
            at, batch = 0, [declared] if declared else []
            for p in pieces():
                batch.append(p)
                if len(batch) == _IOV:
                    at = _write(fd, batch, at)
                    batch = []
            at = _write(fd, batch, at)
            if at != len(declared) + size:
                raise CkptdError(f"file {file!r}: {at - len(declared)} bytes packed, {size} declared")
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, _SEALS)
            reply = self._send(file, size, xxh3, fd, len(declared))
        except _NotTheService as e:  # nothing was given to it: this save's files go over HTTP
            return self._off(str(e), logging.WARNING)
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

    def _send(self, file: str, size: int, xxh3: str, fd: int, chunks: int) -> dict:
        """One connection (``ckptd_schemas.handover``): the hello, the service's proof checked, then the
        header with ``fd``; the service's answer. :class:`_NotTheService` before anything but the hello
        went out when the peer does not prove the session's key."""
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(self.timeout)
            s.connect(self.path)
            ours = new_nonce()
            s.sendall(_line({"principal": self.principal, "run": self.run, "name": self.name,
                             "session": self.session, "nonce": ours}))
            buf = bytearray()
            challenge = _read_line(s, buf, time.monotonic() + min(self.timeout, PROOF_SECONDS))
            theirs = challenge.get("nonce") if isinstance(challenge, dict) else None
            if not isinstance(challenge, dict) or not proven(self.key, "service", ours, challenge.get("proof")) \
                    or not is_nonce(theirs):
                raise _NotTheService(f"the peer at {self.path} did not prove it is the service that answered the "
                                     f"session over HTTP")
            header = {"proof": prove(self.key, "rank", theirs), "file": file, "size": size, "xxh3": xxh3}
            socket.send_fds(s, [_line({**header, "chunks": chunks} if chunks else header)], [fd])
            return _read_line(s, buf, time.monotonic() + self.timeout)

    def _off(self, why: str, level: int = logging.INFO) -> bool:
        with self._lock:  # said once per save, whichever upload thread finds it first
            if self.enabled:
                log.log(level, "co-located uploads off for this save (%s): files go over HTTP", why)
            self.enabled = False
        return False


def _line(value: dict) -> bytes:
    return json.dumps(value, separators=(",", ":")).encode() + b"\n"


def _read_line(s: socket.socket, buf: bytearray, deadline: float) -> dict:
    """The next line of ``s`` as JSON (None for one that is not), within ``deadline``; what follows it
    stays in ``buf``. A line longer than any answer, or an early close, raises ``ConnectionError``."""
    while b"\n" not in buf:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("the service did not answer in time")
        s.settimeout(left)
        data = s.recv(1 << 16)
        if not data:
            raise ConnectionResetError("the peer closed the socket before it answered")
        buf += data
        if len(buf) > (1 << 20):  # an answer is an error body at most; a peer that floods is not the service
            raise ConnectionError("the peer sent a line longer than any answer")
    cut = buf.index(b"\n")
    line = bytes(buf[:cut])
    del buf[:cut + 1]
    try:
        return json.loads(line)
    except ValueError:
        return None  # type: ignore[return-value]


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
