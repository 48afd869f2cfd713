"""Direct uploads: a rank PUTs its data files straight into the object store through presigned URLs.

Used by ``upload_files`` when the session's answer says ``presigned`` (an S3 root, ``direct_uploads``
on at both ends: the service's is off by default). Per file:

1. :func:`file_digests`: the SHA-256 of each part (:data:`PART_BYTES`), which the store checks, and
   the digest record the service keeps (XXH3 of the file and of each block), in one pass;
2. ``POST .../files/<file>/presign`` with the size, part size and SHA-256s: one URL per part and the
   headers signed into each (a multipart upload when there are several parts);
3. ``PUT`` the parts to their URLs with exactly those headers, :data:`PARTS_IN_FLIGHT` at once, on
   connections of their own (the bearer token is the service's, never sent to the store);
4. ``POST .../files/<file>/confirm`` with the same, each part's ETag and the digest record. The service checks the
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
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Iterable, Iterator

import httpx

from ckptd_schemas import ChecksumMismatch, Conflict, InvalidName, InvalidRequest, PresignedUpload
from ckptd_schemas.filedigest import BLOCK_SIZE, StreamDigest

from .transport import Transport

__all__ = ["PART_BYTES", "DirectUploads", "file_digests"]

log = logging.getLogger("ckptd_client")

#: Refusals of one file's direct upload (not of the session): that file goes through the service instead.
FALL_BACK = (ChecksumMismatch, Conflict, InvalidRequest, InvalidName)
#: Bytes per part of a multipart direct upload (S3: at least 5 MiB but the last, at most 10,000 parts);
#: a file of at most this much is one PUT.
PART_BYTES = 32 << 20
#: Parts of one save PUT at once (all of the rank's files together).
PARTS_IN_FLIGHT = 4


def _parts_of(pieces: Iterable[bytes | memoryview], part_size: int) -> Iterator[list[memoryview]]:
    """The file's bytes cut at part boundaries, each part as the views of the pieces it spans (no copy)."""
    part: list[memoryview] = []
    room, parts = part_size, 0
    for p in pieces:
        view = memoryview(p).cast("B")
        while len(view):
            take = view[:room]
            part.append(take)
            view = view[len(take):]
            room -= len(take)
            if room == 0:
                yield part
                part, room, parts = [], part_size, parts + 1
    if part or not parts:  # the last, shorter part; an empty file is one empty part
        yield part


def file_digests(pieces: Iterable[bytes | memoryview], part_size: int = PART_BYTES,
                 block_size: int = BLOCK_SIZE) -> tuple[list[str], str, list[str]]:
    """(SHA-256 of each part as base64, whole-file XXH3, per-block XXH3) of a file's bytes, in one pass."""
    shas: list[str] = []
    digest = StreamDigest(block_size)
    for part in _parts_of(pieces, part_size):
        sha = hashlib.sha256()
        for view in part:
            sha.update(view)
            digest.update(view)
        shas.append(base64.b64encode(sha.digest()).decode())
    whole, blocks = digest.finish()
    return shas, whole, blocks


class DirectUploads:
    """One save's direct uploads; shared by the rank's upload threads. ``enabled`` turns False on the
    first fallback, so the rest of the save goes through the service."""

    def __init__(self, transport: Transport, base: str, session: str, timeout: float) -> None:
        self.transport, self.base, self.session = transport, base, session
        self.enabled = True
        self._store = httpx.Client(timeout=timeout)  # no auth: the URL carries its own signature
        self._parts = ThreadPoolExecutor(PARTS_IN_FLIGHT, thread_name_prefix="ckptd-part")

    def put(self, file: str, size: int, pieces: Callable[[], Iterable[bytes | memoryview]]) -> bool:
        """Upload ``file`` (``pieces()`` gives its bytes, as often as asked) straight to the store;
        False (and direct uploads off) when it went wrong in a way the service's path does not."""
        shas, whole, blocks = file_digests(pieces(), PART_BYTES)
        url = f"{self.base}/sessions/{self.session}/files/{file}"
        claim = {"size": size, "part_size": PART_BYTES, "sha256": shas}
        try:
            signed = PresignedUpload.model_validate(self.transport.request("POST", f"{url}/presign", json=claim))
        except FALL_BACK as e:
            return self._off(f"presign of {file}: {e.message}")
        if signed.block_size != BLOCK_SIZE:
            _, whole, blocks = file_digests(pieces(), PART_BYTES, signed.block_size)
        parts = list(_parts_of(pieces(), PART_BYTES))
        sent = [self._parts.submit(self._put_part, u, h, part) for u, h, part in zip(signed.urls, signed.headers, parts)]
        etags: list[str] = []
        for fut in sent:
            etag, why = fut.result()
            if why is not None:
                for f in sent:
                    f.cancel()
                return self._off(f"PUT of {file} to the store: {why}")
            etags.append(etag)
        try:
            self.transport.request("POST", f"{url}/confirm", json={
                **claim, "upload_id": signed.upload_id, "etags": etags if signed.upload_id else [],
                "xxh3": whole, "block_size": signed.block_size, "blocks": blocks})
        except FALL_BACK as e:
            return self._off(f"confirmation of {file}: {e.message}")
        return True

    def _put_part(self, url: str, headers: dict[str, str], part: list[memoryview]) -> tuple[str, str | None]:
        """PUT one part; (its ETag, None) or ("", why not)."""
        try:
            r = self._store.put(url, content=iter(part), headers=headers)
        except httpx.HTTPError as e:
            return "", str(e)
        if r.status_code // 100 != 2:
            return "", f"HTTP {r.status_code} {r.text[:200]}"
        return r.headers.get("ETag", ""), None

    def _off(self, why: str) -> bool:
        if self.enabled:
            log.warning("ckptd: direct uploads off for the rest of this save (%s); sending through the service", why)
        self.enabled = False
        return False

    def close(self) -> None:
        self._parts.shutdown(wait=True)
        self._store.close()
