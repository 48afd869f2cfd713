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

``--s3`` (the node-local layout of ``deploy/k8s/node-local``): one moto S3 server
(tests/s3_server.py ``MotoServer``) and two replicas on one ``s3://`` root, each
with ``CKPTD_DIRECT_UPLOADS=false`` and its socket in one shared ``TMPDIR``, as a
node's replica is configured. Ranks 0, 1 save through A and 2, 3 through B (each
client given its own replica first, the other second), over the co-located socket,
``--repeat`` times (default 128 MiB, 2 saves); then once more while B is SIGKILLed
as soon as it has been handed a file of that save. Per save, from both replicas'
``/metrics`` (rank 0 reads them between barriers): the data bytes each received and
hashed as they arrived (``ckptd_bytes_in_total`` of the upload routes), what its
commits confirmed as checked on arrival or read back
(``ckptd_commit_checked_bytes_total``), the commit lag (``ckptd_commit_seconds``:
the last index to the marker) and the re-read after the marker (the checkpoint's
recorded verification: bytes and seconds). Every checkpoint is loaded through A and
compared bit for bit.

    .venv/bin/python -m bench.replicas --s3 --out bench/results/replicas_s3.json

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
import shutil
import statistics
import sys
import tempfile
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


# -- --s3: two replicas on one S3 root, each receiving half of the ranks (the node-local layout) ----------

S3_BUCKET = "bucket"
FILES_PER_RANK = 8
DATA_ROUTES = ("local_upload", "upload_file")  # the ways a data file's bytes enter a replica


def scrape(url: str) -> dict[str, float] | None:
    """The counters of one replica's ``/metrics`` this mode reports; None when it does not answer."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    try:
        text = httpx.get(f"{url}/metrics", timeout=10).text
    except httpx.HTTPError:
        return None
    out: dict[str, float] = {"on_arrival": 0.0, "read_back": 0.0, "commits": 0.0, "commit_s": 0.0,
                             "data_in": 0.0, "socket_in": 0.0}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == "ckptd_commit_checked_bytes_total":
                out["on_arrival" if s.labels.get("how") == "on arrival" else "read_back"] += s.value
            elif s.name == "ckptd_commits_total":
                out["commits"] += s.value
            elif s.name == "ckptd_commit_seconds_sum":
                out["commit_s"] += s.value
            elif s.name == "ckptd_bytes_in_total" and s.labels.get("route") in DATA_ROUTES:
                out["data_in"] += s.value  # a data file's bytes, hashed here as they arrived
                if s.labels["route"] == "local_upload":
                    out["socket_in"] += s.value
    return out


def _delta(after: dict | None, before: dict | None) -> dict | None:
    return None if after is None or before is None else {k: after[k] - before[k] for k in after}


def verification(urls: list[str], ref: str, timeout: float = 300.0) -> dict | None:
    """The re-read after the marker (the checkpoint's recorded verification), once it is there."""
    import httpx

    run, name = ref.split("/")
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for url in urls:
            try:
                r = httpx.get(f"{url}/v1/checkpoints/{run}/{name}/verification", timeout=10)
            except httpx.HTTPError:
                continue
            if r.status_code == 200:
                return r.json()
        time.sleep(0.2)
    return None


def s3_save_job(rank: int, world: int, plan: list[dict], mib: float, replicas: list[str], go: str) -> list[dict]:
    """For each entry of ``plan``: barrier, save through this rank's replicas (its own first, the other
    one for fail-over), wait; rank 0 also reads both replicas' counters before and after. With ``kill``,
    a file in ``go`` tells the parent the save has started (it then kills replica B)."""
    from ckptd_client import CheckpointClient

    out = []
    for p in plan:
        sd = rank_state(rank, world, mib, p["seed"])
        # Several files per rank, so that a replica killed after its first file is killed mid-save.
        file_bytes = max(int(mib * MiB) // world // FILES_PER_RANK, 1 << 20)
        with CheckpointClient(p["urls"][rank], retry_seconds=120, incremental=False, file_bytes=file_bytes) as client:
            dist.barrier()
            before = [scrape(u) for u in replicas] if rank == 0 else None
            if p.get("kill"):
                Path(go, f"rank{rank}").touch()
            t0 = time.monotonic()
            handle = client.save(sd, p["ref"])
            t_stall = time.monotonic() - t0
            status = handle.wait(timeout=1800)
            t_done = time.monotonic() - t0
            rec = {"ref": p["ref"], "stall_s": t_stall, "commit_s": t_done, "state": status.state,
                   "manifest_xxh3": status.manifest_xxh3, "ways": dict(handle.ways.bytes)}
            if rank == 0:  # the re-read after the marker, before the next save starts
                rec["reread"] = verification(replicas, p["ref"])
                rec["replicas"] = [_delta(scrape(u), b) for u, b in zip(replicas, before)]
            dist.barrier()
        out.append(rec)
    return out


def _killer(go: Path, ranks: list[int], victim: ServerProcess, state: dict) -> None:
    """Once the ranks of the killed save have started, and ``victim`` has been handed a file of theirs
    (its socket's bytes grew), SIGKILL it; ``state`` records when and what it had received."""
    deadline = time.monotonic() + 1800
    while not all((go / f"rank{r}").exists() for r in ranks):
        if time.monotonic() > deadline:
            return
        time.sleep(0.02)
    start = seen = scrape(victim.url) or {"data_in": 0.0, "socket_in": 0.0}
    while time.monotonic() < deadline:
        now = scrape(victim.url)
        if now is None:  # too busy to answer within 10 s: it is receiving
            break
        seen = now
        if now["socket_in"] > start["socket_in"]:
            break
        time.sleep(0.02)
    state["received_before_kill"] = seen["data_in"] - start["data_in"]  # as its last answer counted them
    state["killed_at"] = time.time()
    victim.kill()


def main_s3(args: argparse.Namespace) -> int:
    """Two replicas on one S3 root (moto), ranks 0, 1 saving through A and 2, 3 through B over the
    co-located socket; then the same save with B SIGKILLed while its ranks upload to it."""
    import threading

    from s3_server import AWS_VARS_TO_CLEAR, MotoServer

    with work_dir("ckptd-bench-replicas-s3-", args.workdir, args.keep) as work:
        t_start, loadavg = time.perf_counter(), os.getloadavg()
        moto = MotoServer(work / "moto.log", bucket=S3_BUCKET)
        a = b = None
        cleanup: list[Path] = []
        try:
            moto.start()
            for k in AWS_VARS_TO_CLEAR:  # the ranks (spawned) and the servers inherit this environment
                os.environ.pop(k, None)
            os.environ.update(moto.env)
            root = f"s3://{S3_BUCKET}/ckptd"
            # As deploy/k8s/node-local configures each node's replica: no direct uploads (the ranks hand
            # their files to the replica on their node), the socket's directory set by TMPDIR.
            # A short path of its own: a socket's path must fit sun_path (107 bytes), a work dir's may not.
            sockets = Path(tempfile.mkdtemp(prefix="ckptd-s-", dir="/tmp"))
            cleanup.append(sockets)
            env = {**moto.env, "CKPTD_DIRECT_UPLOADS": "false", "TMPDIR": str(sockets)}
            a = ServerProcess(root, env=env, log=work / "a.log")
            b = ServerProcess(root, env=env, log=work / "b.log")
            a.start(wait=False), b.start(wait=False)
            a.wait_ready(), b.wait_ready()
            urls = [[a.url, b.url], [a.url, b.url], [b.url, a.url], [b.url, a.url]]  # own replica first
            plan = [{"ref": f"bench/{i + 1}", "urls": urls, "seed": i + 1} for i in range(args.repeat)]
            plan.append({"ref": f"bench/{args.repeat + 1}", "urls": urls, "seed": args.repeat + 1, "kill": True})
            go = work / "go"
            go.mkdir()
            kill: dict = {}
            killer = threading.Thread(target=_killer, args=(go, [2, 3], b, kill), daemon=True)
            killer.start()
            budget = 600 + 10 * args.mib * (args.repeat + 1)
            records = run_ranks(s3_save_job, WORLD, plan, args.mib, [a.url, b.url], str(go), tmp=work,
                                timeout=budget)
            killer.join(5)
            per_ckpt = []
            for i, p in enumerate(plan):
                rows = [rec["result"][i] for rec in records]
                assert {r["state"] for r in rows} == {"committed"}, rows
                assert len({r["manifest_xxh3"] for r in rows}) == 1, rows
                check_load(a.url, p["ref"], args.mib, p["seed"])  # replica A: B is dead after the last save
                reread, reps = rows[0]["reread"], rows[0]["replicas"]
                per_ckpt.append({
                    "ref": p["ref"], "kill": bool(p.get("kill")), "stall_s": max(r["stall_s"] for r in rows),
                    "commit_s": max(r["commit_s"] for r in rows),
                    "ways": {w: sum(r["ways"][w] for r in rows) for w in rows[0]["ways"]},
                    "ways_by_rank": [{w: n for w, n in r["ways"].items() if n} for r in rows],
                    "replicas": dict(zip("AB", reps)),
                    "commit_lag_s": sum(r["commit_s"] for r in reps if r),  # ckptd_commit_seconds of the commit
                    "committed_by": "".join(n for n, r in zip("AB", reps) if r and r["commits"]) or "B (killed)",
                    "on_b_ranks": {w: sum(r["ways"][w] for r in rows[2:]) for w in rows[0]["ways"]},
                    "reread": None if reread is None else {k: reread[k] for k in ("ok", "bytes_read", "seconds")},
                    "loaded_bit_exact": True,
                })
            result = {"benchmark": "replicas_s3", "command": "python -m bench.replicas " + " ".join(args.argv),
                      "mib": args.mib, "ranks": WORLD, "repeat": args.repeat,
                      "config": {"root": root, "replicas": 2, "ranks_per_replica": WORLD // 2,
                                 "service_env": {"CKPTD_DIRECT_UPLOADS": "false", "TMPDIR": "/tmp/ckptd-s-*"},
                                 "client": "CheckpointClient([own replica, other replica], incremental=False)",
                                 "s3": "moto server mode, one process on loopback"},
                      "kill": kill, "machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                                                "python": platform.python_version(), "torch": torch.__version__,
                                                "loadavg_at_start": loadavg},
                      "checkpoints": per_ckpt, "wall_s": time.perf_counter() - t_start,
                      "loadavg_at_end": os.getloadavg()}
            for c in per_ckpt:
                reps = "; ".join(f"{n} received and hashed {r['data_in'] / MiB:.1f} MiB, its commits confirmed "
                                 f"{r['on_arrival'] / MiB:.1f} MiB checked on arrival and read back "
                                 f"{r['read_back'] / MiB:.1f} MiB" if r else f"{n} killed"
                                 for n, r in c["replicas"].items())
                rr = c["reread"]
                print(f"{c['ref']}{' (B killed mid-save)' if c['kill'] else ''}: committed by {c['committed_by']} in "
                      f"{c['commit_s']:.2f}s, commit lag {c['commit_lag_s']:.3f}s; {reps}; re-read after the marker "
                      + (f"{rr['bytes_read'] / MiB:.1f} MiB in {rr['seconds']:.2f}s ok={rr['ok']}" if rr else "none")
                      + f"; ways {c['ways']}")
            if kill:
                b_ranks = per_ckpt[-1]["on_b_ranks"]
                print(f"B SIGKILLed after receiving {kill['received_before_kill'] / MiB:.1f} MiB of the save; its ranks' "
                      f"bytes: {b_ranks['socket'] / MiB:.1f} MiB handed to B, {b_ranks['http'] / MiB:.1f} MiB sent "
                      "again through A; committed and loaded bit for bit")
            if args.out:
                args.out.parent.mkdir(parents=True, exist_ok=True)
                args.out.write_text(json.dumps(result, indent=2) + "\n")
            return 0
        finally:
            for s in (a, b):
                if s is not None:
                    s.kill()
            moto.stop()
            for d in cleanup:
                shutil.rmtree(d, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mib", type=float, default=None,
                    help="total fp32 state over the 4 saving ranks (MiB; default 256, with --s3 128)")
    ap.add_argument("--repeat", type=int, default=None, help="saves per mode (default 3, with --s3 2, then the kill)")
    ap.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    ap.add_argument("--s3", action="store_true",
                    help="two replicas on one S3 root (moto), each receiving half of the ranks over the co-located "
                         "socket, then one killed mid-save (the node-local layout)")
    add_workdir_args(ap, "parent of the work directory (one disk)")
    args = ap.parse_args(argv)
    args.argv = sys.argv[1:] if argv is None else list(argv)
    if args.s3:
        args.mib, args.repeat = args.mib or 128, args.repeat or 2
        return main_s3(args)
    args.mib, args.repeat = args.mib or 256, args.repeat or 3

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
