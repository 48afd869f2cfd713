"""Direct uploads: a rank PUTs its data files straight into the object store through presigned URLs.

Used by ``upload_files`` when the session's answer says ``presigned`` (an S3 root, ``direct_uploads``
on at both ends). Per file:

1. :func:`file_digests`: the SHA-256 the store checks (base64) and the digest record the service
   keeps (XXH3 of the file and of each block), in one pass over the file's bytes;
2. ``POST .../files/<file>/presign`` with the size and SHA-256: a URL and the headers signed into it;
3. ``PUT`` the bytes to that URL with exactly those headers, on a connection of its own (the bearer
   token is the service's, never sent to the store);
4. ``POST .../files/<file>/confirm`` with the size, SHA-256 and digest record. The service checks the
   size (and the store's SHA-256 where it keeps one) now; the commit reads every byte of the file and
   checks it against the record before the checkpoint is visible.

Why: on an object store every byte otherwise crosses two hops (rank -> service -> store), and a fleet of
services would carry all checkpoint traffic. A presign refused (the store or the service takes none),
a PUT that fails or a confirmation refused turns direct uploads off for the rest of the save, and
that file, like the rest, goes through the service as without them.
"""

from __future__ import annotations

import base64
import hashlib
import logging
import threading
from typing import Callable, Iterable

import httpx

from ckptd_schemas import PresignedUpload
from ckptd_schemas.filedigest import BLOCK_SIZE, StreamDigest

from ._staging import FALL_BACK
from .transport import Transport

__all__ = ["DirectUploads", "file_digests"]

log = logging.getLogger("ckptd_client")

def file_digests(pieces: Iterable[bytes | memoryview], block_size: int = BLOCK_SIZE) -> tuple[str, str, list[str]]:
    """(SHA-256 as base64, whole-file XXH3, per-block XXH3) of a file's bytes, in one pass."""
    sha = hashlib.sha256()
    digest = StreamDigest(block_size)
    for p in pieces:
        sha.update(p)
        digest.update(p)
    whole, blocks = digest.finish()
    return base64.b64encode(sha.digest()).decode(), whole, blocks


class DirectUploads:
    """One save's direct uploads; shared by the rank's upload threads. ``enabled`` turns False on the
    first fallback, so the rest of the save goes through the service."""

    def __init__(self, transport: Transport, base: str, session: str, timeout: float) -> None:
        self.transport, self.base, self.session = transport, base, session
        self.enabled = True
        self.bytes_uploaded = 0
        self._store = httpx.Client(timeout=timeout)  # no auth: the URL carries its own signature
        self._lock = threading.Lock()

    def put(self, file: str, size: int, pieces: Callable[[], Iterable[bytes | memoryview]]) -> bool:
        """Upload ``file`` (``pieces()`` gives its bytes, as often as asked) straight to the store;
        False (and direct uploads off) when it went wrong in a way the service's path does not."""
        sha256, whole, blocks = file_digests(pieces())
        url = f"{self.base}/sessions/{self.session}/files/{file}"
        try:
            signed = PresignedUpload.model_validate(
                self.transport.request("POST", f"{url}/presign", json={"size": size, "sha256": sha256}))
        except FALL_BACK as e:
            return self._off(f"presign of {file}: {e.message}")
        if signed.block_size != BLOCK_SIZE:
            _, whole, blocks = file_digests(pieces(), signed.block_size)
        try:
            r = self._store.put(signed.url, content=pieces(), headers=signed.headers)
        except httpx.HTTPError as e:
            return self._off(f"PUT of {file} to the store: {e}")
        if r.status_code // 100 != 2:
            return self._off(f"PUT of {file} to the store: HTTP {r.status_code} {r.text[:200]}")
        try:
            self.transport.request("POST", f"{url}/confirm", json={
                "size": size, "sha256": sha256, "xxh3": whole, "block_size": signed.block_size, "blocks": blocks})
        except FALL_BACK as e:
            return self._off(f"confirmation of {file}: {e.message}")
        with self._lock:
            self.bytes_uploaded += size
        return True

    def _off(self, why: str) -> bool:
        if self.enabled:
            log.warning("ckptd: direct uploads off for the rest of this save (%s); sending through the service", why)
        self.enabled = False
        return False

    def close(self) -> None:
        self._store.close()
