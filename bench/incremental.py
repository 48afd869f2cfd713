"""Incremental saves against ``dcp.save``, side by side in one run on one disk.

    .venv/bin/python -m bench.incremental --mib 512 --steps 5 --out bench/results/incremental.json

Goals: the second and later saves >= 5x faster than ``dcp.save`` of the same state, writing
<= 0.15x its bytes; the last step loads bit for bit at another world size.

What one run does:

1. Starts a real ``ckptd serve`` (tests/support.py ``ServerProcess``) whose root sits, with the
   DCP directory, in one work directory (one disk).
2. Two gloo ranks hold ``--mib`` MiB of fp32 weights as ``Shard(0)`` DTensors: nine tensors
   that never change (``--frozen`` of the bytes, 0.9 by default: a frozen backbone) and one
   that changes at every step (an adapter). With ``--optimizer``, the adapter also carries two
   AdamW moments (``exp_avg``, ``exp_avg_sq``) that change at every step.
3. At each of ``--steps`` steps the ranks change the trainable tensors, then run ``dcp.save``
   to a fresh directory (``FileSystemWriter`` defaults) and ``CheckpointClient.save(...).wait()``
   (every default: incremental on) to ``RUN/<step>``, in alternating order, each after an
   ``os.sync()`` and ``--settle`` seconds of quiet, timed between barriers. Bytes written: the
   DCP directory's size; for ckptd the checkpoint's files less those linked from the previous
   checkpoint (``Manifest.linked_bytes``). Also recorded: the bytes the checkpoint keeps alive
   (``ckptd_total_bytes``: its files, linked ones included) and, of the linked files, the bytes its
   chunks reuse (``ckptd_unchanged_bytes``, ``Manifest.unchanged_bytes``); a linked file is at least
   half reused, so the stale rest never outweighs what the link saves.
4. Three gloo ranks load the last step with ckptd into DTensors on a 3-mesh and compare every
   element with the values saved (bit for bit).
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
from torch.distributed.tensor import DTensor, Shard

from bench._report import add_workdir_args, git_state, work_dir, write_report
from bench.save_load import _pattern

REPO = Path(__file__).resolve().parents[1]
if str(REPO / "tests") not in sys.path:
    sys.path.insert(0, str(REPO / "tests"))

from support import ServerProcess, run_ranks  # noqa: E402  (tests/support.py)

MiB = 1 << 20
COLS = 1024
GOALS = {"speedup_vs_dcp": 5.0, "bytes_vs_dcp": 0.15}


def tensor_specs(mib: float, frozen: float) -> list[tuple[str, int, bool]]:
    """(name, rows, trainable): nine frozen tensors holding ``frozen`` of ``mib`` MiB, one trainable."""
    total_rows = max(int(mib * MiB) // (4 * COLS), 40)
    trainable = max(int(total_rows * (1 - frozen)), 3)
    per = (total_rows - trainable) // 9
    specs = [(f"backbone.{i}.weight", per | 1, False) for i in range(9)]
    return specs + [("adapter.weight", trainable | 1, True)]


def make_state(specs: list[tuple[str, int, bool]], mesh: Any, step: int, optimizer: bool, *, fill: bool) -> dict:
    """``{"model": ..., "optim": ...}`` of ``Shard(0)`` DTensors; trainable values move with ``step``."""
    def dtensor(index: int, rows: int, shift: float) -> DTensor:
        from ckptd_client._placement import shard_box

        local_shape, offsets = shard_box((rows, COLS), tuple(mesh.shape), mesh.get_coordinate(), [Shard(0)])
        local = (_pattern(index, offsets[0], local_shape[0], COLS).add_(shift) if fill
                 else torch.full(local_shape, float("nan")))
        return DTensor.from_local(local, mesh, [Shard(0)], run_check=False, shape=torch.Size((rows, COLS)),
                                  stride=(COLS, 1))

    model, optim = {}, {}
    for i, (name, rows, trainable) in enumerate(specs):
        model[name] = dtensor(i, rows, float(step) if trainable else 0.0)
        if trainable and optimizer:
            optim[f"{name}.exp_avg"] = dtensor(100 + i, rows, 0.5 * step)
            optim[f"{name}.exp_avg_sq"] = dtensor(200 + i, rows, 0.25 * step)
    return {"model": model, "optim": optim} if optimizer else {"model": model}


def _dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def save_job(rank: int, world: int, cfg: dict) -> dict:
    import httpx

    from ckptd_client import CheckpointClient
    from ckptd_schemas import Manifest

    mesh = init_device_mesh("cpu", (world,))
    client = CheckpointClient(cfg["url"])
    steps = []
    for step in range(1, cfg["steps"] + 1):
        sd = make_state(cfg["specs"], mesh, step, cfg["optimizer"], fill=True)
        rec: dict[str, Any] = {"step": step}
        order = ("dcp", "ckptd") if step % 2 else ("ckptd", "dcp")
        for which in order:
            if rank == 0:
                os.sync()
            time.sleep(cfg["settle_s"])
            dist.barrier()
            t0 = time.perf_counter()
            if which == "dcp":
                out = Path(cfg["dcp_dir"]) / f"step{step}"
                dcp.save(sd, checkpoint_id=str(out))
            else:
                client.save(sd, f"inc/{step}").wait()
            dist.barrier()
            rec[f"{which}_s"] = time.perf_counter() - t0
        if rank == 0:
            m = Manifest.model_validate_json(httpx.get(f"{cfg['url']}/v1/checkpoints/inc/{step}").content)
            rec.update(ckptd_bytes=m.total_bytes - m.linked_bytes, ckptd_linked_bytes=m.linked_bytes,
                       ckptd_total_bytes=m.total_bytes, ckptd_unchanged_bytes=m.unchanged_bytes, dcp_bytes=_dir_bytes(Path(cfg["dcp_dir"]) / f"step{step}"))
        steps.append(rec)
    client.close()
    return {"steps": steps}


def load_job(rank: int, world: int, cfg: dict) -> dict:
    from ckptd_client import CheckpointClient

    mesh = init_device_mesh("cpu", (world,))
    last = cfg["steps"]
    got = make_state(cfg["specs"], mesh, last, cfg["optimizer"], fill=False)
    want = make_state(cfg["specs"], mesh, last, cfg["optimizer"], fill=True)
    client = CheckpointClient(cfg["url"])
    dist.barrier()
    t0 = time.perf_counter()
    client.load(got, f"inc/{last}")
    dist.barrier()
    seconds = time.perf_counter() - t0
    client.close()
    mismatched = 0
    for group in want:
        for name, w in want[group].items():
            a, b = got[group][name].to_local(), w.to_local()
            mismatched += int((a.view(torch.int32) != b.view(torch.int32)).sum())
    return {"load_s": seconds, "mismatched_elements": mismatched}


def summarise(steps: list[dict], loads: list[dict]) -> dict:
    later = steps[1:]
    speedups = [s["dcp_s"] / s["ckptd_s"] for s in later]
    ratios = [s["ckptd_bytes"] / s["dcp_bytes"] for s in later]
    return {
        "first_save_ckptd_s": steps[0]["ckptd_s"], "first_save_dcp_s": steps[0]["dcp_s"],
        "later_ckptd_s_median": statistics.median(s["ckptd_s"] for s in later),
        "later_dcp_s_median": statistics.median(s["dcp_s"] for s in later),
        "speedup_vs_dcp_median": statistics.median(speedups), "speedup_vs_dcp_min": min(speedups),
        "bytes_vs_dcp_median": statistics.median(ratios), "bytes_vs_dcp_max": max(ratios),
        "load_world": len(loads), "load_s": max(r["load_s"] for r in loads),
        "load_bit_exact": all(r["mismatched_elements"] == 0 for r in loads),
    }


def markdown(res: dict) -> str:
    s, cfg = res["summary"], res["config"]
    lines = [f"State: {cfg['state_bytes'] / MiB:.0f} MiB over 2 ranks, {cfg['frozen']:.0%} of the weights frozen"
             + (", AdamW moments of the trainable weights" if cfg["optimizer"] else "") + f"; {cfg['steps']} steps.",
             "", "| step | ckptd save (s) | dcp.save (s) | speed-up | ckptd bytes written | dcp bytes | ratio |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for st in res["steps"]:
        lines.append(f"| {st['step']} | {st['ckptd_s']:.3f} | {st['dcp_s']:.3f} | {st['dcp_s'] / st['ckptd_s']:.2f}x | "
                     f"{st['ckptd_bytes'] / MiB:.1f} MiB | {st['dcp_bytes'] / MiB:.1f} MiB | "
                     f"{st['ckptd_bytes'] / st['dcp_bytes']:.3f} |")
    lines += ["", f"Steps 2-{cfg['steps']}: speed-up vs dcp.save median {s['speedup_vs_dcp_median']:.2f}x "
              f"(min {s['speedup_vs_dcp_min']:.2f}x; goal >= {GOALS['speedup_vs_dcp']}x), bytes written "
              f"median {s['bytes_vs_dcp_median']:.3f}x of DCP's (max {s['bytes_vs_dcp_max']:.3f}; goal <= "
              f"{GOALS['bytes_vs_dcp']}). Last step loaded at {s['load_world']} ranks in {s['load_s']:.2f} s, "
              f"bit for bit: {s['load_bit_exact']}."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mib", type=float, default=512, help="fp32 weights over the 2 saving ranks (MiB)")
    ap.add_argument("--frozen", type=float, default=0.9, help="fraction of the weights' bytes that never change")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--optimizer", action="store_true", help="AdamW moments of the trainable weights too")
    ap.add_argument("--settle", type=float, default=2.0, help="seconds of quiet (after os.sync) before each save")
    ap.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "incremental.json")
    add_workdir_args(ap, "parent of the temporary work dir (server root and DCP dir: one disk); default $TMPDIR")
    args = ap.parse_args(argv)
    with work_dir("ckptd-bench-inc-", args.workdir, args.keep) as work:
        t_start = time.perf_counter()
        specs = tensor_specs(args.mib, args.frozen)
        nbytes = sum(r * COLS * 4 * (3 if t and args.optimizer else 1) for _, r, t in specs)
        (work / "dcp").mkdir()
        srv = ServerProcess(work / "root", log=work / "server.log").start()
        try:
            cfg = {"url": srv.url, "specs": specs, "steps": args.steps, "optimizer": args.optimizer,
                   "settle_s": args.settle, "dcp_dir": str(work / "dcp")}
            budget = 120 + args.steps * nbytes / MiB * 0.1
            saved = run_ranks(save_job, 2, cfg, tmp=work, timeout=budget)
            loads = run_ranks(load_job, 3, cfg, tmp=work, timeout=budget)
        finally:
            srv.stop()
        steps = saved[0]["result"]["steps"]
        loads = [r["result"] for r in loads]
        result = {
            "command": "python -m bench.incremental " + " ".join(sys.argv[1:] if argv is None else argv),
            "config": {"mib": args.mib, "frozen": args.frozen, "steps": args.steps, "optimizer": args.optimizer,
                       "state_bytes": nbytes, "save_world": 2, "load_world": 3, "tensors": specs,
                       "dcp": "dcp.save, FileSystemWriter defaults", "ckptd": "CheckpointClient defaults"},
            "git": git_state(), "goals": GOALS, "steps": steps, "loads": loads,
            "summary": summarise(steps, loads), "wall_s": time.perf_counter() - t_start,
        }
        write_report(args.out, result, markdown(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
