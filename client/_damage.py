"""A load that finds a damaged checkpoint tells the service, so that an auto-resume does not crash-loop.

A rank whose load fails on the checkpoint itself reports it (``POST /v1/checkpoints/RUN/NAME/damaged``),
whatever part is damaged: a data file whose bytes fail their digests (an object's bytes lie in one),
or its marker, manifest or load tree (``CorruptCheckpoint`` naming ``COMMITTED``, ``manifest`` or
``load tree``). The service checks again with its own checker and, finding it damaged, records the
failed verification: ``RUN/latest`` resolves to the newest good checkpoint from then on, so a job
restarted on ``RUN/latest`` loads that one, after one failure. The error the load raises says what the
service found, and what ``latest`` is now.

Call order: :func:`reported` on the way out of a load, with the checkpoint the load read (or, where
the load failed before it knew, the one the error names).
"""

from __future__ import annotations

import logging

from ckptd_schemas import CkptdError, CorruptCheckpoint

from .transport import Transport

__all__ = ["reported"]

log = logging.getLogger("ckptd_client")

REPORT_SECONDS = 600.0  # the service reads the files again: a large file takes a while


#: The part a ``CorruptCheckpoint``'s ``file`` names when it is not a data file (the report's ``parts``).
PARTS = {"COMMITTED": "marker", "manifest": "manifest", "load tree": "load tree"}


def reported(transport: Transport, base: str | None, e: CorruptCheckpoint) -> CorruptCheckpoint:
    """``e``, its message extended with what the service found when the damaged part it names was
    reported (``base``: ``/v1/checkpoints/RUN/NAME``, the checkpoint the load read; None: the one ``e``
    names, where the load failed before it knew; ``e`` as it is when neither names a checkpoint)."""
    file = e.details.get("file")
    ref = base.removeprefix("/v1/checkpoints/") if base is not None else e.details.get("ref")
    if not isinstance(file, str) or not isinstance(ref, str) or ref.count("/") != 1 or ref.endswith("/latest"):
        return e
    run = ref.split("/", 1)[0]
    part = PARTS.get(file)
    body = {"parts": [part]} if part is not None else {"files": [file]}
    what = f"checked its {part}" if part is not None else f"read file {file!r}"
    try:
        v = transport.request("POST", f"/v1/checkpoints/{ref}/damaged", json=body, timeout=REPORT_SECONDS)
    except CkptdError as err:
        log.warning("damage of %s not reported to the service: %s", ref, err)
        return e
    if not isinstance(v, dict):
        return e
    if v.get("damaged"):
        now = f"{run}/latest now resolves to {run}/{v['latest']}" if v.get("latest") else \
            f"{run} has no other checkpoint that is not known to be bad"
        said = f"; the service {what} again, found it damaged and recorded {ref} as bad: {now}"
    else:
        said = (f"; the service {what} again and found it intact: the "
                f"{'bytes were damaged on their' if part is None else part + ' was damaged on its'} way here (a retry "
                f"may succeed)")
    out = CorruptCheckpoint(e.message + said, **{**e.details, "reported": v})
    out.request_id = e.request_id
    return out
