"""Named crash points for the fault tests (DESIGN §2 item 6).

``CKPTD_CRASH_AT=<point>`` in a server's environment makes that process
SIGKILL itself when it reaches ``<point>``: the tests use it to kill the
service between the protocol's steps, exactly where a real crash could land.
Unset (always, outside tests) it costs one dict lookup.
"""

from __future__ import annotations

import os
import signal

__all__ = ["CRASH_POINTS", "crash_point"]

CRASH_POINTS = (
    "upload-mid-stream",      # part of a file received, not yet committed to storage
    "upload-before-digest",   # file committed, its digest sidecar not yet written
    "index-written",          # a rank's index stored, commit not yet attempted
    "commit-before-manifest", # all indexes merged, manifest not yet written
    "commit-before-marker",   # manifest durable, COMMITTED not yet created
    "commit-after-marker",    # COMMITTED created, response not yet sent
)


def crash_point(name: str) -> None:
    if os.environ.get("CKPTD_CRASH_AT") == name:
        os.kill(os.getpid(), signal.SIGKILL)
