"""The fast tier: a save commits on local disk, then becomes durable on S3 (``ckptd serve --durable``).

    .venv/bin/python -m bench.tiers --mib 256 --repeat 3 --out bench/results/tiers.json

One ``python -m moto.server`` on loopback (the durable tier, tests/s3_server.py ``MotoServer``),
and one real ``ckptd serve --root WORK/fast --durable s3://bucket/durable``. ``--world`` gloo ranks
(default 2) hold ``--mib`` MiB of fp32 state (``bench.save_load``'s: 8 ``Shard(0)`` DTensors,
uneven rows). Per repeat, between barriers, in alternating order:

* ``dcp.save(sd, storage_writer=FileSystemWriter(WORK/dcp/<r>))``: DCP's defaults (it fsyncs each
  file), on the same local disk as the fast tier;
* ``CheckpointClient.save(sd, "bench/<r>")`` (defaults): the stall (``save()`` returning), the
  commit on the fast tier (``wait()``), and the durable copy (``wait(durable=True)``), each from the
  barrier before the save;
* the same save to a second ``ckptd serve`` without a durable tier on the same disk (what the
  tier itself costs the commit).

Ratios: ``commit_ratio`` = DCP's save time / ckptd's time to commit on the fast tier (the goal is
0.9 or more: within 10 %); ``durable_s`` the time from the save to its durable marker on S3, and
``lag_s`` its part after the commit; ``durable_mb_s`` the bytes over that lag. The floor of the
durable copy is moto's own PUT throughput, measured first from this process (one 64 MiB object).
Each rank's checkpoint is read back from the durable tier alone (a second service on it) and
compared bit for bit at the end.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.device_mesh import init_device_mesh

from bench._report import add_workdir_args, work_dir, write_report
from bench.save_load import MiB, _max_over_ranks, describe_machine, make_state, state_bytes, tensor_specs
from s3_server import AWS_VARS_TO_CLEAR, MotoServer  # noqa: E402  (tests/, on sys.path via bench.save_load)
from support import ServerProcess, run_ranks  # noqa: E402

BUCKET = "bucket"
GOALS = {"commit_ratio": 0.9}


def save_job(rank: int, world: int, cfg: dict) -> dict:
    from ckptd_client import CheckpointClient

    mesh = init_device_mesh("cpu", (world,))
    sd = make_state(cfg["specs"], mesh, fill=True)
    client = CheckpointClient(cfg["url"], incremental=False)  # the same bytes each repeat: full saves
    plain = CheckpointClient(cfg["plain_url"], incremental=False)  # a service without a durable tier
    warm = make_state(tensor_specs(1), mesh, fill=True)
    dcp.save(warm, storage_writer=dcp.FileSystemWriter(f"{cfg['dcp_dir']}/warmup"))
    client.save(warm, "bench/warmup").wait(durable=True)
    plain.save(warm, "bench/warmup").wait()
    del warm
    repeats = []
    variants = ("dcp", "ckptd", "plain")
    for r in range(cfg["repeat"]):
        rec: dict[str, Any] = {}
        for which in variants[r % 3:] + variants[:r % 3]:
            dist.barrier()
            t0 = time.perf_counter()
            if which == "dcp":
                dcp.save(sd, storage_writer=dcp.FileSystemWriter(f"{cfg['dcp_dir']}/{r}"))
                dist.barrier()
                rec["dcp_save_s"] = _max_over_ranks([time.perf_counter() - t0])[0]
                continue
            if which == "plain":
                plain.save(sd, f"bench/{r}").wait()
                dist.barrier()
                rec["plain_commit_s"] = _max_over_ranks([time.perf_counter() - t0])[0]
                continue
            handle = client.save(sd, f"bench/{r}")
            stall = time.perf_counter() - t0
            handle.wait()
            dist.barrier()
            commit = time.perf_counter() - t0
            st = handle.wait(durable=True)
            assert st.durable, st
            dist.barrier()
            durable = time.perf_counter() - t0
            rec["ckptd_stall_s"], rec["ckptd_commit_s"], rec["ckptd_durable_s"] = \
                _max_over_ranks([stall, commit, durable])
        repeats.append(rec)
    client.close()
    plain.close()
    return {"repeats": repeats}


def check_job(rank: int, world: int, cfg: dict) -> dict:
    """Each repeat's checkpoint, read from the durable tier alone, equals the state saved."""
    from ckptd_client import CheckpointClient

    mesh = init_device_mesh("cpu", (world,))
    want = make_state(cfg["specs"], mesh, fill=True)
    ok = True
    with CheckpointClient(cfg["alone_url"]) as client:
        for r in range(cfg["repeat"]):
            got = make_state(cfg["specs"], mesh, fill=False)
            client.load(got, f"bench/{r}")
            ok &= all(torch.equal(got["model"][k].to_local(), v.to_local()) for k, v in want["model"].items())
    return {"bits_equal": bool(_max_over_ranks([0.0 if ok else 1.0])[0] == 0.0)}


def put_floor(moto: MotoServer, nbytes: int = 64 * MiB) -> float:
    """moto's PUT throughput (MB/s) for one object of ``nbytes`` from this process: the durable copy's floor."""
    s3 = moto.client()
    body = os.urandom(nbytes)
    t0 = time.perf_counter()
    s3.put_object(Bucket=BUCKET, Key="floor/probe", Body=body)
    t = time.perf_counter() - t0
    s3.delete_object(Bucket=BUCKET, Key="floor/probe")
    return nbytes / t / 1e6


def summarise(repeats: list[dict], nbytes: int, floor_mb_s: float) -> dict:
    med = {k: statistics.median(r[k] for r in repeats) for k in repeats[0]}
    lag = med["ckptd_durable_s"] - med["ckptd_commit_s"]
    return {
        "dcp_save_s": med["dcp_save_s"], "ckptd_stall_s": med["ckptd_stall_s"],
        "ckptd_commit_s": med["ckptd_commit_s"], "commit_ratio": med["dcp_save_s"] / med["ckptd_commit_s"],
        "plain_commit_s": med["plain_commit_s"], "plain_ratio": med["dcp_save_s"] / med["plain_commit_s"],
        "durable_s": med["ckptd_durable_s"], "lag_s": lag, "durable_mb_s": nbytes / lag / 1e6 if lag > 0 else None,
        "moto_put_mb_s": floor_mb_s, "durable_vs_put_floor": (nbytes / lag / 1e6) / floor_mb_s if lag > 0 else None,
    }


def markdown(res: dict) -> str:
    s, c = res["summary"], res["config"]
    return "\n".join([
        f"{c['state_bytes'] / MiB:.0f} MiB over {c['world']} ranks, median of {c['repeat']} repeats",
        f"  dcp.save to local disk (FileSystemWriter):   {s['dcp_save_s']:.3f} s",
        f"  ckptd commit on the fast tier (wait()):      {s['ckptd_commit_s']:.3f} s  "
        f"(ratio {s['commit_ratio']:.2f}, goal >= {GOALS['commit_ratio']}); stall {s['ckptd_stall_s']:.3f} s",
        f"  ckptd commit, same service without a durable tier: {s['plain_commit_s']:.3f} s  "
        f"(ratio {s['plain_ratio']:.2f})",
        f"  ckptd durable on S3 (wait(durable=True)):    {s['durable_s']:.3f} s from the save, "
        f"{s['lag_s']:.3f} s after the commit ({s['durable_mb_s'] or 0:.0f} MB/s; moto's own PUT "
        f"{s['moto_put_mb_s']:.0f} MB/s)",
        f"  read back from the durable tier alone, bit for bit: {res['check']['bits_equal']}",
    ])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mib", type=float, default=256, help="total fp32 state over the ranks (MiB)")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results" / "tiers.json")
    add_workdir_args(ap, "parent of the temporary work dir (the fast tier, DCP's output, logs)")
    args = ap.parse_args(argv)
    with work_dir("ckptd-bench-tiers-", args.workdir, args.keep) as work:
        t_start = time.perf_counter()
        moto = MotoServer(work / "moto.log", bucket=BUCKET)
        server = alone = plain = None
        try:
            specs = tensor_specs(args.mib)
            nbytes = state_bytes(specs)
            machine = describe_machine(work)
            moto.start()
            for k in AWS_VARS_TO_CLEAR:  # the ranks (spawned) and the servers inherit this environment
                os.environ.pop(k, None)
            os.environ.update(moto.env)
            floor = put_floor(moto)
            durable = f"s3://{BUCKET}/durable"
            server = ServerProcess(work / "fast", env={**moto.env, "CKPTD_DURABLE": durable},
                                   log=work / "server.log").start()
            plain = ServerProcess(work / "plain", log=work / "plain.log").start()
            cfg = {"specs": specs, "repeat": args.repeat, "url": server.url, "plain_url": plain.url,
                   "dcp_dir": str(work / "dcp")}
            repeats = run_ranks(save_job, args.world, cfg, tmp=work, timeout=600 + args.repeat * nbytes / MiB)
            repeats = repeats[0]["result"]["repeats"]
            server.stop()
            plain.stop()
            alone = ServerProcess(durable, env=moto.env, log=work / "alone.log").start()
            check = run_ranks(check_job, args.world, {**cfg, "alone_url": alone.url}, tmp=work,
                              timeout=600)[0]["result"]
            result = {
                "command": "python -m bench.tiers " + " ".join(sys.argv[1:] if argv is None else argv),
                "config": {"mib": args.mib, "state_bytes": nbytes, "repeat": args.repeat, "world": args.world,
                           "fast": "a local directory (the work dir's disk)", "durable": f"{durable} on moto",
                           "dcp": "dcp.save with FileSystemWriter (defaults) on the same disk"},
                "machine": machine, "goals": GOALS, "summary": summarise(repeats, nbytes, floor),
                "repeats": repeats, "check": check, "wall_s": time.perf_counter() - t_start,
            }
            write_report(args.out, result, markdown(result))
            return 0 if check["bits_equal"] else 1
        finally:
            for srv in (server, alone, plain):
                if srv is not None:
                    srv.stop()
            moto.stop()


if __name__ == "__main__":
    sys.exit(main())
