"""Names that end up in storage paths: runs, checkpoint names, files, sessions.

Every name is validated before it touches a path, so no request can reach
outside the storage root (``..``, ``/``, NUL, absolute paths, hidden files).
"""

from __future__ import annotations

import re
from typing import NamedTuple

from .errors import InvalidName

__all__ = ["CheckpointRef", "DCP_METADATA", "LATEST", "RESERVED", "check_file", "check_name", "check_new_name",
           "check_run", "check_session", "linked_name", "parse_ref"]

RUN_RE = re.compile(r"[a-z0-9][a-z0-9._-]{0,127}")
NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
FILE_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
SESSION_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]{0,63}")
LATEST = "latest"
# Reserved object names: ckptd's own records inside a checkpoint.
RESERVED = "__ckptd."  # prefix of every name below; never a state-dict key of the user's
DCP_METADATA = RESERVED + "dcp_metadata"  # DCP's own Metadata, torch.save'd (CkptdStorageWriter)


def _check(kind: str, value: str, pattern: re.Pattern[str]) -> str:
    if not isinstance(value, str) or not pattern.fullmatch(value) or ".." in value:
        raise InvalidName(f"invalid {kind} {value!r}: must match {pattern.pattern}", field=kind, value=str(value)[:200])
    return value


def check_run(run: str) -> str:
    return _check("run", run, RUN_RE)


def check_name(name: str) -> str:
    return _check("name", name, NAME_RE)


def check_new_name(name: str) -> str:
    """A name a new checkpoint may take (a save, a reshard's or an import's output): a valid name
    that is not ``latest`` in any case (``Latest`` would read as the symbolic ref to a user, and be
    the same directory as ``latest`` on a case-insensitive file system)."""
    check_name(name)
    if name.lower() == LATEST:
        raise InvalidName(f"invalid name {name!r}: {LATEST!r} (in any case) names the newest checkpoint of a run; "
                          f"name the checkpoint (e.g. its step)", field="name", value=name)
    return name


def check_file(name: str) -> str:
    return _check("file", name, FILE_RE)


def check_session(sid: str) -> str:
    return _check("session", sid, SESSION_RE)


def linked_name(checkpoint: str, file: str) -> str:
    """The name under which a checkpoint holds ``file`` of the earlier ``checkpoint`` of its run,
    linked rather than written again (incremental saves: ``POST .../files/<name>/link``). Derived
    from both names, so the saver and the service agree on it without asking, two sources never
    share it, and a link of a link stays as short."""
    import xxhash

    return f"ln-{xxhash.xxh3_64_hexdigest(f'{check_name(checkpoint)}/{check_file(file)}'.encode())}.bin"


class CheckpointRef(NamedTuple):
    run: str
    name: str

    def __str__(self) -> str:
        return f"{self.run}/{self.name}"

    @property
    def is_latest(self) -> bool:
        return self.name == LATEST


def parse_ref(ref: str) -> CheckpointRef:
    """``RUN/NAME`` -> CheckpointRef; ``RUN/latest`` is kept symbolic."""
    if not isinstance(ref, str) or ref.count("/") != 1:
        raise InvalidName(f"invalid checkpoint ref {ref!r}: expected RUN/NAME (e.g. gpt/1000)", field="ref", value=str(ref)[:200])
    run, name = ref.split("/")
    return CheckpointRef(check_run(run), check_name(name))
