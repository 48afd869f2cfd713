"""Scale as users run it: one real ``CheckpointClient`` rank in a process group of R ranks, beside DCP's rank.

    .venv/bin/python -m bench.scale_client --ranks 64,1024,10000 --tensors 200 --out bench/results/scale_client.json

``bench.scale`` times the service under R simulated ranks; this times what one rank's own process pays.
Per world size R, against a real ``ckptd serve`` (its own process, fresh root):

1. **seed**: R simulated ranks save ``scale/wR`` over the wire (``bench.scale._save``): a checkpoint of R
   FSDP row bands (2 rows x 8 bf16 columns) of each of T tensors, for the rank to load.
2. **DCP's coordinator**, in a fresh process, not timed: ``DefaultSavePlanner.create_global_plan`` over the
   R local plans of the same layout (as ``bench.manifest.run_dcp``), and the ``.metadata`` a
   ``FileSystemWriter`` would write (``storage_data`` included: one entry per item). What it sends rank 0
   (its final save plan) and the ``.metadata`` are pickled to files.
3. **the rank**, in a fresh process: rank 0 of torch's fake process group of R ranks (every collective
   carries this rank's real payload; the other ranks' parts are not run), ``LOCAL_WORLD_SIZE=8``, its
   state dict T DTensors ``Shard(0)`` over a mesh of R. Timed per call, CPU seconds of the whole process
   (``time.process_time``, its threads included) and wall:

   - ckptd **load** of ``scale/wR`` (reads through the service, as from another host: ``direct_reads=False``);
   - ckptd **save** of a new checkpoint: the rank's whole part, up to its index stored. The session stays
     open (the other R-1 ranks never come), so the save is over when the handle's future is (read from
     ``SaveHandle._future``), not at ``wait()``, which is the commit's;
   - DCP **save**, a non-coordinator's share: ``create_local_plan`` over the same DTensors, pickle it (its
     gather to the coordinator), unpickle its final plan (the scatter), ``finish_plan``;
   - DCP **load**, the same: unpickle the whole ``.metadata`` (every rank reads it), ``set_up_planner`` and
     ``create_local_plan`` (its read items), pickle it, unpickle the plan sent back, ``finish_plan``.

   The first call of each, then the least of the later ones (``--repeats``). The service's CPU during each
   ckptd call is read from ``/proc`` beside it. Then one more load and save with torch.distributed's
   collectives wrapped, to list each collective's calls and the bytes this rank sends and receives.

Not timed: DCP's bytes moved (its ``write_data`` / ``read_data``) and its gather of write results, while
ckptd's calls include moving the rank's bytes (12.8 KB at T=200) over HTTP: the comparison is of the
metadata work, which is all the work at this size. The client's check that every rank makes the same call
(``ckptd_client._join``: five store requests per rank) runs against the process group's store, which
answers for the R-1 absent ranks: each round's arrival count (``ckptd/join/k/n``) is credited with their
R-1 arrivals when this rank adds its own.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import pickle
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any, Callable

from ._report import work_dir, write_report
from .manifest import COLS, ROWS_PER_RANK
from .scale import RUN, _proc_cpu, _save, serve_world

REPO = Path(__file__).resolve().parents[1]

HOST_RANKS = 8  # LOCAL_WORLD_SIZE, as torchrun sets it on a host of 8 GPUs


def _fresh(fn: Callable, *args: object) -> dict:
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(fn, *args).result() or {}


# -- DCP's coordinator (fresh process, not timed) -------------------------------------------------------

def _dcp_coordinator(world: int, tensors: int, work: str) -> dict:
    """The global save plan and ``.metadata`` of the layout; rank 0's final plan and the metadata pickled."""
    import torch
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
    from torch.distributed.checkpoint.planner import SavePlan, TensorWriteData, WriteItem, WriteItemType

    props, size = TensorProperties(dtype=torch.bfloat16), torch.Size([ROWS_PER_RANK * world, COLS])
    plans = []
    for r in range(world):
        offsets = torch.Size([r * ROWS_PER_RANK, 0])
        chunk = ChunkStorageMetadata(offsets=offsets, sizes=torch.Size([ROWS_PER_RANK, COLS]))
        items = [WriteItem(index=MetadataIndex(f"model.layers.{t}.weight", offsets), type=WriteItemType.SHARD,
                           tensor_data=TensorWriteData(chunk=chunk, properties=props, size=size))
                 for t in range(tensors)]
        plans.append(SavePlan(items, planner_data={it.index.fqn: (it.index.fqn,) for it in items}))
    t0 = time.perf_counter()
    finals, metadata = DefaultSavePlanner().create_global_plan(plans)
    nbytes = ROWS_PER_RANK * COLS * 2
    metadata.storage_data = {it.index: _StorageInfo(f"__{r}_0.distcp", i * nbytes, nbytes)
                             for r, p in enumerate(finals) for i, it in enumerate(p.items)}
    Path(work, "final_plan.pkl").write_bytes(pickle.dumps(finals[0]))
    raw = pickle.dumps(metadata)
    Path(work, "metadata.pkl").write_bytes(raw)
    return {"dcp_coordinator_wall_s": time.perf_counter() - t0, "dcp_metadata_bytes": len(raw)}


# -- the rank (fresh process) ---------------------------------------------------------------------------

def _store(world: int) -> Any:
    """A HashStore that answers for the R-1 absent ranks of ``ckptd_client._join``'s rounds (module docstring)."""
    import torch.distributed as dist

    class OtherRanks(dist.Store):
        def __init__(self) -> None:
            super().__init__()
            self.s, self.counted = dist.HashStore(), set()

        def add(self, key: str, n: int) -> int:
            if n and "ckptd/join/" in key and key.endswith("/n") and key not in self.counted:
                self.counted.add(key)
                n += world - 1
            return self.s.add(key, n)

        def set(self, key: str, value: Any) -> None:
            self.s.set(key, value)

        def get(self, key: str) -> bytes:
            return self.s.get(key)

        def compare_set(self, key: str, expected: Any, desired: Any) -> bytes:
            return self.s.compare_set(key, expected, desired)

        def append(self, key: str, value: Any) -> None:
            self.s.append(key, value)

        def wait(self, keys: list[str], timeout: Any = None) -> None:
            self.s.wait(keys, timeout) if timeout is not None else self.s.wait(keys)

        def check(self, keys: list[str]) -> bool:
            return self.s.check(keys)

        def delete_key(self, key: str) -> bool:
            return self.s.delete_key(key)

        def set_timeout(self, timeout: Any) -> None:
            self.s.set_timeout(timeout)

        def num_keys(self) -> int:
            return self.s.num_keys()

    return OtherRanks()


def _counting() -> list[tuple[str, int, int]]:
    """Wrap torch.distributed's collectives the client calls; each outermost call logs (name, bytes this
    rank sends, bytes it receives): objects as pickled, tensors as their bytes."""
    import torch.distributed as dist

    log: list[tuple[str, int, int]] = []
    depth = [0]

    def size(name: str, a: tuple, kw: dict) -> tuple[int, int]:
        if name == "all_reduce":
            return (n := a[0].nelement() * a[0].element_size()), n
        if name in ("send", "recv"):
            n = a[0].nelement() * a[0].element_size()
            return (n, 0) if name == "send" else (0, n)
        if name == "all_gather_object":
            n = len(pickle.dumps(a[1]))
            return n, n * len(a[0])
        if name == "broadcast_object_list":
            return 0, sum(len(pickle.dumps(o)) for o in a[0])
        if name == "gather_object":
            return len(pickle.dumps(a[0])), 0
        if name == "scatter_object_list":
            return 0, len(pickle.dumps(a[0][0]))
        return 0, 0

    def wrap(name: str) -> None:
        real = getattr(dist, name)

        def call(*a: Any, **kw: Any) -> Any:
            depth[0] += 1
            try:
                return real(*a, **kw)
            finally:
                depth[0] -= 1
                if depth[0] == 0:
                    log.append((name, *size(name, a, kw)))
        setattr(dist, name, call)

    for name in ("all_reduce", "all_gather_object", "broadcast_object_list", "gather_object",
                 "scatter_object_list", "send", "recv", "barrier", "new_group"):
        wrap(name)
    return log


def _summed(calls: list[tuple[str, int, int]]) -> dict:
    out: dict = {}
    for name, sent, got in calls:
        s = out.setdefault(name, {"calls": 0, "bytes_sent": 0, "bytes_received": 0})
        s["calls"] += 1
        s["bytes_sent"] += sent
        s["bytes_received"] += got
    return out


def _rank(url: str, pid: int, world: int, tensors: int, repeats: int, work: str) -> dict:
    """Rank 0 of the fake group: ckptd's load and save, DCP's shares, each timed (module docstring)."""
    os.environ.update(LOCAL_WORLD_SIZE=str(HOST_RANKS), LOCAL_RANK="0")
    import torch
    import torch.distributed as dist
    import torch.testing._internal.distributed.fake_pg  # noqa: F401  (registers the "fake" backend)
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    from ckptd_client import CheckpointClient

    store = _store(world)  # held here: the group holds only its C++ half, whose Python methods die with it
    dist.init_process_group("fake", store=store, rank=0, world_size=world)
    mesh = init_device_mesh("cpu", (world,))
    names = [f"model.layers.{t}.weight" for t in range(tensors)]

    def state() -> dict:
        return {n: DTensor.from_local(torch.zeros(ROWS_PER_RANK, COLS, dtype=torch.bfloat16), mesh, [Shard(0)],
                                      run_check=False, shape=torch.Size([ROWS_PER_RANK * world, COLS]),
                                      stride=(COLS, 1)) for n in names}

    def timed(fn: Callable[[dict], Any], service: bool) -> list[dict]:
        got = []
        for _ in range(repeats):
            sd = state()
            s0, c0, t0 = _proc_cpu(pid) if service else 0.0, time.process_time(), time.perf_counter()
            fn(sd)
            row = {"cpu_s": time.process_time() - c0, "wall_s": time.perf_counter() - t0}
            if service:
                row["service_cpu_s"] = _proc_cpu(pid) - s0
            got.append(row)
        return got

    saves = iter(range(10 ** 6))
    ref = f"{RUN}/w{world}"
    final_raw, md_raw = Path(work, "final_plan.pkl").read_bytes(), Path(work, "metadata.pkl").read_bytes()

    def dcp_save(sd: dict) -> None:
        planner = DefaultSavePlanner()
        planner.set_up_planner(sd, None, False)
        pickle.dumps(planner.create_local_plan())  # gathered to the coordinator
        planner.finish_plan(pickle.loads(final_raw))  # scattered back

    def dcp_load(sd: dict) -> None:
        planner = DefaultLoadPlanner()
        planner.set_up_planner(sd, pickle.loads(md_raw), False)
        raw = pickle.dumps(planner.create_local_plan())
        planner.finish_plan(pickle.loads(raw))

    c = CheckpointClient(url, direct_reads=False)
    try:
        out = {"ckptd_load": timed(lambda sd: c.load(sd, ref), True),
               "ckptd_save": timed(lambda sd: c.save(sd, f"{RUN}/c{world}-{next(saves)}")._future.result(), True),
               "dcp_save": timed(dcp_save, False), "dcp_load": timed(dcp_load, False)}
        log = _counting()
        c.load(state(), ref)
        loaded = len(log)
        c.save(state(), f"{RUN}/c{world}-{next(saves)}")._future.result()
    finally:  # the saves stay open (the other ranks never come): not waited for
        c.close(wait=False)
    out.update(ckptd_load_collectives=_summed(log[:loaded]), ckptd_save_collectives=_summed(log[loaded:]))
    planner = DefaultSavePlanner()
    planner.set_up_planner(state(), None, False)
    out["dcp_save_collectives"] = {"plan_sent": len(pickle.dumps(planner.create_local_plan())),
                                   "plan_received": len(final_raw)}
    planner = DefaultLoadPlanner()
    planner.set_up_planner(state(), pickle.loads(md_raw), False)
    sent = len(pickle.dumps(planner.create_local_plan()))
    out["dcp_load_collectives"] = {"plan_sent": sent, "plan_received": sent, "metadata_read": len(md_raw)}
    return out


# -- one world size -------------------------------------------------------------------------------------

def _first_later(runs: list[dict]) -> dict:
    later = runs[1:] or runs
    best = min(later, key=lambda r: r["cpu_s"])
    return {"first": runs[0], "later": best}


def run_world(world: int, tensors: int, repeats: int, work: Path) -> dict:
    srv, pid = serve_world(world, work)
    out: dict = {"ranks": world, "tensors": tensors}
    try:
        t0 = time.perf_counter()
        asyncio.run(_save(srv.url, pid, f"w{world}", world, tensors, wait=False))
        out["seed_wall_s"] = time.perf_counter() - t0
        dcp_dir = work / f"dcp-{world}"
        dcp_dir.mkdir()
        out.update(_fresh(_dcp_coordinator, world, tensors, str(dcp_dir)))
        got = _fresh(_rank, srv.url, pid, world, tensors, repeats, str(dcp_dir))
    finally:
        srv.stop()
    for k in ("ckptd_load", "ckptd_save", "dcp_load", "dcp_save"):
        out[k] = _first_later(got.pop(k))
    out.update(got)
    return out


def _table(rows: list[dict]) -> str:
    def cell(r: dict, k: str, when: str) -> str:
        x = r[k][when]
        return f"{x['cpu_s']:.3f} / {x['wall_s']:.3f}"

    head = ("| ranks x tensors | ckptd load (first) | DCP load (first) | ckptd save: first, later | DCP save: first, "
            "later | service CPU-s per load, later save | ckptd collectives per load / save: calls, KB sent, "
            "KB received |\n"
            + "| --- " * 7 + "|\n")
    lines = []
    for r in rows:
        coll = " / ".join(
            f"{sum(v['calls'] for v in r[k].values())}, {sum(v['bytes_sent'] for v in r[k].values()) / 1e3:.1f}, "
            f"{sum(v['bytes_received'] for v in r[k].values()) / 1e3:.1f}"
            for k in ("ckptd_load_collectives", "ckptd_save_collectives"))
        lines.append(f"| {r['ranks']:,} x {r['tensors']} | {cell(r, 'ckptd_load', 'later')} "
                     f"({cell(r, 'ckptd_load', 'first')}) | {cell(r, 'dcp_load', 'later')} "
                     f"({cell(r, 'dcp_load', 'first')}) | "
                     f"{cell(r, 'ckptd_save', 'first')}, {cell(r, 'ckptd_save', 'later')} | "
                     f"{cell(r, 'dcp_save', 'first')}, {cell(r, 'dcp_save', 'later')} | "
                     f"{r['ckptd_load']['later']['service_cpu_s']:.2f}, "
                     f"{r['ckptd_save']['later']['service_cpu_s']:.2f} | "
                     f"{coll} |")
    return ("One rank's CPU-s / wall s per call (later: the least CPU of the later calls; DCP: its metadata share "
            "only, bytes not moved).\n\n"
            + head + "\n".join(lines) + "\n")


def _ratios(rows: list[dict]) -> dict:
    """Each call's CPU at the largest world size over its CPU at the smallest (``..._cpu_growth``)."""
    lo, hi = rows[0], rows[-1]
    out: dict = {"worlds": [lo["ranks"], hi["ranks"]]}
    for k in ("ckptd_load", "ckptd_save", "dcp_load", "dcp_save"):
        for w in ("first", "later"):
            out[f"{k}_{w}_cpu_growth"] = hi[k][w]["cpu_s"] / lo[k][w]["cpu_s"]
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ranks", default="64,1024", help="world sizes, comma-separated")
    ap.add_argument("--tensors", type=int, default=200)
    ap.add_argument("--repeats", type=int, default=4, help="calls of each kind (the first, then later ones)")
    ap.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "scale_client.json")
    args = ap.parse_args(argv)
    rows, t0 = [], time.perf_counter()
    with work_dir("ckptd-scale-client-") as work:
        for world in (int(x) for x in args.ranks.split(",")):
            rows.append(run_world(world, args.tensors, max(2, args.repeats), work))
            print(json.dumps(rows[-1]), flush=True)
    write_report(args.out, {"rows": rows, "command": " ".join(sys.argv), "summary": _ratios(rows),
                            "load_average_1m": os.getloadavg()[0], "wall_s": time.perf_counter() - t0},
                 _table(rows))


if __name__ == "__main__":
    main()
