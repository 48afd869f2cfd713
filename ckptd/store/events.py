"""What the write side tells an observer (the service's metrics), as hooks it calls, and the event
of a commit (:class:`CommitEvent`, which the ``on_commit`` callbacks receive too).

Call order: :meth:`SessionEvents.opened` when a session is opened or joined;
:meth:`SessionEvents.committed` when this process made a checkpoint visible (its marker created
here, with the commit's time); :meth:`SessionEvents.refused` when a commit was refused and the
session recorded as failed; :meth:`SessionEvents.reclaimed` with what a sweep deleted. The base
class does nothing; an observer overrides what it counts. A hook that raises is logged, never
raised into the save: observing a commit must not change it.
"""

from __future__ import annotations

from dataclasses import dataclass

from ckptd_schemas import CkptdError

__all__ = ["CommitEvent", "SessionEvents"]


@dataclass(frozen=True)
class CommitEvent:
    """A checkpoint this store just made visible (its marker created by this process)."""

    run: str
    name: str
    session: str
    manifest_xxh3: str
    derived_from: str | None
    files: int
    bytes: int


class SessionEvents:
    def opened(self, run: str, name: str, sid: str) -> None:
        """Session ``sid`` of ``run/name`` was opened or joined here."""

    def committed(self, event: CommitEvent, seconds: float) -> None:
        """This process created the marker of ``event`` after ``seconds`` of merging and checking."""

    def refused(self, run: str, name: str, sid: str, error: CkptdError) -> None:
        """The commit of session ``sid`` was refused (recorded as failed) for ``error``."""

    def reclaimed(self, keys: list[str]) -> None:
        """A sweep deleted these uncommitted sessions (``run/name/session``)."""
