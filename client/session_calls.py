"""The session protocol a writer speaks to a ckptd service, one request each.

Call order for one rank of a save (``_save.upload_snapshot`` and the DCP writer run it; so does
``ckptd import --server``): :func:`open_session` (open or join; the answer says whether the
service gives presigned URLs into its object store), upload the files (over HTTP: :func:`put_file`), then
:func:`put_index` with the rank's index; the service commits when the last rank's index arrives,
and :func:`wait_committed` long-polls until the session leaves ``open``, raising its typed error if
the commit was refused. From the opening until the session is committed, refused or gone, the rank
sends keep-alives (``_keepalive``); :func:`abort_session` stops them and drops the staging.
"""

from __future__ import annotations

import contextlib
import itertools
import time
from dataclasses import dataclass
from typing import Callable, Iterable

from ckptd_schemas import RankIndex, SessionInfo, SessionStatus, Unavailable, arrival, error_from_body

from ._keepalive import KEEPALIVE
from .transport import Transport

__all__ = ["Opened", "abort_session", "open_session", "put_file", "put_index", "wait_committed"]


@dataclass(frozen=True)
class Opened:
    """What a rank may do beyond sending its files through the service: upload them to the object store
    with presigned URLs (``presigned``: direct uploads), or hand them over on the service's host
    (``local_socket``: co-located uploads, ``ckptd_client._handover``)."""

    presigned: bool = False
    local_socket: str | None = None  # co-located uploads: the service's socket, and its host's boot id
    local_host: str | None = None
    local_key: str | None = None  # and the key through which the service and this principal prove themselves
    arrival_checks: bool = False  # the service checks each file's chunks as they arrive, from their declaration


def _path(base: str, session: str) -> str:
    return f"{base}/sessions/{session}"


def open_session(transport: Transport, base: str, session: str, world: int, step: int | None, *,
                 parent: str | None = None, direct_uploads: bool = False,
                 retry: bool = True, timeout: float | None = None) -> Opened:
    """Open or join the session. With ``direct_uploads``, the answer says whether the service gives presigned URLs into its object store.
    ``parent``: the checkpoint of another run this run started from (every rank sends the same).
    ``retry`` and ``timeout`` as for ``Transport.request`` (a save's stall opens it once, briefly)."""
    body: dict = {"session": session, "world_size": world, "step": step}
    if parent is not None:
        body["parent"] = parent
    if direct_uploads:
        body["direct_uploads"] = True
    info = SessionInfo.model_validate(transport.request("POST", f"{base}/sessions", json=body, retry=retry,
                                                        timeout=timeout))
    if info.keepalive_seconds:  # until the session is committed, refused or gone (the keep-alive's answer says)
        KEEPALIVE.hold(transport, _path(base, session), info.keepalive_seconds)
    return Opened(presigned=bool(info.presigned), local_socket=info.local_socket, local_host=info.local_host,
                  local_key=info.local_key, arrival_checks=bool(info.arrival_checks))


def put_file(transport: Transport, base: str, session: str, name: str, content: Callable[[], Iterable[bytes]], *,
             size: int, xxh3: str, head: bytes = b"") -> None:
    """Send the data file ``name``: ``size`` bytes whose XXH3-64 is ``xxh3`` (hex), from ``content()`` (called
    again when a retry resends it), after ``head``, the declaration of its chunks (``arrival``) if any."""
    headers = {"X-Ckptd-Xxh3": xxh3, "Content-Length": str(len(head) + size), "Content-Type": "application/octet-stream"}
    if head:
        headers[arrival.CHUNKS_HEADER] = str(len(head))
    transport.request("PUT", f"{_path(base, session)}/files/{name}", headers=headers,
                      content=lambda: itertools.chain([head] if head else [], content()))


def put_index(transport: Transport, base: str, session: str, index: RankIndex) -> SessionStatus:
    body = index.model_dump_json().encode()
    st = transport.request("PUT", f"{_path(base, session)}/ranks/{index.rank}", content=lambda: body,
                           headers={"Content-Type": "application/json"})
    return SessionStatus.model_validate(st)


def abort_session(transport: Transport, base: str, session: str, *, quiet: bool = True) -> None:
    """Delete the session's staging now (it cannot commit without this rank's index), once; with
    ``quiet``, best effort (a failure is left to the service's sweep)."""
    KEEPALIVE.release(transport, _path(base, session))
    with contextlib.suppress(Exception) if quiet else contextlib.nullcontext():
        transport.request("DELETE", _path(base, session), retry=False)


#: How long one status request of a waiting rank may wait (the service allows up to ``MAX_WAIT_SECONDS``):
#: a save of 10,000 ranks takes minutes, and each poll that ends before the commit costs the service a
#: request per rank (polls of 30 s doubled its CPU at 10,000 ranks: BENCHMARKS.md, Ten thousand ranks).
LONG_POLL_SECONDS = 240.0


def _ranks(done: list[int]) -> str:
    return f"{len(done)} ({done[:16]}{' ...' if len(done) > 16 else ''})"


def wait_committed(transport: Transport, base: str, ref: str, status: SessionStatus,
                   deadline: float | None, *, durable: bool = False) -> SessionStatus:
    """Long-poll the session until it leaves ``open``; raise its typed error if it failed (the answers
    of a long poll are shared by every waiting rank and list no ranks; past the deadline one plain
    read says which ranks were done). With
    ``durable``, until the committed checkpoint is durable too (on a service with a durable tier,
    copied there and checked), raising the typed error if it cannot become durable."""
    longest = max(1.0, min(LONG_POLL_SECONDS, transport.timeout - 30.0))  # answered before the read timeout
    while not status.settled(durable):
        left = longest if deadline is None else min(longest, deadline - time.monotonic())
        if left <= 0:
            what = "committed" if status.state == "open" else "durable"
            if status.state == "open":  # a long poll's answer lists no ranks: one read that does
                with contextlib.suppress(Exception):
                    status = SessionStatus.model_validate(transport.request(
                        "GET", f"{base}/sessions/{status.session}", retry=False))
            raise Unavailable(f"{ref}: not {what} in time; ranks done: {_ranks(status.ranks_done)} of "
                              f"{status.world_size}", ref=ref, session=status.session)
        params: dict = {"wait": round(left, 1)}
        if durable:
            params["durable"] = "true"
        status = SessionStatus.model_validate(transport.request(
            "GET", f"{base}/sessions/{status.session}", params=params))
    if status.state == "failed":
        raise error_from_body({"error": status.error}, 422)
    if durable and status.durable_error is not None:
        raise error_from_body({"error": status.durable_error}, 422)
    return status
