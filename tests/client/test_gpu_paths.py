"""The GPU paths, run on the CPU with the same code (CI has no GPU):

* load: ``DeviceStager`` (client/_scatter.py) moves verified bytes to a device through a small ring of
  reused host buffers; on CUDA they are pinned and copied on a side stream with an event per buffer.
  Here the ring runs with device "cpu": buffer reuse, runs split across buffers, fp32/bf16/int64,
  non-contiguous destinations, digest failures, and whole loads through a real service with CPU
  destinations routed through it (``_load.STAGE_CPU``), without any ``torch.cuda`` call;
* save: ``SnapshotPool(background=True)`` (client/_pool.py) lays the slab out in segments and
  allocates them in a background thread while no save holds it (after the first save's upload);
  forced here with ``pin=False`` and an injected allocator: the first claim does not wait, the
  memory bound holds, later claims reuse the slab.
"""

from __future__ import annotations

import gc
import threading
import time
import weakref

import pytest
import torch

import ckptd_client._load as load_mod
from ckptd_client import CheckpointClient, FlatShard
from ckptd_client._scatter import DeviceStager, PieceFill, direct_targets, staged_runs
from ckptd_client._pool import SnapshotPool, aligned, placed_bytes, plan_segments
from ckptd_client._save import build_snapshot
from ckptd_schemas import (
    ChecksumMismatch, Manifest, ReadRequest, plan_reads,
)
from ckptd_schemas.format.assemble import Destination, copy_into
from support import assert_bits_equal, banded_manifest, blank_like, make_state, scaled

KIB = 1 << 10
BLOCK = 4096
CPU = torch.device("cpu")


@pytest.fixture
def no_cuda(monkeypatch):
    """Any torch.cuda stream, event or synchronisation call fails the test: the CPU path must not touch CUDA."""
    def boom(*a, **kw):
        raise AssertionError("torch.cuda called on the CPU path")

    for name in ("Stream", "Event", "current_stream", "stream", "synchronize", "set_device"):
        monkeypatch.setattr(torch.cuda, name, boom)


# -- the ring on its own -------------------------------------------------------------------------------

def _manifest(rows: int, cols: int, cuts: list[int], flat: bool, dtype: torch.dtype) -> tuple[Manifest, dict, torch.Tensor]:
    """``test_direct_load``'s banded tensor, with values that are not whole numbers (bf16 rounds them)."""
    return banded_manifest(rows, cols, cuts, flat, dtype, scale=1.37)


def _cut(blob: bytes, step: int) -> list[bytes]:
    return [blob[i:i + step] for i in range(0, len(blob), step)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64])
@pytest.mark.parametrize("flat", [False, True])
@pytest.mark.parametrize("buffer_bytes", [1000, 4096, 1 << 20])
def test_staged_runs_through_the_ring_equal_the_buffered_copy(dtype, flat, buffer_bytes, no_cuda):
    """Row bands through a 2-buffer ring, with buffers smaller than a run (a run split across several
    windows, a window spanning runs and the gaps between them), HTTP pieces of odd sizes."""
    rows, cols = 48, 96
    m, files, full = _manifest(rows, cols, [10, 29], flat, dtype)
    lo, hi = 5, 40
    plan = plan_reads(m, [ReadRequest(name="model.w", offsets=[lo, 0], sizes=[hi - lo, cols])])
    staged = torch.zeros(hi - lo, cols, dtype=dtype)
    dest = [Destination(staged, [rows, cols], box_offsets=[lo, 0])]
    stager = DeviceStager("cpu", buffers=2, buffer_bytes=buffer_bytes)
    windows = 0
    for i, f in enumerate(plan.fetches):
        copies = [c for c in plan.copies if c.fetch == i]
        runs = staged_runs(copies, dest, CPU)
        assert runs is not None and direct_targets(copies, dest) is not None  # row bands: always direct
        blob = files[f.file][f.start:f.end]
        body = PieceFill(_cut(blob, 777), f)
        assert stager.stream(f, body, runs) == len(blob)
        body.drain()
        windows += -(-len(blob) // buffer_bytes)
    stager.finish()
    assert torch.equal(staged, full[lo:hi])
    assert stager.stats.windows == windows and stager.stats.buffers == min(2, windows)  # reused, never more


def test_a_run_larger_than_every_buffer_lands_whole_and_buffers_are_reused(no_cuda):
    m, files, full = _manifest(64, 256, [], flat=False, dtype=torch.float32)  # one 64 KiB run
    plan = plan_reads(m, [ReadRequest(name="model.w")])
    out = torch.zeros(64, 256)
    stager = DeviceStager("cpu", buffers=3, buffer_bytes=5000)
    (f,) = plan.fetches
    runs = staged_runs(plan.copies, [Destination(out, [64, 256], box_offsets=[0, 0])], CPU)
    assert len(runs) == 1 and runs[0][1] - runs[0][0] == 64 * KIB
    stager.stream(f, PieceFill([files[f.file][f.start:f.end]], f), runs)
    assert torch.equal(out, full)
    assert stager.stats.buffers == 3 and stager.stats.windows == -(-(f.end - f.start) // 5000)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_copies_into_non_contiguous_destinations_go_through_the_ring(dtype, no_cuda):
    """A column slice, into a column slice of a larger tensor (not contiguous on either side), and a
    cast: not runs, so each copy's bytes go through the ring into one buffer, then a strided copy."""
    m, files, full = _manifest(16, 40, [7], flat=False, dtype=dtype)
    plan = plan_reads(m, [ReadRequest(name="model.w", offsets=[0, 3], sizes=[16, 30])])
    host = torch.zeros(16, 50, dtype=dtype)
    staged = torch.zeros(16, 50, dtype=dtype)
    cast = torch.zeros(16, 30, dtype=torch.float64)
    dest_h, dest_s = Destination(host[:, 10:40], [16, 40], box_offsets=[0, 3]), \
        Destination(staged[:, 10:40], [16, 40], box_offsets=[0, 3])
    dest_c = Destination(cast, [16, 40], box_offsets=[0, 3])
    assert staged_runs(plan.copies, [dest_s], CPU) is None
    stager = DeviceStager("cpu", buffers=2, buffer_bytes=64)
    for c in plan.copies:
        f = plan.fetches[c.fetch]
        buf = bytearray(files[f.file][f.start:f.end])
        copy_into(buf, c, dest_h)
        stager.copy_into(buf, c, dest_s)
        stager.copy_into(buf, c, dest_c)
    stager.finish()
    assert torch.equal(staged, host) and torch.equal(staged[:, 10:40], full[:, 3:33])
    assert torch.equal(cast, full[:, 3:33].to(torch.float64))
    assert stager.stats.buffers == 2 and stager.stats.windows > 2


def test_every_block_is_checked_before_its_window_is_copied(no_cuda):
    m, files, _ = _manifest(64, 128, [20, 41], flat=False, dtype=torch.float32)
    plan = plan_reads(m, [ReadRequest(name="model.w", offsets=[30, 0], sizes=[20, 128])])
    f = plan.fetches[0]
    runs = staged_runs([c for c in plan.copies if c.fetch == 0],
                       [Destination(torch.zeros(20, 128), [64, 128], box_offsets=[30, 0])], CPU)
    blob = bytearray(files[f.file][f.start:f.end])
    for flip in (0, len(blob) - 1):  # a junk byte the copy skips, then the last byte it places
        bad = bytearray(blob)
        bad[flip] ^= 0xFF
        with pytest.raises(ChecksumMismatch, match=f"file '{f.file}': bytes"):
            DeviceStager("cpu", buffer_bytes=3000).stream(f, PieceFill([bytes(bad)], f), runs)
    with pytest.raises(ChecksumMismatch, match="more than"):  # in the last piece
        DeviceStager("cpu").stream(f, PieceFill([bytes(blob) + b"x"], f), runs)
    extra = PieceFill([bytes(blob), b"", b"x"], f)
    assert DeviceStager("cpu").stream(f, extra, runs) == len(blob)
    with pytest.raises(ChecksumMismatch, match="more than"):  # after it: the caller drains the body
        extra.drain()
    body = PieceFill([bytes(blob)], f)
    DeviceStager("cpu").stream(f, body, runs)
    body.drain()
    short = PieceFill([bytes(blob[:1000])], f)
    assert DeviceStager("cpu", buffer_bytes=600).stream(f, short, runs) == 1000  # the caller raises on it


def test_the_cuda_branch_orders_its_streams_and_events(monkeypatch):
    """The CUDA branch of the ring with fake streams and events (the copies themselves land in CPU
    tensors): the side stream first waits for the caller's stream; every buffer records an event after
    its copies and is refilled only after waiting on it; buffers are pinned, made once; the copies are
    queued on the side stream; ``finish`` makes the caller's stream wait for the side stream."""
    import ckptd_client._scatter as direct_mod

    log: list[tuple] = []
    on_side = threading.local()

    class FakeStream:
        def __init__(self, name: str) -> None:
            self.name = name

        def wait_stream(self, other: FakeStream) -> None:
            log.append(("wait", self.name, other.name))

    current = FakeStream("current")

    class FakeEvent:
        count = 0

        def __init__(self) -> None:
            FakeEvent.count += 1
            self.id = FakeEvent.count

        def record(self, stream: FakeStream) -> None:
            log.append(("record", self.id, stream.name))

        def query(self) -> bool:
            return False  # every reuse must wait

        def synchronize(self) -> None:
            log.append(("sync", self.id))

    class StreamContext:
        def __init__(self, s: FakeStream) -> None:
            self.s = s

        def __enter__(self) -> None:
            assert self.s.name == "side"
            on_side.active = True

        def __exit__(self, *a: object) -> None:
            on_side.active = False

    pinned: list[bool] = []
    monkeypatch.setattr(torch.cuda, "Stream", lambda device: FakeStream("side"))
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: current)
    monkeypatch.setattr(torch.cuda, "stream", StreamContext)
    monkeypatch.setattr(direct_mod, "_host_buffer",
                        lambda n, pin: (pinned.append(pin), torch.empty(n, dtype=torch.uint8))[1])
    m, files, full = _manifest(64, 256, [], flat=False, dtype=torch.float32)  # one 64 KiB run
    plan = plan_reads(m, [ReadRequest(name="model.w")])
    (f,) = plan.fetches
    out = torch.zeros(64, 256)
    runs = staged_runs(plan.copies, [Destination(out, [64, 256], box_offsets=[0, 0])], CPU)
    stager = DeviceStager(torch.device("cuda", 0), buffers=3, buffer_bytes=5000)
    assert stager.cuda and log == [("wait", "side", "current")]
    real_copy = torch.Tensor.copy_
    copies: list[bool] = []

    def copy_(self, src, non_blocking=False):
        copies.append(bool(getattr(on_side, "active", False)) and non_blocking)
        return real_copy(self, src, non_blocking=non_blocking)

    monkeypatch.setattr(torch.Tensor, "copy_", copy_)
    stager.stream(f, PieceFill(_cut(files[f.file][f.start:f.end], 3333), f), runs)
    monkeypatch.setattr(torch.Tensor, "copy_", real_copy)
    stager.finish()
    assert torch.equal(out, full)
    windows = -(-(f.end - f.start) // 5000)
    assert pinned == [True] * 3 and copies and all(copies)  # pinned, made once; copies async on the side stream
    assert log[-1] == ("wait", "current", "side")
    events = [e for e in log[1:-1]]
    assert sum(1 for e in events if e[0] == "record") == windows
    last: dict[int, str] = {}
    for e in events:  # per buffer: record (after its copies), then sync before it is filled again
        assert last.get(e[1], "sync") != e[0], f"{e} out of order for one buffer: {events}"
        last[e[1]] = e[0]
    assert sum(1 for e in events if e[0] == "sync") == windows - 3


# -- whole loads through a real service, CPU destinations through the stager -------------------------------

def _state(seed: int) -> dict:
    sd = make_state(seed, mib=0.5)
    g = torch.Generator().manual_seed(seed)
    sd["model"]["wt"] = torch.randn(40, 24, generator=g).t()  # saved and loaded non-contiguous
    sd["model"]["h"] = torch.randn(300, 33, generator=g).to(torch.bfloat16)
    return sd


@pytest.fixture
def staged_cpu(monkeypatch):
    """CPU destinations through DeviceStager with 16 KiB buffers (runs span several of them); records
    the stagers made and which staged path each fetch took."""
    made: list[DeviceStager] = []
    paths: dict[str, int] = {"file": 0, "http": 0, "stream": 0, "copy": 0}
    real = load_mod.DeviceStager

    def make(*a, **kw):
        made.append(real(*a, **kw))
        return made[-1]

    def counted(name, fn):
        def wrapper(*a, **kw):
            paths[name] += 1
            return fn(*a, **kw)
        return wrapper

    monkeypatch.setattr(load_mod, "STAGE_CPU", True)
    monkeypatch.setattr(load_mod, "BUFFER_BYTES", 16 * KIB)
    monkeypatch.setattr(load_mod, "DeviceStager", make)
    monkeypatch.setattr(load_mod.LocalFiles, "read", counted("file", load_mod.LocalFiles.read))
    monkeypatch.setattr(load_mod.HttpRanges, "read", counted("http", load_mod.HttpRanges.read))
    monkeypatch.setattr(real, "stream", counted("stream", real.stream))
    monkeypatch.setattr(real, "copy_into", counted("copy", real.copy_into))
    return made, paths


@pytest.mark.parametrize("direct_reads", [True, False])
@pytest.mark.parametrize("compression", [None, "zstd"])
def test_a_load_through_the_stager_is_bit_for_bit(server, staged_cpu, no_cuda, direct_reads, compression):
    """Files (``direct_reads``) or HTTP, raw (runs) or compressed (buffered, then the ring); fp32, bf16,
    int64, a transposed tensor; a FlatShard and a row band of another layout (partial reads)."""
    want = _state(3)
    flat = torch.randn(45 * 24, generator=torch.Generator().manual_seed(9))
    with CheckpointClient(server.url, compression=compression, direct_reads=direct_reads, streams=3) as c:
        c.save({**want, "opt": {"flat": FlatShard(flat, (45, 24), 0)}}, "stage/1").wait()
        got = blank_like(want)
        got["opt"] = {"flat": FlatShard(torch.full((600,), 7.0), (45, 24), 100)}
        assert not got["model"]["wt"].is_contiguous()
        report = c.load(got, "stage/1", strict=False)
        assert report.bytes_read > 0 and (report.bytes_read_direct > 0) == direct_reads
        assert torch.equal(got.pop("opt")["flat"].local, flat[100:700])
        assert_bits_equal(got, want)
        made, paths = staged_cpu
        assert made and all(0 < s.stats.buffers <= s.buffers for s in made)
        assert sum(s.stats.windows for s in made) >= 32  # "model.w" alone: 512 KiB in 16 KiB windows
        assert paths["copy"] > 0  # the transposed destination (and compressed frames): buffered, then the ring
        rows = want["model"]["w"].shape[0]
        part = FlatShard(torch.zeros(50 * 1024), (rows, 1024), 31 * 1024)
        before = dict(paths)
        c.load({"model": {"w": part}}, "stage/1", strict=False)
        assert torch.equal(part.local, want["model"]["w"].reshape(-1)[31 * 1024:81 * 1024])
        if compression is None:  # a row band, raw: streamed through the ring from the file or HTTP, no buffer
            assert paths["copy"] == before["copy"] and paths["stream"] > before["stream"]
            assert paths["file" if direct_reads else "http"] > before["file" if direct_reads else "http"]
            assert paths["http" if direct_reads else "file"] == before["http" if direct_reads else "file"]


def test_a_cpu_load_does_not_use_the_stager_by_default(server, monkeypatch):
    made: list = []
    monkeypatch.setattr(load_mod, "DeviceStager", lambda *a, **kw: made.append(1))
    want = make_state(4)
    with CheckpointClient(server.url) as c:
        c.save(want, "plain/1").wait()
        got = blank_like(want)
        c.load(got, "plain/1")
    assert_bits_equal(got, want)
    assert made == []


# -- the save's slab in segments, allocated in the background ------------------------------------------------

class Allocations:
    """An injected allocator: counts calls, tracks the live bytes it handed out and their peak, and
    blocks while ``gate`` is clear (a slow pinning call)."""

    def __init__(self) -> None:
        self.gate = threading.Event()
        self.gate.set()
        self.calls: list[int] = []
        self.live: list[weakref.ref] = []
        self.peak = 0
        self.lock = threading.Lock()

    def live_bytes(self) -> int:
        gc.collect()
        with self.lock:
            return sum(t.numel() for r in self.live if (t := r()) is not None)

    def __call__(self, nbytes: int, pin: bool) -> torch.Tensor:
        assert not pin
        assert self.gate.wait(30)
        live = self.live_bytes()
        t = torch.zeros(nbytes, dtype=torch.uint8)
        with self.lock:
            self.calls.append(nbytes)
            self.live.append(weakref.ref(t))
            self.peak = max(self.peak, live + nbytes)
        return t


def _segment_of(pool: SnapshotPool, t: torch.Tensor) -> int | None:
    ptr = t.untyped_storage().data_ptr()
    return next((i for i, s in enumerate(pool.segments) if s is not None and s.untyped_storage().data_ptr() == ptr),
                None)


def test_plan_segments_packs_first_fit_caps_and_rounds_pinned_sizes():
    sizes = [aligned(n) for n in (3000, 9000, 200, 5000, 5000, 64, 20000, 100)]
    plan = plan_segments(sizes, cap=1 << 30, segment=8192, pin=False)
    # first-fit: small chunks fill earlier segments' tails; a chunk over a segment gets its own; each cut
    # to what it holds, so the slab is exactly what the save copies
    assert plan == [3456, 9024, 5056, 5056, 20032] and sum(plan) == sum(sizes)
    assert placed_bytes(plan, sizes) == sum(sizes)
    pinned = plan_segments(sizes, cap=1 << 30, segment=8192, pin=True)
    assert all(n & (n - 1) == 0 for n in pinned) and placed_bytes(pinned, sizes) == sum(sizes)
    capped = plan_segments(sizes, cap=16 * KIB, segment=8192, pin=False)
    assert sum(capped) <= 16 * KIB and placed_bytes(capped, sizes) > 8 * KIB


def test_the_first_claim_does_not_wait_for_the_background_allocation(no_cuda):
    alloc = Allocations()
    alloc.gate.clear()  # every allocation blocks until the test lets it go
    claimed_at_alloc: list[bool] = []
    pool = SnapshotPool(pin=False, background=True, segment_bytes=8 * KIB, max_bytes=1 << 20,
                        allocator=lambda n, pin: (claimed_at_alloc.append(pool.claimed), alloc(n, pin))[1])
    shapes = [((1000,), torch.float32), ((3000,), torch.bfloat16), ((5000,), torch.float32), ((7,), torch.int64)]
    sizes = [aligned(torch.Size(s).numel() * d.itemsize) for s, d in shapes]
    t0 = time.monotonic()
    claim = pool.claim(sizes=sizes)
    views = [claim.take(s, d) for s, d in shapes]
    assert time.monotonic() - t0 < scaled(5) and claimed_at_alloc == []  # laid out, nothing allocated in the stall
    assert all(_segment_of(pool, v) is None for v in views)
    assert pool.stats.unready_bytes == pool.stats.fallback_bytes == sum(v.numel() * v.element_size() for v in views)
    assert len(pool.segments) == 3 and not pool.ready
    del views  # the upload ends: its fresh copies go, then the slab is allocated
    claim.release()
    deadline = time.monotonic() + scaled(10)
    while not claimed_at_alloc and time.monotonic() < deadline:
        time.sleep(0.01)
    assert claimed_at_alloc == [False]  # the background thread started, and blocks in the allocator
    second = pool.claim(sizes=sizes)  # while it blocks: fresh memory again, no wait
    assert all(_segment_of(pool, second.take(s, d)) is None for s, d in shapes)
    second.release()
    alloc.gate.set()
    assert pool.wait_ready(30) and not any(claimed_at_alloc)
    assert sum(alloc.calls) == pool.capacity == sum(sizes) and len(alloc.calls) == len(pool.segments) == 3
    for _ in range(3):  # later claims: every chunk in the slab, nothing allocated again
        claim = pool.claim(sizes=sizes)
        views = [claim.take(s, d) for s, d in shapes]
        assert all(_segment_of(pool, v) is not None for v in views)
        claim.release()
        del views
    assert len(alloc.calls) == 3 and pool.stats.allocations == 1
    assert pool.stats.pooled_bytes == 3 * sum(torch.Size(s).numel() * d.itemsize for s, d in shapes)
    pool.close()
    assert alloc.live_bytes() == 0


def test_the_memory_bound_holds_while_layouts_change_in_the_background(no_cuda):
    alloc = Allocations()
    cap = 48 * KIB
    pool = SnapshotPool(pin=False, background=True, segment_bytes=8 * KIB, max_bytes=cap, allocator=alloc)
    states = [[aligned(n) for n in ns] for ns in ([4000] * 6, [9000, 9000, 3000, 100] * 3, [500] * 4,
                                                  [30000, 30000], [4000] * 6)]
    for sizes in states * 2:
        claim = pool.claim(sizes=sizes)
        for n in sizes:
            claim.take((n,), torch.uint8)
        claim.release()
        assert pool.capacity <= cap and alloc.live_bytes() <= cap
    assert pool.wait_ready(30)
    assert alloc.peak <= cap and alloc.live_bytes() <= cap
    claim = pool.claim(sizes=states[0])  # same as the last state: the slab is kept
    before = len(alloc.calls)
    assert all(_segment_of(pool, claim.take((n,), torch.uint8)) is not None for n in states[0])
    claim.release()
    assert len(alloc.calls) == before
    pool.close()
    assert alloc.live_bytes() == 0


def test_saves_through_a_real_service_with_a_background_slab(server, no_cuda):
    """The first save returns while the slab's allocation is blocked; once it is ready, later saves
    copy into it with nothing fresh; every checkpoint loads bit for bit."""
    alloc = Allocations()
    alloc.gate.clear()
    want = [make_state(s, mib=0.5) for s in (21, 22, 23)]
    with CheckpointClient(server.url, incremental=False) as c:
        pool = c.snapshot_pool = SnapshotPool(pin=False, background=True, segment_bytes=64 * KIB,
                                              max_bytes=8 << 20, allocator=alloc)
        t0 = time.monotonic()
        c.save(want[0], "bg/1").wait()
        assert alloc.calls == [] and time.monotonic() - t0 < scaled(20)  # saved and uploaded, the allocation still blocked
        assert pool.stats.pooled_bytes == 0 and pool.stats.unready_bytes > 0
        alloc.gate.set()
        assert pool.wait_ready(30)
        fresh = pool.stats.fallback_bytes
        for i, sd in enumerate(want[1:], start=2):
            c.save(sd, f"bg/{i}").wait()
        assert pool.stats.fallback_bytes == fresh and pool.stats.allocations == 1
        assert pool.stats.pooled_bytes == 2 * sum(t.numel() * t.element_size() for t in want[0]["model"].values())
        for i, sd in enumerate(want, start=1):
            got = blank_like(sd)
            c.load(got, f"bg/{i}")
            assert_bits_equal(got, sd)
    assert pool.closed and alloc.live_bytes() == 0


def test_build_snapshot_leaves_the_allocation_until_the_upload_gave_the_slab_back(no_cuda):
    alloc = Allocations()
    pool = SnapshotPool(pin=False, background=True, segment_bytes=64 * KIB, max_bytes=8 << 20, allocator=alloc)
    sd = make_state(5)
    snap = build_snapshot(sd, 0, 1, pool)
    assert pool.claimed and alloc.calls == [] and not pool.ready
    assert [c.data for cs in snap.chunks.values() for c in cs if _segment_of(pool, c.data) is not None] == []
    snap.release()
    assert pool.wait_ready(30) and alloc.calls and pool.stats.unready_bytes == pool.stats.fallback_bytes > 0
    again = build_snapshot(sd, 0, 1, pool)
    assert all(_segment_of(pool, c.data) is not None for cs in again.chunks.values() for c in cs)
    again.release()
    pool.close()
