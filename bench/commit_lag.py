"""Commit lag: the time from a save's last stored byte to its marker, by size, world size and store.

    .venv/bin/python -m bench.commit_lag --out bench/results/commit_lag.json
    .venv/bin/python -m bench.commit_lag --sizes 64M,256M,1G,4G --s3-sizes 64M,256M,1G,4G --ranks 2,8,64
    .venv/bin/python -m bench.commit_lag --sizes 64M,1G,4G --ranks 2,8,64 --stores local,local-read-back

R simulated ranks save one checkpoint of S bytes in all against a real ``ckptd serve`` (its own
process) over the documented wire protocol (``docs/http-api.md``), the way bench/scale.py drives
them: every rank joins the session, uploads its data files (S/R bytes, in files of at most the
client's ``FILE_BYTES``) with ``PUT .../files/{file}`` and their digest in ``X-Ckptd-Xxh3``, then
sends its index: one flat ``uint8`` tensor of S elements, rank r holding ``[r*S/R, (r+1)*S/R)`` as
one chunk per file. All ranks at once. Every save's bytes differ from every other's (a 64 MiB random
pool, each 4 MiB piece XORed with its own 64-bit salt per save, rank, file and piece), streamed, so
the harness holds no file whole; digests are computed before the save (untimed).

Stores (``--stores``): ``local`` (a root in the work directory; sizes ``--sizes``), ``s3`` (``s3://``
on one moto server, tests/s3_server.py ``MotoServer``, as bench/s3.py starts it; every byte through
the service) and ``s3-direct`` (the same root, each file PUT straight into the bucket with the
presigned URLs the service signs, ``POST .../presign`` then ``.../confirm``, as the default client
does: parts of ``PART_BYTES``, 4 in flight per rank); the S3 stores save ``--s3-sizes`` (default up
to 256 MiB: moto serves a ranged GET by copying the whole object, so a GiB there takes ~50 s a
save). A rank declares each file's chunk ahead of its bytes (``X-Ckptd-Chunks``) where the session
offers ``arrival_checks``, as the client does, so the commit confirms instead of reading back;
``local-read-back`` and ``s3-read-back`` send the same files undeclared (as older clients do): the
commit reads every byte back, the A beside the B in one run. Per store one service process (``--replicas``: that many on the one root, rank r saving through replica r * replicas // world, as node-local replicas) serves every save (one untimed 2-rank save first); the
settings are the defaults but for the per-principal limits (off: every simulated rank is one
principal).

Per save:

* **commit lag**: from the moment the last data file is stored (its ``PUT`` answered; with direct
  uploads its ``confirm`` answered) to the marker: the answer of the index ``PUT`` that says
  ``committed`` (or, where none does, the long poll ``GET .../sessions/{sid}?wait=`` that does). On a
  local root also to the ``COMMITTED`` file's modification time (``marker_lag_s``: no answer in it).
* the service's **CPU seconds** over that interval (``/proc/PID/stat`` utime + stime, plus its reaped
  children's), and what it **read** over it: on a local root ``/proc/PID/io`` ``read_bytes`` (from the
  device) and ``rchar`` (every ``read`` call); on S3, where the service's reads are socket receives
  that ``rchar`` does not count, the bytes received on ``lo`` in the interval (every process's: a
  few MB/s of others' traffic too, on a shared machine) and the data-file GETs moto logged in it
  (moto's log has no sizes; the table sets them beside the checkpoint's pieces of
  ``S3Storage.read_piece``, one ranged GET each); moto's CPU seconds as well.
* the upload's wall time (first request to the last file stored), for scale.

Sizes and world sizes are crossed; each save is repeated ``--repeat`` times (repeats outermost, so a
drift of the shared machine spreads over every cell), median reported, min and max kept. After each
save its verification is waited for (untimed: the re-read after the marker would otherwise run in the
next save's lag), and the one before it is removed (``DELETE /v1/checkpoints/...``, untimed) so the store holds two at
most. The load average is recorded at the start and end of each store's run (the machine is shared).
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import hashlib
import json
import os
import re
import statistics
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import httpx
import numpy as np
import xxhash

from ckptd_client._presigned import PART_BYTES, PARTS_IN_FLIGHT
from ckptd_client._saveplan import FILE_BYTES
from ckptd_schemas import arrival
from ckptd_schemas.filedigest import StreamDigest

from ._report import add_workdir_args, git_state, work_dir, write_report
from .replicas import verification

REPO = Path(__file__).resolve().parents[1]
if str(REPO / "tests") not in sys.path:
    sys.path.insert(0, str(REPO / "tests"))

from s3_server import AWS_VARS_TO_CLEAR, MotoServer  # noqa: E402  (tests/s3_server.py)
from support import ServerProcess  # noqa: E402  (tests/support.py)

MiB = 1 << 20
RUN = "lag"
BUCKET = "bucket"
PIECE = 4 * MiB  # the streamed body's piece; also divides PART_BYTES and FILE_BYTES
POOL = 64 * MiB  # random bytes generated once
#: ``*-read-back``: the same store, files sent without their chunks declared (as older clients do), so the
#: commit reads every byte back: the A beside each B in one run
STORES = ("local", "s3", "s3-direct", "local-read-back", "s3-read-back")
ENV = {"CKPTD_MAX_REQUESTS_PER_PRINCIPAL": "0", "CKPTD_MAX_UPLOADS_PER_PRINCIPAL": "0",
       "CKPTD_MAX_CONNECTIONS": "4096"}


def parse_size(text: str) -> int:
    """``64M``, ``1G``, ``512`` (MiB) -> bytes."""
    text = text.strip().upper().removesuffix("IB").removesuffix("B")
    if text.endswith("G"):
        return int(float(text[:-1]) * 1024) * MiB
    return int(float(text.removesuffix("M"))) * MiB


def _label(size: int) -> str:
    return f"{size // (1 << 30)} GiB" if size >= 1 << 30 else f"{size // MiB} MiB"


# -- the service's process, from /proc ------------------------------------------------------------

def _tree(pid: int) -> list[int]:
    """``pid`` and its live descendants."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        try:
            for task in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{task}/children") as f:
                    todo += [int(c) for c in f.read().split()]
        except OSError:
            pass
    return out


def proc_sample(pid: int) -> dict[str, float]:
    """CPU seconds (utime + stime of ``pid`` and its live descendants, plus reaped children's) and
    ``read_bytes``/``rchar`` of the same processes."""
    tick = os.sysconf("SC_CLK_TCK")
    cpu = 0.0
    io = {"read_bytes": 0, "rchar": 0}
    for p in _tree(pid):
        try:
            with open(f"/proc/{p}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            cpu += sum(int(x) for x in fields[11:15 if p == pid else 13]) / tick
            with open(f"/proc/{p}/io") as f:
                for line in f:
                    k, v = line.split(":")
                    if k in io:
                        io[k] += int(v)
        except OSError:
            pass
    return {"cpu_s": cpu, **io}


def loopback_bytes() -> int:
    """Bytes received on ``lo`` so far (``/proc/net/dev``): every process's loopback traffic, this
    network namespace's other users' too (a few MB/s here when idle), so a cross-check, not a count."""
    with open("/proc/net/dev") as f:
        for line in f:
            name, _, rest = line.partition(":")
            if name.strip() == "lo":
                return int(rest.split()[0])
    return 0


def moto_requests(log: Path, a: int, b: int) -> dict[str, int]:
    """The S3 requests moto logged between byte ``a`` and ``b`` of its log, by kind (bench/s3.py's
    kinds), and ``file_get``: the ranged GETs of data files (the service reads them in pieces of
    ``S3Storage.read_piece``; moto's log has no sizes)."""
    from bench.s3 import _LOG_LINE, _kind  # imports torch: only for the S3 stores

    with open(log, "rb") as f:
        f.seek(a)
        text = f.read(b - a).decode("utf-8", "replace")
    counts: dict[str, int] = {}
    for m in _LOG_LINE.finditer(text):
        kind = _kind(*m.groups())
        counts[kind] = counts.get(kind, 0) + 1
        if m.group(1) == "GET" and "/files/" in m.group(2).split("?")[0]:  # not a listing of the folder
            counts["file_get"] = counts.get("file_get", 0) + 1
    return counts


def _delta(a: dict[str, float], b: dict[str, float]) -> dict[str, float]:
    return {k: b[k] - a[k] for k in a}


# -- the bytes ---------------------------------------------------------------------------------------

class Bytes:
    """Every file's bytes, made on demand from one random pool: piece k is the pool's 4 MiB at
    ``k * PIECE mod POOL``, XORed with a 64-bit salt of (save, rank, file, k)."""

    def __init__(self) -> None:
        self.pool = np.frombuffer(os.urandom(POOL), dtype=np.uint64)

    def pieces(self, key: str, length: int) -> Iterator[bytes]:
        assert length % 8 == 0, length
        for k in range(-(-length // PIECE)):
            n = min(PIECE, length - k * PIECE) // 8
            a = (k * PIECE % POOL) // 8
            salt = np.uint64(xxhash.xxh3_64_intdigest(f"{key}/{k}".encode()))
            yield (self.pool[a:a + n] ^ salt).tobytes()

    async def body(self, key: str, length: int) -> AsyncIterator[bytes]:
        for p in self.pieces(key, length):
            yield p


def _files(rank: int, per_rank: int) -> list[tuple[str, int]]:
    """(name, length) of one rank's data files: at most ``FILE_BYTES`` each, as the client cuts them."""
    n = -(-per_rank // FILE_BYTES)
    return [(f"r{rank:03d}-{j:04d}.bin", min(FILE_BYTES, per_rank - j * FILE_BYTES)) for j in range(n)]


def _layout(size: int, world: int) -> list[tuple[str, int]]:
    """Every data file of a save, all ranks."""
    return [f for r in range(world) for f in _files(r, size // world)]


def _digests(data: Bytes, key: str, length: int, direct: bool) -> dict:
    """The file's XXH3 (header, chunk digest); with ``direct`` also each part's SHA-256 and the
    per-block record the confirmation declares."""
    if not direct:
        h = xxhash.xxh3_64()
        for p in data.pieces(key, length):
            h.update(p)
        return {"xxh3": h.hexdigest()}
    shas, digest, sha, filled = [], StreamDigest(), hashlib.sha256(), 0
    for p in data.pieces(key, length):
        digest.update(p)
        sha.update(p)
        filled += len(p)
        if filled == PART_BYTES:
            shas.append(base64.b64encode(sha.digest()).decode())
            sha, filled = hashlib.sha256(), 0
    if filled or not shas:
        shas.append(base64.b64encode(sha.digest()).decode())
    whole, blocks = digest.finish()
    return {"xxh3": whole, "sha256": shas, "blocks": blocks, "block_size": digest.block_size}


def _index(rank: int, world: int, per_rank: int, files: list[tuple[str, int]], digests: list[dict]) -> dict:
    """One flat uint8 tensor of ``world * per_rank`` elements; this rank's chunks tile its share."""
    chunks, at = [], rank * per_rank
    for (file, length), d in zip(files, digests):
        chunks.append({"kind": "box", "rank": rank, "offsets": [at], "sizes": [length],
                       "location": {"file": file, "offset": 0, "length": length, "codec": "raw",
                                    "raw_length": length, "xxh3": d["xxh3"]}})
        at += length
    return {"rank": rank, "world_size": world, "files": [f for f, _ in files],
            "tensors": [{"name": "w", "shape": [world * per_rank], "dtype": "uint8", "group": "model",
                         "chunks": chunks}]}


async def _prefixed(head: bytes, body: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    yield head
    async for piece in body:
        yield piece


# -- one save ----------------------------------------------------------------------------------------

async def _direct_put(c: httpx.AsyncClient, store: httpx.AsyncClient, url: str, data: Bytes, key: str,
                      length: int, d: dict) -> None:
    """What ``ckptd_client._presigned.DirectUploads.put`` does: presign, PUT the parts (4 at once), confirm."""
    claim = {"size": length, "part_size": PART_BYTES, "sha256": d["sha256"]}
    r = await c.post(f"{url}/presign", json=claim)
    r.raise_for_status()
    signed = r.json()
    assert signed["block_size"] == d["block_size"], signed
    gate = asyncio.Semaphore(PARTS_IN_FLIGHT)
    pieces = data.pieces(key, length)
    per_part = PART_BYTES // PIECE

    async def part(u: str, h: dict, n: int) -> str:
        async with gate:
            body = b"".join(p for _, p in zip(range(per_part), pieces))  # parts are taken in order
            resp = await store.put(u, content=body, headers=h)
            assert resp.status_code // 100 == 2, (resp.status_code, resp.text[:300])
            return resp.headers.get("ETag", "")

    etags = await asyncio.gather(*(part(u, h, n) for n, (u, h) in enumerate(zip(signed["urls"], signed["headers"]))))
    r = await c.post(f"{url}/confirm", json={**claim, "upload_id": signed["upload_id"],
                                             "etags": list(etags) if signed["upload_id"] else [],
                                             "xxh3": d["xxh3"], "block_size": d["block_size"], "blocks": d["blocks"]})
    r.raise_for_status()


async def save(urls: list[str], pids: list[int], data: Bytes, name: str, step: int, world: int, size: int, *,
               direct: bool = False, moto_pid: int = 0, moto_log: Path | None = None, declare: bool = True) -> dict:
    """One checkpoint ``RUN/name`` of ``size`` bytes by ``world`` ranks; its commit lag (module docstring)."""
    base = f"/v1/checkpoints/{RUN}/{name}"
    sid = f"lag-{name}"
    per_rank = size // world
    assert per_rank * world == size and per_rank % 8 == 0, (size, world)
    layout = [_files(r, per_rank) for r in range(world)]
    digests = [[_digests(data, f"{name}/{f}", n, direct) for f, n in files] for files in layout]
    n_files = sum(len(f) for f in layout)
    # per replica, its ranks' connections: rank r saves through replica r * replicas // world (a node's ranks)
    per = max(1, min(world, 16) // len(urls))
    clients = [[httpx.AsyncClient(base_url=url, timeout=600) for _ in range(per)] for url in urls]
    store = httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=world * PARTS_IN_FLIGHT))
    marks: dict = {"stored": 0}

    def sample() -> dict:
        t = time.perf_counter()
        procs = [proc_sample(pid) for pid in pids]  # every replica's, summed
        out = {"t": t, "wall": time.time(), **{k: sum(p[k] for p in procs) for k in procs[0]}, "lo": loopback_bytes(),
               "moto_cpu_s": proc_sample(moto_pid)["cpu_s"] if moto_pid else 0.0,
               "moto_log": os.path.getsize(moto_log) if moto_log else 0}
        out["sample_s"] = time.perf_counter() - t
        return out

    async def rank(r: int) -> None:
        own = clients[r * len(urls) // world]
        c = own[r % len(own)]
        opened = await c.post(f"{base}/sessions", json={"session": sid, "world_size": world, "step": step,
                                                        "direct_uploads": direct})
        opened.raise_for_status()
        assert bool(opened.json().get("presigned")) == direct, opened.text
        declared = declare and bool(opened.json().get("arrival_checks"))
        for (file, length), d in zip(layout[r], digests[r]):
            furl = f"{base}/sessions/{sid}/files/{file}"
            if direct:
                await _direct_put(c, store, furl, data, f"{name}/{file}", length, d)
            elif declared:  # its one chunk declared ahead of its bytes, as the client does where offered
                head = arrival.encode([arrival.Declared(0, length, d["xxh3"], "raw", length, "tensor", "w")])
                resp = await c.put(furl, content=_prefixed(head, data.body(f"{name}/{file}", length)),
                                   headers={"X-Ckptd-Xxh3": d["xxh3"], "Content-Length": str(len(head) + length),
                                            arrival.CHUNKS_HEADER: str(len(head))})
            else:
                resp = await c.put(furl, content=data.body(f"{name}/{file}", length),
                                   headers={"X-Ckptd-Xxh3": d["xxh3"], "Content-Length": str(length)})
                assert resp.status_code == 200, resp.text[:300]
            marks["stored"] += 1
            if marks["stored"] == n_files:
                marks["last_byte"] = sample()
        resp = await c.put(f"{base}/sessions/{sid}/ranks/{r}",
                           content=json.dumps(_index(r, world, per_rank, layout[r], digests[r])).encode(),
                           headers={"Content-Type": "application/json"})
        assert resp.status_code == 200, resp.text[:300]
        if resp.json()["state"] == "committed" and "marker" not in marks:
            marks["marker"] = sample()
            marks["committed_by"] = "index"

    try:
        first = sample()
        await asyncio.gather(*(rank(r) for r in range(world)))
        while "marker" not in marks:  # the commit answered none of the indexes: wait for it
            st = await clients[0][0].get(f"{base}/sessions/{sid}", params={"wait": 60})
            st.raise_for_status()
            if st.json()["state"] != "open":
                assert st.json()["state"] == "committed", st.text[:300]
                marks["marker"] = sample()
                marks["committed_by"] = "poll"
    finally:
        for c in (c for own in clients for c in own):
            await c.aclose()
        await store.aclose()
    a, b = marks["last_byte"], marks["marker"]
    skip = ("t", "wall", "sample_s")
    during = _delta({k: v for k, v in a.items() if k not in skip}, {k: v for k, v in b.items() if k not in skip})
    return {"name": name, "lag_s": b["t"] - a["t"], "upload_s": a["t"] - first["t"], "last_byte_wall": a["wall"],
            "committed_by": marks["committed_by"], "service_cpu_s": during["cpu_s"],
            "read_bytes": during["read_bytes"], "rchar": during["rchar"], "moto_cpu_s": during["moto_cpu_s"],
            "loopback_bytes": during["lo"], "sample_s": a["sample_s"],
            "s3_requests": moto_requests(moto_log, int(a["moto_log"]), int(b["moto_log"])) if moto_log else {},
            "save_service_cpu_s": b["cpu_s"] - first["cpu_s"], "files": n_files}


# -- one store ---------------------------------------------------------------------------------------

def run_store(which: str, sizes: list[int], worlds: list[int], repeat: int, work: Path, data: Bytes,
              moto: MotoServer | None, replicas: int = 1) -> dict:
    """Every (size, world) ``repeat`` times on ``replicas`` services of store ``which`` (one root)."""
    direct, declare = which == "s3-direct", not which.endswith("-read-back")
    if which.startswith("local"):
        root: str = str(work / f"root-{which}")  # its own: the names of a run repeat per store
        env = dict(ENV)
    else:
        assert moto is not None
        root, env = f"s3://{BUCKET}/{which}", {**ENV, **moto.env, "CKPTD_DIRECT_UPLOADS": str(direct).lower()}
    servers = [ServerProcess(root, env=env, log=work / f"server-{which}-{i}.log").start() for i in range(replicas)]
    srv, urls = servers[0], [s.url for s in servers]
    pids = [s.proc.pid for s in servers]  # type: ignore[union-attr]
    moto_pid = moto.proc.pid if moto is not None and not which.startswith("local") else 0  # type: ignore[union-attr]
    moto_log = moto.log if moto_pid else None  # type: ignore[union-attr]
    load0 = os.getloadavg()
    saves: list[dict] = []
    step, prev = 0, None
    try:
        with httpx.Client(base_url=srv.url, timeout=600) as c:
            def forget(name: str | None) -> None:
                if name:
                    r = c.delete(f"/v1/checkpoints/{RUN}/{name}")
                    assert r.status_code == 200 and r.json()["removed"], r.text[:300]

            step += 1
            asyncio.run(save(urls, pids, data, "warmup", step, 2, 2 * MiB, direct=direct, moto_pid=moto_pid,
                             moto_log=moto_log, declare=declare))
            prev = "warmup"
            for rep in range(repeat):
                for size in sizes:
                    for world in worlds:
                        step += 1
                        name = f"s{size // MiB}m-r{world}-{rep}"
                        got = asyncio.run(save(urls, pids, data, name, step, world, size, direct=direct,
                                               moto_pid=moto_pid, moto_log=moto_log, declare=declare))
                        if which.startswith("local"):
                            marker = Path(root) / "runs" / RUN / name / "COMMITTED"
                            got["marker_lag_s"] = marker.stat().st_mtime - got["last_byte_wall"]
                        got.update(store=which, size=size, ranks=world, repeat=rep)
                        saves.append(got)
                        print(json.dumps({k: (round(v, 4) if isinstance(v, float) else v) for k, v in got.items()}),
                              flush=True)
                        assert verification(urls, f"{RUN}/{name}") is not None, name  # the re-read of
                        forget(prev)  # bytes checked on arrival, after the marker: not in the next save's lag
                        prev = name
                        time.sleep(0.3)  # the removal's work settles before the next save
    finally:
        for s in servers:
            s.stop()
    return {"store": which, "root": root, "replicas": replicas, "loadavg_start": load0, "loadavg_end": os.getloadavg(), "saves": saves}


def summarise(saves: list[dict]) -> list[dict]:
    """Per (store, size, ranks): medians, with the lag's min and max."""
    cells: dict[tuple, list[dict]] = {}
    for s in saves:
        cells.setdefault((s["store"], s["size"], s["ranks"]), []).append(s)
    rows = []
    for (store, size, ranks), group in cells.items():
        med = {k: statistics.median(g[k] for g in group)
               for k in ("lag_s", "service_cpu_s", "read_bytes", "rchar", "loopback_bytes", "moto_cpu_s", "upload_s")}
        row = {"store": store, "size": size, "ranks": ranks, "n": len(group), **med,
               "lag_min_s": min(g["lag_s"] for g in group), "lag_max_s": max(g["lag_s"] for g in group),
               "committed_by": sorted({g["committed_by"] for g in group}),
               "s3_file_gets": statistics.median(g["s3_requests"].get("file_get", 0) for g in group)}
        if not store.startswith("local"):
            from ckptd.storage.s3 import S3Storage  # the s3 extra

            row["file_pieces"] = sum(-(-n // S3Storage.read_piece) for _, n in _layout(size, ranks))
        if "marker_lag_s" in group[0]:
            row["marker_lag_s"] = statistics.median(g["marker_lag_s"] for g in group)
        rows.append(row)
    return rows


def markdown(result: dict) -> str:
    lines = ["| store | size | ranks | commit lag s (min–max) | service CPU-s in the lag | what the service read in "
             "the lag | moto CPU-s in the lag | upload s |", "| --- " * 8 + "|"]
    for r in result["rows"]:
        local = r["store"].startswith("local")
        read = (f"{r['read_bytes'] / MiB:.0f} MiB from the device ({r['rchar'] / MiB:.0f} MiB read())" if local else
                f"{r['s3_file_gets']:.0f} file GETs ({r['file_pieces']} pieces in all), "
                f"{r['loopback_bytes'] / MiB:.0f} MiB over loopback")
        lines.append(f"| {r['store']} | {_label(r['size'])} | {r['ranks']} | {r['lag_s']:.3f} ({r['lag_min_s']:.3f}–"
                     f"{r['lag_max_s']:.3f}) | {r['service_cpu_s']:.2f} | {read} | "
                     f"{'' if local else format(r['moto_cpu_s'], '.2f')} | {r['upload_s']:.2f} |")
    loads = "; ".join(f"{s['store']}: {', '.join(f'{x:.2f}' for x in s['loadavg_start'])} at the start, "
                      f"{', '.join(f'{x:.2f}' for x in s['loadavg_end'])} at the end" for s in result["stores"])
    return "\n".join(lines) + (f"\n\nMedian of {result['config']['repeat']} per cell. Load average (1, 5, 15 min): "
                               f"{loads}.\n")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", default="64M,256M,1G", help="total checkpoint sizes, comma-separated (M, G: MiB, GiB)")
    ap.add_argument("--ranks", default="2,8", help="world sizes, comma-separated")
    ap.add_argument("--s3-sizes", default="64M,256M",
                    help="the sizes on the S3 stores (moto takes ~50 s per GiB saved and committed here)")
    ap.add_argument("--stores", default="local,s3,s3-direct", help=f"of {', '.join(STORES)}")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--replicas", type=int, default=1,
                    help="services on the one root; rank r saves through replica r * replicas // world")
    ap.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "commit_lag.json")
    ap.add_argument("--md", type=Path, default=None, help="the table as markdown (default: --out with .md)")
    add_workdir_args(ap)
    args = ap.parse_args(argv)
    sizes = [parse_size(s) for s in args.sizes.split(",")]
    s3_sizes = [parse_size(s) for s in args.s3_sizes.split(",")]
    worlds = [int(x) for x in args.ranks.split(",")]
    stores = [s.strip() for s in args.stores.split(",")]
    assert set(stores) <= set(STORES), stores
    t0 = time.perf_counter()
    command = (f".venv/bin/python -m bench.commit_lag --sizes {args.sizes} --s3-sizes {args.s3_sizes} --ranks "
               f"{args.ranks} --stores {args.stores} --repeat {args.repeat} --replicas {args.replicas}")  # every setting
    result: dict = {"command": command,
                    "config": {"sizes": sizes, "s3_sizes": s3_sizes, "ranks": worlds, "stores": stores,
                               "repeat": args.repeat, "replicas": args.replicas,
                               "file_bytes": FILE_BYTES, "part_bytes": PART_BYTES, "env": ENV},
                    "git": git_state(), "nproc": os.cpu_count(), "stores": []}
    with work_dir("ckptd-bench-lag-", args.workdir, args.keep) as work:
        data = Bytes()
        moto = None
        try:
            if any(not s.startswith("local") for s in stores):
                moto = MotoServer(work / "moto.log", bucket=BUCKET).start()
                for k in AWS_VARS_TO_CLEAR:
                    os.environ.pop(k, None)
                import importlib.metadata as md
                result["config"]["moto"] = md.version("moto")
            for which in stores:
                result["stores"].append(run_store(which, sizes if which.startswith("local") else s3_sizes, worlds, args.repeat,
                                                  work, data, moto, args.replicas))
        finally:
            if moto is not None:
                moto.stop()
    result["rows"] = summarise([s for st in result["stores"] for s in st["saves"]])
    result["wall_s"] = time.perf_counter() - t0
    table = markdown(result)
    (args.md or args.out.with_suffix(".md")).parent.mkdir(parents=True, exist_ok=True)
    write_report(args.out, result, table)
    (args.md or args.out.with_suffix(".md")).write_text(
        f"# Commit lag\n\n```bash\n{result['command']}\n```\n\n{table}")


if __name__ == "__main__":
    main()
