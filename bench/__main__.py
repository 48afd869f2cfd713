"""One harness for every side-by-side comparison: ``python -m bench``.

    .venv/bin/python -m bench --gib 1 --repeat 3                  # everything, ~1 GiB states
    .venv/bin/python -m bench --gib 0.25 --only save_load,reshard  # a subset

Runs each suite below in its own process (they start servers and gloo ranks,
and time whole processes), one after the other on the same disk, then reads
their JSON results and writes ``bench/results/summary.json`` (every ratio next
to its goal, the machine, the command) and ``bench/results/summary.png`` (the
ratios as bars, goals as marks). A ratio is always peer time / ckptd time or
peer memory / ckptd memory, so larger is better for ckptd, except where the
goal says ``<=``.

Suites and what their size knob becomes:

======== ================================================ ===========================
suite    compares                                         size
======== ================================================ ===========================
save_load committed save, stall, load at another world    ``--mib`` = 512 x gib
          size vs ``dcp.save`` / ``dcp.async_save`` / ``dcp.load``
reshard  ``ckptd reshard`` vs ``dcp.load`` (+ save),       ``--gib`` = gib
          ``dcp_to_torch_save``; disk ceiling
dcp_io   ckptd's DCP writer vs ``FileSystemWriter``;       ``--gib`` = gib
          safetensors export vs dcp_to_torch_save+save_file
s3       save/load on S3 (moto) vs DCP's fsspec writer     ``--mib`` = 128 x gib
replicas two service replicas vs one, 4 saving ranks       ``--mib`` = 256 x gib
soak     16 ranks x 20 checkpoints, reshard and gc beside ``--mib`` = 64 x gib
verify   ``ckptd verify`` vs the disk's cold sequential   ``--gib`` = gib
         read bandwidth, same files
manifest commit of 1,024 ranks x 500 tensors vs DCP's    fixed
         ``create_global_plan`` on the same layout
incremental 5 saves, 90% of the weights frozen, vs     ``--mib`` = 512 x gib
         ``dcp.save``: time and bytes written
scale    64 to 10,000 simulated ranks x 200 tensors on    fixed
         the wire protocol: commit, the save's waits, one
         loading rank, reshard planning vs DCP's planner
scale_client one real client rank in a fake process group of fixed
         64 to 10,000 ranks x 200 tensors: load and save
         CPU and wall vs DCP's non-coordinator rank
gpu      one device (cuda, else cpu): stall, save, load   ``--gib`` = gib
         vs DCP and the D2H / write / read floors;
         ``ckptd reshard --device cpu|cuda|auto``
======== ================================================ ===========================
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results"


def _size(flag: str, per_gib: float) -> Callable[[float], list[str]]:
    return lambda gib: [flag, f"{gib * per_gib:g}"]


SUITES: dict[str, tuple[Callable[[float], list[str]], bool]] = {  # name -> (size args, takes --repeat)
    "save_load": (_size("--mib", 512), True),  # CheckpointClient defaults: snapshot buffer sized from the save
    "reshard": (_size("--gib", 1), True),
    "dcp_io": (_size("--gib", 1), True),
    "s3": (_size("--mib", 128), True),
    "tiers": (_size("--mib", 256), True),
    "replicas": (_size("--mib", 256), True),
    "soak": (_size("--mib", 64), False),
    "verify": (_size("--gib", 1), True),
    "manifest": (lambda gib: [], True),  # fixed scale: 1,024 ranks x 500 tensors
    "incremental": (_size("--mib", 512), False),
    "ui": (lambda gib: [], True),  # fixed scale: a run of 2,000 checkpoints in headless Chromium
    "scale": (lambda gib: ["--ranks", "64,1024,4096,10000"], False),  # simulated ranks: fixed scale
    "scale_client": (lambda gib: ["--ranks", "64,1024,10000"], False),  # one real rank in a fake group of R
    "gpu": (_size("--gib", 1), True),  # one device: cuda when available, else the same code on the CPU
}


def _get(d: dict, path: str) -> Any:
    for part in path.split("."):
        if not isinstance(d, dict) or part not in d:
            return None
        d = d[part]
    return d


# (suite, label, path into the suite's JSON, goal, direction): the table and the plot
RATIOS: list[tuple[str, str, str, float | None, str]] = [
    ("save_load", "committed save vs dcp.save", "summary.save_throughput_ratio", 1.5, ">="),
    ("save_load", "committed save vs the same bytes written + fsynced", "summary.ckptd_save_vs_raw", 0.9, ">="),
    ("save_load", "stall / dcp.save time", "summary.stall_ratio", 0.1, "<="),
    ("save_load", "stall / dcp.async_save blocking", "summary.stall_vs_async_ratio", 0.5, "<="),
    ("save_load", "stall / the same shards copied, nothing else", "summary.stall_vs_copy_floor", 1.1, "<="),
    ("save_load", "that copy / dcp.save time (lowest stall ratio possible)", "summary.stall_ratio_possible", None,
     "<="),
    ("save_load", "load at another world size vs dcp.load", "summary.load_throughput_ratio", 1.5, ">="),
    ("save_load", "same, every byte through HTTP (direct_reads=False)", "summary.load_cold_http_throughput_ratio",
     None, ">="),
    ("save_load", "cold load vs the same files read, nothing else", "summary.ckptd_cold_load_vs_raw", 0.9, ">="),
    ("save_load", "the service's CPU-s per GiB committed", "summary.server_cpu_s_per_gib_saved", 1.0, "<="),
    ("reshard", "reshard dp4->dp2 vs dcp.load", "summary.dp2_ratio_vs_dcp_load", 1.5, ">="),
    ("reshard", "reshard dp4->dp2 vs dcp.load+save", "summary.dp2_ratio_vs_dcp_load_save", None, ">="),
    ("reshard", "reshard full vs dcp_to_torch_save", "summary.full_ratio_vs_dcp_to_torch_save", 1.5, ">="),
    ("reshard", "reshard disk efficiency (dp2)", "summary.disk_efficiency_dp2", 0.7, ">="),
    ("reshard", "reshard via the service (warm worker) disk efficiency", "summary.disk_efficiency_service", 0.7,
     ">="),
    ("reshard", "ckptd reshard --server (whole process) disk efficiency (dp2)",
     "summary.disk_efficiency_cli_server_dp2", 0.7, ">="),
    ("dcp_io", "DCP writer via ckptd vs FileSystemWriter", "summary.save_throughput_ratio", 0.9, ">="),
    ("dcp_io", "safetensors export vs dcp_to_torch_save+save_file", "summary.export_ratio", 1.0, ">="),
    ("dcp_io", "export peak RSS / peer's peak RSS", "summary.export_peak_rss_fraction", 0.5, "<="),
    ("dcp_io", "export disk efficiency (whole process)", "summary.export_disk_efficiency", 0.7, ">="),
    ("s3", "save on S3 vs dcp.save (fsspec), direct uploads", "summary.save_throughput_ratio", 1.2, ">="),
    ("s3", "same, every byte through the service", "summary.save_service_throughput_ratio", None, ">="),
    ("s3", "load on S3 vs dcp.load (fsspec)", "summary.load_throughput_ratio", 1.2, ">="),
    ("tiers", "dcp.save to local disk / ckptd commit on the fast tier", "summary.commit_ratio", 0.9, ">="),
    ("tiers", "durable copy to S3 / moto's PUT throughput", "summary.durable_vs_put_floor", None, ">="),
    ("replicas", "two replicas vs one (save throughput)", "summary.two_over_one_throughput", None, ">="),
    ("verify", "ckptd verify vs cold sequential read", "summary.verify_ratio", 0.8, ">="),
    ("verify", "verify in the service's warm worker vs cold read", "summary.verify_service_ratio", 0.8, ">="),
    ("verify", "ckptd verify --server (ranges over HTTP) vs cold read", "summary.verify_server_ratio", None, ">="),
    ("manifest", "commit, 1024 ranks x 500 tensors (seconds)", "summary.commit_s", 2.0, "<="),
    ("manifest", "commit vs DCP global plan, same layout", "summary.commit_ratio_vs_dcp_global_plan", None, ">="),
    ("scale", "largest world: one loading rank's metadata fetched (MB)", "summary.rank_metadata_mb", 1.0, "<="),
    ("scale", "largest world: one loading rank's CPU-s, client + service", "summary.rank_cpu_s", 0.05, "<="),
    ("scale", "largest world: commit's service CPU / DCP's coordinator's CPU", "summary.commit_vs_dcp_coordinator",
     0.25,
     "<="),
    ("scale", "largest world: save's service CPU with the ranks' waits / without", "summary.waits_cpu_ratio", 1.3,
     "<="),
    ("scale_client", "one rank's load CPU, 10,000 / 64 ranks", "summary.ckptd_load_later_cpu_growth", 2.0, "<="),
    ("scale_client", "one rank's first save CPU, 10,000 / 64 ranks", "summary.ckptd_save_first_cpu_growth", 2.0,
     "<="),
    ("scale_client", "one rank's later save CPU, 10,000 / 64 ranks", "summary.ckptd_save_later_cpu_growth", 2.0,
     "<="),
    ("incremental", "later saves, 90% frozen: speed-up vs dcp.save", "summary.speedup_vs_dcp_median", 5.0, ">="),
    ("incremental", "later saves, 90% frozen: bytes written / dcp.save's", "summary.bytes_vs_dcp_median", 0.15,
     "<="),
    ("ui", "web view: run page of 2,000 checkpoints rendered (ms, warm median)", "summary.warm_ms", 1000.0, "<="),
    ("gpu", "load into device tensors, cold, vs dcp.load", "summary.load_vs_dcp", 1.2, ">="),
    ("gpu", "that load vs ckptd's files read cold, nothing else", "summary.load_vs_read_floor", 0.9, ">="),
    ("gpu", "first save's stall (s; goal at 4 GiB)", "summary.first_stall_s", 0.5, "<="),
    ("gpu", "later saves' stall / D2H copy into pinned memory", "summary.later_stall_vs_d2h", 1.1, "<="),
    ("gpu", "reshard --device auto / cpu, whole process (worse dtype)", "summary.reshard_auto_vs_cpu_whole", None,
     "<="),
]


def run_suite(name: str, gib: float, repeat: int, results: Path) -> tuple[int, float, Path]:
    size, takes_repeat = SUITES[name]
    out = results / f"{name}.json"
    cmd = [sys.executable, "-m", f"bench.{name}", *size(gib), "--out", str(out)]
    if takes_repeat:
        cmd += ["--repeat", str(repeat)]
    print(f"\n=== {name}: {' '.join(cmd[1:])}", flush=True)
    t0 = time.monotonic()
    rc = subprocess.call(cmd, cwd=REPO)
    return rc, time.monotonic() - t0, out


def summarize(results: dict[str, dict]) -> list[dict]:
    rows = []
    for suite, label, path, goal, direction in RATIOS:
        value = _get(results.get(suite, {}), path)
        met = None
        if isinstance(value, (int, float)) and goal is not None:
            met = value >= goal if direction == ">=" else value <= goal
        rows.append({"suite": suite, "measure": label, "value": value, "goal": goal, "direction": direction,
                     "met": met})
    return rows


def plot(rows: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shown = [r for r in rows if isinstance(r["value"], (int, float))]
    if not shown:
        return
    fig, ax = plt.subplots(figsize=(9, 0.45 * len(shown) + 1.2))
    ys = range(len(shown))
    colors = ["tab:green" if r["met"] else ("tab:red" if r["met"] is False else "tab:gray") for r in shown]
    ax.barh(list(ys), [r["value"] for r in shown], color=colors)
    for y, r in zip(ys, shown):
        if r["goal"] is not None:
            ax.plot([r["goal"]] * 2, [y - 0.4, y + 0.4], color="black", linewidth=2)
        ax.text(r["value"], y, f" {r['value']:.2f}", va="center", fontsize=8)
    ax.set_yticks(list(ys), [f"{r['measure']} ({r['direction']} {r['goal']})" if r["goal"] is not None
                             else f"{r['measure']} (no goal)" for r in shown], fontsize=8)
    ax.invert_yaxis()
    ax.axvline(1.0, color="gray", linestyle=":", linewidth=1)
    ax.set_xlabel("ratio as labelled (peer / ckptd unless it says otherwise); black mark = goal")
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gib", type=float, default=1.0, help="size knob (see the table in the module docstring)")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--only", default=",".join(SUITES), help=f"comma-separated subset of {','.join(SUITES)}")
    ap.add_argument("--summarize-only", action="store_true", help="only read existing results and plot")
    ap.add_argument("--results", type=Path, default=RESULTS, help="where suite results are read and written")
    args = ap.parse_args(argv)
    names = [n for n in args.only.split(",") if n]
    unknown = set(names) - set(SUITES)
    if unknown:
        ap.error(f"unknown suites {sorted(unknown)}; choose from {','.join(SUITES)}")
    runs = {}
    if not args.summarize_only:
        for name in names:
            rc, seconds, _ = run_suite(name, args.gib, args.repeat, args.results)
            runs[name] = {"rc": rc, "seconds": round(seconds, 1)}
    results = {}
    for name in SUITES:
        f = args.results / f"{name}.json"
        if f.exists():
            results[name] = json.loads(f.read_text())
    rows = summarize(results)
    summary = {"command": "python -m bench " + " ".join(argv if argv is not None else sys.argv[1:]),
               "machine": {"nproc": os.cpu_count(), "platform": platform.platform(), "python": sys.version.split()[0],
                           "load_avg_end": os.getloadavg()},
               "runs": runs, "ratios": rows,
               "sources": {n: f"{n}.json" for n in results}}
    (args.results / "summary.json").write_text(json.dumps(summary, indent=2, default=str))
    plot(rows, args.results / "summary.png", f"ckptd vs peers, {summary['command']} ({os.cpu_count()} CPUs)")
    for r in rows:
        v = "-" if r["value"] is None else f"{r['value']:.2f}"
        goal = "" if r["goal"] is None else f"{r['direction']} {r['goal']}"
        mark = {True: "met", False: "NOT met", None: ""}[r["met"]]
        print(f"{r['suite']:<9} {r['measure']:<52} {v:>6}  {goal:<7} {mark}")
    return 0 if all(v["rc"] == 0 for v in runs.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
