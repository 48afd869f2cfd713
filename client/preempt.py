"""Save on preemption: a signal in any rank makes every rank save the same step before a deadline.

Schedulers announce preemption with a signal to some processes (SIGTERM from
Kubernetes or Slurm, SIGUSR1 from Slurm's ``--signal``), often not to all,
and kill them a grace period later. Saving from the signal handler is unsafe
(collectives and CUDA are not re-entrant) and a save on only the signalled
rank is a partial checkpoint. So the handler only records the signal, and
the training loop asks ``guard.should_save()`` at a step boundary: an
all-reduce (MAX) over the process group, so every rank gets the same answer
at the same step. Then every rank saves that step and waits for the commit
with the time left. If the commit does not happen in time the new checkpoint
stays invisible (the commit is atomic) and the previous one is untouched::

    client = CheckpointClient(url)
    with PreemptionGuard(deadline=120) as guard:
        for step in range(start, steps):
            train_step()
            if guard.should_save():
                guard.save(client, state_dict(), f"gpt/{step}")  # all ranks; committed or raises
                break

``should_save`` costs one scalar all-reduce; pass ``every=N`` to ask only
every N calls (all ranks must call it the same number of times).
"""

from __future__ import annotations

import math
import signal
import time
from types import FrameType
from typing import TYPE_CHECKING, Iterable

from ckptd_schemas import Unavailable

from ._dist import _active, any_ranks, reduce_max

if TYPE_CHECKING:
    from ckptd_schemas import SessionStatus

    from .client import CheckpointClient

__all__ = ["PreemptionGuard"]


class PreemptionGuard:
    """Turns a preemption signal in any rank into one coordinated, committed save before ``deadline``.

    ``deadline`` is seconds from the first signal this rank sees (or from the collective decision,
    on ranks that saw none) to the commit: set it below the scheduler's grace period.
    """

    def __init__(self, *, signals: Iterable[int] = (signal.SIGTERM, signal.SIGUSR1), deadline: float = 60.0,
                 every: int = 1) -> None:
        self.signals = tuple(signals)
        self.deadline = deadline
        self.every = max(1, every)
        self.received: int | None = None  # the signal number, once one arrived
        self._at: float | None = None
        self._calls = 0
        self._previous: dict[int, object] = {}

    def __enter__(self) -> "PreemptionGuard":
        for s in self.signals:
            self._previous[s] = signal.signal(s, self._on_signal)
        return self

    def __exit__(self, *_: object) -> None:
        for s, h in self._previous.items():
            signal.signal(s, h)  # type: ignore[arg-type]
        self._previous.clear()

    def _on_signal(self, signum: int, _frame: FrameType | None) -> None:
        if self.received is None:  # only record: the loop decides at a step boundary
            self.received, self._at = signum, time.monotonic()

    def should_save(self) -> bool:
        """True on every rank iff any rank has received a signal (collective; call on all ranks)."""
        self._calls += 1
        if self._calls % self.every:
            return False
        flag = any_ranks(self.received is not None)[0]
        if flag and self._at is None:
            self._at = time.monotonic()
        return flag

    def remaining(self) -> float:
        """Seconds left before the deadline (the full deadline before any signal)."""
        return self.deadline if self._at is None else self.deadline - (time.monotonic() - self._at)

    def save(self, client: "CheckpointClient", state_dict: dict, ref: str, *, step: int | None = None
             ) -> "SessionStatus":
        """Save on every rank and wait for the commit within the time left; raise ``Unavailable`` if late.

        Collective: the ranks first agree on the smallest time left, so they all start the save or all
        refuse it (a rank that stayed out would leave the others blocked in the save's collectives).
        """
        left = self.remaining()
        if _active():  # the least on any rank, in whole milliseconds: the maximum of the negated
            left = -reduce_max([-math.floor(left * 1000)])[0] / 1000
        if left <= 0:
            raise Unavailable(f"preemption deadline of {self.deadline:g} s passed before the save of {ref} could "
                              "begin; the previous checkpoint is untouched", ref=ref)
        handle = client.save(state_dict, ref, step=step)
        try:
            return handle.wait(timeout=left)
        except TimeoutError:
            raise Unavailable(f"{ref} was not committed within the preemption deadline; it stays invisible and "
                              "the previous checkpoint is untouched", ref=ref) from None
