"""A checkpoint's manifest as the service sends it, checked against the digest it declares.

The service answers ``GET /v1/checkpoints/{run}/{name}`` with the manifest's bytes and, in
``X-Ckptd-Manifest-Xxh3``, the digest its ``COMMITTED`` marker names. Everything a load restores is
found through the manifest (block digests, object digests, object values stored inline), so the
bytes received are hashed against that digest before they are parsed: a manifest damaged on storage
or on the way raises :class:`CorruptCheckpoint` instead of steering the load. A service that sends
no digest (older releases) is taken as it answers.

Call order: :func:`get_manifest` (the load, the DCP reader, :class:`CatalogClient`, ``ckptd verify
--server``), then ``Manifest.model_validate_json`` of what it returns.
"""

from __future__ import annotations

import httpx
import xxhash

from ckptd_schemas import CorruptCheckpoint

from .transport import Transport

__all__ = ["MANIFEST_DIGEST_HEADER", "get_manifest"]

MANIFEST_DIGEST_HEADER = "X-Ckptd-Manifest-Xxh3"


def get_manifest(transport: Transport, run: str, name: str) -> bytes:
    """The manifest's bytes, which hash to the digest the service declares for them."""

    def sink(resp: httpx.Response) -> bytes:
        raw = resp.read()
        want = resp.headers.get(MANIFEST_DIGEST_HEADER)
        if want is not None and xxhash.xxh3_64_hexdigest(raw) != want.lower():
            raise CorruptCheckpoint(f"manifest of {run}/{resp.headers.get('X-Ckptd-Name', name)}: the "
                                    f"{len(raw)} bytes received hash to {xxhash.xxh3_64_hexdigest(raw)}, "
                                    f"its COMMITTED marker says {want}",
                                    ref=f"{run}/{resp.headers.get('X-Ckptd-Name', name)}", file="manifest")
        return raw

    return transport.request("GET", f"/v1/checkpoints/{run}/{name}", sink=sink)
