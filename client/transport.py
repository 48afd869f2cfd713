"""HTTP transport: retries with exponential backoff, typed errors from bodies."""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import random
import socket
import ssl
import threading
import time
import uuid
from typing import Any, Callable, Iterable, Iterator, Sequence

import httpx

from ckptd_schemas import CkptdError, InvalidRequest, Unavailable, Unreachable, error_from_body
from ckptd_schemas.api import LEASE_HEADER

__all__ = ["LEASE_HEADER", "Transport", "split_urls"]

log = logging.getLogger("ckptd_client")
RETRY_STATUS = {429, 500, 502, 503, 504}  # 429: over a limit of the service (e.g. a token's uploads at once)
FAILOVER_ERRORS = (httpx.ConnectError, httpx.ConnectTimeout)  # the replica is not there: try the next
HOPELESS_ERRORS = (httpx.UnsupportedProtocol, httpx.InvalidURL, httpx.LocalProtocolError)  # retrying changes nothing
#: A TLS handshake's failures that a restarting or busy service can cause (the peer closed the connection
#: mid-handshake): retried. Any other TLS failure at connect (a certificate not verified, TLS spoken to
#: a plain-HTTP server) is final at once (:func:`final_cause`).
TRANSIENT_TLS = (ssl.SSLEOFError, ssl.SSLZeroReturnError, ssl.SSLSyscallError)
#: Name-resolution failures that say the name does not exist (EAI_AGAIN, a resolver that did not answer
#: in time, is retried).
NO_SUCH_NAME = {socket.EAI_NONAME, getattr(socket, "EAI_NODATA", socket.EAI_NONAME)}


@functools.cache
def _tls() -> Any:
    """One TLS context per process: httpx builds one per client otherwise, loading the CA bundle
    each time, a cost every client paid even for an ``http://`` URL (BENCHMARKS.md, Figures behind the code)."""
    return httpx.create_ssl_context()


def final_cause(e: httpx.TransportError) -> tuple[str, str] | None:
    """(``tls`` or ``dns``, what failed) when ``e``, a connection that could not be made, failed in a way
    that waiting will not change: a TLS handshake refused for a reason other than a dropped connection,
    or a host name that does not exist. None for everything else (refused, reset, timed out: retried)."""
    if not isinstance(e, httpx.ConnectError):
        return None
    seen: BaseException | None = e
    while seen is not None:
        if isinstance(seen, ssl.SSLCertVerificationError):
            return "tls", f"the service's TLS certificate is not trusted here ({seen.verify_message or seen}); give " \
                          f"its CA with SSL_CERT_FILE, or check the URL"
        if isinstance(seen, ssl.SSLError) and not isinstance(seen, TRANSIENT_TLS):
            return "tls", f"the TLS handshake failed ({seen.reason or seen}): is the service served over https? " \
                          f"A plain-HTTP service is reached with http://"
        if isinstance(seen, socket.gaierror) and seen.errno in NO_SUCH_NAME:
            return "dns", f"the host name does not resolve ({seen.strerror or seen})"
        seen = seen.__cause__ or seen.__context__
    return None


def split_urls(url: str | Sequence[str]) -> list[str]:
    """``"http://a:8470,http://b:8470"`` or a list of URLs -> the list (service replicas, in order)."""
    urls = [u.strip().rstrip("/") for u in (url.split(",") if isinstance(url, str) else url)]
    urls = [u for u in urls if u]
    if not urls:
        raise InvalidRequest("no service URL given", field="url")
    for u in urls:
        try:
            parsed = httpx.URL(u)
        except httpx.InvalidURL as e:
            raise InvalidRequest(f"invalid service URL {u!r}: {e}", field="url", url=u) from e
        if parsed.scheme not in ("http", "https") or not parsed.host:
            raise InvalidRequest(f"invalid service URL {u!r}: it must start with http:// or https:// and name a "
                                 f"host, e.g. http://127.0.0.1:8470", field="url", url=u)
    return urls


class Transport:
    """A thread-safe httpx client for a service URL, or several replicas of one service.

    Every call is idempotent on the service side, so transport errors and 5xx
    answers are retried with jittered exponential backoff until
    ``retry_seconds`` have passed, as are 429 answers (``TooManyRequests``: this
    token is over a limit of the service, e.g. its uploads at once); other 4xx
    answers (401 ``Unauthorized`` and 403 ``Forbidden`` included) raise the
    typed error at once.

    ``token`` (default ``$CKPTD_TOKEN``; ``""`` sends none) goes in an
    ``Authorization: Bearer`` header. Each call sends one ``X-Request-Id``, the
    same on every retry, which the service logs and puts in error bodies
    (``err.request_id``).

    With several URLs (replicas sharing one storage root), a connection that
    cannot be made moves every later call to the next URL (sticky failover).
    A URL without an ``http(s)://`` scheme is refused at once (``InvalidRequest``),
    and so is an error no retry can change: a TLS handshake that fails or a host name that does not
    resolve raise ``Unreachable`` at once (:func:`final_cause`); ``retry_refused=False`` (the CLI's
    choice) also gives up at once when no replica accepts a connection, where a
    trainer waits out a service restart. The first failure of a call is logged
    as a warning, its retries at debug level.
    """

    def __init__(self, url: str | Sequence[str], *, timeout: float = 300.0, retry_seconds: float = 120.0,
                 token: str | None = None, retry_refused: bool = True) -> None:
        self.urls = split_urls(url)
        self.timeout = timeout
        self.retry_seconds = retry_seconds
        self.retry_refused = retry_refused
        token = ((os.environ.get("CKPTD_TOKEN") if token is None else token) or "").strip()
        self.token = token or None  # the bearer token, for calls beside HTTP (co-located uploads)
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._clients = [httpx.Client(base_url=u, timeout=httpx.Timeout(timeout, connect=10.0), headers=headers,
                                      limits=httpx.Limits(max_connections=64, max_keepalive_connections=16),
                                      verify=_tls())
                         for u in self.urls]
        self._active = 0
        self._lock = threading.Lock()
        self._leases: list[tuple[str, str]] = []  # (path prefix, holder) of the read leases held now
        self._lease_lock = threading.Lock()

    @property
    def url(self) -> str:
        """The URL calls go to now."""
        return self.urls[self._active]

    def _fail_over(self, failed: int) -> None:
        with self._lock:
            if self._active == failed:  # concurrent failures of the same replica move on once
                self._active = (failed + 1) % len(self.urls)
                log.warning("ckptd at %s unreachable; failing over to %s", self.urls[failed], self.url)

    def close(self) -> None:
        for c in self._clients:
            c.close()

    @property
    def closed(self) -> bool:
        return all(c.is_closed for c in self._clients)

    @contextlib.contextmanager
    def leased(self, base: str, holder: str) -> Iterator[None]:
        """For the block, every request under ``base`` (``/v1/checkpoints/RUN/NAME``) names ``holder``, the
        read lease this client holds there (:data:`LEASE_HEADER`): the service renews that lease on each
        read instead of leasing the checkpoint for a while on its own, so nothing of the read outlives
        the holder's release (``ckptd_client._lease.read_lease``)."""
        with self._lease_lock:
            self._leases.append((base, holder))
        try:
            yield
        finally:
            with self._lease_lock:
                self._leases.remove((base, holder))

    def request(self, method: str, path: str, *, content: Callable[[], Iterable[bytes] | bytes] | None = None,
                json: Any = None, headers: dict[str, str] | None = None, params: dict[str, Any] | None = None,
                retry: bool = True, sink: Callable[[httpx.Response], Any] | None = None,
                timeout: float | None = None) -> Any:
        """Send; return the parsed JSON body (or ``sink(response)`` when given). ``timeout``: seconds for
        this request instead of the client's (a caller that must not wait long: a save's stall)."""
        deadline = time.monotonic() + (self.retry_seconds if retry else 0.0)
        delay = 0.1
        attempt = 0
        headers = {"X-Request-Id": uuid.uuid4().hex, **(headers or {})}
        with self._lease_lock:  # a read under this client's own lease (the latest): the service renews that one
            held = [holder for base, holder in self._leases if path == base or path.startswith(base + "/")]
        if held:
            headers.setdefault(LEASE_HEADER, held[-1])
        unreachable: set[int] = set()  # replicas refused since the last pause
        hopeless: set[int] = set()  # replicas whose TLS or host name failed (final_cause)
        while True:
            attempt += 1
            active = self._active
            try:
                body = content() if content is not None else None
                with self._clients[active].stream(method, path, content=body, json=json, headers=headers,
                                                  params=params,
                                                  timeout=httpx.USE_CLIENT_DEFAULT if timeout is None else timeout
                                                  ) as resp:
                    if resp.status_code < 400:
                        if sink is not None:
                            return sink(resp)
                        resp.read()
                        return resp.json() if resp.content else None
                    resp.read()
                    try:
                        err = error_from_body(resp.json(), resp.status_code)
                    except ValueError:  # not JSON: a proxy's page, say
                        err = error_from_body(resp.text[:500], resp.status_code)
                    if resp.status_code not in RETRY_STATUS:
                        raise err
                    failure: Exception = err
            except HOPELESS_ERRORS as e:
                raise InvalidRequest(f"{method} {self.urls[active]}{path}: {e}", url=self.urls[active]) from e
            except httpx.TransportError as e:
                failure = e
                if (final := final_cause(e)) is not None:  # waiting will not change it: at once, typed
                    hopeless.add(active)
                    if len(hopeless) == len(self.urls):
                        raise Unreachable(f"cannot reach ckptd at {self.urls[active]}: {final[1]}",
                                          url=self.urls[active], cause=final[0]) from e
                    self._fail_over(active)  # another replica may be reachable
                    continue
                if isinstance(e, FAILOVER_ERRORS):
                    if len(self.urls) > 1:
                        self._fail_over(active)
                    unreachable.add(active)
                    if len(unreachable | hopeless) < len(self.urls):
                        continue  # another replica not tried yet: at once, no pause
                    if not self.retry_refused:
                        raise Unavailable(f"cannot connect to ckptd at {', '.join(self.urls)}: {e} (is `ckptd serve` "
                                          f"running there?)", url=self.urls[active]) from e
            unreachable.clear()
            if time.monotonic() + delay > deadline:
                if isinstance(failure, CkptdError):
                    raise failure
                raise Unavailable(f"{method} {self.urls[active]}{path} failed after {attempt} attempts: "
                                  f"{type(failure).__name__}: {failure}", url=self.urls[active]) from failure
            (log.warning if attempt == 1 else log.debug)(
                "%s %s failed (%s); retrying for up to %.0fs", method, path, failure, deadline - time.monotonic())
            time.sleep(delay * (0.5 + random.random()))
            delay = min(delay * 2, 5.0)
