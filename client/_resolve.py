"""What a ref resolved to: the manifest, and for ``RUN/latest`` the newer checkpoints skipped.

The service resolves ``RUN/latest`` to the newest trainer checkpoint not known to be bad (its
recorded verification of the manifest committed under that name failed). The answer to ``GET
/v1/checkpoints/{run}/{name}`` is that checkpoint's manifest, named in ``X-Ckptd-Name``, with the
newer trainer checkpoints it skipped, and why, in ``X-Ckptd-Skipped`` (a JSON array of
:class:`~ckptd_schemas.api.SkippedCheckpoint`, newest first).

Call order: :func:`resolve_manifest` (the load's first step, ``ckptd show --server``), then
``Manifest.model_validate_json`` of the bytes it returns. Imports no torch: the CLI uses it.
"""

from __future__ import annotations

import json
import logging
from typing import Any

import httpx

from ckptd_schemas.api import SKIPPED_HEADER, SkippedCheckpoint

from ._manifest import get_manifest
from .transport import Transport

__all__ = ["resolve_manifest"]

log = logging.getLogger("ckptd_client")


class _Headers:
    """A transport that keeps the headers of the answer its caller's sink read (one request at a time):
    :func:`get_manifest` checks the manifest's digest and returns its bytes only."""

    def __init__(self, transport: Transport) -> None:
        self.transport, self.headers = transport, httpx.Headers()

    def request(self, method: str, path: str, *, sink: Any, **kw: Any) -> Any:
        def keep(resp: httpx.Response) -> Any:
            self.headers = resp.headers
            return sink(resp)

        return self.transport.request(method, path, sink=keep, **kw)


def resolve_manifest(transport: Transport, run: str, name: str) -> tuple[bytes, list[SkippedCheckpoint]]:
    """The manifest ``run/name`` resolves to (:func:`get_manifest`: its bytes checked against the digest
    the service declares) and, for ``latest``, the newer checkpoints the service skipped as known to be
    bad (empty from a service that sends none). A header that does not parse is logged and read as
    none: the manifest itself was checked."""
    answer = _Headers(transport)
    raw = get_manifest(answer, run, name)  # type: ignore[arg-type]
    header = answer.headers.get(SKIPPED_HEADER)
    if not header:
        return raw, []
    try:
        return raw, [SkippedCheckpoint.model_validate(x) for x in json.loads(header)]
    except (ValueError, TypeError) as e:  # pydantic's ValidationError is a ValueError
        log.warning("%s/%s: the service's %s header does not parse (%s): %.200s", run, name, SKIPPED_HEADER, e,
                    header)
        return raw, []
