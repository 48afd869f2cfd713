"""Load and soak: many saving ranks, many checkpoints; beside them a reshard job and gc, or a second
service replica and a SIGKILL.

    .venv/bin/python -m bench.soak --ranks 16 --checkpoints 20 --mib 64 --out bench/results/soak.json
    .venv/bin/python -m bench.soak --replicas 2 --ranks 64 --checkpoints 20 --mib 16 --kill-after-step 8 \
        --out bench/results/soak_replicas.json       # --restart: the killed replica comes back

One replica (the default): one real ``ckptd serve`` on a local root. ``--ranks``
gloo processes hold an FSDP2-style state (``Shard(0)`` DTensors over all ranks,
uneven rows, plus a replicated plain tensor) and save ``--checkpoints`` steps
back to back, each ``save()`` followed by ``wait()``; every step changes every
value. While they save, the parent submits a reshard job (``POST /v1/reshard``,
the newest committed step to ``fsdp2:dp=4``) as soon as step 3 has committed,
and runs retention (``ckptd.store.retention.collect``, ``keep_last=4``,
``keep_every=5``) after every few commits. The server's resident memory is
sampled every 0.2 s. Checked at the end (the run fails otherwise): every step
committed, exactly once (one marker, whose session is the one the ranks used);
every checkpoint still present passes ``verify`` (every byte re-read and
re-hashed); the reshard job finished (it compares every tensor's digest with
its source's before committing) and its output verifies; gc kept the newest
step and every multiple of 5, and deleted only committed ones.

Two replicas (``--replicas 2``): two ``ckptd serve`` processes on one local
root, both sweeping every 2 s (stale-session TTL 60 s). The ``--ranks`` gloo
processes are forked from one process that imported torch and the client once
(:func:`run_forked`), hold flat-partitioned state (``FlatShard`` slices of six
uneven tensors of ``--mib`` MiB in all, a replicated plain tensor, a JSON
object) and save ``--checkpoints`` steps, each ``save()`` followed by
``wait()``, every byte through HTTP in files of 64
KiB. Each rank's client is ``CheckpointClient([A, B])`` (even ranks) or
``[B, A]`` (odd ranks). Once step ``--kill-after-step`` has committed, the
parent SIGKILLs replica A at the first later step it finds mid-save (half its
data files stored, not every rank's index, no marker); the ranks fail over to
B. With ``--restart``, A starts again once the step after the killed one has
committed. Checked at the end (the run fails otherwise): every step
has exactly one marker content, ever (polled every 20 ms), naming the session
every rank got; after the replicas' sweeps that session is the only one under
its step, with one manifest and no failure record; every checkpoint passes
``verify``; every live replica lists the same steps and manifest digests;
every rank loads the killed step and the last one back through a fresh client
and gets what it saved, bit for bit; neither replica logged an error.

Recorded: commit latency per step (rank 0's ``save()`` call to ``wait()``
returning, and the slowest rank's), p50/p99, and the servers' RSS; with two
replicas also the steps around the kill, the failover (kill to each rank's
failover, kill to the killed step's marker), the ranks' memory, and the hidden
partial files the killed replica left inside committed sessions.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable

import httpx
import torch
import torch.distributed as dist

from bench._report import git_state

REPO = Path(__file__).resolve().parents[1]
if str(REPO / "tests") not in sys.path:
    sys.path.insert(0, str(REPO / "tests"))

from support import ServerProcess, run_ranks, server_errors  # noqa: E402  (tests/support.py)

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
    from ckptd.store.checker import verify_manifest

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
        present = {c.name: c for c in reader.checkpoints_page(run_name)[0]}
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
                                                   for c in reader.checkpoints_page(f"{run_name}-dp4")[0]]
        for r, n in refs:
            m = reader.manifest(r, n)
            rep = verify_manifest(m, _Source(reader, r, n).read)
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


# -- two replicas, one SIGKILLed mid-save --------------------------------------------------------------

RUN = "soak"
FILE_BYTES = 64 << 10  # several files per rank: a kill finds uploads in flight
SWEEP_S, TTL_S = 2.0, 60.0
SWEEP_ENV = {"CKPTD_RECLAIM_INTERVAL": str(SWEEP_S), "CKPTD_STALE_SESSION_TTL": str(TTL_S)}
POLL_S = 0.02
PRELOAD = ["torch", "torch.distributed", "ckptd_client.client", "ckptd_client.flat"]


def flat_state(rank: int, world: int, mib: float, step: int) -> dict:
    """This rank's part of the global state at ``step``, built without torch.distributed: a contiguous
    slice of each of six flat tensors of uneven sizes (slices differ by one element), values depending
    on step, tensor and position; a replicated plain tensor (written once); a JSON object."""
    from ckptd_client import FlatShard

    total = max(len(WEIGHTS) * world * 4, int(mib * MiB) // 4)
    model: dict = {}
    for i, w in enumerate(WEIGHTS):
        n = max(world, total * w // sum(WEIGHTS)) | 1
        lo, hi = rank * n // world, (rank + 1) * n // world
        model[f"w{i}"] = FlatShard(torch.arange(lo, hi, dtype=torch.float32) * 1e-3 + (step * 10 + i), (n,), lo)
    model["scale"] = torch.full((17,), float(step))
    return {"model": model, "extra": {"step": step}}


def _blank(sd: dict) -> dict:
    """``sd``'s keys, slices, shapes and dtypes, every value 7 and the object None: what a load must overwrite."""
    from ckptd_client import FlatShard

    model = {k: FlatShard(torch.full_like(v.local, 7), v.global_shape, v.flat_offset) if isinstance(v, FlatShard)
             else torch.full_like(v, 7) for k, v in sd["model"].items()}
    return {"model": model, "extra": {k: None for k in sd["extra"]}}


def _differs(got: dict, want: dict) -> str | None:
    """The first key whose bits (tensors, slices) or value (objects) differ; None when all are equal."""
    from ckptd_client import FlatShard

    for k, w in want["model"].items():
        g = got["model"][k]
        a, b = (g.local, w.local) if isinstance(w, FlatShard) else (g, w)
        if a.dtype != b.dtype or a.shape != b.shape or not torch.equal(a.view(torch.uint8), b.view(torch.uint8)):
            return f"model.{k}"
    return None if got["extra"] == want["extra"] else "extra"


class _FailoverLog(logging.Handler):
    """When (wall clock) this rank's client logged "failing over" to another replica."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.times: list[float] = []

    def emit(self, record: logging.LogRecord) -> None:
        if "failing over" in record.getMessage():
            self.times.append(record.created)


def _replica_job(rank: int, world: int, urls: list[str], steps: int, mib: float, kill_record: str) -> dict:
    """One rank of the two-replica soak: ``steps`` saves, each followed by ``wait()``, through one
    ``CheckpointClient`` over both replicas in this rank's order (even ranks prefer the first); then the
    killed step and the last one loaded back through a fresh client and compared bit for bit.
    Returns per step the latency, the wall time ``wait()`` returned and the session; the failovers logged."""
    from ckptd_client import CheckpointClient

    order = urls if rank % 2 == 0 else urls[::-1]
    failovers = _FailoverLog()
    logging.getLogger("ckptd_client").addHandler(failovers)
    lat, done, sessions = [], [], []
    with CheckpointClient(order, file_bytes=FILE_BYTES) as client:
        for step in range(1, steps + 1):
            sd = flat_state(rank, world, mib, step)
            t0 = time.perf_counter()
            status = client.save(sd, f"{RUN}/{step}").wait()
            lat.append(time.perf_counter() - t0)
            done.append(time.time())
            sessions.append(status.session)
        url_at_end = client._transport.url
    loaded = {step: _load_back(order, rank, world, mib, step) for step in _steps_to_load(Path(kill_record), steps)}
    return {"latency_s": lat, "done_at": done, "sessions": sessions, "failovers_at": failovers.times,
            "url_at_end": url_at_end, "loaded": loaded}


def _steps_to_load(kill_record: Path, steps: int) -> list[int]:
    """The step the kill landed in (the parent's record, as rank 0 reads it) and the last step; the same
    list on every rank, since the loads are collective."""
    box: list = [None]
    if dist.get_rank() == 0:
        killed = json.loads(kill_record.read_text())["step"] if kill_record.exists() else steps
        box = [sorted({killed, steps})]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _load_back(urls: list[str], rank: int, world: int, mib: float, step: int) -> str:
    """Load ``step`` into blank state through a fresh client (collective): "equal", or the key that differs."""
    from ckptd_client import CheckpointClient

    want = flat_state(rank, world, mib, step)
    got = _blank(want)
    with CheckpointClient(urls, retry_seconds=60) as client:
        client.load(got, f"{RUN}/{step}")
    return _differs(got, want) or "equal"


def run_forked(fn: Callable, world: int, *args: Any, tmp: Path, timeout: float, pids: list[int]) -> list[dict]:
    """``support.run_ranks`` with torch and the client preloaded in the fork server the ranks are forked
    from: on the 2-core machine of BENCHMARKS.md an idle gloo rank then holds ~8 MiB of memory of its own
    instead of ~90 MiB, and 64 are up in ~10 s, where each spawned one spends ~4 s of CPU importing torch.
    ``pids`` gets the ranks' process ids at start; a failed rank raises (``AssertionError``, its traceback)."""
    return run_ranks(fn, world, *args, tmp=tmp, timeout=timeout, preload=PRELOAD, pids=pids)


def _count(d: Path) -> int:
    """Entries of ``d`` whose names do not start with a dot (0 when it does not exist)."""
    try:
        return sum(not n.startswith(".") for n in os.listdir(d))
    except OSError:
        return 0


class Fault:
    """Watches the root from a thread of the parent every ``POLL_S`` and drives the fault.

    ``markers[step]``: every content of the step's ``COMMITTED`` ever read; ``first_seen[step]``: when it
    first appeared. Once step ``kill_after`` has committed, replica ``a`` is SIGKILLed at the first later
    step found mid-save: at least half as many data files stored as step ``kill_after`` has, not every
    rank's index, no marker; ``kill`` records when and what was stored, and goes to ``record`` for the
    ranks. With ``restart``, ``a`` starts again (``restarted``) once the step after the killed one has
    committed, or at :meth:`finish_restart` when the kill hit the last step.
    """

    def __init__(self, root: Path, world: int, a: ServerProcess, kill_after: int, restart: bool,
                 record: Path) -> None:
        self.dir, self.world, self.a = root / "runs" / RUN, world, a
        self.kill_after, self.restart, self.record = kill_after, restart, record
        self.markers: dict[int, set[bytes]] = {}
        self.first_seen: dict[int, float] = {}
        self.kill: dict | None = None
        self.restarted: dict | None = None
        self._restarter: threading.Thread | None = None
        self._files_per_step = 0  # data files of step ``kill_after``: every step has as many

    def run(self, stop: threading.Event) -> None:
        """Poll until ``stop``; four times as often while the kill waits for a step mid-save (with few ranks
        a step lasts a few hundred milliseconds)."""
        while not stop.is_set():
            self.poll()
            stop.wait(POLL_S / 4 if self.kill_after and self.kill is None else POLL_S)

    def poll(self) -> None:
        now = time.time()
        for d in self.dir.iterdir() if self.dir.exists() else ():
            if not d.name.isdigit():
                continue
            try:
                raw = (d / "COMMITTED").read_bytes()
            except OSError:
                continue
            self.markers.setdefault(int(d.name), set()).add(raw)
            self.first_seen.setdefault(int(d.name), now)
        if self.kill is None and self.kill_after and self.kill_after in self.first_seen:
            self._maybe_kill(max(self.first_seen) + 1)
        elif self.kill is not None and self.kill["step"] + 1 in self.first_seen:
            self._start_restart()

    def finish_restart(self, timeout: float) -> None:
        """After the ranks: start the restart if the kill hit the last step, and wait for it to be ready (or
        to fail) before the end checks look at A."""
        if self.kill is not None:
            self._start_restart()
        if self._restarter is not None:
            self._restarter.join(timeout)

    def _start_restart(self) -> None:
        if self.restart and self.restarted is None:
            self.restarted = {"at": time.time()}
            self._restarter = threading.Thread(target=self._restart, daemon=True)
            self._restarter.start()

    def _progress(self, step: int) -> tuple[int, int] | None:
        """(files accepted, indexes stored) of ``step``'s one session; None before it opens or once committed."""
        sdir = self.dir / str(step)
        try:
            sessions = os.listdir(sdir / "sessions")
        except OSError:
            return None
        if len(sessions) != 1 or (sdir / "COMMITTED").exists():
            return None
        return _count(sdir / "sessions" / sessions[0] / "digests"), _count(sdir / "sessions" / sessions[0] / "ranks")

    def _maybe_kill(self, step: int) -> None:
        if not self._files_per_step:
            sid = json.loads(next(iter(self.markers[self.kill_after])))["session"]
            self._files_per_step = _count(self.dir / str(self.kill_after) / "sessions" / sid / "files")
        progress = self._progress(step)
        if progress is None or progress[0] < max(1, self._files_per_step // 2) or progress[1] >= self.world:
            return
        at = time.time()
        self.a.kill()
        self.kill = {"step": step, "at": at, "files_accepted": progress[0], "indexes_stored": progress[1],
                     "marker_right_after": (self.dir / str(step) / "COMMITTED").exists()}
        self.record.write_text(json.dumps(self.kill))

    def _restart(self) -> None:
        assert self.restarted is not None
        try:
            self.a.start()
            self.restarted["ready_s"] = time.time() - self.restarted["at"]
        except (RuntimeError, TimeoutError) as e:
            self.restarted["error"] = str(e)[-500:]


def _status_kib(pid: int, field: str) -> int:
    """A KiB field of ``/proc/PID/status`` (``VmRSS``); 0 when absent (a process killed, not yet reaped)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return 0


def _rollup_kib(pid: int) -> tuple[int, int]:
    """(PSS, private) KiB of ``pid``: its share of every page it maps, and the pages only it maps."""
    kib = {k: int(v.split()[0]) for k, v in (line.split(":", 1) for line in
                                             Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines()[1:])}
    return kib["Pss"], kib["Private_Clean"] + kib["Private_Dirty"]


def _memory_sampler(servers: dict[str, ServerProcess], ranks: list[int], stop: threading.Event, out: dict) -> None:
    """Every 0.2 s each live replica's RSS (a restarted one under its own label, ``a_restarted``); every 5 s
    the ranks' summed PSS and private memory, their largest RSS, and the machine's MemAvailable."""
    labels: dict[int, str] = {}
    tick = 0
    while not stop.is_set():
        for name, srv in servers.items():
            proc = srv.proc
            if proc is None:
                continue
            label = labels.setdefault(proc.pid, name if name not in labels.values() else f"{name}_restarted")
            try:
                rss = _status_kib(proc.pid, "VmRSS") << 10
            except OSError:
                continue
            if rss:  # 0: killed, not yet reaped
                out.setdefault(label, []).append(rss)
        if tick % 25 == 0 and ranks:
            _sample_ranks(ranks, out)
        tick += 1
        stop.wait(0.2)


def _sample_ranks(ranks: list[int], out: dict) -> None:
    """One memory sample of the ranks (those still alive) and of the machine, appended to ``out["ranks"]``."""
    pss, private, rss = 0, 0, []
    for pid in ranks:
        try:
            (p, q), r = _rollup_kib(pid), _status_kib(pid, "VmRSS")
        except (OSError, KeyError):
            continue
        pss, private = pss + (p << 10), private + (q << 10)
        rss.append(r << 10)
    avail = next(int(x.split()[1]) << 10 for x in Path("/proc/meminfo").read_text().splitlines()
                 if x.startswith("MemAvailable:"))
    if rss:
        out.setdefault("ranks", []).append({"alive": len(rss), "pss_total": pss, "private_total": private,
                                            "rss_max": max(rss), "mem_available": avail})


def check_steps(root: Path, steps: int, sessions: list[str], markers: dict[int, set[bytes]]) -> list[str]:
    """Exactly once, step by step: one marker content ever (those seen during the run, ``markers``, and the
    one on disk now), naming ``sessions[step - 1]`` (the session every rank got); that session the only one
    left under the step, with one manifest, the marker's, and no failure record; no other checkpoint in the
    run. Returns the problems (empty: all hold)."""
    problems = []
    run_dir = root / "runs" / RUN
    for step in range(1, steps + 1):
        d = run_dir / str(step)
        try:
            raw = (d / "COMMITTED").read_bytes()
        except OSError:
            problems.append(f"{step}: no COMMITTED marker")
            continue
        contents = markers.get(step, set()) | {raw}
        if len(contents) != 1:
            problems.append(f"{step}: {len(contents)} different COMMITTED contents seen")
        marker, sid = json.loads(raw), sessions[step - 1]
        if marker["session"] != sid:
            problems.append(f"{step}: the marker names session {marker['session']}, the ranks got {sid}")
        left = sorted(os.listdir(d / "sessions"))
        if left != [sid]:
            problems.append(f"{step}: sessions left {left}, want only {sid}")
            continue
        manifests = sorted(n for n in os.listdir(d / "sessions" / sid) if n.startswith("manifest-"))
        if manifests != [marker["manifest"]] or (d / "sessions" / sid / "FAILED.json").exists():
            problems.append(f"{step}: manifests {manifests}, marker {marker['manifest']}, or a failure record")
    others = sorted(set(os.listdir(run_dir)) - {str(s) for s in range(1, steps + 1)}) if run_dir.exists() else []
    if others:
        problems.append(f"checkpoints no rank saved: {others}")
    return problems


def _hidden_files(root: Path) -> dict[str, int]:
    """Dot files inside committed sessions (``run/step/sessions/sid/...``): partial uploads a killed replica
    never finished. The sweep leaves a committed session as it is. Path -> bytes."""
    run_dir = root / "runs" / RUN
    return {str(p.relative_to(run_dir)): p.stat().st_size for p in sorted(run_dir.glob("*/sessions/*/**/.*"))
            if p.is_file()}


def _orphans(root: Path) -> list[Path]:
    """Session directories no marker names."""
    out = []
    for d in (root / "runs" / RUN).glob("*"):
        named = json.loads((d / "COMMITTED").read_bytes())["session"] if (d / "COMMITTED").exists() else None
        out += [s for s in (d / "sessions").glob("*") if s.name != named]
    return out


def _await_sweep(root: Path) -> list[str]:
    """Two sweeps after the last commit; while sessions no marker names remain, until the newest of them
    is past the TTL and swept twice more (at most TTL + 3 sweeps). Returns those left, with their age."""
    time.sleep(2 * SWEEP_S)
    deadline = time.monotonic() + TTL_S + 3 * SWEEP_S
    while _orphans(root) and time.monotonic() < deadline:
        time.sleep(SWEEP_S)
    return [f"{p.relative_to(root)} ({time.time() - p.stat().st_mtime:.0f}s old)" for p in _orphans(root)]


def _verify_all(root: Path, steps: int) -> dict[str, bool | list]:
    """``verify`` of every step, reading the root directly: True, or its first problems."""
    from ckptd.storage import LocalStorage
    from ckptd.store import CheckpointReader
    from ckptd.store.checker import verify_manifest

    reader = CheckpointReader(LocalStorage(root))
    out: dict[str, bool | list] = {}
    for step in range(1, steps + 1):
        name = str(step)
        try:
            rep = verify_manifest(reader.manifest(RUN, name), _Source(reader, RUN, name).read)
            out[name] = True if rep.ok else rep.problems[:3]
        except Exception as e:  # noqa: BLE001 - a checkpoint that cannot even be read is a failed verify
            out[name] = [f"{type(e).__name__}: {e}"]
    return out


def _listing_problems(urls: dict[str, str], root: Path) -> list[str]:
    """Every live replica lists exactly the steps that have a marker, each with the marker's manifest digest."""
    run_dir = root / "runs" / RUN
    want = {d.name: json.loads((d / "COMMITTED").read_bytes())["manifest_xxh3"]
            for d in run_dir.glob("*") if (d / "COMMITTED").exists()}
    problems = []
    for name, url in urls.items():
        rows = httpx.get(f"{url}/v1/runs/{RUN}/checkpoints", timeout=60).json()
        got = {r["name"]: r["manifest_xxh3"] for r in rows}
        if got != want:
            problems.append(f"replica {name} lists {sorted(got, key=int)} or other digests than the markers")
    return problems


def run_replicas(ranks: int, checkpoints: int, mib: float, kill_after: int, restart: bool, work: Path,
                 timeout: float) -> dict:
    """Start both replicas, the watcher (:class:`Fault`) and the memory sampler; run the ranks; let the
    live replicas sweep; then check and report (:func:`_replica_report`)."""
    root = work / "root"
    a = ServerProcess(root, env=SWEEP_ENV, log=work / "a.log")
    b = ServerProcess(root, env=SWEEP_ENV, log=work / "b.log")
    fault = Fault(root, ranks, a, kill_after, restart, work / "kill.json")
    mem: dict = {}
    pids: list[int] = []
    stop = threading.Event()
    threads = [threading.Thread(target=fault.run, args=(stop,), daemon=True),
               threading.Thread(target=_memory_sampler, args=({"a": a, "b": b}, pids, stop, mem), daemon=True)]
    try:
        a.start(wait=False), b.start(wait=False)
        a.wait_ready(), b.wait_ready()
        for th in threads:
            th.start()
        t0 = time.perf_counter()
        try:
            recs = run_forked(_replica_job, ranks, [a.url, b.url], checkpoints, mib, str(work / "kill.json"),
                              tmp=work, timeout=timeout, pids=pids)
            wall = time.perf_counter() - t0
            left = _await_sweep(root)
            fault.finish_restart(timeout=60)
        finally:
            stop.set()
            for th in threads:
                th.join(timeout=30)
        fault.poll()
        return _replica_report(recs, fault, root, {"a": a, "b": b}, left, mem, wall,
                               config={"ranks": ranks, "checkpoints": checkpoints, "mib": mib, "replicas": 2,
                                       "kill_after_step": kill_after, "restart": restart,
                                       "file_bytes": FILE_BYTES, "sweep_s": SWEEP_S, "ttl_s": TTL_S},
                               errors=server_errors(a, b))
    finally:
        a.kill(), b.kill()


def _replica_report(recs: list[dict], fault: Fault, root: Path, servers: dict[str, ServerProcess],
                    orphans: list[str], mem: dict, wall: float, config: dict, errors: list[str]) -> dict:
    """Every check of the two-replica run (the problems) and every figure, as the result JSON."""
    live = {name: s.url for name, s in servers.items() if s.proc is not None}
    res = [r["result"] for r in recs]
    steps = config["checkpoints"]
    sessions = res[0]["sessions"]
    problems = [f"rank {r}: step {i + 1} session {s}, rank 0 got {sessions[i]}"
                for r, x in enumerate(res) for i, s in enumerate(x["sessions"]) if s != sessions[i]][:5]
    problems += check_steps(root, steps, sessions, fault.markers)
    verified = _verify_all(root, steps)
    problems += [f"verify {n}: {v}" for n, v in verified.items() if v is not True]
    problems += _listing_problems(live, root)
    loads = {f"{s}": sorted({x["loaded"][s] for x in res}) for s in res[0]["loaded"]}
    problems += [f"load of {s}: {v}" for s, v in loads.items() if v != ["equal"]]
    problems += [f"sessions no marker names, left after the sweeps: {orphans}"] if orphans else []
    problems += errors[:5]
    if config["kill_after_step"] and fault.kill is None:
        problems.append("the kill never found a step mid-save")
    if config["restart"] and fault.kill is not None and not (fault.restarted or {}).get("ready_s"):
        problems.append(f"replica A did not come back: {fault.restarted}")
    lat = [x["latency_s"] for x in res]
    per_step = [max(col) for col in zip(*lat)]
    return {
        "config": config,
        "machine": {"nproc": os.cpu_count(), "platform": platform.platform(), "load_avg_end": os.getloadavg(),
                    "mem_total_bytes": os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")},
        "git": git_state(),
        "wall_s": wall,
        "commit_latency_s": {"rank0": lat[0], "slowest_rank": per_step, "p50": statistics.median(per_step),
                             "p99": _pct(per_step, 0.99), "max": max(per_step)},
        "kill": fault.kill, "restart": fault.restarted,
        "failover": _failover(res, fault, per_step),
        "memory": _memory_summary(mem),
        "totals": {"steps_committed": len(fault.first_seen), "bytes_per_step": _bytes_per_step(root),
                   "ranks_on_at_end": {n: sum(x["url_at_end"] == s.url for x in res) for n, s in servers.items()}},
        "loaded_back": loads, "verified": verified, "hidden_files_in_committed_sessions": _hidden_files(root),
        "problems": problems, "ok": not problems,
    }


def _failover(res: list[dict], fault: Fault, per_step: list[float]) -> dict | None:
    """How long the kill cost: to each rank's failover (ranks that logged one after it), to the killed
    step's marker, to the last rank's ``wait()`` of that step; the slowest-rank latency of the steps around it."""
    if fault.kill is None:
        return None
    at, step = fault.kill["at"], fault.kill["step"]
    moved = sorted(min(after) - at for x in res if (after := [t for t in x["failovers_at"] if t >= at]))
    return {"killed_step": step, "ranks_failed_over": len(moved),
            "rank_failover_s": {"min": moved[0], "p50": statistics.median(moved), "max": moved[-1]} if moved else None,
            "kill_to_marker_s": fault.first_seen.get(step, float("nan")) - at,
            "kill_to_last_wait_s": max(x["done_at"][step - 1] for x in res) - at,
            "around_kill_s": {str(s): per_step[s - 1] for s in range(step - 2, step + 3) if 1 <= s <= len(per_step)},
            "p50_other_steps_s": statistics.median(v for i, v in enumerate(per_step) if i + 1 != step)}


def _memory_summary(mem: dict) -> dict:
    """Each replica's RSS (first, peak, last sample) and the ranks' peaks, from :func:`_memory_sampler`'s samples."""
    out: dict = {name: {"first": xs[0], "peak": max(xs), "last": xs[-1], "samples": len(xs)}
                 for name, xs in mem.items() if name != "ranks"}
    ranks = mem.get("ranks", [])
    if ranks:
        out["ranks"] = {"pss_total_peak": max(r["pss_total"] for r in ranks),
                        "private_total_peak": max(r["private_total"] for r in ranks),
                        "rss_per_rank_peak": max(r["rss_max"] for r in ranks),
                        "alive_max": max(r["alive"] for r in ranks),
                        "mem_available_min": min(r["mem_available"] for r in ranks), "samples": len(ranks)}
    return out


def _bytes_per_step(root: Path) -> int:
    """Bytes of data files in the last step's committed session."""
    run_dir = root / "runs" / RUN
    last = max((d for d in run_dir.glob("*") if (d / "COMMITTED").exists()), key=lambda d: int(d.name))
    sid = json.loads((last / "COMMITTED").read_bytes())["session"]
    return sum(p.stat().st_size for p in (last / "sessions" / sid / "files").iterdir() if not p.name.startswith("."))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", type=int, default=16)
    p.add_argument("--checkpoints", type=int, default=20)
    p.add_argument("--mib", type=float, default=64.0, help="global state size per checkpoint")
    p.add_argument("--replicas", type=int, choices=(1, 2), default=1,
                   help="1: one server, a reshard job and gc beside the ranks; 2: two replicas on one root")
    p.add_argument("--kill-after-step", type=int, default=0,
                   help="with --replicas 2: SIGKILL replica A mid-save at the first step after this one (0: never)")
    p.add_argument("--restart", action="store_true",
                   help="with --kill-after-step: restart A once the step after the killed one has committed")
    p.add_argument("--timeout", type=float, default=900.0)
    p.add_argument("--work", type=Path, help="work directory (default: a fresh temp dir)")
    p.add_argument("--out", type=Path)
    args = p.parse_args(argv)
    if args.replicas == 1 and (args.kill_after_step or args.restart):
        p.error("--kill-after-step and --restart need --replicas 2")
    if args.restart and not args.kill_after_step:
        p.error("--restart needs --kill-after-step")
    if args.kill_after_step and args.kill_after_step + 2 > args.checkpoints:
        p.error("--kill-after-step must leave at least two steps after it")
    import tempfile

    work = args.work or Path(tempfile.mkdtemp(prefix="ckptd-soak-"))
    work.mkdir(parents=True, exist_ok=True)
    if args.replicas == 2:
        result = run_replicas(args.ranks, args.checkpoints, args.mib, args.kill_after_step, args.restart, work,
                              args.timeout)
    else:
        result = run(args.ranks, args.checkpoints, args.mib, work, args.timeout)
    result["command"] = "python -m bench.soak " + " ".join(argv if argv is not None else sys.argv[1:])
    text = json.dumps(result, indent=2, default=str)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)
    print(_summary_line(result))
    return 0 if result["ok"] else 1


def _summary_line(result: dict) -> str:
    c, lat = result["config"], result["commit_latency_s"]
    line = (f"{c['ranks']} ranks x {c['checkpoints']} checkpoints in {result['wall_s']:.1f}s: commit latency "
            f"p50 {lat['p50']:.2f}s p99 {lat['p99']:.2f}s; ")
    if "server_rss_bytes" in result:
        line += f"server RSS peak {result['server_rss_bytes']['peak'] / MiB:.0f} MiB; "
    else:
        fo = result["failover"] or {}
        line += (f"killed at step {fo.get('killed_step')}, marker {fo.get('kill_to_marker_s', 0):.2f}s after; RSS peak "
                 + ", ".join(f"{k} {v['peak'] / MiB:.0f} MiB" for k, v in result["memory"].items() if k != "ranks")
                 + "; ")
    return line + f"ok={result['ok']} {result['problems'][:3]}"


if __name__ == "__main__":
    sys.exit(main())
