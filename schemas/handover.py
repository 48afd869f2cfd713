"""Co-located uploads' wire, as both sides read it: a rank on the service's host hands a data file over
as a memory file sealed against any change, through a Unix socket (``ckptd.service.local_uploads``,
``ckptd_client._handover``).

Whoever can bind the socket's path receives what a rank sends there (a restarted service frees it; a
service whose temporary directory is private leaves the ranks' path free for anyone), so the rank sends
nothing, no token and no byte, before the peer proves it is the service that answered its session over
HTTP. The proof is a key only that service and the session's writer hold: the session's answer carries
``local_key`` (:func:`session_key`: the service's per-process secret over the principal, run, name and
session; an HTTP answer to a principal with write on the run), and it authorizes nothing but that
principal's uploads to that session.

One file per connection, each message one JSON line (all the lines a rank sends at most
:data:`HEADER_BYTES`, sent within the service's one deadline for them):

1. rank: the hello, ``{"principal", "run", "name", "session", "nonce"}`` (``principal`` and the key from
   ``local_key``, :func:`split_key`; a fresh :func:`new_nonce`);
2. service: ``{"proof": prove(key, "service", rank's nonce), "nonce": its own}``; the rank checks it
   (:func:`proven`) and otherwise closes, sending nothing more;
3. rank: the header, ``{"proof": prove(key, "rank", service's nonce), "file", "size", "xxh3"}``, with the
   memory file's descriptor (``SCM_RIGHTS``), carrying at least :data:`SEALS`; with ``"chunks": N``
   the memory file's first ``N`` bytes declare the file's chunks (:mod:`ckptd_schemas.arrival`) and
   its ``size`` bytes follow;
4. service: ``{"status": 200, "result": UploadResult}`` or ``{"status": N, "error": {...}}`` (the error
   body of any route); an error may also answer 1 or 3.

Both sides tell one host from another by :func:`boot_id`.
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import hmac
import json
import re
import secrets
from typing import Literal

__all__ = ["HEADER_BYTES", "SEALS", "boot_id", "is_nonce", "new_nonce", "prove", "proven", "session_key", "split_key"]

#: The lines a rank sends at most (names, nonces, a proof and a digest).
HEADER_BYTES = 16 << 10
#: The seals a handed-over memory file carries: no write, no shrink, no growth.
SEALS = fcntl.F_SEAL_WRITE | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW

_HEX64 = re.compile(r"[0-9a-f]{64}")


def session_key(secret: bytes, principal: str, run: str, name: str, session: str) -> str:
    """``SessionInfo.local_key``: ``PRINCIPAL:KEY``, KEY the service's ``secret`` keyed over the four
    (HMAC-SHA256, hex): one key per principal and session, which the service derives again from a hello."""
    coords = json.dumps([principal, run, name, session]).encode()
    return f"{principal}:{hmac.new(secret, coords, hashlib.sha256).hexdigest()}"


def split_key(local_key: str) -> tuple[str, str] | None:
    """``(principal, key)`` of a ``local_key``; None when it is not one (the rank then uses HTTP)."""
    principal, _, key = local_key.rpartition(":")
    return (principal, key) if principal and _HEX64.fullmatch(key) else None


def new_nonce() -> str:
    """A fresh challenge: 32 random bytes, hex."""
    return secrets.token_hex(32)


def prove(key: str, role: Literal["service", "rank"], nonce: str) -> str:
    """What ``role`` answers to the other side's ``nonce``: HMAC-SHA256 under the session's key of the
    role and the nonce (the roles apart: one side's answer is never the other's)."""
    return hmac.new(bytes.fromhex(key), f"ckptd handover {role} {nonce}".encode(), hashlib.sha256).hexdigest()


def proven(key: str, role: Literal["service", "rank"], nonce: str, proof: object) -> bool:
    """True when ``proof`` is ``prove(key, role, nonce)`` (compared in constant time)."""
    return isinstance(proof, str) and hmac.compare_digest(prove(key, role, nonce).encode(),
                                                          proof.encode("utf-8", "replace"))


def is_nonce(value: object) -> bool:
    """A nonce as :func:`new_nonce` makes them (what either side accepts from the other)."""
    return isinstance(value, str) and _HEX64.fullmatch(value) is not None


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
