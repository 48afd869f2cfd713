"""``ckptd drill REF --to SPEC [--to SPEC ...]``: prove a checkpoint converts into each layout; write only a record.

Offline (``--root``) the drill runs in this process (``ckptd.reshard.drill``); through a service
(``--server``) it runs as a job in the service's worker pool (``POST /v1/drill``), followed until it
ends. Either way the record lands beside the checkpoint (``runs/RUN/NAME/DRILL.json``) and is printed.

Exit status: 0 every layout passed; 1 a problem was found (each one named by tensor and layout), or
the checkpoint is absent or corrupt beyond reading; 2 bad input (a spec that does not parse, a
layout the checkpoint cannot take, a bad ref) or a connection error: one line on stderr.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from ckptd_schemas import parse_ref

from .output import Bar, human, plural
from .target import open_backend, resolve_target

__all__ = ["add_parsers", "print_record"]


def cmd_drill(args: argparse.Namespace) -> int:
    from ..reshard.drill_layouts import check_layout

    layouts = [check_layout(x) for x in args.to]  # refused before any I/O (exit 2, one line)
    parse_ref(args.ref)
    b = open_backend(resolve_target(args))
    bar = Bar(f"drill {args.ref}", args.json)
    try:
        rec = b.drill(args.ref, layouts, jobs=args.jobs, bar=bar)
    finally:
        bar.stop()
        b.close()
    print_record(rec, args.json)
    return 0 if rec["ok"] else 1


def print_record(rec: dict[str, Any], as_json: bool) -> None:
    """The drill's record (``DrillRecord`` as JSON): the record itself with ``--json``, else a line per layout
    and each problem, naming tensor and layout."""
    if as_json:
        print(json.dumps(rec))
        return
    head = "OK" if rec["ok"] else "FAIL"
    verdict = ("every tensor of every layout matches the source's digest" if rec["ok"] else
               plural(sum(len(x["problems"]) for x in rec["layouts"]), "problem"))
    print(f"{head} {rec['ref']} (manifest {rec['manifest_xxh3']}): {plural(len(rec['layouts']), 'layout')}, "
          f"{verdict}; recorded in DRILL.json")
    for x in rec["layouts"]:
        name = x["layout"] if x["layout"] == x["spec"] else f"{x['layout']} ({x['spec']})"
        failing = len({p["tensor"] for p in x["problems"] if p.get("tensor")})
        print(f"  {'ok' if x['ok'] else 'FAIL':<4}  {name}: {plural(x['tensors'], 'tensor')}"
              f"{f' ({failing} failing)' if failing else ''}, {human(x['bytes'])} assembled, "
              f"{human(x['bytes_read'])} read in {x['seconds']:.2f}s")
        for p in x["problems"][:50]:
            tensor = f"tensor {p['tensor']!r}: " if p.get("tensor") else ""
            print(f"        - layout {p['layout']}: {tensor}{p['message']}")


def _jobs(text: str) -> int:
    if not text.isdigit() or not 1 <= int(text) <= 64:
        raise argparse.ArgumentTypeError(f"--jobs takes 1 to 64, not {text!r}")
    return int(text)


def add_parsers(sub: argparse._SubParsersAction, add_target) -> None:
    s = sub.add_parser("drill", help="check that a checkpoint converts into layouts, bit for bit; writes only a "
                                     "record (DRILL.json), exit 1 if a tensor fails")
    s.add_argument("ref", help="checkpoint, RUN/NAME or RUN/latest")
    s.add_argument("--to", required=True, action="append", metavar="SPEC",
                   help="target layout, repeatable: a spec as for reshard (full, fsdp2:dp=4, zero3:dp=8,align=16, "
                        "tp=2, ...), or half / double (the source's data-parallel degree halved or doubled, as "
                        "fsdp2)")
    s.add_argument("--jobs", type=_jobs, default=1, help="tensors assembled at once (1 to 64)")
    s.add_argument("--json", action="store_true", help="print the record")
    add_target(s)
    s.set_defaults(func=cmd_drill)
