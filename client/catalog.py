"""CatalogClient: what a tool asks a ckptd service without holding tensors.

Listing runs and checkpoints, reading a manifest or a byte range of a data file, asking for a
verification or a retention pass, submitting a reshard job, uploading data files a tool already
laid out (``ckptd import dcp --server``): none of it needs torch, and importing torch (with
``torch.distributed``) costs a command-line tool more before its first request than ``ckptd verify
--server`` spends reading 256 MiB (BENCHMARKS.md, Figures behind the code). So these calls live
here, on the HTTP transport alone; :class:`ckptd_client.CheckpointClient` extends this class with
``save`` and ``load``.
"""

from __future__ import annotations

import contextlib
import os
import time
import uuid
import warnings
from typing import Any, Callable, Iterable, Iterator, Sequence

from ckptd_schemas import (
    CheckpointSummary, InvalidName, InvalidRequest, Manifest, RankIndex, RunSummary, SessionStatus, parse_ref,
)
from ckptd_schemas.api import NEXT_HEADER, SkippedCheckpoint

from .transport import Transport
from ._lease import read_lease
from ._manifest import get_manifest
from .session_calls import abort_session, open_session, put_file, put_index, wait_committed

__all__ = ["DEFAULT_URL", "CatalogClient", "Upload"]

DEFAULT_URL = "http://127.0.0.1:8470"


class CatalogClient:
    """Queries and byte reads against a ckptd service (or several replicas of one).

    Args:
        url: service URL (default ``$CKPTD_URL`` or ``http://127.0.0.1:8470``); several replicas of
            one service (same storage root) as a list or comma-separated: calls go to the first and
            move to the next when a connection cannot be made.
        token: bearer token (default ``$CKPTD_TOKEN``).
        retry_seconds: how long transient failures (connection errors, 5xx) are retried.
        timeout: seconds one request may take.
        retry_refused: retry a refused connection (a service restarting); False gives up at once.
    """

    def __init__(self, url: str | Sequence[str] | None = None, *, token: str | None = None,
                 retry_seconds: float = 120.0, timeout: float = 300.0, retry_refused: bool = True) -> None:
        self.url = url or os.environ.get("CKPTD_URL", DEFAULT_URL)
        self._token = token or os.environ.get("CKPTD_TOKEN")
        self._transport = Transport(self.url, token=self._token, retry_seconds=retry_seconds, timeout=timeout,
                                    retry_refused=retry_refused)

    def manifest(self, ref: str) -> Manifest:
        """The manifest of ``ref``, its bytes checked against the digest its marker names."""
        return self.resolve(ref)[0]

    def load_tree_root(self, ref: str) -> str | None:
        """The root of ``ref``'s load tree as its marker names it, its head checked against it (None: the
        checkpoint, or the service, has none); ``CorruptCheckpoint`` when the service finds the manifest's
        tree is not the one its marker names."""
        from ._loadtree import fetch_head

        r = parse_ref(ref)
        found = fetch_head(self._transport, r.run, r.name)
        return None if found is None else found.head.root

    def resolve(self, ref: str) -> tuple[Manifest, list[SkippedCheckpoint]]:
        """:meth:`manifest`, and for ``RUN/latest`` the newer checkpoints the service skipped as known to
        be bad (its ``X-Ckptd-Skipped`` header), newest first."""
        r = parse_ref(ref)
        raw, skipped = get_manifest(self._transport, r.run, r.name)
        return Manifest.model_validate_json(raw), skipped

    def list_runs(self) -> list[RunSummary]:
        """Every run the token may read, following the service's pages (:meth:`_pages`)."""
        return [RunSummary.model_validate(x) for x in self._pages("/v1/runs")]

    def list_checkpoints(self, run: str) -> list[CheckpointSummary]:
        """Every committed checkpoint of ``run``, oldest first, following the service's pages: each page
        is oldest first, and a listing of several is ordered by step, then commit time, then name."""
        pages: list[list[Any]] = []
        rows = [CheckpointSummary.model_validate(x) for x in self._pages(f"/v1/runs/{run}/checkpoints", pages)]
        if len(pages) > 1:  # pages are cut in name order
            rows.sort(key=lambda c: (c.step if c.step is not None else -1, c.committed_at, c.name))
        return rows

    def _pages(self, path: str, pages: list[list[Any]] | None = None) -> list[Any]:
        """The items of a paged listing: page after page, each after the name the last one's ``X-Ckptd-Next``
        header gave, until one gives none (a service of an earlier release gives none: one page). A
        cursor that does not move forward is refused, so a service cannot keep a client listing."""
        pages = [] if pages is None else pages
        after: str | None = None
        while True:
            items, following = self._transport.request(
                "GET", path, params=None if after is None else {"after": after},
                sink=lambda r: (r.read(), r.json(), r.headers.get(NEXT_HEADER))[1:])
            pages.append(items)
            if following is None:
                return [x for page in pages for x in page]
            if after is not None and following <= after:
                raise InvalidRequest(f"GET {path}: the service's next page starts after {following!r}, "
                                     f"not after {after!r}", path=path)
            after = following

    def gc(self, run: str, *, keep_last: int, keep_every: int | None = None, dry_run: bool = False,
           drop_parents: bool = False) -> dict:
        """Retention on the service (admin scope): the same rules as ``ckptd gc``; returns the plan
        (``keep`` with reasons, ``delete``, ``deleted``). ``drop_parents`` also deletes checkpoints
        that checkpoints of other runs name as their parent."""
        return self._transport.request("POST", f"/v1/runs/{run}/gc", json={
            "keep_last": keep_last, "keep_every": keep_every, "dry_run": dry_run, "drop_parents": drop_parents})

    def remove(self, ref: str, *, dry_run: bool = False) -> dict:
        """Delete the checkpoint ``ref`` (write scope on its run) unless retention protects it: the
        newest, the newest verified, or the parent of another run's checkpoint. Returns ``{"ref",
        "removed": bool, "reason"}``: ``reason`` is ``"removed"`` or why it stays; a protected checkpoint
        is not an error. Raises ``CheckpointLeased`` (409, naming the holders) when a lease holds it,
        ``CheckpointBeingDeleted`` (409) while another deletion of it is under way, and
        ``CheckpointNotFound`` when ``ref`` is not visible (or was gone by the time it was claimed)."""
        r = parse_ref(ref)
        if r.is_latest:
            raise InvalidName("remove names a checkpoint, not RUN/latest", ref=ref)
        return self._transport.request("DELETE", f"/v1/checkpoints/{r.run}/{r.name}",
                                       params={"dry_run": "true"} if dry_run else None)

    def verify(self, ref: str) -> dict:
        """Ask the service to re-read and check every byte of ``ref`` in its worker process (as ``ckptd
        verify`` does) and record the outcome; returns the record (``ok``, ``problems``, counts)."""
        r = parse_ref(ref)
        return self._transport.request("POST", f"/v1/checkpoints/{r.run}/{r.name}/verify")

    def read_range(self, ref: str, file: str, start: int, end: int) -> bytes:
        """Bytes ``[start, end)`` of one data file of a committed checkpoint, as stored (not checked)."""
        r = parse_ref(ref)
        return self._transport.request("GET", f"/v1/checkpoints/{r.run}/{r.name}/files/{file}",
                                       headers={"Range": f"bytes={start}-{end - 1}"}, sink=lambda x: x.read())

    @contextlib.contextmanager
    def lease(self, ref: str) -> Iterator[str]:
        """Hold a read lease on ``ref`` while the block runs, so retention keeps the checkpoint between
        a tool's requests however long it pauses (the service renews a lease only on the reads it
        serves). ``RUN/latest`` is resolved once, when the lease is taken; the block receives the
        concrete ``RUN/NAME`` it holds (``ref`` itself where the service grants no lease)."""
        r = parse_ref(ref)
        with read_lease(self._transport, f"/v1/checkpoints/{r.run}/{r.name}") as held:
            yield held or f"{r.run}/{r.name}"

    def reshard(self, source: str, to: str, *, out: str | None = None, dtype: str | None = None,
                device: str = "auto", jobs: int = 2, preview: bool = False) -> dict:
        """Submit a reshard job (``POST /v1/reshard``, as ``ckptd reshard --server``): ``source``
        (``RUN/NAME`` or ``RUN/latest``) rewritten in the layout spec ``to`` as ``out`` (default
        ``RUN/NAME-<spec>``), floating tensors cast to ``dtype``, on ``device`` (auto, cpu, cuda) with
        ``jobs`` work units at once. Returns the job's status (``id``, ``state``, ``bytes_total``,
        ...), which :meth:`job` follows. With ``preview``, nothing is written: returns the per-rank
        bytes and reads the plan would take (``POST /v1/reshard/preview``)."""
        body = {"source": source, "to": to, "out": out, "dtype": dtype, "device": device, "jobs": jobs}
        return self._transport.request("POST", "/v1/reshard/preview" if preview else "/v1/reshard", json=body)

    def job(self, job_id: str) -> dict:
        """The status of job ``job_id``, a reshard job or a drill (``GET /v1/jobs/{id}``): ``state`` (queued, running,
        done, failed), ``bytes_done`` of ``bytes_total``, then ``result`` or ``error``."""
        return self._transport.request("GET", f"/v1/jobs/{job_id}")

    def drill(self, source: str, to: Sequence[str], *, jobs: int = 1) -> dict:
        """Submit a conversion drill (``POST /v1/drill``, admin scope, as ``ckptd drill --server``): the
        service plans the conversion of ``source`` (``RUN/NAME`` or ``RUN/latest``) into each layout of
        ``to`` (specs, or ``half`` / ``double``), assembles every target chunk and checks every tensor's
        digest against the source's, writing only the record. Returns the job (``id``, ``state``), which
        :meth:`job` follows (``result``: the record, ``ok`` and per layout ``problems``)."""
        return self._transport.request("POST", "/v1/drill", json={"source": source, "to": list(to), "jobs": jobs})

    def drill_job(self, job_id: str) -> dict:
        """Deprecated, removed in 0.2.0 with ``GET /v1/drills/{id}``: :meth:`job`."""
        warnings.warn("CatalogClient.drill_job is CatalogClient.job", DeprecationWarning, stacklevel=2)
        return self.job(job_id)

    def drill_record(self, ref: str) -> dict:
        """The last drill recorded for checkpoint ``ref`` (``GET /v1/checkpoints/{run}/{name}/drill``, read
        scope); ``NotFound`` when it has none for the manifest committed there."""
        r = parse_ref(ref)
        return self._transport.request("GET", f"/v1/checkpoints/{r.run}/{r.name}/drill")

    def upload(self, ref: str, *, step: int | None = None, session: str | None = None) -> "Upload":
        """Open a one-rank upload session on ``ref`` (``RUN/NAME``; write scope) for data files a tool
        has already laid out, and return it (:class:`Upload`): the session protocol a trainer's save
        speaks, without tensors. Nothing becomes visible until :meth:`Upload.commit`."""
        r = parse_ref(ref)
        if r.is_latest:
            raise InvalidName("upload names a checkpoint, not RUN/latest", ref=ref)
        return Upload(self._transport, r.run, r.name, session or uuid.uuid4().hex, step)

    def close(self) -> None:
        """Release the connections."""
        self._transport.close()

    def __enter__(self) -> "CatalogClient":
        return self

    def __exit__(self, *_: object) -> None:
        self.close()


class Upload:
    """One rank's upload session on a checkpoint (:meth:`CatalogClient.upload`), opened on creation.

    Call order: :meth:`put_file` for each data file (each sent whole, with its XXH3-64 and size,
    which the service checks), then :meth:`commit` with the rank's index, which names those files;
    the service checks and commits the checkpoint. On any failure before that, :meth:`abort` drops
    the session and its files: nothing becomes visible."""

    def __init__(self, transport: Transport, run: str, name: str, session: str, step: int | None) -> None:
        self._transport = transport
        self.ref, self.session = f"{run}/{name}", session
        self._base = f"/v1/checkpoints/{run}/{name}"
        open_session(transport, self._base, session, 1, step)

    def put_file(self, file: str, content: bytes | Callable[[], Iterable[bytes]], *, size: int, xxh3: str) -> None:
        """Send the data file ``file`` of ``size`` bytes whose XXH3-64 is ``xxh3`` (hex). ``content``: the
        bytes, or a function returning an iterable of its pieces (called again when a retry resends it)."""
        put_file(self._transport, self._base, self.session, file,
                 content if callable(content) else (lambda: [content]), size=size, xxh3=xxh3)

    def commit(self, index: RankIndex, *, timeout: float = 600.0) -> SessionStatus:
        """Send the rank's index and wait up to ``timeout`` seconds for the commit; returns the session's
        final status (``manifest_xxh3``: the committed manifest's digest), or raises the typed error
        of a refused commit."""
        status = put_index(self._transport, self._base, self.session, index)
        return wait_committed(self._transport, self._base, self.ref, status, time.monotonic() + timeout)

    def abort(self) -> None:
        """Drop the session and the files it received (once, without retrying)."""
        abort_session(self._transport, self._base, self.session, quiet=False)
