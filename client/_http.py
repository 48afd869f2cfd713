"""HTTP transport: retries with exponential backoff, typed errors from bodies."""

from __future__ import annotations

import logging
import os
import random
import time
import uuid
from typing import Any, Callable, Iterable

import httpx

from ckptd_schemas import CkptdError, Unavailable, error_from_body

__all__ = ["Transport"]

log = logging.getLogger("ckptd_client")
RETRY_STATUS = {500, 502, 503, 504}


class Transport:
    """A thread-safe httpx client for one service URL.

    Every call is idempotent on the service side, so transport errors and 5xx
    answers are retried with jittered exponential backoff until
    ``retry_seconds`` have passed; 4xx answers (401 ``Unauthorized`` and 403
    ``Forbidden`` included) raise the typed error at once.

    ``token`` (default ``$CKPTD_TOKEN``; ``""`` sends none) goes in an
    ``Authorization: Bearer`` header. Each call sends one ``X-Request-Id``, the
    same on every retry, which the service logs and puts in error bodies
    (``err.request_id``).
    """

    def __init__(self, url: str, *, timeout: float = 300.0, retry_seconds: float = 120.0,
                 token: str | None = None) -> None:
        self.url = url.rstrip("/")
        self.retry_seconds = retry_seconds
        token = ((os.environ.get("CKPTD_TOKEN") if token is None else token) or "").strip()
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._client = httpx.Client(base_url=self.url, timeout=httpx.Timeout(timeout, connect=10.0),
                                    headers=headers, limits=httpx.Limits(max_connections=64,
                                                                         max_keepalive_connections=16))

    def close(self) -> None:
        self._client.close()

    def request(self, method: str, path: str, *, content: Callable[[], Iterable[bytes] | bytes] | None = None,
                json: Any = None, headers: dict[str, str] | None = None, params: dict[str, Any] | None = None,
                retry: bool = True, sink: Callable[[httpx.Response], Any] | None = None) -> Any:
        """Send; return the parsed JSON body (or ``sink(response)`` when given)."""
        deadline = time.monotonic() + (self.retry_seconds if retry else 0.0)
        delay = 0.1
        attempt = 0
        headers = {"X-Request-Id": uuid.uuid4().hex, **(headers or {})}
        while True:
            attempt += 1
            try:
                body = content() if content is not None else None
                with self._client.stream(method, path, content=body, json=json, headers=headers,
                                         params=params) as resp:
                    if resp.status_code < 400:
                        if sink is not None:
                            return sink(resp)
                        resp.read()
                        return resp.json() if resp.content else None
                    resp.read()
                    err = self._error(resp)
                    if resp.status_code not in RETRY_STATUS:
                        raise err
                    failure: Exception = err
            except httpx.TransportError as e:
                failure = e
            if time.monotonic() + delay > deadline:
                if isinstance(failure, CkptdError):
                    raise failure
                raise Unavailable(f"{method} {self.url}{path} failed after {attempt} attempts: "
                                  f"{type(failure).__name__}: {failure}", url=self.url) from failure
            log.warning("%s %s failed (%s); retrying in %.1fs", method, path, failure, delay)
            time.sleep(delay * (0.5 + random.random()))
            delay = min(delay * 2, 5.0)

    @staticmethod
    def _error(resp: httpx.Response) -> CkptdError:
        try:
            body = resp.json()
        except ValueError:
            body = resp.text[:500]
        return error_from_body(body, resp.status_code)
