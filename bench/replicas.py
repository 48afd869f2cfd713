"""Two ``ckptd serve`` replicas against one, with 4 saving ranks, on one root.

    .venv/bin/python -m bench.replicas --mib 256 --repeat 3 --out bench/results/replicas.json

Two real ``ckptd serve`` processes (tests/support.py ``ServerProcess``) on
different ports share one local root. Four gloo ranks each hold a quarter of
``--mib`` MiB of fp32 state (flat-partitioned tensors, ``FlatShard``). Per
repeat, between barriers, they save a fresh checkpoint twice:

* ``one``: all four ranks talk to replica A;
* ``two``: ranks 0, 1 talk to A and ranks 2, 3 to B (the commit happens on
  whichever replica stores the last index).

The order of the two alternates between repeats. Times: ``save()``'s return on
the slowest rank (the training stall) and, from the first barrier to the last
rank's ``handle.wait()`` (committed), the save's wall time; throughput is the
global state size over that wall time. Every checkpoint is then loaded by one
process (through the other replica for ``two``) and compared bit for bit.

What it can show depends on the machine: with few cores the ranks, both
servers and the hashing share the same CPUs, so a second replica mostly adds
a second event loop and thread pool; it pays where one server process is the
bottleneck (its request handling, one NIC, one Python GIL for hashing).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from bench._report import add_workdir_args, work_dir

REPO = Path(__file__).resolve().parents[1]
if str(REPO / "tests") not in sys.path:
    sys.path.insert(0, str(REPO / "tests"))

from support import ServerProcess, run_ranks  # noqa: E402  (tests/support.py)

MiB = 1 << 20
WORLD = 4
COLS = 1024
WEIGHTS = (7, 3, 5, 2)  # four tensors of uneven sizes


def _tensors(mib: float, seed: int):
    """(name, full tensor), one at a time: a rank keeps only its slices, never the whole state."""
    rows_total = max(int(mib * MiB) // (4 * COLS), 4 * len(WEIGHTS))
    g = torch.Generator().manual_seed(seed)
    for i, w in enumerate(WEIGHTS):
        yield f"model.t{i}", torch.randn(max(rows_total * w // sum(WEIGHTS), 4), COLS, generator=g)


def full_state(mib: float, seed: int) -> dict[str, torch.Tensor]:
    return dict(_tensors(mib, seed))


def rank_state(rank: int, world: int, mib: float, seed: int) -> dict:
    from ckptd_client import FlatShard

    out = {}
    for name, t in _tensors(mib, seed):
        flat = t.reshape(-1)
        per = -(-flat.numel() // world)
        lo, hi = min(rank * per, flat.numel()), min((rank + 1) * per, flat.numel())
        out[name] = FlatShard(flat[lo:hi].clone(), tuple(t.shape), lo)
    return out


def save_job(rank: int, world: int, plan: list[dict], mib: float) -> list[dict]:
    """For each entry of ``plan`` ({"ref", "urls", "seed"}): barrier, save, wait; this rank's times."""
    from ckptd_client import CheckpointClient

    out = []
    for p in plan:
        sd = rank_state(rank, world, mib, p["seed"])
        with CheckpointClient(p["urls"][rank], retry_seconds=60) as client:
            dist.barrier()
            t0 = time.monotonic()
            handle = client.save(sd, p["ref"])
            t_stall = time.monotonic() - t0
            status = handle.wait(timeout=1800)
            t_done = time.monotonic() - t0
            dist.barrier()
        out.append({"ref": p["ref"], "stall_s": t_stall, "commit_s": t_done, "state": status.state,
                    "manifest_xxh3": status.manifest_xxh3})
    return out


def check_load(url: str, ref: str, mib: float, seed: int) -> None:
    from ckptd_client import CheckpointClient

    want = full_state(mib, seed)
    got = {k: torch.zeros_like(v) for k, v in want.items()}
    with CheckpointClient(url) as client:
        client.load(got, ref)
    for k, v in want.items():
        assert torch.equal(got[k].view(torch.uint8), v.view(torch.uint8)), f"{ref}: {k} differs"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mib", type=float, default=256, help="total fp32 state over the 4 saving ranks (MiB)")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    add_workdir_args(ap, "parent of the work directory (one disk)")
    args = ap.parse_args(argv)

    with work_dir("ckptd-bench-replicas-", args.workdir, args.keep) as work:
        root = work / "root"
        a = ServerProcess(root, log=work / "a.log")
        b = ServerProcess(root, log=work / "b.log")
        try:
            a.start(wait=False), b.start(wait=False)
            a.wait_ready(), b.wait_ready()
            plan, seed = [], 0
            for r in range(args.repeat):
                order = ("one", "two") if r % 2 == 0 else ("two", "one")
                for mode in order:
                    seed += 1
                    urls = [a.url] * WORLD if mode == "one" else [a.url, a.url, b.url, b.url]
                    plan.append({"ref": f"bench/{seed}", "urls": urls, "seed": seed, "mode": mode})
            budget = 600 + 10 * args.mib * args.repeat
            records = run_ranks(save_job, WORLD, plan, args.mib, tmp=work, timeout=budget)
            per_ckpt = []
            for i, p in enumerate(plan):
                rows = [rec["result"][i] for rec in records]
                assert {r["state"] for r in rows} == {"committed"}, rows
                assert len({r["manifest_xxh3"] for r in rows}) == 1, rows
                check_load(b.url if p["mode"] == "two" else a.url, p["ref"], args.mib, p["seed"])
                per_ckpt.append({"mode": p["mode"], "ref": p["ref"], "stall_s": max(r["stall_s"] for r in rows),
                                 "commit_s": max(r["commit_s"] for r in rows)})
            summary = {}
            for mode in ("one", "two"):
                ts = [c["commit_s"] for c in per_ckpt if c["mode"] == mode]
                stalls = [c["stall_s"] for c in per_ckpt if c["mode"] == mode]
                summary[mode] = {"commit_s_median": statistics.median(ts), "commit_s_all": ts,
                                 "stall_s_median": statistics.median(stalls),
                                 "mib_per_s": args.mib / statistics.median(ts)}
            summary["two_over_one_throughput"] = summary["two"]["mib_per_s"] / summary["one"]["mib_per_s"]
            result = {"benchmark": "replicas", "mib": args.mib, "ranks": WORLD, "repeat": args.repeat,
                      "machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                                  "python": platform.python_version(), "torch": torch.__version__},
                      "summary": summary, "checkpoints": per_ckpt}
            for mode in ("one", "two"):
                s = summary[mode]
                print(f"{mode} replica{'s' if mode == 'two' else ''}: {args.mib:.0f} MiB committed in "
                      f"{s['commit_s_median']:.2f}s median ({s['mib_per_s']:.0f} MiB/s), "
                      f"stall {s['stall_s_median'] * 1000:.0f} ms; all: "
                      + ", ".join(f"{t:.2f}" for t in s["commit_s_all"]))
            print(f"two/one throughput: {summary['two_over_one_throughput']:.2f}x")
            if args.out:
                args.out.parent.mkdir(parents=True, exist_ok=True)
                args.out.write_text(json.dumps(result, indent=2) + "\n")
            return 0
        finally:
            a.kill(), b.kill()


if __name__ == "__main__":
    sys.exit(main())
