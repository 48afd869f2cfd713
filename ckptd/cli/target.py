"""Where a command works: a storage root directly, or a running service. Decided here and nowhere else.

Precedence, the same for every command that reads or writes checkpoints:

1. ``--server URL`` or ``--root PATH`` (mutually exclusive);
2. without either, ``$CKPTD_URL`` when it is set (a running service sees leases and open
   sessions that a direct reader of the root would not);
3. else ``$CKPTD_ROOT``, else ``./ckptd-data``.

A root is opened by :func:`open_root`: commands that only read (``ls``, ``show``, ``verify``,
``export``, ``gc --dry-run``...) pass ``create=False``, so a mistyped local path is refused as
"no such root" instead of being created empty; a URL whose scheme has no installed fsspec
backend is refused naming the package to install.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from ckptd_schemas import InvalidRequest, NotFound

if TYPE_CHECKING:
    from ..storage import Storage

__all__ = ["DEFAULT_ROOT", "Target", "add_target", "open_root", "resolve_target"]

DEFAULT_ROOT = "./ckptd-data"


@dataclass(frozen=True)
class Target:
    """Exactly one of ``server`` (a URL) and ``root`` (a path or fsspec URL) is set."""

    server: str | None = None
    root: str | None = None

    def __str__(self) -> str:
        return self.server or self.root or ""


def add_target(p: argparse.ArgumentParser) -> None:
    g = p.add_mutually_exclusive_group()
    g.add_argument("--root", help="storage root (directory or fsspec URL); default $CKPTD_ROOT or ./ckptd-data, "
                                  "when $CKPTD_URL is not set")
    g.add_argument("--server", help="URL of a running ckptd service (default $CKPTD_URL when set)")


def resolve_target(args: argparse.Namespace) -> Target:
    """The one rule (module docstring): flags, then ``$CKPTD_URL``, then ``$CKPTD_ROOT``, then the default."""
    if getattr(args, "server", None):
        return Target(server=args.server)
    if getattr(args, "root", None):
        return Target(root=args.root)
    if os.environ.get("CKPTD_URL"):
        return Target(server=os.environ["CKPTD_URL"])
    return Target(root=os.environ.get("CKPTD_ROOT") or DEFAULT_ROOT)


def open_root(root: str, *, create: bool) -> "Storage":
    """Open the storage root ``root``; with ``create=False`` a local directory must already exist."""
    from ..store.tiers import TIERED, open_root as open_tiers, split_tiered

    if root.startswith(TIERED):  # a fast tier and its durable tier, as `ckptd serve --durable` sees them
        try:
            parts = split_tiered(root)
        except ValueError as e:
            raise InvalidRequest(str(e), root=root, field="root") from e
    else:
        parts = (root,)
    for part in parts:
        path = Path(part)
        if "://" not in part and not create and not path.is_dir():
            what = "is not a directory" if path.exists() else "does not exist"
            raise NotFound(f"no such root: {part} {what} (pass --root PATH or --server URL)", root=part)
    try:
        return open_tiers(root)
    except ImportError as e:
        scheme = root.split("://", 1)[0]
        raise InvalidRequest(f"no storage backend for {scheme}:// roots: {e} (install the fsspec package for "
                             f"{scheme!r}, e.g. pip install 's3fs' for s3://)", root=root, field="root") from e
    except ValueError as e:  # fsspec: "Protocol not known"
        raise InvalidRequest(f"cannot open root {root}: {e}", root=root, field="root") from e
