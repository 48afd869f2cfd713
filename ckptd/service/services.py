"""What the route modules share: the objects ``create_app`` builds once per app.

``create_app`` builds one ``Services`` and hands it to ``upload_routes.upload_router``
and ``read_routes.read_router``; each reads what its routes need from it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..storage import Storage
    from ..store import CheckpointReader
    from ..store.durable import DurableCopier
    from ..store.visibility import Visibility
    from .limits import UploadSlots
    from .local_uploads import LocalUploads
    from ..store import SessionStore
    from .metrics import Metrics
    from ..store.leases import ReadLeases
    from .settings import Settings
    from .workers import Workers

__all__ = ["Services"]


@dataclass(frozen=True)
class Services:
    settings: Settings
    storage: Storage
    metrics: Metrics
    visibility: Visibility
    reader: CheckpointReader
    sessions: SessionStore
    uploads: UploadSlots  # file uploads in progress, per token
    read_leases: ReadLeases
    workers: Workers  # the worker pool (started on first use): reshard jobs, verifications, drills
    durable: DurableCopier | None = None  # the durable tier's copier (--durable), else None
    local: LocalUploads | None = None  # co-located uploads' socket (CKPTD_LOCAL_UPLOADS), else None
