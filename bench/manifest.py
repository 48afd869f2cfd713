"""Commit at scale: merge and commit a simulated N ranks x 500 tensors, and the service's memory doing it.

    .venv/bin/python -m bench.manifest --ranks 1024 --tensors 500 --repeat 3
    .venv/bin/python -m bench.manifest --ranks 10000 --tensors 500 --repeat 1

Each simulated rank uploads one real data file through the service's session
store (local storage in a temp dir) and an index with one FSDP-style row band
of every tensor. Every step runs in its own fresh process, so that what is
measured is the service's work and memory, not the simulation's:

1. ``populate`` uploads every rank's data file into two sessions through
   ``SessionStore``, and writes the cold session's indexes straight into
   storage (where other replicas' ``put_index`` calls would have put them).
2. ``warm`` is the service receiving the indexes of the warm session: each
   rank's request body is built, parsed as the HTTP route parses it and given
   to ``SessionStore.put_index`` (timed: the per-rank validation a real upload
   pays), then dropped; the last call commits: read every index back (the
   parsed ones still cached are reused when their bytes match), merge, check
   bounds, tiling and every stored byte, write the manifest and the marker.
   Its time less a median ``put_index`` is the commit (its CPU seconds are
   the whole last call's).
3. ``cold`` commits the cold session from storage alone (every index parsed),
   as a replica that received none of the indexes would, in a process that
   did nothing before.

Peak memory is each process's peak RSS (``VmHWM``): for the warm commit, the
peak from the last ``put_index`` on (reset through ``/proc/self/clear_refs``
just before it) and the peak over the whole session; for the cold one, the
process's peak. Each is reported with the process's RSS before the work (the
interpreter and imports), and set against the manifest's size.

The peer is PyTorch DCP's coordinator step for the same layout: the
``DefaultSavePlanner.create_global_plan`` over N local plans (dedup and
global metadata) plus pickling the ``Metadata`` as ``.metadata`` is written,
in its own process too. Its local plans alone outgrow this machine's memory at
some size, so it is skipped above ``--dcp-max-ranks`` (the output says so).
"""

from __future__ import annotations

import argparse
import gc
import io
import json
import multiprocessing
import os
import pickle
import random
import statistics
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable

import xxhash

from ._report import write_report

ROWS_PER_RANK = 2
COLS = 8
ITEM = 2  # bfloat16
RUN = "scale"
DCP_MAX_RANKS = 4096


def _rank(rank: int, world: int, tensors: int) -> tuple[str, bytes, bytes]:
    """One rank's data file name, its bytes and its index as the client sends it (columns): each
    chunk's bytes distinct, with their true digest (the commit re-hashes every chunk)."""
    file, n = f"r{rank:06d}-0000.bin", ROWS_PER_RANK * COLS * ITEM
    data = random.Random(rank).randbytes(64 * tensors)
    body = {
        "rank": rank, "world_size": world, "files": [file],
        "tensor_table": {"name": [f"model.layers.{t}.weight" for t in range(tensors)],
                         "shape": [[ROWS_PER_RANK * world, COLS]] * tensors, "dtype": ["bfloat16"] * tensors,
                         "group": ["model"] * tensors, "placement": ["(Shard(dim=0),)"] * tensors},
        "chunk_table": {"tensor": list(range(tensors)), "offsets": [[rank * ROWS_PER_RANK, 0]] * tensors,
                        "sizes": [[ROWS_PER_RANK, COLS]] * tensors, "file": [file] * tensors,
                        "offset": [t * 64 for t in range(tensors)], "length": [n] * tensors,
                        "xxh3": [xxhash.xxh3_64_hexdigest(data[t * 64:t * 64 + n]) for t in range(tensors)]},
    }
    return file, data, json.dumps(body, separators=(",", ":")).encode()


def _memory() -> dict[str, int]:
    """This process's resident and peak resident memory, bytes."""
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(("VmRSS:", "VmHWM:")):
                out[line[:5]] = int(line.split()[1]) * 1024
    return out


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def _sessions(trial: int) -> dict[str, tuple[str, str]]:
    return {kind: (f"t{trial}{kind}", f"s{trial:04d}{kind}") for kind in ("warm", "cold")}


def populate(root: str, world: int, tensors: int, trial: int) -> None:
    """Step 1: both sessions' data files, and the cold session's indexes."""
    from ckptd.storage.local import LocalStorage
    from ckptd.store.intake import recorded_file
    from ckptd.store.rank_indexes import BatchWriter
    from ckptd.store.records import arrival_of
    from ckptd.store.session_reads import read_meta
    from ckptd.store.sessions import SessionStore
    from ckptd_schemas import OpenSession

    store = SessionStore(LocalStorage(Path(root)))
    for kind, (name, sid) in _sessions(trial).items():
        store.open(RUN, name, OpenSession(session=sid, world_size=world, step=trial))
        for r in range(world):
            file, data, body = _rank(r, world, tensors)
            sink = store.intake.receive(RUN, name, sid, file)
            sink.write(data)
            sink.finish(None)
            if kind == "cold":  # stored as a replica stores the indexes it checked, one by one
                records = {file: (recorded_file(store.storage, RUN, name, sid, file),
                                  arrival_of(store.storage, RUN, name, sid, file))}
                BatchWriter(store.storage).store(RUN, name, sid, read_meta(store.storage, RUN, name, sid)
                                                 .created_at.isoformat(), r, body, records)


def warm(root: str, world: int, tensors: int, trial: int) -> dict:
    """Step 2: every index through ``put_index``; the last call commits."""
    from ckptd.storage.local import LocalStorage
    from ckptd.store.sessions import SessionStore
    from ckptd_schemas import RankIndex

    name, sid = _sessions(trial)["warm"]
    store = SessionStore(LocalStorage(Path(root)))
    gc.collect()
    start = _memory()["VmRSS"]
    put_times = []
    for r in range(world):
        body = _rank(r, world, tensors)[2]
        if r == world - 1:  # the session so far, then the commit's own peak
            session = _memory()
            _reset_peak()
        t0, c0 = time.perf_counter(), time.process_time()
        st = store.put_index(RUN, name, sid, RankIndex.model_validate_json(body))
        put_times.append(time.perf_counter() - t0)
        del body
    assert st.state == "committed", st
    median = statistics.median(put_times[:-1]) if world > 1 else 0.0
    return {"put_index_median_s": median, "commit_s": put_times[-1] - median,
            "commit_cpu_s": time.process_time() - c0, "warm_start_rss": start,
            "warm_session_rss": session["VmRSS"], "warm_session_peak_rss": session["VmHWM"],
            "warm_commit_peak_rss": _memory()["VmHWM"]}


def cold(root: str, world: int, tensors: int, trial: int) -> dict:
    """Step 3: a fresh store commits the other session from storage alone; then the manifest is read back."""
    from ckptd.storage.local import LocalStorage
    from ckptd.store.paths import Paths
    from ckptd.store.sessions import SessionStore
    from ckptd_schemas import Manifest

    name, sid = _sessions(trial)["cold"]
    store = SessionStore(LocalStorage(Path(root)))
    gc.collect()
    start = _memory()["VmRSS"]
    t0, c0 = time.perf_counter(), time.process_time()
    digest = store.committer.commit(RUN, name, sid)
    out = {"commit_cold_s": time.perf_counter() - t0, "commit_cold_cpu_s": time.process_time() - c0,
           "cold_start_rss": start,
           "cold_commit_peak_rss": _memory()["VmHWM"]}
    raw = store.storage.read(Paths.manifest(RUN, name, sid, digest))
    t0 = time.perf_counter()
    m = Manifest.model_validate_json(raw)
    out["manifest_read_s"] = time.perf_counter() - t0
    out["manifest_bytes"] = len(raw)
    assert len(m.tensors) == tensors and sum(len(t.table) for t in m.tensors) == world * tensors
    return out


def run_dcp(world: int, tensors: int) -> dict:
    import torch
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, TensorProperties
    from torch.distributed.checkpoint.planner import (
        SavePlan, TensorWriteData, WriteItem, WriteItemType,
    )
    from torch.distributed.checkpoint.metadata import MetadataIndex

    props = TensorProperties(dtype=torch.bfloat16)
    plans = []
    for r in range(world):
        items = []
        for t in range(tensors):
            fqn = f"model.layers.{t}.weight"
            offsets = torch.Size([r * ROWS_PER_RANK, 0])
            items.append(WriteItem(
                index=MetadataIndex(fqn, offsets), type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(chunk=ChunkStorageMetadata(offsets=offsets,
                                                                       sizes=torch.Size([ROWS_PER_RANK, COLS])),
                                            properties=props, size=torch.Size([ROWS_PER_RANK * world, COLS]))))
        plans.append(SavePlan(items, planner_data={it.index.fqn: (it.index.fqn,) for it in items}))
    planner = DefaultSavePlanner()
    gc.collect()
    t0, c0 = time.perf_counter(), time.process_time()
    _, metadata = planner.create_global_plan(plans)
    buf = io.BytesIO()
    pickle.dump(metadata, buf)
    return {"global_plan_s": time.perf_counter() - t0, "global_plan_cpu_s": time.process_time() - c0,
            "metadata_bytes": buf.tell(),
            "dcp_peak_rss": _memory()["VmHWM"]}


def _in_fresh_process(fn: Callable, *args: object) -> dict:
    """``fn(*args)`` in a new interpreter (spawned), so its peak RSS is its own."""
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(fn, *args).result() or {}


def trial(root: str, world: int, tensors: int, i: int, dcp: bool) -> dict:
    _in_fresh_process(populate, root, world, tensors, i)
    got = {"index_bytes_per_rank": len(_rank(0, world, tensors)[2]), "load_average_1m": os.getloadavg()[0]}
    got.update(_in_fresh_process(warm, root, world, tensors, i))
    got.update(_in_fresh_process(cold, root, world, tensors, i))
    if dcp:
        got.update(_in_fresh_process(run_dcp, world, tensors))
    return got


def _summary(args: argparse.Namespace, trials: list[dict], dcp: bool) -> dict:
    med = {k: statistics.median(t[k] for t in trials) for k in trials[0]}
    mb = 1e6
    out = {
        "ranks": args.ranks, "tensors": args.tensors, "chunks": args.ranks * args.tensors,
        "commit_s": med["commit_s"], "goal_commit_s": 2.0, "commit_cold_s": med["commit_cold_s"],
        "commit_cpu_s": med["commit_cpu_s"], "commit_cold_cpu_s": med["commit_cold_cpu_s"],
        "manifest_read_s": med["manifest_read_s"], "manifest_mb": med["manifest_bytes"] / mb,
        "put_index_median_ms": med["put_index_median_s"] * 1e3,
        "warm_commit_peak_rss_mb": med["warm_commit_peak_rss"] / mb,
        "warm_session_peak_rss_mb": med["warm_session_peak_rss"] / mb,
        "warm_start_rss_mb": med["warm_start_rss"] / mb,
        "cold_commit_peak_rss_mb": med["cold_commit_peak_rss"] / mb, "cold_start_rss_mb": med["cold_start_rss"] / mb,
    }
    out["cold_commit_rss_growth_per_manifest_byte"] = \
        (med["cold_commit_peak_rss"] - med["cold_start_rss"]) / med["manifest_bytes"]
    out["cold_commit_rss_growth_per_rank_kb"] = (med["cold_commit_peak_rss"] - med["cold_start_rss"]) / args.ranks / 1e3
    if dcp:
        out.update(dcp_global_plan_s=med["global_plan_s"], dcp_peak_rss_mb=med["dcp_peak_rss"] / mb,
                   commit_ratio_vs_dcp_global_plan=med["global_plan_s"] / med["commit_s"],
                   commit_cold_ratio_vs_dcp_global_plan=med["global_plan_s"] / med["commit_cold_s"])
    else:
        out.update(dcp_global_plan_s=None, commit_ratio_vs_dcp_global_plan=None,
                   dcp_skipped=f"DCP peer not run above --dcp-max-ranks {args.dcp_max_ranks}")
    return out


def _table(args: argparse.Namespace, s: dict) -> str:
    dcp = (f"  DCP create_global_plan + pickle .metadata:                         {s['dcp_global_plan_s']:.2f} s, "
           f"peak RSS {s['dcp_peak_rss_mb']:.0f} MB\n" if s["dcp_global_plan_s"] is not None else
           f"  DCP create_global_plan: skipped ({s['dcp_skipped']})\n")
    return (f"{args.ranks} ranks x {args.tensors} tensors ({s['chunks']} chunks), median of {args.repeat}\n"
            f"  ckptd commit (read indexes, merge, check, write manifest + marker): {s['commit_s']:.2f} s "
            f"({s['commit_cpu_s']:.2f} CPU-s), "
            f"peak RSS {s['warm_commit_peak_rss_mb']:.0f} MB (session before it: peak "
            f"{s['warm_session_peak_rss_mb']:.0f} MB; process start {s['warm_start_rss_mb']:.0f} MB)\n"
            f"  ckptd commit from storage alone (a replica that saw no index):     {s['commit_cold_s']:.2f} s "
            f"({s['commit_cold_cpu_s']:.2f} CPU-s), "
            f"peak RSS {s['cold_commit_peak_rss_mb']:.0f} MB (process start {s['cold_start_rss_mb']:.0f} MB; "
            f"{s['cold_commit_rss_growth_per_manifest_byte']:.1f} bytes per manifest byte)\n"
            + dcp +
            f"  manifest {s['manifest_mb']:.1f} MB, read back in {s['manifest_read_s']:.2f} s; "
            f"put_index {s['put_index_median_ms']:.2f} ms per rank")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", type=int, default=1024)
    ap.add_argument("--tensors", type=int, default=500)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--dcp-max-ranks", type=int, default=DCP_MAX_RANKS,
                    help="skip the DCP peer above this many ranks (its plans alone outgrow the memory)")
    ap.add_argument("--gib", type=float, default=None, help="ignored (the harness's size knob)")
    ap.add_argument("--out", type=Path, default=Path("bench/results/manifest.json"))
    args = ap.parse_args()
    start = time.perf_counter()
    dcp = args.ranks <= args.dcp_max_ranks
    trials = []
    with tempfile.TemporaryDirectory(prefix="ckptd-bench-manifest-") as tmp:
        for i in range(args.repeat):
            got = trial(tmp, args.ranks, args.tensors, i, dcp)
            trials.append(got)
            print(f"trial {i}: " + ", ".join(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}"
                                            for k, v in got.items()), flush=True)
    summary = _summary(args, trials, dcp)
    command = f"python -m bench.manifest --ranks {args.ranks} --tensors {args.tensors} --repeat {args.repeat}"
    write_report(args.out, {"created": datetime.now(timezone.utc).isoformat(), "command": command,
                            "wall_s": time.perf_counter() - start, "trials": trials, "summary": summary},
                 _table(args, summary))


if __name__ == "__main__":
    main()
