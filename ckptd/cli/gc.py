"""Retention (``ckptd.store.retention``) from the command line.

``ckptd gc RUN --keep-last N [--keep-every K] [--dry-run] [--drop-parents]``: the run's policy.
``ckptd rm RUN/NAME [--dry-run]``: one checkpoint, unless retention protects it or a lease holds it
(exit 1 then, with the reason); not there: exit 1, ``ckptd: ...`` on stderr.
"""

from __future__ import annotations

import argparse
import json

from ckptd_schemas import CheckpointBeingDeleted, CheckpointLeased, InvalidName, parse_ref

from ..store.activity import DEAD_SESSION_AFTER
from .backends import require_run
from .target import open_backend, resolve_target

__all__ = ["add_parsers"]


def cmd_gc(args: argparse.Namespace) -> int:
    b = open_backend(resolve_target(args))
    try:
        plan = b.gc(args.run, keep_last=args.keep_last, keep_every=args.keep_every, dry_run=args.dry_run,
                    drop_parents=args.drop_parents, stale_ttl=args.stale_ttl, dead_after=args.dead_after)
        if not plan["keep"] and not plan["delete"] and not plan["deleted"]:
            require_run(b, args.run)  # nothing of it: say whether the run exists at all
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
    for name, why in plan.get("known_bad", {}).items():  # not counted by --keep-last; RUN/latest skips them
        print(f"known bad {args.run}/{name}: {why}")
    if plan.get("newest_verified"):  # rule 5: what every deletion relied on
        print(f"newest verified {args.run}/{plan['newest_verified']} ({plan.get('verified_how')})")
    elif gone or plan.get("failed_verification"):
        print(f"newest verified: none of {args.run} verifies")
    for name, why in plan.get("failed_verification", {}).items():
        print(f"does not verify {args.run}/{name}: {why}")
    for sid in plan.get("reclaimed_sessions", []):
        print(f"reclaimed stale staging {sid}")
    return 0


def cmd_rm(args: argparse.Namespace) -> int:
    ref = parse_ref(args.ref)
    if ref.is_latest:
        raise InvalidName("ckptd rm names a checkpoint, not RUN/latest", ref=args.ref)
    b = open_backend(resolve_target(args))
    try:
        out = b.remove(ref.run, ref.name, dry_run=args.dry_run)
    except (CheckpointLeased, CheckpointBeingDeleted) as e:  # kept: a lease holds it, or a deletion is under way
        out = {"ref": f"{ref.run}/{ref.name}", "removed": False, "reason": e.message, "error": e.code}
    finally:
        b.close()
    gone = out["reason"] in ("removed", "would be removed") and "error" not in out
    if args.json:
        print(json.dumps(out))
    elif gone:
        print(f"{out['reason']} {out['ref']}")
    else:
        print(f"kept {out['ref']}: {out['reason']}")
    return 0 if gone else 1


def add_parsers(sub: argparse._SubParsersAction, add_target) -> None:
    s = sub.add_parser("gc", help="delete old committed checkpoints of a run (retention), reclaim stale staging")
    s.add_argument("run")
    s.add_argument("--keep-last", type=int, required=True, metavar="N", help="keep the N newest steps")
    s.add_argument("--keep-every", type=int, metavar="K", help="also keep every step that is a multiple of K")
    s.add_argument("--dry-run", action="store_true", help="list what would go; delete nothing")
    s.add_argument("--stale-ttl", type=float, default=6 * 3600.0, metavar="S",
                   help="reclaim uncommitted staging older than S seconds, however active (default 6 h; "
                        "through a service, its own CKPTD_STALE_SESSION_TTL)")
    s.add_argument("--dead-after", type=float, default=DEAD_SESSION_AFTER, metavar="S",
                   help="reclaim uncommitted staging with no live writer for S seconds (default 300; through a "
                        "service, its own CKPTD_DEAD_SESSION_AFTER)")
    s.add_argument("--drop-parents", action="store_true",
                   help="also delete checkpoints that checkpoints of other runs name as their parent")
    s.add_argument("--json", action="store_true")
    add_target(s)
    s.set_defaults(func=cmd_gc)

    s = sub.add_parser("rm", help="delete one checkpoint unless retention protects it (exit 1 if kept)")
    s.add_argument("ref", help="RUN/NAME")
    s.add_argument("--dry-run", action="store_true", help="say whether it would go; delete nothing")
    s.add_argument("--json", action="store_true")
    add_target(s)
    s.set_defaults(func=cmd_rm)
