"""Compression chosen by measurement (``compression="auto"``) and frames small enough for ranged reads."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

from ckptd_client import CheckpointClient, FlatShard
from ckptd_client.codec import CompressionPolicy, Measurement, measure
from ckptd_schemas.format.encoding import FRAME_BYTES, split_frames
from support import run_ranks

MiB = 1 << 20
MB = 1e6


def fixed_speed_clock(seconds_per_call: float):
    """A clock that advances a fixed step per reading: every 1 MiB sample "takes" the same time."""
    t = [0.0]

    def clock() -> float:
        t[0] += seconds_per_call
        return t[0]
    return clock


ZSTD_1 = 2e-3  # 1 MiB in 2 ms: about 0.5 GB/s, zstd level 1 on one core


def policy(store_bw: float) -> CompressionPolicy:
    return CompressionPolicy(store_bw, clock=fixed_speed_clock(ZSTD_1))


def low_entropy_bf16(rows: int, cols: int) -> torch.Tensor:
    """bf16 weights with few distinct values (a quantised-looking tensor): compress well."""
    g = torch.Generator().manual_seed(1)
    return (torch.randint(-16, 16, (rows, cols), generator=g) * 0.01).to(torch.bfloat16)


def random_fp32(rows: int, cols: int) -> torch.Tensor:
    return torch.randn(rows, cols, generator=torch.Generator().manual_seed(2))


def raw(t: torch.Tensor) -> memoryview:
    return memoryview(t.contiguous().reshape(-1).view(torch.uint8).numpy())


def verify(url: str, ref: str) -> None:
    out = subprocess.run([sys.executable, "-m", "ckptd.cli.main", "verify", ref, "--server", url],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.startswith(f"OK {ref}"), out.stdout + out.stderr


# -- the policy, without timing -------------------------------------------------------------------

def test_decision_compares_upload_time_with_compress_plus_smaller_upload():
    m = Measurement(raw=MiB, stored=int(0.7 * MiB), seconds=MiB / (500 * MB))  # 0.5 GB/s, 30% saved
    big = 1 << 30
    assert CompressionPolicy(50 * MB).decide(big, m)          # slow store (remote S3): compress
    assert not CompressionPolicy(1300 * MB).decide(big, m)    # local disk: faster than zstd itself
    # 1/500 + 0.7/b < 0.95/b  <=>  b < 125 MB/s: 120 MB/s compresses, 130 does not
    assert CompressionPolicy(120 * MB).decide(big, m) and not CompressionPolicy(130 * MB).decide(big, m)
    hardly = Measurement(raw=MiB, stored=int(0.97 * MiB), seconds=1e-6)  # fast but shrinks only 3%
    assert not CompressionPolicy(1 * MB).decide(big, hardly)
    assert not CompressionPolicy(1 * MB).decide(0, m)


def test_measurement_uses_the_injected_clock_and_a_middle_sample():
    data = bytes(4 * MiB)
    m = measure(data, "zstd", 1, clock=fixed_speed_clock(0.25))
    assert m.raw == MiB and m.seconds == 0.25 and m.ratio < 0.01
    assert policy(100 * MB).should_compress(raw(low_entropy_bf16(1024, 1024)))
    assert not policy(100 * MB).should_compress(raw(random_fp32(512, 1024)))    # 8% is not worth 2 ms/MiB
    assert not policy(1300 * MB).should_compress(raw(low_entropy_bf16(1024, 1024)))
    assert not policy(1 * MB).should_compress(torch.randint(0, 256, (MiB,), dtype=torch.uint8).numpy().data)


def test_store_throughput_is_learned_from_uploads():
    p = CompressionPolicy(1000 * MB)
    p.observe(1 * MiB, 1.0)            # too small to say anything about throughput
    assert p.store_bw == 1000 * MB and p.observed == 0
    p.observe(100 * MB, 1.0)           # the first observation replaces the default
    assert p.store_bw == 100 * MB
    p.observe(100 * MB, 0.5)           # then a moving average
    assert p.store_bw == 150 * MB and p.observed == 2


def test_frames_tile_the_chunk_along_rows_or_flat_ranges():
    pieces = list(split_frames(4, ([10, 0], [2500, 1024]), None, limit=FRAME_BYTES))
    assert [p[2][1][0] for p in pieces] == [1024, 1024, 452]
    assert [p[2][0] for p in pieces] == [[10, 0], [1034, 0], [2058, 0]]
    assert [(p[0], p[1]) for p in pieces] == [(0, 1024 * 1024), (1024 * 1024, 1024 * 1024), (2048 * 1024, 452 * 1024)]
    # a row larger than the limit is cut within the row: no frame is over the limit every decoder enforces
    assert [p[2] for p in split_frames(4, ([0, 0], [3, 2 * MiB]), None, limit=FRAME_BYTES)] == [
        ([0, 0], [1, MiB]), ([0, MiB], [1, MiB]), ([1, 0], [1, MiB]), ([1, MiB], [1, MiB]), ([2, 0], [1, MiB]),
        ([2, MiB], [1, MiB])]
    assert len(list(split_frames(4, ([0], [MiB]), None, limit=FRAME_BYTES))) == 1  # exactly the limit
    flat = list(split_frames(2, None, (100, 5 * MiB), limit=FRAME_BYTES))
    assert [p[3] for p in flat] == [(100, 2 * MiB), (100 + 2 * MiB, 2 * MiB), (100 + 4 * MiB, MiB)]
    with pytest.raises(ValueError, match="compression must be"):
        CheckpointClient("http://127.0.0.1:1", compression="lz4")


# -- against the real service -----------------------------------------------------------------------

@pytest.mark.parametrize("mode", ["zstd", "planes", "auto"])
def test_big_tensor_is_stored_as_several_frames_and_verifies(server, mode):
    src = low_entropy_bf16(5000, 1024)  # 10 MiB of bf16
    small = torch.arange(7, dtype=torch.float32)
    with CheckpointClient(server.url, compression=policy(50 * MB) if mode == "auto" else mode) as c:
        c.save({"w": src, "s": small}, f"frames/{mode}").wait()
        w = c.manifest(f"frames/{mode}").tensor("w")
        codec = "zstd" if mode == "zstd" else "blosc2"  # byte planes for 2-byte elements unless zstd is asked for
        assert len(w.chunks) == 3 and {ch.location.codec for ch in w.chunks} == {codec}
        assert all(ch.location.raw_length <= FRAME_BYTES for ch in w.chunks)
        assert sum(ch.location.length for ch in w.chunks) < 0.5 * src.numel() * 2
        out = {"w": torch.zeros_like(src), "s": torch.zeros(7)}
        c.load(out, f"frames/{mode}")
        assert torch.equal(out["w"].view(torch.int16), src.view(torch.int16)) and torch.equal(out["s"], small)
    verify(server.url, f"frames/{mode}")


def test_auto_compresses_bf16_on_a_slow_store_and_not_random_fp32_on_a_fast_one(server):
    bf16, fp32 = low_entropy_bf16(2048, 1024), random_fp32(1024, 1024)
    with CheckpointClient(server.url, compression=policy(100 * MB)) as slow:
        slow.save({"bf16": bf16, "fp32": fp32}, "auto/slow").wait()
        m = slow.manifest("auto/slow")
    assert {c.location.codec for c in m.tensor("bf16").chunks} == {"blosc2"}
    assert {c.location.codec for c in m.tensor("fp32").chunks} == {"raw"}  # random mantissas: not worth it
    with CheckpointClient(server.url, compression=policy(1300 * MB)) as fast:
        fast.save({"bf16": bf16, "fp32": fp32}, "auto/fast").wait()
        m = fast.manifest("auto/fast")
    assert {c.location.codec for c in m.tensor("bf16").chunks} == {"raw"}
    assert [c.location.codec for c in m.tensor("fp32").chunks] == ["raw"]  # raw chunks are not split
    with CheckpointClient(server.url, compression="auto") as real:  # real clock, default store estimate
        h = real.save({"fp32": random_fp32(2048, 1024)}, "auto/real")
        h.wait()
        assert [c.location.codec for c in real.manifest("auto/real").tensor("fp32").chunks] == ["raw"]
        assert real._codec.observed == 1  # the 8 MiB upload fed the throughput estimate
    out = {"bf16": torch.zeros_like(bf16), "fp32": torch.zeros_like(fp32)}
    with CheckpointClient(server.url) as c:
        c.load(out, "auto/slow")
    assert torch.equal(out["bf16"].view(torch.int16), bf16.view(torch.int16)) and torch.equal(out["fp32"], fp32)
    verify(server.url, "auto/slow")


def test_ranged_flat_read_decodes_only_the_frames_it_overlaps(server):
    full = low_entropy_bf16(4096, 2048).reshape(-1)  # 16 MiB: flat frames of 4 MiB
    with CheckpointClient(server.url, compression="zstd") as c:
        c.save({"w": FlatShard(full.clone(), (4096, 2048), 0)}, "flat/1").wait()
        m = c.manifest("flat/1")
        chunks = m.tensor("w").chunks
        assert [(ch.kind, ch.start, ch.length) for ch in chunks] == [("flat", i * 2 * MiB, 2 * MiB) for i in range(4)]
        stored = sum(ch.location.length for ch in chunks)
        part = torch.zeros(full.numel() // 4, dtype=torch.bfloat16)  # "rank 1 of 4", inside one frame
        report = c.load({"w": FlatShard(part, (4096, 2048), part.numel())}, "flat/1")
    assert torch.equal(part.view(torch.int16), full[part.numel():2 * part.numel()].view(torch.int16))
    block = m.files[chunks[1].location.file].block_size
    assert report.bytes_read <= chunks[1].location.length + 2 * block < stored  # one frame, block-aligned
    verify(server.url, "flat/1")


def _global() -> torch.Tensor:
    return random_fp32(3001, 1024)  # 12 MiB, odd rows: uneven over 2 and 3 ranks; frames of ~4 MB stored


def save_job(rank: int, world: int, url: str) -> int:
    mesh = init_device_mesh("cpu", (world,))
    with CheckpointClient(url, compression="zstd") as c:
        c.save({"w": distribute_tensor(_global(), mesh, [Shard(0)])}, "dt/2").wait()
        return len(c.manifest("dt/2").tensor("w").chunks)


def load_job(rank: int, world: int, url: str) -> dict:
    mesh = init_device_mesh("cpu", (world,))
    sd = {"w": distribute_tensor(torch.zeros(3001, 1024), mesh, [Shard(0)])}
    with CheckpointClient(url) as c:
        report = c.load(sd, "dt/2")
    return {"w": sd["w"].full_tensor(), "bytes_read": report.bytes_read}


@pytest.mark.slow
def test_frames_load_at_another_world_size(server, tmp_path):
    assert run_ranks(save_job, 2, server.url, tmp=tmp_path)[0]["result"] == 4  # 6 MiB per rank: 2 frames each
    got = run_ranks(load_job, 3, server.url, tmp=tmp_path)
    assert all(torch.equal(r["result"]["w"], _global()) for r in got)
    with CheckpointClient(server.url) as c:
        stored = sum(ch.location.length for ch in c.manifest("dt/2").tensor("w").chunks)
    assert all(r["result"]["bytes_read"] < stored for r in got)  # no rank reads every frame
    verify(server.url, "dt/2")


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_dcp_writer_takes_the_same_option(server):
    import torch.distributed.checkpoint as dcp

    src = low_entropy_bf16(5000, 1024)
    with CheckpointClient(server.url, compression=policy(50 * MB)) as c:
        dcp.save({"w": src}, storage_writer=c.dcp_writer("dcpz/1"), no_dist=True)
        chunks = c.manifest("dcpz/1").tensor("w").chunks
        assert len(chunks) == 3 and {ch.location.codec for ch in chunks} == {"blosc2"}
        out = {"w": torch.zeros_like(src)}
        dcp.load(out, storage_reader=c.dcp_reader("dcpz/1"), no_dist=True)
    assert torch.equal(out["w"].view(torch.int16), src.view(torch.int16))
    verify(server.url, "dcpz/1")


@pytest.mark.parametrize("compression", [None, "zstd"])
def test_each_file_is_handed_on_hashed_before_the_next_is_packed(compression):
    """The save's pipeline: ``_pack`` yields each file (where its upload starts) as soon as it is
    complete, with its final digest, and before any byte of a later file is hashed."""
    import xxhash

    from ckptd_client._save import _pack, _stream, build_snapshot

    g = torch.Generator().manual_seed(3)
    sd = {f"w{i}": torch.randn(64, 1024, generator=g).to(torch.bfloat16) for i in range(5)}
    snap = build_snapshot(sd, 0, 1)
    real = xxhash.xxh3_64
    log: list[str] = []

    class Counting:  # a file hasher (the i-th made hashes file i) that logs the bytes it is fed
        made = 0

        def __init__(self) -> None:
            self.h, self.i = real(), Counting.made
            Counting.made += 1

        def update(self, data) -> None:
            log.append(f"hash {self.i}")
            self.h.update(data)

        def hexdigest(self) -> str:
            return self.h.hexdigest()

    import ckptd_client._save as save_mod

    save_mod.xxhash.xxh3_64, handed = Counting, []
    try:
        for f in _pack(snap, snap.order(), compression, 200 << 10):
            handed.append(f)
            log.append(f"done {len(handed) - 1}")
    finally:
        save_mod.xxhash.xxh3_64 = real
    assert len(handed) >= 3 and len({f.name for f in handed}) == len(handed)
    for i, f in enumerate(handed):
        assert f.xxh3 == xxhash.xxh3_64_hexdigest(b"".join(bytes(p) for p in _stream(f)))
        later = [j for j, e in enumerate(log) if e == f"hash {i + 1}"]
        assert not later or log.index(f"done {i}") < later[0]  # handed on before file i+1 is hashed


def test_the_blosc2_overhead_bound_is_the_library_s():
    import blosc2

    from ckptd_schemas.format.encoding import BLOSC2_OVERHEAD

    assert BLOSC2_OVERHEAD == blosc2.MAX_OVERHEAD
