"""CatalogClient: what a tool asks a ckptd service without holding tensors.

Listing runs and checkpoints, reading a manifest or a byte range of a data file, asking for a
verification or a retention pass: none of it needs torch, and importing torch (with
``torch.distributed``) costs a command-line tool 1.5–3 s before its first request on the measured VMs, more than
``ckptd verify --server`` spent reading 256 MiB. So these calls live here, on the HTTP transport
alone; :class:`ckptd_client.CheckpointClient` extends this class with ``save`` and ``load``.
"""

from __future__ import annotations

import contextlib
import os
from typing import Iterator, Sequence

from ckptd_schemas import CheckpointSummary, InvalidName, Manifest, RunSummary, parse_ref

from .transport import Transport
from ._lease import read_lease
from ._manifest import get_manifest

__all__ = ["DEFAULT_URL", "CatalogClient"]

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
        r = parse_ref(ref)
        return Manifest.model_validate_json(get_manifest(self._transport, r.run, r.name))

    def list_runs(self) -> list[RunSummary]:
        return [RunSummary.model_validate(x) for x in self._transport.request("GET", "/v1/runs")]

    def list_checkpoints(self, run: str) -> list[CheckpointSummary]:
        return [CheckpointSummary.model_validate(x)
                for x in self._transport.request("GET", f"/v1/runs/{run}/checkpoints")]

    def gc(self, run: str, *, keep_last: int, keep_every: int | None = None, dry_run: bool = False,
           drop_parents: bool = False) -> dict:
        """Retention on the service (admin scope): the same rules as ``ckptd gc``; returns the plan
        (``keep`` with reasons, ``delete``, ``deleted``). ``drop_parents`` also deletes checkpoints
        that checkpoints of other runs name as their parent."""
        return self._transport.request("POST", f"/v1/runs/{run}/gc", json={
            "keep_last": keep_last, "keep_every": keep_every, "dry_run": dry_run, "drop_parents": drop_parents})

    def remove(self, ref: str, *, dry_run: bool = False) -> dict:
        """Delete the checkpoint ``ref`` (write scope on its run) unless retention protects it: the
        newest, the newest verified, a leased one, or the parent of another run's checkpoint. Returns
        ``{"ref", "removed": bool, "reason"}``: ``reason`` is ``"removed"`` or why it stays; a protected
        checkpoint is not an error. Raises ``CheckpointNotFound`` when ``ref`` is not visible."""
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

    def close(self) -> None:
        """Release the connections."""
        self._transport.close()

    def __enter__(self) -> "CatalogClient":
        return self

    def __exit__(self, *_: object) -> None:
        self.close()
