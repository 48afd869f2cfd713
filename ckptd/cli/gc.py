"""``ckptd gc RUN --keep-last N [--keep-every K] [--dry-run]``: retention (``ckptd.store.retention``)."""

from __future__ import annotations

import argparse
import json

from ckptd_schemas import NotFound

from .target import open_root, resolve_target

__all__ = ["add_parsers"]


def cmd_gc(args: argparse.Namespace) -> int:
    where = resolve_target(args)
    if where.server:
        from ckptd_client import CatalogClient

        with CatalogClient(where.server, retry_seconds=5.0, retry_refused=False) as client:
            if args.run not in {r.run for r in client.list_runs()}:
                raise NotFound(f"no such run {args.run!r} at {where.server}", run=args.run)
            plan = client.gc(args.run, keep_last=args.keep_last, keep_every=args.keep_every, dry_run=args.dry_run)
    else:
        from ..store import CheckpointReader
        from ..store.retention import collect

        storage = open_root(where.root, create=False)
        if args.run not in {r.run for r in CheckpointReader(storage).list_runs()}:
            raise NotFound(f"no such run {args.run!r} in {where.root}", run=args.run)
        plan = collect(storage, args.run, keep_last=args.keep_last, keep_every=args.keep_every,
                       dry_run=args.dry_run).as_json()
        if not args.dry_run:
            from ..store import SessionStore

            plan["reclaimed_sessions"] = SessionStore(storage).reclaim_stale(args.stale_ttl)
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
