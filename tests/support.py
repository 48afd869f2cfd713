"""Test support: a real ``ckptd serve`` process on loopback, and real gloo ranks."""

from __future__ import annotations

import atexit
import multiprocessing
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import shutil
import traceback
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import httpx
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

if TYPE_CHECKING:
    from ckptd_schemas import Manifest

__all__ = ["BENCH_TIMEOUT_S", "BLOCK", "TIME_SCALE", "ServerProcess", "as_user", "assert_bits_equal", "assert_quoted",
           "banded_manifest", "blank_like", "example_block", "free_port", "make_state", "plant_file", "read_only_view", "REPO",
           "run_bench", "run_example", "run_ranks", "scaled"]

#: One setting for every deadline of the tests: ``CKPTD_TEST_TIME_SCALE=2`` doubles them on a machine
#: twice as slow (server start, rank groups, benchmark runs, and the tests that pass theirs through
#: :func:`scaled`). Deadlines are guards against hangs, never assertions about speed.
TIME_SCALE = float(os.environ.get("CKPTD_TEST_TIME_SCALE") or 1.0)


def scaled(seconds: float) -> float:
    """``seconds`` times :data:`TIME_SCALE`."""
    return seconds * TIME_SCALE


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


REPO = Path(__file__).resolve().parents[1]

#: How long a benchmark smoke run may take before it counts as hung. A guard, not a timing: the 0.01 GiB
#: reshard benchmark takes 44 s alone on a 2-core VM and went past 110 s beside another xdist worker.
BENCH_TIMEOUT_S = scaled(600)


def run_bench(module: str, *args: str) -> subprocess.CompletedProcess:
    """Run ``python -m <module> <args>`` from the repository root; fail with its output if it exits non-zero."""
    proc = subprocess.run([sys.executable, "-m", module, *args], cwd=REPO, capture_output=True, text=True,
                          timeout=BENCH_TIMEOUT_S)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


_LIVE: set[subprocess.Popen] = set()  # servers started and not yet stopped, killed at exit
# Run a command that is SIGKILLed when the process that started it dies, however it dies (Linux
# PR_SET_PDEATHSIG, kept across exec): an interrupted or killed test run leaves no server behind.
_DIE_WITH_PARENT = ("import ctypes, os, signal, sys; ctypes.CDLL(None).prctl(1, signal.SIGKILL); "
                    "os.getppid() == int(sys.argv[1]) or sys.exit(1); os.execv(sys.argv[2], sys.argv[2:])")


def as_user(uid: int | None, cmd: list[str]) -> list[str]:
    """``cmd`` run as ``uid`` (its gid the same, no other groups) through setpriv(1); as is for None.
    The change of user clears a parent-death signal (:func:`guarded`): such a process is stopped at exit."""
    if uid is None:
        return cmd
    setpriv = shutil.which("setpriv")
    assert setpriv, "running a command as another user needs setpriv(1)"
    return [setpriv, f"--reuid={uid}", f"--regid={uid}", "--clear-groups", *cmd]


def guarded(cmd: list[str]) -> list[str]:
    """``cmd`` wrapped so that it dies with this process. The signal follows the thread that starts
    it, so only a command started from the main thread is wrapped (the rest are stopped at exit)."""
    if threading.current_thread() is not threading.main_thread() or not sys.platform.startswith("linux"):
        return cmd
    return [sys.executable, "-c", _DIE_WITH_PARENT, str(os.getpid()), *cmd]


@atexit.register
def _kill_live() -> None:
    for proc in list(_LIVE):
        if proc.poll() is None:
            proc.kill()


def stop_process(proc: subprocess.Popen | None) -> None:
    """SIGTERM, then SIGKILL after 10 s; nothing if it already exited."""
    _LIVE.discard(proc)
    if proc is not None and proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


class ServerProcess:
    """``ckptd serve`` in its own process, killable and restartable on the same root and port."""

    def __init__(self, root: str | Path, port: int | None = None, env: dict[str, str] | None = None,
                 log: Path | None = None, args: list[str] | None = None, user: int | None = None) -> None:
        self.root = str(root)
        self.user = user  # run as this uid (and gid, no other groups): needs root; None: as this process
        self.port = port or free_port()
        self.env = dict(env or {})
        self.args = list(args or [])  # more `ckptd serve` flags (later ones win: --log-level debug)
        self.log = Path(log) if log else Path(self.root).with_name(f"server-{self.port}.log")
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, env: dict[str, str] | None = None, wait: bool = True) -> "ServerProcess":
        """Start the server; with ``CKPTD_FAULTS`` set (in ``env`` or the server's own environment) it is
        tests/fault_server.py, the service with faults wrapped around its storage, else ``ckptd serve``."""
        full_env = {**os.environ, **self.env, **(env or {}), "PYTHONUNBUFFERED": "1"}
        self.log.parent.mkdir(parents=True, exist_ok=True)
        self._logf = open(self.log, "ab")
        if full_env.get("CKPTD_FAULTS"):
            assert not self.args, "the fault server takes its settings from the environment, not flags"
            # The repository first on the path: tests/ckptd (no __init__) must not stand in for the package.
            full_env.update(CKPTD_ROOT=os.path.abspath(self.root), CKPTD_PORT=str(self.port), CKPTD_LOG_LEVEL="warning",
                            PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), full_env.get("PYTHONPATH")])))
            cmd = [sys.executable, str(REPO / "tests" / "fault_server.py")]
        else:
            cmd = [sys.executable, "-m", "ckptd.cli.main", "serve", "--root", self.root, "--port", str(self.port),
                   "--log-level", "warning", *self.args]
        self.proc = subprocess.Popen(guarded(as_user(self.user, cmd)), env=full_env, stdout=self._logf,
                                     stderr=subprocess.STDOUT)
        _LIVE.add(self.proc)
        if wait:
            self.wait_ready()
        return self

    def wait_ready(self, timeout: float = 30.0) -> None:
        timeout = scaled(timeout)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(f"ckptd serve exited with {self.proc.returncode}:\n{self.log.read_text()[-3000:]}")
            try:
                if httpx.get(f"{self.url}/healthz", timeout=1.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.05)
        raise TimeoutError(f"ckptd serve on port {self.port} not ready:\n{self.log.read_text()[-3000:]}")

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)
        self.proc = None

    def wait_exit(self, timeout: float = 60.0) -> int:
        assert self.proc is not None
        rc = self.proc.wait(timeout)
        self.proc = None
        return rc

    def stop(self) -> None:
        stop_process(self.proc)
        self.proc = None

    def restart(self, env: dict[str, str] | None = None) -> "ServerProcess":
        self.kill()
        return self.start(env=env)


def verified(url: str, *refs: str, token: str | None = None) -> list[dict]:
    """Wait until each ``RUN/NAME`` has its verification recorded: the service's re-read after a commit
    that confirmed bytes checked on arrival (a commit that read every byte records its own at once).
    Tests that look at the root or at records after a save wait here, so the re-read's record does
    not land in the middle of what they look at. The records, in order."""
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    out = []
    for ref in refs:
        deadline = time.monotonic() + scaled(60)
        while True:
            r = httpx.get(f"{url}/v1/checkpoints/{ref}/verification", headers=headers, timeout=10)
            if r.status_code == 200:
                out.append(r.json())
                break
            assert time.monotonic() < deadline, f"{ref}: no verification recorded: {r.text}"
            time.sleep(0.05)
    return out


def server_errors(*servers: ServerProcess) -> list[str]:
    """Lines of the servers' logs that tell of a 5xx or an unhandled exception."""
    bad = []
    for s in servers:
        text = s.log.read_text(errors="replace") if s.log.exists() else ""
        bad += [f"{s.log.name}: {line}" for line in text.splitlines()
                if "unhandled error" in line or "Traceback" in line or " 500 " in line or "ERROR" in line]
    return bad


def _rank_main(rank: int, world: int, port: int, fn: Callable, args: tuple, out_dir: str,
               env: dict[str, str]) -> None:
    os.environ.clear()  # the test's environment at the call, as a spawned process would have it
    os.environ.update(env)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        result = fn(rank, world, *args)
        torch.save({"ok": True, "result": result}, Path(out_dir) / f"rank{rank}.pt")
        # Every rank done before any tears gloo down: a peer closing its sockets while another
        # rank still has work in flight can abort that rank ("terminate called ..."). Bounded, so a
        # test that kills a rank on purpose is not held up: the record is already saved.
        try:
            dist.monitored_barrier(timeout=timedelta(seconds=scaled(30)))
        except RuntimeError:
            pass
    except BaseException as e:  # noqa: BLE001 - reported to the parent test
        torch.save({"ok": False, "error": f"{type(e).__name__}: {e}", "tb": traceback.format_exc(),
                    "type": type(e).__name__}, Path(out_dir) / f"rank{rank}.pt")
        raise
    finally:
        dist.destroy_process_group()


#: What the fork server that ranks are started from imports once (multiprocessing's forkserver): a
#: spawned rank imported torch and DCP again, seconds a rank on 2 cores. Only these: a module that reads
#: the environment when imported is imported in the rank, after the test's environment is put in place.
RANK_PRELOAD = ["torch", "torch.distributed", "torch.distributed.checkpoint"]


def run_ranks(fn: Callable, world: int, *args: Any, tmp: Path, check: bool = True,
              timeout: float = 240.0, preload: list[str] = RANK_PRELOAD, pids: list[int] | None = None) -> list[dict]:
    """Run ``fn(rank, world, *args)`` in ``world`` gloo ranks; return each rank's record. Each rank is a
    fresh process forked from the fork server (``preload`` already imported, read when the server starts:
    the first call), with this process's working directory, ``sys.path`` and environment at the call
    (the fork server keeps the one it started with). ``pids`` gets the ranks' process ids at start."""
    timeout = scaled(timeout)
    out_dir = Path(tmp) / f"ranks-{time.monotonic_ns()}"
    out_dir.mkdir(parents=True)
    multiprocessing.set_forkserver_preload(preload)
    ctx = mp.start_processes(_rank_main, args=(world, free_port(), fn, args, str(out_dir), dict(os.environ)),
                             nprocs=world, join=False, start_method="forkserver")
    if pids is not None:
        pids.extend(p.pid for p in ctx.processes)
    deadline = time.monotonic() + timeout
    try:
        while not ctx.join(timeout=max(deadline - time.monotonic(), 0.1)):
            if time.monotonic() > deadline:
                raise TimeoutError(f"{world} ranks of {fn.__name__} did not finish in {timeout}s")
    except mp.ProcessRaisedException:
        if check:
            records = [_record(out_dir, r) for r in range(world)]
            errs = [rec.get("tb") or rec.get("error") for rec in records if not rec.get("ok")]
            raise AssertionError("rank failed:\n" + "\n".join(str(e) for e in errs)) from None
    except mp.ProcessExitedException:
        if check:
            raise
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
    return [_record(out_dir, r) for r in range(world)]


def _record(out_dir: Path, rank: int) -> dict:
    path = out_dir / f"rank{rank}.pt"
    return torch.load(path, weights_only=False) if path.exists() else {"ok": False, "error": "no result"}


# -- state dicts for protocol tests -----------------------------------------------------------------

def make_state(seed: int, mib: float = 0.25) -> dict:
    """A small but varied state dict: float32/bfloat16/int64 tensors, a JSON and a pickled object."""
    g = torch.Generator().manual_seed(seed)
    rows = max(1, int(mib * (1 << 20) / (4 * 1024)))
    return {
        "model": {
            "w": torch.randn(rows, 1024, generator=g),
            "b": torch.randn(37, generator=g).to(torch.bfloat16),
            "count": torch.randint(-(1 << 40), 1 << 40, (5, 3), generator=g),
        },
        "extra": {"epoch": seed, "rng": (seed, "tuple-pickled", 2.5)},
    }


def blank_like(sd: dict) -> dict:
    """Same keys, shapes and dtypes; every tensor filled with a value the checkpoint does not hold."""
    out: dict = {}
    for k, v in sd.items():
        if isinstance(v, dict):
            out[k] = blank_like(v)
        elif isinstance(v, torch.Tensor):
            out[k] = torch.full_like(v, 7)
        else:
            out[k] = None
    return out


def assert_bits_equal(got: dict, want: dict, where: str = "") -> None:
    assert set(got) == set(want), f"{where}: keys {sorted(got)} != {sorted(want)}"
    for k, w in want.items():
        g, name = got[k], f"{where}.{k}" if where else str(k)
        if isinstance(w, dict):
            assert_bits_equal(g, w, name)
        elif isinstance(w, torch.Tensor):
            assert g.dtype == w.dtype and g.shape == w.shape, f"{name}: {g.dtype}{list(g.shape)}"
            assert torch.equal(g.contiguous().view(-1).view(torch.uint8), w.contiguous().view(-1).view(torch.uint8)), \
                f"{name} differs bitwise"
        else:
            assert g == w and type(g) is type(w), f"{name}: {g!r} != {w!r}"


def example_block(path: Path, begin: str = "# ckptd: begin\n", end: str = "# ckptd: end") -> str:
    """The lines of an example between its markers: what the README and docs quote."""
    return path.read_text().split(begin, 1)[1].split(end, 1)[0]


def run_example(example: Path, *args: str, url: str, ranks: int = 1, cwd: Path | None = None,
                expect: str = "") -> subprocess.CompletedProcess:
    """Run an example as a user would (``torchrun`` for several ranks) against the service at ``url``;
    fail the test with its output unless it exits 0 and prints ``expect``."""
    env = {**os.environ, "CKPTD_URL": url, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, str(example), *args] if ranks == 1 else \
        [str(Path(sys.executable).with_name("torchrun")), "--nproc-per-node", str(ranks),
         "--master-port", str(free_port()), str(example), *args]
    out = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=scaled(240))
    assert out.returncode == 0 and expect in out.stdout, out.stdout[-2000:] + out.stderr[-4000:]
    return out


def assert_quoted(example: Path, docs: tuple[str, ...] = ("docs/integrations.md", "README.md")) -> None:
    """The example's marked lines (at most a dozen) appear, dedented, in each of ``docs``: the text
    users copy is the text the example tests run."""
    import textwrap

    block = textwrap.dedent(example_block(example)).strip()
    assert 8 <= len(block.splitlines()) <= 12, f"{example.name}: {len(block.splitlines())} marked lines"
    for doc in docs:
        assert block in (REPO / doc).read_text(), f"{doc} quotes another block than {example.name}"


def read_only_view(src: Path, at: Path) -> Callable[[], None]:
    """Mount ``src`` read-only at ``at`` (a bind mount remounted ``ro``: writes there fail with EROFS, even
    as root); return the unmount. Skips the test where that cannot be done (not root, no mount(8))."""
    import pytest

    if os.geteuid() != 0 or not shutil.which("mount"):
        pytest.skip("a read-only bind mount needs root and mount(8)")
    at.mkdir(parents=True, exist_ok=True)
    for cmd in (["mount", "--bind", str(src), str(at)], ["mount", "-o", "remount,bind,ro", str(at)]):
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
        if r.returncode != 0:
            subprocess.run(["umount", "-l", str(at)], capture_output=True, timeout=30)
            pytest.skip(f"cannot make a read-only bind mount here ({' '.join(cmd)}): {r.stderr.strip()}")

    def unmount() -> None:
        subprocess.run(["umount", "-l", str(at)], capture_output=True, timeout=30)

    return unmount


def small_tmpfs(at: Path, size: str) -> Callable[[], None]:
    """Mount a real tmpfs of ``size`` (``"1m"``) at ``at``, a disk that fills for real; return the unmount.
    Skips the test where that cannot be done (not root, no mount(8))."""
    import pytest

    if os.geteuid() != 0 or not shutil.which("mount"):
        pytest.skip("mounting a small tmpfs needs root and mount(8)")
    at.mkdir(parents=True, exist_ok=True)
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0755", "ckptd-test", str(at)],
                       capture_output=True, text=True, timeout=30)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.strip()}")
    return lambda: subprocess.run(["umount", "-l", str(at)], capture_output=True, timeout=30)


def plant_file(root: Path, run: str, name: str, file: str, stored: bytes,
               edit: Callable[[dict], None] = lambda manifest: None, *, load_tree: bool = False) -> None:
    """Replace data file ``file`` of the committed ``run/name`` with ``stored`` on disk and make its
    manifest and marker agree (the file's digests, ``edit(manifest)`` for its chunk rows, the manifest's
    name and digest; with ``load_tree``, the marker's load-tree root too), as a writer with access to
    the root could: what the checks that judge stored bytes, not records, must still refuse."""
    import json

    import xxhash

    from ckptd_schemas import Manifest
    from ckptd_schemas.filedigest import StreamDigest
    from ckptd_schemas.loadtree import LoadTree

    ckpt = root / "runs" / run / name
    marker = json.loads((ckpt / "COMMITTED").read_text())
    sdir = ckpt / "sessions" / marker["session"]
    manifest = json.loads((sdir / marker["manifest"]).read_text())
    (sdir / "files" / file).write_bytes(stored)
    entry = manifest["files"][file]
    digest = StreamDigest(entry["block_size"])
    digest.update(memoryview(stored))
    whole, blocks = digest.finish()
    entry.update(size=len(stored), xxh3=whole, blocks=list(blocks))
    edit(manifest)
    raw = json.dumps(manifest, separators=(",", ":")).encode()
    mdigest = xxhash.xxh3_64_hexdigest(raw)
    (sdir / f"manifest-{mdigest}.json").write_bytes(raw)
    marker.update(manifest=f"manifest-{mdigest}.json", manifest_xxh3=mdigest)
    if load_tree:
        marker["load_tree"] = LoadTree(Manifest.model_validate_json(raw)).root
    (ckpt / "COMMITTED").write_text(json.dumps(marker))


#: The digest block size of :func:`banded_manifest`'s files.
BLOCK = 4096


def banded_manifest(rows: int, cols: int, cuts: list[int], flat: bool, dtype: torch.dtype, scale: float = 1.0
                    ) -> tuple[Manifest, dict, torch.Tensor]:
    """A [rows, cols] tensor (``arange * scale``) saved as row bands (or the same bands as flat ranges), one
    file per band, with 100 junk bytes before each band so that fetches have gaps to hash and skip."""
    from datetime import datetime, timezone

    from ckptd_schemas import BoxChunk, FileEntry, FlatChunk, Location, Manifest, TensorEntry, Topology
    from ckptd_schemas.filedigest import StreamDigest, xxh3_hex

    full = (torch.arange(rows * cols, dtype=torch.float32).reshape(rows, cols) * scale).to(dtype)
    edges = [0, *cuts, rows]
    chunks, files, data = [], {}, {}
    for r, (lo, hi) in enumerate(zip(edges, edges[1:])):
        name = f"r{r:06d}-0000.bin"
        band = full[lo:hi].contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
        blob = bytes(range(100)) + band
        loc = Location(file=name, offset=100, length=len(band), raw_length=len(band), xxh3=xxh3_hex(band))
        if flat:
            chunks.append(FlatChunk(rank=r, start=lo * cols, length=(hi - lo) * cols, location=loc))
        else:
            chunks.append(BoxChunk(rank=r, offsets=[lo, 0], sizes=[hi - lo, cols], location=loc))
        d = StreamDigest(BLOCK)
        d.update(blob)
        whole, blocks = d.finish()
        files[name] = FileEntry(size=len(blob), xxh3=whole, block_size=BLOCK, blocks=blocks)
        data[name] = blob
    t = TensorEntry(name="model.w", shape=[rows, cols], dtype=str(dtype).removeprefix("torch."), group="model",
                    chunks=chunks)
    m = Manifest(run="r", name="1", session="s" * 8, created_at=datetime.now(timezone.utc),
                 topology=Topology(world_size=len(chunks)), tensors=[t], files=files)
    return m, data, full


def store_index(storage, run: str, name: str, sid: str, ix) -> None:
    """Rank index ``ix`` stored as a replica stores an index it checked (``ckptd.store.rank_indexes``), with
    its files' records as the store holds them (none for a file without one), and no commit asked for: a
    replica that died right after."""
    from ckptd.store.intake import recorded_file
    from ckptd.store.rank_indexes import BatchWriter
    from ckptd.store.records import arrival_of
    from ckptd.store.session_reads import read_meta

    meta = read_meta(storage, run, name, sid)
    entries = {f: recorded_file(storage, run, name, sid, f) for f in ix.files}
    records = {f: (e, arrival_of(storage, run, name, sid, f)) for f, e in entries.items() if e is not None}
    BatchWriter(storage).store(run, name, sid, meta.created_at.isoformat(), ix.rank, ix.model_dump_json().encode(),
                               records)
