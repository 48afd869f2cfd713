"""``ckptd reshard`` and ``ckptd reshard-worker``."""

from __future__ import annotations

import argparse
import json
import os

from ckptd_schemas import InvalidRequest

from ..reshard.models import ReshardRequest
from .dcp_io import CAST_DTYPES
from .output import Bar, human, print_preview
from .target import open_backend, resolve_target

__all__ = ["add_parsers"]


def cmd_reshard(args: argparse.Namespace) -> int:
    """Offline (``--root``: converted in this process) or through a service (``--server``: a job in its
    workers), the same request (the service's ``ReshardRequest``) and the same steps
    (``ckptd.reshard.jobs``). Call order: a dry run prints the plan's preview and stops;
    ``--write-plan`` writes the plan for worker pods and stops; otherwise the conversion, then the
    result with the engine that ran and why."""
    from ..reshard.spec import parse_spec

    parse_spec(args.to)  # refused before any I/O
    req = request(args)
    b = open_backend(resolve_target(args))
    bar = Bar(f"reshard -> {args.to}", args.json)
    try:
        if args.dry_run:
            print_preview(b.reshard_preview(req), args.json)
            return 0
        if args.write_plan:
            print(json.dumps(b.write_plan(req, args.write_plan, args.workers)))
            return 0
        done = b.reshard(req, bar=bar)
    finally:
        bar.stop()
        b.close()
    res = done.result
    if args.json:
        extra = {"imbalance": done.imbalance, "per_rank_bytes": done.per_rank_bytes} if done.per_rank_bytes else {}
        print(json.dumps({**res, **extra}))
        return 0
    rate = res["bytes_written"] / res["seconds"] if res["seconds"] else 0
    engine = res.get("engine")  # which engine ran, and why (executor.choose_device); "host" is numpy
    if engine:
        print(f"engine: {engine['device']} ({engine['reason']}; "
              f"{'numpy' if engine['impl'] == 'host' else engine['impl']})")
    print(f"committed {res['ref']} ({done.spec}, derived from {done.source}): {res['units']} work units, "
          f"{human(res['bytes_read'])} read, {human(res['bytes_written'])} written in {res['seconds']:.2f}s "
          f"({human(rate)}/s); every tensor's digest matches the source")
    if done.per_rank_bytes:
        loads = done.per_rank_bytes
        print(f"per rank: max {human(max(loads))}, min {human(min(loads))}, imbalance {done.imbalance:.1%}")
    return 0


def request(args: argparse.Namespace) -> ReshardRequest:
    """The command's flags as the service's request body; a value it refuses is a typed error naming the flag."""
    from pydantic import ValidationError

    try:
        return ReshardRequest(source=args.ref, to=args.to, out=args.out, dtype=args.dtype, device=args.device,
                              jobs=args.jobs)
    except ValidationError as e:
        err = e.errors()[0]
        flag = f"--{err['loc'][0]}" if err["loc"] else "a flag"
        raise InvalidRequest(f"{flag}: {err['msg']} (got {err.get('input')!r})", field=str(err["loc"][0])) from None


def cmd_reshard_worker(args: argparse.Namespace) -> int:
    from ..reshard.jobs import run_worker

    result = run_worker(args.plan, args.index, root=args.root)
    print(json.dumps(result))
    return 0


def _workers(text: str) -> int:
    if not text.isdigit() or not 1 <= int(text) <= 100_000:
        raise argparse.ArgumentTypeError(f"--workers takes 1 to 100000 (an Indexed Job's completions), not {text!r}")
    return int(text)


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
    s.add_argument("--jobs", type=int, default=2, help="work units run in parallel (threads; processes from "
                   "2,000 target chunks, where Python needs more than one core)")
    s.add_argument("--dtype", choices=CAST_DTYPES, help="cast floating tensors to this dtype")
    s.add_argument("--dry-run", action="store_true", help="print per-rank bytes and reads; write nothing")
    s.add_argument("--write-plan", metavar="URI", help="write the job for `ckptd reshard-worker` pods and exit")
    s.add_argument("--workers", type=_workers, metavar="N", help="with --write-plan: the pods that share the work units "
                   "(indexes 0..N-1; default one per unit, at most 32)")
    s.add_argument("--json", action="store_true")
    add_target(s)
    s.set_defaults(func=cmd_reshard)

    s = sub.add_parser("reshard-worker", help="run one work unit of a written plan (Kubernetes Indexed Job)")
    s.add_argument("--plan", required=True, metavar="URI", help="plan written by reshard --write-plan")
    s.add_argument("--index", type=int, default=int(os.environ.get("JOB_COMPLETION_INDEX", "-1")),
                   help="work unit (default $JOB_COMPLETION_INDEX)")
    s.add_argument("--root", help="storage root holding the checkpoints (default: the plan's)")
    s.set_defaults(func=cmd_reshard_worker)


