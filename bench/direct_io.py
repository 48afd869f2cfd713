"""``CKPTD_DIRECT_IO=1`` (``O_DIRECT`` writes) against the default (the page cache), interleaved process by process.

    .venv/bin/python -m bench.direct_io --gib 1 --pairs 6 --out bench/results/direct_io.json

Why interleaved: on the shared VMs this runs on, the disk and the CPU change speed from minute to
minute, by more than the difference measured here. Two whole benchmark runs, one per setting,
compare two different machines; pairs of single processes, the order alternating, do not.

What one run does:

1. Starts a real ``ckptd serve`` on a fresh root and saves ``--gib`` GiB of fp32 matrices with an
   odd row count into it (``CheckpointClient.save``, world size 1), then stops the server.
2. ``--pairs`` times: the page cache of the checkpoint's files is evicted, then ``ckptd reshard
   --to fsdp2:dp=2 --jobs 2`` runs as a whole process under one setting, and again under the
   other (the first setting alternates pair by pair). Each output is deleted after its run.
3. The same for ``ckptd export`` (safetensors, checked), one file written front to back.

Each process: wall time, CPU (user + sys, ``wait4``) and, for the reshard, its own ``seconds``
(in process, no start-up). The JSON holds every run; the table the medians and ranges.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench._disk import evict  # noqa: E402
from bench._report import add_workdir_args, git_state, work_dir, write_report  # noqa: E402
from bench.save_load import describe_machine  # noqa: E402
from bench.verify import _children_cpu as children_cpu, run_cli  # noqa: E402
from tests.support import ServerProcess  # noqa: E402

PY = sys.executable
REF = "bench/direct"
SETTINGS = ("0", "1")  # CKPTD_DIRECT_IO: the default (page cache), then O_DIRECT


def save_source(root: Path, gib: float, log: Path) -> int:
    import torch

    from ckptd_client import CheckpointClient

    cols = 2048
    rows = 2049  # odd: the dp=2 split is uneven
    n = max(1, round(gib * (1 << 30) / (rows * cols * 4)))
    if gib * (1 << 30) < rows * cols * 4:  # tiny runs (the smoke test): one smaller matrix
        rows = max(3, int(gib * (1 << 30) / (cols * 4)) | 1)
    g = torch.Generator().manual_seed(0)
    state = {f"layer{i}.weight": torch.randn(rows, cols, generator=g) for i in range(n)}
    server = ServerProcess(root, log=log)
    server.start()
    try:
        client = CheckpointClient(server.url)
        client.save(state, REF).wait()
        client.close()
    finally:
        server.stop()
    return sum(t.numel() * 4 for t in state.values())


def timed(cmd: list[str], direct: str, timeout: float) -> dict:
    """One process under ``CKPTD_DIRECT_IO=direct``: wall, CPU (``RUSAGE_CHILDREN`` before and after), and its
    last JSON line."""
    before = sum(children_cpu())
    rec = run_cli(cmd, timeout, env={"CKPTD_DIRECT_IO": direct})
    return {"wall_s": rec["wall_s"], "cpu_s": sum(children_cpu()) - before, "json": rec["report"]}


def pairs(name: str, n: int, cmd_of: Any, cleanup: Any, files: list[Path], timeout: float) -> list[dict]:
    runs = []
    for i in range(n):
        order = SETTINGS if i % 2 == 0 else SETTINGS[::-1]
        for direct in order:
            os.sync()
            evict(files)
            rec = timed(cmd_of(direct, i), direct, timeout)
            cleanup(direct, i)
            rec.update(pair=i, direct=direct)
            runs.append(rec)
            print(f"[{name}] pair {i} CKPTD_DIRECT_IO={direct}: wall {rec['wall_s']:.2f} s, cpu {rec['cpu_s']:.2f} s",
                  flush=True)
    return runs


def summarise(runs: list[dict]) -> dict:
    out = {}
    for direct in SETTINGS:
        mine = [r for r in runs if r["direct"] == direct]
        walls = [r["wall_s"] for r in mine]
        out[direct] = {"wall_s": statistics.median(walls), "wall_min_s": min(walls), "wall_max_s": max(walls),
                       "cpu_s": statistics.median(r["cpu_s"] for r in mine)}
        inproc = [r["json"]["seconds"] for r in mine if isinstance(r.get("json"), dict) and "seconds" in r["json"]]
        if inproc:
            out[direct]["in_process_s"] = statistics.median(inproc)
    out["direct_over_default_wall"] = out["1"]["wall_s"] / out["0"]["wall_s"]
    out["direct_faster_in_pairs"] = sum(
        a["wall_s"] > b["wall_s"] for a in runs if a["direct"] == "0"
        for b in runs if b["direct"] == "1" and b["pair"] == a["pair"])
    return out


def markdown(res: dict) -> str:
    rows = ["| operation | setting | wall (median, min-max) | CPU user+sys | in process |", "| --- | --- | --- | --- | --- |"]
    for op in ("reshard", "export"):
        s = res["summary"][op]
        for direct, label in (("0", "page cache (default)"), ("1", "`CKPTD_DIRECT_IO=1`")):
            x = s[direct]
            inproc = f"{x['in_process_s']:.2f} s" if "in_process_s" in x else ""
            rows.append(f"| {op} | {label} | {x['wall_s']:.2f} s ({x['wall_min_s']:.2f}-{x['wall_max_s']:.2f}) | "
                        f"{x['cpu_s']:.2f} s | {inproc} |")
        rows.append(f"| {op} | direct / default, wall | {s['direct_over_default_wall']:.2f} "
                    f"(direct faster in {s['direct_faster_in_pairs']} of {res['config']['pairs']} pairs) | | |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gib", type=float, default=1.0, help="checkpoint size (GiB of fp32)")
    ap.add_argument("--pairs", type=int, default=6, help="pairs of processes per operation")
    ap.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "direct_io.json")
    add_workdir_args(ap)
    args = ap.parse_args(argv)
    t_start = time.perf_counter()
    with work_dir("ckptd-bench-directio-", args.workdir, args.keep) as work:
        root = work / "root"
        nbytes = save_source(root, args.gib, work / "server.log")
        files = [root]
        timeout = 120 + nbytes / (1 << 20) * 0.5
        reshard = pairs(
            "reshard", args.pairs,
            lambda d, i: [PY, "-m", "ckptd.cli.main", "reshard", REF, "--to", "fsdp2:dp=2", "--root", str(root),
                          "--out", f"bench/out{d}-{i}", "--json", "--jobs", "2", "--device", "cpu"],
            lambda d, i: shutil.rmtree(root / "runs" / "bench" / f"out{d}-{i}", ignore_errors=True),
            files, timeout)
        export = pairs(
            "export", args.pairs,
            lambda d, i: [PY, "-m", "ckptd.cli.main", "export", REF, str(work / f"export{d}"), "--root", str(root),
                          "--json"],
            lambda d, i: shutil.rmtree(work / f"export{d}", ignore_errors=True),
            files, timeout)
        res = {
            "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "command": "python -m bench.direct_io " + " ".join(sys.argv[1:] if argv is None else argv),
            "git": git_state(),
            "machine": describe_machine(work),
            "config": {"gib": args.gib, "pairs": args.pairs, "state_bytes": nbytes},
            "runs": {"reshard": reshard, "export": export},
            "summary": {"reshard": summarise(reshard), "export": summarise(export)},
            "wall_s": time.perf_counter() - t_start,
        }
        write_report(args.out, res, markdown(res))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
