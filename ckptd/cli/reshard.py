"""``ckptd reshard`` and ``ckptd reshard-worker``."""

from __future__ import annotations

import argparse
import json
import os
import uuid

from ckptd_schemas import AlreadyCommitted, parse_ref

from .dcp_io import CAST_DTYPES
from .output import engine_line, human, print_preview, progress_bar
from .target import open_root, resolve_target

__all__ = ["add_parsers"]


def cmd_reshard(args: argparse.Namespace) -> int:
    """Offline (``--root``) or through a service (``--server``). Call order offline: parse the spec (refused
    before any I/O), plan, then a dry run prints the preview and stops; otherwise choose the engine
    (``plan_device``: refused before any write, and printed with its reason), then ``--write-plan`` writes
    the plan for worker pods and stops, or ``run_plan`` converts and commits under a lease on the source."""
    where = resolve_target(args)
    if where.server:
        from .reshard_remote import reshard_via_server

        return reshard_via_server(args, where.server)
    from ..reshard.executor import plan_device, plan_engine, run_plan
    from ..reshard.planner import plan_reshard
    from ..reshard.preview import preview
    from ..reshard.spec import default_out_name, parse_spec
    from ..store import CheckpointReader, SessionStore

    spec = parse_spec(args.to)  # refused before any I/O
    src = parse_ref(args.ref)
    storage = open_root(where.root, create=False)
    reader, sessions = CheckpointReader(storage), SessionStore(storage)
    manifest = reader.manifest(src.run, src.name)
    plan = plan_reshard(manifest, spec, dtype=args.dtype, min_units=args.jobs)
    if args.dry_run:
        print_preview(preview(plan), args.json)
        return 0
    choice = plan_device(plan, args.device)  # --device auto: the CPU unless a large cast pays for the GPU
    engine = plan_engine(plan, choice)  # refused before any write (cuda without a GPU)
    out = args.out or f"{manifest.run}/{default_out_name(manifest.name, str(spec), args.dtype)}"
    dst = parse_ref(out)
    if reader.visibility.check(dst.run, dst.name) is not None:  # before any work: a committed name is never reused
        raise AlreadyCommitted(f"{out} already exists (committed checkpoints are never replaced); "
                               f"name another output with --out RUN/NAME", ref=out)
    if args.write_plan:
        from ..reshard.jobs import write_job

        session = uuid.uuid4().hex
        write_job(args.write_plan, plan, out, session, args.device, sessions)
        print(json.dumps({"plan": args.write_plan, "units": len(plan.units), "out": out, "session": session}))
        return 0
    from ..store.leases import Leases

    if not args.json:  # before the work: which engine runs it, and why
        print(engine_line(choice.device, choice.reason, engine.name), flush=True)
    advance, stop = progress_bar(plan.bytes_to_write, f"reshard -> {spec}", args.json)
    try:
        with Leases(storage).hold(manifest.run, manifest.name, "reshard"):  # gc spares the source meanwhile
            res = run_plan(reader, sessions, plan, out, uuid.uuid4().hex, engine=engine, jobs=args.jobs,
                           progress=advance)
    finally:
        stop()
    pv = preview(plan)
    if args.json:
        print(json.dumps({"ref": res.ref, "manifest_xxh3": res.manifest_xxh3, "units": res.units,
                          "bytes_read": res.bytes_read, "bytes_written": res.bytes_written,
                          "seconds": round(res.seconds, 3), "imbalance": pv.imbalance,
                          "per_rank_bytes": [sum(r.values()) for r in pv.per_rank],
                          "engine": {"device": choice.device, "reason": choice.reason, "impl": engine.name}}))
    else:
        rate = res.bytes_written / res.seconds if res.seconds else 0
        print(f"committed {res.ref} ({spec}, derived from {manifest.ref}): {res.units} work units, "
              f"{human(res.bytes_read)} read, {human(res.bytes_written)} written in {res.seconds:.2f}s "
              f"({human(rate)}/s); every tensor's digest matches the source")
        loads = [sum(r.values()) for r in pv.per_rank]
        print(f"per rank: max {human(max(loads))}, min {human(min(loads))}, imbalance {pv.imbalance:.1%}")
    return 0


def cmd_reshard_worker(args: argparse.Namespace) -> int:
    from ..reshard.jobs import run_worker

    result = run_worker(args.plan, args.index, root=args.root)
    print(json.dumps(result))
    return 0


def add_parsers(sub: argparse._SubParsersAction, add_target) -> None:
    s = sub.add_parser("reshard", help="convert a committed checkpoint to another layout (new checkpoint)")
    s.add_argument("ref", help="source checkpoint, RUN/NAME or RUN/latest")
    s.add_argument("--to", required=True, metavar="SPEC", help="target layout, e.g. fsdp2:dp=4, zero3:dp=8,align=16, "
                   "tp=2,dp=2, owner:dp=4,max-per-rank=5, pp=2, full")
    s.add_argument("--out", help="output ref (default RUN/NAME-<spec>)")
    s.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"],
                   help="where chunks are assembled and cast: cuda (torch), cpu (numpy; torch only to cast), "
                        "auto (the CPU, unless --dtype casts enough bytes for a present GPU to pay for its "
                        "start-up; the command prints which engine ran and why)")
    s.add_argument("--jobs", type=int, default=2, help="work units run in parallel")
    s.add_argument("--dtype", choices=CAST_DTYPES, help="cast floating tensors to this dtype")
    s.add_argument("--dry-run", action="store_true", help="print per-rank bytes and reads; write nothing")
    s.add_argument("--write-plan", metavar="URI", help="write the plan for `ckptd reshard-worker` pods and exit")
    s.add_argument("--json", action="store_true")
    add_target(s)
    s.set_defaults(func=cmd_reshard)

    s = sub.add_parser("reshard-worker", help="run one work unit of a written plan (Kubernetes Indexed Job)")
    s.add_argument("--plan", required=True, metavar="URI", help="plan written by reshard --write-plan")
    s.add_argument("--index", type=int, default=int(os.environ.get("JOB_COMPLETION_INDEX", "-1")),
                   help="work unit (default $JOB_COMPLETION_INDEX)")
    s.add_argument("--root", help="storage root holding the checkpoints (default: the plan's)")
    s.set_defaults(func=cmd_reshard_worker)


