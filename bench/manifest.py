"""Commit at scale: merge and commit a simulated 1,024 ranks x 500 tensors (issue 7 target: under 2 s).

    .venv/bin/python -m bench.manifest --ranks 1024 --tensors 500 --repeat 3

Each simulated rank uploads one real data file through the service's session
store (local storage in a temp dir) and an index with one FSDP-style row band
of every tensor. The indexes of all but the last rank go through
``SessionStore.put_index`` (timed: the per-rank validation a real upload pays);
the last one's call commits: read every index back (the parsed ones are reused
when their bytes match), merge, check bounds and tiling, write the manifest and
the marker. A second session is committed by a fresh store from storage alone
(every index parsed), as a replica that received none of them would. Reading
the committed manifest back (what every loader does first) is timed too.

The peer is PyTorch DCP's coordinator step for the same layout: the
``DefaultSavePlanner.create_global_plan`` over 1,024 local plans (dedup and
global metadata) plus pickling the ``Metadata`` as ``.metadata`` is written.
"""

from __future__ import annotations

import argparse
import gc
import io
import pickle
import random
import statistics
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

import xxhash

from ckptd_schemas import BoxChunk, Location, Manifest, OpenSession, RankIndex, TensorEntry

from ._report import write_report

ROWS_PER_RANK = 2
COLS = 8
ITEM = 2  # bfloat16


def _index(rank: int, world: int, tensors: int, file: str) -> tuple[RankIndex, bytes]:
    """One rank's index and its data file: each chunk's bytes distinct, with their true digest (the
    commit re-hashes every chunk from the stored bytes)."""
    n = ROWS_PER_RANK * COLS * ITEM
    data = random.Random(rank).randbytes(64 * tensors)
    entries = []
    for t in range(tensors):
        loc = Location(file=file, offset=t * 64, length=n, raw_length=n,
                       xxh3=xxhash.xxh3_64_hexdigest(data[t * 64:t * 64 + n]))
        entries.append(TensorEntry(name=f"model.layers.{t}.weight", shape=[ROWS_PER_RANK * world, COLS],
                                   dtype="bfloat16", group="model", placement="(Shard(dim=0),)",
                                   chunks=[BoxChunk(rank=rank, offsets=[rank * ROWS_PER_RANK, 0],
                                                    sizes=[ROWS_PER_RANK, COLS], location=loc)]))
    return RankIndex(rank=rank, world_size=world, tensors=entries, files=[file]), data


def run_ckptd(root: Path, world: int, tensors: int, trial: int) -> dict:
    """Two sessions of the same save: the usual one (every index through ``put_index``, the last
    one's call includes the commit) and a cold one (a fresh store commits from storage alone, as a
    replica that received none of the indexes would)."""
    from ckptd.storage.local import LocalStorage
    from ckptd.store.layout import Paths
    from ckptd.store.sessions import SessionStore

    uploads = [(f"r{r:06d}-0000.bin", *_index(r, world, tensors, f"r{r:06d}-0000.bin")) for r in range(world)]
    raws = [ix.model_dump_json().encode() for _, ix, _ in uploads]
    out: dict = {"index_bytes_per_rank": sum(map(len, raws)) // world}
    for kind in ("warm", "cold"):
        store = SessionStore(LocalStorage(root))
        run, name, sid = "scale", f"t{trial}{kind}", f"s{trial:04d}{kind}"
        store.open(run, name, OpenSession(session=sid, world_size=world, step=trial))
        put_times = []
        for r, ((fname, _, data), raw) in enumerate(zip(uploads, raws)):
            sink = store.begin_file(run, name, sid, fname)
            sink.write(data)
            sink.finish(None)
            if r < world - 1 or kind == "warm":
                t0 = time.perf_counter()
                st = store.put_index(run, name, sid, RankIndex.model_validate_json(raw))
                put_times.append(time.perf_counter() - t0)
            else:
                store.storage.put(Paths.rank_index(run, name, sid, r), raw)
        gc.collect()
        if kind == "warm":
            assert st.state == "committed", st
            digest = st.manifest_xxh3
            out["put_index_median_s"] = statistics.median(put_times[:-1])
            out["commit_s"] = put_times[-1] - out["put_index_median_s"]  # the last index's call, less its own part
        else:
            t0 = time.perf_counter()
            digest = SessionStore(LocalStorage(root)).commit(run, name, sid)
            out["commit_cold_s"] = time.perf_counter() - t0
    raw = store.storage.read(Paths.manifest(run, name, sid, digest))
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
    t0 = time.perf_counter()
    _, metadata = planner.create_global_plan(plans)
    buf = io.BytesIO()
    pickle.dump(metadata, buf)
    return {"global_plan_s": time.perf_counter() - t0, "metadata_bytes": buf.tell()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", type=int, default=1024)
    ap.add_argument("--tensors", type=int, default=500)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--gib", type=float, default=None, help="ignored (the harness's size knob)")
    ap.add_argument("--out", type=Path, default=Path("bench/results/manifest.json"))
    args = ap.parse_args()
    start = time.perf_counter()
    trials = []
    with tempfile.TemporaryDirectory(prefix="ckptd-bench-manifest-") as tmp:
        for i in range(args.repeat):
            got = run_ckptd(Path(tmp), args.ranks, args.tensors, i)
            got.update(run_dcp(args.ranks, args.tensors))
            trials.append(got)
            print(f"trial {i}: " + ", ".join(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}"
                                            for k, v in got.items()), flush=True)
    med = {k: statistics.median(t[k] for t in trials) for k in trials[0]}
    summary = {
        "ranks": args.ranks, "tensors": args.tensors, "chunks": args.ranks * args.tensors,
        "commit_s": med["commit_s"], "goal_commit_s": 2.0, "commit_cold_s": med["commit_cold_s"],
        "manifest_read_s": med["manifest_read_s"], "manifest_mb": med["manifest_bytes"] / 1e6,
        "put_index_median_ms": med["put_index_median_s"] * 1e3,
        "dcp_global_plan_s": med["global_plan_s"],
        "commit_ratio_vs_dcp_global_plan": med["global_plan_s"] / med["commit_s"],
        "commit_cold_ratio_vs_dcp_global_plan": med["global_plan_s"] / med["commit_cold_s"],
    }
    table = (f"{args.ranks} ranks x {args.tensors} tensors ({summary['chunks']} chunks), median of {args.repeat}\n"
             f"  ckptd commit (read indexes, merge, check, write manifest + marker): {summary['commit_s']:.2f} s "
             f"(goal < 2 s)\n"
             f"  ckptd commit from storage alone (a replica that saw no index):     {summary['commit_cold_s']:.2f} s\n"
             f"  DCP create_global_plan + pickle .metadata:                         {summary['dcp_global_plan_s']:.2f} s\n"
             f"  manifest {summary['manifest_mb']:.1f} MB, read back in {summary['manifest_read_s']:.2f} s; "
             f"put_index {summary['put_index_median_ms']:.2f} ms per rank")
    write_report(args.out, {"created": datetime.now(timezone.utc).isoformat(), "command": "python -m bench.manifest "
                            f"--ranks {args.ranks} --tensors {args.tensors} --repeat {args.repeat}",
                            "wall_s": time.perf_counter() - start, "trials": trials, "summary": summary}, table)


if __name__ == "__main__":
    main()
