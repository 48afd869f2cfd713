"""The one interface a command works through: a storage root directly, or a running service over HTTP.

:class:`Backend` is every call a command makes: list, read a manifest and a byte range, lease what it
reads, write an upload session (``ckptd import``), retention (``gc``, ``rm``), conversions (reshard,
drill) and the checks around them. It is implemented once over a root (:mod:`.root_backend`: the
store's own code in this process) and once over HTTP (:mod:`.http_backend`: ``CatalogClient``, the
service's code in its process), and :func:`ckptd.cli.target.open_backend` alone chooses which. A
command never asks which one it holds.

Call order for a command: ``open_backend(resolve_target(args))``, the calls, ``close()``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, ContextManager, Protocol

from ckptd_schemas import Manifest, NotFound

if TYPE_CHECKING:  # annotations only: the API bodies are not built for commands that never list
    from ckptd_schemas import CheckpointSummary, RunSummary
    from ckptd_schemas.api import SkippedCheckpoint
    from ckptd_schemas.readplan import ReadFn

    from ..interop.dcp_import import ImportTarget
    from ..reshard.models import ReshardRequest

__all__ = ["Backend", "Bar", "DEFAULT_WORKERS", "ReshardOutcome", "require_run"]


class Bar(Protocol):
    """A command's progress bar, started once the total is known (:class:`ckptd.cli.output.Bar`)."""

    quiet: bool  # --json: nothing but the answer on stdout, no bar or note on stderr

    def start(self, total: int) -> Callable[[int], None] | None: ...


#: ``--write-plan`` without ``--workers``: one pod per work unit, up to this many. Each pod cuts the whole
#: job's units again from the source manifest (O(target chunks)), so pods beyond a few dozen add that cost
#: more than they take work away.
DEFAULT_WORKERS = 32


@dataclass
class ReshardOutcome:
    """What a conversion did (both backends fill it): the result as a job records it
    (``ReshardResult.as_json``: with the engine that ran and why), and, offline, the per-rank preview
    of the plan."""

    result: dict[str, Any]
    source: str
    spec: str
    per_rank_bytes: list[int] = field(default_factory=list)
    imbalance: float | None = None


class Backend(Protocol):
    where: str  # the root or URL, for messages

    # -- reads ------------------------------------------------------------------------------------
    def list_runs(self) -> list[RunSummary]: ...
    def list_checkpoints(self, run: str) -> list[CheckpointSummary]: ...
    def run_names(self) -> list[str]: ...
    def manifest(self, run: str, name: str) -> Manifest: ...
    def resolve(self, run: str, name: str) -> tuple[Manifest, list[SkippedCheckpoint]]: ...
    def status(self, manifest: Manifest) -> tuple[str | None, str | None]:
        """``verified``, ``pending`` or ``known bad`` and why (``records.status_of``, where the store is);
        None when the checkpoint went meanwhile or the service does not say."""
        ...

    def byte_source(self, manifest: Manifest) -> ReadFn:
        """The byte source of ``manifest``'s data files (``ckptd export``, ``ckptd verify``)."""
        ...

    def lease(self, manifest: Manifest, what: str) -> ContextManager[object]: ...

    # -- checks -----------------------------------------------------------------------------------
    def check_source(self, manifest: Manifest) -> None:
        """Before a conversion reads ``manifest``'s checkpoint here: the one checker's verdict on it."""
        ...

    def verify_in_service(self, ref: str) -> dict[str, Any]:
        """The service's own verification of ``ref`` (its worker reads and checks), as its record."""
        ...

    def verify(self, manifest: Manifest, progress: Callable[[int], None] | None) -> dict[str, Any]:
        """Every byte, chunk and tensor of ``manifest``'s checkpoint checked by the one checker, and its
        load tree against the marker's (what loading ranks check their pieces against), in this process;
        nothing recorded. The answer has ``ref``, ``ok``, ``files``, ``tensors``, ``chunks``,
        ``bytes_read`` and ``problems``."""
        ...

    # -- writes -----------------------------------------------------------------------------------
    def require_new(self, run: str, name: str) -> None:
        """``AlreadyCommitted`` (or ``Conflict``) at once when ``run/name`` is taken: ``ckptd import``
        asks before it reads its source, where the session's open would ask only after."""
        ...

    def import_target(self) -> ImportTarget:
        """An upload session for ``ckptd import`` (one rank; ``interop.dcp_import.ImportTarget``)."""
        ...

    def gc(self, run: str, *, keep_last: int, keep_every: int | None, dry_run: bool, drop_parents: bool,
           stale_ttl: float, dead_after: float) -> dict[str, Any]:
        """Retention's plan for ``run`` (``RetentionPlan.as_json()``), carried out unless ``dry_run``;
        then stale staging reclaimed (``reclaimed_sessions``)."""
        ...

    def remove(self, run: str, name: str, *, dry_run: bool) -> dict[str, Any]:
        """One checkpoint removed unless retention protects it (``Removal`` as JSON)."""
        ...

    # -- conversions ------------------------------------------------------------------------------
    def reshard_preview(self, req: ReshardRequest) -> Any:
        """The plan's per-rank preview (``reshard.preview.Preview``), writing nothing."""
        ...

    def write_plan(self, req: ReshardRequest, uri: str, workers: int | None) -> dict[str, Any]:
        """``--write-plan``: the plan written for ``workers`` ``ckptd reshard-worker`` pods (None:
        :data:`DEFAULT_WORKERS` at most); nothing converted."""
        ...

    def reshard(self, req: ReshardRequest, *, bar: Bar) -> ReshardOutcome:
        """Convert and commit (``ckptd.reshard.jobs``: ``plan_conversion``, then ``convert``)."""
        ...

    def drill(self, ref: str, layouts: list[str], *, jobs: int, bar: Bar) -> dict[str, Any]:
        """The drill's record (``DrillRecord`` as JSON), recorded beside the checkpoint."""
        ...

    def close(self) -> None: ...


def require_run(b: Backend, run: str) -> None:
    """A command about RUN (``ls RUN``, ``gc RUN``) that found nothing of it says so (exit 1) when
    the run is not there, instead of printing nothing. Called only once the command found nothing."""
    if run not in b.run_names():
        raise NotFound(f"no such run {run!r} in {b.where}", run=run)
