"""Retention: which committed checkpoints of a run may be deleted, and deleting them safely.

The rules, each a guarantee tested in ``tests/test_retention.py``:

1. Checkpoints are ordered by step number, as integers (never names as text),
   then by commit time. Only committed checkpoints are counted or deleted; a
   save in progress counts for nothing, so ``--keep-last 1`` keeps the
   previous checkpoint until its successor has committed.
2. ``keep_last N`` keeps every checkpoint whose step is among the N newest
   steps (a resharded copy of a step counts with its step); ``keep_every K``
   also keeps every step that is a multiple of K.
3. The newest committed trainer checkpoint (what ``RUN/latest`` resolves to)
   is always kept, whatever the policy says.
4. A leased checkpoint (being read, resharded or exported) is kept, and so is
   one without a step (there is no order to judge it by).

Call order: ``plan_retention`` (pure) decides; ``collect`` lists the run,
reads leases, plans and, unless ``dry_run``, deletes: first the ``COMMITTED``
marker (the checkpoint disappears atomically: a reader resolves it or gets
404, never half a checkpoint), then its files. Leases are read again right
before each marker goes, so a lease taken while gc runs still protects.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ckptd_schemas import CheckpointSummary, InvalidRequest, check_run

from ..storage import Storage
from .layout import Paths
from .leases import Leases
from .reader import CheckpointReader

__all__ = ["RetentionPlan", "collect", "plan_retention"]


@dataclass
class RetentionPlan:
    run: str
    keep: dict[str, str] = field(default_factory=dict)  # name -> why it stays
    delete: list[str] = field(default_factory=list)  # names, oldest first
    deleted: list[str] = field(default_factory=list)  # what collect() actually removed

    def as_json(self) -> dict:
        return {"run": self.run, "keep": self.keep, "delete": self.delete, "deleted": self.deleted}


def plan_retention(run: str, ckpts: list[CheckpointSummary], *, keep_last: int, keep_every: int | None = None,
                   leased: set[str] = frozenset()) -> RetentionPlan:
    """Decide what goes. Pure: the committed checkpoints and the leased names in, a plan out."""
    if keep_last < 1:
        raise InvalidRequest(f"keep_last must be at least 1, not {keep_last}: the newest checkpoint always stays",
                             field="keep_last")
    if keep_every is not None and keep_every < 1:
        raise InvalidRequest(f"keep_every must be at least 1, not {keep_every}", field="keep_every")
    plan = RetentionPlan(run=run)
    ordered = sorted(ckpts, key=lambda c: (c.step is None, c.step or 0, c.committed_at, c.name))
    steps = sorted({c.step for c in ordered if c.step is not None})
    newest_steps = set(steps[-keep_last:])
    trainer = [c for c in ordered if c.step is not None and c.derived_from is None]
    latest = trainer[-1].name if trainer else None
    for c in ordered:
        if c.name == latest:
            plan.keep[c.name] = "newest committed checkpoint"
        elif c.name in leased:
            plan.keep[c.name] = "leased"
        elif c.step is None:
            plan.keep[c.name] = "no step to order it by"
        elif c.step in newest_steps:
            plan.keep[c.name] = f"among the last {keep_last} steps"
        elif keep_every is not None and c.step % keep_every == 0:
            plan.keep[c.name] = f"step is a multiple of {keep_every}"
        else:
            plan.delete.append(c.name)
    return plan


def collect(storage: Storage, run: str, *, keep_last: int, keep_every: int | None = None,
            dry_run: bool = False) -> RetentionPlan:
    """List the run's committed checkpoints, plan, and delete (marker first) unless ``dry_run``."""
    check_run(run)
    reader = CheckpointReader(storage)
    leases = Leases(storage)
    ckpts = reader.list_checkpoints(run)
    leased = {c.name for c in ckpts if leases.active(run, c.name)}
    plan = plan_retention(run, ckpts, keep_last=keep_last, keep_every=keep_every, leased=leased)
    if dry_run:
        return plan
    for name in plan.delete:
        if leases.active(run, name):  # leased since the listing: keep it
            plan.keep[name] = "leased"
            continue
        storage.delete(Paths.marker(run, name))
        storage.delete_tree(Paths.ckpt(run, name))
        storage.delete_tree(f"leases/{run}/{name}")  # only expired ones are left
        plan.deleted.append(name)
    plan.delete = [n for n in plan.delete if n in plan.deleted]
    return plan
