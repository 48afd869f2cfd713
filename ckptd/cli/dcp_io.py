"""``ckptd import dcp DIR REF`` and ``ckptd export REF --format safetensors|torch OUT``."""

from __future__ import annotations

import argparse
import dataclasses
import json

from ckptd_schemas import NotFound, check_new_name, parse_ref
from ckptd_schemas.dtypes import FLOATING

from .output import human, progress_bar
from .target import open_backend, resolve_target

__all__ = ["add_parsers"]

CAST_DTYPES = sorted(FLOATING)  # what --dtype casts to, and which tensors it casts


def cmd_import_dcp(args: argparse.Namespace) -> int:
    from ..interop.dcp_import import import_dcp, inspect_dcp

    r = parse_ref(args.ref)  # refused before any I/O, as a new checkpoint's name (not latest)
    check_new_name(r.name)
    target = resolve_target(args)
    try:  # a taken name is refused before the source is read (its metadata can take long to load)
        seen = open_backend(target)
    except NotFound:
        pass  # no root there yet: no name is taken
    else:
        try:
            seen.require_new(r.run, r.name)
        finally:
            seen.close()
    src = inspect_dcp(args.dir)  # refuses a damaged directory, naming the files, before anything is written
    backend = open_backend(target, create=True)  # a write: a new root is made
    advance, stop = progress_bar(src.total_bytes, f"import {r}", args.json)
    try:
        res = import_dcp(src, str(r), backend.import_target(), progress=advance)
    finally:
        stop()
        backend.close()
    if args.json:
        print(json.dumps({**dataclasses.asdict(res), "seconds": round(res.seconds, 3)}))
    else:
        print(f"committed {res.ref} from DCP checkpoint {res.source}: {res.tensors} tensors ({res.chunks} chunks), "
              f"{res.objects} objects, {human(res.bytes_written)} in {res.files} files, hashed on ingest, in "
              f"{res.seconds:.2f}s; DCP's metadata is kept for client.dcp_reader")
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    from ..interop.export import default_prefix, export_safetensors, export_torch, parse_size, tensor_bytes
    ref = parse_ref(args.ref)
    max_shard = parse_size(args.max_shard_size)
    backend = open_backend(resolve_target(args))
    manifest = backend.manifest(ref.run, ref.name)
    backend.check_source(manifest)  # the one checker's verdict on the source first (its record, usually)
    read = backend.byte_source(manifest)

    prefix = args.prefix if args.prefix is not None else default_prefix(manifest, args.format)
    total = sum(tensor_bytes(t.shape, args.dtype if args.dtype and t.dtype in CAST_DTYPES else t.dtype)
                for t in manifest.tensors if not prefix or t.name.startswith(prefix))
    # One bar for writing and, unless --no-check, reading every tensor back.
    advance, stop = progress_bar(total * (1 if args.no_check else 2), f"export {manifest.ref}", args.json)
    try:
        kw = dict(dtype=args.dtype, prefix=prefix, check=not args.no_check, progress=advance,
                  check_progress=advance)
        with backend.lease(manifest, "export"):
            if args.format == "safetensors":
                res = export_safetensors(manifest, read, args.out, max_shard_size=max_shard, **kw)
            else:
                res = export_torch(manifest, read, args.out, trust_objects=args.trust_objects, **kw)
    finally:
        stop()
        backend.close()
    if args.json:
        print(json.dumps({"ref": res.ref, "format": res.format, "out": res.out, "files": res.files,
                          "tensors": res.tensors, "objects": res.objects, "total_size": res.total_size,
                          "prefix": prefix or None, "tensors_in_checkpoint": len(manifest.tensors),
                          "nested": res.nested if res.format == "torch" else None, "checked": not args.no_check,
                          "seconds": round(res.seconds, 3)}))
    else:
        shards = len(res.files) - 1
        what = (f"{shards} shard{'s' if shards != 1 else ''} + {res.files[-1]}" if res.format == "safetensors"
                else f"one torch.save file ({'nested as DCP saved it' if res.nested else 'flat FQN keys'}, "
                     f"{res.objects} objects)")
        check = "read back: every tensor's digest matches the source" if not args.no_check else "not checked"
        which = f"the {res.tensors} tensors under {prefix!r} (without it)" if prefix else f"{res.tensors} tensors"
        print(f"exported {res.ref} to {res.out}: {which}, {human(res.total_size)}, {what}, in "
              f"{res.seconds:.2f}s; {check}")
        if prefix and args.prefix is None and res.tensors < len(manifest.tensors):
            print(f"  the other {len(manifest.tensors) - res.tensors} tensors (optimizer state, ...) are not in it: "
                  f"--prefix '' exports every tensor, --format torch the whole state dict")
    return 0


def add_parsers(sub: argparse._SubParsersAction, add_target) -> None:
    s = sub.add_parser("import", help="ingest a checkpoint written by another tool as a committed checkpoint")
    fmt = s.add_subparsers(dest="source_format", required=True)
    d = fmt.add_parser("dcp", help="a torch.distributed.checkpoint directory (FileSystemWriter)")
    d.add_argument("dir", help="DCP checkpoint directory (holds .metadata and *.distcp files)")
    d.add_argument("ref", help="checkpoint to create, RUN/NAME (a numeric NAME is its step)")
    d.add_argument("--json", action="store_true", help="print one JSON object; no progress bar")
    add_target(d)
    d.set_defaults(func=cmd_import_dcp)

    s = sub.add_parser("export", help="write a checkpoint as sharded safetensors (Hugging Face) or one torch.save file")
    s.add_argument("ref", help="checkpoint, RUN/NAME or RUN/latest")
    s.add_argument("--format", choices=["safetensors", "torch"], default="safetensors",
                   help="safetensors: OUT is a directory of model-0000i-of-0000N.safetensors and "
                        "model.safetensors.index.json; torch: OUT is one file")
    s.add_argument("out", metavar="OUT", help="output directory (safetensors) or file (torch)")
    s.add_argument("--max-shard-size", default="5GB", help="safetensors shard size, e.g. 5GB, 500MB, 2GiB")
    s.add_argument("--dtype", choices=CAST_DTYPES, help="cast floating tensors to this dtype")
    s.add_argument("--prefix", help="export only tensors whose name starts with PREFIX, without it; safetensors "
                                    "default: model. when the checkpoint has such tensors (the model's weights, "
                                    "not its optimizer state); --prefix '' exports every tensor")
    s.add_argument("--no-check", action="store_true", help="skip reading the export back and comparing digests")
    s.add_argument("--trust-objects", action="store_true",
                   help="torch format: unpickle objects that a safe load (torch.load weights_only=True) refuses; "
                        "this runs any code the checkpoint's writers put there (docs/security.md)")
    s.add_argument("--json", action="store_true", help="print one JSON object; no progress bar")
    add_target(s)
    s.set_defaults(func=cmd_export)
