"""``ckptd`` command line: serve, ls, show, verify, reshard, reshard-worker, import, export, gc, rm.

Exit codes: 0 success; 1 the thing checked is wrong (corrupt, invalid, not
found); 2 usage or connection error.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from math import prod
from typing import NoReturn
from ckptd_schemas import CkptdError, Forbidden, IntegrityError, Manifest, NotFound, parse_ref

from .. import __version__
from .backends import Backend, require_run
from .dcp_io import add_parsers as add_dcp_io_parsers
from .drill import add_parsers as add_drill_parsers
from .gc import add_parsers as add_gc_parsers
from .output import human, plural, progress_bar
from .reshard import add_parsers as add_reshard_parsers
from .target import add_target, looked_in, open_backend, resolve_target

__all__ = ["main"]


def cmd_serve(args: argparse.Namespace) -> int:
    try:
        from pydantic import ValidationError

        from ..service.server import AuthConfigError, ListenError, serve
        from ..service.settings import Settings, env_name
    except ImportError as e:
        print(f"ckptd serve needs the server extra: pip install 'ckptd[server]' ({e})", file=sys.stderr)
        return 2
    # every flag of serve sets the setting of its name (settings_table.serve_flags reads them the same way)
    overrides = {k: v for k, v in vars(args).items() if k in Settings.model_fields and v is not None}
    try:
        settings = Settings(**overrides)
    except ValidationError as e:
        for err in e.errors():
            field = str(err["loc"][0]) if err["loc"] else "?"
            flag = f"--{field.replace('_', '-')}" if field in overrides else env_name(field)
            msg = str(err["ctx"]["error"]) if err["type"] == "value_error" else err["msg"]  # no "Value error, "
            print(f"ckptd serve: {flag}: {msg} (got {err.get('input')!r})", file=sys.stderr)
        return 2
    for flag, where in (("--root", settings.root), ("--durable", settings.durable)):
        if where and "://" not in where and os.path.exists(where) and not os.path.isdir(where):
            print(f"ckptd serve: {flag} {where}: not a directory (a storage root is a directory or an fsspec URL)",
                  file=sys.stderr)
            return 2
    try:
        serve(settings)
    except (AuthConfigError, ListenError) as e:
        print(f"ckptd serve: {e}", file=sys.stderr)
        return 2
    return 0


def cmd_ls(args: argparse.Namespace) -> int:
    with contextlib.closing(open_backend(resolve_target(args))) as b:  # a server's connection too
        if args.run:
            rows = b.list_checkpoints(args.run)
            if not rows:
                require_run(b, args.run)
                if not args.json:  # the run exists (a save under way, or one that never committed)
                    print(f"run {args.run} has no committed checkpoint yet", file=sys.stderr)
            if args.json:
                print(json.dumps([r.model_dump(mode="json") for r in rows], indent=2))
                return 0
            for r in rows:
                derived = f"  derived from {r.derived_from}" if r.derived_from else ""
                parent = f"  parent {r.parent}" if r.parent else ""
                step = f"step={r.step}" if r.step is not None else "no step"
                status = status_words(r.status, r.status_reason)
                print(f"{r.run}/{r.name}\t{step}\t{r.committed_at:%Y-%m-%d %H:%M:%S}\t{status}{derived}{parent}")
            return 0
        runs = b.list_runs()
        if args.json:
            print(json.dumps([r.model_dump(mode="json") for r in runs], indent=2))
            return 0
        for r in runs:
            print(f"{r.run}\t{plural(r.checkpoints, 'checkpoint')}\tlatest={r.latest}")
        if not runs:
            print(f"no runs in {resolve_target(args).describe()}", file=sys.stderr)
        return 0


def status_words(status: str | None, reason: str | None) -> str:
    """A checkpoint's status as ``ls`` and ``show`` print it: ``known bad (verification failed at ...)``."""
    return f"{status or 'unknown'}{f' ({reason})' if reason else ''}"


MAX_LINEAGE = 64  # parents followed by ``ckptd show``


def lineage(backend: Backend, m: Manifest) -> list[str]:
    """The chain of parents above ``m``, nearest first; a parent no longer visible ends it, marked so."""
    chain: list[str] = []
    seen = {m.ref}
    parent = m.parent
    while parent is not None and len(chain) < MAX_LINEAGE and parent not in seen:
        seen.add(parent)
        p = parse_ref(parent)
        try:
            parent = backend.manifest(p.run, p.name).parent
        except NotFound:
            chain.append(f"{p} (no longer visible)")
            break
        except Forbidden:  # another run, which this token may not read: the chain ends here, said so
            chain.append(f"{p} (not readable with this token)")
            break
        chain.append(str(p))
    return chain


def cmd_show(args: argparse.Namespace) -> int:
    ref = parse_ref(args.ref)
    b = open_backend(resolve_target(args))
    try:
        m, skipped = b.resolve(ref.run, ref.name)  # RUN/latest: the newest not known to be bad, and what it skipped
        status, reason = b.status(m)
        chain = lineage(b, m) if m.parent and not args.json else []
    finally:
        b.close()
    if args.json:
        print(m.model_dump_json(indent=2))
        if status is not None:
            print(f"ckptd show: {m.ref} is {status_words(status, reason)}", file=sys.stderr)
        for s in skipped:  # stdout is the manifest alone
            print(f"ckptd show: {args.ref} is {m.ref}: skipped {s.ref}: {s.reason}", file=sys.stderr)
        return 0
    topo = m.topology
    print(f"checkpoint {m.ref}  {f'step={m.step}' if m.step is not None else 'no step'}  created={m.created_at:%Y-%m-%d %H:%M:%S}  session={m.session}")
    for s in skipped:
        print(f"skipped    {s.ref}: {s.reason}")
    print(f"status     {status_words(status, reason)}")
    if m.derived_from:
        print(f"derived from {m.derived_from}")
    if m.parent:
        print(f"lineage    {' <- '.join([m.ref, *chain])}")
    print(f"topology   world_size={topo.world_size} mesh={topo.mesh or '-'} layouts={topo.layouts or '-'}")
    print(f"files      {len(m.files)} ({human(m.total_bytes)})")
    if any(f.linked is not None for f in m.files.values()):
        linked = [f for f in m.files.values() if f.linked is not None]
        sources = sorted({f.linked.split("/", 1)[0] for f in linked})
        # unchanged: the reused chunks' bytes, not the linked files' sizes (Manifest.unchanged_bytes)
        print(f"written    {human(m.total_bytes - m.linked_bytes)}; unchanged {human(m.unchanged_bytes)} in "
              f"{plural(len(linked), 'file')} ({human(m.linked_bytes)}) linked from "
              f"{', '.join(f'{m.run}/{s}' for s in sources)} (incremental)")
    groups: dict[str, list[int]] = {}
    for t in m.tensors:
        g = groups.setdefault(t.group, [0, 0])
        g[0] += 1
        g[1] += sum(c.location.raw_length for c in t.chunks)
    for g, (n, nbytes) in sorted(groups.items()):
        print(f"group      {g}: {plural(n, 'tensor')}, {human(nbytes)}")
    per_rank = [0] * topo.world_size
    matrices = [0] * topo.world_size
    for t in m.tensors:
        for c in t.chunks:
            per_rank[c.rank] += c.location.raw_length
            matrices[c.rank] += len(t.shape) >= 2 and c.numel == prod(t.shape)
    owners = any(v.startswith("owner") for v in topo.layouts.values())  # said only of the owner layout
    if any(per_rank):
        peak, total = max(per_rank), sum(per_rank)
        mean = total / topo.world_size
        print(f"per rank   max {human(peak)}, mean {human(mean)}, imbalance {peak / mean - 1:.1%}")
        if args.ranks or topo.world_size <= 8:
            for r, n in enumerate(per_rank):
                owned = f"  owns {matrices[r]} whole {'matrix' if matrices[r] == 1 else 'matrices'}" if owners else ""
                print(f"  rank {r:<5} {human(n):>10}{owned}")
    for pg in m.param_groups:
        hp = ", ".join(f"{k}={v}" for k, v in pg.hyperparams.items() if k in ("lr", "weight_decay", "betas", "eps"))
        print(f"optimizer  {pg.optimizer or '-'} group {pg.index}: {len(pg.params)} params, {hp}")
    if args.tensors:
        for t in m.tensors:
            print(f"  {t.name}  {t.dtype}{t.shape}  {plural(len(t.chunks), 'chunk')}  {t.placement or ''}")
    return 0


def cmd_verify(args: argparse.Namespace) -> int:
    """The checkpoint checked here (``Backend.verify``: every byte by the one checker, and the load tree),
    under a lease, or with ``--in-service`` by the service's worker (recorded there); 1 when bad."""
    ref = parse_ref(args.ref)
    b = open_backend(resolve_target(args))
    try:
        if args.in_service:
            rep = b.verify_in_service(str(ref))  # the service's worker reads and checks; a root refuses
        else:
            try:
                m = b.manifest(ref.run, ref.name)
            except (IntegrityError, NotFound) as e:  # absent, or failing the visibility rule
                print(f"FAIL {args.ref}: {e.message}")
                return 1
            progress, finish = progress_bar(m.total_bytes, f"verify {m.ref}", args.json)
            with b.lease(m, "verify"):
                rep = b.verify(m, progress)
            finish()
    finally:
        b.close()
    strays = rep.get("strays") or []  # --server without --in-service sees the manifest's files only
    if args.json:
        print(json.dumps({**{k: rep[k] for k in ("ref", "ok", "files", "tensors", "chunks", "bytes_read",
                                                  "problems")}, "strays": strays}))
        return 0 if rep["ok"] else 1
    if rep["ok"]:
        print(f"OK {rep['ref']}: {plural(rep['files'], 'file')}, {plural(rep['tensors'], 'tensor')}, "
              f"{plural(rep['chunks'], 'chunk')}, {human(rep['bytes_read'])} re-read and re-hashed")
    else:
        print(f"FAIL {rep['ref']}: {plural(len(rep['problems']), 'problem')}")
        for p in rep["problems"][:50]:
            print(f"  - {p}")
    if strays:  # seen, not a verdict: the checkpoint's own bytes are what decides the exit status
        print(f"STRAY {rep['ref']}: {plural(len(strays), 'file')} in its directory, no part of the checkpoint "
              f"(its data is not affected)")
        for x in strays[:50]:
            print(f"  - {x['key']} ({human(x['size'])})")
    return 0 if rep["ok"] else 1


class _Parser(argparse.ArgumentParser):
    """argparse, whose usage error is one line naming the flag (``ckptd serve: argument --port: invalid
    int value: 'abc' (ckptd serve --help)``), exit 2; subcommands' parsers are of this class too."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: {message} ({self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="ckptd", description="Distributed checkpoint and reshard service.",
                                epilog="Exit status: 0 success; 1 what was checked is wrong (corrupt, invalid, not "
                                       "found); 2 usage or connection error.")
    p.add_argument("--version", action="version", version=f"ckptd {__version__}")
    sub = p.add_subparsers(dest="command", required=True)

    s = sub.add_parser("serve", help="run the HTTP service")
    s.add_argument("--root", help="storage root (default ./ckptd-data or $CKPTD_ROOT)")
    s.add_argument("--durable", help="durable tier behind the root (s3://bucket/prefix or a directory): saves "
                   "commit on the root, then are copied there and marked durable (or $CKPTD_DURABLE)")
    s.add_argument("--host", help="address (default 127.0.0.1)")
    s.add_argument("--port", type=int, help="port (default 8470)")
    s.add_argument("--log-level", help="debug, info (default), warning, error, critical")
    s.add_argument("--log-format", choices=["text", "json"], help="log lines as text (default) or JSON objects")
    s.add_argument("--tokens-file", help="bearer tokens and their scopes (docs/security.md, Tokens)")
    s.add_argument("--insecure-open", action="store_true", default=None,
                   help="serve without tokens on a non-loopback address")
    s.set_defaults(func=cmd_serve)

    s = sub.add_parser("ls", help="list runs, or the committed checkpoints of RUN")
    s.add_argument("run", nargs="?")
    s.add_argument("--json", action="store_true")
    add_target(s)
    s.set_defaults(func=cmd_ls)

    s = sub.add_parser("show", help="describe a checkpoint (RUN/NAME or RUN/latest)")
    s.add_argument("ref")
    s.add_argument("--json", action="store_true", help="print the manifest")
    s.add_argument("--tensors", action="store_true", help="list every tensor")
    s.add_argument("--ranks", action="store_true", help="bytes per rank (always shown up to 8 ranks)")
    add_target(s)
    s.set_defaults(func=cmd_show)

    s = sub.add_parser("verify", help="re-read and check every byte of a checkpoint (exit 1 if bad)")
    s.add_argument("ref")
    s.add_argument("--json", action="store_true")
    s.add_argument("--in-service", action="store_true",
                   help="with --server: the service's worker reads and checks, and records the outcome")
    add_target(s)
    s.set_defaults(func=cmd_verify)

    add_reshard_parsers(sub, add_target)
    add_drill_parsers(sub, add_target)
    add_dcp_io_parsers(sub, add_target)
    add_gc_parsers(sub, add_target)
    return p


def main(argv: list[str] | None = None) -> int:
    """Run one command; every failure is one line on stderr and an exit status, never a traceback
    (``CKPTD_DEBUG=1`` adds the traceback of an unexpected one)."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:
        return int(e.code or 0) if e.code in (0, None) else 2
    if args.command != "serve":
        # pydantic scans every installed package's entry points for plugins when it first builds a
        # validator; no plugin serves a one-shot command, and the scan is a tenth of `ckptd verify`'s start.
        os.environ.setdefault("PYDANTIC_DISABLE_PLUGINS", "__all__")
    try:
        rc = int(args.func(args) or 0)
        sys.stdout.flush()  # a closed pipe fails here, inside the handlers below, not at exit
        return rc
    except (NotFound, IntegrityError) as e:
        where = looked_in(args) if isinstance(e, NotFound) else None
        print(f"ckptd: {e.message}" + (f"; looked in {where}" if where else ""), file=sys.stderr)
        return 1
    except CkptdError as e:  # usage, connection, service refusals
        print(f"ckptd: {e.message}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # the reader of stdout went away (| head): stop quietly
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 1
    except OSError as e:
        where = f": {e.filename}" if e.filename else ""
        print(f"ckptd: {e.strerror or e}{where}", file=sys.stderr)
        return 1
    except Exception as e:  # noqa: BLE001 - a bug of ckptd's: say so in one line, not a traceback
        if os.environ.get("CKPTD_DEBUG"):
            raise
        print(f"ckptd: internal error: {type(e).__name__}: {e} (set CKPTD_DEBUG=1 for the traceback)",
              file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
