"""ckptd on an S3 root against DCP's fsspec writer and reader, on the same S3 server (moto).

    .venv/bin/python -m bench.s3 --mib 256 --repeat 3 --out bench/results/s3.json

What one run does (see bench/results/s3.md for the results and how to read them):

1. One ``python -m moto.server`` on loopback with one bucket (tests/s3_server.py
   ``MotoServer``). This process's environment, which the ranks inherit, gets the
   standard AWS variables pointing at it (``AWS_ENDPOINT_URL_S3``, fixed
   credentials); stray AWS variables are removed.
2. One real ``ckptd serve --root s3://bucket/ckptd`` (tests/support.py
   ``ServerProcess``) with the same variables.
3. A few micro-baselines of the S3 server itself, from this process with boto3: one
   64 MiB PUT, one whole GET, and 1 MiB ranged GETs of that object.
4. ``--save-world`` gloo ranks (default 2) hold ``--mib`` MiB of fp32 state (the state
   of ``bench.save_load``: 8 ``Shard(0)`` DTensors, uneven row counts). Per repeat,
   between barriers, in alternating order:

   * ``dcp.save(sd, storage_writer=FsspecWriter("s3://bucket/dcp/<r>", sync_files=False))``
     (s3fs picks the endpoint up from the environment; no storage options are passed);
   * ``CheckpointClient.save(sd, "bench/<r>")`` then ``handle.wait()`` (committed on
     the server, in S3), timing also ``save()``'s return (the training stall): the default
     client, which uploads the data files straight into the bucket with presigned URLs (the
     bench's service opts in to them: ``CKPTD_DIRECT_UPLOADS=true``; off by default);
   * the same with ``direct_uploads=False`` (every byte through the service, the default route).

   After each ckptd save, and outside its timing, rank 0 waits for the checkpoint's recorded
   verification (``*_reread_s``: from the marker, the re-read of bytes checked on arrival; a direct
   upload's bytes were read back before the marker): the re-read reads every byte from the same moto,
   and would otherwise run during the next step, whichever side that is. Checkpoints of a training
   run are minutes apart; the re-read is timed on its own.

5. ``--load-world`` gloo ranks (default 3: another world size) load every repeat's two
   checkpoints into NaN-filled DTensors on their mesh, in alternating order:
   ``dcp.load(sd, storage_reader=FsspecReader("s3://bucket/dcp/<r>"))`` and
   ``CheckpointClient.load(sd, "bench/<r>")``. Both are compared bit for bit with the
   values saved (and with each other); the results are recorded as flags.

Every time is the slower rank's, between barriers. CPU seconds: ranks from ``os.times()``,
the ckptd server and moto from ``/proc/PID/stat``. The S3 requests each side made are
counted from moto's request log. Ratio = DCP time / ckptd time (throughput ratio).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.device_mesh import init_device_mesh

from bench._report import add_workdir_args, work_dir, write_report
from bench.replicas import verification
from bench.save_load import (MiB, Probe, _max_over_ranks, _med, _own_cpu, _proc_cpu, _sum_over_ranks,
                             describe_machine, make_state, state_bytes, tensor_specs)
from s3_server import AWS_VARS_TO_CLEAR, MotoServer  # noqa: E402  (tests/, on sys.path via bench.save_load)
from support import ServerProcess, run_ranks  # noqa: E402

BUCKET = "bucket"
GOALS = {"save_throughput_ratio": 1.0, "load_throughput_ratio": 1.0}
_ESC = r"(?:\x1b\[[\d;]*m)*"  # werkzeug colours some lines
_LOG_LINE = re.compile(rf'"{_ESC}(GET|PUT|POST|HEAD|DELETE) (\S+) HTTP/[\d.]+{_ESC}" (\d{{3}})')
WARMUP_MIB = 1  # an untimed save and load of this size on each side first (imports, sessions, connections)


def _fsspec_io() -> tuple[type, type]:
    """DCP's fsspec writer and reader (not re-exported by ``torch.distributed.checkpoint`` in every release)."""
    try:
        from torch.distributed.checkpoint import FsspecReader, FsspecWriter  # type: ignore[attr-defined]
    except ImportError:
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter
    return FsspecWriter, FsspecReader


# -- moto's request log -------------------------------------------------------------------------------

def _kind(method: str, path: str, status: str) -> str:
    path, _, query = path.partition("?")
    if method == "PUT" and "partNumber=" in query:
        return "upload_part"
    if method == "POST" and "uploads" in query.split("&"):
        return "create_multipart"
    if method == "POST" and "uploadId=" in query:
        return "complete_multipart"
    if method == "POST" and "delete" in query.split("&"):
        return "delete"
    if method == "GET" and "list-type=" in query:
        return "list"
    if method == "GET":
        return "get_range" if status == "206" else "get"
    return {"PUT": "put", "HEAD": "head", "DELETE": "delete", "POST": "post"}.get(method, method)


def moto_requests(log: str, offset: int) -> tuple[int, dict[str, int]]:
    """S3 requests moto logged after byte ``offset`` of its log, by kind; and the new offset."""
    with open(log, "rb") as f:
        f.seek(offset)
        data = f.read()
    counts: Counter[str] = Counter()
    for m in _LOG_LINE.finditer(data.decode("utf-8", "replace")):
        counts[_kind(*m.groups())] += 1
    return offset + len(data), dict(counts)


def _log_size(log: str) -> int:
    return os.path.getsize(log)


# -- rank jobs (spawned; module-level so they pickle) ------------------------------------------------

def _cpu_pair(pid: int) -> tuple[float, float]:
    return _proc_cpu(pid) if pid else (0.0, 0.0)


def save_job(rank: int, world: int, cfg: dict) -> dict:
    from ckptd_client import CheckpointClient

    writer_cls, _ = _fsspec_io()
    probe = Probe()
    mesh = init_device_mesh("cpu", (world,))
    sd = make_state(cfg["specs"], mesh, fill=True)
    # Every repeat saves the same bytes: incremental saves would link all of them from the previous
    # repeat (on S3, copies inside the store), so they are off here; these are full saves.
    client = CheckpointClient(cfg["url"], incremental=False)  # default otherwise: direct uploads (presigned)
    through = CheckpointClient(cfg["url"], incremental=False, direct_uploads=False)  # every byte via the service
    warm = make_state(cfg["warmup_specs"], mesh, fill=True)
    dcp.save(warm, storage_writer=writer_cls(f"{cfg['dcp_url']}/warmup", sync_files=cfg["dcp_sync_files"]))
    client.save(warm, "bench/warmup").wait()
    del warm
    repeats = []
    for r in range(cfg["repeat"]):
        variants = ("dcp", "ckptd", "ckptd_service")
        order = variants[r % 3:] + variants[:r % 3]
        rec: dict[str, Any] = {"order": list(order)}
        for which in order:
            dist.barrier()
            log0 = _log_size(cfg["moto_log"]) if rank == 0 else 0
            cpu0 = _own_cpu()
            srv0 = _cpu_pair(cfg["server_pid"]) if rank == 0 else (0.0, 0.0)
            moto0 = _cpu_pair(cfg["moto_pid"]) if rank == 0 else (0.0, 0.0)
            t0 = time.perf_counter()
            if which == "dcp":
                writer = writer_cls(f"{cfg['dcp_url']}/{r}", sync_files=cfg["dcp_sync_files"])
                dcp.save(sd, storage_writer=writer)
                stall = 0.0
            else:
                handle = (client.save(sd, f"bench/{r}") if which == "ckptd" else
                          through.save(sd, f"bench/service-{r}"))
                stall = time.perf_counter() - t0
                handle.wait()
            dist.barrier()
            t = time.perf_counter() - t0
            cpu = sum(b - a for a, b in zip(cpu0, _own_cpu()))
            srv = sum(b - a for a, b in zip(srv0, _cpu_pair(cfg["server_pid"]))) if rank == 0 else 0.0
            moto = sum(b - a for a, b in zip(moto0, _cpu_pair(cfg["moto_pid"]))) if rank == 0 else 0.0
            t_max, stall_max = _max_over_ranks([t, stall])
            cpu_sum, srv, moto = _sum_over_ranks([cpu, srv, moto])
            rec[f"{which}_save_s"] = t_max
            rec[f"{which}_save_ranks_cpu_s"] = cpu_sum
            rec[f"{which}_save_moto_cpu_s"] = moto
            if which == "ckptd":
                rec["ckptd_stall_s"] = stall_max
                rec["ckptd_save_server_cpu_s"] = srv
                rec["ckptd_phases"] = probe.take(t0)
            elif which == "ckptd_service":
                rec["ckptd_service_save_server_cpu_s"] = srv
                probe.take(t0)  # its phases are not reported: only the default client's
            if rank == 0:
                time.sleep(0.2)  # let moto finish logging the last requests (outside the timing)
                rec[f"{which}_save_s3_requests"] = moto_requests(cfg["moto_log"], log0)[1]
                if which != "dcp":  # the re-read after the marker ends before the next step starts: each
                    ref = f"bench/{r}" if which == "ckptd" else f"bench/service-{r}"  # is timed alone
                    moto0 = _cpu_pair(cfg["moto_pid"])
                    got = verification([cfg["url"]], ref)
                    assert got is not None and got["ok"], got
                    rec[f"{which}_reread_s"] = time.perf_counter() - t0 - t
                    rec[f"{which}_reread_moto_cpu_s"] = sum(b - a for a, b in zip(moto0, _cpu_pair(cfg["moto_pid"])))
        repeats.append(rec)
    client.close()
    through.close()
    return {"repeats": repeats}


def load_job(rank: int, world: int, cfg: dict) -> dict:
    from ckptd_client import CheckpointClient

    _, reader_cls = _fsspec_io()
    probe = Probe()
    mesh = init_device_mesh("cpu", (world,))
    expected = make_state(cfg["specs"], mesh, fill=True)["model"]
    into = {"dcp": make_state(cfg["specs"], mesh, fill=False), "ckptd": make_state(cfg["specs"], mesh, fill=False)}
    client = CheckpointClient(cfg["url"])
    warm = make_state(cfg["warmup_specs"], mesh, fill=False)
    dcp.load(warm, storage_reader=reader_cls(f"{cfg['dcp_url']}/warmup"))
    client.load(warm, "bench/warmup")
    del warm

    def bits(t: torch.Tensor) -> torch.Tensor:
        return t.contiguous().view(-1).view(torch.int32)

    def bit_exact(sd: dict) -> bool:
        return all(torch.equal(bits(sd["model"][n].to_local()), bits(w.to_local())) for n, w in expected.items())

    repeats = []
    for r in range(cfg["repeat"]):
        rec: dict[str, Any] = {}
        order = ("dcp", "ckptd") if r % 2 == 0 else ("ckptd", "dcp")
        rec["order"] = list(order)
        for which in order:
            for t in into[which]["model"].values():
                t.to_local().fill_(float("nan"))
            dist.barrier()
            log0 = _log_size(cfg["moto_log"]) if rank == 0 else 0
            cpu0 = _own_cpu()
            srv0 = _cpu_pair(cfg["server_pid"]) if rank == 0 else (0.0, 0.0)
            moto0 = _cpu_pair(cfg["moto_pid"]) if rank == 0 else (0.0, 0.0)
            t0 = time.perf_counter()
            if which == "dcp":
                dcp.load(into["dcp"], storage_reader=reader_cls(f"{cfg['dcp_url']}/{r}"))
            else:
                client.load(into["ckptd"], f"bench/{r}")
            dist.barrier()
            t = time.perf_counter() - t0
            cpu = sum(b - a for a, b in zip(cpu0, _own_cpu()))
            srv = sum(b - a for a, b in zip(srv0, _cpu_pair(cfg["server_pid"]))) if rank == 0 else 0.0
            moto = sum(b - a for a, b in zip(moto0, _cpu_pair(cfg["moto_pid"]))) if rank == 0 else 0.0
            rec[f"{which}_load_s"] = _max_over_ranks([t])[0]
            cpu_sum, srv, moto = _sum_over_ranks([cpu, srv, moto])
            rec[f"{which}_load_ranks_cpu_s"] = cpu_sum
            rec[f"{which}_load_moto_cpu_s"] = moto
            if which == "ckptd":
                rec["ckptd_load_server_cpu_s"] = srv
                rec["ckptd_phases"] = probe.take(t0)
            if rank == 0:
                time.sleep(0.2)
                rec[f"{which}_load_s3_requests"] = moto_requests(cfg["moto_log"], log0)[1]
        # bit for bit against the values saved, and the two loads against each other; all ranks agree
        flags = [bit_exact(into["dcp"]), bit_exact(into["ckptd"]),
                 all(torch.equal(bits(into["dcp"]["model"][n].to_local()), bits(into["ckptd"]["model"][n].to_local()))
                     for n in expected)]
        t = torch.tensor([float(f) for f in flags])
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
        rec["dcp_load_bit_exact"], rec["ckptd_load_bit_exact"], rec["loads_agree"] = (bool(x) for x in t.tolist())
        rec["checked_tensors"] = len(expected)
        repeats.append(rec)
    client.close()
    return {"repeats": repeats}


def _merge(records: list[dict]) -> dict:
    """Rank 0's record, each repeat's per-rank probe phases gathered under ``ckptd_phases_by_rank``."""
    base = records[0]["result"]
    for i, rep in enumerate(base["repeats"]):
        rep["ckptd_phases_by_rank"] = [rec["result"]["repeats"][i].get("ckptd_phases", {}) for rec in records]
        rep.pop("ckptd_phases", None)
    return base


# -- the S3 server's own speed ---------------------------------------------------------------------

def moto_baselines(moto: MotoServer, nbytes: int) -> dict:
    """One client, boto3, an object of ``nbytes`` (a rank file's size): one PUT, one whole GET, and 1 MiB ranged
    GETs (moto 5 reads the whole object for every ranged GET, so their cost grows with the object)."""
    c = moto.client()
    body = os.urandom(nbytes)
    key = "baseline/object"
    t0 = time.perf_counter()
    c.put_object(Bucket=moto.bucket, Key=key, Body=body)
    put_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    got = c.get_object(Bucket=moto.bucket, Key=key)["Body"].read()
    get_s = time.perf_counter() - t0
    assert got == body
    ranged = []
    for i in range(4):
        start = (i * 13 + 5) * MiB % (nbytes - MiB + 1)
        t0 = time.perf_counter()
        c.get_object(Bucket=moto.bucket, Key=key, Range=f"bytes={start}-{start + MiB - 1}")["Body"].read()
        ranged.append(time.perf_counter() - t0)
    c.delete_object(Bucket=moto.bucket, Key=key)
    return {"object_mib": nbytes / MiB, "put_gbps": nbytes / put_s / 1e9, "get_gbps": nbytes / get_s / 1e9,
            "ranged_get_1mib_s": statistics.median(ranged), "whole_get_s": get_s, "put_s": put_s}


def bucket_usage(moto: MotoServer, prefix: str) -> dict:
    c = moto.client()
    n = size = 0
    for page in c.get_paginator("list_objects_v2").paginate(Bucket=moto.bucket, Prefix=prefix):
        for o in page.get("Contents") or ():
            n += 1
            size += o["Size"]
    pending = len(c.list_multipart_uploads(Bucket=moto.bucket, Prefix=prefix).get("Uploads") or ())
    return {"objects": n, "bytes": size, "pending_multipart_uploads": pending}


# -- summary -------------------------------------------------------------------------------------------

def _sum_counts(dicts: list[dict[str, int]]) -> dict[str, float]:
    keys = sorted({k for d in dicts for k in d})
    return {k: _med([d.get(k, 0) for d in dicts]) for k in keys}


def summarise(save: dict, load: dict, nbytes: int) -> dict:
    sr, lr = save["repeats"], load["repeats"]
    gb = nbytes / 1e9
    out: dict[str, Any] = {}
    for side in ("dcp", "ckptd"):
        out[f"{side}_save_s"] = _med([r[f"{side}_save_s"] for r in sr])
        out[f"{side}_load_s"] = _med([r[f"{side}_load_s"] for r in lr])
        out[f"{side}_save_gbps"] = gb / out[f"{side}_save_s"]
        out[f"{side}_load_gbps"] = gb / out[f"{side}_load_s"]
        for op, reps in (("save", sr), ("load", lr)):
            out[f"{side}_{op}_worst_s"] = max(r[f"{side}_{op}_s"] for r in reps)
            out[f"{side}_{op}_ranks_cpu_s"] = _med([r[f"{side}_{op}_ranks_cpu_s"] for r in reps])
            out[f"{side}_{op}_moto_cpu_s"] = _med([r[f"{side}_{op}_moto_cpu_s"] for r in reps])
            out[f"{side}_{op}_s3_requests"] = _sum_counts([r.get(f"{side}_{op}_s3_requests", {}) for r in reps])
    out["ckptd_save_server_cpu_s"] = _med([r["ckptd_save_server_cpu_s"] for r in sr])
    out["ckptd_load_server_cpu_s"] = _med([r["ckptd_load_server_cpu_s"] for r in lr])
    out["ckptd_stall_s"] = _med([r["ckptd_stall_s"] for r in sr])
    out["save_throughput_ratio"] = out["dcp_save_s"] / out["ckptd_save_s"]
    out["ckptd_service_save_s"] = _med([r["ckptd_service_save_s"] for r in sr])
    out["save_service_throughput_ratio"] = out["dcp_save_s"] / out["ckptd_service_save_s"]
    for k in ("ckptd_service_save_server_cpu_s", "ckptd_service_save_moto_cpu_s", "ckptd_service_save_ranks_cpu_s",
              "ckptd_service_reread_s", "ckptd_service_reread_moto_cpu_s"):
        out[k] = _med([r[k] for r in sr if k in r]) if any(k in r for r in sr) else None
    out["load_throughput_ratio"] = out["dcp_load_s"] / out["ckptd_load_s"]
    out["stall_ratio"] = out["ckptd_stall_s"] / out["dcp_save_s"]
    skeys = ("stall", "snapshot", "open_session", "pack_hash", "put_file_span", "put_file_n", "body_sent_end",
             "put_file_end", "put_index", "put_index_end", "own_wait_return")
    out["save_phases_s"] = {k: _med([max(p.get(k, 0.0) for p in r["ckptd_phases_by_rank"]) for r in sr])
                            for k in skeys}
    # last body byte handed to httpx -> the file's PUT answered: the server's last part + multipart completion
    out["save_phases_s"]["server_file_tail"] = _med([max(p.get("put_file_end", 0.0) - p.get("body_sent_end", 0.0)
                                                         for p in r["ckptd_phases_by_rank"]) for r in sr])
    lkeys = ("manifest", "read_plan", "get_range_span", "get_range_n", "fetch_verify", "fetch_copy_total")
    out["load_phases_s"] = {k: _med([max(p.get(k, 0.0) for p in r["ckptd_phases_by_rank"]) for r in lr])
                            for k in lkeys}
    out["correct"] = {
        "dcp_load_bit_exact": all(r["dcp_load_bit_exact"] for r in lr),
        "ckptd_load_bit_exact": all(r["ckptd_load_bit_exact"] for r in lr),
        "loads_agree": all(r["loads_agree"] for r in lr),
    }
    out["goals_met"] = {f"{k}>={v}": out[k] >= v for k, v in GOALS.items()}
    return out


def markdown(res: dict) -> str:
    s, cfg = res["summary"], res["config"]
    mib = cfg["state_bytes"] / MiB

    def cell(side: str, op: str) -> str:
        return f"{s[f'{side}_{op}_s']:.2f} s = {s[f'{side}_{op}_gbps'] * 1000:.0f} MB/s"

    lines = [f"{mib:.0f} MiB fp32 state, save on {cfg['save_world']} ranks, load on {cfg['load_world']}, "
             f"median of {cfg['repeat']} repeats, one moto server:", "",
             "| measure | ckptd (s3:// root) | DCP (fsspec, s3://) | ratio DCP/ckptd | goal | met |",
             "| --- | --- | --- | --- | --- | --- |",
             f"| save, committed (`save()` + `wait()`), direct uploads (opt-in) vs `dcp.save` | {cell('ckptd', 'save')} | {cell('dcp', 'save')} "
             f"| {s['save_throughput_ratio']:.2f} | >= 1.0 | {'yes' if s['save_throughput_ratio'] >= 1 else 'no'} |",
             f"| same, every byte through the service (the default) | "
             f"{s['ckptd_service_save_s']:.2f} s | | {s['save_service_throughput_ratio']:.2f} | | |",
             f"| its re-read after the marker, timed alone (from the save's end to the record) | "
             f"{s['ckptd_service_reread_s']:.2f} s | | | | |" if s.get("ckptd_service_reread_s") is not None else "",
             f"| load at world size {cfg['load_world']} | {cell('ckptd', 'load')} | {cell('dcp', 'load')} "
             f"| {s['load_throughput_ratio']:.2f} | >= 1.0 | {'yes' if s['load_throughput_ratio'] >= 1 else 'no'} |",
             "", f"training stall (`save()` returns): {s['ckptd_stall_s']:.3f} s ({s['stall_ratio']:.3f} x dcp.save)",
             "", "CPU seconds (median; ranks summed): "
             f"save: DCP ranks {s['dcp_save_ranks_cpu_s']:.2f} + moto {s['dcp_save_moto_cpu_s']:.2f}; ckptd ranks "
             f"{s['ckptd_save_ranks_cpu_s']:.2f} + server {s['ckptd_save_server_cpu_s']:.2f} + moto "
             f"{s['ckptd_save_moto_cpu_s']:.2f} (direct); through the service: ranks "
             f"{s['ckptd_service_save_ranks_cpu_s']:.2f} + server {s['ckptd_service_save_server_cpu_s']:.2f} + moto "
             f"{s['ckptd_service_save_moto_cpu_s']:.2f}. load: DCP ranks {s['dcp_load_ranks_cpu_s']:.2f} + moto "
             f"{s['dcp_load_moto_cpu_s']:.2f}; ckptd ranks {s['ckptd_load_ranks_cpu_s']:.2f} + server "
             f"{s['ckptd_load_server_cpu_s']:.2f} + moto {s['ckptd_load_moto_cpu_s']:.2f}",
             "", "S3 requests (median per operation): " + "; ".join(
                 f"{side} {op}: " + ", ".join(f"{k}={v:g}" for k, v in s[f"{side}_{op}_s3_requests"].items())
                 for op in ("save", "load") for side in ("dcp", "ckptd")),
             "", "ckptd save phases (s, slower rank): "
             + ", ".join(f"{k}={v:.3f}" for k, v in s["save_phases_s"].items()),
             "ckptd load phases (s, slower rank): " + ", ".join(f"{k}={v:.3f}" for k, v in s["load_phases_s"].items()),
             "", "moto baselines (one boto3 client): " + ", ".join(f"{k}={v:.3f}" for k, v in res["baselines"].items()),
             "", "correct: " + ", ".join(f"{k}={v}" for k, v in s["correct"].items())]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mib", type=float, default=256, help="total fp32 state over the saving ranks (MiB)")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--save-world", type=int, default=2)
    ap.add_argument("--load-world", type=int, default=3)
    ap.add_argument("--dcp-sync-files", action="store_true",
                    help="FsspecWriter(sync_files=True), DCP's default: on an s3fs stream (no fileno) DCP then "
                         "calls os.sync() for the whole machine after every file; off by default")
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results" / "s3.json")
    add_workdir_args(ap, "parent of the temporary work dir (logs)")
    args = ap.parse_args(argv)

    with work_dir("ckptd-bench-s3-", args.workdir, args.keep) as work:
        t_start = time.perf_counter()
        moto = MotoServer(work / "moto.log", bucket=BUCKET)
        server: ServerProcess | None = None
        try:
            specs = tensor_specs(args.mib)
            nbytes = state_bytes(specs)
            machine = describe_machine(work)
            import importlib.metadata as md

            for p in ("moto", "s3fs", "fsspec", "botocore", "aiobotocore", "boto3", "werkzeug"):
                try:
                    machine["versions"][p] = md.version(p)
                except md.PackageNotFoundError:
                    machine["versions"][p] = None
            print(f"work dir {work}; {nbytes / MiB:.1f} MiB state; load average {machine['loadavg_at_start']}",
                  flush=True)
            moto.start()
            # The ranks (spawned) and the server inherit this environment: the standard AWS variables only.
            for k in AWS_VARS_TO_CLEAR:
                os.environ.pop(k, None)
            os.environ.update(moto.env)
            # ckptd writes one file per rank (up to the client's file_bytes, 256 MiB); so does DCP
            baselines = moto_baselines(moto, min(max(nbytes // args.save_world, 4 * MiB), 256 * MiB) // MiB * MiB)
            print("moto baselines", json.dumps({k: round(v, 3) for k, v in baselines.items()}), flush=True)
            root = f"s3://{BUCKET}/ckptd"
            server = ServerProcess(root, env={**moto.env, "CKPTD_DIRECT_UPLOADS": "true"},  # opted in: the direct row
                                   log=work / "server.log").start()
            cfg = {"specs": specs, "repeat": args.repeat, "url": server.url, "server_pid": server.proc.pid,
                   "moto_pid": moto.proc.pid, "moto_log": str(moto.log), "dcp_url": f"s3://{BUCKET}/dcp",
                   "dcp_sync_files": args.dcp_sync_files, "warmup_specs": tensor_specs(WARMUP_MIB)}
            budget = 300 + args.repeat * nbytes / MiB * 2.0
            t0 = time.perf_counter()
            save = _merge(run_ranks(save_job, args.save_world, cfg, tmp=work, timeout=budget))
            print(f"saved in {time.perf_counter() - t0:.1f} s", flush=True)
            stored = {"ckptd": bucket_usage(moto, "ckptd/runs/bench/"), "dcp": bucket_usage(moto, "dcp/")}
            t0 = time.perf_counter()
            load = _merge(run_ranks(load_job, args.load_world, cfg, tmp=work, timeout=budget))
            print(f"loaded in {time.perf_counter() - t0:.1f} s", flush=True)
            server.stop()
            summary = summarise(save, load, nbytes)
            summary["correct"]["stored_in_s3"] = (stored["ckptd"]["bytes"] >= args.repeat * nbytes
                                                  and stored["dcp"]["bytes"] >= args.repeat * nbytes
                                                  and stored["ckptd"]["pending_multipart_uploads"] == 0)
            result = {
                "command": "python -m bench.s3 " + " ".join(sys.argv[1:] if argv is None else argv),
                "config": {"mib": args.mib, "state_bytes": nbytes, "repeat": args.repeat, "tensors": len(specs),
                           "tensor_specs": specs, "save_world": args.save_world, "load_world": args.load_world,
                           "s3": f"moto {machine['versions']['moto']} server mode (python -m moto.server, werkzeug, "
                                 "threaded), one process on loopback, bucket 'bucket'",
                           "ckptd": f"ckptd serve --root {root} (S3Storage: 32 MiB multipart parts, ranged GETs); "
                                    "CheckpointClient defaults (streams=4, file_bytes=256 MiB, no compression)",
                           "dcp": f"dcp.save/dcp.load with FsspecWriter/FsspecReader('s3://{BUCKET}/dcp/<repeat>'), "
                                  f"sync_files={args.dcp_sync_files}, thread_count=1, no storage options (s3fs "
                                  "reads AWS_ENDPOINT_URL_S3 from the environment)",
                           "env": sorted(moto.env),
                           "warmup": f"each rank job first saves (loads) a {WARMUP_MIB} MiB state once on each side, "
                                     "untimed"},
                "machine": machine, "baselines": baselines, "stored": stored,
                "summary": summary, "save": save, "load": load,
                "wall_s": time.perf_counter() - t_start, "loadavg_at_end": os.getloadavg(),
            }
            write_report(args.out, result, markdown(result), extra=f"; load average at end {result['loadavg_at_end']}")
            return 0 if all(summary["correct"].values()) else 1
        finally:
            if server is not None:
                server.stop()
            moto.stop()


if __name__ == "__main__":
    sys.exit(main())
