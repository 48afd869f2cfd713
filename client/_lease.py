"""Read leases taken by a client: a reader the service does not see must say it is still reading.

The service renews a checkpoint's lease on every read it serves; a reader of the service's files
(direct reads), a rank waiting for the others, or a tool between two requests makes no read for a
while, so it holds a lease of its own for as long as it reads. Torch-free: command-line tools use it
through :meth:`ckptd_client.CatalogClient.lease`.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import uuid
from typing import Iterator

from ckptd_schemas import CkptdError

from .transport import Transport

__all__ = ["LoadLease", "read_lease"]

log = logging.getLogger("ckptd_client")


@contextlib.contextmanager
def read_lease(transport: Transport, base: str, holder: str | None = None) -> Iterator[str | None]:
    """Hold a read lease on the checkpoint at ``base`` (``/v1/checkpoints/RUN/NAME``) for the block:
    taken at once, renewed every third of the period the service grants, released at the end. A
    ``latest`` name is resolved by the service once, when the lease is taken, and the lease stays on
    that checkpoint; the block receives its ``RUN/NAME``. Every request of the block under the
    checkpoint names the lease (``Transport.leased``), so the service renews it instead of leasing the
    checkpoint on its own for a while after each read: once released, nothing of this read keeps the
    checkpoint from ``rm`` or gc. A service that grants no lease (leases off, or a release without the
    route) leaves the block as it was, receiving None. ``holder``: the name of the lease (a load names
    it before it resolves ``latest``, so that its first read is under it too)."""
    holder = holder or uuid.uuid4().hex
    try:
        answer = transport.request("PUT", f"{base}/leases/{holder}")
    except CkptdError as e:
        log.debug("no read lease on %s: %s", base, e)
        yield None
        return
    answer = answer if isinstance(answer, dict) else {}
    seconds = float(answer.get("seconds", 0) or 0)
    ref = str(answer.get("ref") or base.removeprefix("/v1/checkpoints/"))
    path = f"/v1/checkpoints/{ref}/leases/{holder}"
    stop = threading.Event()

    def renew() -> None:
        while not stop.wait(seconds / 3):
            try:
                transport.request("PUT", path, retry=False)
            except CkptdError as e:  # the next renewal tries again; the reads raise if it is gone
                log.debug("read lease on %s not renewed: %s", ref, e)

    t = threading.Thread(target=renew, name="ckptd-read-lease", daemon=True) if seconds > 0 else None
    if t is not None:
        t.start()
    try:
        with transport.leased(f"/v1/checkpoints/{ref}", holder):
            yield ref
    finally:
        stop.set()
        if t is not None:
            t.join(timeout=5)
        with contextlib.suppress(CkptdError):
            transport.request("DELETE", path, retry=False)


class LoadLease(contextlib.ExitStack):
    """The one read lease of a load (``load_into``, a DCP reader's rank), from its first request to its end.

    Call order: construct it before the first request of the load (every request under
    ``/v1/checkpoints/RUN/NAME`` names the lease from then on, the manifest of ``latest`` included),
    :meth:`hold` once the manifest has said which checkpoint ``NAME`` is (the lease is taken there and
    renewed while the load reads, :func:`read_lease`), ``close`` when the load returns: the service
    then leases nothing on this load's account, and ``rm`` right after succeeds."""

    def __init__(self, transport: Transport, run: str, name: str) -> None:
        super().__init__()
        self.transport, self.holder = transport, uuid.uuid4().hex
        self.base: str | None = None  # the checkpoint held, once resolved
        self.enter_context(transport.leased(f"/v1/checkpoints/{run}/{name}", self.holder))

    def hold(self, base: str) -> None:
        """Take (and renew) the lease on the checkpoint at ``base``, the resolved one."""
        self.base = base
        self.enter_context(read_lease(self.transport, base, self.holder))
