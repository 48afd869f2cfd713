"""Co-located uploads: a rank on this host hands a data file over as a sealed memory file.

A file sent over HTTP costs the service two copies of every byte inside its HTTP stack, one out of
the socket and Python work per body piece (``BENCHMARKS.md``: where the service's CPU goes). A rank
on the same host (the session's answer names this host's boot id and this socket:
``SessionInfo.local_socket``) writes the file into a memory file instead, seals it against every
change (``F_SEAL_WRITE``, ``F_SEAL_SHRINK``, ``F_SEAL_GROW``) and passes its descriptor over a Unix
socket (``SCM_RIGHTS``). The rank keeps no way to change those bytes, as with HTTP: what the service
reads is what it stores and checks.

The socket trusts a key, not a token: the session's answer gives its writer ``local_key``
(:meth:`LocalUploads.key_for`: this process's random secret and the principal's token over the
principal, run, name and session),
and each side proves it holds that key to the other before anything is handed over
(``ckptd_schemas.handover``: the wire). The rank thus gives nothing to a listener that is not this
service (a path freed by a restart, or planted where this service's temporary directory is private),
and what crosses the socket authorizes only that principal's uploads to that session; the principal
is then looked up again (the tokens file may have changed) and must still have write on the run.

The rest is the HTTP upload's: the same per-principal upload slots, and the same intake (the
principal's quota and the root's reserve asked there): the memory
file, read a window at a time into one buffer (never mapped: reading a hole of a sparse memory file
allocates nothing), goes through ``SessionStore.intake.receive`` (hashed, block digests, written past the
page cache) and ``finish`` with the declared digest; the commit's checker reads the stored bytes back
as for any upload. A descriptor that is not a memory file sealed so, not open for reading, or of
another size than declared is refused 400 before a byte is read (unsealed, the rank could change the
bytes while they are read).

Call order: ``create_app`` builds one :class:`LocalUploads` (``CKPTD_LOCAL_UPLOADS``, on by default)
and names its socket and a session key in every session's answer; the lifespan calls :meth:`start`
(the socket bound at a fresh path in the temporary directory, a thread accepting, a small pool
serving; a connection must send its hello and header, whole, within :data:`HEADER_SECONDS` of being
served, and past :data:`MAX_CONNECTIONS` held at once a new one is closed, so idle connections only
send other ranks to HTTP) and :meth:`stop` (closed and unlinked).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import secrets
import socket
import stat
import tempfile
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from ckptd_schemas import (
    CkptdError, Forbidden, InvalidRequest, Unauthorized, check_file, check_name, check_run, check_session,
)
from ckptd_schemas import arrival
from ckptd_schemas.handover import HEADER_BYTES, SEALS, boot_id, is_nonce, new_nonce, prove, proven, session_key

from .auth import TokenStore, principal_named, token_named
from .error_body import error_body
from .limits import UploadSlots
from .logs import access_log

if TYPE_CHECKING:
    from ..store import SessionStore
    from .metrics import Metrics

__all__ = ["LocalUploads"]

log = logging.getLogger("ckptd.service")

PIECE = 8 << 20  # the read window: bytes read into the buffer and handed to the intake at a time
HEADER_SECONDS = 2.0  # a connection's hello and header, whole, arrive within this (a rank sends them at once)
MAX_CONNECTIONS = 64  # held at once (served or waiting); one more is closed at once: that rank uses HTTP
_XXH3 = frozenset("0123456789abcdefABCDEF")


class LocalUploads:
    """The Unix socket of co-located uploads (module docstring)."""

    def __init__(self, sessions: "SessionStore", tokens: TokenStore, uploads: UploadSlots,
                 metrics: "Metrics | None" = None, *, workers: int = 16) -> None:
        self.sessions, self.tokens, self.uploads, self.metrics = sessions, tokens, uploads, metrics
        self.path = os.path.join(tempfile.gettempdir(), f"ckptd-{uuid.uuid4().hex[:16]}.sock")
        self.host = boot_id()
        self._secret = secrets.token_bytes(32)  # this process's: a restarted service's keys are new ones
        self._sock: socket.socket | None = None
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix="ckptd-local-upload")
        self._thread: threading.Thread | None = None
        self._held = threading.BoundedSemaphore(MAX_CONNECTIONS)
        self._buffers = threading.local()  # each worker's read window, reused for every file it reads

    @property
    def address(self) -> str | None:
        """The socket's path while it accepts, for the session's answer; None when it does not."""
        return self.path if self._sock is not None and self.host is not None else None

    def key_for(self, principal: str, run: str, name: str, session: str) -> str:
        """``SessionInfo.local_key``: what ``principal`` proves itself with here for its uploads to this
        session, and what proves this service to it (given only in an HTTP answer to that principal).
        Keyed with the principal's token as well: a token replaced under the same name ends its keys."""
        return session_key(self._secret + token_named(self.tokens, principal), principal, run, name, session)

    def start(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.bind(self.path)
            os.chmod(self.path, 0o666)  # who may hand a file over is decided by the session key
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
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()
            with contextlib.suppress(OSError):
                os.unlink(self.path)
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _accept(self) -> None:
        failing = False
        while (sock := self._sock) is not None:
            try:
                conn, _ = sock.accept()
            except OSError as e:
                if self._sock is not sock:
                    return  # closed by stop()
                if not failing:  # once per spell: out of descriptors (EMFILE) until connections close theirs
                    log.warning("co-located uploads: accept failed (%s); accepting again as it clears", e)
                failing = True
                time.sleep(0.1)
                continue
            failing = False
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
        lines = _Lines(conn, time.monotonic() + HEADER_SECONDS)
        seen: dict[str, Any] = {"route": "local_upload"}  # what the access log says of it
        t0 = time.perf_counter()
        try:
            hello = lines.read("hello")
            key = self._challenge(conn, hello, seen)
            header = lines.read("header")
            if len(lines.fds) != 1:
                raise InvalidRequest(f"a co-located upload passes one file descriptor with its header, not "
                                     f"{len(lines.fds)}", field="fd")
            result = self._upload(hello, key, header, lines.fds[0], seen)
            reply: dict[str, Any] = {"status": 200, "result": result}
        except CkptdError as e:
            reply = {"status": e.status, **error_body(e)}
        except Exception as e:  # noqa: BLE001 - a bug: answered 500, logged, the service goes on
            log.exception("co-located upload failed")
            reply = {"status": 500, **error_body(CkptdError(f"internal error: {type(e).__name__}: {e}"))}
        finally:
            lines.close_fds()
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

    def _challenge(self, conn: socket.socket, hello: dict[str, Any], seen: dict[str, Any]) -> tuple[str, str]:
        """Answer the hello: this service's proof of the session's key over the rank's nonce, and a nonce of
        its own for the rank's proof; returns ``(key, that nonce)``. Anyone may ask (the key is never sent)."""
        principal, run, name, sid, nonce = (hello.get(k) for k in ("principal", "run", "name", "session", "nonce"))
        if not all(isinstance(v, str) for v in (principal, run, name, sid)) or not is_nonce(nonce):
            raise InvalidRequest("a co-located upload's hello names principal, run, name, session and a nonce "
                                 "(64 hex digits)", field="hello")
        seen.update(run=run[:200], checkpoint=name[:200])  # its principal once proven (``_upload``)
        check_run(run), check_name(name), check_session(sid)
        key = self.key_for(principal, run, name, sid).rpartition(":")[2]
        ours = new_nonce()
        try:
            conn.sendall(json.dumps({"proof": prove(key, "service", nonce), "nonce": ours}).encode() + b"\n")
        except OSError as e:
            raise InvalidRequest(f"a co-located upload's rank went away after its hello: {e}", field="hello") from None
        return key, ours

    def _upload(self, hello: dict[str, Any], key: tuple[str, str], header: dict[str, Any], fd: int,
                seen: dict[str, Any]) -> dict[str, Any]:
        """The file behind ``fd`` through the intake, as ``PUT .../files/{file}`` takes a body, once the
        header proves the session's key; ``seen`` gathers what the access log says of it."""
        file, size, xxh3 = header.get("file"), header.get("size"), header.get("xxh3")
        chunks = header.get("chunks", 0)  # the memory file's first bytes declare the file's chunks
        if not isinstance(file, str) or not isinstance(xxh3, str) or type(size) is not int or size < 0 \
                or type(chunks) is not int or not 0 <= chunks <= arrival.MAX_BYTES:
            raise InvalidRequest("a co-located upload's header names proof, file, size and xxh3 (and chunks: the "
                                 f"length of its chunk declaration, at most {arrival.MAX_BYTES})", field="header")
        seen["file"] = file[:200]
        if not proven(key[0], "rank", key[1], header.get("proof")):
            raise Unauthorized(f"file {file[:200]!r}: the header does not prove the session's key (local_key of "
                               f"this service's answer to the session)", file=file[:200])
        run, name, sid = hello["run"], hello["name"], hello["session"]
        check_file(file)
        if len(xxh3) != 16 or not set(xxh3) <= _XXH3:
            raise InvalidRequest(f"file {file!r}: xxh3 is 16 hex digits", file=file, field="xxh3")
        principal = principal_named(self.tokens, hello["principal"])
        seen["principal"] = principal.name
        if not principal.can_write(run):
            raise Forbidden(f"token {principal.name!r} (scopes {principal.scopes}) may not write run {run!r}",
                            token=principal.name, needs=f"write:{run}")
        _check_handed(fd, file, chunks + size)
        with self.uploads.held(principal.name, file):
            declared = arrival.parse(os.pread(fd, chunks, 0), file) if chunks else None
            sink = self.sessions.intake.receive(run, name, sid, file, principal, declared)
            try:
                self._read_into(fd, chunks, size, sink, seen)
                return sink.finish(xxh3).model_dump(mode="json")
            except BaseException:
                sink.abort()
                raise

    def _read_into(self, fd: int, start: int, size: int, sink: Any, seen: dict[str, Any]) -> None:
        """``size`` bytes of ``fd`` from ``start`` into ``sink``, a window at a time through this worker's one buffer:
        the service's memory per handover is the window, whatever the file (holes read as zeros,
        allocating nothing)."""
        buf = getattr(self._buffers, "window", None)
        if buf is None:
            buf = self._buffers.window = memoryview(bytearray(PIECE))
        seen["bytes_in"] = 0
        at = 0
        while at < size:
            n = os.preadv(fd, [buf[:min(PIECE, size - at)]], start + at)
            if n <= 0:  # sealed against shrinking: cannot happen, but never loop
                raise InvalidRequest(f"file {seen.get('file')!r}: the memory file ended at {at} of {size} bytes",
                                     file=seen.get("file"))
            sink.write(buf[:n])
            at += n
            seen["bytes_in"] = at


class _Lines:
    """The lines a rank sends on one connection, and the descriptors that came with them, all within
    one deadline (``time.monotonic``): each read waits only for what is left of it, so a peer that
    trickles bytes is cut when the deadline passes, not per read; :data:`HEADER_BYTES` in all, and one
    descriptor (each is held until the answer)."""

    def __init__(self, conn: socket.socket, deadline: float) -> None:
        self.conn, self.deadline = conn, deadline
        self.fds: list[int] = []
        self._buf = bytearray()
        self._taken = 0

    def read(self, what: str) -> dict[str, Any]:
        while b"\n" not in self._buf:
            if self._taken >= HEADER_BYTES:
                raise InvalidRequest(f"a co-located upload's hello and header take at most {HEADER_BYTES} bytes",
                                     field=what)
            left = self.deadline - time.monotonic()
            if left <= 0:
                raise InvalidRequest(f"a co-located upload's {what} did not arrive whole within {HEADER_SECONDS:g} s",
                                     field=what)
            try:
                self.conn.settimeout(left)
                data, fds, _, _ = socket.recv_fds(self.conn, HEADER_BYTES - self._taken, 4)
            except TimeoutError:
                continue  # the deadline, said above
            except OSError as e:
                raise InvalidRequest(f"a co-located upload's {what} did not arrive whole: {e}", field=what) from None
            self.fds += fds
            if len(self.fds) > 1:  # held until the answer: a peer sending more would fill this process's table
                raise InvalidRequest(f"a co-located upload passes one file descriptor with its header, not "
                                     f"{len(self.fds)}", field="fd")
            if not data:
                raise InvalidRequest(f"a co-located upload's {what} did not arrive whole: the rank closed the "
                                     f"connection", field=what)
            self._buf += data
            self._taken += len(data)
        cut = self._buf.index(b"\n")
        line, self._buf = bytes(self._buf[:cut]), self._buf[cut + 1:]
        try:
            value = json.loads(line)
        except (ValueError, RecursionError):  # nested past the parser's depth: not a line of a JSON object either
            value = None
        if not isinstance(value, dict):
            raise InvalidRequest(f"a co-located upload's {what} is one line of a JSON object", field=what)
        return value

    def close_fds(self) -> None:
        for fd in self.fds:
            os.close(fd)
        self.fds = []


def _check_handed(fd: int, file: str, size: int) -> None:
    """:class:`InvalidRequest` unless ``fd`` is a regular memory file open for reading, sealed against
    writes, shrinking and growth, of the ``size`` declared: all decided before a byte is read."""
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        raise InvalidRequest(f"file {file!r}: a co-located upload passes a memory file, not this descriptor",
                             file=file)
    if fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_ACCMODE not in (os.O_RDONLY, os.O_RDWR):
        raise InvalidRequest(f"file {file!r}: the memory file passed is not open for reading", file=file)
    try:
        seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
    except OSError:
        seals = 0  # not a memory file (sealing is theirs alone)
    if seals & SEALS != SEALS:
        raise InvalidRequest(f"file {file!r}: the memory file passed is not sealed against writes, shrinking and "
                             f"growth (F_SEAL_WRITE, F_SEAL_SHRINK, F_SEAL_GROW): its bytes could change while "
                             f"they are read", file=file)
    if st.st_size != size:
        raise InvalidRequest(f"file {file!r}: the memory file passed holds {st.st_size} bytes, the header declares "
                             f"{size}", file=file, field="size", declared=size, actual=st.st_size)
