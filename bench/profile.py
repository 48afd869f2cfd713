"""Where the time goes: py-spy profiles of a save, a load at another world size and an offline reshard.

    .venv/bin/pip install py-spy          # once; a static binary, no ptrace permission needed (it spawns)
    .venv/bin/python -m bench.profile --gib 1 --out bench/results/profile.json

Three workloads on one ~``--gib`` GiB fp32 state (the save/load benchmark's: 8 ``Shard(0)``
DTensors with uneven row counts), each run under ``py-spy record --subprocesses --format raw``
(py-spy starts the command itself, so it may sample it without ptrace rights over
other processes), one after the other in one temporary work directory:

* ``save``: a driver starts a real ``ckptd serve`` and two gloo ranks that each
  ``CheckpointClient.save(...).wait()`` their shards: the server, both client ranks
  and the driver are sampled (one collapsed file, stacks prefixed by their process);
* ``load``: on the same root, with the checkpoint evicted from the page cache, a
  fresh ``ckptd serve`` and three gloo ranks (another world size) that
  ``CheckpointClient.load`` it into DTensors on a 3-mesh;
* ``reshard``: ``ckptd reshard bench/src --to fsdp2:dp=3 --root ROOT --jobs 2``
  (offline, one process), the checkpoint evicted first.

py-spy samples Python stacks (``--rate`` per second per thread) of threads that are
running or waiting on the disk (D state); threads parked on a lock, a queue, a
socket or a sleep are not sampled (py-spy's default, no ``--idle``). A C function
shows as the Python line that called it, so each sample is put in a category by
its innermost frame (function, file and the text of that source line; see
``CATEGORIES``) and by frames above it (import machinery, HTTP stacks). Per
workload: the samples per process, the top ``--top`` functions by own time (the
innermost frame) and by cumulative time (in the stack at all), and the share of
each category. The collapsed stacks (paths made relative, process ids replaced by
roles) go to ``bench/results/profiles/<workload>.collapsed`` (gzipped above 1 MB).

The functions ``pyspy_record``, ``parse_raw``, ``aggregate``, ``categorize`` and
``save_collapsed`` are also used by ``bench/verify.py --profile``.
"""

from __future__ import annotations

import argparse
import functools
import gzip
import linecache
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import time
from collections import Counter
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO / "tests") not in sys.path:
    sys.path.insert(0, str(REPO / "tests"))

from bench._report import add_workdir_args, git_state, work_dir, write_report  # noqa: E402

MiB, GiB = 1 << 20, 1 << 30
PY = sys.executable
REF = "bench/src"
SAVE_WORLD, LOAD_WORLD = 2, 3
RESHARD_SPEC = "fsdp2:dp=3"
WORKLOADS = ("save", "load", "reshard")
MAX_PLAIN = 1 << 20  # collapsed files above this are gzipped

Stack = tuple[str, ...]


# -- running py-spy -----------------------------------------------------------------------------------

def pyspy_bin() -> str:
    for cand in (Path(PY).parent / "py-spy", shutil.which("py-spy")):
        if cand and Path(cand).exists():
            return str(cand)
    raise SystemExit("py-spy not found: .venv/bin/pip install py-spy")


def pyspy_record(cmd: list[str], raw: Path, *, rate: int = 100, subprocesses: bool = True, native: bool = False,
                 timeout: float = 1800, env: dict[str, str] | None = None, root_role: str = "main") -> dict:
    """``py-spy record --format raw`` over ``cmd`` (py-spy spawns it); the parsed stacks and the wall time."""
    raw.parent.mkdir(parents=True, exist_ok=True)
    tmp = raw.with_suffix(raw.suffix + ".tmp")
    spy = [pyspy_bin(), "record", "--format", "raw", "--full-filenames", "-r", str(rate), "-o", str(tmp)]
    if subprocesses:
        spy.append("--subprocesses")
    if native:
        spy.append("--native")
    t0 = time.perf_counter()
    p = subprocess.run([*spy, "--", *cmd], cwd=REPO, capture_output=True, text=True, timeout=timeout,
                       env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})})
    wall = time.perf_counter() - t0
    if p.returncode != 0 or not tmp.exists():
        raise RuntimeError(f"py-spy over {' '.join(cmd)} exited with {p.returncode}:\n{p.stdout[-3000:]}\n"
                           f"{p.stderr[-3000:]}")
    stacks = parse_raw(tmp.read_text(errors="replace"), root_role)
    tmp.unlink()
    m = re.search(r"Samples: (\d+) Errors: (\d+)", p.stderr + p.stdout)
    return {"command": " ".join(["py-spy", *spy[1:], "--", *cmd]).replace(PY, "python"), "wall_s": wall,
            "stacks": stacks, "pyspy_samples": int(m.group(1)) if m else None,
            "pyspy_errors": int(m.group(2)) if m else None, "output": p.stdout[-4000:]}


# -- parsing and naming -------------------------------------------------------------------------------

_PROC = re.compile(r'process (\d+):"([^"]*)"(?:;|$)')
_FRAME = re.compile(r"^(?P<func>.*) \((?P<file>.*?):(?P<line>\d+)\)$")
_PREFIXES: list[tuple[str, str]] = []


def _prefixes() -> list[tuple[str, str]]:
    if not _PREFIXES:
        paths = sysconfig.get_paths()
        found = [(str(REPO) + "/", ""), (paths["purelib"] + "/", "site:"), (paths["platlib"] + "/", "site:"),
                 (paths["stdlib"] + "/", "stdlib:")]
        _PREFIXES.extend(sorted(set(found), key=lambda kv: -len(kv[0])))
    return _PREFIXES


def short_path(path: str) -> str:
    for prefix, tag in _prefixes():
        if path.startswith(prefix):
            return tag + path[len(prefix):]
    return path


def role_of(cmdline: str) -> str:
    """A stable name for a sampled process from its command line."""
    if " serve " in f" {cmdline} " or cmdline.endswith(" serve"):
        return "server"
    if "multiprocessing" in cmdline and ("spawn_main" in cmdline or "--multiprocessing-fork" in cmdline):
        return "rank"
    if "resource_tracker" in cmdline:
        return "mp-resource-tracker"
    if " reshard " in f" {cmdline} ":
        return "ckptd reshard"
    if " verify " in f" {cmdline} ":
        return "ckptd verify"
    if "bench.profile" in cmdline:
        return "driver"
    return cmdline[:60]


def parse_raw(text: str, root_role: str = "main") -> Counter:
    """py-spy ``--format raw`` (collapsed stacks, ``frame;frame;... count``) -> Counter of stacks.

    With ``--subprocesses`` each stack starts with ``process PID:"cmdline"`` frames; those become one
    ``[role]`` frame (the innermost process), ranks numbered by pid order: ``[rank 0]``, ``[rank 1]``..."""
    raw: list[tuple[str | None, str, list[str], int]] = []
    pids: dict[str, str] = {}
    for line in text.splitlines():
        line = line.rstrip()
        if not line:
            continue
        head, _, count = line.rpartition(" ")
        if not count.isdigit():
            continue
        pid = None
        while m := _PROC.match(head):
            pid, cmd = m.group(1), m.group(2)
            pids.setdefault(pid, cmd)
            head = head[m.end():]
        frames = [f for f in head.split(";") if f] if head else []
        raw.append((pid, pids.get(pid, "") if pid else "", frames, int(count)))
    ranks = sorted((p for p, c in pids.items() if role_of(c) == "rank"), key=int)
    names = {p: (f"rank {ranks.index(p)}" if role_of(c) == "rank" else role_of(c) if c else root_role)
             for p, c in pids.items()}
    out: Counter = Counter()
    for pid, _, frames, n in raw:
        proc = f"[{names[pid]}]" if pid else f"[{root_role}]"
        out[(proc, *(_short_frame(f) for f in frames))] += n
    return out


def _short_frame(frame: str) -> str:
    m = _FRAME.match(frame)
    if not m:
        return frame
    return f"{m.group('func')} ({short_path(m.group('file'))}:{m.group('line')})"


def split_frame(frame: str) -> tuple[str, str, int]:
    m = _FRAME.match(frame)
    if not m:
        return frame, "", 0
    return m.group("func"), m.group("file"), int(m.group("line"))


def func_of(frame: str) -> str:
    """The function without its line: ``name (file)``."""
    func, file, _ = split_frame(frame)
    return f"{func} ({file})" if file else func


# (file, line) -> source text as it was when the profile was recorded (others may edit the tree later)
_SOURCES: dict[tuple[str, int], str] = {}


def snapshot_sources(stacks: Counter) -> dict[str, str]:
    """The source text of every innermost frame, read now: ``{"file:line": text}`` (kept with the result)."""
    out = {}
    for stack in stacks:
        if len(stack) > 1:
            func, file, line = split_frame(stack[-1])
            if file:
                out[f"{file}:{line}"] = _source_line(file, line)
    return out


def use_sources(sources: dict[str, str]) -> None:
    """Classify by the recorded source text instead of today's files."""
    for key, text in sources.items():
        file, _, line = key.rpartition(":")
        _SOURCES[(file, int(line))] = text
    category_of.cache_clear()


def _source_line(file: str, line: int) -> str:
    if (file, line) in _SOURCES:
        return _SOURCES[(file, line)]
    if not file or line <= 0:
        return ""
    if file.startswith("site:") or file.startswith("stdlib:"):
        tag, rest = file.split(":", 1)
        paths = sysconfig.get_paths()
        full = os.path.join(paths["purelib"] if tag == "site" else paths["stdlib"], rest)
    elif file.startswith("/") or file.startswith("<"):
        full = file
    else:
        full = str(REPO / file)
    return linecache.getline(full, line).strip()


# -- aggregation ----------------------------------------------------------------------------------

# entry points that sit under every sample of a process or thread: left out of the cumulative table
_ENTRY = re.compile(r"^(_run_module_as_main|_run_code|<module> \((<string>|ckptd/cli/main\.py|bench/profile\.py)\)|"
                    r"main \(ckptd/cli/main\.py\)|spawn_main|_main \(stdlib:multiprocessing|"
                    r"BaseProcess\.|_wrap \(site:torch/multiprocessing|_rank_main|Thread\._bootstrap|"
                    r"Thread\.run|_worker \(stdlib:concurrent|WorkerThread\.run|_driver \(bench|"
                    # import machinery: _find_and_load alone stands for it
                    r"_call_with_frames_removed|_LoaderBasics\.exec_module|_find_and_load_unlocked|_load_unlocked|"
                    r"_handle_fromlist|_gcd_import|import_module \(stdlib)")


def aggregate(stacks: Counter, top: int = 15, *, process: str | None = None, busy_only: bool = True) -> dict:
    """Top functions by own samples (innermost frame) and by cumulative samples (anywhere in the stack).

    ``busy_only``: leave out samples of parked threads and of the bench's own work (IDLE, HARNESS)."""
    own: Counter = Counter()
    cum: Counter = Counter()
    total = 0
    for stack, n in stacks.items():
        if process is not None and stack[0] != process:
            continue
        if busy_only and category_of(stack) in (IDLE, HARNESS):
            continue
        frames = stack[1:]
        total += n
        if not frames:
            own["(no Python frame: interpreter exit, final GC)"] += n
            continue
        own[func_of(frames[-1])] += n
        for f in {func_of(fr) for fr in frames}:
            if not _ENTRY.match(f):
                cum[f] += n

    def rows(c: Counter) -> list[dict]:
        return [{"function": f, "samples": k, "fraction": k / total if total else 0.0} for f, k in c.most_common(top)]

    return {"samples": total, "top_self": rows(own), "top_cumulative": rows(cum)}


def per_process(stacks: Counter) -> dict[str, int]:
    c: Counter = Counter()
    for stack, n in stacks.items():
        c[stack[0]] += n
    return dict(c.most_common())


# (category, where: "leaf" looks at the innermost frame's function/file/source text, "any" at every frame's
#  function/file, regex). First match wins, in this order. IDLE and HARNESS are left out of the "busy" shares.
IDLE = "threads parked on a lock/queue (idle)"
HARNESS = "bench harness (state, checks)"
NO_FRAMES = "interpreter exit (final GC, no Python frame)"
IMPORT = "import time"
SETUP = "process/dist setup, barriers"
NOT_WORK = (IDLE, HARNESS, NO_FRAMES, IMPORT, SETUP)
CATEGORIES: list[tuple[str, str, str]] = [
    # py-spy skips idle threads, but with many parked threads (anyio's pool, httpx's) ~1% of their
    # wake-ups still land in the samples; they do no work
    (IDLE, "leaf", r"^(Condition\.wait|Event\.wait|Queue\.get|SimpleQueue\.get|Thread\.join|_wait_for_tstate_lock|"
                   r"Semaphore\.acquire|BoundedSemaphore\.acquire) |waiter\.acquire\(|work_queue\.get\(|\.wait\(|"
                   r"time\.sleep\(|lock\.acquire\(|selector\.poll\(|\._selector\.select\("),
    (IMPORT, "any", r"_find_and_load|<frozen importlib|_call_with_frames_removed"),
    (HARNESS, "any", r"\b(make_state|_pattern|tensor_specs|_check_loaded|evict)\b \((bench/|tests/)"),
    (SETUP, "any",
     r"\b(init_process_group|init_device_mesh|destroy_process_group|barrier|monitored_barrier|rendezvous)\b"),
    ("HTTP client setup (TLS context)", "leaf", r"load_verify_locations|create_default_context"),
    ("HTTP socket send/recv", "leaf",
     r"\(site:(uvicorn|httpcore|h11|httpx|starlette|anyio|uvloop)/.*(sock\.send|sock\.recv|transport\.write|"
     r"sendall|recv_into)"),
    ("hashing (xxh3)", "leaf", r"\) .*(xxh|hexdigest|intdigest|\.update\()"),
    ("digest bookkeeping (Python, per block)", "leaf", r"\((schemas/digest\.py|schemas/filedigest\.py)\)"),
    ("fsync", "leaf", r"fsync|fdatasync|sync_file_range"),
    ("file writes", "leaf", r"os\.write\b|os\.pwrite|\.write\(|writev|copy_file_range|sendfile|truncate|"
                            r"os\.replace|os\.rename|os\.link"),
    ("file reads (open, read)", "leaf", r"readinto|os\.read\b|os\.pread|preadv|\bf\.read\(|\.read\(\)|mmap|"
                                        r"posix_fadvise|\bopen\(|\.seek\("),
    ("buffer allocation (bytearray/empty, page faults)", "leaf",
     r"= bytearray\(|torch\.empty\(|torch\.zeros\(|np\.empty|empty_like|new_empty|_alloc"),
    ("memcpy / torch copies", "leaf",
     r"copy_\(|\.clone\(|contiguous\(|bytes\(|bytearray\(|tobytes|\.numpy\(|"
     r"torch\.cat|\bcopy\(|b\"\"\.join|b''\.join|narrow|index_select|\[.*:.*\] = |"
     r"copy_into|_copy|assemble|fill_|to_local|from_local|\w \+= \w|\.extend\("),
    ("JSON / pydantic", "leaf", r"model_validate|model_dump|model_construct|json|TypeAdapter|pydantic|orjson|"
                               r"validate_python|loads\(|dumps\("),
    ("JSON / pydantic", "any", r"\((site:pydantic|site:pydantic_core|stdlib:json/)"),
    ("event loop (uvloop, native: socket reads, scheduling)", "leaf", r"run_until_complete\(|run_forever\("),
    ("HTTP handling (uvicorn/starlette/fastapi/httpx, Python)", "any",
     r"\((site:(uvicorn|starlette|fastapi|h11|httpx|httpcore|anyio|sniffio|h2))/"),
    ("event loop (uvloop/asyncio, native)", "any", r"\((stdlib:(asyncio|selectors|socket|ssl)|site:uvloop)/"),
    ("torch (other)", "leaf", r"\(site:torch/"),
]


@functools.lru_cache(maxsize=None)
def category_of(stack: Stack) -> str:
    frames = stack[1:]
    if not frames:
        return NO_FRAMES
    leaf = frames[-1]
    func, file, line = split_frame(leaf)
    leaf_text = f"{func} ({file}) {_source_line(file, line)}"
    anys = " ".join(func_of(f) for f in frames)
    for name, where, rx in CATEGORIES:
        if re.search(rx, leaf_text if where == "leaf" else anys):
            return name
    return "other Python"


def categorize(stacks: Counter, *, process: str | None = None) -> dict:
    c: Counter = Counter()
    for stack, n in stacks.items():
        if process is not None and stack[0] != process:
            continue
        c[category_of(stack)] += n
    total = sum(c.values())
    busy = sum(v for k, v in c.items() if k not in (IDLE, HARNESS))
    work = sum(v for k, v in c.items() if k not in NOT_WORK)
    return {"samples": dict(c.most_common()),
            "fractions": {k: v / total for k, v in c.most_common()} if total else {},
            "busy_samples": busy,  # without parked threads and the bench's own work
            "fractions_busy": {k: v / busy for k, v in c.most_common() if k not in (IDLE, HARNESS)} if busy else {},
            "work_samples": work,  # also without process start-up and exit: the per-checkpoint work
            "fractions_work": {k: v / work for k, v in c.most_common() if k not in NOT_WORK} if work else {}}


def top_lines(stacks: Counter, top: int = 15, *, process: str | None = None) -> list[dict]:
    """The innermost frames with their line and source text: which C call a Python line stands for."""
    c: Counter = Counter()
    cats: dict[str, Counter] = {}
    for stack, n in stacks.items():
        if (process is None or stack[0] == process) and len(stack) > 1:
            c[stack[-1]] += n
            cats.setdefault(stack[-1], Counter())[category_of(stack)] += n
    total = sum(n for s, n in stacks.items() if process is None or s[0] == process)
    out = []
    for frame, n in c.most_common(top):
        func, file, line = split_frame(frame)
        out.append({"frame": frame, "source": _source_line(file, line)[:120], "samples": n,
                    "fraction": n / total if total else 0.0, "category": cats[frame].most_common(1)[0][0]})
    return out


def save_collapsed(path: Path, stacks: Counter) -> str:
    """Write ``frame;frame;... count`` lines (gzipped above 1 MB); return the path written, repo-relative."""
    path.parent.mkdir(parents=True, exist_ok=True)
    text = "".join(f"{';'.join(s)} {n}\n" for s, n in sorted(stacks.items(), key=lambda kv: -kv[1]))
    data = text.encode()
    for stale in (path, path.with_name(path.name + ".gz")):
        if stale.exists():
            stale.unlink()
    if len(data) > MAX_PLAIN:
        out = path.with_name(path.name + ".gz")
        out.write_bytes(gzip.compress(data, 9, mtime=0))
    else:
        out = path
        out.write_bytes(data)
    try:
        return str(out.relative_to(REPO))
    except ValueError:
        return str(out)


def read_collapsed(path: Path) -> Counter:
    data = gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_bytes()
    out: Counter = Counter()
    for line in data.decode().splitlines():
        head, _, n = line.rpartition(" ")
        out[tuple(head.split(";"))] += int(n)
    return out


# -- the workloads (run by py-spy as `python -m bench.profile _WORKLOAD ...`) ----------------------

def _save_rank(rank: int, world: int, cfg: dict) -> dict:
    from ckptd_client import CheckpointClient
    from torch.distributed.device_mesh import init_device_mesh

    from bench.save_load import make_state

    mesh = init_device_mesh("cpu", (world,))
    sd = make_state(cfg["specs"], mesh, fill=True)
    client = CheckpointClient(cfg["url"])
    t0 = time.perf_counter()
    client.save(sd, REF).wait()
    seconds = time.perf_counter() - t0
    client.close()
    return {"save_s": seconds}


def _check_loaded(sd: dict, specs: list, mesh: Any) -> None:
    import torch

    from bench.save_load import make_state

    want = make_state(specs, mesh, fill=True)["model"]
    for name, t in want.items():
        assert torch.equal(sd["model"][name].to_local(), t.to_local()), name


def _load_rank(rank: int, world: int, cfg: dict) -> dict:
    from ckptd_client import CheckpointClient
    from torch.distributed.device_mesh import init_device_mesh

    from bench.save_load import make_state

    mesh = init_device_mesh("cpu", (world,))
    into = make_state(cfg["specs"], mesh, fill=False)
    client = CheckpointClient(cfg["url"])
    t0 = time.perf_counter()
    client.load(into, REF)
    seconds = time.perf_counter() - t0
    client.close()
    _check_loaded(into, cfg["specs"], mesh)
    return {"load_s": seconds}


def _driver(which: str, root: Path, gib: float, log: Path) -> int:
    """Runs under py-spy: a server and the ranks of one workload; prints one JSON line."""
    import json

    from bench.save_load import tensor_specs
    from support import ServerProcess, run_ranks

    specs = tensor_specs(gib * 1024)
    server = ServerProcess(root, log=log).start()
    try:
        t0 = time.perf_counter()
        if which == "save":
            recs = run_ranks(_save_rank, SAVE_WORLD, {"specs": specs, "url": server.url}, tmp=log.parent,
                             timeout=600 + gib * 600)
        else:
            recs = run_ranks(_load_rank, LOAD_WORLD, {"specs": specs, "url": server.url}, tmp=log.parent,
                             timeout=600 + gib * 600)
        wall = time.perf_counter() - t0
        server_cpu = _proc_cpu(server.proc.pid)
    finally:
        server.stop()
    print(json.dumps({"workload": which, "ranks_wall_s": wall, "per_rank": [r["result"] for r in recs],
                      "server_cpu_s": server_cpu}), flush=True)
    return 0


def _proc_cpu(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _evict_root(root: Path) -> int:
    from bench._disk import evict

    os.sync()
    return evict([root])


def _last_json(text: str) -> dict | None:
    import json

    lines = [ln for ln in text.splitlines() if ln.startswith("{")]
    return json.loads(lines[-1]) if lines else None


# -- report -------------------------------------------------------------------------------------------

def _pct(x: float) -> str:
    return f"{100 * x:.0f}%" if x >= 0.01 else "<1%"


def markdown(res: dict) -> str:
    """Per workload and process: where the busy samples go (categories), then the top functions."""
    out = [f"{res['config']['pyspy']}, {res['config']['rate']} samples/s per thread, "
           f"{res['config']['gib']:g} GiB state. Busy samples: all but parked threads and the bench's own state "
           "building and checks (both counted in the JSON). Work samples: busy samples less import time, "
           "interpreter exit and process/dist set-up, i.e. what a long-running trainer or server pays per "
           "checkpoint. Top tables are of the busy samples."]
    for w, r in res["workloads"].items():
        out.append(f"\n### {w}: {r['what']}\n")
        rep = r.get("report") or {}
        inner = ""
        if rep.get("per_rank"):
            inner = "; per rank " + ", ".join(f"{k} {v:.2f} s" for x in rep["per_rank"] for k, v in x.items())
            inner += f"; server CPU {rep['server_cpu_s']:.1f} s"
        elif rep.get("seconds") is not None:
            inner = f"; reshard itself {rep['seconds']:.2f} s ({rep.get('units')} units)"
        out.append(f"{r['wall_s']:.1f} s wall under py-spy{inner}; samples by process: "
                   + ", ".join(f"{p} {n}" for p, n in r["processes"].items()))
        out += ["", "| process | busy samples | where they go | work samples | the work alone (no start-up, exit) |",
                "| --- | --- | --- | --- | --- |"]
        for proc, cat in r["categories_by_process"].items():
            if proc.startswith("[rank ") and "[ranks, all]" in r["categories_by_process"]:
                continue
            out.append(f"| {proc} | {cat['busy_samples']} | "
                       + ", ".join(f"{k} {_pct(v)}" for k, v in cat["fractions_busy"].items() if v >= 0.005)
                       + f" | {cat['work_samples']} | "
                       + ", ".join(f"{k} {_pct(v)}" for k, v in cat["fractions_work"].items() if v >= 0.005) + " |")
        for proc, agg in r["top_by_process"].items():
            out += [f"\n{proc}, top {len(agg['top_self'])} functions of {agg['samples']} busy samples:", "",
                    "| # | own | function (innermost frame) | cumulative | function (anywhere in the stack) |",
                    "| --- | --- | --- | --- | --- |"]
            for i in range(max(len(agg["top_self"]), len(agg["top_cumulative"]))):
                a = agg["top_self"][i] if i < len(agg["top_self"]) else None
                b = agg["top_cumulative"][i] if i < len(agg["top_cumulative"]) else None
                out.append(f"| {i + 1} | {_pct(a['fraction']) if a else ''} | {_code(a['function']) if a else ''} | "
                           f"{_pct(b['fraction']) if b else ''} | {_code(b['function']) if b else ''} |")
        for proc, lines in r["top_lines_by_process"].items():
            if proc not in r["top_by_process"]:
                continue
            out += [f"\n{proc}, innermost lines (a C call shows as the Python line that made it):", "",
                    "| samples | category | line | source |", "| --- | --- | --- | --- |"]
            out += [f"| {x['samples']} | {x['category']} | {_code(x['frame'])} | {_code(x['source'])} |"
                    for x in lines[:10]]
    return "\n".join(out)


def _code(text: str) -> str:
    return "`" + text.replace("|", "\\|").replace("`", "'") + "`" if text else ""


def profile_one(which: str, ctx: dict) -> dict:
    root, work, gib, rate, top = ctx["root"], ctx["work"], ctx["gib"], ctx["rate"], ctx["top"]
    raw = ctx["out_dir"] / f"{which}.collapsed"
    if which in ("load", "reshard"):
        _evict_root(root)
    if which in ("save", "load"):
        cmd = [PY, "-m", "bench.profile", f"_{which}", "--root", str(root), "--gib", f"{gib:g}",
               "--log", str(work / f"server-{which}.log")]
        what = ({"save": f"CheckpointClient.save at world size {SAVE_WORLD} through a real `ckptd serve`",
                 "load": f"CheckpointClient.load at world size {LOAD_WORLD} of the world-size-{SAVE_WORLD} "
                         f"checkpoint, cold page cache, through a fresh `ckptd serve`"})[which]
    else:
        cmd = [PY, "-m", "ckptd.cli.main", "reshard", REF, "--to", RESHARD_SPEC, "--root", str(root),
               "--out", f"{REF}-dp3", "--jobs", "2", "--device", "cpu", "--json"]
        what = f"`ckptd reshard {REF} --to {RESHARD_SPEC} --jobs 2` offline, cold page cache"
    print(f"=== {which}: {' '.join(cmd[1:])}", flush=True)
    rec = pyspy_record(cmd, raw, rate=rate, subprocesses=True, timeout=900 + gib * 900,
                       root_role="driver" if which in ("save", "load") else "ckptd reshard")
    stacks: Counter = rec["stacks"]
    sources = snapshot_sources(stacks)
    use_sources(sources)
    result = {"what": what, "command": rec["command"], "wall_s": rec["wall_s"], "samples": sum(stacks.values()),
              "pyspy_errors": rec["pyspy_errors"], "report": _last_json(rec["output"]),
              "file": save_collapsed(raw, stacks), **analyse(stacks, top), "leaf_sources": sources}
    print(f"{which}: {result['wall_s']:.1f}s, {result['samples']} samples, processes {result['processes']}",
          flush=True)
    return result


def analyse(stacks: Counter, top: int) -> dict:
    """Per process (and all ranks together): categories, top functions, top innermost lines."""
    procs = per_process(stacks)
    main_procs = [p for p in procs if p not in ("[mp-resource-tracker]",)]
    out = {
        "processes": procs,
        "categories": categorize(stacks),
        "categories_by_process": {p: categorize(stacks, process=p) for p in main_procs},
        "top_by_process": {p: aggregate(stacks, top, process=p) for p in main_procs
                           if p not in ("[driver]",) and procs[p] >= 20},
        "top_lines_by_process": {p: top_lines(stacks, top, process=p) for p in main_procs if procs[p] >= 20},
    }
    ranks = [p for p in procs if p.startswith("[rank ")]
    if len(ranks) > 1:  # all ranks together as well (they run the same code)
        merged: Counter = Counter()
        for s, n in stacks.items():
            if s[0] in ranks:
                merged[("[ranks]", *s[1:])] += n
        out["categories_by_process"]["[ranks, all]"] = categorize(merged)
        out["top_by_process"] = {k: v for k, v in out["top_by_process"].items() if k not in ranks}
        out["top_by_process"]["[ranks, all]"] = aggregate(merged, top)
        out["top_lines_by_process"]["[ranks, all]"] = top_lines(merged, top)
    return out


def reaggregate(out: Path, top: int) -> int:
    """Recompute every table of an existing result from its collapsed files (no new profile)."""
    import json

    res = json.loads(out.read_text())
    for w, r in res["workloads"].items():
        use_sources(r.get("leaf_sources", {}))  # the source text as recorded, not today's
        r.update(analyse(read_collapsed(REPO / r["file"]), top))
    res["config"]["categories"] = [[n, w, rx] for n, w, rx in CATEGORIES]
    res["reaggregated_with"] = "python -m bench.profile --reaggregate"
    md = markdown(res)
    (out.parent / "profiles" / "profile.md").write_text(f"# Profiles (generated by `{res['command']}`)\n\n{md}\n")
    write_report(out, res, md)
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in ("_save", "_load"):
        ap = argparse.ArgumentParser()
        ap.add_argument("--root", type=Path, required=True)
        ap.add_argument("--gib", type=float, required=True)
        ap.add_argument("--log", type=Path, required=True)
        a = ap.parse_args(argv[1:])
        return _driver(argv[0][1:], a.root, a.gib, a.log)

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gib", type=float, default=1.0, help="state size (GiB of fp32)")
    ap.add_argument("--rate", type=int, default=100, help="py-spy samples per second")
    ap.add_argument("--top", type=int, default=15)
    ap.add_argument("--only", default=",".join(WORKLOADS), help="comma-separated subset of save,load,reshard "
                    "(load and reshard need the save's checkpoint: save always runs)")
    ap.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "profile.json")
    ap.add_argument("--profiles-dir", type=Path, default=None,
                    help="where the collapsed stacks go (default: profiles/ beside --out)")
    add_workdir_args(ap, "parent of the temporary work dir")
    ap.add_argument("--reaggregate", action="store_true",
                    help="only recompute the tables of --out from its collapsed files (after changing CATEGORIES)")
    args = ap.parse_args(argv)
    if args.reaggregate:
        return reaggregate(args.out, args.top)
    names = [n for n in args.only.split(",") if n]
    if set(names) - set(WORKLOADS):
        ap.error(f"unknown workloads {sorted(set(names) - set(WORKLOADS))}")
    if "save" not in names:
        names = ["save", *names]
    pyspy_bin()
    with work_dir("ckptd-bench-profile-", args.workdir, args.keep) as work:
        t_start = time.perf_counter()
        ctx = {"root": work / "ckptd-root", "work": work, "gib": args.gib, "rate": args.rate, "top": args.top,
               "out_dir": args.profiles_dir or args.out.parent / "profiles"}
        loads = {}
        workloads = {}
        for w in names:
            loads[w] = os.getloadavg()
            workloads[w] = profile_one(w, ctx)
        from bench.save_load import describe_machine

        result = {
            "command": "python -m bench.profile " + " ".join(argv),
            "config": {"gib": args.gib, "rate": args.rate, "save_world": SAVE_WORLD, "load_world": LOAD_WORLD,
                       "reshard_spec": RESHARD_SPEC,
                       "pyspy": subprocess.run([pyspy_bin(), "--version"], capture_output=True,
                                               text=True).stdout.strip(),
                       "categories": [[n, w, rx] for n, w, rx in CATEGORIES]},
            "git": git_state(),
            "machine": describe_machine(work), "loadavg_at_start": loads,
            "workloads": workloads, "wall_s": time.perf_counter() - t_start, "loadavg_at_end": os.getloadavg(),
        }
        md = markdown(result)
        (ctx["out_dir"] / "profile.md").write_text(
            f"# Profiles (generated by `{result['command']}`)\n\n" + md + "\n")
        write_report(args.out, result, md)
        return 0


if __name__ == "__main__":
    sys.exit(main())
