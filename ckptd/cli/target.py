"""Where a command works: a storage root directly, or a running service. Decided here and nowhere else:
:func:`open_backend` gives the command its :class:`~.backends.Backend`, one interface for both.

Precedence, the same for every command that reads or writes checkpoints:

1. ``--server URL`` or ``--root PATH`` (mutually exclusive);
2. without either, ``$CKPTD_URL`` when it is set (a running service sees leases and open
   sessions that a direct reader of the root would not);
3. else ``$CKPTD_ROOT``, else ``./ckptd-data``.

A root is opened by :func:`ckptd.cli.root_backend.open_checked_root`: commands that only read (``ls``,
``show``, ``verify``, ``export``, ``gc --dry-run``...) open it read-only, so a mistyped local path
is refused as "no such root" instead of being created empty.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING


if TYPE_CHECKING:
    from .backends import Backend

__all__ = ["DEFAULT_ROOT", "Target", "add_target", "looked_in", "open_backend", "resolve_target"]

DEFAULT_ROOT = "./ckptd-data"


@dataclass(frozen=True)
class Target:
    """Exactly one of ``server`` (a URL) and ``root`` (a path or fsspec URL) is set; ``source`` says
    which step of the rule chose it (``--server``, ``--root``, ``$CKPTD_URL``, ``$CKPTD_ROOT`` or the
    default)."""

    server: str | None = None
    root: str | None = None
    source: str = "the default"

    def __str__(self) -> str:
        return self.server or self.root or ""

    def describe(self) -> str:
        """Where a command looked, and why there: what a command that finds nothing says."""
        why = self.source if self.source != "the default" else \
            "the default (no --server, --root, $CKPTD_URL or $CKPTD_ROOT set)"
        return f"{'service' if self.server else 'root'} {self}, from {why}"


def add_target(p: argparse.ArgumentParser) -> None:
    g = p.add_mutually_exclusive_group()
    g.add_argument("--root", help="storage root (directory or fsspec URL); default $CKPTD_ROOT or ./ckptd-data, "
                                  "when $CKPTD_URL is not set")
    g.add_argument("--server", help="URL of a running ckptd service (default $CKPTD_URL when set)")


def resolve_target(args: argparse.Namespace) -> Target:
    """The one rule (module docstring): flags, then ``$CKPTD_URL``, then ``$CKPTD_ROOT``, then the default."""
    if getattr(args, "server", None):
        return Target(server=args.server, source="--server")
    if getattr(args, "root", None):
        return Target(root=args.root, source="--root")
    if os.environ.get("CKPTD_URL"):
        return Target(server=os.environ["CKPTD_URL"], source="$CKPTD_URL")
    if os.environ.get("CKPTD_ROOT"):
        return Target(root=os.environ["CKPTD_ROOT"], source="$CKPTD_ROOT")
    return Target(root=DEFAULT_ROOT)


def looked_in(args: argparse.Namespace) -> str | None:
    """:meth:`Target.describe` for a command that takes a target (None for one that does not: serve)."""
    return resolve_target(args).describe() if hasattr(args, "server") or hasattr(args, "root") else None


def open_backend(target: Target, *, create: bool = False) -> "Backend":
    """The :class:`~.backends.Backend` for ``target``: over HTTP for a server, else over the root (opened
    read-only unless ``create``: a command that writes, ``ckptd import``, makes a new root)."""
    if target.server:
        from .http_backend import HttpBackend

        return HttpBackend(target.server)
    from .root_backend import RootBackend

    return RootBackend(target.root or DEFAULT_ROOT, create=create)
