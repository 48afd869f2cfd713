"""Retention over HTTP and as a service policy; read leases on manifests.

* ``POST /v1/runs/{run}/gc`` (admin): ``ckptd gc RUN --server``; the same rules
  as offline (``ckptd.store.retention``), then reclaims stale staging.
* ``DELETE /v1/checkpoints/{run}/{name}`` (write): ``ckptd rm RUN/NAME --server``, a
  trainer's own removal (Lightning's ``remove_checkpoint``); retention's protections
  hold (the newest, the newest verified, leased ones, parents of other runs'
  checkpoints): a protected checkpoint stays and the answer says why.
* Policy: with ``CKPTD_RETENTION_KEEP_LAST`` set, the run of every checkpoint
  that commits through this service is collected right after the commit (in
  the background; a failure is logged and changes nothing visible).
* Read leases: serving a manifest, a read plan or file bytes leases that
  checkpoint for ``CKPTD_READ_LEASE_SECONDS``, so gc does not delete it under a
  load that is still fetching its files (renewed at most every half lease per
  replica); a reader that fetches nothing through the service for a while
  (direct reads) holds its own lease (``PUT .../leases/{holder}``) and renews it.
"""

from __future__ import annotations

import logging
import re
import threading
import time
import uuid
from typing import Any, Callable

from fastapi import APIRouter
from pydantic import BaseModel, ConfigDict, Field
from starlette.concurrency import run_in_threadpool

from ckptd_schemas import check_run

from ..storage import Storage
from ..store import SessionStore
from ..store.leases import Leases
from ..store.retention import Verifier, collect, remove
from .settings import Settings

__all__ = ["GcRequest", "ReadLeases", "RemovalBody", "RetentionPolicy", "gc_router"]

log = logging.getLogger("ckptd.service")


class GcRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    keep_last: int = Field(ge=1, le=1_000_000, description="keep the N newest steps")
    keep_every: int | None = Field(None, ge=1, le=1_000_000_000, description="also keep multiples of K")
    dry_run: bool = False
    drop_parents: bool = Field(False, description=(
        "also delete checkpoints that a visible checkpoint of another run names as its parent"))


class RemovalBody(BaseModel):
    """The answer to ``DELETE /v1/checkpoints/{run}/{name}`` (``ckptd.store.retention.Removal``)."""

    ref: str
    removed: bool
    reason: str = Field(description="'removed' ('would be removed' in a dry run), or why retention keeps it")


#: Told every decision (run, ``RetentionPlan.as_json()``, who asked, dry run): ``gc_log.GcLog.record``.
DecisionLog = Callable[[str, dict[str, Any], str, bool], None]


def gc_router(storage: Storage, settings: Settings, verify: Verifier | None = None,
              record: DecisionLog | None = None) -> APIRouter:
    router = APIRouter(tags=["retention"])

    @router.post("/v1/runs/{run}/gc")
    async def run_gc(run: str, body: GcRequest) -> dict:
        check_run(run)

        def work() -> dict:
            plan = collect(storage, run, keep_last=body.keep_last, keep_every=body.keep_every,
                           dry_run=body.dry_run, verify=verify, drop_parents=body.drop_parents).as_json()
            if record is not None:
                record(run, plan, "POST /v1/runs/{run}/gc", body.dry_run)
            if not body.dry_run:
                plan["reclaimed_sessions"] = SessionStore(storage, dead_after=settings.dead_session_after).reclaim_stale(
                    settings.stale_session_ttl)
            return plan

        return await run_in_threadpool(work)

    @router.delete("/v1/checkpoints/{run}/{name}", response_model=RemovalBody)
    async def remove_checkpoint(run: str, name: str, dry_run: bool = False) -> RemovalBody:
        out = await run_in_threadpool(remove, storage, run, name, dry_run=dry_run, verify=verify)
        return RemovalBody(**out.as_json())

    return router


class RetentionPolicy:
    """Collects a run after each commit when the service has a retention policy; one pass per run at a time."""

    def __init__(self, storage: Storage, settings: Settings, verify: Verifier | None = None,
                 record: DecisionLog | None = None) -> None:
        self.storage, self.settings, self.verify, self.record = storage, settings, verify, record
        self._busy: set[str] = set()  # runs being collected
        self._again: set[str] = set()  # of those, runs committed to meanwhile
        self._lock = threading.Lock()

    @property
    def enabled(self) -> bool:
        return self.settings.retention_keep_last is not None

    def after_commit(self, run: str) -> None:
        """Collect ``run`` in a thread; a commit while it runs has it collect once more after (its
        listing may predate that commit)."""
        if not self.enabled:
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
            plan = collect(self.storage, run, keep_last=self.settings.retention_keep_last or 1,
                           keep_every=self.settings.retention_keep_every, verify=self.verify)
            if self.record is not None:
                self.record(run, plan.as_json(), "retention policy", False)
            if plan.deleted:
                log.info("retention: deleted %s from run %s", ", ".join(plan.deleted), run)
        except Exception:  # noqa: BLE001 - retention never breaks a save; the next commit tries again
            log.exception("retention of run %s failed", run)


_HOLDER = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,127}")  # a reader's lease name, as the lease routes take


class ReadLeases:
    """Leases served checkpoints for a while; at most one storage write per checkpoint per half lease."""

    def __init__(self, storage: Storage, seconds: float) -> None:
        self.leases, self.seconds = Leases(storage), seconds
        self.holder = f"reader-{uuid.uuid4().hex[:12]}"  # this replica
        self._renewed: dict[tuple[str, str], float] = {}
        self._lock = threading.Lock()

    def touch(self, run: str, name: str, holder: str | None = None) -> None:
        """A read of ``run/name``: renew the reader's own lease when the request names one
        (``X-Ckptd-Lease``: released by the reader when it is done, so nothing of its read outlives
        it), else this replica's lease on the checkpoint, which runs a while after the last read."""
        if self.seconds <= 0:
            return
        if holder is not None and not _HOLDER.fullmatch(holder):
            holder = None  # not a name a lease can have: as a read without one
        now = time.monotonic()
        key = (run, name, holder or "")
        with self._lock:
            if now - self._renewed.get(key, -1e18) < self.seconds / 2:
                return
            self._renewed[key] = now
            if len(self._renewed) > 10_000:
                self._renewed = {k: v for k, v in self._renewed.items() if now - v < self.seconds}
        if holder is not None:
            self.hold(run, name, holder)
            return
        # Renewed at most every half lease, so each renewal runs one and a half leases: a read
        # keeps the checkpoint for at least a whole lease after it, whenever the last renewal was.
        self.leases.acquire(run, name, self.holder, ttl=1.5 * self.seconds)

    def hold(self, run: str, name: str, holder: str) -> None:
        """A reader's own lease, for one lease period from now (the reader renews it)."""
        if self.seconds > 0:
            self.leases.acquire(run, name, f"client-{holder}", ttl=self.seconds)

    def release(self, run: str, name: str, holder: str) -> None:
        self.leases.release(run, name, f"client-{holder}")
