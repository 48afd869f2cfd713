"""A checkpoint's manifest as the service sends it, checked against the digest it declares.

The service answers ``GET /v1/checkpoints/{run}/{name}`` with the manifest's bytes and, in
``X-Ckptd-Manifest-Xxh3``, the digest its ``COMMITTED`` marker names. Everything a load restores is
found through the manifest (block digests, object digests, object values stored inline), so the
bytes received are hashed against that digest before they are parsed: a manifest damaged on storage
or on the way raises :class:`CorruptCheckpoint` instead of steering the load. A service that sends
no digest (older releases) is taken as it answers. ``RUN/latest`` resolves to the newest trainer
checkpoint not known to be bad: the answer names it in ``X-Ckptd-Name`` and the newer ones it skipped,
and why, in ``X-Ckptd-Skipped`` (:func:`skipped_in`).

Call order: :func:`get_manifest` (the load, the DCP reader, :class:`CatalogClient`, ``ckptd verify
--server``, ``ckptd show --server``), then ``Manifest.model_validate_json`` of the bytes it returns.
Imports no torch: the CLI uses it.
"""

from __future__ import annotations

import json
import logging

import httpx
import xxhash

from ckptd_schemas import CorruptCheckpoint
from ckptd_schemas.api import SKIPPED_HEADER, SkippedCheckpoint

from .transport import Transport

__all__ = ["MANIFEST_DIGEST_HEADER", "get_manifest", "skipped_in"]

MANIFEST_DIGEST_HEADER = "X-Ckptd-Manifest-Xxh3"
log = logging.getLogger("ckptd_client")


def get_manifest(transport: Transport, run: str, name: str) -> tuple[bytes, list[SkippedCheckpoint]]:
    """The manifest's bytes, which hash to the digest the service declares for them, and for ``latest``
    the newer checkpoints the service skipped as known to be bad (:func:`skipped_in`)."""

    def sink(resp: httpx.Response) -> tuple[bytes, list[SkippedCheckpoint]]:
        raw = resp.read()
        want = resp.headers.get(MANIFEST_DIGEST_HEADER)
        if want is not None and xxhash.xxh3_64_hexdigest(raw) != want.lower():
            raise CorruptCheckpoint(f"manifest of {run}/{resp.headers.get('X-Ckptd-Name', name)}: the "
                                    f"{len(raw)} bytes received hash to {xxhash.xxh3_64_hexdigest(raw)}, "
                                    f"its COMMITTED marker says {want}",
                                    ref=f"{run}/{resp.headers.get('X-Ckptd-Name', name)}", file="manifest")
        return raw, skipped_in(resp.headers, f"{run}/{name}")

    return transport.request("GET", f"/v1/checkpoints/{run}/{name}", sink=sink)


def skipped_in(headers: httpx.Headers, ref: str) -> list[SkippedCheckpoint]:
    """The checkpoints an answer about ``ref`` says it skipped (``X-Ckptd-Skipped``, newest first); none
    from a service that sends none. A header that does not parse is logged and read as none: the
    answer itself is checked on its own."""
    header = headers.get(SKIPPED_HEADER)
    if not header:
        return []
    try:
        return [SkippedCheckpoint.model_validate(x) for x in json.loads(header)]
    except (ValueError, TypeError) as e:  # pydantic's ValidationError is a ValueError
        log.warning("%s: the service's %s header does not parse (%s): %.200s", ref, SKIPPED_HEADER, e, header)
        return []
