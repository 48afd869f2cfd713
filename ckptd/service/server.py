"""Run the service under uvicorn (uvloop + httptools when installed).

The httptools protocol is subclassed twice: the request head is bounded in bytes
(:func:`_bounded_httptools`, 431; a request the parser refuses is answered 400 in the
service's error shape), and in time, responses the client does not read in time, and the
open connections in number (:func:`ckptd.service.connections.guard_protocol`).
"""

from __future__ import annotations

import importlib.util
import ipaddress
import logging
import socket
from typing import Any

import uvicorn
from prometheus_client import disable_created_metrics

from ckptd_schemas import InvalidRequest, PayloadTooLarge

from .app import create_app
from .auth import AuthConfigError, TokenStore
from .connections import guard_protocol
from .error_body import raw_error_response
from .logs import configure_logging
from .settings import Settings

__all__ = ["AuthConfigError", "ListenError", "check_open_mode", "is_loopback", "listen", "serve"]

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


def _malformed_response(msg: str) -> bytes:
    """A 400 in the service's error shape for a request the HTTP parser refused (uvicorn's own is plain text)."""
    return raw_error_response(InvalidRequest(f"malformed HTTP request: {msg}"), reason="Bad Request")


def _bounded_httptools(limit: int) -> Any:
    """uvicorn's httptools protocol with the request line plus headers bounded (httptools has no limit)."""
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    response = raw_error_response(PayloadTooLarge(f"request line and headers exceed {limit} bytes", limit=limit),
                                  status=431, reason="Request Header Fields Too Large")

    class BoundedHttpToolsProtocol(HttpToolsProtocol):
        _ckptd_head = 0  # bytes received since the current request began, while its head is incomplete
        _ckptd_parsed = 0  # request line and headers parsed so far
        _ckptd_in_body = False
        _ckptd_refused = False

        def _ckptd_refuse(self) -> None:
            if not self._ckptd_refused and not self.transport.is_closing():
                self._ckptd_refused = True
                logging.getLogger("uvicorn.error").warning("request head over %d bytes refused (431)", limit)
                self.transport.write(response)
                self.transport.close()

        def data_received(self, data: bytes) -> None:
            if self._ckptd_refused:
                return
            if not self._ckptd_in_body:
                self._ckptd_head += len(data)
            super().data_received(data)
            if not self._ckptd_in_body and self._ckptd_head > limit:  # one header still arriving
                self._ckptd_refuse()

        def send_400_response(self, msg: str) -> None:  # a callback below raised: answer 431, not 400
            if self._ckptd_parsed > limit:
                self._ckptd_refuse()
            elif not self.transport.is_closing():  # malformed HTTP: 400 in the one error shape, then close
                cycle = getattr(self, "cycle", None)
                if cycle is None or not cycle.response_started or cycle.response_complete:
                    self.transport.write(_malformed_response(msg))
                self.transport.close()

        def on_message_begin(self) -> None:
            self._ckptd_parsed, self._ckptd_in_body = 0, False
            super().on_message_begin()

        def on_url(self, url: bytes) -> None:
            self._ckptd_parsed += len(url)
            if self._ckptd_parsed > limit:
                raise ValueError("request line too long")
            super().on_url(url)

        def on_header(self, name: bytes, value: bytes) -> None:
            self._ckptd_parsed += len(name) + len(value) + 4
            if self._ckptd_parsed > limit:
                raise ValueError("request headers too large")
            super().on_header(name, value)

        def on_headers_complete(self) -> None:
            self._ckptd_in_body = True
            super().on_headers_complete()

        def on_message_complete(self) -> None:
            self._ckptd_in_body, self._ckptd_head = False, 0
            super().on_message_complete()

    return BoundedHttpToolsProtocol


def serve(settings: Settings) -> None:
    """Configure logging, check the authentication setup, and run until stopped.

    Raises :class:`AuthConfigError` (before listening) when the tokens cannot be
    read, or when no token is configured on a non-loopback address without
    ``insecure_open``; :class:`ListenError` when the address cannot be listened on.
    """
    configure_logging(settings.log_level, settings.log_format)
    disable_created_metrics()  # no *_created series beside every counter and histogram
    tokens = TokenStore.from_settings(settings)
    check_open_mode(settings, tokens)
    app = create_app(settings, tokens=tokens)
    loop = "uvloop" if importlib.util.find_spec("uvloop") else "asyncio"
    http: Any = "h11"
    if importlib.util.find_spec("httptools"):
        try:
            http = guard_protocol(_bounded_httptools(settings.max_header_bytes), settings.header_timeout_seconds,
                                  settings.max_connections, app.state.metrics,
                                  send_timeout=settings.send_idle_timeout_seconds)
        except (ImportError, AttributeError):  # an uvicorn without this protocol class: h11 has its own bound
            http = "h11"
    if http == "h11":
        log.warning("httptools is not installed: serving with h11, without the request-head deadline and the "
                    "connection cap (CKPTD_HEADER_TIMEOUT_SECONDS, CKPTD_SEND_IDLE_TIMEOUT_SECONDS, CKPTD_MAX_CONNECTIONS)")
    sock = listen(settings.host, settings.port)
    host, port = sock.getsockname()[:2]
    log.info("ckptd listening on http://%s:%d (root %s)", f"[{host}]" if ":" in host else host, port, settings.root)
    config = uvicorn.Config(app, loop=loop, http=http, log_config=None, log_level=settings.log_level.lower(),
                            access_log=False, timeout_keep_alive=30,
                            h11_max_incomplete_event_size=settings.max_header_bytes)
    try:
        uvicorn.Server(config).run(sockets=[sock])
    finally:
        sock.close()
