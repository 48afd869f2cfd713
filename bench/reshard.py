"""``ckptd reshard`` against DCP's ways of changing a checkpoint's layout, side by side, in one run on one disk.

    .venv/bin/python -m bench.reshard --gib 1 --sizes 1,2,4 --out bench/results/reshard.json

What one run does (see BENCHMARKS.md, section "Reshard", for the results and how to read them):

1. Measures this disk's ceiling in this process: durable writes (write + fsync, buffered and
   ``O_DIRECT``, the better counts),
   cold reads (pages evicted with ``posix_fadvise(DONTNEED)``) and a plain file
   copy, each with 2 and 4 threads; the faster of the two counts.
2. For each size (``--sizes`` and ``--gib``): four gloo ranks hold the same fp32
   state, ``Shard(0)`` DTensors with odd (uneven) row counts in two groups,
   ``model`` (4 weights per layer) and ``optim`` (``exp_avg``/``exp_avg_sq`` of
   each weight, as ``optim.state.<param>.<kind>``); fixed per-layer shapes, the
   layer count grows with the size. The ranks write it at dp=4 both with
   ``dcp.save`` (``FileSystemWriter`` defaults) and through a real ``ckptd
   serve`` (``CheckpointClient.save``, a trainer save: files per rank, no
   layout-independent digests yet), into one work directory (one disk).
3. Then, each preceded by evicting every checkpoint file from the page cache:

   * ``ckptd reshard SRC --to fsdp2:dp=2`` (subprocess, ``--jobs 2``, CPU)
     against ``dcp.load`` at world size 2 (2 gloo ranks, DTensors on a 2-mesh),
     and against ``dcp.load`` + ``dcp.save`` at dp=2 (the DCP way to *produce*
     a dp=2 checkpoint);
   * ``ckptd reshard SRC --to full`` against ``dcp_to_torch_save`` (subprocess;
     an ``fsync`` of the ``.pt`` is added, since ckptd's output is durable);
   * both conversions again as service jobs: ``POST /v1/reshard`` to the
     ``ckptd serve`` that took the saves, then ``GET /v1/jobs/{id}`` every
     ``POLL_S`` until done; timed from the POST to the poll that sees the job
     committed (it reports done only after the commit). What is warm: the
     service runs jobs in a ``ProcessPoolExecutor`` of ``CKPTD_RESHARD_WORKERS``
     (1) spawned processes, created at the first POST; each job is one task in
     the same long-lived process. ``warm_service`` runs a first, tiny job once,
     so the measured jobs find that worker started, with Python, torch, ckptd,
     xxhash and pydantic imported (and torch imported in the server, which
     plans the job). Nothing else carries over: each job opens its storage and
     reader anew (the source manifest is read again, in the server to plan and
     in the worker), starts its own ``--jobs`` threads, and allocates its
     buffers per work unit; the page cache is evicted as before. The server
     runs with ``CKPTD_RESHARD_MAX_MBPS=0``: the default 256 MiB/s cap is a
     policy that keeps conversions from slowing saves, not the cost of the
     work. The worker still lowers its own priority (``nice`` 10), as it does
     in production; on an otherwise idle machine that costs nothing.

   Wall time; peak RSS (``ru_maxrss`` from ``wait4`` for subprocesses, ``VmHWM``
   reset before the timed phase for ranks); CPU; disk bytes (``ru_inblock``/
   ``ru_oublock``). Outputs are checked: ckptd's built-in digest check, plus a
   spot-check of tensors against the values the ranks held (``read_tensor``,
   ``torch.load``); the DCP ranks check every tensor they loaded.
4. Once, at ``--gib``: ``ckptd reshard`` in a subprocess whose executor functions
   are wrapped with timers (outside the headline runs): where the time goes.
5. With a CUDA device: the GPU path (``--device cuda``) once at ``--gib``.

Every ckptd output (CLI and service, dp2 and full) is read back with its
tensors' digests, which do not depend on layout: one repeat's four outputs
must hold the same digests (``same_digests``).

Headline ratios are DCP's time / ckptd's time (> 1: ckptd is faster). ckptd is
timed as a whole process (Python and torch import, planning, conversion,
digest check, commit); DCP's load-time reshard is timed inside already running
ranks (no start-up), which favours DCP. Disk efficiency = the time the disk
needs at its measured ceiling to read the source once and write the target once,
``state_bytes/read_bw + target_bytes/write_bw``, divided by the measured wall
time; with target = source size that is (state_bytes / wall) / (1 / (1/read_bw +
1/write_bw)), the checkpoint bytes converted per second against the disk's
convert ceiling.
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import resource
import shutil
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable

import httpx
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import xxhash
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard

from bench._report import add_workdir_args, work_dir, write_report  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
if str(REPO / "tests") not in sys.path:
    sys.path.insert(0, str(REPO / "tests"))

# reused from the save/load benchmark: the deterministic values, machine description, VmHWM
from bench._disk import evict, parallel  # noqa: E402
from bench.save_load import _pattern, describe_machine, vm_status  # noqa: E402
from support import ServerProcess, run_ranks  # noqa: E402  (tests/support.py)

MiB, GiB = 1 << 20, 1 << 30
COLS = 1024                                                        # fp32 columns: 4 KiB per row
LAYER = (("wqkv", 3071), ("wo", 1021), ("w_up", 4093), ("w_down", 2045))  # odd rows: uneven over 4 and 2
OPTIM_KINDS = ("exp_avg", "exp_avg_sq")
SRC_WORLD, DST_WORLD = 4, 2
SERVICE_ENV = {"CKPTD_RESHARD_MAX_MBPS": "0"}                     # the jobs' bandwidth cap off: measure the work
POLL_S = 0.02                                                      # job status polls: the timing's resolution
GOALS = {"dp2_ratio_vs_dcp_load": 1.5, "full_ratio_vs_dcp_to_torch_save": 1.5, "disk_efficiency": 0.7,
         "peak_rss_growth_max": 1.25}
PY = sys.executable


# -- the state --------------------------------------------------------------------------------------

def tensor_specs(gib: float) -> list[tuple[str, str, int, int]]:
    """(group, fqn, rows, cols): ``layers`` x 4 weights, then 2 optimizer tensors per weight, about ``gib``.

    Per-layer shapes are fixed (rows scaled by a factor in (0.9, 1] so the total hits ``gib``; below
    two layers' worth the rows shrink instead), so a bigger checkpoint has more tensors, not bigger ones.
    """
    target = max(int(gib * GiB), 1)
    layer_bytes = sum(r for _, r in LAYER) * COLS * 4 * (1 + len(OPTIM_KINDS))
    layers = max(2, -(-target // layer_bytes))
    scale = min(1.0, target / (layers * layer_bytes))
    rows = {w: max(5, int(r * scale) | 1) for w, r in LAYER}
    specs = [("model", f"model.layers.{i}.{w}.weight", rows[w], COLS) for i in range(layers) for w, _ in LAYER]
    specs += [("optim", f"optim.state.layers.{i}.{w}.weight.{k}", rows[w], COLS)
              for i in range(layers) for w, _ in LAYER for k in OPTIM_KINDS]
    return specs


def state_bytes(specs: list) -> int:
    return sum(r * c * 4 for _, _, r, c in specs)


def _put(sd: dict, fqn: str, value: Any) -> None:
    """Place ``value`` so that DCP and ckptd's client both flatten it to ``fqn``."""
    group, rest = fqn.split(".", 1)
    if group == "model":
        sd.setdefault("model", {})[rest] = value
    else:  # optim.state.<param>.<kind>
        param, kind = rest.removeprefix("state.").rsplit(".", 1)
        sd.setdefault("optim", {}).setdefault("state", {}).setdefault(param, {})[kind] = value


def make_state(specs: list, mesh: Any, *, fill: bool) -> tuple[dict, dict[str, torch.Tensor]]:
    """(nested state dict of ``Shard(0)`` DTensors on ``mesh``, {fqn: local tensor}); values or NaN."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    sd: dict = {}
    local: dict[str, torch.Tensor] = {}
    for i, (_, fqn, rows, cols) in enumerate(specs):
        shape, offsets = compute_local_shape_and_global_offset((rows, cols), mesh, [Shard(0)])
        t = _pattern(i, offsets[0], shape[0], cols) if fill else torch.full(tuple(shape), float("nan"))
        local[fqn] = t
        _put(sd, fqn, DTensor.from_local(t, mesh, [Shard(0)], run_check=False, shape=torch.Size((rows, cols)),
                                         stride=(cols, 1)))
    return sd, local


def expected(specs: list, fqn: str) -> torch.Tensor:
    i = next(k for k, s in enumerate(specs) if s[1] == fqn)
    _, _, rows, cols = specs[i]
    return _pattern(i, 0, rows, cols)


def spot_names(specs: list) -> list[str]:
    """A model weight and an optimizer tensor, both with uneven rows, from the middle of the list."""
    model = [s[1] for s in specs if s[0] == "model"]
    optim = [s[1] for s in specs if s[0] == "optim"]
    return [model[len(model) // 2], optim[-1]]


# -- measurement helpers -----------------------------------------------------------------------------

def reset_peak(pid: int) -> bool:
    """Reset ``VmHWM`` of ``pid`` to its current RSS (``/proc/PID/clear_refs``)."""
    try:
        with open(f"/proc/{pid}/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _usage() -> dict[str, float]:
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return {"user_s": ru.ru_utime, "sys_s": ru.ru_stime, "disk_read_bytes": ru.ru_inblock * 512,
            "disk_write_bytes": ru.ru_oublock * 512}


def _delta(a: dict, b: dict) -> dict:
    return {k: b[k] - a[k] for k in a}


def run_measured(cmd: list[str], log: Path, timeout: float) -> dict:
    """Run ``cmd``; wall time and the child's own rusage (peak RSS, CPU, disk blocks) from ``wait4``."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    with open(log, "wb") as f:
        t0 = time.perf_counter()
        p = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=REPO, env=env)
        killer = threading.Timer(timeout, p.kill)
        killer.start()
        try:
            _, status, ru = os.wait4(p.pid, 0)
        finally:
            killer.cancel()
        wall = time.perf_counter() - t0
    p.returncode = os.waitstatus_to_exitcode(status)
    out = log.read_text(errors="replace")
    if p.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited with {p.returncode} after {wall:.1f}s:\n{out[-3000:]}")
    last = [ln for ln in out.splitlines() if ln.startswith("{")]
    return {"wall_s": wall, "peak_rss_bytes": ru.ru_maxrss * 1024, "user_s": ru.ru_utime, "sys_s": ru.ru_stime,
            "disk_read_bytes": ru.ru_inblock * 512, "disk_write_bytes": ru.ru_oublock * 512,
            "report": json.loads(last[-1]) if last else None}


def disk_ceiling(work: Path, nbytes: int) -> dict:
    """This disk now: durable write (the better of buffered and ``O_DIRECT``), cold read and plain copy rates
    (GB/s) with 2 and 4 threads."""
    piece = os.urandom(8 * MiB)
    out: dict[str, Any] = {"bytes": nbytes}

    for n in (2, 4):
        per = nbytes // n
        src = [work / f"disk-src-{i}.bin" for i in range(n)]
        dst = [work / f"disk-dst-{i}.bin" for i in range(n)]

        def write(i: int) -> None:
            fd = os.open(src[i], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            try:
                left = per
                while left > 0:
                    left -= os.write(fd, piece[:min(left, len(piece))])
                os.fsync(fd)
            finally:
                os.close(fd)

        def write_direct(i: int) -> None:
            # O_DIRECT from a page-aligned buffer (around the page cache): one of the two ways to the floor
            # the disk's write rate without the page cache's CPU, so the ceiling is the better of both ways
            buf = mmap.mmap(-1, len(piece))
            buf[:] = piece
            fd = os.open(src[i], os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_DIRECT", 0), 0o644)
            try:
                left = per
                while left > 0:
                    left -= os.write(fd, buf)
                os.ftruncate(fd, per)
                os.fsync(fd)
            finally:
                os.close(fd)
                buf.close()

        def read(i: int) -> None:
            buf = bytearray(8 * MiB)
            with open(src[i], "rb", buffering=0) as f:
                while f.readinto(buf):
                    pass

        def copy(i: int) -> None:
            buf = bytearray(8 * MiB)
            mv = memoryview(buf)
            fd = os.open(dst[i], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            try:
                with open(src[i], "rb", buffering=0) as f:
                    while k := f.readinto(buf):
                        os.write(fd, mv[:k])
                os.fsync(fd)
            finally:
                os.close(fd)

        os.sync()
        out[f"write_direct_gbps_{n}t"] = n * per / parallel(write_direct, n) / 1e9
        os.sync()
        out[f"write_buffered_gbps_{n}t"] = n * per / parallel(write, n) / 1e9
        out[f"write_gbps_{n}t"] = max(out[f"write_direct_gbps_{n}t"], out[f"write_buffered_gbps_{n}t"])
        evict(src)
        out[f"read_gbps_{n}t"] = n * per / parallel(read, n) / 1e9
        evict(src)
        out[f"copy_gbps_{n}t"] = n * per / parallel(copy, n) / 1e9  # source bytes per second
        for p in src + dst:
            p.unlink()
    r = max(out["read_gbps_2t"], out["read_gbps_4t"])
    w = max(out["write_gbps_2t"], out["write_gbps_4t"])
    out.update(read_gbps=r, write_gbps=w, copy_gbps=max(out["copy_gbps_2t"], out["copy_gbps_4t"]),
               convert_ceiling_gbps=1 / (1 / r + 1 / w))
    return out


def combine_ceilings(start: dict, end: dict) -> dict:
    """The better of two measurements (start and end of the run): the ceiling is what the disk can do."""
    r, w = max(start["read_gbps"], end["read_gbps"]), max(start["write_gbps"], end["write_gbps"])
    return {"read_gbps": r, "write_gbps": w, "copy_gbps": max(start["copy_gbps"], end["copy_gbps"]),
            "convert_ceiling_gbps": 1 / (1 / r + 1 / w), "start": start, "end": end}


def _evict(paths: list[Path]) -> int:
    os.sync()
    return evict([p for p in paths if p.exists()])


# -- rank jobs (spawned; module-level so they pickle) -------------------------------------------------

def source_job(rank: int, world: int, cfg: dict) -> dict:
    """dp=4: the same state written by ``dcp.save`` and by ``CheckpointClient.save`` (real server)."""
    from ckptd_client import CheckpointClient

    mesh = init_device_mesh("cpu", (world,))
    sd, _ = make_state(cfg["specs"], mesh, fill=True)
    dist.barrier()
    t0 = time.perf_counter()
    dcp.save(sd, checkpoint_id=cfg["dcp_dir"])
    dist.barrier()
    t_dcp = time.perf_counter() - t0
    client = CheckpointClient(cfg["url"])
    t0 = time.perf_counter()
    client.save(sd, cfg["ref"]).wait()
    dist.barrier()
    t_ckptd = time.perf_counter() - t0
    client.close()
    return {"dcp_save_s": t_dcp, "ckptd_save_s": t_ckptd}


def dcp_load_job(rank: int, world: int, cfg: dict) -> dict:
    """DCP's load-time reshard: ``dcp.load`` of the dp=4 directory into DTensors on a 2-mesh (timed
    between barriers, ranks already running), then ``dcp.save`` of what was loaded at dp=2."""
    mesh = init_device_mesh("cpu", (world,))
    sd, local = make_state(cfg["specs"], mesh, fill=False)
    rss_before = vm_status(os.getpid())["VmRSS"]
    reset_peak(os.getpid())
    u0 = _usage()
    dist.barrier()
    t0 = time.perf_counter()
    dcp.load(sd, checkpoint_id=cfg["dcp_dir"])
    dist.barrier()
    t_load = time.perf_counter() - t0
    u1 = _usage()
    load_peak = vm_status(os.getpid())["VmHWM"]
    reset_peak(os.getpid())
    dist.barrier()
    t0 = time.perf_counter()
    dcp.save(sd, checkpoint_id=cfg["dcp_out"])
    dist.barrier()
    t_save = time.perf_counter() - t0
    u2 = _usage()
    save_peak = vm_status(os.getpid())["VmHWM"]
    # every loaded tensor against the values the dp=4 ranks held
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
    for i, (_, fqn, rows, cols) in enumerate(cfg["specs"]):
        shape, offsets = compute_local_shape_and_global_offset((rows, cols), mesh, [Shard(0)])
        assert torch.equal(local[fqn], _pattern(i, offsets[0], shape[0], cols)), f"dcp.load: {fqn} differs"
    return {"load_s": t_load, "save_s": t_save, "load": _delta(u0, u1), "save": _delta(u1, u2),
            "rss_before_bytes": rss_before, "load_peak_rss_bytes": load_peak, "save_peak_rss_bytes": save_peak}


# -- the measured operations ------------------------------------------------------------------------------

def ckptd_cmd(root: Path, src: str, spec: str, out: str, jobs: int, device: str) -> list[str]:
    return [PY, "-m", "ckptd.cli.main", "reshard", src, "--to", spec, "--root", str(root), "--out", out,
            "--json", "--jobs", str(jobs), "--device", device]


def run_ckptd(ctx: dict, spec: str, out: str, device: str = "cpu", server: bool = False) -> dict:
    """``ckptd reshard`` as a whole process, page cache evicted first: on the root (``--root``), or with
    ``server`` through the running service (``--server URL``: the CLI submits the job to the warm worker and
    waits for it; no torch in the CLI's process)."""
    _evict([ctx["dcp_dir"], ctx["root"]])
    cmd = ckptd_cmd(ctx["root"], ctx["ref"], spec, out, ctx["jobs"], device)
    if server:
        cmd[cmd.index("--root"):cmd.index("--root") + 2] = ["--server", str(ctx["http"].base_url)]
    r = run_measured(cmd, ctx["work"] / f"ckptd-{'server-' if server else ''}{out.replace('/', '-')}.log",
                     ctx["timeout"])
    rep = r["report"]
    r.update(inproc_s=rep["seconds"], bytes_read=rep["bytes_read"], bytes_written=rep["bytes_written"],
             units=rep["units"])
    r.update(check_output(ctx, spec, out))
    return r


def run_drill(ctx: dict, spec: str) -> dict:
    """``ckptd drill SRC --to SPEC --root`` as a whole process, page cache evicted first: the same plan and
    reads as the reshard to ``spec``, each assembled tensor hashed instead of written; it must pass."""
    _evict([ctx["dcp_dir"], ctx["root"]])
    cmd = [PY, "-m", "ckptd.cli.main", "drill", ctx["ref"], "--to", spec, "--root", str(ctx["root"]), "--json",
           "--jobs", str(ctx["jobs"])]
    r = run_measured(cmd, ctx["work"] / f"drill-{spec.replace(':', '-').replace('=', '')}.log", ctx["timeout"])
    assert r["report"] and r["report"]["ok"], f"the drill to {spec} failed: {r['report']}"
    return r


def check_output(ctx: dict, spec: str, out: str) -> dict:
    """Check a committed output, then delete it: topology and provenance, two tensors' values against what the
    ranks held (``read_tensor``), and every tensor's digest present. Returns the spot-checked names, the
    manifest digest its COMMITTED marker names, and a fingerprint of all tensor digests: digests are
    layout-independent, so every output of one source must share it (``same_digests``)."""
    from ckptd.storage import LocalStorage
    from ckptd.store import CheckpointReader
    from stored_tensors import read_tensor

    root = ctx["root"]
    reader = CheckpointReader(LocalStorage(root, durable=False))
    marker = reader.marker(*out.split("/"))
    assert marker is not None, f"{out} is not committed"
    m = reader.manifest(*out.split("/"))
    assert m.topology.world_size == (1 if spec == "full" else DST_WORLD) and m.derived_from == ctx["ref"], m.ref
    for name in spot_names(ctx["specs"]):
        assert torch.equal(read_tensor(reader, out, name), expected(ctx["specs"], name)), f"{out}: {name} differs"
    missing = [t.name for t in m.tensors if t.digest is None]
    assert not missing, f"{out}: tensors without a digest: {missing[:5]}"
    fingerprint = xxhash.xxh3_64_hexdigest(json.dumps(sorted((t.name, t.digest) for t in m.tensors)).encode())
    shutil.rmtree(root / "runs" / out.split("/")[0] / out.split("/")[1])
    return {"spot_checked": spot_names(ctx["specs"]), "committed_manifest_xxh3": marker.manifest_xxh3,
            "tensor_digests_xxh3": fingerprint}


def same_digests(rec: dict) -> None:
    """Every ckptd output of one repeat holds the same tensor digests (layout-independent): mark them matched."""
    ops = [op for op in rec if "tensor_digests_xxh3" in rec[op]]
    values = {rec[op]["tensor_digests_xxh3"] for op in ops}
    assert len(values) == 1, {op: rec[op]["tensor_digests_xxh3"] for op in ops}
    for op in ops:
        rec[op]["digests_match"] = ops


def submit_and_wait(http: httpx.Client, body: dict, timeout: float) -> tuple[dict, float]:
    """``POST /v1/reshard``, then poll ``GET /v1/jobs/{id}`` every ``POLL_S`` until the job leaves
    queued/running. Returns (the final job status, seconds from just before the POST to the poll that saw
    it finished)."""
    t0 = time.perf_counter()
    r = http.post("/v1/reshard", json=body)
    assert r.status_code == 202, r.text
    job = r.json()
    while job["state"] in ("queued", "running"):
        if time.perf_counter() - t0 > timeout:
            raise TimeoutError(f"reshard job {job['id']} still {job['state']} after {timeout:.0f}s")
        time.sleep(POLL_S)
        r = http.get(f"/v1/jobs/{job['id']}")
        r.raise_for_status()
        job = r.json()
    wall = time.perf_counter() - t0
    assert job["state"] == "done", job.get("error")
    return job, wall


def run_service(ctx: dict, spec: str, out: str) -> dict:
    """The same conversion as ``run_ckptd``, submitted to the running service's reshard worker (already warm:
    ``warm_service``), page cache evicted first; timed from submit to the job reported done (committed)."""
    _evict([ctx["dcp_dir"], ctx["root"]])
    body = {"source": ctx["ref"], "to": spec, "out": out, "device": "cpu", "jobs": ctx["jobs"]}
    job, wall = submit_and_wait(ctx["http"], body, ctx["timeout"])
    res = job["result"]
    r = {"wall_s": wall, "inproc_s": res["seconds"], "bytes_read": res["bytes_read"],
         "bytes_written": res["bytes_written"], "units": res["units"], "job": job["id"], "state": job["state"]}
    r.update(check_output(ctx, spec, out))
    r["committed"] = res["ref"] == out and r["committed_manifest_xxh3"] == res["manifest_xxh3"]
    assert r["committed"], f"job {job['id']} reported {res['ref']} {res['manifest_xxh3']}, marker says {r}"
    return r


def warm_service(url: str, timeout: float) -> dict:
    """Save a tiny checkpoint through the service and convert it there, untimed by the headline: the first job
    spawns the service's reshard worker process and imports torch in it (and in the server, which plans).
    Returns that first job's wall time, the cold start a measured job no longer pays."""
    from ckptd_client import CheckpointClient

    client = CheckpointClient(url)
    try:
        client.save({"w": torch.arange(4 * DST_WORLD, dtype=torch.float32).reshape(DST_WORLD, 4)}, "warmup/0").wait()
    finally:
        client.close()
    with httpx.Client(base_url=url, timeout=60.0) as http:
        job, wall = submit_and_wait(http, {"source": "warmup/0", "to": f"fsdp2:dp={DST_WORLD}", "out": "warmup/dp2",
                                           "device": "cpu", "jobs": 1}, timeout)
    return {"wall_s": wall, "inproc_s": job["result"]["seconds"]}


def run_dcp_load(ctx: dict, tag: str) -> dict:
    dcp_out = ctx["work"] / f"dcp-out-{tag}"
    _evict([ctx["dcp_dir"], ctx["root"]])
    cfg = {"specs": ctx["specs"], "dcp_dir": str(ctx["dcp_dir"]), "dcp_out": str(dcp_out)}
    t0 = time.perf_counter()
    recs = run_ranks(dcp_load_job, DST_WORLD, cfg, tmp=ctx["work"], timeout=ctx["timeout"])
    wall = time.perf_counter() - t0
    res = [rec["result"] for rec in recs]
    shutil.rmtree(dcp_out)
    s = lambda phase, k: sum(x[phase][k] for x in res)  # noqa: E731
    return {
        "load_s": max(x["load_s"] for x in res), "save_s": max(x["save_s"] for x in res),
        "load_save_s": max(x["load_s"] for x in res) + max(x["save_s"] for x in res),
        "ranks_wall_s": wall,  # spawn + init + allocation + load + save + check: context only
        "load_peak_rss_bytes_per_rank": [x["load_peak_rss_bytes"] for x in res],
        "save_peak_rss_bytes_per_rank": [x["save_peak_rss_bytes"] for x in res],
        "rss_before_bytes_per_rank": [x["rss_before_bytes"] for x in res],
        "load_cpu_s": s("load", "user_s") + s("load", "sys_s"), "save_cpu_s": s("save", "user_s") + s("save", "sys_s"),
        "load_disk_read_bytes": s("load", "disk_read_bytes"), "save_disk_write_bytes": s("save", "disk_write_bytes"),
        "checked": "every tensor on both ranks",
    }


_DCP_TO_TORCH = """
import json, os, sys, time
t0 = time.perf_counter()
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
t1 = time.perf_counter()
dcp_to_torch_save(sys.argv[1], sys.argv[2])
t2 = time.perf_counter()
fd = os.open(sys.argv[2], os.O_RDONLY); os.fsync(fd); os.close(fd)
t3 = time.perf_counter()
print(json.dumps({"import_s": t1 - t0, "convert_s": t2 - t1, "fsync_s": t3 - t2}))
"""


def run_dcp_to_torch_save(ctx: dict, tag: str) -> dict:
    pt = ctx["work"] / f"full-{tag}.pt"
    _evict([ctx["dcp_dir"], ctx["root"]])
    r = run_measured([PY, "-c", _DCP_TO_TORCH, str(ctx["dcp_dir"]), str(pt)], ctx["work"] / f"dcp-full-{tag}.log",
                     ctx["timeout"])
    r["bytes_written"] = pt.stat().st_size
    sd = torch.load(pt, mmap=True, weights_only=True)
    for name in spot_names(ctx["specs"]):
        group, rest = name.split(".", 1)
        got = sd["model"][rest] if group == "model" else _optim_get(sd, rest)
        assert torch.equal(got, expected(ctx["specs"], name)), f"dcp_to_torch_save: {name} differs"
    r["spot_checked"] = spot_names(ctx["specs"])
    del sd
    pt.unlink()
    return r


def _optim_get(sd: dict, rest: str) -> torch.Tensor:
    param, kind = rest.removeprefix("state.").rsplit(".", 1)
    return sd["optim"]["state"][param][kind]


# -- where ckptd's time goes: the executor wrapped with timers, in its own process ------------------------

def profile_main(argv: list[str]) -> int:
    """``python -m bench.reshard --profile-run ROOT SRC SPEC OUT JOBS``: run the CLI with timers around the
    executor's steps; print one JSON line of summed thread-seconds per step and phase spans."""
    t_start = time.perf_counter()
    root, src, spec, out, jobs = argv
    import ckptd.reshard.executor as ex
    import ckptd.reshard.planner as planner
    import ckptd_schemas.format.engines as engines
    import ckptd_schemas.filedigest as hashing
    import ckptd.store.sessions as sessions
    from ckptd.cli.main import main as ckptd_main
    from ckptd.store.reader import CheckpointReader
    from ckptd.storage.local import LocalStorage, _LocalWriter

    events: list[tuple[str, float, float]] = []
    lock = threading.Lock()

    def timed(fn: Callable, kind: str) -> Callable:
        def wrapper(*a: Any, **kw: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                with lock:
                    events.append((kind, t0, time.perf_counter()))
        return wrapper

    t_imported = time.perf_counter()
    planner_fn = planner.plan_reshard
    planner.plan_reshard = timed(planner_fn, "plan")
    ex.run_unit = timed(ex.run_unit, "unit")
    ex.finalize = timed(ex.finalize, "finalize")
    for fn in ("tensor_digests", "tensor_digest", "combine"):  # the digest check (per call: thread-seconds)
        if hasattr(ex, fn):
            setattr(ex, fn, timed(getattr(ex, fn), "digests"))
    import ckptd_schemas.readplan as readplan  # run_fetches verifies each fetch through the module's name

    readplan.verify_fetch = timed(readplan.verify_fetch, "verify_blocks")
    for buf in (engines._HostBuffer, engines._TorchBuffer):  # the engine's copies (host on the CPU)
        buf.copy = timed(buf.copy, "assemble_copy")
    ex.write_hashed = timed(ex.write_hashed, "write_hashed")  # chunk, tensor and file digests + writes (nested)
    CheckpointReader.read_range = timed(CheckpointReader.read_range, "read")
    LocalStorage.read = timed(LocalStorage.read, "storage_read")  # nested in "read"; also the target re-read
    LocalStorage.read_into = timed(LocalStorage.read_into, "read")  # the executor's source reads
    hashing.StreamDigest.update = timed(hashing.StreamDigest.update, "sink_hash")
    _LocalWriter.write = timed(_LocalWriter.write, "sink_write")
    _LocalWriter.commit = timed(_LocalWriter.commit, "fsync_commit")
    sessions.SessionStore.put_index = timed(sessions.SessionStore.put_index, "put_index_commit")
    rc = ckptd_main(["reshard", src, "--to", spec, "--root", root, "--out", out, "--json", "--jobs", jobs,
                     "--device", "cpu"])
    t_end = time.perf_counter()
    fin = [e for e in events if e[0] == "finalize"]
    units = [e for e in events if e[0] == "unit"]
    f0 = min(a for _, a, _ in fin) if fin else t_end

    def summed(kind: str, lo: float, hi: float) -> float:
        return sum(b - a for k, a, b in events if k == kind and a >= lo and b <= hi)

    kinds = sorted({k for k, _, _ in events} - {"unit", "finalize", "plan"})
    res = {
        "rc": rc, "process_to_main_s": t_imported - t_start,
        "plan_s": summed("plan", 0, t_end),
        "units_span_s": (max(b for _, _, b in units) - min(a for _, a, _ in units)) if units else 0.0,
        "units_thread_s": sum(b - a for _, a, b in units), "n_units": len(units),
        "finalize_s": sum(b - a for _, a, b in fin),
        "in_units_thread_s": {k: summed(k, 0, f0) for k in kinds},
        "in_finalize_s": {k: summed(k, f0, t_end) for k in kinds},
        "main_total_s": t_end - t_imported,
    }
    print(json.dumps(res))
    return rc


# -- summary ------------------------------------------------------------------------------------------------

def _med(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def summarise(sizes: dict, main_key: str, ceiling: dict) -> dict:
    m = sizes[main_key]
    reps = m["repeats"]
    ck_dp2 = _med([r["ckptd_dp2"]["wall_s"] for r in reps])
    ck_dp2_in = _med([r["ckptd_dp2"]["inproc_s"] for r in reps])
    ck_full = _med([r["ckptd_full"]["wall_s"] for r in reps])
    drill = _med([r["drill_dp2"]["wall_s"] for r in reps]) if "drill_dp2" in reps[0] else None
    ck_full_in = _med([r["ckptd_full"]["inproc_s"] for r in reps])
    svc = {op: _med([r[f"service_{op}"]["wall_s"] for r in reps]) for op in ("dp2", "full")}
    svc_in = {op: _med([r[f"service_{op}"]["inproc_s"] for r in reps]) for op in ("dp2", "full")}
    cli_svc = _med([r["cli_server_dp2"]["wall_s"] for r in reps])
    d_load = _med([r["dcp_load"]["load_s"] for r in reps])
    d_load_save = _med([r["dcp_load"]["load_save_s"] for r in reps])
    d_full = _med([r["dcp_to_torch_save"]["wall_s"] for r in reps])
    d_full_nofsync = _med([r["dcp_to_torch_save"]["wall_s"] - r["dcp_to_torch_save"]["report"]["fsync_s"]
                           for r in reps])
    nbytes = m["state_bytes"]
    R, W = ceiling["read_gbps"] * 1e9, ceiling["write_gbps"] * 1e9

    def eff(op: str, t: float) -> float:
        """Time the disk needs at its ceiling to read the source once and write the target once, over ``t``."""
        return (nbytes / R + reps[0][op]["bytes_written"] / W) / t

    out: dict[str, Any] = {
        "state_bytes": nbytes,
        "ckptd_dp2_wall_s": ck_dp2, "ckptd_dp2_inproc_s": ck_dp2_in,
        "dcp_load_dp2_s": d_load, "dcp_load_save_dp2_s": d_load_save,
        "dp2_ratio_vs_dcp_load": d_load / ck_dp2, "dp2_ratio_vs_dcp_load_save": d_load_save / ck_dp2,
        "dp2_ratio_vs_dcp_load_inproc": d_load / ck_dp2_in,
        "dp2_ratio_vs_dcp_load_save_inproc": d_load_save / ck_dp2_in,
        "ckptd_full_wall_s": ck_full, "ckptd_full_inproc_s": ck_full_in,
        "drill_dp2_wall_s": drill, "drill_vs_reshard_dp2": drill and drill / ck_dp2,
        "dcp_to_torch_save_wall_s": d_full, "dcp_to_torch_save_wall_no_fsync_s": d_full_nofsync,
        "full_ratio_vs_dcp_to_torch_save": d_full / ck_full,
        "full_ratio_vs_dcp_to_torch_save_no_fsync": d_full_nofsync / ck_full,
        "ckptd_dp2_gbps": nbytes / ck_dp2 / 1e9, "ckptd_full_gbps": nbytes / ck_full / 1e9,
        "disk_convert_ceiling_gbps": ceiling["convert_ceiling_gbps"],
        "disk_efficiency_dp2": eff("ckptd_dp2", ck_dp2), "disk_efficiency_full": eff("ckptd_full", ck_full),
        "disk_efficiency_dp2_inproc": eff("ckptd_dp2", ck_dp2_in),
        "disk_efficiency_full_inproc": eff("ckptd_full", ck_full_in),
        # the same conversions as jobs of the running service (warm worker), submit to done
        "service_dp2_wall_s": svc["dp2"], "service_full_wall_s": svc["full"],
        "service_dp2_inproc_s": svc_in["dp2"], "service_full_inproc_s": svc_in["full"],
        "disk_efficiency_service_dp2": eff("service_dp2", svc["dp2"]),
        "disk_efficiency_service_full": eff("service_full", svc["full"]),
        # `ckptd reshard --server URL`: the CLI as a whole process, the work in the service's warm worker
        "cli_server_dp2_wall_s": cli_svc, "disk_efficiency_cli_server_dp2": eff("cli_server_dp2", cli_svc),
        # DCP against the same ceiling (it reads the source once and writes about as much)
        "disk_efficiency_dcp_load_save": (nbytes / R + nbytes / W) / d_load_save,
        "disk_efficiency_dcp_to_torch_save": (nbytes / R + reps[0]["dcp_to_torch_save"]["bytes_written"] / W) / d_full,
    }
    peaks = {k: {"state_bytes": v["state_bytes"],
                 "ckptd_dp2": max(r["ckptd_dp2"]["peak_rss_bytes"] for r in v["repeats"]),
                 "ckptd_full": max(r["ckptd_full"]["peak_rss_bytes"] for r in v["repeats"]),
                 "dcp_load_per_rank": max(max(r["dcp_load"]["load_peak_rss_bytes_per_rank"]) for r in v["repeats"]),
                 "dcp_to_torch_save": max(r["dcp_to_torch_save"]["peak_rss_bytes"] for r in v["repeats"])}
             for k, v in sizes.items()}
    # one number for the goal: the worse conversion, so meeting it means both do
    out["disk_efficiency_service"] = min(out["disk_efficiency_service_dp2"], out["disk_efficiency_service_full"])
    out["peak_rss_bytes"] = peaks
    order = sorted(peaks, key=lambda k: peaks[k]["state_bytes"])
    lo, hi = peaks[order[0]], peaks[order[-1]]
    out["peak_rss_growth"] = {op: hi[op] / lo[op] for op in ("ckptd_dp2", "ckptd_full", "dcp_load_per_rank",
                                                              "dcp_to_torch_save")}
    out["peak_rss_growth_sizes"] = [order[0], order[-1]]
    growth_ok = len(order) > 1 and max(out["peak_rss_growth"]["ckptd_dp2"],
                                       out["peak_rss_growth"]["ckptd_full"]) <= GOALS["peak_rss_growth_max"]
    out["goals_met"] = {
        "dp2: dcp.load time / ckptd reshard time >= 1.5": out["dp2_ratio_vs_dcp_load"] >= 1.5,
        "dp2: (dcp.load + dcp.save) time / ckptd reshard time >= 1.5": out["dp2_ratio_vs_dcp_load_save"] >= 1.5,
        "full: dcp_to_torch_save time / ckptd reshard time >= 1.5": out["full_ratio_vs_dcp_to_torch_save"] >= 1.5,
        "peak RSS flat (largest / smallest size <= 1.25)": growth_ok,
        "disk efficiency >= 0.7 (dp2)": out["disk_efficiency_dp2"] >= 0.7,
        "disk efficiency >= 0.7 (full)": out["disk_efficiency_full"] >= 0.7,
        "disk efficiency >= 0.7 via the service (warm worker; dp2 and full)":
            out["disk_efficiency_service"] >= GOALS["disk_efficiency"],
    }
    return out


def markdown(res: dict) -> str:
    s, c = res["summary"], res["ceiling"]
    lines = [f"{s['state_bytes'] / GiB:.2f} GiB fp32 state ({res['config']['tensors_at_gib']} tensors), "
             f"saved at dp=4; median of {res['config']['repeat']} run(s), page cache evicted before each:", "",
             "| measure | ckptd | DCP | ratio (DCP / ckptd) | goal |", "| --- | --- | --- | --- | --- |",
             f"| dp=4 -> dp=2: `ckptd reshard` (whole process) vs `dcp.load` at world size 2 (in running ranks) | "
             f"{s['ckptd_dp2_wall_s']:.2f} s | {s['dcp_load_dp2_s']:.2f} s | {s['dp2_ratio_vs_dcp_load']:.2f} | "
             ">= 1.5 |",
             f"| dp=4 -> dp=2 as a new checkpoint: vs `dcp.load` + `dcp.save` at dp=2 | "
             f"{s['ckptd_dp2_wall_s']:.2f} s | {s['dcp_load_save_dp2_s']:.2f} s | "
             f"{s['dp2_ratio_vs_dcp_load_save']:.2f} | >= 1.5 |",
             f"| dp=4 -> full: `ckptd reshard --to full` vs `dcp_to_torch_save` (+ fsync) | "
             f"{s['ckptd_full_wall_s']:.2f} s | {s['dcp_to_torch_save_wall_s']:.2f} s | "
             f"{s['full_ratio_vs_dcp_to_torch_save']:.2f} | >= 1.5 |",
             f"| same, `dcp_to_torch_save` without the fsync | {s['ckptd_full_wall_s']:.2f} s | "
             f"{s['dcp_to_torch_save_wall_no_fsync_s']:.2f} s | "
             f"{s['full_ratio_vs_dcp_to_torch_save_no_fsync']:.2f} | |",
             "",
             f"ckptd in-process time (`seconds` of `--json`: execute + digest check + commit, no start-up/planning): "
             f"dp2 {s['ckptd_dp2_inproc_s']:.2f} s (ratio vs dcp.load {s['dp2_ratio_vs_dcp_load_inproc']:.2f}, vs "
             f"load+save {s['dp2_ratio_vs_dcp_load_save_inproc']:.2f}), full {s['ckptd_full_inproc_s']:.2f} s "
             f"(ratio vs dcp_to_torch_save {s['dcp_to_torch_save_wall_s'] / s['ckptd_full_inproc_s']:.2f}). A bare "
             f"`python` that only imports ckptd's reshard modules takes {res['ckptd_startup']['wall_s']:.2f} s "
             f"(imports {res['ckptd_startup']['report']['import_s']:.2f} s).", "",
             f"Disk ceiling (this disk, best of start and end of the run): read {c['read_gbps']:.2f} GB/s, "
             f"durable write {c['write_gbps']:.2f} GB/s -> convert ceiling 1/(1/R+1/W) = "
             f"{c['convert_ceiling_gbps']:.2f} GB/s of checkpoint; plain file copy {c['copy_gbps']:.2f} GB/s. "
             f"ckptd: dp2 {s['ckptd_dp2_gbps']:.2f} GB/s = efficiency "
             f"{s['disk_efficiency_dp2']:.2f}, full {s['ckptd_full_gbps']:.2f} GB/s = {s['disk_efficiency_full']:.2f} "
             f"(goal >= 0.7; in-process: {s['disk_efficiency_dp2_inproc']:.2f} / "
             f"{s['disk_efficiency_full_inproc']:.2f}). "
             f"Via the service (`POST /v1/reshard` to a warm worker, submit to done): dp2 "
             f"{s['service_dp2_wall_s']:.2f} s = efficiency {s['disk_efficiency_service_dp2']:.2f}, full "
             f"{s['service_full_wall_s']:.2f} s = {s['disk_efficiency_service_full']:.2f} (in the worker "
             f"{s['service_dp2_inproc_s']:.2f} / {s['service_full_inproc_s']:.2f} s; the first job, which spawned "
             f"the worker, took {res['service_warmup']['wall_s']:.2f} s). `ckptd reshard --server` as a whole process "
             f"(the CLI submits and waits): dp2 {s['cli_server_dp2_wall_s']:.2f} s = efficiency "
             f"{s['disk_efficiency_cli_server_dp2']:.2f}. "
             f"DCP on the same scale: load + save {s['disk_efficiency_dcp_load_save']:.2f}, dcp_to_torch_save "
             f"{s['disk_efficiency_dcp_to_torch_save']:.2f}.",
             "", "Wall time per size (median over its runs; ratio = DCP / ckptd):", "",
             "| state | ckptd dp2 | dcp.load | dcp.load + dcp.save | ckptd full | dcp_to_torch_save + fsync |",
             "| --- | --- | --- | --- | --- | --- |"]
    for k, v in sorted(res["sizes"].items(), key=lambda kv: kv[1]["state_bytes"]):
        m = {op: _med([r[op][key] for r in v["repeats"]]) for op, key in (
            ("ckptd_dp2", "wall_s"), ("dcp_load", "load_s"), ("ckptd_full", "wall_s"), ("dcp_to_torch_save", "wall_s"))}
        ls = _med([r["dcp_load"]["load_save_s"] for r in v["repeats"]])
        lines.append(f"| {v['state_bytes'] / GiB:.2f} GiB | {m['ckptd_dp2']:.2f} s | {m['dcp_load']:.2f} s "
                     f"({m['dcp_load'] / m['ckptd_dp2']:.2f}) | {ls:.2f} s ({ls / m['ckptd_dp2']:.2f}) | "
                     f"{m['ckptd_full']:.2f} s | {m['dcp_to_torch_save']:.2f} s "
                     f"({m['dcp_to_torch_save'] / m['ckptd_full']:.2f}) |")
    lines += ["", "| state | ckptd dp2 peak RSS | ckptd full peak RSS | dcp.load peak RSS per rank | "
             "dcp_to_torch_save peak RSS |", "| --- | --- | --- | --- | --- |"]
    for k, p in sorted(s["peak_rss_bytes"].items(), key=lambda kv: kv[1]["state_bytes"]):
        lines.append(f"| {p['state_bytes'] / GiB:.2f} GiB | {p['ckptd_dp2'] / MiB:.0f} MiB | "
                     f"{p['ckptd_full'] / MiB:.0f} MiB | {p['dcp_load_per_rank'] / MiB:.0f} MiB | "
                     f"{p['dcp_to_torch_save'] / MiB:.0f} MiB |")
    g = s["peak_rss_growth"]
    lines += ["", f"peak RSS growth {s['peak_rss_growth_sizes'][0]} -> {s['peak_rss_growth_sizes'][1]}: "
              + ", ".join(f"{k} x{v:.2f}" for k, v in g.items())]
    if res.get("profile"):
        for spec, p in res["profile"].items():
            lines += ["", f"where `ckptd reshard --to {spec}` spends its time (s; thread-seconds summed over "
                      f"--jobs threads): start-up {p['process_to_main_s']:.2f}, plan {p['plan_s']:.2f}, "
                      f"units {p['units_span_s']:.2f} wall ({p['n_units']} units, "
                      + ", ".join(f"{k} {v:.2f}" for k, v in p["in_units_thread_s"].items() if v) +
                      f"), finalize {p['finalize_s']:.2f} ("
                      + ", ".join(f"{k} {v:.2f}" for k, v in p["in_finalize_s"].items() if v) + ")"]
    lines += ["", "GPU path: " + res["gpu"]["note"]]
    lines += ["", "goals: " + "; ".join(f"{k}: {'met' if v else 'NOT met'}" for k, v in s["goals_met"].items())]
    return "\n".join(lines)


# -- main ---------------------------------------------------------------------------------------------------

def _tag(gib: float) -> str:
    return f"{gib:g}gib".replace(".", "p")


def one_size(gib: float, repeat: int, ctx: dict, server: ServerProcess, profile: bool, gpu: bool) -> dict:
    tag = _tag(gib)
    specs = tensor_specs(gib)
    nbytes = state_bytes(specs)
    run, name = f"src-{tag}", "1000"
    dcp_dir = ctx["work"] / f"dcp-{tag}"
    c = {**ctx, "specs": specs, "ref": f"{run}/{name}", "dcp_dir": dcp_dir,
         "timeout": 300 + 120 * nbytes / GiB}
    print(f"[{tag}] {nbytes / GiB:.3f} GiB in {len(specs)} tensors: writing the dp=4 sources", flush=True)
    recs = run_ranks(source_job, SRC_WORLD, {"specs": specs, "dcp_dir": str(dcp_dir), "url": server.url,
                                             "ref": c["ref"]}, tmp=ctx["work"], timeout=c["timeout"])
    src = {k: max(r["result"][k] for r in recs) for k in ("dcp_save_s", "ckptd_save_s")}
    src["dcp_dir_bytes"] = sum(p.stat().st_size for p in dcp_dir.rglob("*") if p.is_file())
    src["ckptd_src_bytes"] = sum(p.stat().st_size for p in (ctx["root"] / "runs" / run).rglob("*") if p.is_file())
    repeats = []
    for r in range(repeat):
        rec: dict[str, Any] = {}
        order = ("ckptd", "service", "dcp") if r % 2 == 0 else ("dcp", "ckptd", "service")
        for which in order:
            if which == "ckptd":
                rec["ckptd_dp2"] = run_ckptd(c, "fsdp2:dp=2", f"out/{tag}-dp2-r{r}")
                rec["ckptd_full"] = run_ckptd(c, "full", f"out/{tag}-full-r{r}")
                rec["drill_dp2"] = run_drill(c, "fsdp2:dp=2")
            elif which == "service":
                rec["service_dp2"] = run_service(c, "fsdp2:dp=2", f"out/{tag}-svc-dp2-r{r}")
                rec["service_full"] = run_service(c, "full", f"out/{tag}-svc-full-r{r}")
                rec["cli_server_dp2"] = run_ckptd(c, "fsdp2:dp=2", f"out/{tag}-cli-svc-dp2-r{r}", server=True)
            else:
                rec["dcp_load"] = run_dcp_load(c, f"{tag}-r{r}")
                rec["dcp_to_torch_save"] = run_dcp_to_torch_save(c, f"{tag}-r{r}")
        print(f"[{tag}] repeat {r}: ckptd dp2 {rec['ckptd_dp2']['wall_s']:.2f}s (in-process "
              f"{rec['ckptd_dp2']['inproc_s']:.2f}s, peak {rec['ckptd_dp2']['peak_rss_bytes'] / MiB:.0f} MiB), "
              f"dcp.load {rec['dcp_load']['load_s']:.2f}s + save {rec['dcp_load']['save_s']:.2f}s; "
              f"ckptd full {rec['ckptd_full']['wall_s']:.2f}s (peak {rec['ckptd_full']['peak_rss_bytes'] / MiB:.0f}"
              f" MiB), dcp_to_torch_save {rec['dcp_to_torch_save']['wall_s']:.2f}s (peak "
              f"{rec['dcp_to_torch_save']['peak_rss_bytes'] / MiB:.0f} MiB); via the service: dp2 "
              f"{rec['service_dp2']['wall_s']:.2f}s, full {rec['service_full']['wall_s']:.2f}s", flush=True)
        same_digests(rec)
        repeats.append(rec)
    out: dict[str, Any] = {"gib": gib, "state_bytes": nbytes, "tensors": len(specs),
                           "largest_tensor_bytes": max(r * cc * 4 for _, _, r, cc in specs),
                           "source": src, "repeats": repeats}
    if profile:
        out["profile"] = {}
        for spec in ("fsdp2:dp=2", "full"):
            ref = f"out/{tag}-profile-{'dp2' if spec != 'full' else 'full'}"
            _evict([dcp_dir, ctx["root"]])
            r = run_measured([PY, "-m", "bench.reshard", "--profile-run", str(ctx["root"]), c["ref"], spec, ref,
                              str(ctx["jobs"])], ctx["work"] / f"profile-{tag}.log", c["timeout"])
            out["profile"][spec] = {**r["report"], "wall_s": r["wall_s"]}
            shutil.rmtree(ctx["root"] / "runs" / "out" / ref.split("/")[1])
    if gpu:
        out["gpu"] = {spec: run_ckptd(c, spec, f"out/{tag}-{kind}-cuda", device="cuda")
                      for spec, kind in (("fsdp2:dp=2", "dp2"), ("full", "full"))}
    shutil.rmtree(dcp_dir)
    shutil.rmtree(ctx["root"] / "runs" / run)
    return out


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--profile-run"]:
        return profile_main(argv[1:])
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gib", type=float, default=1.0, help="state size of the side-by-side comparison (GiB)")
    ap.add_argument("--sizes", default=None, help="comma-separated state sizes (GiB) for peak RSS vs size "
                                                  "(default: gib,2*gib,4*gib)")
    ap.add_argument("--repeat", type=int, default=1, help="runs of each operation at --gib (median)")
    ap.add_argument("--jobs", type=int, default=2, help="ckptd reshard --jobs")
    ap.add_argument("--no-profile", action="store_true", help="skip the timer-wrapped ckptd run")
    ap.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "reshard.json")
    add_workdir_args(ap, "parent of the temporary work dir (ckptd root and DCP dirs: one disk); default $TMPDIR")
    args = ap.parse_args(argv)
    sizes = sorted({float(x) for x in args.sizes.split(",") if x.strip()} if args.sizes is not None
                   else {args.gib, 2 * args.gib, 4 * args.gib})
    sizes = sorted(set(sizes) | {args.gib})

    with work_dir("ckptd-bench-reshard-", args.workdir, args.keep) as work:
        t_start = time.perf_counter()
        server: ServerProcess | None = None
        http: httpx.Client | None = None
        gpu = torch.cuda.is_available()
        try:
            machine = describe_machine(work)
            free = shutil.disk_usage(work).free
            need = 3.2 * state_bytes(tensor_specs(max(sizes))) + 0.2 * GiB
            if free < need:
                raise SystemExit(f"{work}: {free / GiB:.1f} GiB free, the largest size needs about {need / GiB:.1f}")
            print(f"work dir {work}; sizes {sizes} GiB; load average {machine['loadavg_at_start']}", flush=True)
            ceiling = disk_ceiling(work, min(state_bytes(tensor_specs(args.gib)), 2 * GiB))
            print("disk ceiling", json.dumps({k: round(v, 3) for k, v in ceiling.items()}), flush=True)
            # the fixed cost of a `ckptd reshard` process before any work: Python, torch, ckptd's modules
            startup = run_measured([PY, "-c", "import time; t = time.perf_counter(); import ckptd.cli.main, "
                                    "ckptd.reshard.executor, ckptd.reshard.planner, ckptd.reshard.preview; "
                                    "print('{\"import_s\": %f}' % (time.perf_counter() - t))"],
                                   work / "startup.log", 120)
            print(f"ckptd reshard start-up (process + imports): {startup['wall_s']:.2f}s", flush=True)
            root = work / "ckptd-root"
            server = ServerProcess(root, log=work / "server.log", env=SERVICE_ENV).start()
            service_warmup = warm_service(server.url, 300)
            print(f"first service job (spawns and warms the reshard worker): {service_warmup['wall_s']:.2f}s",
                  flush=True)
            http = httpx.Client(base_url=server.url, timeout=60.0)
            ctx = {"work": work, "root": root, "jobs": args.jobs, "http": http}
            results: dict[str, dict] = {}
            for gib in sizes:
                main_size = gib == args.gib
                results[_tag(gib)] = one_size(gib, args.repeat if main_size else 1, ctx, server,
                                              profile=main_size and not args.no_profile, gpu=gpu and main_size)
            server.stop()
            ceiling_end = disk_ceiling(work, min(state_bytes(tensor_specs(args.gib)), 2 * GiB))
            print("disk ceiling at the end", json.dumps({k: round(v, 3) for k, v in ceiling_end.items()}), flush=True)
            ceiling = combine_ceilings(ceiling, ceiling_end)
            main_key = _tag(args.gib)
            same_disk = len({os.stat(p).st_dev for p in (root, work)}) == 1
            result = {
                "command": "python -m bench.reshard " + " ".join(argv),
                "config": {"gib": args.gib, "sizes_gib": sizes, "repeat": args.repeat, "jobs": args.jobs,
                           "source_world": SRC_WORLD, "target_world": DST_WORLD, "cols": COLS, "layer_rows": LAYER,
                           "tensors_at_gib": results[main_key]["tensors"], "same_filesystem": same_disk,
                           "workdir": str(work),
                           "ckptd_source": "written at dp=4 by 4 gloo ranks through a real `ckptd serve` "
                                           "(CheckpointClient defaults), like a trainer save",
                           "ckptd": "`python -m ckptd.cli.main reshard SRC --to SPEC --root ROOT --json --jobs N "
                                    "--device cpu` as a subprocess; LocalStorage durable (fsync)",
                           "service": f"POST /v1/reshard (same SRC, SPEC, jobs, device cpu) to the running `ckptd "
                                      f"serve` (env {SERVICE_ENV}), GET /v1/jobs/ID every {POLL_S}s until done; "
                                      "timed from the POST; its one worker process already ran a job",
                           "dcp": "dcp.save/dcp.load, FileSystemWriter/Reader defaults; dcp_to_torch_save + fsync"},
                "goals": GOALS, "machine": machine, "ceiling": ceiling, "ckptd_startup": startup,
                "service_warmup": service_warmup,
                "gpu": {"available": gpu, **({"results": results[main_key].get("gpu")} if gpu else {}),
                        "note": ("measured at --gib with --device cuda: see sizes[gib].gpu" if gpu else
                                 "no CUDA device in this run (torch.cuda.is_available() is False): GPU path not "
                                 "measured")},
                "summary": summarise(results, main_key, ceiling),
                "profile": results[main_key].get("profile"),
                "sizes": results,
                "wall_s": time.perf_counter() - t_start,
            }
            write_report(args.out, result, markdown(result))
            return 0
        finally:
            if http is not None:
                http.close()
            if server is not None:
                server.stop()


if __name__ == "__main__":
    sys.exit(main())
