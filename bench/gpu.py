"""ckptd against torch.distributed.checkpoint (DCP) on one device (a GPU where there is one), side by side.

    .venv/bin/python -m bench.gpu --gib 4 --repeat 3 --out bench/results/gpu.json   # cuda when available
    .venv/bin/python -m bench.gpu --gib 0.01 --repeat 1 --device cpu                  # the same code on the CPU

What one run does, at world size 1 (one process, no process group), in one work directory (one disk):

1. State: mixed-precision Adam on ``--device``: N bf16 weights and fp32 ``exp_avg`` and ``exp_avg_sq``
   (``--gib`` GiB in all, 8 layers of uneven size), as a trainer holds it. A real ``ckptd serve``
   (tests/support.py ``ServerProcess``) runs on a root in the work directory.
2. Saves, ``--repeat`` + 1 rounds; before each round every byte of the state changes (``mutate``), so no
   save can reuse an earlier one's bytes. Each measure starts after an ``os.sync()`` and ``--settle``
   seconds of quiet. In a round: the D2H floor (every tensor copied into pre-faulted pinned host memory,
   nothing else); ``CheckpointClient.save`` (defaults) timed until it returns (the stall) and until
   ``handle.wait()`` (committed); ``dcp.async_save`` timed until it returns (its blocking part), then
   until done; ``dcp.save``; the write floor (the same bytes, ``write`` + ``fsync``, 1 and 4 threads).
   Round 0 is the first save of a fresh client (and of DCP's stager): its stall is reported on its own
   (``first``); medians are over rounds 1..repeat (``later``).
3. Loads of the last round's checkpoints into zeroed device tensors, ``--repeat`` times, the order
   rotating: ``CheckpointClient.load``, ``dcp.load`` and the read floor (ckptd's files read cold with
   ``preadv``, 1 and 4 threads, the faster counts), each after its files are evicted from the page
   cache (``posix_fadvise(DONTNEED)``, bench/_disk.py). Every load is checked bit for bit.
4. ``ckptd reshard`` of the last ckptd checkpoint 1 -> ``fsdp2:dp=4`` (``--jobs 2``, the default), with
   and without ``--dtype bfloat16``: in process (``ckptd.cli.main.main``, torch and CUDA already up: the
   conversion alone) with ``--device cpu`` and ``cuda``, and as a whole process (``python -m
   ckptd.cli.main``: start-up counted) with ``--device cpu``, ``cuda`` and ``auto``; source evicted
   before each, output deleted after. ``cuda`` only where CUDA is. Whole-process runs record the engine
   the command named and why (``executor.choose_device``); from them the summary derives the cast size
   at which the GPU pays for its start-up (``reshard_gpu_break_even_cast_bytes``), the figure
   ``executor.GPU_CAST_MIN_BYTES`` is to be set from.

Goals: load >= 1.2x ``dcp.load`` and >= 0.9 of the cold-read floor; first stall <= 0.5 s at
4 GiB; later stalls <= 1.1x the D2H floor; ``--device auto`` as a whole process never slower than ``cpu``.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp

from bench._disk import evict
from bench._gpu_state import (d2h_floor, equal_bits, host_buffer, make_state, mutate, read_floor, state_bytes,
                              state_rows, sync, write_floor)
from bench._report import add_workdir_args, git_state, work_dir, write_report

REPO = Path(__file__).resolve().parents[1]
if str(REPO / "tests") not in sys.path:
    sys.path.insert(0, str(REPO / "tests"))

from support import ServerProcess

SPEC = "fsdp2:dp=4"
GOALS = {"load_vs_dcp": 1.2, "load_vs_read_floor": 0.9, "first_stall_s_at_4gib": 0.5, "later_stall_vs_d2h": 1.1}
warnings.filterwarnings("ignore", message="torch.distributed is disabled")  # DCP at world size 1


def _med(xs: list[float]) -> float:
    return statistics.median(xs)


def _quiet(settle: float) -> None:
    """Before each measure: write back what the previous one left dirty, then wait ``settle`` seconds."""
    os.sync()
    time.sleep(settle)


def _ckpt_files(root: Path, ref: str) -> list[Path]:
    return sorted(p for p in (root / "runs" / ref).rglob("*") if p.is_file() and p.parent.name == "files")


# -- saves ----------------------------------------------------------------------------------------------

def save_rounds(sd: dict, device: torch.device, client: Any, work: Path, repeat: int, settle: float) -> list[dict]:
    """``repeat`` + 1 rounds of saves (module docstring, step 2). Keeps only the last round's checkpoints
    (ckptd ``gpu/<last>``, DCP ``dcp/s<last>``): earlier ones are deleted as the next commits."""
    host = host_buffer(state_bytes(sd), device)
    dcp_dir = work / "dcp"
    rounds = []
    for k in range(repeat + 1):
        mutate(sd)
        sync(device)
        rec: dict[str, float] = {}
        _quiet(settle)
        rec["d2h_s"] = d2h_floor(sd, host, device)  # host now holds this round's bytes: the write floor's
        _quiet(settle)
        t0 = time.perf_counter()
        handle = client.save(sd, f"gpu/{k}")
        rec["ckptd_stall_s"] = time.perf_counter() - t0
        handle.wait()
        rec["ckptd_committed_s"] = time.perf_counter() - t0
        if k and not client.remove(f"gpu/{k - 1}")["removed"]:  # not the newest any more: retention lets it go
            print(f"gpu/{k - 1} kept by retention: the disk holds one more checkpoint", flush=True)
        _quiet(settle)
        t0 = time.perf_counter()
        fut = dcp.async_save(sd, checkpoint_id=str(dcp_dir / f"a{k}"))
        rec["dcp_async_block_s"] = time.perf_counter() - t0
        fut.result()
        rec["dcp_async_total_s"] = time.perf_counter() - t0
        shutil.rmtree(dcp_dir / f"a{k}")
        _quiet(settle)
        t0 = time.perf_counter()
        dcp.save(sd, checkpoint_id=str(dcp_dir / f"s{k}"))
        rec["dcp_save_s"] = time.perf_counter() - t0
        if k:
            shutil.rmtree(dcp_dir / f"s{k - 1}")
        for n in (1, 4):
            _quiet(settle)
            rec[f"write_floor_{n}t_s"] = write_floor(host, work, n)
        rounds.append(rec)
        print(f"save round {k}: " + ", ".join(f"{a}={b:.3f}" for a, b in rec.items()), flush=True)
    return rounds


# -- loads ----------------------------------------------------------------------------------------------

def load_repeats(sd: dict, rows: list[int], device: torch.device, client: Any, root: Path, work: Path,
                 last: int, repeat: int, settle: float) -> list[dict]:
    """Loads of round ``last``'s checkpoints into zeroed device tensors, checked bit for bit against ``sd``
    (module docstring, step 3)."""
    into = make_state(rows, device, fill=False)
    ref, dcp_path = f"gpu/{last}", work / "dcp" / f"s{last}"
    files = _ckpt_files(root, ref)
    ways = ("ckptd", "dcp", "read_floor")
    out = []
    for r in range(repeat):
        rec: dict[str, Any] = {"order": list(ways[r % 3:] + ways[:r % 3])}
        for way in rec["order"]:
            for threads in ((1, 4) if way == "read_floor" else (0,)):
                evict([dcp_path] if way == "dcp" else files)
                if way != "read_floor":
                    mutate(into)  # whatever the last load left, it is wrong now
                _quiet(settle)
                t0 = time.perf_counter()
                if way == "ckptd":
                    client.load(into, ref)
                elif way == "dcp":
                    dcp.load(into, checkpoint_id=str(dcp_path))
                else:
                    _, rec["read_floor_bytes"] = read_floor(files, threads)
                sync(device)
                t = time.perf_counter() - t0
                if way == "read_floor":
                    rec[f"read_floor_{threads}t_s"] = t
                    continue
                rec[f"{way}_load_s"] = t
                rec[f"{way}_bit_exact"] = equal_bits(into, sd)
                assert rec[f"{way}_bit_exact"], f"{way} load (repeat {r}) differs from the state saved"
        out.append(rec)
        print(f"load repeat {r}: " + ", ".join(f"{a}={b}" for a, b in rec.items()), flush=True)
    return out


# -- reshard --------------------------------------------------------------------------------------------

def _reshard_argv(root: Path, src: str, out: str, device: str, dtype: str | None) -> list[str]:
    return ["reshard", src, "--to", SPEC, "--root", str(root), "--out", out, "--json", "--device", device,
            *(["--dtype", dtype] if dtype else [])]


def reshard_once(root: Path, src: str, device: str, dtype: str | None, whole: bool, tag: str,
                 log: Path) -> dict:
    """One ``ckptd reshard`` (module docstring, step 4), source evicted first, output deleted after.
    Returns its wall time and the command's JSON report (which names the engine)."""
    out = f"rs/{tag}"
    argv = _reshard_argv(root, src, out, device, dtype)
    evict([root / "runs" / src])
    t0 = time.perf_counter()
    if whole:
        proc = subprocess.run([sys.executable, "-m", "ckptd.cli.main", *argv], cwd=REPO, capture_output=True,
                              text=True, check=False, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        wall, rc, text, err = time.perf_counter() - t0, proc.returncode, proc.stdout, proc.stderr
    else:
        from ckptd.cli.main import main as ckptd_main

        buf, ebuf = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(ebuf):
            rc = ckptd_main(argv)
        sync(torch.device("cuda") if device != "cpu" and torch.cuda.is_available() else torch.device("cpu"))
        wall, text, err = time.perf_counter() - t0, buf.getvalue(), ebuf.getvalue()
    with open(log, "a") as f:
        f.write(f"$ ckptd {' '.join(argv)}  ({'whole process' if whole else 'in process'})\n{text}{err}\n")
    if rc != 0:
        raise RuntimeError(f"ckptd {' '.join(argv)} exited with {rc}:\n{err[-3000:]}")
    report = json.loads([ln for ln in text.splitlines() if ln.startswith("{")][-1])
    shutil.rmtree(root / "runs" / "rs" / tag)
    return {"wall_s": wall, "conversion_s": report["seconds"], "engine": report["engine"],
            "bytes_written": report["bytes_written"]}


def reshard_matrix(root: Path, src: str, repeat: int, log: Path) -> dict:
    """Every (mode, device, dtype) ``repeat`` times, the order rotating within each repeat. Returns
    ``{"in_process"|"whole_process": {device: {dtype or "none": [runs]}}}``."""
    gpu = torch.cuda.is_available()
    cases = [("in_process", d) for d in (("cpu", "cuda") if gpu else ("cpu",))]
    cases += [("whole_process", d) for d in (("cpu", "cuda", "auto") if gpu else ("cpu", "auto"))]
    cases = [(m, d, t) for m, d in cases for t in (None, "bfloat16")]
    res: dict[str, dict] = {}
    for r in range(repeat):
        for i in range(len(cases)):
            mode, device, dtype = cases[(i + r) % len(cases)]
            run = reshard_once(root, src, device, dtype, mode == "whole_process",
                               f"{mode[0]}-{device}-{dtype or 'none'}-{r}", log)
            res.setdefault(mode, {}).setdefault(device, {}).setdefault(dtype or "none", []).append(run)
            print(f"reshard {mode} --device {device} --dtype {dtype}: {run['wall_s']:.2f} s, engine "
                  f"{run['engine']['device']} ({run['engine']['reason']})", flush=True)
    return res


# -- summary --------------------------------------------------------------------------------------------

def summarise(rounds: list[dict], loads: list[dict], rs: dict, nbytes: int, cast: int) -> dict:
    later = rounds[1:]
    m = lambda key, rows=later: _med([x[key] for x in rows])
    gbps = lambda s: nbytes / s / 1e9
    s: dict[str, Any] = {
        "d2h_floor_s": m("d2h_s"), "write_floor_1t_s": m("write_floor_1t_s"), "write_floor_4t_s": m("write_floor_4t_s"),
        "ckptd_first_stall_s": rounds[0]["ckptd_stall_s"], "ckptd_later_stall_s": m("ckptd_stall_s"),
        "dcp_async_first_block_s": rounds[0]["dcp_async_block_s"], "dcp_async_later_block_s": m("dcp_async_block_s"),
        "ckptd_first_committed_s": rounds[0]["ckptd_committed_s"], "ckptd_committed_s": m("ckptd_committed_s"),
        "dcp_save_s": m("dcp_save_s"), "dcp_async_total_s": m("dcp_async_total_s"),
        "ckptd_load_cold_s": m("ckptd_load_s", loads), "dcp_load_cold_s": m("dcp_load_s", loads),
        "read_floor_1t_s": m("read_floor_1t_s", loads), "read_floor_4t_s": m("read_floor_4t_s", loads),
        "loads_bit_exact": all(x["ckptd_bit_exact"] and x["dcp_bit_exact"] for x in loads),
    }
    s["write_floor_s"] = min(s["write_floor_1t_s"], s["write_floor_4t_s"])
    s["read_floor_s"] = min(s["read_floor_1t_s"], s["read_floor_4t_s"])
    for k in ("d2h_floor", "write_floor", "read_floor", "ckptd_committed", "dcp_save", "ckptd_load_cold",
              "dcp_load_cold"):
        s[f"{k}_gbps"] = gbps(s[f"{k}_s"])
    s.update({
        "later_stall_vs_d2h": s["ckptd_later_stall_s"] / s["d2h_floor_s"],
        "first_stall_s": s["ckptd_first_stall_s"],
        "later_stall_vs_async_block": s["ckptd_later_stall_s"] / s["dcp_async_later_block_s"],
        "first_stall_vs_async_block": s["ckptd_first_stall_s"] / s["dcp_async_first_block_s"],
        "save_vs_dcp": s["dcp_save_s"] / s["ckptd_committed_s"],
        "save_vs_write_floor": s["write_floor_s"] / s["ckptd_committed_s"],
        "load_vs_dcp": s["dcp_load_cold_s"] / s["ckptd_load_cold_s"],
        "load_vs_read_floor": s["read_floor_s"] / s["ckptd_load_cold_s"],
    })
    s["reshard"] = {mode: {dev: {dt: _med([x["wall_s"] for x in runs]) for dt, runs in by.items()}
                           for dev, by in devs.items()} for mode, devs in rs.items()}
    whole = s["reshard"]["whole_process"]
    s["reshard_auto_engine"] = {dt: rs["whole_process"]["auto"][dt][0]["engine"] for dt in ("none", "bfloat16")}
    s["reshard_auto_vs_cpu_whole"] = max(whole["auto"][dt] / whole["cpu"][dt] for dt in ("none", "bfloat16"))
    s["reshard_cast_bytes"] = cast
    s.update(break_even(s["reshard"], cast))
    return s


def break_even(rs: dict, cast: int) -> dict:
    """With a cast, on a GPU: what the GPU saves per cast byte in process, what its start-up costs beyond
    the CPU's (whole process minus in process, GPU minus CPU), and the cast size at which they are equal:
    the figure ``executor.GPU_CAST_MIN_BYTES`` is to be set from (None where there was no GPU, or where
    the GPU saved nothing)."""
    inp, whole = rs["in_process"], rs["whole_process"]
    if "cuda" not in inp:
        return {"reshard_gpu_break_even_cast_bytes": None}
    saved = inp["cpu"]["bfloat16"] - inp["cuda"]["bfloat16"]
    startup = ((whole["cuda"]["bfloat16"] - inp["cuda"]["bfloat16"])
               - (whole["cpu"]["bfloat16"] - inp["cpu"]["bfloat16"]))
    return {"reshard_gpu_saved_s_per_gib_cast": saved / (cast / 2**30), "reshard_gpu_extra_startup_s": startup,
            "reshard_gpu_break_even_cast_bytes": (max(startup, 0.0) / saved * cast) if saved > 0 else None}


def markdown(res: dict) -> str:
    s, c = res["summary"], res["config"]
    g = lambda k: f"{s[k]:.3f} s ({s[k[:-2] + '_gbps']:.2f} GB/s)"
    rows = [
        ("first save's stall (`save()` returns) vs `dcp.async_save` blocking, first",
         f"{s['ckptd_first_stall_s']:.3f} s",
         f"{s['dcp_async_first_block_s']:.3f} s", f"{s['first_stall_vs_async_block']:.2f}", "<= 0.5 s at 4 GiB"),
        ("later saves' stall vs `dcp.async_save` blocking", f"{s['ckptd_later_stall_s']:.3f} s",
         f"{s['dcp_async_later_block_s']:.3f} s", f"{s['later_stall_vs_async_block']:.2f}", ""),
        ("D2H copy into pinned memory, nothing else (the stall's floor)", "", g("d2h_floor_s"),
         f"stall {s['later_stall_vs_d2h']:.2f}x it", "<= 1.1x"),
        ("save, committed vs `dcp.save`", g("ckptd_committed_s"), g("dcp_save_s"), f"{s['save_vs_dcp']:.2f}", ""),
        ("the same bytes written + fsynced, 1 / 4 threads (the floor)", "",
         f"{s['write_floor_1t_s']:.3f} / {s['write_floor_4t_s']:.3f} s", f"ckptd {s['save_vs_write_floor']:.2f} of it",
         ""),
        ("load into device tensors, cold, vs `dcp.load`", g("ckptd_load_cold_s"), g("dcp_load_cold_s"),
         f"{s['load_vs_dcp']:.2f}", ">= 1.2"),
        ("ckptd's files read cold, 1 / 4 threads (the floor)", "",
         f"{s['read_floor_1t_s']:.3f} / {s['read_floor_4t_s']:.3f} s", f"ckptd {s['load_vs_read_floor']:.2f} of it",
         ">= 0.9"),
    ]
    lines = [f"{c['state_bytes'] / 2**30:.2f} GiB mixed-precision Adam state on {c['device']} ({c['device_name']}), "
             f"world size 1, median of {c['repeat']} (first save: one):", "",
             "| measure | ckptd | DCP / floor | ratio | goal |", "| --- | --- | --- | --- | --- |"]
    lines += [f"| {' | '.join(r)} |" for r in rows]
    lines += ["", f"`ckptd reshard` 1 -> `{SPEC}`, seconds (median of {c['reshard_repeat']}); cast: "
              f"{s['reshard_cast_bytes'] / 2**30:.2f} GiB with `--dtype bfloat16`:", "",
              "| mode | --device | no cast | --dtype bfloat16 |", "| --- | --- | --- | --- |"]
    for mode, devs in s["reshard"].items():
        for dev, by in devs.items():
            lines.append(f"| {mode.replace('_', ' ')} | {dev} | {by['none']:.2f} | {by['bfloat16']:.2f} |")
    lines.append("")
    for dt, e in s["reshard_auto_engine"].items():
        lines.append(f"`--device auto`, {dt}: engine {e['device']} ({e['reason']})  ")
    be = s.get("reshard_gpu_break_even_cast_bytes")
    lines.append(f"auto / cpu as a whole process (worse of the two dtypes): {s['reshard_auto_vs_cpu_whole']:.2f}; "
                 + (f"GPU break-even cast: {be / 2**30:.2f} GiB" if be is not None else "GPU break-even: not measured "
                    "(no GPU, or the GPU saved nothing)"))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gib", type=float, default=4.0, help="state size: bf16 weights + fp32 exp_avg, exp_avg_sq")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--reshard-repeat", type=int, default=None, help="repeats of each reshard (default --repeat)")
    ap.add_argument("--device", choices=["cuda", "cpu"], default=None, help="default: cuda when available")
    ap.add_argument("--settle", type=float, default=1.0, help="seconds of quiet (after os.sync) before each measure")
    ap.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "gpu.json")
    add_workdir_args(ap, "parent of the temporary work dir (server root and DCP dir: one disk); default $TMPDIR")
    args = ap.parse_args(argv)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: no CUDA device here")
    rs_repeat = args.reshard_repeat or args.repeat
    with work_dir("ckptd-bench-gpu-", args.workdir, args.keep) as work:
        t_start = time.perf_counter()
        root = work / "root"
        server = ServerProcess(root, log=work / "server.log").start()
        try:
            from ckptd_client import CheckpointClient

            rows = state_rows(args.gib)
            sd = make_state(rows, device, fill=True)
            sync(device)
            nbytes = state_bytes(sd)
            print(f"work dir {work}; {nbytes / 2**30:.3f} GiB state on {device}", flush=True)
            with CheckpointClient(server.url) as client:
                rounds = save_rounds(sd, device, client, work, args.repeat, args.settle)
                loads = load_repeats(sd, rows, device, client, root, work, args.repeat, args.repeat, args.settle)
        finally:
            server.stop()
        from ckptd.reshard.executor import cast_bytes
        from ckptd.reshard.planner import outline_reshard
        from ckptd.reshard.spec import parse_spec
        from ckptd.storage import LocalStorage
        from ckptd.store import CheckpointReader

        src = f"gpu/{args.repeat}"
        cast = cast_bytes(outline_reshard(CheckpointReader(LocalStorage(root)).manifest(*src.split("/")),
                                          parse_spec(SPEC), dtype="bfloat16"))
        rs = reshard_matrix(root, src, rs_repeat, work / "reshard.log")
        result = {
            "command": "python -m bench.gpu " + " ".join(sys.argv[1:] if argv is None else argv),
            "config": {"gib": args.gib, "state_bytes": nbytes, "rows": rows, "cols": 1024, "repeat": args.repeat,
                       "reshard_repeat": rs_repeat, "settle_s": args.settle, "device": device.type,
                       "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU",
                       "torch": torch.__version__, "cuda_available": torch.cuda.is_available(),
                       "nproc": os.cpu_count(), "workdir": str(work), "git": git_state(),
                       "ckptd": "CheckpointClient defaults (pinned snapshot pool on a GPU); server LocalStorage "
                                "durable (fsync)",
                       "dcp": "dcp.save / dcp.async_save (default stager) / dcp.load, FileSystemWriter defaults, no "
                              "process group",
                       "reshard": f"1 -> {SPEC}, --jobs 2 (default)"},
            "summary": summarise(rounds, loads, rs, nbytes, cast),
            "saves": rounds, "loads": loads, "reshard_runs": rs,
            "wall_s": time.perf_counter() - t_start,
        }
        write_report(args.out, result, markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
