"""What the write side tells its observers, through one channel: :class:`Observers`.

An observer is a :class:`SessionEvents`: the service's metrics override every hook; what follows a
commit (the service's verify-after-commit, retention, drills, the durable copy) is an
:class:`AfterCommit` around a function of the :class:`CommitEvent`.

Call order: :meth:`SessionEvents.opened` when a session is opened or joined;
:meth:`SessionEvents.committed` after every commit that created a marker here (with the commit's
time), whichever path committed (a rank's index, a retry, the sweep); :meth:`SessionEvents.refused`
when a commit was refused and the session recorded as failed; :meth:`SessionEvents.reclaimed` with
what a sweep deleted. The base class does nothing; an observer overrides what it hears.
:meth:`Observers.tell` calls each observer's hook in the order the observers were added; what one
raises is logged and the next still hears it, never raised into the save: observing a commit must
not change it, and after the marker nothing undoes the commit.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable, Iterable

from ckptd_schemas import CkptdError

__all__ = ["AfterCommit", "CommitEvent", "Observers", "SessionEvents"]

log = logging.getLogger("ckptd.store")


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
    bytes_read: int = 0  # data bytes the commit read back and checked
    bytes_arrived: int = 0  # data bytes checked as they arrived, confirmed by their stored identity

    @property
    def reread(self) -> bool:
        """Some bytes were not read by the commit: the independent re-read after the marker is due."""
        return self.bytes_arrived > 0


class SessionEvents:
    def opened(self, run: str, name: str, sid: str) -> None:
        """Session ``sid`` of ``run/name`` was opened or joined here."""

    def committed(self, event: CommitEvent, seconds: float) -> None:
        """This process created the marker of ``event`` after ``seconds`` of merging and checking."""

    def refused(self, run: str, name: str, sid: str, error: CkptdError) -> None:
        """The commit of session ``sid`` was refused (recorded as failed) for ``error``."""

    def reclaimed(self, keys: list[str]) -> None:
        """A sweep deleted these uncommitted sessions (``run/name/session``)."""


class AfterCommit(SessionEvents):
    """An action after every commit made here: ``action(event)`` is the observer's ``committed``."""

    def __init__(self, action: Callable[[CommitEvent], None]) -> None:
        self.action = action

    def committed(self, event: CommitEvent, seconds: float) -> None:
        self.action(event)

    def __repr__(self) -> str:
        return f"AfterCommit({self.action!r})"


class Observers:
    """The write side's one observer channel: every observer hears every hook, in the order added."""

    def __init__(self, observers: Iterable[SessionEvents] = ()) -> None:
        self._observers: tuple[SessionEvents, ...] = tuple(observers)

    def add(self, observer: SessionEvents) -> None:
        self._observers = (*self._observers, observer)

    def tell(self, hook: str, *args: object) -> None:
        """Call ``hook`` of each observer; what one raises is logged, never raised into the save."""
        for observer in self._observers:
            try:
                getattr(observer, hook)(*args)
            except Exception:  # noqa: BLE001 - observing must not change the outcome, nor stop the others
                log.exception("session event %s: observer %r failed", hook, observer)
