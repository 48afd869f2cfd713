"""What the write side reads of one upload session and of the ref it would commit; reads only.

The session store (:mod:`.sessions`), the intake (:mod:`.intake`), the commit (:mod:`.commit`) and
the sweep (:mod:`.sweep`) ask these the same questions: the session's record (:func:`read_meta`,
:func:`session_meta`), which session's marker took the ref (:func:`committed_by`, through
:class:`~.visibility.Visibility`, the one reader of markers), why a taken ref refuses a write
(:func:`taken_error`) and whether the session takes writes (:meth:`Gate.writable`, the one write gate:
every file, index and keep-alive asks it before anything is stored). Which ranks' indexes are stored is
:mod:`.rank_indexes`'s to say.
"""

from __future__ import annotations

from typing import Any, Callable

from ckptd_schemas import (
    AlreadyCommitted, Conflict, SessionConflict, SessionNotFound, check_file, check_name, check_run, check_session,
)

from ..storage import Storage
from .inflight import SharedCalls, is_remote, ordered_map
from .paths import Marker, Paths, SessionMeta
from .visibility import BadMarker, Visibility

__all__ = ["Gate", "committed_by", "read_meta", "session_meta", "taken_error"]


def read_meta(storage: Storage, run: str, name: str, sid: str) -> SessionMeta | None:
    """Session ``sid``'s record, or None where it has none (aborted, reclaimed or never opened)."""
    data = storage.read_json_or_none(Paths.session_meta(run, name, sid))
    return SessionMeta.model_validate(data) if data is not None else None


def session_meta(storage: Storage, run: str, name: str, sid: str) -> SessionMeta:
    """Session ``sid``'s record; :class:`SessionNotFound` where it has none."""
    meta = read_meta(storage, run, name, sid)
    if meta is None:
        raise _no_session(run, name, sid)
    return meta


def _no_session(run: str, name: str, sid: str) -> SessionNotFound:
    return SessionNotFound(f"no upload session {sid!r} for {run}/{name} (aborted, reclaimed or never opened)",
                           ref=f"{run}/{name}", session=sid)


class Gate:
    """The one write gate of a store: every file, index and keep-alive asks :meth:`writable` before
    anything is stored."""

    def __init__(self, storage: Storage, visibility: Visibility) -> None:
        self.storage, self.visibility = storage, visibility
        self._shared: SharedCalls[tuple[SessionMeta | None, Marker | BadMarker | None, Any]] = SharedCalls()

    def writable(self, run: str, name: str, sid: str, file: str | None = None) -> SessionMeta:
        """The names are valid, session ``sid`` is open, no marker took the ref and the commit did not
        refuse it; its record, else the typed refusal (nothing is written)."""
        check_run(run), check_name(name), check_session(sid)
        if file is not None:
            check_file(file)
        reads: list[Callable[[], Any]] = [lambda: read_meta(self.storage, run, name, sid),
                                          lambda: self.visibility.marker(run, name),
                                          lambda: self.storage.read_json_or_none(Paths.failed(run, name, sid))]
        key = Paths.session_meta(run, name, sid)
        if is_remote(self.storage, key):  # a round trip each: the three at once, shared by the calls arriving together
            meta, m, failed = self._shared.call(key, lambda: tuple(ordered_map(lambda read: read(), reads, len(reads))))
        else:
            meta, m, failed = (read() for read in reads)
        if meta is None:  # refusals in this order, as when the three are read one by one
            raise _no_session(run, name, sid)
        if m is not None:
            raise taken_error(run, name, m)
        if failed is not None:
            raise SessionConflict(
                f"session {sid} of {run}/{name} was refused at commit ({failed['error']['message']}); "
                f"save again with a new session", ref=f"{run}/{name}", session=sid)
        return meta


def committed_by(visibility: Visibility, run: str, name: str, sid: str,
                 m: Marker | BadMarker | None = None) -> Marker | None:
    """The marker, when ``run/name`` is visible and was committed by session ``sid`` (``m``: the
    marker as already read)."""
    m = visibility.marker(run, name) if m is None else m
    if not isinstance(m, Marker) or m.session != sid:
        return None
    c = visibility.check_marker(run, name, m)
    return c.marker if c is not None else None


def taken_error(run: str, name: str, m: Marker | BadMarker) -> Conflict:
    """Why a write to ``run/name``, whose marker is ``m``, is refused."""
    if isinstance(m, BadMarker):
        return Conflict(f"{run}/{name} has a COMMITTED marker that does not parse ({m.reason}); the checkpoint "
                        f"is invisible and its name cannot be reused (save under a new name)", ref=f"{run}/{name}")
    return AlreadyCommitted(
        f"checkpoint {run}/{name} is already committed (session {m.session}); committed checkpoints "
        f"are immutable (save under a new name)", ref=f"{run}/{name}", session=m.session)
