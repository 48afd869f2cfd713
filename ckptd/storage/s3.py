"""S3 (and S3-compatible) storage through s3fs: ``--root s3://bucket/prefix``.

Endpoint and credentials come from the standard AWS environment: the
credential chain (``AWS_ACCESS_KEY_ID``/``AWS_SECRET_ACCESS_KEY``, profiles,
instance roles), ``AWS_DEFAULT_REGION``, and ``AWS_ENDPOINT_URL_S3`` or
``AWS_ENDPOINT_URL`` for S3-compatible stores (MinIO, Ceph, moto).

How the storage primitives map onto S3 (no rename anywhere):

* ``open_write``: the object is written in place. Up to one block
  (:data:`DEFAULT_BLOCK_SIZE`) a single PUT at commit; beyond it a streaming
  multipart upload, one part per block, completed at commit. Parts go out
  while the next block is received: up to ``S3Storage.parts_in_flight`` parts
  of all of a storage's uploads at once (the memory they hold), on s3fs's
  event loop. Nothing is visible at the key before the PUT or the completion;
  ``abort`` waits for the parts in flight, then aborts the multipart upload.
* ``open_write(once=True)``: the same, with ``If-None-Match: *`` on the PUT or the
  multipart completion: a 412 means the key exists, and nothing is written.
* ``create_if_absent``: one conditional PUT (``If-None-Match: *``); 412
  PreconditionFailed means another writer was first. A 409
  ConditionalRequestConflict (a concurrent conditional write in flight) is
  retried. Caveat of the protocol: when a PUT that succeeded is retried
  (its response lost to a 5xx or a reset connection), the retry reads 412 and
  the call returns False although this writer's bytes are at the key; callers
  read the object back (the commit compares the marker's session).
* ``read``: ranged GET; ``size``: HEAD; ``list``: ``ListObjectsV2`` with the
  ``/`` delimiter; ``delete_tree``: batched ``DeleteObjects`` plus aborting
  the multipart uploads left under the prefix (a crashed writer's parts).
* Retries: botocore's ``standard`` mode (exponential backoff with jitter on
  throttling - SlowDown, 503 - and on 500/502/503/504 and connection errors),
  ``AWS_MAX_ATTEMPTS`` attempts in all (default 10) unless ``AWS_RETRY_MODE`` /
  ``AWS_MAX_ATTEMPTS`` or the ``config_kwargs`` storage option say otherwise.
  What still fails becomes :class:`ckptd_schemas.StorageError` naming the key; a refusal that no
  retry changes (``AccessDenied``, unknown credentials: :mod:`ckptd.storage.failures`) becomes
  ``StorageReadOnly`` on a write, ``StoragePermanent`` on a read, final at once.

Listings are never cached (another process or replica may have written since).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import threading
import time
from concurrent.futures import Future
from typing import Any, Iterator, Mapping

from ckptd_schemas import StorageError

import fsspec

from .base import Presigned, Storage, Writer, check_key
from .failures import classified, classify, client_errors

__all__ = ["DEFAULT_BLOCK_SIZE", "DEFAULT_MAX_ATTEMPTS", "S3Storage", "s3_options_from_env"]

DEFAULT_BLOCK_SIZE = 32 << 20  # multipart part size (S3: at least 5 MiB, at most 10,000 parts)
_PARTS_PER_SIZE = 2000  # the part size doubles every 2,000 parts: 32 MiB blocks reach 1.9 TiB
DEFAULT_MAX_ATTEMPTS = 10
_CONFLICT_ATTEMPTS = 8  # 409 ConditionalRequestConflict on create_if_absent
_COPY_ONE = 5 << 30  # the largest object one CopyObject copies
_COPY_PART = 1 << 30  # bytes per UploadPartCopy beyond it
# s3fs's own retry loop wraps botocore's: it re-runs a call whose botocore retries are spent
# when the error is SlowDown, and re-reads a body cut off mid-stream (which botocore cannot).
# Kept small: the attempts multiply.
_S3FS_RETRIES = 3
#: Seconds the readiness probe's S3 calls wait to connect and for an answer (``S3Storage.for_probes``).
PROBE_TIMEOUT = 2.0


def s3_options_from_env(env: Mapping[str, str] | None = None) -> dict[str, Any]:
    """s3fs options from the standard AWS environment (endpoint, retry mode and attempts).

    Credentials and region are left to botocore's own chain.
    """
    env = os.environ if env is None else env
    opts: dict[str, Any] = {}
    endpoint = env.get("AWS_ENDPOINT_URL_S3") or env.get("AWS_ENDPOINT_URL")
    if endpoint and env.get("AWS_IGNORE_CONFIGURED_ENDPOINT_URLS", "").lower() != "true":
        opts["endpoint_url"] = endpoint
    try:
        attempts = int(env.get("AWS_MAX_ATTEMPTS") or DEFAULT_MAX_ATTEMPTS)
    except ValueError:
        attempts = DEFAULT_MAX_ATTEMPTS
    mode = env.get("AWS_RETRY_MODE") or "standard"
    # AWS_MAX_ATTEMPTS: total attempts. SigV4 for every request, presigned URLs included (botocore would
    # presign with the legacy query signature, which signs neither the checksum nor the length).
    opts["config_kwargs"] = {"retries": {"mode": mode, "total_max_attempts": attempts}, "signature_version": "s3v4"}
    return opts


def _create_outcome(e: BaseException) -> str:
    """``exists`` (412: the key is there), ``conflict`` (409: retry) or ``error``."""
    if isinstance(e, FileExistsError):
        return "exists"
    for code, status in client_errors(e):
        if code == "PreconditionFailed" or status == 412:
            return "exists"
        if code == "ConditionalRequestConflict" or status == 409:
            return "conflict"
    return "error"


class _S3Writer(Writer):
    """Streaming upload: a single PUT at commit up to one block, else a multipart upload
    whose parts (one block each) go out while the bytes arrive and which completes at commit.

    Nothing is ever published implicitly: a writer dropped without ``commit`` leaves at most
    an unfinished multipart upload (invisible; aborted by ``delete_tree`` of its folder or by
    the bucket's lifecycle rule), never a partial object. (s3fs's own file object completes
    its upload when it is garbage collected, so it is not used for writing.)
    """

    def __init__(self, st: "S3Storage", key: str, once: bool = False) -> None:
        self._st, self._key, self._once = st, key, once
        self._s3key = st._s3key(key)
        self._block = int(st.block_size)
        self._buf = bytearray()
        self._upload_id: str | None = None
        self._parts: list[tuple[int, Future]] = []  # (part number, its upload) in order
        self._checked = 0  # parts before this one are known to have succeeded
        self._closed = False

    def _call(self, method: str, **kw: Any) -> dict:
        return self._st.fs.call_s3(method, Bucket=self._st.bucket, Key=self._s3key, **kw)

    def _upload_part(self, body: bytes) -> None:
        """Send one part without waiting for it (at most ``parts_in_flight`` of the storage's at once);
        a part that failed earlier is raised here, or at the latest by ``commit``."""
        if self._upload_id is None:
            self._upload_id = self._call("create_multipart_upload")["UploadId"]
        while self._checked < len(self._parts) and self._parts[self._checked][1].done():
            self._parts[self._checked][1].result()
            self._checked += 1
        n = len(self._parts) + 1
        st = self._st
        st._in_flight.acquire()  # bounds the memory of parts sent but not yet answered
        try:
            fut = asyncio.run_coroutine_threadsafe(
                st.fs._call_s3("upload_part", Bucket=st.bucket, Key=self._s3key, UploadId=self._upload_id,
                               PartNumber=n, Body=body), st.fs.loop)
        except BaseException:
            st._in_flight.release()
            raise
        fut.add_done_callback(lambda _: st._in_flight.release())
        self._parts.append((n, fut))

    def _completed_parts(self) -> list[dict[str, Any]]:
        # botocore sends (and S3 checks) a checksum of each part's body; the upload was created
        # without a checksum algorithm, so completion names parts by ETag only (as s3fs does).
        return [{"PartNumber": n, "ETag": fut.result()["ETag"]} for n, fut in self._parts]

    def _settle(self) -> None:
        """Wait for every part in flight, failed or not (an abort must come after the last part)."""
        for _, fut in self._parts:
            try:
                fut.result()
            except Exception:  # noqa: BLE001 - the caller is aborting anyway
                pass

    def part_size(self) -> int:
        """Size of the next part: the block size, doubled every 2,000 parts (S3 allows 10,000)."""
        return self._block << (len(self._parts) // _PARTS_PER_SIZE)

    def write(self, data: bytes | memoryview) -> None:
        if self._closed:
            raise StorageError(f"storage write of {self._key!r} failed: the writer is closed", key=self._key)
        self._buf += data
        with self._aborting("write", self._key, self._st.url):  # any backend error becomes StorageError
            while len(self._buf) >= (n := self.part_size()):
                body = bytes(memoryview(self._buf)[:n])
                del self._buf[:n]
                self._upload_part(body)

    def commit(self) -> bool:
        if self._closed:
            raise StorageError(f"storage commit of {self._key!r} failed: the writer is closed", key=self._key)
        cond = {"IfNoneMatch": "*"} if self._once else {}
        try:
            if self._upload_id is None:
                self._call("put_object", Body=bytes(self._buf), **cond)
            else:
                if self._buf:
                    self._upload_part(bytes(self._buf))
                self._call("complete_multipart_upload", UploadId=self._upload_id,
                           MultipartUpload={"Parts": self._completed_parts()}, **cond)
            self._closed = True
            self._buf = bytearray()
            return True
        except Exception as e:  # noqa: BLE001
            self.abort()
            if self._once and _create_outcome(e) == "exists":
                return False
            raise classify("commit", self._key, e, self._st.url) from e

    def abort(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._buf = bytearray()
        if self._upload_id is not None:
            self._settle()
            try:
                self._call("abort_multipart_upload", UploadId=self._upload_id)
            except Exception:  # noqa: BLE001 - best effort; delete_tree and lifecycle rules reap leftovers
                pass


class S3Storage(Storage):
    """Storage rooted at ``s3://bucket[/prefix]``; see the module docstring for the mapping.

    ``storage_options`` go to :class:`s3fs.S3FileSystem` and override the
    defaults (environment endpoint and retries, :data:`DEFAULT_BLOCK_SIZE`,
    no listings cache).
    """

    presigns = True  # presigned PUTs with a signed SHA-256 (direct uploads)
    read_piece = 16 << 20  # one ranged GET per 16 MiB streamed out, not per MiB
    parts_in_flight = 4  # multipart parts sent and not yet answered, all uploads together (memory: as many parts)

    def __init__(self, url: str, **storage_options: Any) -> None:
        opts: dict[str, Any] = {"default_block_size": DEFAULT_BLOCK_SIZE, "use_listings_cache": False,
                                **s3_options_from_env(), **storage_options}
        self.url = url.rstrip("/")
        self._options = opts
        try:
            self.fs, root = fsspec.url_to_fs(self.url, **opts)
        except ImportError as e:
            raise StorageError(f"{url}: S3 needs s3fs (pip install 'ckptd[s3]'): {e}", key="") from e
        self.root = root.rstrip("/")
        self.fs.retries = _S3FS_RETRIES
        self.bucket, _, prefix = self.root.partition("/")
        self._prefix = prefix.strip("/")
        self.block_size = int(getattr(self.fs, "default_block_size", None) or DEFAULT_BLOCK_SIZE)
        self._in_flight = threading.BoundedSemaphore(self.parts_in_flight)
        if self.block_size < 5 << 20:
            raise StorageError(f"{url}: S3 multipart parts are at least 5 MiB (block size {self.block_size})", key="")

    def for_probes(self) -> "S3Storage":
        """This root with one attempt per call (no botocore or s3fs retries) and :data:`PROBE_TIMEOUT`
        to connect and to answer: a store answering 503 fails the readiness probe in one round trip,
        where the service's own calls retry with backoff for a minute or more."""
        config = {**self._options.get("config_kwargs", {}), "connect_timeout": PROBE_TIMEOUT,
                  "read_timeout": PROBE_TIMEOUT, "retries": {"mode": "standard", "total_max_attempts": 1}}
        st = S3Storage(self.url, **{**self._options, "config_kwargs": config})
        st.fs.retries = 1
        return st

    # -- helpers ------------------------------------------------------------------
    def _path(self, key: str) -> str:
        return f"{self.root}/{check_key(key)}"

    def _s3key(self, key: str) -> str:
        """The S3 object key of a storage key (validated)."""
        return self._path(key).partition("/")[2]

    def _dir(self, prefix: str) -> str:
        """The S3 key prefix (ending in ``/``, or empty at the bucket root) of a storage folder."""
        k = self._s3key(prefix) if prefix else self._prefix
        return f"{k}/" if k else ""

    def _walk(self, prefix: str, method: str = "list_objects_v2", **kw: Any) -> Iterator[dict]:
        """Every page of a listing under ``prefix``: objects (``kw``: a ``Delimiter``) or multipart uploads."""
        kw.update(Bucket=self.bucket, Prefix=prefix)
        while True:
            out = self.fs.call_s3(method, **kw)
            yield out
            if not out.get("IsTruncated"):
                return
            if method == "list_objects_v2":
                kw["ContinuationToken"] = out["NextContinuationToken"]
            else:
                kw["KeyMarker"], kw["UploadIdMarker"] = out.get("NextKeyMarker"), out.get("NextUploadIdMarker")

    def _missing(self, key: str) -> StorageError:
        return StorageError(f"storage object {key!r} does not exist", key=key)

    # -- primitives ---------------------------------------------------------------
    def open_write(self, key: str, *, once: bool = False) -> Writer:
        return _S3Writer(self, key, once)

    def read(self, key: str, start: int = 0, end: int | None = None) -> bytes:
        path = self._path(key)
        if end is not None and end <= start:
            # S3 ignores an inverted Range and would send the whole object.
            if self.size(key) is None:
                raise self._missing(key)
            return b""
        try:
            if start == 0 and end is None:
                return self.fs.cat_file(path)
            return self.fs.cat_file(path, start=start, end=end)
        except FileNotFoundError as e:
            raise self._missing(key) from e
        except Exception as e:  # noqa: BLE001 - any backend error becomes StorageError
            if not isinstance(e, StorageError):  # 416 InvalidRange past the end: a short read, as on a file
                size = self.size(key)
                if size is not None and start >= size:
                    return b""
            raise classify("read", key, e, self.url) from e

    def _head(self, key: str, **kw: Any) -> dict | None:
        """One HEAD of ``key``; None when it is absent."""
        with classified("stat", key, self.url):
            try:
                return self.fs.call_s3("head_object", Bucket=self.bucket, Key=self._s3key(key), **kw)
            except FileNotFoundError:
                return None

    def size(self, key: str) -> int | None:
        out = self._head(key)
        return None if out is None else int(out.get("ContentLength") or 0)

    def stamp(self, key: str) -> str | None:
        """ETag and size from one HEAD: any PUT of other bytes changes the ETag."""
        out = self._head(key)
        return None if out is None else f"{out.get('ETag', '')}:{int(out.get('ContentLength') or 0)}"

    def listed_stamps(self, prefix: str) -> dict[str, str]:
        """:meth:`stamp`'s ETag and size of every object under ``prefix``, from ListObjectsV2 pages."""
        root = f"{self._prefix}/" if self._prefix else ""
        with classified("list", prefix, self.url):
            try:
                return {o["Key"][len(root):]: f"{o.get('ETag', '')}:{int(o.get('Size') or 0)}"
                        for page in self._walk(self._dir(prefix)) for o in page.get("Contents") or ()}
            except FileNotFoundError:
                return {}

    def presign_put(self, key: str, size: int, part_size: int, sha256s: list[str], seconds: float) -> Presigned:
        """SigV4 presigned ``PutObject`` (one part) or ``UploadPart`` URLs of a multipart upload made with
        ``ChecksumAlgorithm=SHA256``, each with its ``Content-Length`` and ``x-amz-checksum-sha256``
        signed in: S3 refuses a part of another length or SHA-256, and a URL used for another key,
        part, method or header value. The ``PutObject`` URL also signs ``If-None-Match: *``: it creates
        the object once, and a replay after that is refused (412) by the store; a multipart upload is
        completed by the service, with ``If-None-Match: *`` too (:meth:`complete_presigned`), after
        which its part URLs name an upload that no longer exists."""
        k = self._s3key(key)
        lengths = [min(part_size, size - i * part_size) for i in range(len(sha256s))] if size else [0]

        async def presign() -> Presigned:
            await self.fs.set_session()  # s3fs makes its client on its first call: this may be ours
            s3 = await self.fs.get_s3(self.bucket)
            if len(sha256s) == 1:
                url = await s3.generate_presigned_url("put_object", ExpiresIn=int(seconds), Params={
                    "Bucket": self.bucket, "Key": k, "ContentLength": size, "ChecksumSHA256": sha256s[0],
                    "IfNoneMatch": "*"})
                return Presigned(None, [url], [{"Content-Length": str(size), "x-amz-checksum-sha256": sha256s[0],
                                                "If-None-Match": "*"}])
            upload = await s3.create_multipart_upload(Bucket=self.bucket, Key=k, ChecksumAlgorithm="SHA256")
            uid = upload["UploadId"]
            urls = [await s3.generate_presigned_url("upload_part", ExpiresIn=int(seconds), Params={
                "Bucket": self.bucket, "Key": k, "UploadId": uid, "PartNumber": n, "ContentLength": length,
                "ChecksumSHA256": sha}) for n, (length, sha) in enumerate(zip(lengths, sha256s), start=1)]
            return Presigned(uid, urls, [{"Content-Length": str(length), "x-amz-checksum-sha256": sha}
                                         for length, sha in zip(lengths, sha256s)])

        try:
            return asyncio.run_coroutine_threadsafe(presign(), self.fs.loop).result(120)
        except Exception as e:  # noqa: BLE001
            raise classify("presign", key, e, self.url) from e

    def complete_presigned(self, key: str, upload_id: str, etags: list[str], sha256s: list[str]) -> None:
        parts = [{"PartNumber": n, "ETag": etag, "ChecksumSHA256": sha}
                 for n, (etag, sha) in enumerate(zip(etags, sha256s), start=1)]
        try:
            self.fs.call_s3("complete_multipart_upload", Bucket=self.bucket, Key=self._s3key(key),
                            UploadId=upload_id, MultipartUpload={"Parts": parts}, IfNoneMatch="*")
        except Exception as e:  # noqa: BLE001
            with contextlib.suppress(Exception):
                self.fs.call_s3("abort_multipart_upload", Bucket=self.bucket, Key=self._s3key(key),
                                UploadId=upload_id)
            raise classify("complete", key, e, self.url) from e

    def stored_sha256(self, key: str) -> str | None:
        out = self._head(key, ChecksumMode="ENABLED")
        return None if out is None else out.get("ChecksumSHA256")

    def read_or_none(self, key: str) -> bytes | None:
        """One GET (no HEAD first)."""
        with classified("read", key, self.url):
            try:
                return self.fs.cat_file(self._path(key), start=0, end=None)
            except FileNotFoundError:
                return None

    def read_head(self, key: str, n: int) -> bytes | None:
        """One ranged GET; absent: None from that answer, not from a look after it (a marker another
        replica creates meanwhile must not turn "absent" into a failure). An empty object's range is
        refused (416): answered empty."""
        with classified("read", key, self.url):
            try:
                return self.fs.cat_file(self._path(key), start=0, end=n)
            except FileNotFoundError:
                return None
            except Exception:
                if self.size(key) == 0:
                    return b""
                raise

    def list(self, prefix: str) -> list[str]:
        pfx = self._dir(prefix)
        names: set[str] = set()
        with classified("list", prefix, self.url):
            try:
                for page in self._walk(pfx, Delimiter="/"):
                    names.update(c["Prefix"][len(pfx):].rstrip("/") for c in page.get("CommonPrefixes") or ())
                    names.update(o["Key"][len(pfx):] for o in page.get("Contents") or ())
            except FileNotFoundError:
                return []
        return sorted(n for n in names if n and "/" not in n and not n.startswith(".") and ".tmp-" not in n)

    def create_if_absent(self, key: str, data: bytes) -> bool:
        k = self._s3key(key)
        for attempt in range(_CONFLICT_ATTEMPTS):
            try:
                self.fs.call_s3("put_object", Bucket=self.bucket, Key=k, Body=bytes(data), IfNoneMatch="*")
                return True
            except Exception as e:  # noqa: BLE001
                outcome = _create_outcome(e)
                if outcome == "exists":
                    return False
                if outcome == "conflict" and attempt + 1 < _CONFLICT_ATTEMPTS:
                    time.sleep(min(0.05 * 2 ** attempt, 2.0) * (0.5 + random.random()))
                    continue
                raise classify("create", key, e, self.url) from e
        raise AssertionError("unreachable")  # pragma: no cover

    def link(self, src: str, dst: str, stamp: str | None = None) -> bool:
        """A copy inside the store that creates ``dst`` once (``If-None-Match: *``): ``CopyObject`` up to
        5 GiB, else ``UploadPartCopy`` of :data:`_COPY_PART` ranges and a conditional completion. False
        when ``src`` is absent or ``dst`` already holds an object (nothing is replaced). With ``stamp``,
        ``src`` is looked at first (one HEAD: its stamp and size), and every copy is conditional on its
        ETag (``CopySourceIfMatch``): a store that enforces the condition (AWS S3; moto does not) copies
        the object that was checked or nothing, even if it is replaced between the look and the copy."""
        now = self.stamp(src)
        if now is None or stamp is not None and now != stamp:
            return False
        size = int(now.rsplit(":", 1)[1])
        source = {"Bucket": self.bucket, "Key": self._s3key(src)}
        cond = {"CopySourceIfMatch": stamp.rsplit(":", 1)[0]} if stamp is not None else {}
        k = self._s3key(dst)
        try:
            if size <= _COPY_ONE:
                self.fs.call_s3("copy_object", Bucket=self.bucket, Key=k, CopySource=source, IfNoneMatch="*", **cond)
                return True
            uid = self.fs.call_s3("create_multipart_upload", Bucket=self.bucket, Key=k)["UploadId"]
            try:
                parts = []
                for n, lo in enumerate(range(0, size, _COPY_PART), start=1):
                    out = self.fs.call_s3("upload_part_copy", Bucket=self.bucket, Key=k, UploadId=uid, PartNumber=n,
                                          CopySource=source, CopySourceRange=f"bytes={lo}-{min(size, lo + _COPY_PART) - 1}",
                                          **cond)
                    parts.append({"PartNumber": n, "ETag": out["CopyPartResult"]["ETag"]})
                self.fs.call_s3("complete_multipart_upload", Bucket=self.bucket, Key=k, UploadId=uid,
                                MultipartUpload={"Parts": parts}, IfNoneMatch="*")
            except BaseException:
                with contextlib.suppress(Exception):
                    self.fs.call_s3("abort_multipart_upload", Bucket=self.bucket, Key=k, UploadId=uid)
                raise
            return True
        except FileNotFoundError:
            return False
        except Exception as e:  # noqa: BLE001
            if _create_outcome(e) == "exists":
                return False
            raise classify("link", dst, e, self.url) from e

    def delete(self, key: str) -> None:
        with classified("delete", key, self.url), contextlib.suppress(FileNotFoundError):
            self.fs.call_s3("delete_object", Bucket=self.bucket, Key=self._s3key(key))

    def delete_tree(self, prefix: str) -> None:
        k = self._s3key(prefix)
        pfx = f"{k}/"
        try:
            keys = [k]  # an object at the prefix itself goes too, as a file does locally
            for page in self._walk(pfx):
                keys.extend(o["Key"] for o in page.get("Contents") or ())
            for i in range(0, len(keys), 1000):
                out = self.fs.call_s3("delete_objects", Bucket=self.bucket,
                                      Delete={"Objects": [{"Key": x} for x in keys[i:i + 1000]], "Quiet": True})
                errors = [e for e in out.get("Errors") or () if e.get("Code") != "NoSuchKey"]
                if errors:
                    first = errors[0]
                    raise OSError(f"{len(errors)} objects not deleted, first {first.get('Key')!r}: "
                                  f"{first.get('Code')} {first.get('Message')}")
            self._abort_uploads(pfx)
        except FileNotFoundError:
            pass
        except Exception as e:  # noqa: BLE001
            raise classify("delete", prefix, e, self.url) from e
        self.fs.invalidate_cache(self._path(prefix))

    def _abort_uploads(self, pfx: str, older_than: float = float("inf")) -> int:
        """Abort the multipart uploads in flight under ``pfx`` (parts of crashed or abandoned writers)
        begun before ``older_than`` (epoch seconds); return how many."""
        n = 0
        for out in self._walk(pfx, "list_multipart_uploads"):
            for u in out.get("Uploads") or ():
                begun = u.get("Initiated")
                if begun is None or begun.timestamp() < older_than:
                    with contextlib.suppress(FileNotFoundError):
                        self.fs.call_s3("abort_multipart_upload", Bucket=self.bucket, Key=u["Key"],
                                        UploadId=u["UploadId"])
                        n += 1
        return n

    def reclaim_temps(self, prefix: str, older_than: float) -> int:
        """The unfinished multipart uploads under ``prefix`` (a writer killed mid-upload, or a presigned
        upload never completed): not objects, invisible to reads and listings, but their parts are
        stored (and billed) until aborted."""
        with classified("delete", prefix, self.url):
            return self._abort_uploads(self._dir(prefix), older_than)

    def walk(self, prefix: str) -> list[tuple[str, int]]:
        root = f"{self._prefix}/" if self._prefix else ""
        with classified("list", prefix, self.url):
            try:
                return sorted((o["Key"][len(root):], o["Size"]) for page in self._walk(self._dir(prefix))
                              for o in page.get("Contents") or ())
            except FileNotFoundError:
                return []
