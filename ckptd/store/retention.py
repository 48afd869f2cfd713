"""Retention: which committed checkpoints of a run may be deleted, and deleting them safely.

The rules, each a guarantee tested in ``tests/ckptd/store/test_retention.py``:

1. Checkpoints are ordered by step number, as integers (never names as text),
   then by commit time; the step is the one marker and manifest agree on
   (:mod:`.visibility`), so no single edited file reorders a run. Only visible
   checkpoints are counted or deleted; a save in progress counts for nothing,
   so ``--keep-last 1`` keeps the previous checkpoint until its successor has
   committed.
2. ``keep_last N`` keeps every checkpoint whose step is among the N newest
   steps (a resharded copy of a step counts with its step); ``keep_every K``
   also keeps every step that is a multiple of K. A checkpoint *known to be
   bad* (its recorded verification of the manifest committed now failed:
   :func:`~.records.known_bad`) is not counted: the N steps are the
   newest N held by a checkpoint not known to be bad, and a known-bad
   checkpoint stays while fewer than N such steps are as new as it is (gc
   never deletes more than it would if the record did not exist), but never
   takes one of the N places.
3. The newest committed trainer checkpoint is always kept, whatever the
   policy says, and so is what ``RUN/latest`` resolves to (the newest not
   known to be bad: :meth:`~.visibility.Visibility.latest`) when they differ.
4. A leased checkpoint (being read, resharded or exported) is kept, and so is
   one without a step (there is no order to judge it by).
5. The run always keeps its newest *verified* trainer checkpoint. Before
   anything is deleted, ``collect`` establishes which one that is, newest
   first: a recorded verification that still vouches for exactly the stored
   bytes (:func:`~.records.record_holds`), or a fresh verification. If
   none verifies, nothing is deleted. A dry run reports which one it is and how
   it was established.
6. A checkpoint that a visible checkpoint of another run names as its ``parent`` (lineage across
   runs: a fine-tune, a job resumed under a new run name) is kept, unless the call says
   ``drop_parents``; the children are found from their own markers and manifests
   (:class:`~.visibility.Visibility` decides which are visible), never from an index a root edit
   could lose.

``remove`` deletes one named checkpoint under the same rules 3-6 (the retention policy is the
caller's: a trainer's own ``keep the best k``): a protected one stays, with the reason.

Call order: ``plan_retention`` (pure) decides; ``collect`` gathers the facts of rules 2-6, plans
and, unless ``dry_run``, deletes each checkpoint through :meth:`.leases.Leases.delete` (its
``COMMITTED`` marker first: a reader resolves it or gets 404, never half a checkpoint; a lease
answered 200 meanwhile protects it whatever the interleaving: :mod:`.leases`).
"""

from __future__ import annotations

import logging
import threading
from dataclasses import asdict, dataclass, field, fields
from typing import Any, Callable, Mapping

from ckptd_schemas import (
    CheckpointBeingDeleted, CheckpointLeased, CheckpointNotFound, CheckpointSummary, CkptdError, InvalidRequest,
    StorageFull, StorageReadOnly, check_name, check_run,
)

from ..storage import Storage
from .leases import Leases
from .paths import Committed, Marker, Paths
from .records import VerifyRecord, record_holds
from .verification import read_record, verify_committed, verify_unrecorded
from .visibility import Visibility

__all__ = ["Removal", "RetentionPlan", "RetentionPolicy", "Verifier", "children_elsewhere", "collect", "gc_run",
           "plan_retention", "remove"]

log = logging.getLogger("ckptd.store")

#: Verifies the visible checkpoint (run, name) and records the outcome: in this process
#: (``verify_committed``) or in one of the service's workers.
Verifier = Callable[[str, str], VerifyRecord]


@dataclass
class RetentionPlan:
    run: str
    keep: dict[str, str] = field(default_factory=dict)  # name -> why it stays
    delete: list[str] = field(default_factory=list)  # names, oldest first
    deleted: list[str] = field(default_factory=list)  # what collect() actually removed
    newest_verified: str | None = None
    verified_how: str | None = None  # "recorded verification of the stored bytes" or "verified now"
    failed_verification: dict[str, str] = field(default_factory=dict)  # newer ones that did not verify: why
    latest: str | None = None  # what RUN/latest resolves to (``collect``: the visibility rule's answer)
    known_bad: dict[str, str] = field(default_factory=dict)  # not counted by keep_last (rule 2): why
    #: kept for a lease, for another deletion under way, or gone already: the typed error ``rm`` answers
    refused: dict[str, CkptdError] = field(default_factory=dict, repr=False)

    def as_json(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self) if f.repr}  # every field but ``refused``


def plan_retention(run: str, ckpts: list[CheckpointSummary], *, keep_last: int, keep_every: int | None = None,
                   leased: set[str] = frozenset(), newest_verified: str | None = None,
                   latest: str | None = None, children: dict[str, list[str]] | None = None,
                   only: set[str] | None = None, newest: str | None = None,
                   known_bad: Mapping[str, str] | None = None) -> RetentionPlan:
    """Decide what goes. Pure: the visible checkpoints, the leased names, the newest verified
    checkpoint, the children in other runs (name -> their refs) and the checkpoints known to be bad
    (name -> why) in, a plan out. ``newest``: the newest trainer checkpoint, ``latest``: what
    ``RUN/latest`` resolves to (``collect`` passes the visibility rule's answers); without them, the
    newest trainer checkpoint by step, then commit time (for ``latest``: the newest not known to be
    bad). ``only``: the names the caller asks to delete (``remove``); the others stay, and the step
    policy is not applied."""
    if keep_last < 1:
        raise InvalidRequest(f"keep_last must be at least 1, not {keep_last}: the newest checkpoint always stays",
                             field="keep_last")
    if keep_every is not None and keep_every < 1:
        raise InvalidRequest(f"keep_every must be at least 1, not {keep_every}", field="keep_every")
    bad = dict(known_bad or {})
    plan = RetentionPlan(run=run, known_bad={c.name: bad[c.name] for c in ckpts if c.name in bad})
    ordered = sorted(ckpts, key=lambda c: (c.step is None, c.step or 0, c.committed_at, c.name))
    # Rule 2: the N newest steps held by a checkpoint not known to be bad; a known-bad one takes no place.
    steps = sorted({c.step for c in ordered if c.step is not None and c.name not in bad})
    newest_steps = set(steps[-keep_last:])
    # A known-bad checkpoint stays while fewer than N good steps are as new as it is.
    oldest_kept = steps[-keep_last] if len(steps) >= keep_last else None
    trainer = [c for c in ordered if c.step is not None and c.derived_from is None]
    if newest is None:
        newest = trainer[-1].name if trainer else None
    if latest is None:
        latest = next((c.name for c in reversed(trainer) if c.name not in bad), None)
    plan.latest = latest
    children = children or {}
    for c in ordered:
        if only is not None and c.name not in only:
            continue
        if c.name == newest:
            plan.keep[c.name] = "newest committed checkpoint" + (
                " (known to be bad: RUN/latest skips it)" if c.name in bad else "")
        elif c.name == newest_verified:
            plan.keep[c.name] = "newest verified checkpoint"
        elif c.name == latest:
            plan.keep[c.name] = "what RUN/latest resolves to (the newer ones are known to be bad)"
        elif c.name in leased:
            plan.keep[c.name] = "leased"
        elif c.name in children:
            plan.keep[c.name] = "parent of " + ", ".join(sorted(children[c.name])[:3]) + \
                (f" and {len(children[c.name]) - 3} more" if len(children[c.name]) > 3 else "")
        elif only is not None:
            plan.delete.append(c.name)
        elif c.step is None:
            plan.keep[c.name] = "no step to order it by"
        elif c.name in bad and (oldest_kept is None or c.step >= oldest_kept):
            plan.keep[c.name] = f"known to be bad, not counted among the last {keep_last} steps (kept until " \
                                f"{keep_last} good steps are as new): {bad[c.name]}"
        elif c.name not in bad and c.step in newest_steps:
            plan.keep[c.name] = f"among the last {keep_last} steps"
        elif keep_every is not None and c.step % keep_every == 0:
            plan.keep[c.name] = f"step is a multiple of {keep_every}"
        else:
            plan.delete.append(c.name)
    return plan


def children_elsewhere(vis: Visibility, run: str) -> dict[str, list[str]]:
    """Per checkpoint name of ``run``, the visible checkpoints of other runs that name it as their
    parent. Reads every other run's markers, and applies the visibility rule (which reads a
    manifest) only to those whose marker names a parent in ``run``: a marker that says so when its
    manifest does not makes its checkpoint invisible, so it protects nothing, and one that drops a
    parent its manifest names does too. No index kept beside the markers could be trusted more."""
    out: dict[str, list[str]] = {}
    prefix = f"{run}/"
    for other in vis.runs():
        if other == run:
            continue
        for name in vis.names(other):
            m = vis.marker(other, name)
            if not isinstance(m, Marker) or m.parent is None or not m.parent.startswith(prefix):
                continue
            if vis.check_marker(other, name, m) is not None:
                out.setdefault(m.parent[len(prefix):], []).append(f"{other}/{name}")
    return out


def collect(storage: Storage, run: str, *, keep_last: int, keep_every: int | None = None,
            dry_run: bool = False, verify: Verifier | None = None, drop_parents: bool = False,
            only: set[str] | None = None) -> RetentionPlan:
    """List the run's visible checkpoints, establish the newest verified one (rule 5), plan, and
    delete (marker first) unless ``dry_run``. ``verify`` defaults to verifying in this process;
    ``drop_parents`` lifts rule 6; ``only`` as for :func:`plan_retention`. A dry run only reads: it
    verifies in this process without recording (``verify`` is not called), and a checkpoint it finds
    bad counts as known to be bad for its plan, as the record a real run writes would make it."""
    check_run(run)
    vis = Visibility(storage)
    leases = Leases(storage)
    visible = vis.listing(run)
    ckpts = [c.summary() for c in visible]
    leased = {c.name for c in ckpts if leases.active(run, c.name)}

    found_bad: dict[str, str] = {}  # a dry run's verifications, which it does not record

    def facts() -> dict:  # rules 2 and 3 as the records say now (a dry run: and as its own findings would)
        head = vis.latest(visible)
        good = vis.latest([c for c in visible if c.name not in found_bad]) if found_bad else head
        return {"known_bad": {**_known_bad_newest(vis, visible, keep_last), **found_bad},
                "latest": good.checkpoint.name if good.checkpoint is not None else None,
                "newest": head.newest.name if head.newest is not None else None}

    plan = plan_retention(run, ckpts, keep_last=keep_last, keep_every=keep_every, leased=leased, only=only,
                          **facts())
    if not plan.delete and not dry_run:
        return _name_holders(plan, leases, run)
    # Only when something would go: the other runs' listings (rule 6) cost a read of every marker.
    children = {} if drop_parents else children_elsewhere(vis, run)
    if dry_run:
        check: Verifier = lambda r, n: verify_unrecorded(storage, r, n)  # noqa: E731 - a dry run writes nothing
    else:
        check = verify or (lambda r, n: verify_committed(storage, r, n))
    newest, how, failed = _newest_verified(storage, vis, visible, check)
    if dry_run:
        found_bad.update(failed)
        how = "verified now, not recorded (dry run)" if how == "verified now" else how
    # The verifications just done are recorded: a checkpoint found bad now is known to be bad (and one
    # found good again no longer is), so rules 2 and 3 are read again before anything is decided.
    plan = plan_retention(run, ckpts, keep_last=keep_last, keep_every=keep_every, leased=leased,
                          newest_verified=newest, children=children, only=only, **facts())
    plan.newest_verified, plan.verified_how, plan.failed_verification = newest, how, failed
    _name_holders(plan, leases, run)
    if newest is None and plan.delete:  # something would go, but nothing newer is known good
        for name in plan.delete:
            plan.keep[name] = "no checkpoint of the run verifies: nothing is deleted"
        plan.delete = []
        log.warning("retention of run %s deleted nothing: no checkpoint of it verifies", run)
    if dry_run:
        return plan
    for name in plan.delete:
        try:  # claimed, its leases read again, then marker first (a lease taken meanwhile still protects)
            leases.delete(run, name, lambda n=name: (storage.delete(Paths.marker(run, n)),  # type: ignore[misc]
                                                     storage.delete_tree(Paths.ckpt(run, n))))
        except (CheckpointLeased, CheckpointBeingDeleted, CheckpointNotFound) as e:
            plan.refused[name] = e
            if not isinstance(e, CheckpointNotFound):  # gone already (another request deleted it): not kept
                plan.keep[name] = e.message
            continue
        plan.deleted.append(name)
    plan.delete = [n for n in plan.delete if n in plan.deleted]
    return plan


def _name_holders(plan: RetentionPlan, leases: Leases, run: str) -> RetentionPlan:
    """Each checkpoint kept for its lease says who holds it and until when (``rm`` refuses with it)."""
    for name, why in plan.keep.items():
        if why == "leased":
            held = leases.holding(run, name)
            plan.keep[name] = leases.describe(run, name, held)
            plan.refused[name] = CheckpointLeased(f"{plan.keep[name]} (checkpoint {run}/{name} stays)",
                                                  ref=f"{run}/{name}", holders=[h for h, _ in held])
    return plan


@dataclass(frozen=True)
class Removal:
    """What :func:`remove` did: ``reason`` is ``"removed"`` (``"would be removed"`` in a dry run) or
    why retention keeps the checkpoint (the newest, the newest verified, a parent...). A lease, another
    deletion under way and a checkpoint gone already are not a Removal: :func:`remove` raises."""

    ref: str
    removed: bool
    reason: str

    def as_json(self) -> dict:
        return asdict(self)


def gc_run(storage: Storage, run: str, *, keep_last: int, keep_every: int | None, dry_run: bool, drop_parents: bool,
           sweep: Callable[[], list[str]], verify: Verifier | None = None) -> dict[str, Any]:
    """``ckptd gc RUN``, every way in (``--root`` in this process, ``POST /v1/runs/{run}/gc`` in the
    service): :func:`collect`, then, unless ``dry_run``, stale staging reclaimed by ``sweep`` (the
    caller's sweep: the service's has its settings and metrics). Returns the plan as JSON with
    ``reclaimed_sessions``."""
    plan = collect(storage, run, keep_last=keep_last, keep_every=keep_every, dry_run=dry_run, verify=verify,
                   drop_parents=drop_parents).as_json()
    plan["reclaimed_sessions"] = [] if dry_run else sweep()
    return plan


def remove(storage: Storage, run: str, name: str, *, dry_run: bool = False, verify: Verifier | None = None,
           drop_parents: bool = False) -> Removal:
    """Delete the visible checkpoint ``run/name`` unless rules 3-6 keep it, and say truly which it did:
    removed (or kept by a rule, with the reason); ``CheckpointLeased`` naming the holders when a lease
    holds it (rule 4, read again after the claim on its deletion: :meth:`~.leases.Leases.delete`);
    ``CheckpointBeingDeleted`` while another deletion of it is under way; ``CheckpointNotFound`` when it
    is not visible, or was gone by the time this one claimed it."""
    check_run(run), check_name(name)
    if Visibility(storage).check(run, name) is None:
        raise CheckpointNotFound(f"checkpoint {run}/{name} is not visible", ref=f"{run}/{name}")
    plan = collect(storage, run, keep_last=1, dry_run=dry_run, verify=verify, drop_parents=drop_parents,
                   only={name})
    if name in (plan.delete if dry_run else plan.deleted):
        return Removal(f"{run}/{name}", not dry_run, "would be removed" if dry_run else "removed")
    if name in plan.refused:
        raise plan.refused[name]
    if name not in plan.keep:  # not in the listing any more: deleted by another request meanwhile
        raise CheckpointNotFound(f"checkpoint {run}/{name} is gone already", ref=f"{run}/{name}")
    return Removal(f"{run}/{name}", False, plan.keep[name])


def _known_bad_newest(vis: Visibility, visible: list[Committed], keep_last: int) -> dict[str, str]:
    """The checkpoints known to be bad (name -> why) among those rule 2 has to judge: every checkpoint
    of a step from the newest down to the ``keep_last``-th newest step held by one not known to be
    bad. Older ones cannot change the plan, so their records are not read."""
    by_step: dict[int, list[Committed]] = {}
    for c in visible:
        if c.step is not None:
            by_step.setdefault(c.step, []).append(c)
    bad: dict[str, str] = {}
    good_steps = 0
    for step in sorted(by_step, reverse=True):
        if good_steps >= keep_last:
            break
        held = False
        for c in by_step[step]:
            why = vis.known_bad(c)
            if why is None:
                held = True
            else:
                bad[c.name] = why
        good_steps += held
    return bad


def _newest_verified(storage: Storage, vis: Visibility, visible: list, verify: Verifier
                     ) -> tuple[str | None, str | None, dict[str, str]]:
    """The newest trainer checkpoint that verifies, how that was established, and why each newer one
    did not. A record is relied on only while it vouches for exactly the stored bytes. A root that
    cannot be written (the fresh verification's record refused) raises its ``StorageReadOnly`` or
    ``StorageFull``: nothing could be deleted there anyway, and no checkpoint is to blame."""
    failed: dict[str, str] = {}
    trainer = [c for c in visible if c.derived_from is None and c.step is not None]
    for c in reversed(trainer):  # newest first
        try:
            files = sorted(vis.manifest(c).files)
            if record_holds(storage, c, read_record(storage, c.run, c.name), files):
                return c.name, "recorded verification of the stored bytes", failed
            rec = verify(c.run, c.name)
        except (StorageReadOnly, StorageFull):  # the root cannot record (nor delete): its reason, not the checkpoint's
            raise
        except CkptdError as e:
            failed[c.name] = e.message
            continue
        if rec.ok and rec.manifest_xxh3 == c.digest:
            return c.name, "verified now", failed
        failed[c.name] = "; ".join(rec.problems[:3]) or "verification failed"
    return None, None, failed


class RetentionPolicy:
    """Collects a run after each commit when the service has a retention policy; one pass per run at a time."""

    def __init__(self, storage: Storage, keep_last: int | None, keep_every: int | None = None,
                 verify: Verifier | None = None,
                 record: Callable[[str, dict, str, bool], None] | None = None) -> None:
        """``keep_last`` None: no policy (``CKPTD_RETENTION_KEEP_LAST`` unset). ``record``: told every decision
        (run, ``RetentionPlan.as_json()``, who asked, dry run)."""
        self.storage, self.keep_last, self.keep_every = storage, keep_last, keep_every
        self.verify, self.record = verify, record
        self._busy: set[str] = set()  # runs being collected
        self._again: set[str] = set()  # of those, runs committed to meanwhile
        self._lock = threading.Lock()

    def after_commit(self, run: str) -> None:
        """Collect ``run`` in a thread; a commit while it runs has it collect once more after (its
        listing may predate that commit)."""
        if self.keep_last is None:  # no policy
            return
        with self._lock:
            if run in self._busy:
                self._again.add(run)
                return
            self._busy.add(run)
        threading.Thread(target=self._collect_while_asked, args=(run,), name=f"ckptd-gc-{run}", daemon=True).start()

    def _collect_while_asked(self, run: str) -> None:
        while True:
            self._collect(run)
            with self._lock:
                if run not in self._again:
                    self._busy.discard(run)
                    return
                self._again.discard(run)

    def _collect(self, run: str) -> None:
        try:
            plan = collect(self.storage, run, keep_last=self.keep_last or 1, keep_every=self.keep_every,
                           verify=self.verify)
            if self.record is not None:
                self.record(run, plan.as_json(), "retention policy", False)
            if plan.deleted:
                log.info("retention: deleted %s from run %s", ", ".join(plan.deleted), run)
        except Exception:  # noqa: BLE001 - retention never breaks a save; the next commit tries again
            log.exception("retention of run %s failed", run)
