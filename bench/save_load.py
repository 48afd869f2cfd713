"""ckptd against torch.distributed.checkpoint (DCP), side by side, in one run on one disk.

    .venv/bin/python -m bench.save_load --mib 512 --repeat 3 --out bench/results/save_load.json

What one run does (see BENCHMARKS.md for the results and how to read them):

1. Machine baselines in this process: durable disk writes (two writers, write +
   fsync, the ceiling for both systems; measured again at the end, the better
   of the two bounds every save ratio), XXH3 and memcpy speed.
2. Starts real ``ckptd serve`` processes (tests/support.py ``ServerProcess``)
   whose roots sit, with the DCP directory, in one work directory (one disk):
   the main server, and one more per ``--rss-mib`` size that only ever sees a
   state of that size (one save, one load), so that the servers' peak RSS
   (``VmHWM``) can be compared across shard sizes. Each server is restarted
   (same root and port) between the saves and the loads, so the load peak is
   that of a fresh process.
3. Two gloo ranks hold ``--mib`` MiB of fp32 state in total: 8 DTensors,
   ``Shard(0)``, with uneven row counts. Per repeat, between barriers, they run
   ``dcp.save`` (``FileSystemWriter`` defaults: ``sync_files=True``, one thread
   per rank) and ``CheckpointClient.save`` to a fresh ref, timing ``save()``'s
   return (the training stall) and ``handle.wait()`` (committed: every byte
   through the service, which hashes it as it stores it). A third entry writes the same shard bytes with ``write`` + ``fsync`` and
   nothing else: the floor under any durable save at that moment (this VM's
   disk swings between about 0.6 and 2 GB/s). The order of the three rotates
   between repeats, and each starts after an ``os.sync()`` and ``--settle``
   seconds of quiet: on this VM a save that follows DCP's at once runs up to
   2x slower, and the rotation keeps the same one after DCP. Internal client steps are timed from the
   outside by wrapping functions (no code in the client knows about this).
4. Three gloo ranks (another world size) load every repeat's checkpoint into
   DTensors on a 3-mesh with ``dcp.load`` and ``CheckpointClient.load``, the
   latter twice: with direct reads (the default: the ranks share the service's
   host) and with ``direct_reads=False`` (every byte through HTTP). The same
   ranks also read ckptd's files a third each with ``preadv`` and nothing else
   (``raw_read``: the disk's floor under any load). First cold (pages of both
   checkpoints evicted with ``posix_fadvise(DONTNEED)`` before each load), then
   warm; the four ways rotate who goes first. Every result is checked bit for
   bit against the values saved.
5. A replicated state (plain tensors, a quarter of the size) that every rank
   loads whole, over HTTP and cold: once with ``share_replicas`` (one rank of
   the host fetches each tensor and sends it to the others) and once without;
   bytes fetched from the service, time and the service's CPU.

Throughput is the global state size divided by wall time between barriers.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import xxhash
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard

from bench._disk import evict, read_span  # noqa: E402
from bench._report import add_workdir_args, work_dir, write_report  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
if str(REPO / "tests") not in sys.path:
    sys.path.insert(0, str(REPO / "tests"))

from support import ServerProcess, run_ranks  # noqa: E402  (tests/support.py)

MiB = 1 << 20
COLS = 1024                                  # fp32 columns: 4 KiB per row
WEIGHTS = (23, 5, 17, 3, 13, 7, 19, 11)      # relative sizes of the 8 tensors (uneven on purpose)
GOALS = {"save_throughput_ratio": 1.5, "stall_ratio": 0.1, "stall_vs_async_ratio": 1.0, "load_throughput_ratio": 1.5}
#: The service's CPU per GiB it commits, at the floor of its HTTP stack, how close a save's stall and a cold
#: load come to this machine's floors, and a save and a cold load against DCP's (BENCHMARKS.md, Save and load).
FLOOR_GOALS = {"server_cpu_s_per_gib_saved": ("<=", 1.0), "stall_vs_copy_floor": ("<=", 1.1),
               "ckptd_cold_load_vs_raw": (">=", 0.9), "save_throughput_ratio": (">=", 1.0),
               "load_cold_throughput_ratio": (">=", 1.0)}


# -- the state ------------------------------------------------------------------------------------

def tensor_specs(mib: float) -> list[tuple[str, int, int]]:
    """8 (name, rows, cols) with odd row counts (uneven over 2 and 3 ranks) summing to about ``mib``."""
    total_rows = max(int(mib * MiB) // (4 * COLS), 8 * 3)
    rows = [max(total_rows * w // sum(WEIGHTS), 3) for w in WEIGHTS]
    rows = [r if r % 2 else r - 1 for r in rows]
    rows[0] += total_rows - sum(rows)  # the remainder, kept odd
    if rows[0] % 2 == 0:
        rows[0] -= 1
    return [(f"layers.{i}.weight", r, COLS) for i, r in enumerate(rows)]


def _pattern(index: int, row0: int, rows: int, cols: int) -> torch.Tensor:
    """Deterministic values of rows [row0, row0+rows) of tensor ``index``, whatever the world size."""
    idx = torch.arange(row0 * cols, (row0 + rows) * cols, dtype=torch.int64)
    idx.mul_(2654435761).add_(97 * index + 1).remainder_(16777213)
    return idx.to(torch.float32).reshape(rows, cols)


def make_state(specs: list[tuple[str, int, int]], mesh: Any, *, fill: bool) -> dict:
    """``{"model": {name: DTensor}}`` sharded Shard(0) on ``mesh``; values from ``_pattern`` or NaN."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    model = {}
    for i, (name, rows, cols) in enumerate(specs):
        local_shape, offsets = compute_local_shape_and_global_offset((rows, cols), mesh, [Shard(0)])
        if fill:
            local = _pattern(i, offsets[0], local_shape[0], cols)
        else:
            local = torch.full(tuple(local_shape), float("nan"))
        model[name] = DTensor.from_local(local, mesh, [Shard(0)], run_check=False,
                                         shape=torch.Size((rows, cols)), stride=(cols, 1))
    return {"model": model}


def copy_floor(sd: dict, buf: torch.Tensor) -> float:
    """The floor under any save's stall: seconds to copy this rank's shards into ``buf`` (allocated and
    pre-faulted once, as the snapshot pool is), with ``copy_``, nothing else (no flattening, no metadata)."""
    t0 = time.perf_counter()
    pos = 0
    for t in sd["model"].values():
        local = t.to_local()
        n = local.numel() * local.element_size()
        buf[pos:pos + n].view(local.dtype).view(local.shape).copy_(local)
        pos += -(-n // 64) * 64
    return time.perf_counter() - t0


def _shard_bytes(sd: dict) -> int:
    return sum(-(-t.to_local().numel() * t.to_local().element_size() // 64) * 64 for t in sd["model"].values())


def raw_write(sd: dict, path: str) -> None:
    """The floor under any durable save of this rank's shards: their bytes, ``write`` + ``fsync``,
    one file, nothing else (no format, no hashing, no metadata)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        for t in sd["model"].values():
            view = memoryview(t.to_local().contiguous().view(torch.uint8).numpy())
            for i in range(0, len(view), 8 * MiB):
                piece = view[i:i + 8 * MiB]
                while piece:
                    piece = piece[os.write(fd, piece):]
        os.fsync(fd)
    finally:
        os.close(fd)


def raw_read(root: Path, rank: int, world: int) -> int:
    """The floor under any load of these files by ``world`` ranks: this rank's share of their bytes
    (the ``rank``-th of ``world`` equal spans of the files laid end to end), ``preadv`` into one reused
    buffer, nothing else (no plan, no digests, no copy into tensors). Returns the bytes read."""
    files = sorted(p for p in root.rglob("*") if p.is_file() and p.parent.name == "files")
    sizes = [p.stat().st_size for p in files]
    total = sum(sizes)
    lo, hi = rank * total // world, (rank + 1) * total // world
    buf = memoryview(bytearray(8 * MiB))
    at, got = 0, 0
    for path, size in zip(files, sizes):
        a, b = max(lo, at) - at, min(hi, at + size) - at
        at += size
        if a >= b:
            continue
        got += read_span(path, a, b, buf)
    return got


def replicated_state(specs: list[tuple[str, int, int]], *, fill: bool) -> dict:
    """``{"repl": {name: tensor}}``: plain (DDP-replicated) tensors every rank holds whole."""
    return {"repl": {name: _pattern(100 + i, 0, rows, cols) if fill else torch.full((rows, cols), float("nan"))
                     for i, (name, rows, cols) in enumerate(specs)}}


def state_bytes(specs: list[tuple[str, int, int]]) -> int:
    return sum(r * c * 4 for _, r, c in specs)


# -- outside instrumentation ------------------------------------------------------------------------

def _kind(method: str, path: str) -> str:
    if method == "POST" and path.endswith("/sessions"):
        return "open_session"
    if method == "PUT" and "/files/" in path:
        return "put_file"
    if method == "PUT" and "/ranks/" in path:
        return "put_index"
    if method == "GET" and "/sessions/" in path:
        return "poll"
    if method == "POST" and path.endswith("/read-plan"):
        return "read_plan"
    if method == "GET" and "/files/" in path:
        return "get_range"
    if method == "GET":
        return "manifest"
    return f"{method} other"


class Probe:
    """Times ckptd_client internals by wrapping them; missing names are skipped (the bench must not rot)."""

    def __init__(self) -> None:
        self.events: list[tuple[str, float, float]] = []
        import ckptd_client._load as cl
        import ckptd_client._save as cs
        import ckptd_client.client as cc
        from ckptd_client.transport import Transport

        import ckptd_client._handover as ch

        for mod, name, kind in ((cc, "build_snapshot", "snapshot"), (cc, "upload_snapshot", "upload_total"),
                                (getattr(ch, "LocalHandover", None), "put", "put_file"),  # a file handed over
                                (getattr(cl, "HttpRanges", None), "read", "fetch_verify"),
                                (cl, "execute", "fetch_copy_total")):
            if hasattr(mod, name):
                setattr(mod, name, self._timed(getattr(mod, name), kind))
        # generators, timed from their first step to their last: the packing of a save's files (its end:
        # the last file hashed) and the body of a file PUT (its end: the last byte handed to httpx)
        for name, kind in (("_pack", "pack_hash"), ("_stream", "body_sent")):
            if hasattr(cs, name):
                setattr(cs, name, self._timed_generator(getattr(cs, name), kind))
        if hasattr(Transport, "request"):
            orig = Transport.request
            events = self.events

            @functools.wraps(orig)
            def request(tr: Any, method: str, path: str, *a: Any, **kw: Any) -> Any:
                t0 = time.perf_counter()
                try:
                    return orig(tr, method, path, *a, **kw)
                finally:
                    events.append((_kind(method, path), t0, time.perf_counter()))

            Transport.request = request

    def _timed(self, fn: Callable, kind: str) -> Callable:
        events = self.events

        @functools.wraps(fn)
        def wrapper(*a: Any, **kw: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                events.append((kind, t0, time.perf_counter()))

        return wrapper

    def _timed_generator(self, fn: Callable, kind: str) -> Callable:
        events = self.events

        @functools.wraps(fn)
        def wrapper(*a: Any, **kw: Any) -> Any:
            t0 = time.perf_counter()
            yield from fn(*a, **kw)
            events.append((kind, t0, time.perf_counter()))

        return wrapper

    def take(self, t_start: float) -> dict[str, float]:
        """Durations by kind since ``t_start``: ``<kind>`` = summed seconds, ``<kind>_span`` = first start..last end."""
        evs, self.events[:] = list(self.events), []
        out: dict[str, float] = {}
        kinds: dict[str, list[tuple[float, float]]] = {}
        for k, a, b in evs:
            if a >= t_start:
                kinds.setdefault(k, []).append((a, b))
        for k, spans in kinds.items():
            out[k] = sum(b - a for a, b in spans)
            out[f"{k}_span"] = max(b for _, b in spans) - min(a for a, _ in spans)
            out[f"{k}_n"] = len(spans)
            out[f"{k}_end"] = max(b for _, b in spans) - t_start
        return out


def _proc_cpu(pid: int) -> tuple[float, float]:
    """(user, system) CPU seconds of a process, all its threads, from /proc."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    tick = os.sysconf("SC_CLK_TCK")
    return int(fields[11]) / tick, int(fields[12]) / tick


def _own_cpu() -> tuple[float, float]:
    t = os.times()
    return t.user, t.system


def _max_over_ranks(values: list[float]) -> list[float]:
    t = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def _sum_over_ranks(values: list[float]) -> list[float]:
    t = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t.tolist()


# -- rank jobs (spawned; module-level so they pickle) ------------------------------------------------

def save_job(rank: int, world: int, cfg: dict) -> dict:
    from ckptd_client import CheckpointClient

    probe = Probe()
    mesh = init_device_mesh("cpu", (world,))
    sd = make_state(cfg["specs"], mesh, fill=True)
    # Every repeat saves the same bytes: incremental saves would link all of them from the previous
    # repeat, so they are off here (bench.incremental measures them); these are full saves.
    client = CheckpointClient(cfg["url"], snapshot_bytes=cfg.get("snapshot_bytes"),
                              incremental=False)
    floor_buf = torch.zeros(_shard_bytes(sd), dtype=torch.uint8)  # zeroed: every page faulted in now
    variants = ("dcp", "ckptd", "raw")
    repeats = []
    for r in range(cfg["repeat"]):
        order = variants[r % 3:] + variants[:r % 3]
        rec: dict[str, Any] = {"order": list(order)}
        for which in order:
            # Let the previous save's after-effects settle first (write-back at the host, memory it
            # freed): on this VM a save that starts right after another is up to 2x slower, and in a
            # fixed rotation the same variant would always be the one that follows DCP.
            if rank == 0:
                os.sync()
            time.sleep(cfg.get("settle_s", 0.0))
            dist.barrier()
            if which == "ckptd":  # the copy floor under its stall, both ranks at once, just before it
                rec["copy_floor_s"] = _max_over_ranks([copy_floor(sd, floor_buf)])[0]
                dist.barrier()
            cpu0 = _own_cpu()
            srv0 = _proc_cpu(cfg["server_pid"]) if rank == 0 else (0.0, 0.0)
            t0 = time.perf_counter()
            if which == "dcp":
                dcp.save(sd, checkpoint_id=os.path.join(cfg["dcp_dir"], f"r{r}"))
                dist.barrier()
                t_total = time.perf_counter() - t0
                cpu = [b - a for a, b in zip(cpu0, _own_cpu())]
                vals = _max_over_ranks([t_total, *cpu])
                rec["dcp_save_s"], rec["dcp_rank_user_s"], rec["dcp_rank_sys_s"] = vals
                rec["dcp_rank_cpu_s"] = vals[1] + vals[2]
                # dcp.async_save: how long it blocks the caller (its staging copy), then let it finish
                dist.barrier()
                t0 = time.perf_counter()
                fut = dcp.async_save(sd, checkpoint_id=os.path.join(cfg["dcp_dir"], f"a{r}"))
                t_block = time.perf_counter() - t0
                fut.result()
                dist.barrier()
                rec["dcp_async_block_s"] = _max_over_ranks([t_block])[0]
            elif which == "raw":
                path = os.path.join(cfg["dcp_dir"], f"raw-{r}-{rank}.bin")
                raw_write(sd, path)
                dist.barrier()
                rec["raw_write_s"] = _max_over_ranks([time.perf_counter() - t0])[0]
                os.unlink(path)
            else:
                handle = client.save(sd, f"bench/{r}")
                t_stall = time.perf_counter() - t0
                handle.wait()
                t_own = time.perf_counter() - t0
                dist.barrier()
                t_total = time.perf_counter() - t0
                cpu = [b - a for a, b in zip(cpu0, _own_cpu())]
                srv = [b - a for a, b in zip(srv0, _proc_cpu(cfg["server_pid"]))] if rank == 0 else [0.0, 0.0]
                phases = probe.take(t0)
                vals = _max_over_ranks([t_stall, t_total, *cpu, *srv])
                w = which
                (rec[f"{w}_stall_s"], rec[f"{w}_committed_s"], rec[f"{w}_rank_user_s"], rec[f"{w}_rank_sys_s"],
                 rec[f"{w}_server_user_s"], rec[f"{w}_server_sys_s"]) = vals
                rec[f"{w}_rank_cpu_s"] = vals[2] + vals[3]
                rec[f"{w}_server_cpu_s"] = vals[4] + vals[5]
                rec[f"{w}_phases"] = {**phases, "stall": t_stall, "own_wait_return": t_own}
        repeats.append(rec)
    client.save(replicated_state(cfg["repl_specs"], fill=True), "bench/repl").wait()  # written once
    client.close()
    del sd
    # One save of another size to a server that only ever sees that size (its peak RSS vs shard size).
    extra_s = {}
    for ex in cfg["extra"]:
        dist.barrier()
        other = make_state(ex["specs"], mesh, fill=True)
        other_client = CheckpointClient(ex["url"])
        t0 = time.perf_counter()
        other_client.save(other, "bench/other").wait()
        dist.barrier()
        extra_s[ex["key"]] = time.perf_counter() - t0
        other_client.close()
        del other
    return {"repeats": repeats, "extra_committed_s": extra_s}


def load_job(rank: int, world: int, cfg: dict) -> dict:
    from ckptd_client import CheckpointClient

    probe = Probe()
    mesh = init_device_mesh("cpu", (world,))
    expected = make_state(cfg["specs"], mesh, fill=True)["model"]
    into_dcp = make_state(cfg["specs"], mesh, fill=False)
    into_ckptd = make_state(cfg["specs"], mesh, fill=False)
    client = CheckpointClient(cfg["url"])  # direct reads: the service's files are on this host
    http_client = CheckpointClient(cfg["url"], direct_reads=False)  # every byte through the service

    def check(sd: dict, what: str) -> None:
        for name, want in expected.items():
            got = sd["model"][name].to_local()
            assert torch.equal(got, want.to_local()), f"{what}: {name} differs on rank {rank}"

    def reset(sd: dict) -> None:
        for t in sd["model"].values():
            t.to_local().fill_(float("nan"))

    repeats = []
    ways = ("dcp", "ckptd", "ckptd_http", "raw")  # raw: the read floor, ckptd's files read and nothing else
    for r in range(cfg["repeat"]):
        rec: dict[str, Any] = {}
        for cache in ("cold", "warm"):
            order = ways[r % 4:] + ways[:r % 4]  # rotate who goes first
            for which in order:
                if cache == "cold":  # before each load its own files (ckptd's two ways read the same ones),
                    if rank == 0:  # so that every file is cached again when the warm loads start
                        own = (Path(cfg["dcp_dir"]) / f"r{r}" if which == "dcp"
                               else Path(cfg["root"]) / "runs" / "bench" / str(r))
                        rec[f"evicted_bytes_{which}"] = evict([own])
                    dist.barrier()
                if which != "raw":  # the floor fills no tensors
                    reset(into_dcp if which == "dcp" else into_ckptd)
                dist.barrier()
                cpu0 = _own_cpu()
                srv0 = _proc_cpu(cfg["server_pid"]) if rank == 0 else (0.0, 0.0)
                t0 = time.perf_counter()
                if which == "dcp":
                    dcp.load(into_dcp, checkpoint_id=os.path.join(cfg["dcp_dir"], f"r{r}"))
                elif which == "raw":
                    raw_n = raw_read(Path(cfg["root"]) / "runs" / "bench" / str(r), rank, world)
                else:
                    rep = (client if which == "ckptd" else http_client).load(into_ckptd, f"bench/{r}")
                    rec[f"{which}_{cache}_direct_fraction"] = rep.bytes_read_direct / max(1, rep.bytes_read)
                dist.barrier()
                t = time.perf_counter() - t0
                cpu = sum(b - a for a, b in zip(cpu0, _own_cpu()))
                srv = sum(b - a for a, b in zip(srv0, _proc_cpu(cfg["server_pid"]))) if rank == 0 else 0.0
                if which not in ("dcp", "raw"):
                    rec[f"{which}_{cache}_phases"] = probe.take(t0)
                cpu_sum, srv = _sum_over_ranks([cpu, srv])
                rec[f"{which}_{cache}_load_s"] = _max_over_ranks([t])[0]
                rec[f"{which}_{cache}_load_ranks_cpu_s"] = cpu_sum
                if which == "raw":
                    rec[f"raw_{cache}_bytes"] = _sum_over_ranks([float(raw_n)])[0]
                    continue
                if which != "dcp":
                    rec[f"{which}_{cache}_load_server_cpu_s"] = srv
                    check(into_ckptd, f"{which} load repeat {r} ({cache})")
            check(into_dcp, f"dcp.load repeat {r} ({cache})")
            for name in expected:  # the loads agree bit for bit
                assert torch.equal(into_dcp["model"][name].to_local(), into_ckptd["model"][name].to_local())
        repeats.append(rec)
    client.close()
    http_client.close()
    repl = _replicated_loads(rank, cfg)
    expected.clear()  # free the main state before the other sizes
    del into_dcp, into_ckptd
    for ex in cfg["extra"]:
        want = make_state(ex["specs"], mesh, fill=True)["model"]
        got = make_state(ex["specs"], mesh, fill=False)
        other_client = CheckpointClient(ex["url"])
        other_client.load(got, "bench/other")
        for name, w in want.items():
            assert torch.equal(got["model"][name].to_local(), w.to_local()), f"{ex['key']}: {name} differs"
        other_client.close()
        del want, got
    return {"repeats": repeats, "replicated": repl}


def _replicated_loads(rank: int, cfg: dict) -> dict:
    """Every rank loads the same plain tensors over HTTP (as from a remote store), cold: once with
    ``share_replicas`` (one rank of the host fetches each, then sends it) and once without."""
    from ckptd_client import CheckpointClient

    want = replicated_state(cfg["repl_specs"], fill=True)["repl"]
    out: dict[str, dict] = {}
    for share in (True, False):
        got = replicated_state(cfg["repl_specs"], fill=False)
        if rank == 0:
            evict([Path(cfg["root"]) / "runs" / "bench" / "repl"])
        with CheckpointClient(cfg["url"], direct_reads=False, share_replicas=share) as c:
            dist.barrier()
            srv0 = _proc_cpu(cfg["server_pid"]) if rank == 0 else (0.0, 0.0)
            t0 = time.perf_counter()
            rep = c.load(got, "bench/repl")
            dist.barrier()
            t = time.perf_counter() - t0
        srv = sum(b - a for a, b in zip(srv0, _proc_cpu(cfg["server_pid"]))) if rank == 0 else 0.0
        for name, w in want.items():
            assert torch.equal(got["repl"][name], w), f"replicated {name} differs on rank {rank} (share={share})"
        fetched, shared_in, srv = _sum_over_ranks([rep.bytes_read, rep.bytes_shared_in, srv])
        out["shared" if share else "each_rank"] = {"load_s": _max_over_ranks([t])[0], "bytes_fetched": fetched,
                                                   "bytes_shared_in": shared_in, "server_cpu_s": srv}
    return out


# -- machine and micro-baselines ----------------------------------------------------------------------

def _cmd(args: list[str]) -> str:
    try:
        return subprocess.run(args, capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def describe_machine(work: Path) -> dict:
    mem_kib = 0
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemTotal:"):
                mem_kib = int(line.split()[1])
    cpu = ""
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    df = _cmd(["df", "-hT", str(work)]).splitlines()
    dev = df[-1].split()[0] if df else ""
    rotational = ""
    name = os.path.basename(dev)
    if name and os.path.exists(f"/sys/block/{name}/queue/rotational"):
        rotational = Path(f"/sys/block/{name}/queue/rotational").read_text().strip()
    import importlib.metadata as md

    def ver(p: str) -> str | None:
        try:
            return md.version(p)
        except md.PackageNotFoundError:
            return None

    return {
        "nproc": os.cpu_count(), "cpu": cpu, "mem_gib": round(mem_kib / 2**20, 1),
        "disk": df[-1] if df else "", "disk_rotational": rotational, "kernel": platform.release(),
        "python": platform.python_version(),
        "versions": {p: ver(p) for p in ("torch", "fastapi", "uvicorn", "uvloop", "httptools", "httpx",
                                         "xxhash", "starlette")},
        "loadavg_at_start": os.getloadavg(),
    }


def micro_baselines(work: Path, total_bytes: int) -> dict:
    """Durable disk write (2 writers, like 2 ranks), XXH3 and memcpy speed, on this machine, now."""
    piece = os.urandom(8 * MiB)
    per = total_bytes // 2

    def writer(path: Path) -> None:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            left = per
            while left > 0:
                left -= os.write(fd, piece[:min(left, len(piece))])
            os.fsync(fd)
        finally:
            os.close(fd)

    paths = [work / f"disk-baseline-{i}.bin" for i in range(2)]
    t0 = time.perf_counter()
    threads = [threading.Thread(target=writer, args=(p,)) for p in paths]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    disk_s = time.perf_counter() - t0
    for p in paths:
        p.unlink()
    buf = torch.randint(0, 255, (64 * MiB,), dtype=torch.uint8)
    mv = memoryview(buf.numpy())
    t0 = time.perf_counter()
    for _ in range(4):
        xxhash.xxh3_64_hexdigest(mv)
    xxh_s = (time.perf_counter() - t0) / 4
    t0 = time.perf_counter()
    for _ in range(4):
        torch.empty_like(buf).copy_(buf)
    fresh_s = (time.perf_counter() - t0) / 4
    dst = torch.empty_like(buf)
    dst.copy_(buf)
    t0 = time.perf_counter()
    for _ in range(4):
        dst.copy_(buf)
    reuse_s = (time.perf_counter() - t0) / 4
    return {"disk_durable_write_2_writers_gbps": total_bytes / disk_s / 1e9,
            "xxh3_gbps": 64 * MiB / xxh_s / 1e9,
            "memcpy_fresh_alloc_gbps": 64 * MiB / fresh_s / 1e9,
            "memcpy_reused_gbps": 64 * MiB / reuse_s / 1e9}


def vm_status(pid: int) -> dict[str, int]:
    out = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            k, _, v = line.partition(":")
            if k in ("VmHWM", "VmRSS"):
                out[k] = int(v.split()[0]) * 1024
    return out


def _upload_streams(root: str, streams: int = 4) -> dict:
    """Data files per rank of one checkpoint under ``root``, and the concurrent uploads that makes
    (each rank sends up to ``streams`` files at once: CheckpointClient's default)."""
    sess = sorted(Path(root).glob("runs/bench/*/sessions/*/files"))
    per_rank: dict[str, int] = {}
    if sess:
        for f in sess[0].iterdir():
            if f.name.startswith("r") and f.name.endswith(".bin"):
                r = f.name.split("-")[0]
                per_rank[r] = per_rank.get(r, 0) + 1
    return {"files_per_rank": sorted(per_rank.values()),
            "concurrent_uploads": sum(min(streams, n) for n in per_rank.values())}


# -- summary ------------------------------------------------------------------------------------------

def _med(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def summarise(save: dict, load: dict, nbytes: int) -> dict:
    sr, lr = save["repeats"], load["repeats"]
    gb = nbytes / 1e9
    dcp_save = _med([r["dcp_save_s"] for r in sr])
    stall = _med([r["ckptd_stall_s"] for r in sr])
    committed = _med([r["ckptd_committed_s"] for r in sr])
    out: dict[str, Any] = {
        "dcp_save_s": dcp_save, "ckptd_stall_s": stall, "ckptd_committed_s": committed,
        "ckptd_stall_worst_s": max(r["ckptd_stall_s"] for r in sr),
        "ckptd_committed_worst_s": max(r["ckptd_committed_s"] for r in sr),
        "dcp_save_worst_s": max(r["dcp_save_s"] for r in sr),
        "dcp_save_gbps": gb / dcp_save, "ckptd_committed_gbps": gb / committed,
        "save_throughput_ratio": dcp_save / committed, "stall_ratio": stall / dcp_save,
        # the same bytes written and fsynced by the same 2 ranks, nothing else, in the same rotation
        "raw_write_s": _med([r["raw_write_s"] for r in sr]),
        "ckptd_save_vs_raw": _med([r["raw_write_s"] / r["ckptd_committed_s"] for r in sr]),
        "dcp_save_vs_raw": _med([r["raw_write_s"] / r["dcp_save_s"] for r in sr]),
        "dcp_async_block_s": _med([r["dcp_async_block_s"] for r in sr]),
        # both ranks copying their shards into pre-faulted memory at once, nothing else: the stall's floor
        "copy_floor_s": _med([r["copy_floor_s"] for r in sr]),
        "stall_vs_copy_floor": _med([r["ckptd_stall_s"] / r["copy_floor_s"] for r in sr]),
        "stall_ratio_possible": _med([r["copy_floor_s"] for r in sr]) / dcp_save,
        "stall_vs_async_ratio": stall / _med([r["dcp_async_block_s"] for r in sr]),
        # CPU seconds during the save (per rank: the larger rank's; server: the whole process)
        **{k: _med([r[k] for r in sr]) for k in (
            "dcp_rank_cpu_s", "dcp_rank_user_s", "dcp_rank_sys_s",
            *(f"ckptd_{x}" for x in (
                "rank_cpu_s", "rank_user_s", "rank_sys_s", "server_cpu_s", "server_user_s", "server_sys_s")))},
    }
    for cache in ("cold", "warm"):
        d = _med([r[f"dcp_{cache}_load_s"] for r in lr])
        c = _med([r[f"ckptd_{cache}_load_s"] for r in lr])
        out.update({f"dcp_{cache}_load_s": d, f"ckptd_{cache}_load_s": c, f"dcp_{cache}_load_gbps": gb / d,
                    f"ckptd_{cache}_load_gbps": gb / c, f"load_{cache}_throughput_ratio": d / c,
                    f"dcp_{cache}_load_ranks_cpu_s": _med([r[f"dcp_{cache}_load_ranks_cpu_s"] for r in lr]),
                    f"ckptd_{cache}_load_ranks_cpu_s": _med([r[f"ckptd_{cache}_load_ranks_cpu_s"] for r in lr]),
                    f"ckptd_{cache}_load_server_cpu_s": _med([r[f"ckptd_{cache}_load_server_cpu_s"] for r in lr])})
        h = _med([r[f"ckptd_http_{cache}_load_s"] for r in lr])  # the same load with direct_reads=False
        out.update({f"ckptd_http_{cache}_load_s": h, f"ckptd_http_{cache}_load_gbps": gb / h,
                    f"load_{cache}_http_throughput_ratio": d / h,
                    **{f"{w}_{cache}_direct_fraction": _med([r[f"{w}_{cache}_direct_fraction"] for r in lr])
                       for w in ("ckptd", "ckptd_http")},
                    f"ckptd_http_{cache}_load_ranks_cpu_s": _med([r[f"ckptd_http_{cache}_load_ranks_cpu_s"] for r in lr]),
                    f"ckptd_http_{cache}_load_server_cpu_s": _med(
                        [r[f"ckptd_http_{cache}_load_server_cpu_s"] for r in lr])})
        # the same files read by the same ranks, nothing else, in the same rotation (the disk's floor)
        out.update({f"raw_{cache}_load_s": _med([r[f"raw_{cache}_load_s"] for r in lr]),
                    f"raw_{cache}_bytes": _med([r[f"raw_{cache}_bytes"] for r in lr]),
                    f"ckptd_{cache}_load_vs_raw": _med([r[f"raw_{cache}_load_s"] / r[f"ckptd_{cache}_load_s"]
                                                        for r in lr]),
                    f"dcp_{cache}_load_vs_raw": _med([r[f"raw_{cache}_load_s"] / r[f"dcp_{cache}_load_s"]
                                                      for r in lr])})
    out["load_throughput_ratio"] = out["load_cold_throughput_ratio"]
    gib = nbytes / (1 << 30)  # the service's CPU per GiB: from the first body byte to the marker, and served
    out["server_cpu_s_per_gib_saved"] = out["ckptd_server_cpu_s"] / gib
    for cache in ("cold", "warm"):
        out[f"server_cpu_s_per_gib_served_http_{cache}"] = out[f"ckptd_http_{cache}_load_server_cpu_s"] / gib
    rp = load["replicated"]  # plain tensors every rank loads, over HTTP: one fetch per host, or one per rank
    out["replicated_load"] = {**rp, "fetch_ratio": rp["each_rank"]["bytes_fetched"] / rp["shared"]["bytes_fetched"],
                              "time_ratio": rp["each_rank"]["load_s"] / rp["shared"]["load_s"]}
    # Where ckptd's save time goes: median over repeats of each phase (seconds, the slower rank's).
    keys = ("stall", "snapshot", "open_session", "pack_hash", "put_file_span",
            "put_file_n", "put_index", "put_index_end", "upload_total", "upload_total_end", "poll", "own_wait_return")
    for r in sr:
        for p in r["ckptd_phases_by_rank"]:
            if "put_file_end" in p and "body_sent_end" in p:
                # last byte of the last file handed to httpx -> its PUT answered: the server's fsync + digest
                p["server_file_tail"] = p["put_file_end"] - p["body_sent_end"]
    keys += ("server_file_tail",)
    by_rank = [r["ckptd_phases_by_rank"] for r in sr]
    # last index answered (the commit) -> the last rank's wait() returns: how fast waiters learn of the commit
    out["ckptd_commit_seen_after_s"] = _med([max(p.get("own_wait_return", 0.0) for p in ps)
                                             - max(p.get("put_index_end", 0.0) for p in ps) for ps in by_rank])
    out["save_phases_s"] = {k: _med([max(p.get(k, 0.0) for p in ps) for ps in by_rank]) for k in keys
                            if any(k in p for ps in by_rank for p in ps)}
    lkeys = ("manifest", "read_plan", "get_range_span", "get_range_n", "fetch_verify", "fetch_copy_total")
    out["load_phases_s"] = {f"{w}_{c}": {k: _med([max(p.get(k, 0.0) for p in r[f"{w}_{c}_phases_by_rank"])
                                                 for r in lr]) for k in lkeys}
                            for w in ("ckptd", "ckptd_http") for c in ("cold", "warm")}
    out["goals_met"] = {
        "save_throughput_ratio>=1.5": out["save_throughput_ratio"] >= GOALS["save_throughput_ratio"],
        "stall_ratio<=0.1": out["stall_ratio"] <= GOALS["stall_ratio"],
        "stall_vs_async_ratio<=1.0": out["stall_vs_async_ratio"] <= GOALS["stall_vs_async_ratio"],
        "load_throughput_ratio>=1.5 (cold)": out["load_cold_throughput_ratio"] >= GOALS["load_throughput_ratio"],
        "load_throughput_ratio>=1.5 (warm)": out["load_warm_throughput_ratio"] >= GOALS["load_throughput_ratio"],
        **{f"{k}{op}{v}": (out[k] <= v if op == "<=" else out[k] >= v) for k, (op, v) in FLOOR_GOALS.items()},
    }
    return out


def _merge_rank_records(records: list[dict], phase_keys: tuple[str, ...]) -> dict:
    """Rank 0's record, with each repeat's per-rank phase dicts gathered under ``<key>_by_rank``."""
    base = records[0]["result"]
    for i, rep in enumerate(base["repeats"]):
        for k in phase_keys:
            rep[f"{k}_by_rank"] = [rec["result"]["repeats"][i].get(k, {}) for rec in records]
            rep.pop(k, None)
    return base


def markdown(res: dict) -> str:
    s, cfg = res["summary"], res["config"]
    mib = cfg["state_bytes"] / MiB
    rows = [
        ("save, committed (ckptd `handle.wait()`) vs `dcp.save`", f"{s['ckptd_committed_s']:.2f} s = "
         f"{s['ckptd_committed_gbps']:.2f} GB/s", f"{s['dcp_save_s']:.2f} s = {s['dcp_save_gbps']:.2f} GB/s",
         f"throughput ratio {s['save_throughput_ratio']:.2f}", ">= 1.5"),
        ("the same bytes written + fsynced by the 2 ranks, nothing else (the floor)", "", f"{s['raw_write_s']:.2f} s",
         f"ckptd reaches {s['ckptd_save_vs_raw']:.2f} of it, "
         f"DCP {s['dcp_save_vs_raw']:.2f}", ""),
        ("training stall (`save()` returns) vs `dcp.save`", f"{s['ckptd_stall_s']:.3f} s",
         f"{s['dcp_save_s']:.2f} s", f"stall ratio {s['stall_ratio']:.3f}", "<= 0.1"),
        ("the same shards copied by the 2 ranks into pre-faulted memory, nothing else (the stall's floor)", "",
         f"{s['copy_floor_s']:.3f} s", f"stall is {s['stall_vs_copy_floor']:.2f}x it; the lowest stall ratio "
         f"this memory allows is {s['stall_ratio_possible']:.3f}", ""),
        ("training stall vs `dcp.async_save` blocking", f"{s['ckptd_stall_s']:.3f} s",
         f"{s['dcp_async_block_s']:.3f} s", f"ratio {s['stall_vs_async_ratio']:.2f}", "<= 1.0"),
        ("load at world size 3, cold page cache", f"{s['ckptd_cold_load_s']:.2f} s = "
         f"{s['ckptd_cold_load_gbps']:.2f} GB/s", f"{s['dcp_cold_load_s']:.2f} s = {s['dcp_cold_load_gbps']:.2f} GB/s",
         f"throughput ratio {s['load_cold_throughput_ratio']:.2f}", ">= 1.5"),
        ("ckptd's files read by the 3 ranks, a third each, nothing else (the floor), cold", "",
         f"{s['raw_cold_load_s']:.2f} s", f"ckptd reaches {s['ckptd_cold_load_vs_raw']:.2f} of it, "
         f"DCP {s['dcp_cold_load_vs_raw']:.2f}", ""),
        ("load at world size 3, warm page cache", f"{s['ckptd_warm_load_s']:.2f} s = "
         f"{s['ckptd_warm_load_gbps']:.2f} GB/s", f"{s['dcp_warm_load_s']:.2f} s = {s['dcp_warm_load_gbps']:.2f} GB/s",
         f"throughput ratio {s['load_warm_throughput_ratio']:.2f}", ">= 1.5"),
        *((f"same, {c}, `direct_reads=False` (every byte through the service)",
           f"{s[f'ckptd_http_{c}_load_s']:.2f} s = {s[f'ckptd_http_{c}_load_gbps']:.2f} GB/s",
           f"{s[f'dcp_{c}_load_s']:.2f} s", f"throughput ratio {s[f'load_{c}_http_throughput_ratio']:.2f}", "")
          for c in ("cold", "warm")),
    ]
    lines = [f"{mib:.0f} MiB fp32 state, save on 2 ranks, load on 3, median of {cfg['repeat']} repeats:", "",
             "| measure | ckptd | DCP | ratio | goal |", "| --- | --- | --- | --- | --- |"]
    lines += [f"| {a} | {b} | {c} | {d} | {e} |" for a, b, c, d, e in rows]
    rss = res["server_rss"]
    lines += ["", "| server | state | idle RSS | peak RSS, saves | concurrent uploads | peak RSS, loads (fresh process) |",
              "| --- | --- | --- | --- | --- | --- |"]
    for key, r in sorted(rss.items(), key=lambda kv: kv[1]["state_mib"]):
        lines.append(f"| {key} | {r['state_mib']:.0f} MiB | {r['idle']['VmHWM'] / MiB:.0f} MiB | "
                     f"{r['after_save']['VmHWM'] / MiB:.0f} MiB | {r['upload_streams']['concurrent_uploads']} | "
                     f"{r['load_peak']['VmHWM'] / MiB:.0f} MiB |")
    lines += ["", "ckptd save phases (s, slower rank, median): " + ", ".join(
        f"{k}={v:.3f}" for k, v in s["save_phases_s"].items())]
    lines += ["", "CPU seconds during one save (user+sys; ranks: the busier rank, x2 for both): "
              f"DCP ranks 2 x ({s['dcp_rank_user_s']:.2f}+{s['dcp_rank_sys_s']:.2f}); "
              f"ckptd ranks 2 x ({s['ckptd_rank_user_s']:.2f}+{s['ckptd_rank_sys_s']:.2f}), "
              f"server {s['ckptd_server_user_s']:.2f}+{s['ckptd_server_sys_s']:.2f}"]
    lines += [f"the service's CPU per GiB: {s['server_cpu_s_per_gib_saved']:.2f} CPU-s per GiB committed (goal <= "
              f"{FLOOR_GOALS['server_cpu_s_per_gib_saved'][1]}), {s['server_cpu_s_per_gib_served_http_cold']:.2f} per "
              f"GiB served over HTTP cold, {s['server_cpu_s_per_gib_served_http_warm']:.2f} warm"]
    lines += ["CPU seconds during one load at world size 3 (all ranks summed): " + "; ".join(
        f"{c}: DCP {s[f'dcp_{c}_load_ranks_cpu_s']:.2f}, ckptd ranks {s[f'ckptd_{c}_load_ranks_cpu_s']:.2f} + "
        f"server {s[f'ckptd_{c}_load_server_cpu_s']:.2f} (HTTP: ranks {s[f'ckptd_http_{c}_load_ranks_cpu_s']:.2f} + "
        f"server {s[f'ckptd_http_{c}_load_server_cpu_s']:.2f})" for c in ("cold", "warm"))]
    rl = s["replicated_load"]
    lines += ["", f"replicated state ({rl['shared']['bytes_fetched'] / MiB:.0f} MiB of plain tensors) loaded by all 3 "
              f"ranks over HTTP, cold: shared per host {rl['shared']['load_s']:.2f} s, "
              f"{rl['shared']['bytes_fetched'] / MiB:.0f} MiB fetched, server {rl['shared']['server_cpu_s']:.2f} CPU-s; "
              f"each rank its own {rl['each_rank']['load_s']:.2f} s, {rl['each_rank']['bytes_fetched'] / MiB:.0f} MiB "
              f"fetched, server {rl['each_rank']['server_cpu_s']:.2f} CPU-s"]
    b = res["baselines"]
    lines += ["", "baselines: " + ", ".join(f"{k}={v:.2f}" for k, v in b.items())]
    lines += [f"disk's durable-write ceiling (2 writers, best of start and end) {s['disk_write_ceiling_gbps']:.2f} GB/s: "
              f"dcp.save reaches {s['dcp_save_vs_ceiling']:.2f} of it, ckptd {s['ckptd_save_vs_ceiling']:.2f}; the "
              f"highest save ratio this disk allows is {s['save_ratio_possible']:.2f}"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mib", type=float, default=512, help="total fp32 state over the 2 saving ranks (MiB)")
    ap.add_argument("--rss-mib", default=None,
                    help="comma-separated state sizes (MiB), each saved and loaded once through its own server, "
                         "for peak RSS vs shard size (default: mib/4,mib*2)")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "save_load.json")
    add_workdir_args(ap, "parent of the temporary work dir (server roots and DCP dir: one disk); default $TMPDIR")
    ap.add_argument("--settle", type=float, default=2.0,
                    help="seconds of quiet (after an os.sync) before each timed save, so that none of the four "
                         "pays for the previous one's write-back")
    ap.add_argument("--snapshot-bytes", type=int, default=None,
                    help="CheckpointClient(snapshot_bytes=...) per saving rank: the reusable snapshot buffer")
    args = ap.parse_args(argv)
    other_mibs = ([float(x) for x in args.rss_mib.split(",") if x.strip()] if args.rss_mib is not None
                  else [max(args.mib / 4, 1), args.mib * 2])

    with work_dir("ckptd-bench-", args.workdir, args.keep) as work:
        t_start = time.perf_counter()
        servers: list[ServerProcess] = []
        try:
            specs = tensor_specs(args.mib)
            other_specs = {f"state-{m:g}MiB": tensor_specs(m) for m in other_mibs}
            nbytes = state_bytes(specs)
            machine = describe_machine(work)
            print(f"work dir {work}; {nbytes / MiB:.1f} MiB state; load average {machine['loadavg_at_start']}",
                  flush=True)
            baselines = micro_baselines(work, nbytes)
            print("baselines", json.dumps({k: round(v, 2) for k, v in baselines.items()}), flush=True)
            dcp_dir, root = work / "dcp", work / "ckptd-root"
            dcp_dir.mkdir()
            main_srv = ServerProcess(root, log=work / "server-main.log").start()
            servers.append(main_srv)
            extra, pids = [], {"main": main_srv.proc.pid}
            state_mib = {"main": nbytes / MiB}
            for key, sp in other_specs.items():
                srv = ServerProcess(work / f"ckptd-root-{key}", log=work / f"server-{key}.log").start()
                servers.append(srv)
                extra.append({"key": key, "url": srv.url, "specs": sp})
                pids[key], state_mib[key] = srv.proc.pid, state_bytes(sp) / MiB
            rss: dict[str, dict] = {k: {"state_mib": state_mib[k], "idle": vm_status(pid)} for k, pid in pids.items()}
            cfg = {"specs": specs, "extra": extra, "repeat": args.repeat, "url": main_srv.url,
                   "repl_specs": tensor_specs(args.mib / 4),
                   "server_pid": pids["main"], "dcp_dir": str(dcp_dir), "root": str(root),
                   "snapshot_bytes": args.snapshot_bytes, "settle_s": args.settle}
            budget = 180 + (args.repeat * nbytes + sum(map(state_bytes, other_specs.values()))) / MiB * 0.2

            save_records = run_ranks(save_job, 2, cfg, tmp=work, timeout=budget)
            # Each server's peak during the saves; then a fresh process on the same root and port for the
            # loads (sessions live in storage), so that the load peak carries nothing over from the saves.
            for (k, pid), srv in zip(list(pids.items()), servers):
                rss[k]["after_save"] = vm_status(pid)
                rss[k]["upload_streams"] = _upload_streams(srv.root)
                srv.stop()
                srv.start()
                pids[k] = srv.proc.pid
                rss[k]["load_idle"] = vm_status(pids[k])
            cfg["server_pid"] = pids["main"]
            print("saved", flush=True)
            load_records = run_ranks(load_job, 3, cfg, tmp=work, timeout=budget)
            for k, pid in pids.items():
                rss[k]["load_peak"] = vm_status(pid)
            for s in servers:
                s.stop()
            save = _merge_rank_records(save_records, ("ckptd_phases",))
            load = _merge_rank_records(load_records, ("ckptd_cold_phases", "ckptd_warm_phases",
                                                      "ckptd_http_cold_phases", "ckptd_http_warm_phases"))
            same_disk = len({os.stat(p).st_dev for p in (dcp_dir, root, work)}) == 1
            baselines_end = micro_baselines(work, nbytes)
            summary = summarise(save, load, nbytes)
            # The disk's durable-write ceiling, best of the start and the end: no save that writes every
            # byte durably (ckptd or DCP) can beat it, so it bounds the save ratio this disk can show.
            ceiling = max(baselines["disk_durable_write_2_writers_gbps"], baselines_end["disk_durable_write_2_writers_gbps"])
            summary.update({"disk_write_ceiling_gbps": ceiling,
                            "dcp_save_vs_ceiling": summary["dcp_save_gbps"] / ceiling,
                            "ckptd_save_vs_ceiling": summary["ckptd_committed_gbps"] / ceiling,
                            "save_ratio_possible": ceiling / summary["dcp_save_gbps"]})
            result = {
                "command": "python -m bench.save_load " + " ".join(sys.argv[1:] if argv is None else argv),
                "config": {"mib": args.mib, "state_bytes": nbytes, "rss_state_mib": other_mibs,
                           "repeat": args.repeat, "save_world": 2, "load_world": 3, "tensors": specs,
                           "same_filesystem": same_disk, "workdir": str(work),
                           "snapshot_bytes": args.snapshot_bytes, "settle_s": args.settle,
                           "dcp": "dcp.save/dcp.load, FileSystemWriter defaults (sync_files=True, thread_count=1)",
                           "ckptd": "CheckpointClient defaults (streams=4, file_bytes=256 MiB, no compression); "
                                    "server LocalStorage durable (fsync)"},
                "machine": machine, "baselines": baselines, "baselines_end": baselines_end,
                "summary": summary,
                "server_rss": rss, "save": save, "load": load,
                "wall_s": time.perf_counter() - t_start, "loadavg_at_end": os.getloadavg(),
            }
            write_report(args.out, result, markdown(result))
            return 0
        finally:
            for s in servers:
                s.stop()


if __name__ == "__main__":
    sys.exit(main())
