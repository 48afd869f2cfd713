"""Scale: R simulated ranks against one real ``ckptd serve``, beside DCP's own planner and metadata.

    .venv/bin/python -m bench.scale --ranks 64,1024 --tensors 200 --out bench/results/scale.json
    .venv/bin/python -m bench.scale --ranks 10000 --tensors 200 --sample 8 --out bench/results/scale-10000.json

Every rank holds one FSDP row band (2 rows x 8 bf16 columns) of each of T tensors: tiny bytes, so
that metadata is all the work. The ranks are simulated in this one process over real HTTP with the
documented wire protocol (``docs/http-api.md``): open or join the session, upload the rank's data
file with its digest, put its index; the service is a real ``ckptd serve`` on 127.0.0.1 (its own
process: its CPU seconds and peak RSS are read from ``/proc``). Per world size:

1. **save** twice, each a fresh checkpoint: once where every rank, its index sent, long-polls the
   session's status until it commits (what ``CheckpointClient.save(...).wait()`` does, polls of
   ``LONG_POLL_SECONDS``), once where no rank waits (the last index's answer says committed). The
   service's CPU seconds of each, and their ratio (the waits' cost). The last rank sends its index
   once every other one is stored: the service's CPU during that request is the commit's (last
   index to marker). Keep-alives are not sent (a save here takes minutes at most; a rank sends one
   every 30 s by default).
2. **resume**: ``--sample`` ranks spread over the world each do what a loading rank does before it
   reads bytes (``ckptd_client._loadtree``): fetch the load tree's head (hashed against the
   marker's root), its pieces for the rank's T bands (each checked against the head), plan the
   reads here. Per rank: bytes fetched, client CPU, service CPU (ranks one after another, so each
   delta is the rank's own), after a first rank that makes the service parse the manifest and build
   its load tree (measured apart: once per checkpoint and service process). The resume of every rank
   is that first rank's cost plus the sample's mean times R: **extrapolated**, and said so. ``--manifest-sample`` of them also load the way a checkpoint
   without a load tree is loaded (the whole manifest, the service's read plan), for the ratio.
3. **reshard planning** R -> R/2 (``fsdp2``) as a job runs it, over the committed root: the service's
   part in a fresh process (the outline: units cut from the layout, no read planned; CPU-s, peak RSS,
   the recorded summary's bytes), then ``--reshard-workers`` fresh processes at once, each reading the
   manifest, cutting the units and planning its share's reads one unit at a time (wall s, CPU-s and
   peak RSS of each; every target chunk is planned once in all, which the row checks); the job file a
   worker receives is measured too. Skipped above ``--reshard-max-ranks`` (said so).
4. **DCP**: ``DefaultSavePlanner.create_global_plan`` over the same R local plans plus pickling the
   ``Metadata`` (its coordinator), and one loading rank's share (unpickle the whole ``.metadata`` and
   ``create_read_items_for_chunk_list`` for its T bands), each in a fresh process; skipped above
   ``--dcp-max-ranks`` (the output says so).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import statistics
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Callable

import httpx
import xxhash

from ckptd_client.session_calls import LONG_POLL_SECONDS

from ._report import write_report
from .manifest import COLS, ROWS_PER_RANK, _rank, run_dcp

REPO = Path(__file__).resolve().parents[1]
if str(REPO / "tests") not in sys.path:
    sys.path.insert(0, str(REPO / "tests"))

from support import ServerProcess  # noqa: E402  (tests/support.py)

RUN = "scale"
UPLOADS_AT_ONCE = 32  # ranks uploading at one time (every rank waits at once)
RANKS_PER_CLIENT = 32


def _proc_cpu(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _peak_rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0


def _reset_peak(pid: int) -> None:
    with open(f"/proc/{pid}/clear_refs", "w") as f:
        f.write("5")


# -- save ------------------------------------------------------------------------------------------

async def _save(url: str, pid: int, name: str, world: int, tensors: int, *, wait: bool, shared: bool = False
                ) -> dict:
    """Every rank saves ``RUN/name``; with ``wait``, each long-polls until the commit. The last rank
    sends its index once every other rank's is stored, so that the service's CPU during that one
    request is the commit's (last index to marker), with the other ranks' waits beside it."""
    base = f"/v1/checkpoints/{RUN}/{name}"
    sid = f"scale-{name}"
    gate = asyncio.Semaphore(UPLOADS_AT_ONCE)
    others_in = asyncio.Event()
    stored = 0
    commit: dict = {}
    # A client per RANKS_PER_CLIENT ranks, as ranks have their own: one pool of a thousand connections
    # costs its owner O(connections) per response (httpcore), which would time the harness, not the service.
    # ``shared``: UPLOADS_AT_ONCE clients, rank r on client r % UPLOADS_AT_ONCE, each keeping its connection:
    # at 100,000 ranks a client per 32 ranks opens a connection per request, and the local ports left in
    # TIME_WAIT run out (connections refused minutes in).
    clients = [httpx.AsyncClient(base_url=url, timeout=600)
               for _ in range(UPLOADS_AT_ONCE if shared else -(-world // RANKS_PER_CLIENT))]
    try:
        c = clients[0]
        (await c.post(f"{base}/sessions", json={"session": sid, "world_size": world, "step": 1})).raise_for_status()

        async def rank(r: int) -> None:
            nonlocal stored
            c = clients[r % UPLOADS_AT_ONCE] if shared else clients[r // RANKS_PER_CLIENT]
            file, data, body = _rank(r, world, tensors)
            async with gate:
                (await c.post(f"{base}/sessions", json={"session": sid, "world_size": world, "step": 1})
                 ).raise_for_status()
                (await c.put(f"{base}/sessions/{sid}/files/{file}", content=data,
                             headers={"X-Ckptd-Xxh3": xxhash.xxh3_64_hexdigest(data)})).raise_for_status()
            last = r == world - 1
            if last:
                await others_in.wait()
                await asyncio.sleep(0.5)  # the waiters' polls settle
                cpu0 = _proc_cpu(pid)
            async with gate:
                st = await c.put(f"{base}/sessions/{sid}/ranks/{r}", content=body,
                                 headers={"Content-Type": "application/json"})
            st.raise_for_status()
            if last:
                assert st.json()["state"] == "committed", st.text[:300]
                commit["cpu"] = _proc_cpu(pid) - cpu0
            else:
                stored += 1
                if stored == world - 1:
                    others_in.set()
            while wait:
                st = await c.get(f"{base}/sessions/{sid}", params={"wait": LONG_POLL_SECONDS})
                st.raise_for_status()
                if st.json()["state"] != "open":
                    assert st.json()["state"] == "committed", st.text[:500]
                    return

        if world == 1:
            others_in.set()
        cpu0, t0 = _proc_cpu(pid), time.perf_counter()
        await asyncio.gather(*(rank(r) for r in range(world)))
        return {"service_cpu_s": _proc_cpu(pid) - cpu0, "wall_s": time.perf_counter() - t0,
                "commit_cpu_s": commit["cpu"]}
    finally:
        for client in clients:
            await client.aclose()


# -- resume ----------------------------------------------------------------------------------------

def _resume_rank(c: httpx.Client, pid: int, name: str, rank: int, world: int, tensors: int) -> dict:
    """What one loading rank does before it reads bytes (``ckptd_client._loadtree``), timed on both
    sides: the load tree's head (hashed against the marker's root), its pieces for the rank's T bands
    (each checked against the head), its read plan made here, every element covered."""
    from ckptd_schemas import ReadRequest, plan_reads
    from ckptd_schemas.api import LOAD_TREE_HEADER
    from ckptd_schemas.loadtree import LoadHead, check_covered, verify_answer

    cpu0, own0 = _proc_cpu(pid), time.process_time()
    r = c.get(f"/v1/checkpoints/{RUN}/{name}/load-tree")
    r.raise_for_status()
    head = LoadHead.parse(r.content, r.headers[LOAD_TREE_HEADER])
    reqs = [ReadRequest(name=n, offsets=[rank * ROWS_PER_RANK, 0], sizes=[ROWS_PER_RANK, COLS])
            for n in head.tensors()]
    p = c.post(f"/v1/checkpoints/{RUN}/{name}/load-tree",
               json={"requests": [q.model_dump(exclude_none=True) for q in reqs], "rank": rank})
    out = {"plan_status": p.status_code, "metadata_bytes": len(r.content) + len(p.content),
           "head_bytes": len(r.content), "answer_bytes": len(p.content)}
    if p.status_code == 200:
        part, _ = verify_answer(head, json.loads(p.content), reqs, rank)
        plan = plan_reads(part, reqs)
        check_covered(plan, reqs, part)
        assert len(plan.copies) == tensors, len(plan.copies)
    out.update(client_cpu_s=time.process_time() - own0, service_cpu_s=_proc_cpu(pid) - cpu0)
    return out


def _resume_rank_manifest(c: httpx.Client, pid: int, name: str, rank: int, tensors: int) -> dict:
    """The same through the whole manifest and the service's read plan (a checkpoint without a load
    tree): the path every rank took before load trees."""
    from ckptd_schemas import Manifest, ReadPlan

    cpu0, own0 = _proc_cpu(pid), time.process_time()
    r = c.get(f"/v1/checkpoints/{RUN}/{name}")
    r.raise_for_status()
    assert xxhash.xxh3_64_hexdigest(r.content) == r.headers["X-Ckptd-Manifest-Xxh3"]
    manifest = Manifest.model_validate_json(r.content)
    reqs = [{"name": t.name, "offsets": [rank * ROWS_PER_RANK, 0], "sizes": [ROWS_PER_RANK, COLS]}
            for t in manifest.tensors]
    p = c.post(f"/v1/checkpoints/{RUN}/{name}/read-plan", json={"requests": reqs})
    if p.status_code == 200:
        assert len(ReadPlan.model_validate_json(p.content).copies) == tensors
    return {"metadata_bytes": len(r.content) + len(p.content), "client_cpu_s": time.process_time() - own0,
            "service_cpu_s": _proc_cpu(pid) - cpu0, "plan_status": p.status_code}


def _resume(url: str, pid: int, name: str, world: int, tensors: int, sample: int, manifest_sample: int) -> dict:
    ranks = sorted({round(i * (world - 1) / max(1, sample - 1)) for i in range(sample)})
    _reset_peak(pid)
    with httpx.Client(base_url=url, timeout=600) as c:
        first = _resume_rank(c, pid, name, world // 3, world, tensors)  # parses the manifest, builds its tree
        per = [_resume_rank(c, pid, name, r, world, tensors) for r in ranks]
        peak = _peak_rss(pid)
        old = [_resume_rank_manifest(c, pid, name, r, tensors) for r in ranks[:manifest_sample]]
    mean = {k: statistics.mean(p[k] for p in per) for k in ("metadata_bytes", "client_cpu_s", "service_cpu_s")}
    out = {"sampled_ranks": ranks, "plan_status": sorted({p["plan_status"] for p in per}),
           "rank_metadata_bytes": mean["metadata_bytes"], "rank_head_bytes": per[0]["head_bytes"],
           "rank_client_cpu_s": mean["client_cpu_s"], "rank_service_cpu_s": mean["service_cpu_s"],
           "first_rank_service_cpu_s": first["service_cpu_s"],
           "resume_all_service_cpu_s_extrapolated": first["service_cpu_s"] + mean["service_cpu_s"] * world,
           "resume_all_served_bytes_extrapolated": mean["metadata_bytes"] * world,
           "resume_service_peak_rss": peak}
    if old:
        out.update({f"manifest_path_{k}": statistics.mean(o[k] for o in old)
                    for k in ("metadata_bytes", "client_cpu_s", "service_cpu_s")})
        out["manifest_path_plan_status"] = sorted({o["plan_status"] for o in old})
    return out


# -- reshard planning and DCP, each in a fresh process ---------------------------------------------------

def _peak() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))


def _outline_job(root: str, name: str, target: int) -> dict:
    """What the service does for ``POST /v1/reshard`` (``reshard.jobs.submit_job``): read the manifest, cut
    the units from the target layout (no read planned), record the outline's summary."""
    from ckptd.reshard.planner import outline_reshard
    from ckptd.reshard.preview import plan_summary
    from ckptd.reshard.spec import parse_spec
    from ckptd.storage.local import LocalStorage
    from ckptd.store.reader import CheckpointReader

    c0 = time.process_time()
    manifest = CheckpointReader(LocalStorage(Path(root))).manifest(RUN, name)
    outline = outline_reshard(manifest, parse_spec(f"fsdp2:dp={target}"))
    summary = len(json.dumps(plan_summary(outline), separators=(",", ":")))
    return {"reshard_outline_cpu_s": time.process_time() - c0, "reshard_outline_peak_rss": _peak(),
            "reshard_summary_bytes": summary, "reshard_units": len(outline.cuts)}


def _plan_share(root: str, name: str, target: int, share: int, shares: int) -> dict:
    """One worker (``ckptd reshard-worker``, or a service job's process): read the manifest, cut the units,
    plan the reads of its share one unit at a time (as it would run them; the bytes are not moved here)."""
    from ckptd.reshard.planner import outline_reshard
    from ckptd.reshard.spec import parse_spec
    from ckptd.storage.local import LocalStorage
    from ckptd.store.reader import CheckpointReader

    t0, c0 = time.perf_counter(), time.process_time()
    manifest = CheckpointReader(LocalStorage(Path(root))).manifest(RUN, name)
    outline = outline_reshard(manifest, parse_spec(f"fsdp2:dp={target}"))
    cut_s = time.process_time() - c0
    chunks = fetches = 0
    for cut in outline.share_of(share, shares):
        unit = outline.unit(cut)
        chunks += len(unit.chunks)
        fetches += sum(len(pc.reads.fetches) for pc in unit.chunks)
    return {"wall_s": time.perf_counter() - t0, "cpu_s": time.process_time() - c0, "cut_cpu_s": cut_s,
            "chunks": chunks, "fetches": fetches, "peak_rss": _peak()}


def _plan_reshard(root: str, name: str, target: int, workers: int) -> dict:
    """Reshard planning R -> R/2 as a job runs it: the service's outline (fresh process), then ``workers``
    processes at once, each planning its share; every target chunk planned exactly once overall."""
    from ckptd.reshard.jobs import WorkerJob

    out = _fresh(_outline_job, root, name, target)
    t0 = time.perf_counter()
    with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn")) as pool:
        got = list(pool.map(_plan_share, *zip(*[(root, name, target, i, workers) for i in range(workers)])))
    doc = WorkerJob(root=root, out=f"{RUN}/{name}-dp{target}", session="0" * 32, device="auto",
                    source=f"{RUN}/{name}", source_session="0" * 32, to=f"fsdp2:dp={target}", workers=workers)
    out.update({"reshard_workers": workers, "reshard_plan_wall_s": time.perf_counter() - t0,
                "reshard_worker_wall_s": max(g["wall_s"] for g in got),
                "reshard_worker_cpu_s": [round(g["cpu_s"], 2) for g in got],
                "reshard_worker_cut_cpu_s": max(g["cut_cpu_s"] for g in got),
                "reshard_worker_peak_rss": max(g["peak_rss"] for g in got),
                "reshard_chunks_planned": sum(g["chunks"] for g in got),
                "reshard_job_doc_bytes": len(doc.model_dump_json())})
    return out


def _dcp_load_rank(world: int, tensors: int, rank: int) -> dict:
    """One DCP loading rank's metadata work: unpickle the whole ``.metadata``, plan its T bands."""
    import io
    import pickle

    import torch
    from torch.distributed.checkpoint.metadata import (
        ChunkStorageMetadata, Metadata, TensorProperties, TensorStorageMetadata,
    )
    from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

    props = TensorProperties(dtype=torch.bfloat16)
    size = torch.Size([ROWS_PER_RANK * world, COLS])
    md = Metadata(state_dict_metadata={
        f"model.layers.{t}.weight": TensorStorageMetadata(props, size, [
            ChunkStorageMetadata(offsets=torch.Size([r * ROWS_PER_RANK, 0]), sizes=torch.Size([ROWS_PER_RANK, COLS]))
            for r in range(world)]) for t in range(tensors)})
    buf = io.BytesIO()
    pickle.dump(md, buf)
    raw = buf.getvalue()
    del md
    t0 = time.process_time()
    md = pickle.loads(raw)
    mine = [ChunkStorageMetadata(offsets=torch.Size([rank * ROWS_PER_RANK, 0]), sizes=torch.Size([ROWS_PER_RANK, COLS]))]
    items = [item for fqn, tmd in md.state_dict_metadata.items()
             for item in create_read_items_for_chunk_list(fqn, tmd, mine)]
    assert len(items) == tensors
    return {"dcp_rank_metadata_bytes": len(raw), "dcp_rank_cpu_s": time.process_time() - t0}


def _fresh(fn: Callable, *args: object) -> dict:
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(fn, *args).result() or {}


# -- one world size ---------------------------------------------------------------------------------

def serve_world(world: int, work: Path) -> tuple[ServerProcess, int]:
    """A real ``ckptd serve`` over ``work/root-{world}`` for ``world`` simulated ranks (one principal: its
    per-principal limits off, connections for every rank), and its pid."""
    env = {"CKPTD_MAX_CONNECTIONS": str(max(4096, 2 * world + 256)),
           "CKPTD_MAX_REQUESTS_PER_PRINCIPAL": "0", "CKPTD_MAX_UPLOADS_PER_PRINCIPAL": "0",
           "CKPTD_VERIFY_AFTER_COMMIT": "false"}
    srv = ServerProcess(work / f"root-{world}", env=env, log=work / f"server-{world}.log").start()
    return srv, srv.proc.pid  # type: ignore[union-attr]


def run_world(world: int, tensors: int, sample: int, manifest_sample: int, dcp: bool, reshard_max: int,
              work: Path, reshard_workers: int = 2, waits_max: int = 10_000) -> dict:
    srv, pid = serve_world(world, work)
    out: dict = {"ranks": world, "tensors": tensors, "chunks": world * tensors}
    try:
        asyncio.run(_save(srv.url, pid, "warmup", min(world, 8), 2, wait=True))  # the service's first save
        quiet = asyncio.run(_save(srv.url, pid, "nowait", world, tensors, wait=False, shared=world > waits_max))
        out.update({"save_nowait_service_cpu_s": quiet["service_cpu_s"], "save_nowait_wall_s": quiet["wall_s"],
                    "commit_service_cpu_s": quiet["commit_cpu_s"]})
        name = "nowait"
        if world <= waits_max:  # every rank long-polling at once holds one connection per rank
            waited = asyncio.run(_save(srv.url, pid, "waited", world, tensors, wait=True))
            out.update({"save_waited_service_cpu_s": waited["service_cpu_s"], "save_waited_wall_s": waited["wall_s"],
                        "waits_cpu_ratio": waited["service_cpu_s"] / quiet["service_cpu_s"]})
            name = "waited"
        else:
            out["waits_skipped"] = f"{world} ranks > --waits-max-ranks {waits_max}"
        out.update(_resume(srv.url, pid, name, world, tensors, sample, manifest_sample))
    finally:
        srv.stop()
    if world <= reshard_max:
        out.update(_plan_reshard(str(srv.root), name, max(1, world // 2), reshard_workers))
    else:
        out["reshard_skipped"] = f"{world} ranks > --reshard-max-ranks {reshard_max}"
    if dcp:
        got = _fresh(run_dcp, world, tensors)
        out.update(dcp_global_plan_s=got["global_plan_s"], dcp_global_plan_cpu_s=got["global_plan_cpu_s"],
                   dcp_metadata_bytes=got["metadata_bytes"])
        out.update(_fresh(_dcp_load_rank, world, tensors, world // 2))
        out["commit_vs_dcp_coordinator"] = (out["commit_service_cpu_s"] or 0) / got["global_plan_cpu_s"]  # CPU / CPU
        out["rank_metadata_vs_dcp"] = out["rank_metadata_bytes"] / out["dcp_rank_metadata_bytes"]
        out["rank_cpu_vs_dcp"] = (out["rank_client_cpu_s"] + out["rank_service_cpu_s"]) / out["dcp_rank_cpu_s"]
    else:
        out["dcp_skipped"] = f"{world} ranks > --dcp-max-ranks"
    return out


def _table(rows: list[dict]) -> str:
    mb = 1e6
    head = ("| ranks x tensors | commit, service CPU-s (DCP coordinator CPU-s) | save's waits: service CPU with / "
            "without | one loading rank: metadata fetched, CPU-s client + service (whole manifest) | DCP rank: "
            "metadata, CPU-s | resume of every rank: service CPU-s (extrapolated; the first rank's parse and tree build "
            "once), peak RSS | reshard R -> R/2: the service's outline CPU-s, RSS; W workers at once: wall s, "
            "each one's peak RSS |\n" + "| --- " * 7 + "|\n")
    lines = []
    for r in rows:
        dcp_coord = (f"{r['dcp_global_plan_cpu_s']:.2f} CPU-s" if "dcp_global_plan_cpu_s" in r
                     else f"{r['dcp_global_plan_s']:.2f} s" if "dcp_global_plan_s" in r else "skipped")
        dcp_rank = (f"{r['dcp_rank_metadata_bytes'] / mb:.1f} MB, {r['dcp_rank_cpu_s']:.3f}"
                    if "dcp_rank_cpu_s" in r else "skipped")
        old = (f" ({r['manifest_path_metadata_bytes'] / mb:.1f} MB, "
               f"{r['manifest_path_client_cpu_s'] + r['manifest_path_service_cpu_s']:.2f})"
               if "manifest_path_metadata_bytes" in r else "")
        lines.append(
            f"| {r['ranks']:,} x {r['tensors']} | {r['commit_service_cpu_s'] or 0:.2f} ({dcp_coord}) | "
            + (f"{r['save_waited_service_cpu_s']:.1f} / {r['save_nowait_service_cpu_s']:.1f} ({r['waits_cpu_ratio']:.2f}x)"
               if "waits_cpu_ratio" in r else f"not run / {r['save_nowait_service_cpu_s']:.1f}")
            + f" | {r['rank_metadata_bytes'] / mb:.3f} MB, "
            f"{r['rank_client_cpu_s'] + r['rank_service_cpu_s']:.3f}{old} | {dcp_rank} | "
            f"{r['resume_all_service_cpu_s_extrapolated']:.1f} ({r.get('first_rank_service_cpu_s', 0):.1f} of it once), "
            f"{r['resume_service_peak_rss'] / mb:.0f} MB | "
            + (f"{r['reshard_outline_cpu_s']:.1f}, {r['reshard_outline_peak_rss'] / mb:.0f} MB; "
               f"W={r['reshard_workers']}: {r['reshard_plan_wall_s']:.1f} s, {r['reshard_worker_peak_rss'] / mb:.0f} MB |"
               if "reshard_plan_wall_s" in r else "skipped |"))
    return head + "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ranks", default="64,1024", help="world sizes, comma-separated")
    ap.add_argument("--tensors", type=int, default=200)
    ap.add_argument("--sample", type=int, default=8, help="loading ranks measured per world size")
    ap.add_argument("--manifest-sample", type=int, default=2,
                    help="of the sampled ranks, how many also load through the whole manifest (the old path)")
    ap.add_argument("--dcp-max-ranks", type=int, default=10_000)
    ap.add_argument("--reshard-max-ranks", type=int, default=10_000,
                    help="plan the reshard R -> R/2 up to this world size")
    ap.add_argument("--waits-max-ranks", type=int, default=10_000,
                    help="save a second time with every rank waiting for the commit up to this world size")
    ap.add_argument("--reshard-workers", type=int, default=os.cpu_count() or 2,
                    help="worker processes that plan the reshard's shares at once (default: one per CPU)")
    ap.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "scale.json")
    args = ap.parse_args(argv)
    rows, t0 = [], time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="ckptd-scale-") as tmp:
        for world in (int(x) for x in args.ranks.split(",")):
            row = run_world(world, args.tensors, args.sample, args.manifest_sample, world <= args.dcp_max_ranks,
                            args.reshard_max_ranks, Path(tmp), args.reshard_workers, args.waits_max_ranks)
            rows.append(row)
            print(json.dumps(row), flush=True)
    last = rows[-1]
    summary = {**last, "rank_metadata_mb": last["rank_metadata_bytes"] / 1e6,
               "rank_cpu_s": last["rank_client_cpu_s"] + last["rank_service_cpu_s"]}
    write_report(args.out, {"rows": rows, "command": " ".join(sys.argv), "summary": summary,
                            "wall_s": time.perf_counter() - t0}, _table(rows))


if __name__ == "__main__":
    main()
