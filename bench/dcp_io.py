"""ckptd's DCP storage writer and its safetensors export, against DCP's own ways, in one run on one disk.

    .venv/bin/python -m bench.dcp_io --gib 1 --repeat 3 --out bench/results/dcp_io.json

What one run does (see BENCHMARKS.md, section "DCP writer and safetensors export"):

1. Describes the machine (nproc, RAM, load average at the start) and measures this disk's
   ceiling (``bench.reshard.disk_ceiling``: durable write, cold read, copy).
2. **DCP writer.** ``--world`` gloo ranks (default 4) hold one fp32 state of ``Shard(0)``
   DTensors with odd row counts (``bench.reshard``'s state: model weights + Adam moments,
   about ``--gib`` GiB). Per repeat, in alternating order, each timed between barriers after
   ``sync`` and evicting every checkpoint file from the page cache (``posix_fadvise``):

   * ``dcp.save(sd, storage_writer=FileSystemWriter(dir))`` (defaults: ``sync_files=True``,
     one thread per rank, one file per rank);
   * ``dcp.save(sd, storage_writer=client.dcp_writer(ref))`` against a real ``ckptd serve``
     subprocess whose root is on the same disk. The writer's ``finish`` (coordinator) returns
     after the commit, and DCP broadcasts ``finish``'s end to every rank, so the time is
     "committed"; the benchmark checks the manifest afterwards.

   Then, for information, ``dcp.load`` of the same repeat's checkpoints at the same world
   size, cold, through ``FileSystemReader`` and ``client.dcp_reader``; every tensor loaded
   is compared bit for bit with the values saved. Ratio = DCP time / ckptd time (the
   throughput ratio; goal for the save >= 0.9). CPU seconds of the ranks (``os.times``)
   and of the server (``/proc/PID/stat``), and the writer's phases (functions wrapped from
   the outside, ``bench.save_load.Probe``) say where the time goes.
3. **safetensors export** of the DCP directory the last repeat wrote (>= 1 GiB at
   ``--gib 1``). Once, timed separately: ``ckptd import dcp DIR REF --root R``. Then per
   repeat, each a subprocess:

   * the peer's pipeline in one process: ``dcp_to_torch_save(DIR, tmp.pt)``, ``torch.load``,
     the nested dict flattened to dotted names, ``safetensors.torch.save_file``, the
     intermediate ``.pt`` removed, then an ``fsync`` of the output, timed on its own;
   * ``ckptd export REF --format safetensors OUT --root R --prefix ''`` (every tensor, as the
     peer; otherwise defaults: the export is read back and every tensor's digest compared), and,
     for information, with ``--no-check``.

   Each op starts from the same state: the previous op's output deleted, ``sync``, its
   inputs evicted; the order rotates between repeats. Wall time and peak RSS (``ru_maxrss``
   from ``wait4``, taken by ``/usr/bin/time`` around the command: see ``run_sampled``), plus
   the child's anonymous and file-backed RSS sampled every 20 ms. The outputs are opened
   with ``safetensors.safe_open``: same names, dtypes and shapes, every tensor's bytes hash
   alike (XXH3-64), four tensors equal bit for bit, and two of them equal to the values the
   ranks held. Whether each side fsyncs is
   observed, not assumed: one more (untimed) run of each under ``strace`` counts its
   fsync-family calls. The headline peer time includes the output fsync only if ckptd's
   export fsyncs.
4. Writes every raw number, the command line and the machine to ``--out`` (JSON).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.device_mesh import init_device_mesh

from bench._report import add_workdir_args, work_dir, write_report  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
if str(REPO / "tests") not in sys.path:
    sys.path.insert(0, str(REPO / "tests"))

# The state, subprocess measurement, disk ceiling and eviction of the reshard benchmark; machine
# description, outside probes and CPU accounting of the save/load benchmark.
from bench.reshard import (  # noqa: E402
    _evict, _med, disk_ceiling, expected, make_state, reset_peak, run_measured, spot_names, state_bytes,
    tensor_specs,
)
from bench.save_load import (  # noqa: E402
    Probe, _max_over_ranks, _own_cpu, _proc_cpu, _sum_over_ranks, describe_machine, vm_status,
)
from support import ServerProcess, run_ranks  # noqa: E402  (tests/support.py)

MiB, GiB = 1 << 20, 1 << 30
PY = sys.executable
# "a fraction of the peak memory" is read as at most half of the peer's peak RSS
GOALS = {"save_throughput_ratio": 0.9, "export_ratio_min_exclusive": 1.0, "export_peak_rss_fraction_max": 0.5}
FSYNC_CALLS = ("fsync", "fdatasync", "sync_file_range", "syncfs", "sync", "msync")


# -- DCP writer: rank job (spawned; module level so it pickles) ----------------------------------------

def _hook(probe: Probe) -> None:
    """Wrap the storage layers' entry points (both sides) so each op's phases show up in ``probe``."""
    from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter

    import ckptd_client.dcp as cdcp

    targets = [(cdcp.CkptdStorageWriter, "write_data", "ckptd_write_data"),
               (cdcp.CkptdStorageWriter, "finish", "ckptd_finish"),
               (cdcp, "open_session", "open_session_call"), (cdcp, "upload_files", "upload_files"),
               (cdcp, "put_index", "put_index_call"), (cdcp, "wait_committed", "wait_committed"),
               (cdcp.CkptdStorageReader, "read_metadata", "ckptd_read_metadata"),
               (cdcp.CkptdStorageReader, "read_data", "ckptd_read_data"),
               (cdcp, "_fetch", "fetch_verify"), (cdcp, "copy_into", "copy_into"),
               (FileSystemWriter, "write_data", "dcp_write_data"), (FileSystemWriter, "finish", "dcp_finish"),
               (FileSystemReader, "read_data", "dcp_read_data")]
    for owner, name, kind in targets:
        if hasattr(owner, name):  # a renamed function is skipped: the benchmark must not rot
            setattr(owner, name, probe._timed(getattr(owner, name), kind))


def _bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(
        a.contiguous().view(-1).view(torch.uint8), b.contiguous().view(-1).view(torch.uint8))


def writer_job(rank: int, world: int, cfg: dict) -> dict:
    from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter

    from ckptd_client import CheckpointClient
    from ckptd_client.dcp import DCP_METADATA

    probe = Probe()
    _hook(probe)
    mesh = init_device_mesh("cpu", (world,))
    sd, local = make_state(cfg["specs"], mesh, fill=True)
    into, into_local = make_state(cfg["specs"], mesh, fill=False)
    client = CheckpointClient(cfg["url"])
    evict_paths = [Path(p) for p in cfg["evict"]]
    pid = cfg["server_pid"]

    def measure(fn: Callable[[], None]) -> dict:
        evicted = _evict(evict_paths) if rank == 0 else 0  # sync + drop every checkpoint file's pages
        dist.barrier()
        cpu0, srv0 = _own_cpu(), (_proc_cpu(pid) if rank == 0 else (0.0, 0.0))
        t0 = time.perf_counter()
        fn()
        dist.barrier()
        t = time.perf_counter() - t0
        cpu = [b - a for a, b in zip(cpu0, _own_cpu())]
        srv = [b - a for a, b in zip(srv0, _proc_cpu(pid))] if rank == 0 else [0.0, 0.0]
        phases = probe.take(t0)
        (t_max,) = _max_over_ranks([t])
        cu, cs, su, ss = _sum_over_ranks([*cpu, *srv])
        return {"s": t_max, "own_s": t, "ranks_user_s": cu, "ranks_sys_s": cs, "server_user_s": su,
                "server_sys_s": ss, "evicted_bytes": evicted, "phases": phases}

    repeats = []
    for r in range(cfg["repeat"]):
        order = ("dcp", "ckptd") if r % 2 == 0 else ("ckptd", "dcp")
        path, ref = os.path.join(cfg["dcp_dir"], f"r{r}"), f"dcpio/{r}"
        rec: dict[str, Any] = {"order": list(order)}
        for which in order:
            if which == "dcp":
                rec["dcp_save"] = measure(lambda: dcp.save(sd, storage_writer=FileSystemWriter(path)))
            else:
                rec["ckptd_save"] = measure(lambda: dcp.save(sd, storage_writer=client.dcp_writer(ref)))
        if rank == 0:  # both saves really happened; ckptd's is committed (its manifest is served)
            m = client.manifest(ref)
            assert len(m.tensors) == len(cfg["specs"]), m.ref
            assert any(o.name == DCP_METADATA for o in m.objects), "DCP metadata stored with the checkpoint"
            assert os.path.exists(os.path.join(path, ".metadata"))
            rec["ckptd_committed_manifest"] = m.ref
        for which in order:
            for t in into_local.values():
                t.fill_(float("nan"))
            reader = FileSystemReader(path) if which == "dcp" else client.dcp_reader(ref)
            rec[f"{which}_load"] = measure(lambda: dcp.load(into, storage_reader=reader))
            bad = [fqn for fqn, want in local.items() if not _bits_equal(into_local[fqn], want)]
            assert not bad, f"{which} load, repeat {r}, rank {rank}: {bad[:3]} differ"
            rec[f"{which}_load"]["checked_tensors"] = len(local)
        repeats.append(rec)
    client.close()
    return {"repeats": repeats, "local_bytes": sum(t.numel() * t.element_size() for t in local.values())}


# -- safetensors export ----------------------------------------------------------------------------------

_PEER = r"""
import json, os, sys, time
t0 = time.perf_counter()
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from safetensors.torch import save_file

def hwm():
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024

def reset_hwm():
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass

src, pt, out, fsync = sys.argv[1:5]
t1 = time.perf_counter()
dcp_to_torch_save(src, pt)
t2 = time.perf_counter()
hwm_convert = hwm()
reset_hwm()
sd = torch.load(pt)
t3 = time.perf_counter()
flat = {}

def walk(prefix, v):
    if isinstance(v, dict):
        for k, x in v.items():
            walk(f"{prefix}{k}.", x)
    elif isinstance(v, torch.Tensor):
        flat[prefix[:-1]] = v

walk("", sd)
save_file(flat, out, metadata={"format": "pt"})
t4 = time.perf_counter()
hwm_save = hwm()
del flat, sd
os.unlink(pt)
t5 = time.perf_counter()
if fsync == "fsync":
    fd = os.open(out, os.O_RDONLY)
    os.fsync(fd)
    os.close(fd)
t6 = time.perf_counter()
print(json.dumps({"import_s": t1 - t0, "dcp_to_torch_save_s": t2 - t1, "torch_load_s": t3 - t2,
                  "save_file_s": t4 - t3, "unlink_pt_s": t5 - t4, "fsync_s": t6 - t5,
                  "hwm_dcp_to_torch_save_bytes": hwm_convert, "hwm_load_save_file_bytes": hwm_save}))
"""


class ChildMemory:
    """Samples the ``RssAnon`` (heap) and ``RssFile`` (mapped files) of this process's descendants, summed,
    every ``interval`` seconds while open. ``ru_maxrss`` counts both; this tells them apart (short peaks may
    be missed)."""

    def __init__(self, interval: float = 0.02) -> None:
        self.interval, self.peak = interval, {"rss_anon_bytes": 0, "rss_file_bytes": 0, "samples": 0}
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    @staticmethod
    def _children(pid: int) -> list[str]:
        out: list[str] = []
        try:
            for tid in os.listdir(f"/proc/{pid}/task"):
                with open(f"/proc/{pid}/task/{tid}/children") as f:
                    out += f.read().split()
        except OSError:
            pass
        return out

    def _run(self) -> None:
        me = os.getpid()
        while not self._done.wait(self.interval):
            pending, seen = self._children(me), 0
            anon = file = 0
            while pending:
                pid = pending.pop()
                pending += self._children(int(pid))
                try:
                    with open(f"/proc/{pid}/status") as f:
                        for line in f:
                            if line.startswith("RssAnon:"):
                                anon += int(line.split()[1]) * 1024
                            elif line.startswith("RssFile:"):
                                file += int(line.split()[1]) * 1024
                    seen += 1
                except OSError:
                    continue
            if seen:
                self.peak["samples"] += 1
            self.peak["rss_anon_bytes"] = max(self.peak["rss_anon_bytes"], anon)
            self.peak["rss_file_bytes"] = max(self.peak["rss_file_bytes"], file)

    def __enter__(self) -> "ChildMemory":
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._done.set()
        self._thread.join()


def run_sampled(cmd: list[str], log: Path, timeout: float) -> dict:
    """``bench.reshard.run_measured`` (wall, rusage from ``wait4``), with the child's peak RSS taken without
    this process's floor, and its memory sampled.

    A child's ``ru_maxrss`` starts from this process's ``VmHWM`` (the forked address space's high-water mark
    is carried into the exec'd program: a bare ``python -c pass`` reports this process's size). So the
    command runs under ``/usr/bin/time``, whose own ``wait4`` reports the command's ``ru_maxrss`` from a
    floor of a few MiB; ``run_measured``'s figure is kept as ``wait4_ru_maxrss_bytes``. User and system
    time and disk blocks from ``wait4`` include the waited-for command.
    """
    gnu_time = shutil.which("time", path="/usr/bin:/bin")
    maxrss_file = log.with_suffix(".maxrss")
    reset_peak(os.getpid())  # the floor without /usr/bin/time: this process's current RSS
    floor = vm_status(os.getpid())["VmHWM"]
    with ChildMemory() as mem:
        r = run_measured(([gnu_time, "-f", "%M", "-o", str(maxrss_file)] if gnu_time else []) + cmd, log, timeout)
    r["wait4_ru_maxrss_bytes"], r["ru_maxrss_floor_bytes"] = r["peak_rss_bytes"], floor
    if gnu_time:
        r["peak_rss_bytes"] = int(maxrss_file.read_text().split()[-1]) * 1024
    r["peak_rss_source"] = "/usr/bin/time %M (ru_maxrss of the command)" if gnu_time else \
        "ru_maxrss from wait4 (floored at this process's RSS)"
    r["sampled_peak_rss_anon_bytes"] = mem.peak["rss_anon_bytes"]
    r["sampled_peak_rss_file_bytes"] = mem.peak["rss_file_bytes"]
    r["memory_samples"] = mem.peak["samples"]
    return r


def peer_cmd(src: Path, pt: Path, out: Path, fsync: bool) -> list[str]:
    return [PY, "-c", _PEER, str(src), str(pt), str(out), "fsync" if fsync else "nofsync"]


def ckptd_cli(*args: str) -> list[str]:
    return [PY, "-m", "ckptd.cli.main", *args]


def export_cmd(ref: str, out: Path, root: Path, *extra: str) -> list[str]:
    """Every tensor (``--prefix ''``), as the peer's pipeline writes the whole state dict."""
    return ckptd_cli("export", ref, "--format", "safetensors", str(out), "--root", str(root), "--prefix", "", "--json",
                     *extra)


def read_output(files: list[Path], keep: list[str]) -> tuple[dict[str, list], dict[str, torch.Tensor]]:
    """Every tensor of the safetensors ``files``: ``{name: [dtype, shape, bytes, xxh3-64 of them]}``, and copies
    of the tensors named in ``keep`` (for a bit-for-bit comparison)."""
    import xxhash
    from safetensors import safe_open

    digests: dict[str, list] = {}
    kept: dict[str, torch.Tensor] = {}
    for path in files:
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                assert name not in digests, f"{name} is in two files"
                t = f.get_tensor(name)
                raw = memoryview(t.contiguous().view(-1).view(torch.uint8).numpy())
                digests[name] = [str(t.dtype), list(t.shape), len(raw), xxhash.xxh3_64_hexdigest(raw)]
                if name in keep:
                    kept[name] = t.clone()
                del t, raw
    return digests, kept


def output_files(which: str, out: Path) -> list[Path]:
    if which == "peer":
        return [out / "model.safetensors"]
    index = json.loads((out / "model.safetensors.index.json").read_text())
    return [out / f for f in sorted(set(index["weight_map"].values()))]


def compare_outputs(outputs: dict[str, tuple[dict, dict]], specs: list) -> dict:
    """Same names, dtypes and shapes in every output; every tensor's bytes hash alike; the kept tensors equal
    bit for bit across outputs and to the values the ranks held."""
    (first, (d0, k0)), *rest = outputs.items()
    for which, (d, k) in rest:
        assert set(d) == set(d0), f"{which} vs {first}: names differ: {sorted(set(d) ^ set(d0))[:5]}"
        bad = [n for n in d0 if d[n] != d0[n]]
        assert not bad, f"{which} vs {first}: {bad[:5]} differ (dtype, shape or bytes)"
        assert set(k) == set(k0)
        for n in k0:
            assert _bits_equal(k[n], k0[n]), f"{which} vs {first}: {n} differs bit for bit"
    spot = spot_names(specs)
    for n in spot:
        assert _bits_equal(k0[n], expected(specs, n)), f"{n}: the export differs from the ranks' values"
    return {"outputs": list(outputs), "tensors": len(d0), "digests_equal": True,
            "bitwise_equal_tensors": sorted(k0), "spot_checked_against_source": spot,
            "bytes": sum(d[2] for d in d0.values()), "equal": True}


def count_fsyncs(cmd: list[str], log: Path, timeout: float) -> dict:
    """Run ``cmd`` once under strace and count its fsync-family system calls (None without strace)."""
    strace = shutil.which("strace")
    if strace is None:
        return {"available": False, "calls": None}
    trace = log.with_suffix(".strace")
    with open(log, "wb") as f:
        p = subprocess.run([strace, "-f", "-qq", "-e", "signal=none", "-e", "trace=" + ",".join(FSYNC_CALLS),
                            "-o", str(trace), *cmd], stdout=f, stderr=subprocess.STDOUT, cwd=REPO, timeout=timeout)
    if p.returncode != 0 or not trace.exists():
        return {"available": False, "calls": None, "rc": p.returncode, "log": log.read_text(errors="replace")[-2000:]}
    lines = [ln for ln in trace.read_text(errors="replace").splitlines()
             if any(f" {c}(" in f" {ln.split(' ', 1)[-1]}" for c in FSYNC_CALLS)]
    calls: dict[str, int] = {}
    for ln in lines:
        call = ln.split(" ", 1)[-1].lstrip().split("(", 1)[0]
        calls[call] = calls.get(call, 0) + 1
    return {"available": True, "calls": calls, "total": sum(calls.values())}


def export_part(work: Path, src_dir: Path, specs: list, repeat: int, timeout: float, fsync_probe: bool) -> dict:
    root, ref = work / "export-root", "export/1"
    src_bytes = sum(p.stat().st_size for p in src_dir.rglob("*") if p.is_file())
    _evict([src_dir])
    imp = run_sampled(ckptd_cli("import", "dcp", str(src_dir), ref, "--root", str(root), "--json"),
                       work / "import.log", timeout)
    print(f"[export] ckptd import dcp ({src_bytes / GiB:.3f} GiB directory): {imp['wall_s']:.2f}s, peak "
          f"{imp['peak_rss_bytes'] / MiB:.0f} MiB", flush=True)
    names = [n for _, n, _, _ in specs]
    keep = sorted(set(spot_names(specs)) | {names[0], names[-1]})  # compared bit for bit, the rest by digest
    ops = ("peer", "ckptd", "ckptd_no_check")
    repeats = []
    for r in range(repeat):
        order = ops[r % 3:] + ops[:r % 3]  # each op first, second and third in turn
        rec: dict[str, Any] = {"order": list(order)}
        outputs: dict[str, tuple[dict, dict]] = {}
        for which in order:
            out = work / f"{which}-{r}"
            _evict([src_dir, root])  # sync, then drop the inputs' pages: every op starts cold and clean
            if which == "peer":
                out.mkdir()
                cmd = peer_cmd(src_dir, out / "full.pt", out / "model.safetensors", True)
            else:
                cmd = export_cmd(ref, out, root, *(("--no-check",) if which == "ckptd_no_check" else ()))
            res = run_sampled(cmd, work / f"{which}-{r}.log", timeout)
            res["bytes_written"] = sum(p.stat().st_size for p in out.iterdir() if p.is_file())
            if which == "peer":
                res["wall_no_fsync_s"] = res["wall_s"] - res["report"]["fsync_s"]
            else:
                res["inproc_s"] = res["report"]["seconds"]
            rec[which] = res
            outputs[which] = read_output(output_files(which, out), keep)
            shutil.rmtree(out)  # the next op starts without this one's output in the page cache
        rec["compare"] = compare_outputs({w: outputs[w] for w in ops}, specs)
        del outputs
        print(f"[export] repeat {r} ({'/'.join(order)}): peer {rec['peer']['wall_s']:.2f}s (without its fsync "
              f"{rec['peer']['wall_no_fsync_s']:.2f}s, peak {rec['peer']['peak_rss_bytes'] / MiB:.0f} MiB); ckptd "
              f"export {rec['ckptd']['wall_s']:.2f}s (peak {rec['ckptd']['peak_rss_bytes'] / MiB:.0f} MiB; "
              f"--no-check {rec['ckptd_no_check']['wall_s']:.2f}s); outputs equal ({rec['compare']['tensors']} "
              f"tensors by digest, {len(keep)} bit for bit)", flush=True)
        repeats.append(rec)
    fsyncs: dict[str, Any] = {"probed": fsync_probe}
    if fsync_probe:  # untimed: does either side fsync on its own?
        pd, out = work / "peer-strace", work / "ckptd-strace"
        pd.mkdir()
        fsyncs["peer"] = count_fsyncs(peer_cmd(src_dir, pd / "full.pt", pd / "model.safetensors", False),
                                      work / "peer-strace.log", timeout)
        fsyncs["ckptd_export"] = count_fsyncs(export_cmd(ref, out, root), work / "ckptd-strace.log", timeout)
        shutil.rmtree(pd)
        shutil.rmtree(out, ignore_errors=True)
        print(f"[export] fsync-family calls: peer {fsyncs['peer'].get('calls')}, ckptd export "
              f"{fsyncs['ckptd_export'].get('calls')}", flush=True)
    return {"source_dir_bytes": src_bytes, "ref": ref, "import": imp, "repeats": repeats, "fsyncs": fsyncs}


# -- summary ----------------------------------------------------------------------------------------------

def _phase(rec: dict, key: str) -> float:
    """The slower rank's seconds in ``key`` (summed per rank)."""
    return max(p.get(key, 0.0) for p in rec["phases_by_rank"])


def with_export_efficiency(summary: dict, ceiling: dict) -> dict:
    """``summary`` plus the export's share of the disk's conversion ceiling (read it once, write it once:
    1/(1/R + 1/W), measured in the same run), as a whole process and in process."""
    gbps = summary["export_state_bytes"] / 1e9
    cap = ceiling["convert_ceiling_gbps"]
    summary["export_disk_efficiency"] = gbps / summary["ckptd_export_wall_s"] / cap
    summary["export_disk_efficiency_inproc"] = gbps / summary["ckptd_export_inproc_s"] / cap
    return summary


def summarise(writer: dict, export: dict, nbytes: int) -> dict:
    reps = writer["repeats"]
    gb = nbytes / 1e9
    out: dict[str, Any] = {"state_bytes": nbytes}
    for op in ("save", "load"):
        d = _med([r[f"dcp_{op}"]["s"] for r in reps])
        c = _med([r[f"ckptd_{op}"]["s"] for r in reps])
        out.update({f"dcp_{op}_s": d, f"ckptd_{op}_s": c, f"dcp_{op}_gbps": gb / d, f"ckptd_{op}_gbps": gb / c,
                    f"{op}_throughput_ratio": d / c,
                    f"{op}_throughput_ratio_per_repeat": [r[f"dcp_{op}"]["s"] / r[f"ckptd_{op}"]["s"] for r in reps]})
        for who in ("dcp", "ckptd"):
            for k in ("ranks_user_s", "ranks_sys_s", "server_user_s", "server_sys_s"):
                out[f"{who}_{op}_{k}"] = _med([r[f"{who}_{op}"][k] for r in reps])
    # where ckptd's save time goes (the slower rank's seconds, median over repeats)
    keys = ("ckptd_write_data", "open_session_call", "upload_files", "put_file_span", "pack_hash", "ckptd_finish",
            "put_index_call", "wait_committed", "dcp_write_data", "dcp_finish")
    out["save_phases_s"] = {k: _med([_phase(r[f"{'dcp' if k.startswith('dcp') else 'ckptd'}_save"], k) for r in reps])
                            for k in keys}
    out["save_phases_s"]["ckptd_snapshot_copy_approx"] = _med([
        _phase(r["ckptd_save"], "ckptd_write_data") - _phase(r["ckptd_save"], "upload_files")
        - _phase(r["ckptd_save"], "open_session_call") for r in reps])
    lkeys = ("ckptd_read_metadata", "ckptd_read_data", "fetch_verify", "copy_into", "read_plan", "get_range_span",
             "dcp_read_data")
    out["load_phases_s"] = {k: _med([_phase(r[f"{'dcp' if k.startswith('dcp') else 'ckptd'}_load"], k) for r in reps])
                            for k in lkeys}
    er = export["repeats"]
    peer = _med([r["peer"]["wall_s"] for r in er])
    peer_nofsync = _med([r["peer"]["wall_no_fsync_s"] for r in er])
    ck = _med([r["ckptd"]["wall_s"] for r in er])
    ck_nocheck = _med([r["ckptd_no_check"]["wall_s"] for r in er])
    fs = export["fsyncs"]
    ck_fsyncs = fs.get("ckptd_export", {}).get("total") if fs.get("probed") else None
    peer_fsyncs = fs.get("peer", {}).get("total") if fs.get("probed") else None
    # The peer gets its output fsync only when ckptd's export fsyncs too (unknown: the peer is not charged).
    peer_headline = peer if ck_fsyncs else peer_nofsync
    ck_peak = max(r["ckptd"]["peak_rss_bytes"] for r in er)
    peer_peak = max(r["peer"]["peak_rss_bytes"] for r in er)
    imp = export["import"]
    out.update({
        "export_state_bytes": er[0]["compare"]["bytes"],
        "peer_wall_s": peer, "peer_wall_no_fsync_s": peer_nofsync, "peer_headline_s": peer_headline,
        "peer_headline_includes_fsync": bool(ck_fsyncs),
        "ckptd_export_wall_s": ck, "ckptd_export_inproc_s": _med([r["ckptd"]["inproc_s"] for r in er]),
        "ckptd_export_no_check_wall_s": ck_nocheck,
        "export_ratio": peer_headline / ck, "export_ratio_no_check": peer_headline / ck_nocheck,
        "export_ratio_per_repeat": [(r["peer"]["wall_s"] if ck_fsyncs else r["peer"]["wall_no_fsync_s"])
                                    / r["ckptd"]["wall_s"] for r in er],
        "ckptd_import_wall_s": imp["wall_s"], "ckptd_import_peak_rss_bytes": imp["peak_rss_bytes"],
        "import_plus_export_ratio": peer_headline / (imp["wall_s"] + ck),
        "ckptd_export_peak_rss_bytes": ck_peak, "peer_peak_rss_bytes": peer_peak,
        "export_peak_rss_fraction": ck_peak / peer_peak,
        "ckptd_export_no_check_peak_rss_bytes": max(r["ckptd_no_check"]["peak_rss_bytes"] for r in er),
        "export_no_check_peak_rss_fraction": max(r["ckptd_no_check"]["peak_rss_bytes"] for r in er) / peer_peak,
        # ru_maxrss counts mapped file pages too (the export's read-back maps its output): the sampled split
        "sampled_peak_rss_anon_bytes": {w: max(r[w]["sampled_peak_rss_anon_bytes"] for r in er)
                                        for w in ("peer", "ckptd", "ckptd_no_check")},
        "sampled_peak_rss_file_bytes": {w: max(r[w]["sampled_peak_rss_file_bytes"] for r in er)
                                        for w in ("peer", "ckptd", "ckptd_no_check")},
        "peer_phases_s": {k: _med([r["peer"]["report"][k] for r in er]) for k in (
            "import_s", "dcp_to_torch_save_s", "torch_load_s", "save_file_s", "unlink_pt_s", "fsync_s")},
        "peer_hwm_bytes": {k: max(r["peer"]["report"][k] for r in er) for k in (
            "hwm_dcp_to_torch_save_bytes", "hwm_load_save_file_bytes")},
        "fsync_calls": {"peer": peer_fsyncs, "ckptd_export": ck_fsyncs},
        "outputs_equal": all(r["compare"]["equal"] for r in er),
    })
    out["goals_met"] = {
        "save: dcp.save(FileSystemWriter) time / dcp.save(ckptd writer) time >= 0.9":
            out["save_throughput_ratio"] >= GOALS["save_throughput_ratio"],
        "export: ckptd export faster than dcp_to_torch_save + save_file": out["export_ratio"] > 1.0,
        f"export: peak RSS (ru_maxrss) <= {GOALS['export_peak_rss_fraction_max']} x the peer's":
            out["export_peak_rss_fraction"] <= GOALS["export_peak_rss_fraction_max"],
    }
    anon = out["sampled_peak_rss_anon_bytes"]
    out["export_peak_rss_anon_fraction"] = anon["ckptd"] / anon["peer"] if anon["peer"] else float("nan")
    return out


def markdown(res: dict) -> str:
    s, cfg = res["summary"], res["config"]
    pp = s["peer_phases_s"]
    lines = [
        f"{s['state_bytes'] / GiB:.3f} GiB fp32 state ({cfg['tensors']} tensors) on {cfg['world']} gloo ranks; "
        f"median of {cfg['repeat']} repeat(s), page cache evicted before each operation:", "",
        "| measure | ckptd | DCP / peer | ratio (DCP / ckptd) | goal |", "| --- | --- | --- | --- | --- |",
        f"| `dcp.save` through `client.dcp_writer` (committed) vs `FileSystemWriter` | {s['ckptd_save_s']:.2f} s = "
        f"{s['ckptd_save_gbps']:.2f} GB/s | {s['dcp_save_s']:.2f} s = {s['dcp_save_gbps']:.2f} GB/s | "
        f"{s['save_throughput_ratio']:.2f} | >= 0.9 |",
        f"| `dcp.load` through `client.dcp_reader` vs `FileSystemReader`, cold, world {cfg['world']} | "
        f"{s['ckptd_load_s']:.2f} s = {s['ckptd_load_gbps']:.2f} GB/s | {s['dcp_load_s']:.2f} s = "
        f"{s['dcp_load_gbps']:.2f} GB/s | {s['load_throughput_ratio']:.2f} | (information) |",
        f"| safetensors: `ckptd export` (checked) vs `dcp_to_torch_save` + `torch.load` + `save_file`"
        f"{' + fsync' if s['peer_headline_includes_fsync'] else ''} | {s['ckptd_export_wall_s']:.2f} s | "
        f"{s['peer_headline_s']:.2f} s | {s['export_ratio']:.2f} | > 1 |",
        f"| same, `ckptd export --no-check` | {s['ckptd_export_no_check_wall_s']:.2f} s | {s['peer_headline_s']:.2f} s"
        f" | {s['export_ratio_no_check']:.2f} | |",
        f"| same, `ckptd import dcp` + `ckptd export` | {s['ckptd_import_wall_s'] + s['ckptd_export_wall_s']:.2f} s | "
        f"{s['peer_headline_s']:.2f} s | {s['import_plus_export_ratio']:.2f} | |",
        "",
        f"Peak RSS: ckptd export {s['ckptd_export_peak_rss_bytes'] / MiB:.0f} MiB, peer "
        f"{s['peer_peak_rss_bytes'] / MiB:.0f} MiB (fraction {s['export_peak_rss_fraction']:.2f}); --no-check "
        f"{s['ckptd_export_no_check_peak_rss_bytes'] / MiB:.0f} MiB ({s['export_no_check_peak_rss_fraction']:.2f}); "
        f"ckptd import {s['ckptd_import_peak_rss_bytes'] / MiB:.0f} MiB. Sampled peak anonymous / file-backed RSS: "
        + ", ".join(f"{w} {s['sampled_peak_rss_anon_bytes'][w] / MiB:.0f} / "
                    f"{s['sampled_peak_rss_file_bytes'][w] / MiB:.0f} MiB"
                    for w in ("peer", "ckptd", "ckptd_no_check")),
        "Peer phases (s): " + ", ".join(f"{k} {v:.2f}" for k, v in pp.items()),
        f"fsync-family calls (strace): {s['fsync_calls']}",
        "ckptd save phases (s, slower rank): " + ", ".join(f"{k} {v:.3f}" for k, v in s["save_phases_s"].items()),
        f"CPU s per save (all ranks; server): DCP {s['dcp_save_ranks_user_s']:.2f}+{s['dcp_save_ranks_sys_s']:.2f}; "
        f"ckptd ranks {s['ckptd_save_ranks_user_s']:.2f}+{s['ckptd_save_ranks_sys_s']:.2f}, server "
        f"{s['ckptd_save_server_user_s']:.2f}+{s['ckptd_save_server_sys_s']:.2f}",
        "", "goals: " + "; ".join(f"{k}: {'met' if v else 'NOT met'}" for k, v in s["goals_met"].items()),
    ]
    return "\n".join(lines)


def _merge_rank_records(records: list[dict]) -> dict:
    """Rank 0's record; per op, every rank's phases under ``phases_by_rank``."""
    base = records[0]["result"]
    for i, rep in enumerate(base["repeats"]):
        for op in ("dcp_save", "ckptd_save", "dcp_load", "ckptd_load"):
            rep[op]["phases_by_rank"] = [rec["result"]["repeats"][i][op]["phases"] for rec in records]
            rep[op]["own_s_by_rank"] = [rec["result"]["repeats"][i][op]["own_s"] for rec in records]
            rep[op].pop("phases", None)
            rep[op].pop("own_s", None)
    return base


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gib", type=float, default=1.0, help="state size (GiB): the saves and the export")
    ap.add_argument("--repeat", type=int, default=3, help="runs of each operation (median)")
    ap.add_argument("--world", type=int, default=4, help="gloo ranks that save and load")
    ap.add_argument("--no-fsync-probe", action="store_true", help="skip the strace runs that count fsyncs")
    ap.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "dcp_io.json")
    add_workdir_args(ap, "parent of the temporary work dir (server root, DCP dirs, exports: one disk); default $TMPDIR")
    args = ap.parse_args(argv)
    with work_dir("ckptd-bench-dcpio-", args.workdir, args.keep) as work:
        t_start = time.perf_counter()
        server: ServerProcess | None = None
        try:
            specs = tensor_specs(args.gib)
            nbytes = state_bytes(specs)
            machine = describe_machine(work)
            free = shutil.disk_usage(work).free
            need = (2 * args.repeat + 5) * nbytes + GiB // 4
            if free < need:
                raise SystemExit(f"{work}: {free / GiB:.1f} GiB free, this run needs about {need / GiB:.1f}")
            print(f"work dir {work}; {nbytes / GiB:.3f} GiB in {len(specs)} tensors; world {args.world}; load average "
                  f"{machine['loadavg_at_start']}", flush=True)
            ceiling = disk_ceiling(work, min(nbytes, GiB))
            print("disk ceiling", json.dumps({k: round(v, 3) for k, v in ceiling.items()}), flush=True)
            dcp_dir, root = work / "dcp", work / "ckptd-root"
            dcp_dir.mkdir()
            server = ServerProcess(root, log=work / "server.log").start()
            timeout = 300 + 150 * nbytes / GiB
            cfg = {"specs": specs, "repeat": args.repeat, "url": server.url, "server_pid": server.proc.pid,
                   "dcp_dir": str(dcp_dir), "evict": [str(dcp_dir), str(root)]}
            idle = vm_status(server.proc.pid)
            records = run_ranks(writer_job, args.world, cfg, tmp=work, timeout=timeout * args.repeat)
            server_rss = {"idle": idle, "end": vm_status(server.proc.pid)}
            writer = _merge_rank_records(records)
            for r, rep in enumerate(writer["repeats"]):
                print(f"[writer] repeat {r} ({'/'.join(rep['order'])}): save DCP {rep['dcp_save']['s']:.2f}s, ckptd "
                      f"{rep['ckptd_save']['s']:.2f}s; load DCP {rep['dcp_load']['s']:.2f}s, ckptd "
                      f"{rep['ckptd_load']['s']:.2f}s", flush=True)
            server.stop()
            same_disk = len({os.stat(p).st_dev for p in (dcp_dir, root, work)}) == 1
            export = export_part(work, dcp_dir / f"r{args.repeat - 1}", specs, args.repeat, timeout,
                                 fsync_probe=not args.no_fsync_probe)
            result = {
                "command": "python -m bench.dcp_io " + " ".join(argv),
                "config": {"gib": args.gib, "state_bytes": nbytes, "repeat": args.repeat, "world": args.world,
                           "tensors": len(specs), "largest_tensor_bytes": max(r * c * 4 for _, _, r, c in specs),
                           "specs": specs, "same_filesystem": same_disk, "workdir": str(work),
                           "dcp_writer": "dcp.save(sd, storage_writer=FileSystemWriter(dir)) defaults: "
                                         "sync_files=True, thread_count=1, single_file_per_rank=True",
                           "ckptd_writer": "dcp.save(sd, storage_writer=CheckpointClient(url).dcp_writer(ref)) "
                                           "defaults (streams=4, file_bytes=256 MiB, no compression); real "
                                           "`ckptd serve`, LocalStorage durable (fsync)",
                           "peer_export": "one subprocess: dcp_to_torch_save(dir, tmp.pt); torch.load(tmp.pt); flatten "
                                          "to dotted names; safetensors.torch.save_file; unlink tmp.pt; fsync (timed "
                                          "apart)",
                           "ckptd_export": "subprocess `python -m ckptd.cli.main export REF --format safetensors OUT "
                                           "--root R --json` (default: read back and checked); import done before, "
                                           "timed apart"},
                "goals": GOALS, "machine": machine, "ceiling": ceiling,
                "summary": with_export_efficiency(summarise(writer, export, nbytes), ceiling),
                "writer": writer, "export": export, "server_rss": server_rss,
                "wall_s": time.perf_counter() - t_start, "loadavg_at_end": os.getloadavg(),
            }
            write_report(args.out, result, markdown(result))
            return 0
        finally:
            if server is not None:
                server.stop()


if __name__ == "__main__":
    sys.exit(main())
