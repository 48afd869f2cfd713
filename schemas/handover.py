"""Co-located uploads' wire, as both sides read it: a rank on the service's host hands a data file over
as a memory file sealed against any change, through a Unix socket (``ckptd.service.local_uploads``,
``ckptd_client._handover``).

One file per connection: the rank sends one header line (JSON: ``token``, ``run``, ``name``,
``session``, ``file``, ``xxh3``; at most :data:`HEADER_BYTES`) with the memory file's descriptor
(``SCM_RIGHTS``); the service answers one line, ``{"status": 200, "result": UploadResult}`` or
``{"status": N, "error": {...}}`` (the error body of any route). The memory file carries at least
:data:`SEALS`. Both sides tell one host from another by :func:`boot_id`.
"""

from __future__ import annotations

import fcntl
import functools

__all__ = ["HEADER_BYTES", "SEALS", "boot_id"]

#: A header line at most (a token, names and a digest).
HEADER_BYTES = 16 << 10
#: The seals a handed-over memory file carries: no write, no shrink, no growth.
SEALS = fcntl.F_SEAL_WRITE | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW


@functools.cache
def boot_id() -> str | None:
    """This host's kernel (``/proc/sys/kernel/random/boot_id``), as the service names its host in a
    session's answer and a rank compares; None where there is none. Read once per process: it is
    fixed until the host reboots."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip() or None
    except OSError:
        return None
