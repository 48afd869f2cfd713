"""``ckptd verify`` against the disk's cold sequential read bandwidth, on the same files, in one run.

    .venv/bin/python -m bench.verify --gib 1 --repeat 3 --out bench/results/verify.json

Goal: ``ckptd verify`` >= 0.8 x the disk's cold sequential read bandwidth.

What one run does (see BENCHMARKS.md, section "Verify", for the results and how to read them):

1. Starts a real ``ckptd serve`` (tests/support.py ``ServerProcess``) on a root in a
   temporary work directory and saves ``--gib`` GiB of fp32 state into it with the
   real client (``CheckpointClient.save``, one process, no torch.distributed: a
   world-size-1 checkpoint split into data files of the client's default
   ``file_bytes``), then stops the server (nothing else runs during the timings).
2. Per repeat, each step preceded by evicting every data file of the checkpoint
   from the page cache (``fdatasync`` then ``posix_fadvise(DONTNEED)``, no root):

   * **cold sequential read**: the same data files, in the order verify reads them
     (sorted by name), each opened once and read front to back into one reused
     buffer, one thread, once per read size in ``--blocks-mib`` (default 1, 4 and 16
     MiB: the best size depends on the device's read-ahead window); the fastest of
     them is the disk's cold sequential read bandwidth in that repeat;
   * **``ckptd verify REF --root ROOT --json``** as a subprocess, timed as a whole
     process (Python start-up and imports included: what a user waits for);
   * the same verification in this process (``RootBackend.verify``, what the CLI
     runs): verify without the process start-up; and again with
     ``ckptd.store.checker.READ_SIZE`` set to ``--alt-read-mib`` for the duration
     (a what-if for the read size, code unchanged otherwise);
   * unless ``--no-server``, ``ckptd verify REF --server URL`` against a restarted
     service (the bytes over loopback HTTP), for reference; and ``POST
     .../verify`` to a restarted service, which checks the checkpoint in its
     worker process (one untimed call first starts that worker, then the page
     cache is evicted and a second call is timed).

   The order of the steps rotates between repeats.
3. With ``--profile``: one more cold ``ckptd verify`` under ``py-spy record``; the
   collapsed stacks go to ``bench/results/profiles/verify.collapsed(.gz)`` and the
   top functions by own and cumulative time into the JSON (bench/profile.py).

Bandwidth is the bytes of the checkpoint's data files divided by wall time;
the headline ratio is ``verify_cli_gbps / cold_read_gbps`` (median of the repeats,
each repeat's ratio from its own measurements).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

from bench._disk import evict
from bench._report import add_workdir_args, git_state, work_dir, write_report

REPO = Path(__file__).resolve().parents[1]
if str(REPO / "tests") not in sys.path:
    sys.path.insert(0, str(REPO / "tests"))

from support import ServerProcess  # noqa: E402  (tests/support.py)

MiB, GiB = 1 << 20, 1 << 30
COLS = 1024  # fp32 columns: 4 KiB per row
WEIGHTS = (23, 5, 17, 3, 13, 7, 19, 11)  # relative sizes of the 8 tensors
GOAL = 0.8
PY = sys.executable
REF = "bench/verify"


# -- the checkpoint ---------------------------------------------------------------------------------

def make_state(gib: float) -> dict[str, torch.Tensor]:
    """8 fp32 tensors, about ``gib`` GiB together, deterministic non-constant values (cheap to make)."""
    total_rows = max(int(gib * GiB) // (4 * COLS), 8)
    rows = [max(total_rows * w // sum(WEIGHTS), 1) for w in WEIGHTS]
    rows[0] += total_rows - sum(rows)
    out = {}
    for i, r in enumerate(rows):
        t = torch.arange(r * COLS, dtype=torch.int32).mul_(2654435761 & 0x7FFFFFFF).add_(97 * i + 1)
        out[f"layers.{i}.weight"] = t.view(torch.float32).reshape(r, COLS)  # arbitrary bit patterns
    return out


def save_checkpoint(url: str, gib: float) -> dict:
    from ckptd_client import CheckpointClient

    state = make_state(gib)
    client = CheckpointClient(url)
    t0 = time.perf_counter()
    client.save(state, REF).wait()
    seconds = time.perf_counter() - t0
    client.close()
    import httpx

    while httpx.get(f"{url}/v1/checkpoints/{REF}/verification", timeout=10).status_code != 200:
        time.sleep(0.05)  # the re-read after the marker: over before the server stops
    return {"state_bytes": sum(t.numel() * 4 for t in state.values()), "save_s": seconds}


def data_files(root: Path) -> tuple[list[Path], int, Any]:
    """Paths of the checkpoint's data files in the order verify reads them, their total size, the manifest."""
    from ckptd.storage import LocalStorage
    from ckptd.store import CheckpointReader

    reader = CheckpointReader(LocalStorage(root, durable=False))
    run, name = REF.split("/")
    m = reader.manifest(run, name)
    paths = []
    for fname in sorted(m.files):
        key, size = reader.file_key(run, name, fname)
        p = root.joinpath(*key.split("/"))
        assert p.stat().st_size == size, (p, size)
        paths.append(p)
    return paths, sum(e.size for e in m.files.values()), m


# -- the measurements -------------------------------------------------------------------------------

def resident_fraction(paths: list[Path]) -> float | None:
    """Fraction of the files' pages in the page cache now (``mincore``), or None where unavailable."""
    try:
        import ctypes
        import mmap

        libc = ctypes.CDLL(None, use_errno=True)
        libc.mmap.restype = ctypes.c_void_p
        libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                              ctypes.c_long]
        libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
        page = mmap.PAGESIZE
        resident = total = 0
        for p in paths:
            size = p.stat().st_size
            if not size:
                continue
            n = (size + page - 1) // page
            vec = (ctypes.c_ubyte * n)()
            fd = os.open(p, os.O_RDONLY)
            try:
                addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
                if addr in (None, ctypes.c_void_p(-1).value):
                    return None
                try:
                    if libc.mincore(addr, size, vec) != 0:
                        return None
                finally:
                    libc.munmap(addr, size)
            finally:
                os.close(fd)
            resident += sum(v & 1 for v in bytes(vec))
            total += n
        return resident / total if total else None
    except Exception:  # noqa: BLE001 - only a sanity figure
        return None


def cold_read(paths: list[Path], block: int) -> dict:
    """One thread reads every file front to back in ``block``-byte reads into one buffer."""
    buf = bytearray(block)
    n = 0
    t0 = time.perf_counter()
    for p in paths:
        with open(p, "rb", buffering=0) as f:
            while k := f.readinto(buf):
                n += k
    s = time.perf_counter() - t0
    return {"seconds": s, "bytes": n, "gbps": n / s / 1e9}


def run_cli(cmd: list[str], timeout: float, env: dict[str, str] | None = None) -> dict:
    """A subprocess (``env`` added to this one's): wall time and its last JSON line."""
    t0 = time.perf_counter()
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=REPO,
                         env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})})
    try:
        out, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        p.kill()
        raise
    wall = time.perf_counter() - t0
    if p.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited with {p.returncode}:\n{out.decode()[-2000:]}\n"
                           f"{err.decode()[-2000:]}")
    lines = [ln for ln in out.decode().splitlines() if ln.startswith("{")]
    return {"wall_s": wall, "report": json.loads(lines[-1]) if lines else None}


def _children_cpu() -> tuple[float, float]:
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return ru.ru_utime, ru.ru_stime


def verify_cli(root: Path, nbytes: int, timeout: float, server: str | None = None) -> dict:
    target = ["--server", server] if server else ["--root", str(root)]
    cpu0 = _children_cpu()
    r = run_cli([PY, "-m", "ckptd.cli.main", "verify", REF, *target, "--json"], timeout)
    cpu1 = _children_cpu()
    rep = r["report"]
    assert rep and rep["ok"] and rep["bytes_read"] == nbytes, rep
    return {"seconds": r["wall_s"], "gbps": nbytes / r["wall_s"] / 1e9, "user_s": cpu1[0] - cpu0[0],
            "sys_s": cpu1[1] - cpu0[1], "chunks": rep["chunks"], "files": rep["files"]}


def verify_service(url: str, nbytes: int, timeout: float) -> dict:
    """``POST .../verify``: the service checks the checkpoint in its worker process and answers with
    the record; timed from the request to the answer."""
    import httpx

    t0 = time.perf_counter()
    r = httpx.post(f"{url}/v1/checkpoints/{REF}/verify", timeout=timeout)
    s = time.perf_counter() - t0
    rec = r.json()
    assert r.status_code == 200 and rec["ok"] and rec["bytes_read"] == nbytes, rec
    return {"seconds": s, "gbps": nbytes / s / 1e9, "worker_s": rec["seconds"]}


def reread(root: Path, files: list[Path], nbytes: int, workers: int, timeout: float, log: Path) -> dict:
    """The re-read after a marker (``ckptd.store.rereads``) by a service of ``workers`` worker processes:
    they are started first (a small checkpoint saved and re-read), then the checkpoint's record is deleted,
    its files evicted and its re-read marked due as a commit marks it; timed from the mark to the record
    (the service's sweep, which finds it, runs every 50 ms)."""
    import httpx

    from ckptd.storage import LocalStorage
    from ckptd.store.rereads import mark_due
    from ckptd_client import CheckpointClient

    run, name = REF.split("/")
    srv = ServerProcess(root, env={"CKPTD_RESHARD_WORKERS": str(workers), "CKPTD_RECLAIM_INTERVAL": "0.05"},
                        log=log).start()

    def recorded(ref: str) -> dict:
        deadline = time.monotonic() + timeout
        while (r := httpx.get(f"{srv.url}/v1/checkpoints/{ref}/verification", timeout=10)).status_code != 200:
            assert time.monotonic() < deadline, r.text
            time.sleep(0.01)
        return r.json()

    try:
        warm = f"{run}/warm{workers}x{time.time_ns()}"
        with CheckpointClient(srv.url, file_bytes=MiB) as c:  # files enough for a share per worker
            c.save(make_state(16 / 1024), warm).wait()
        recorded(warm)
        (root / "runs" / run / name / "VERIFIED.json").unlink(missing_ok=True)
        sid = json.loads((root / "runs" / run / name / "COMMITTED").read_text())["session"]
        os.sync()
        evicted = evict(files)
        load = os.getloadavg()
        t0 = time.perf_counter()
        mark_due(LocalStorage(root, durable=False), run, name, sid)
        rec = recorded(REF)
        s = time.perf_counter() - t0
        assert rec["ok"] and rec["bytes_read"] == nbytes, rec
        return {"seconds": s, "gbps": nbytes / s / 1e9, "per_worker_gbps": nbytes / s / 1e9 / workers,
                "workers_s": rec["seconds"], "evicted_bytes": evicted, "loadavg": load}
    finally:
        srv.stop()


def verify_inproc(root: Path, nbytes: int, read_size: int | None = None) -> dict:
    from ckptd.cli.root_backend import RootBackend
    from ckptd.store import checker as verify_mod

    if read_size is not None:  # what-if: the module constant, for this call only
        saved, verify_mod.READ_SIZE = verify_mod.READ_SIZE, read_size
        try:
            return verify_inproc(root, nbytes)
        finally:
            verify_mod.READ_SIZE = saved
    t = os.times()
    t0 = time.perf_counter()
    b = RootBackend(str(root))
    m = b.manifest(*REF.split("/"))
    rep = b.verify(m, None)  # what `ckptd verify --root` runs
    s = time.perf_counter() - t0
    t1 = os.times()
    assert rep["ok"] and rep["bytes_read"] == nbytes, rep["problems"]
    return {"seconds": s, "gbps": nbytes / s / 1e9, "user_s": t1.user - t.user, "sys_s": t1.system - t.system}


def startup_s(timeout: float) -> float:
    """Wall time of ``ckptd verify --help``: the interpreter and the CLI's imports, no work."""
    t0 = time.perf_counter()
    subprocess.run([PY, "-m", "ckptd.cli.main", "verify", "--help"], cwd=REPO, check=True,
                   stdout=subprocess.DEVNULL, timeout=timeout)
    return time.perf_counter() - t0


def profile_verify(root: Path, files: list[Path], out_dir: Path, rate: int) -> dict:
    """One more cold ``ckptd verify --root`` under py-spy: top functions, innermost lines, categories."""
    from bench.profile import (aggregate, categorize, pyspy_record, save_collapsed, snapshot_sources, top_lines,
                               use_sources)

    os.sync()
    evict(files)
    raw = out_dir / "verify.collapsed"
    rec = pyspy_record([PY, "-m", "ckptd.cli.main", "verify", REF, "--root", str(root), "--json"], raw,
                       rate=rate, subprocesses=False, root_role="ckptd verify")
    stacks = rec["stacks"]
    sources = snapshot_sources(stacks)
    use_sources(sources)
    agg = aggregate(stacks, top=15)
    return {"command": rec["command"], "wall_s": rec["wall_s"], "samples": agg["samples"],
            "file": save_collapsed(raw, stacks), "top_self": agg["top_self"],
            "top_cumulative": agg["top_cumulative"], "top_lines": top_lines(stacks, 15),
            "categories": categorize(stacks), "leaf_sources": sources}


# -- summary ----------------------------------------------------------------------------------------

def _med(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def summarise(repeats: list[dict], nbytes: int) -> dict:
    out: dict[str, Any] = {}
    for key in ("cold_read", "verify_cli", "verify_inproc", "verify_inproc_alt", "verify_server", "verify_service"):
        vals = [r[key]["gbps"] for r in repeats if key in r]
        if vals:
            out[f"{key}_gbps"] = _med(vals)
            out[f"{key}_s"] = _med([r[key]["seconds"] for r in repeats if key in r])
    out["verify_ratio"] = _med([r["verify_cli"]["gbps"] / r["cold_read"]["gbps"] for r in repeats])
    out["verify_inproc_ratio"] = _med([r["verify_inproc"]["gbps"] / r["cold_read"]["gbps"] for r in repeats])
    if all("verify_inproc_alt" in r for r in repeats):
        out["verify_inproc_alt_ratio"] = _med([r["verify_inproc_alt"]["gbps"] / r["cold_read"]["gbps"]
                                               for r in repeats])
    out["cold_read_by_block_gbps"] = {b: _med([r["cold_read"]["by_block"][b]["gbps"] for r in repeats])
                                      for b in repeats[0]["cold_read"]["by_block"]}
    if all("verify_server" in r for r in repeats):
        out["verify_server_ratio"] = _med([r["verify_server"]["gbps"] / r["cold_read"]["gbps"] for r in repeats])
    if all("verify_service" in r for r in repeats):
        out["verify_service_ratio"] = _med([r["verify_service"]["gbps"] / r["cold_read"]["gbps"] for r in repeats])
        out["service_warmup_s"] = _med([r["service_warmup_s"] for r in repeats])
    for key in sorted({k for r in repeats for k in r if k.startswith("reread_")}):
        out[f"{key}_gbps"] = _med([r[key]["gbps"] for r in repeats])
        out[f"{key}_s"] = _med([r[key]["seconds"] for r in repeats])
        out[f"{key}_per_worker_gbps"] = _med([r[key]["per_worker_gbps"] for r in repeats])
        out[f"{key}_ratio"] = _med([r[key]["gbps"] / r["cold_read"]["gbps"] for r in repeats])
        out[f"{key}_loadavg"] = _med([r[key]["loadavg"][0] for r in repeats])
    out["verify_cli_cpu_s"] = _med([r["verify_cli"]["user_s"] + r["verify_cli"]["sys_s"] for r in repeats])
    out["verify_inproc_cpu_s"] = _med([r["verify_inproc"]["user_s"] + r["verify_inproc"]["sys_s"] for r in repeats])
    out["goal"] = GOAL
    out["goal_met"] = out["verify_ratio"] >= GOAL
    return out


def markdown(res: dict) -> str:
    s, cfg = res["summary"], res["config"]
    lines = [f"{cfg['data_bytes'] / GiB:.2f} GiB in {cfg['files']} data files, cold page cache, median of "
             f"{cfg['repeat']} repeats:", "",
             "| measure | seconds | GB/s | / cold read | goal |", "| --- | --- | --- | --- | --- |",
             "| cold sequential read, 1 thread, best read size of each repeat | "
             f"{s['cold_read_s']:.2f} | {s['cold_read_gbps']:.2f} | 1.00 | |",
             *[f"| ... {b} reads | | {v:.2f} | | |" for b, v in s["cold_read_by_block_gbps"].items()],
             f"| `ckptd verify --root` (whole process) | {s['verify_cli_s']:.2f} | {s['verify_cli_gbps']:.2f} | "
             f"**{s['verify_ratio']:.2f}** | >= {GOAL} |",
             f"| verify in process (no start-up) | {s['verify_inproc_s']:.2f} | {s['verify_inproc_gbps']:.2f} | "
             f"{s['verify_inproc_ratio']:.2f} | |"]
    if "verify_inproc_alt_ratio" in s:
        lines.append(f"| verify in process, `READ_SIZE` = {cfg['alt_read_mib']:g} MiB (what-if) | "
                     f"{s['verify_inproc_alt_s']:.2f} | {s['verify_inproc_alt_gbps']:.2f} | "
                     f"{s['verify_inproc_alt_ratio']:.2f} | |")
    if "verify_server_ratio" in s:
        lines.append(f"| `ckptd verify --server` (HTTP, whole process) | {s['verify_server_s']:.2f} | "
                     f"{s['verify_server_gbps']:.2f} | {s['verify_server_ratio']:.2f} | |")
    if "verify_service_ratio" in s:
        lines.append(f"| `POST .../verify`: the service's warm worker (first call, which starts it: "
                     f"{s['service_warmup_s']:.2f} s) | {s['verify_service_s']:.2f} | {s['verify_service_gbps']:.2f} | "
                     f"**{s['verify_service_ratio']:.2f}** | >= {GOAL} |")
    for key in sorted(k[:-5] for k in s if k.startswith("reread_") and k.endswith("_gbps") and "per_worker" not in k):
        lines.append(f"| re-read after a marker, {key[7:]} worker(s) ({s[key + '_per_worker_gbps']:.2f} GB/s each; "
                     f"load average {s[key + '_loadavg']:.1f}) | {s[key + '_s']:.2f} | {s[key + '_gbps']:.2f} | "
                     f"{s[key + '_ratio']:.2f} | |")
    lines += ["", f"`ckptd verify --help` (start-up only): {res['startup_s']:.2f} s; CPU of `ckptd verify --root`: "
              f"{s['verify_cli_cpu_s']:.2f} s, in process {s['verify_inproc_cpu_s']:.2f} s; "
              f"goal {'met' if s['goal_met'] else 'NOT met'}"]
    if res.get("profile"):
        p = res["profile"]
        lines += ["", f"py-spy of one cold `ckptd verify` ({p['samples']} samples): " + ", ".join(
            f"{k} {v:.0%}" for k, v in p["categories"]["fractions"].items() if v >= 0.01)]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gib", type=float, default=1.0, help="checkpoint size (GiB of fp32 state)")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--blocks-mib", default="1,4,16", help="read sizes of the cold sequential reads (MiB)")
    ap.add_argument("--alt-read-mib", type=float, default=4,
                    help="also verify in process with this READ_SIZE (MiB; 0: skip)")
    ap.add_argument("--no-server", action="store_true", help="skip `ckptd verify --server` (HTTP) and the service's own verification")
    ap.add_argument("--reread-workers", default="1,2",
                    help="re-read after a marker by a service of each of these worker counts ('': skip)")
    ap.add_argument("--profile", action="store_true", help="one more cold verify under py-spy")
    ap.add_argument("--profile-rate", type=int, default=200)
    ap.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "verify.json")
    add_workdir_args(ap)
    args = ap.parse_args(argv)

    with work_dir("ckptd-bench-verify-", args.workdir, args.keep) as work:
        root = work / "ckptd-root"
        t_start = time.perf_counter()
        server = ServerProcess(root, log=work / "server.log")
        try:
            from bench.save_load import describe_machine

            machine = describe_machine(work)
            server.start()
            saved = save_checkpoint(server.url, args.gib)
            server.stop()  # nothing else runs while timing
            files, nbytes, manifest = data_files(root)
            print(f"work dir {work}; saved {saved['state_bytes'] / MiB:.0f} MiB in {saved['save_s']:.1f}s; "
                  f"{len(files)} data files, {nbytes / MiB:.0f} MiB; load average {os.getloadavg()}", flush=True)
            timeout = 120 + nbytes / MiB * 0.5
            startup = startup_s(timeout)
            blocks = [float(b) for b in args.blocks_mib.split(",") if b.strip()]
            steps = (["cold_read", "verify_cli", "verify_inproc"] + (["verify_inproc_alt"] if args.alt_read_mib else [])
                     + ([] if args.no_server else ["verify_server", "verify_service"])
                     + [f"reread_{w}" for w in args.reread_workers.split(",") if w.strip()])
            repeats = []
            for r in range(args.repeat):
                k = r % len(steps)
                order = steps[k:] + steps[:k]
                rec: dict[str, Any] = {"order": order, "loadavg": os.getloadavg()}
                for step in order:
                    if step == "verify_server":
                        server.start()
                    if step == "verify_service":  # start the service and its worker process, untimed
                        server.start()
                        rec["service_warmup_s"] = verify_service(server.url, nbytes, timeout)["seconds"]
                    if step == "cold_read":
                        by_block = {}
                        for b in blocks:
                            rec.setdefault("evicted_bytes", []).append(evict(files))
                            rec.setdefault("resident_after_evict", []).append(resident_fraction(files))
                            by_block[f"{b:g} MiB"] = cold_read(files, int(b * MiB))
                            assert by_block[f"{b:g} MiB"]["bytes"] == nbytes
                        best = max(by_block.values(), key=lambda x: x["gbps"])
                        rec[step] = {**best, "by_block": by_block,
                                     "best_block": next(k for k, v in by_block.items() if v is best)}
                        continue
                    if step.startswith("reread_"):
                        rec[step] = reread(root, files, nbytes, int(step[7:]), timeout, work / "reread.log")
                        continue
                    os.sync()
                    rec.setdefault("evicted_bytes", []).append(evict(files))
                    rec.setdefault("resident_after_evict", []).append(resident_fraction(files))
                    if step == "verify_cli":
                        rec[step] = verify_cli(root, nbytes, timeout)
                    elif step == "verify_inproc":
                        rec[step] = verify_inproc(root, nbytes)
                    elif step == "verify_inproc_alt":
                        rec[step] = verify_inproc(root, nbytes, int(args.alt_read_mib * MiB))
                    elif step == "verify_service":
                        rec[step] = verify_service(server.url, nbytes, timeout)
                        server.stop()
                    else:
                        rec[step] = verify_cli(root, nbytes, timeout, server=server.url)
                        server.stop()
                rec["ratio"] = rec["verify_cli"]["gbps"] / rec["cold_read"]["gbps"]
                sizes = ", ".join(f"{k} {v['gbps']:.2f}" for k, v in rec["cold_read"]["by_block"].items())
                print(f"repeat {r}: " + ", ".join(f"{s} {rec[s]['gbps']:.2f} GB/s" for s in order)
                      + f" (cold read by size: {sizes})"
                      + f"; ratio {rec['ratio']:.2f}", flush=True)
                repeats.append(rec)
            profile = None
            if args.profile:
                profile = profile_verify(root, files, args.out.parent / "profiles", args.profile_rate)
            import xxhash

            result = {
                "command": "python -m bench.verify " + " ".join(sys.argv[1:] if argv is None else argv),
                "config": {"gib": args.gib, "repeat": args.repeat, "blocks_mib": blocks,
                           "alt_read_mib": args.alt_read_mib,
                           "ref": REF, "read_ahead_kb": _read_ahead_kb(work),
                           "state_bytes": saved["state_bytes"], "data_bytes": nbytes, "files": len(files),
                           "file_sizes": [p.stat().st_size for p in files],
                           "chunks": sum(len(t.chunks) for t in manifest.tensors), "workdir": str(work),
                           "client": "CheckpointClient defaults (file_bytes=256 MiB, no compression), world size 1",
                           "verify_read_size": _verify_read_size(), "xxhash": xxhash.VERSION},
                "git": git_state(),
                "machine": {**machine, "python": platform.python_version()},
                "save_s": saved["save_s"], "startup_s": startup,
                "summary": summarise(repeats, nbytes), "repeats": repeats, "profile": profile,
                "wall_s": time.perf_counter() - t_start, "loadavg_at_end": os.getloadavg(),
            }
            write_report(args.out, result, markdown(result))
            return 0
        finally:
            server.stop()


def _read_ahead_kb(path: Path) -> int | None:
    """The block device's read-ahead window under ``path`` (sysfs), or None."""
    try:
        dev = os.stat(path).st_dev
        sysdir = Path(f"/sys/dev/block/{os.major(dev)}:{os.minor(dev)}")
        for cand in (sysdir / "queue" / "read_ahead_kb", sysdir / ".." / "queue" / "read_ahead_kb",
                     sysdir / "bdi" / "read_ahead_kb"):
            if cand.exists():
                return int(cand.read_text().strip())
    except (OSError, ValueError):
        pass
    return None


def _verify_read_size() -> int | None:
    from ckptd.store import checker

    return getattr(checker, "READ_SIZE", None)


if __name__ == "__main__":
    sys.exit(main())
