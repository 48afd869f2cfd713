"""Load and soak: many saving ranks, many checkpoints, a reshard job and gc running at the same time.

    .venv/bin/python -m bench.soak --ranks 16 --checkpoints 20 --mib 64 --out bench/results/soak.json

One real ``ckptd serve`` on a local root. ``--ranks`` gloo processes hold an
FSDP2-style state (``Shard(0)`` DTensors over all ranks, uneven rows, plus a
replicated plain tensor) and save ``--checkpoints`` steps back to back, each
``save()`` followed by ``wait()``; every step changes every value. While they
save, the parent submits a reshard job (``POST /v1/reshard``, the newest
committed step to ``fsdp2:dp=4``) as soon as step 3 has committed, and runs
retention (``ckptd.store.retention.collect``, ``keep_last=4``,
``keep_every=5``) after every few commits. The server's resident memory is
sampled every 0.2 s.

Checked at the end (the run fails otherwise): every step committed, exactly
once (one marker, whose session is the one the ranks used); every checkpoint
still present passes ``verify`` (every byte re-read and re-hashed); the
reshard job finished (it compares every tensor's digest with its source's
before committing) and its output verifies; gc kept the newest step and every
multiple of 5, and deleted only committed ones.
Recorded: commit latency per step (rank 0's ``save()`` call to ``wait()``
returning, and the slowest rank's), p50/p99, and the server's RSS.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import threading
import time
from pathlib import Path

import httpx
import torch

REPO = Path(__file__).resolve().parents[1]
if str(REPO / "tests") not in sys.path:
    sys.path.insert(0, str(REPO / "tests"))

from support import ServerProcess, run_ranks  # noqa: E402  (tests/support.py)

MiB = 1 << 20
WEIGHTS = (7, 3, 5, 2, 11, 1)  # relative tensor sizes: uneven on purpose
KEEP_LAST, KEEP_EVERY = 4, 5


def _state(rank: int, world: int, mib: float, step: int) -> dict:
    """This rank's shards of the global state at ``step`` (values depend on step, tensor and row)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    cols = 256
    total_rows = max(len(WEIGHTS) * world, int(mib * MiB / (4 * cols)))
    sd: dict = {"model": {}}
    for i, w in enumerate(WEIGHTS):
        rows = max(world, total_rows * w // sum(WEIGHTS)) | 1  # odd: uneven shards
        full = torch.arange(rows * cols, dtype=torch.float32).reshape(rows, cols) * 1e-3 + (step * 10 + i)
        sd["model"][f"w{i}"] = distribute_tensor(full, mesh, [Shard(0)])
    sd["model"]["scale"] = torch.full((17,), float(step))  # a plain tensor: replicated, written once
    return sd


def _save_job(rank: int, world: int, url: str, run: str, steps: int, mib: float) -> dict:
    from ckptd_client import CheckpointClient

    client = CheckpointClient(url)
    lat: list[float] = []
    sessions: list[str] = []
    for step in range(1, steps + 1):
        sd = _state(rank, world, mib, step)
        t0 = time.perf_counter()
        handle = client.save(sd, f"{run}/{step}")
        status = handle.wait()
        lat.append(time.perf_counter() - t0)
        sessions.append(status.session)
        assert status.state == "committed", status
    client.close()
    return {"latency_s": lat, "sessions": sessions}


def _rss_sampler(pid: int, stop: threading.Event, out: list[int]) -> None:
    while not stop.is_set():
        try:
            for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    out.append(int(line.split()[1]) * 1024)
        except OSError:
            pass
        stop.wait(0.2)


def _background(url: str, root: Path, run: str, steps: int, stop: threading.Event, log: dict) -> None:
    """Submit one reshard job once step 3 is committed; run gc after every few new commits."""
    from ckptd.storage import LocalStorage
    from ckptd.store.retention import collect

    storage = LocalStorage(root)
    job_id = None
    gc_runs = 0
    seen = 0
    with httpx.Client(base_url=url, timeout=30) as http:
        while not stop.is_set():
            names = [c["name"] for c in http.get(f"/v1/runs/{run}/checkpoints").json()]
            done = [int(n) for n in names if n.isdigit()]
            newest = max(done, default=0)
            if job_id is None and newest >= 3:
                r = http.post("/v1/reshard", json={"source": f"{run}/{newest}", "to": "fsdp2:dp=4",
                                                   "out": f"{run}-dp4/{newest}", "jobs": 2})
                r.raise_for_status()
                job_id = r.json()["id"]
                log["reshard"] = {"id": job_id, "source": f"{run}/{newest}", "submitted_at": time.time()}
            if newest >= seen + 3:
                seen = newest
                plan = collect(storage, run, keep_last=KEEP_LAST, keep_every=KEEP_EVERY)
                gc_runs += 1
                log.setdefault("gc_deleted", []).extend(plan.deleted)
            if job_id is not None and "job" not in log:
                st = http.get(f"/v1/jobs/{job_id}").json()
                if st["state"] in ("done", "failed"):
                    log["job"] = st
                    log["reshard"]["finished_at"] = time.time()
            stop.wait(0.3)
    log["gc_runs"] = gc_runs


class _Source:
    """``verify``'s byte source: the storage root directly, not the server that wrote it."""

    def __init__(self, reader, run: str, name: str) -> None:
        self.reader, self.run, self.name = reader, run, name

    def read(self, file: str, start: int, end: int) -> bytes:
        return self.reader.read_range(self.run, self.name, file, start, end)


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, int(round(q * (len(xs) - 1)))))]


def run(ranks: int, checkpoints: int, mib: float, work: Path, timeout: float) -> dict:
    from ckptd.storage import LocalStorage
    from ckptd.store import CheckpointReader
    from ckptd.store.retention import collect
    from ckptd.store.verify import verify_manifest

    root = work / "root"
    run_name = "soak"
    srv = ServerProcess(root, env={"CKPTD_RESHARD_WORKERS": "1"}).start()
    stop = threading.Event()
    rss: list[int] = []
    log: dict = {}
    sampler = threading.Thread(target=_rss_sampler, args=(srv.proc.pid, stop, rss), daemon=True)
    bg = threading.Thread(target=_background, args=(srv.url, root, run_name, checkpoints, stop, log), daemon=True)
    sampler.start()
    bg.start()
    t0 = time.perf_counter()
    try:
        recs = run_ranks(_save_job, ranks, srv.url, run_name, checkpoints, mib, tmp=work, timeout=timeout)
        wall = time.perf_counter() - t0
        deadline = time.monotonic() + 300
        while "job" not in log and time.monotonic() < deadline:  # the reshard job may still be running
            time.sleep(0.5)
    finally:
        stop.set()
        bg.join(timeout=30)
        sampler.join(timeout=5)
    try:
        storage = LocalStorage(root)
        final = collect(storage, run_name, keep_last=KEEP_LAST, keep_every=KEEP_EVERY)
        log.setdefault("gc_deleted", []).extend(final.deleted)
        reader = CheckpointReader(storage)
        lat = [r["result"]["latency_s"] for r in recs]
        sessions = [r["result"]["sessions"] for r in recs]
        assert all(s == sessions[0] for s in sessions), "ranks saw different sessions"
        present = {c.name: c for c in reader.list_checkpoints(run_name)}
        deleted = set(log["gc_deleted"])
        problems: list[str] = []
        for step in range(1, checkpoints + 1):
            name = str(step)
            if name in present:
                if present[name].session != sessions[0][step - 1]:
                    problems.append(f"{name}: marker names session {present[name].session}, "
                                    f"ranks committed {sessions[0][step - 1]}")
            elif name not in deleted:
                problems.append(f"{name}: committed by the ranks, not present and not deleted by gc")
            elif step == checkpoints or step % KEEP_EVERY == 0:
                problems.append(f"{name}: gc deleted a checkpoint the policy keeps")
        verified = {}
        refs = [(run_name, n) for n in present] + [(f"{run_name}-dp4", c.name)
                                                   for c in reader.list_checkpoints(f"{run_name}-dp4")]
        for r, n in refs:
            m = reader.manifest(r, n)
            rep = verify_manifest(m, _Source(reader, r, n))
            verified[f"{r}/{n}"] = rep.ok
            if not rep.ok:
                problems.append(f"verify {r}/{n}: {rep.problems[:3]}")
        job = log.get("job") or {}
        if job.get("state") != "done":
            problems.append(f"reshard job did not finish: {job}")
        per_step_max = [max(col) for col in zip(*lat)]
        rank0 = lat[0]
        result = {
            "config": {"ranks": ranks, "checkpoints": checkpoints, "mib": mib, "keep_last": KEEP_LAST,
                       "keep_every": KEEP_EVERY},
            "machine": {"nproc": os.cpu_count(), "platform": platform.platform(),
                        "load_avg_end": os.getloadavg()},
            "wall_s": wall,
            "commit_latency_s": {"rank0": rank0, "slowest_rank": per_step_max,
                                 "p50": statistics.median(per_step_max), "p99": _pct(per_step_max, 0.99),
                                 "max": max(per_step_max)},
            "server_rss_bytes": {"peak": max(rss, default=0), "first": rss[0] if rss else 0,
                                 "last": rss[-1] if rss else 0, "samples": len(rss)},
            "reshard_job": job, "gc": {"runs": log.get("gc_runs", 0) + 1, "deleted": sorted(deleted, key=int)},
            "verified": verified, "problems": problems, "ok": not problems,
        }
    finally:
        srv.stop()
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", type=int, default=16)
    p.add_argument("--checkpoints", type=int, default=20)
    p.add_argument("--mib", type=float, default=64.0, help="global state size per checkpoint")
    p.add_argument("--timeout", type=float, default=900.0)
    p.add_argument("--work", type=Path, help="work directory (default: a fresh temp dir)")
    p.add_argument("--out", type=Path)
    args = p.parse_args(argv)
    import tempfile

    work = args.work or Path(tempfile.mkdtemp(prefix="ckptd-soak-"))
    work.mkdir(parents=True, exist_ok=True)
    result = run(args.ranks, args.checkpoints, args.mib, work, args.timeout)
    result["command"] = "python -m bench.soak " + " ".join(argv if argv is not None else sys.argv[1:])
    text = json.dumps(result, indent=2, default=str)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)
    lat = result["commit_latency_s"]
    print(f"{args.ranks} ranks x {args.checkpoints} checkpoints in {result['wall_s']:.1f}s: commit latency "
          f"p50 {lat['p50']:.2f}s p99 {lat['p99']:.2f}s; server RSS peak "
          f"{result['server_rss_bytes']['peak'] / MiB:.0f} MiB; ok={result['ok']} {result['problems'][:3]}")
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
