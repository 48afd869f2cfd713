"""Run the service under uvicorn (httptools; uvloop when installed).

Each connection's protocol, whichever uvicorn picks, sits behind
:class:`ckptd.service.connections.ConnectionGuard`: request heads bounded in bytes (431) and
in time, responses the client does not read in time, the open connections in number (over the
cap, an idle connection, an unread response or the slowest request body is shed, and room is
kept for probes), and the parser's own 400 answered in the service's error shape.
"""

from __future__ import annotations

import ctypes
import importlib.util
import ipaddress
import logging
import os
import socket

import uvicorn
from prometheus_client import disable_created_metrics

from ..storage import Storage
from .app import create_app
from .auth import AuthConfigError, TokenStore
from .connections import ConnectionGuard
from .logs import configure_logging
from .settings import Settings

__all__ = ["AuthConfigError", "ListenError", "check_open_mode", "is_loopback", "listen", "reuse_freed_memory", "serve"]

log = logging.getLogger("ckptd.service")


class ListenError(Exception):
    """The service cannot listen on its address (port in use, address not on this host)."""


def listen(host: str, port: int) -> socket.socket:
    """A listening TCP socket on ``host:port``, bound here so that a busy port or a foreign address
    is one clear :class:`ListenError` before anything else starts."""
    try:
        family, kind, proto, _, addr = socket.getaddrinfo(host.strip("[]"), port, type=socket.SOCK_STREAM)[0]
    except (socket.gaierror, OverflowError) as e:
        raise ListenError(f"cannot listen on {host}:{port}: {e}") from e
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(addr)
        sock.listen(2048)
    except OSError as e:
        sock.close()
        raise ListenError(f"cannot listen on {host}:{port}: {e.strerror or e}") from e
    return sock


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


#: glibc ``mallopt`` parameters (``M_TRIM_THRESHOLD``, ``M_MMAP_THRESHOLD``) and the values the service sets.
_TRIM, _MMAP = -1, -3
TRIM_BYTES, MMAP_BYTES = 256 << 20, 64 << 20


def reuse_freed_memory() -> bool:
    """Have glibc's malloc keep large freed blocks (up to :data:`TRIM_BYTES` free at an arena's top, blocks
    up to :data:`MMAP_BYTES` from the heap) for the next allocation, instead of unmapping each and faulting
    the next one in page by page. The service allocates such blocks per byte it moves: each 32 MiB
    multipart part of an S3 upload, and each copy the S3 client libraries make of it (a page fault per
    4 KiB: 0.3 of the service's CPU per byte uploaded to S3 on a VM, bench/results/s3.md). Not applied
    where the operator set malloc's own variables (``MALLOC_*_``, ``GLIBC_TUNABLES``) or the C library is
    not glibc; True when applied. Called once by :func:`serve`, before anything is allocated for requests."""
    if any(k.startswith("MALLOC_") or k == "GLIBC_TUNABLES" for k in os.environ):
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    return bool(mallopt(_TRIM, TRIM_BYTES)) and bool(mallopt(_MMAP, MMAP_BYTES))


def check_open_mode(settings: Settings, tokens: TokenStore) -> None:
    """Open mode (no tokens) only on loopback, unless ``insecure_open``; says so either way."""
    if tokens.enabled:
        if not tokens.entries:
            log.warning("the tokens file %s holds no token: every request except probes and /metrics is refused "
                        "until one is added", tokens.file)
        return
    where = f"{settings.host}:{settings.port}"
    if is_loopback(settings.host):
        log.warning("authentication is off (no CKPTD_TOKENS_FILE or CKPTD_TOKENS): anyone on this machine who can "
                    "reach %s can read and write checkpoints", where)
    elif settings.insecure_open:
        log.warning("authentication is off on %s (--insecure-open): anyone who can reach this address can read, "
                    "write and reshard checkpoints", where)
    else:
        raise AuthConfigError(
            f"refusing to serve on {settings.host} without authentication: anyone who can reach {where} could "
            f"read and write every checkpoint. Configure bearer tokens (CKPTD_TOKENS_FILE or CKPTD_TOKENS; "
            f"docs/security.md, 'Authentication'), listen on 127.0.0.1, or pass --insecure-open "
            f"(CKPTD_INSECURE_OPEN=1) to serve openly anyway.")


def serve(settings: Settings, *, storage: Storage | None = None) -> None:
    """Configure logging, check the authentication setup, and run until stopped, serving ``storage``
    (by default the root of ``settings``; an embedding, or a test that wraps the backend, passes its own).

    Raises :class:`AuthConfigError` (before listening) when the tokens cannot be
    read, or when no token is configured on a non-loopback address without
    ``insecure_open``; :class:`ListenError` when the address cannot be listened on.
    """
    configure_logging(settings.log_level, settings.log_format)
    reuse_freed_memory()
    disable_created_metrics()  # no *_created series beside every counter and histogram
    tokens = TokenStore.from_settings(settings)
    check_open_mode(settings, tokens)
    app = create_app(settings, storage, tokens=tokens)
    loop = "uvloop" if importlib.util.find_spec("uvloop") else "asyncio"
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol  # the guard frames with httptools too

    guard = ConnectionGuard(settings.header_timeout_seconds, settings.send_idle_timeout_seconds,
                            settings.max_header_bytes, settings.max_connections, app.state.metrics,
                            min_body_rate=settings.body_min_bytes_per_second)
    app.state.readiness.announce()  # a root that cannot be written (read-only, not ours): said here, first
    sock = listen(settings.host, settings.port)
    host, port = sock.getsockname()[:2]
    log.info("ckptd listening on http://%s:%d (root %s)", f"[{host}]" if ":" in host else host, port, settings.root)
    config = uvicorn.Config(guard.track(app), loop=loop, http=guard.protocol(HttpToolsProtocol), log_config=None,
                            log_level=settings.log_level.lower(), access_log=False, timeout_keep_alive=30)
    try:
        uvicorn.Server(config).run(sockets=[sock])
    finally:
        sock.close()
