"""``ckptd gc RUN --keep-last N [--keep-every K] [--dry-run]``: retention (``ckptd.store.retention``)."""

from __future__ import annotations

import argparse
import json

from .backends import HttpBackend, RootBackend, open_backend, require_run
from .target import resolve_target

__all__ = ["add_parsers"]


def cmd_gc(args: argparse.Namespace) -> int:
    b = open_backend(resolve_target(args))
    try:
        if isinstance(b, HttpBackend):
            plan = b.client.gc(args.run, keep_last=args.keep_last, keep_every=args.keep_every, dry_run=args.dry_run)
        else:
            from ..store.retention import collect

            plan = collect(b.reader.storage, args.run, keep_last=args.keep_last, keep_every=args.keep_every,
                           dry_run=args.dry_run).as_json()
        if not plan["keep"] and not plan["delete"] and not plan["deleted"]:
            require_run(b, args.run)  # nothing of it: say whether the run exists at all
        if isinstance(b, RootBackend) and not args.dry_run:
            from ..store import SessionStore

            plan["reclaimed_sessions"] = SessionStore(b.reader.storage).reclaim_stale(args.stale_ttl)
    finally:
        b.close()
    if args.json:
        print(json.dumps(plan, indent=2))
        return 0
    verb = "would delete" if args.dry_run else "deleted"
    gone = plan["delete"] if args.dry_run else plan["deleted"]
    for name in gone:
        print(f"{verb} {args.run}/{name}")
    for name, why in plan["keep"].items():
        print(f"keep   {args.run}/{name}  ({why})")
    for sid in plan.get("reclaimed_sessions", []):
        print(f"reclaimed stale staging {sid}")
    return 0


def add_parsers(sub: argparse._SubParsersAction, add_target) -> None:
    s = sub.add_parser("gc", help="delete old committed checkpoints of a run (retention), reclaim stale staging")
    s.add_argument("run")
    s.add_argument("--keep-last", type=int, required=True, metavar="N", help="keep the N newest steps")
    s.add_argument("--keep-every", type=int, metavar="K", help="also keep every step that is a multiple of K")
    s.add_argument("--dry-run", action="store_true", help="list what would go; delete nothing")
    s.add_argument("--stale-ttl", type=float, default=6 * 3600.0, metavar="S",
                   help="reclaim uncommitted staging older than S seconds (default 6 h)")
    s.add_argument("--json", action="store_true")
    add_target(s)
    s.set_defaults(func=cmd_gc)
