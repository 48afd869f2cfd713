"""``ckptd reshard --server URL``: submit a job to the service, follow it with a progress bar."""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import TYPE_CHECKING

from ckptd_schemas import AlreadyCommitted, CkptdError, error_from_body

from .output import engine_line, human, print_preview

if TYPE_CHECKING:
    from ckptd_client import CatalogClient

__all__ = ["reshard_via_server"]


def reshard_via_server(args: argparse.Namespace, url: str) -> int:
    from ckptd_client import CatalogClient

    with CatalogClient(url, retry_seconds=10.0, retry_refused=False) as client:
        try:
            return _follow(client, args)
        except AlreadyCommitted as e:  # the output's name is taken: say how to choose another
            raise AlreadyCommitted(f"{e.message}; name another output with --out RUN/NAME", **e.details) from None


def _follow(client: "CatalogClient", args: argparse.Namespace) -> int:
    spec = {"out": args.out, "dtype": args.dtype, "device": args.device, "jobs": args.jobs}
    if args.dry_run:
        from ..reshard.preview import Preview

        print_preview(Preview(**client.reshard(args.ref, args.to, preview=True, **spec)), args.json)
        return 0
    job = client.reshard(args.ref, args.to, **spec)
    bar = None
    if not args.json and sys.stderr.isatty():
        from rich.progress import BarColumn, DownloadColumn, Progress

        bar = Progress("[progress.description]{task.description}", BarColumn(), DownloadColumn(), transient=True)
        bar.start()
        task = bar.add_task(f"reshard -> {args.to}", total=job["bytes_total"] or 1)
    try:
        pause = 0.02  # short jobs end quickly: poll fast first, then every 0.3 s
        while job["state"] in ("queued", "running"):
            time.sleep(pause)
            pause = min(pause * 2, 0.3)
            job = client.job(job["id"])
            if bar is not None:
                bar.update(task, completed=job["bytes_done"])
    finally:
        if bar is not None:
            bar.stop()
    if job["state"] == "failed":
        err = error_from_body({"error": job["error"]}, 422)
        raise err if isinstance(err, CkptdError) else CkptdError(str(job["error"]))
    res = job["result"]
    if args.json:
        print(json.dumps(res))
    else:
        print(f"committed {res['ref']} ({job['spec']}, derived from {job['source']}): {res['units']} work units, "
              f"{human(res['bytes_written'])} written in {res['seconds']:.2f}s; every tensor's digest matches")
        if "engine" in res:  # which engine the service's worker ran, and why (executor.choose_device)
            print(engine_line(res["engine"]["device"], res["engine"]["reason"], res["engine"]["impl"]))
    return 0
