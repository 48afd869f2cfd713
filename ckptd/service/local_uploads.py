"""Co-located uploads: a rank on this host hands a data file over as a sealed memory file.

A file sent over HTTP costs the service two copies of every byte inside its HTTP stack, one out of
the socket and Python work per body piece (``BENCHMARKS.md``: where the service's CPU goes). A rank
on the same host (the session's answer names this host's boot id and this socket:
``SessionInfo.local_socket``) writes the file into a memory file instead, seals it against every
change (``F_SEAL_WRITE``, ``F_SEAL_SHRINK``, ``F_SEAL_GROW``) and passes its descriptor over a Unix
socket (``SCM_RIGHTS``) with a one-line header. The rank keeps no way to change those bytes, as with
HTTP: what the service reads is what it stores and checks.

It is the HTTP upload's strategy, not a new rule: the same token rule (``auth.principal_for``), the
same write scope on the run, the same per-token upload slots, and the same intake (the token's
quota and the root's reserve asked there): the memory file,
mapped read-only, goes through ``SessionStore.begin_file`` (hashed, block digests, written past the
page cache) and ``finish`` with the declared digest; the commit's checker reads the stored bytes
back as for any upload. A descriptor that is not a memory file sealed so is refused (unsealed, the
rank could change the bytes while they are read, or shrink the file under the service's mapping).

The wire (one file per connection, a header line with the descriptor, an answer line) is
``ckptd_schemas.handover``.

Call order: ``create_app`` builds one :class:`LocalUploads` (``CKPTD_LOCAL_UPLOADS``, on by default)
and names its socket in every session's answer; the lifespan calls :meth:`start` (the socket bound
at a fresh path in the temporary directory, a thread accepting, a small pool serving; a connection
must send its header within :data:`HEADER_SECONDS`, and past :data:`MAX_CONNECTIONS` held at once a
new one is closed, so idle connections only send other ranks to HTTP) and :meth:`stop` (closed and
unlinked).
"""

from __future__ import annotations

import fcntl
import json
import logging
import mmap
import os
import socket
import stat
import tempfile
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from ckptd_schemas import CkptdError, Forbidden, InvalidRequest, check_file, check_name, check_run, check_session
from ckptd_schemas.handover import HEADER_BYTES, SEALS, boot_id

from .auth import TokenStore, principal_for
from .error_body import error_body
from .limits import UploadSlots
from .logs import access_log

if TYPE_CHECKING:
    from ..store import SessionStore
    from .metrics import Metrics

__all__ = ["LocalUploads"]

log = logging.getLogger("ckptd.service")

PIECE = 8 << 20  # bytes handed to the intake at a time
HEADER_SECONDS = 2.0  # a connection that sends no header within this is closed (a rank sends it at once)
MAX_CONNECTIONS = 64  # held at once (served or waiting); one more is closed at once: that rank uses HTTP


class LocalUploads:
    """The Unix socket of co-located uploads (module docstring)."""

    def __init__(self, sessions: "SessionStore", tokens: TokenStore, uploads: UploadSlots,
                 metrics: "Metrics | None" = None, *, workers: int = 16) -> None:
        self.sessions, self.tokens, self.uploads, self.metrics = sessions, tokens, uploads, metrics
        self.path = os.path.join(tempfile.gettempdir(), f"ckptd-{uuid.uuid4().hex[:16]}.sock")
        self.host = boot_id()
        self._sock: socket.socket | None = None
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix="ckptd-local-upload")
        self._thread: threading.Thread | None = None
        self._held = threading.BoundedSemaphore(MAX_CONNECTIONS)

    @property
    def address(self) -> str | None:
        """The socket's path while it accepts, for the session's answer; None when it does not."""
        return self.path if self._sock is not None and self.host is not None else None

    def start(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.bind(self.path)
            os.chmod(self.path, 0o666)  # who may write is decided by the token, as over HTTP on 127.0.0.1
            sock.listen(64)
        except OSError as e:
            sock.close()
            log.warning("co-located uploads off: cannot listen at %s (%s)", self.path, e)
            return
        self._sock = sock
        self._thread = threading.Thread(target=self._accept, name="ckptd-local-uploads", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        sock, self._sock = self._sock, None
        if sock is not None:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            sock.close()
            try:
                os.unlink(self.path)
            except OSError:
                pass
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _accept(self) -> None:
        while (sock := self._sock) is not None:
            try:
                conn, _ = sock.accept()
            except OSError:
                return  # closed by stop()
            if not self._held.acquire(blocking=False):  # idle connections cannot queue up the others
                conn.close()
                continue
            self._pool.submit(self._serve_held, conn)

    # -- one connection -------------------------------------------------------------------------------
    def _serve_held(self, conn: socket.socket) -> None:
        try:
            self._serve(conn)
        finally:
            self._held.release()

    def _serve(self, conn: socket.socket) -> None:
        fds: list[int] = []
        seen: dict[str, Any] = {"route": "local_upload"}  # what the access log says of it
        t0 = time.perf_counter()
        try:
            conn.settimeout(HEADER_SECONDS)
            header, fds = _receive(conn)
            if len(fds) != 1:
                raise InvalidRequest(f"a co-located upload passes one file descriptor, not {len(fds)}", field="fd")
            result = self._upload(header, fds[0], seen)
            reply: dict[str, Any] = {"status": 200, "result": result}
        except CkptdError as e:
            reply = {"status": e.status, **error_body(e)}
        except Exception as e:  # noqa: BLE001 - a bug: answered 500, logged, the service goes on
            log.exception("co-located upload failed")
            reply = {"status": 500, **error_body(CkptdError(f"internal error: {type(e).__name__}: {e}"))}
        finally:
            for fd in fds:
                os.close(fd)
        status = seen["status"] = reply["status"]
        seen["duration_ms"] = round((time.perf_counter() - t0) * 1000, 1)
        if self.metrics is not None:
            self.metrics.observe_local_upload(status, seen.get("bytes_in", 0))
        access_log.log(logging.WARNING if status >= 500 or status in (401, 403) else logging.INFO,
                       "LOCAL %s %d %.1fms", seen.get("file", "-"), status, seen["duration_ms"], extra=seen)
        try:
            conn.settimeout(HEADER_SECONDS)
            conn.sendall(json.dumps(reply, separators=(",", ":")).encode() + b"\n")
        except OSError:
            pass  # the rank went away: it sends the file over HTTP
        finally:
            conn.close()

    def _upload(self, header: dict[str, Any], fd: int, seen: dict[str, Any]) -> dict[str, Any]:
        """The file behind ``fd`` through the intake, as ``PUT .../files/{file}`` takes a body; ``seen``
        gathers what the access log says of it (run, checkpoint, file, principal, bytes)."""
        run, name, sid, file, xxh3 = (header.get(k) for k in ("run", "name", "session", "file", "xxh3"))
        if not all(isinstance(v, str) for v in (run, name, sid, file, xxh3)):
            raise InvalidRequest("a co-located upload's header names run, name, session, file and xxh3", field="header")
        seen.update(run=run[:200], checkpoint=name[:200], file=file[:200])
        check_run(run), check_name(name), check_session(sid), check_file(file)
        token = header.get("token")
        principal = principal_for(self.tokens, token if isinstance(token, str) else None)
        seen["principal"] = principal.name
        if not principal.can_write(run):
            raise Forbidden(f"token {principal.name!r} (scopes {principal.scopes}) may not write run {run!r}",
                            token=principal.name, needs=f"write:{run}")
        size = seen["bytes_in"] = _sealed_size(fd, file)
        release = self.uploads.acquire(principal.name, file)
        try:
            sink = self.sessions.begin_file(run, name, sid, file, principal)
            try:
                for at in range(0, size, PIECE):  # one piece mapped at a time: resident memory stays a piece
                    with mmap.mmap(fd, min(PIECE, size - at), flags=mmap.MAP_SHARED, prot=mmap.PROT_READ,
                                   offset=at) as mm, memoryview(mm) as piece:
                        sink.write(piece)
                return sink.finish(xxh3).model_dump(mode="json")
            except BaseException:
                sink.abort()
                raise
        finally:
            release()


def _receive(conn: socket.socket) -> tuple[dict[str, Any], list[int]]:
    """The header line and the descriptors that came with it."""
    fds: list[int] = []
    try:
        data, fds, _, _ = socket.recv_fds(conn, HEADER_BYTES, 4)
        buf = bytearray(data)
        while b"\n" not in buf:
            if not data or len(buf) >= HEADER_BYTES:
                raise InvalidRequest(f"a co-located upload starts with a header line of at most {HEADER_BYTES} "
                                     f"bytes", field="header")
            data = conn.recv(HEADER_BYTES - len(buf))
            buf += data
        header = json.loads(bytes(buf[:buf.index(b"\n")]))
    except (OSError, ValueError, InvalidRequest) as e:
        for fd in fds:
            os.close(fd)
        if isinstance(e, InvalidRequest):
            raise
        raise InvalidRequest(f"a co-located upload's header did not arrive whole: {e}", field="header") from None
    if not isinstance(header, dict):
        for fd in fds:
            os.close(fd)
        raise InvalidRequest("a co-located upload's header is a JSON object", field="header")
    return header, list(fds)


def _sealed_size(fd: int, file: str) -> int:
    """The size of the memory file ``fd``; :class:`InvalidRequest` unless it is a regular memory file
    sealed against writes, shrinking and growth."""
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        raise InvalidRequest(f"file {file!r}: a co-located upload passes a memory file, not this descriptor",
                             file=file)
    try:
        seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
    except OSError:
        seals = 0  # not a memory file (sealing is theirs alone)
    if seals & SEALS != SEALS:
        raise InvalidRequest(f"file {file!r}: the memory file passed is not sealed against writes, shrinking and "
                             f"growth (F_SEAL_WRITE, F_SEAL_SHRINK, F_SEAL_GROW): its bytes could change while "
                             f"they are read", file=file)
    return st.st_size
