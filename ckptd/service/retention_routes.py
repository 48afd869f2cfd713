"""Retention over HTTP (the policy after each commit is ``store.retention.RetentionPolicy``; the
leases a read takes are ``store.leases.ReadLeases``).

* ``POST /v1/runs/{run}/gc`` (admin): ``ckptd gc RUN --server``; the same rules
  as offline (``ckptd.store.retention``), then reclaims stale staging.
* ``DELETE /v1/checkpoints/{run}/{name}`` (write): ``ckptd rm RUN/NAME --server``, a
  trainer's own removal (Lightning's ``remove_checkpoint``); retention's protections
  hold (the newest, the newest verified, leased ones, parents of other runs'
  checkpoints): a protected checkpoint stays and the answer says why.
* Policy: with ``CKPTD_RETENTION_KEEP_LAST`` set, the run of every checkpoint
  that commits through this service is collected right after the commit (in
  the background; a failure is logged and changes nothing visible).
* Read leases (``ckptd.store.leases`` decides them): a load holds its own lease
  (``PUT .../leases/{holder}``, owned by its token) while it reads; file bytes
  served to a request that names none lease the checkpoint for
  ``CKPTD_READ_LEASE_SECONDS`` after the read; reading metadata takes none.
"""

from __future__ import annotations

import logging
from typing import Any, Callable

from fastapi import APIRouter
from pydantic import BaseModel, ConfigDict, Field

from ckptd_schemas import check_run

from ..storage import Storage
from ..store.retention import Verifier, gc_run, remove

__all__ = ["DecisionLog", "GcRequest", "RemovalBody", "gc_router"]

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


def gc_router(storage: Storage, sweep: Callable[[], list[str]], verify: Verifier | None,
              record: DecisionLog) -> APIRouter:
    """The routes; ``sweep`` is the service's own stale-session sweep (its settings, its metrics)."""
    router = APIRouter(tags=["retention"])

    # plain functions: they read and delete storage, and FastAPI runs them in its thread pool
    @router.post("/v1/runs/{run}/gc")
    def run_gc(run: str, body: GcRequest) -> dict:
        check_run(run)
        plan = gc_run(storage, run, keep_last=body.keep_last, keep_every=body.keep_every, dry_run=body.dry_run,
                      drop_parents=body.drop_parents, sweep=sweep, verify=verify)
        record(run, plan, "POST /v1/runs/{run}/gc", body.dry_run)
        return plan

    @router.delete("/v1/checkpoints/{run}/{name}", response_model=RemovalBody)
    def remove_checkpoint(run: str, name: str, dry_run: bool = False) -> RemovalBody:
        return RemovalBody(**remove(storage, run, name, dry_run=dry_run, verify=verify).as_json())

    return router
