"""A load that finds damaged bytes tells the service, so that an auto-resume does not crash-loop.

A rank whose reads fail their digests (``CorruptCheckpoint`` naming a data file) reports the file
(``POST /v1/checkpoints/RUN/NAME/damaged``); the service reads it again with its own checker and,
finding it damaged, records the failed verification: ``RUN/latest`` resolves to the newest good
checkpoint from then on, so a job restarted on ``RUN/latest`` loads that one, after one failure. The
error the load raises says what the service found, and what ``latest`` is now.

Call order: :func:`reported` on the way out of a load, with the checkpoint the load read.
"""

from __future__ import annotations

import logging

from ckptd_schemas import CkptdError, CorruptCheckpoint

from .transport import Transport

__all__ = ["reported"]

log = logging.getLogger("ckptd_client")

REPORT_SECONDS = 600.0  # the service reads the files again: a large file takes a while


def reported(transport: Transport, base: str | None, e: CorruptCheckpoint) -> CorruptCheckpoint:
    """``e``, its message extended with what the service found when the damaged data file it names was
    reported (``base``: ``/v1/checkpoints/RUN/NAME``, the checkpoint the load read; None, or an error
    about no data file: ``e`` as it is)."""
    file = e.details.get("file")
    if base is None or not isinstance(file, str) or file == "load tree":
        return e
    ref = base.removeprefix("/v1/checkpoints/")
    run = ref.split("/", 1)[0]
    try:
        v = transport.request("POST", f"{base}/damaged", json={"files": [file]}, timeout=REPORT_SECONDS)
    except CkptdError as err:
        log.warning("damaged bytes of %s not reported to the service: %s", ref, err)
        return e
    if not isinstance(v, dict):
        return e
    if v.get("damaged"):
        now = f"{run}/latest now resolves to {run}/{v['latest']}" if v.get("latest") else \
            f"{run} has no other checkpoint that is not known to be bad"
        said = f"; the service read file {file!r} again, found it damaged and recorded {ref} as bad: {now}"
    else:
        said = (f"; the service read file {file!r} again and found it intact: the bytes were damaged on their way "
                f"here (a retry may succeed)")
    out = CorruptCheckpoint(e.message + said, **{**e.details, "reported": v})
    out.request_id = e.request_id
    return out
