"""Is zstd worth it on this machine, and what does ``compression="auto"`` choose?

    .venv/bin/python -m bench.compression --mib 256 --repeat 3 --slow-mbps 100 --out bench/results/compression.json

1. zstd level 1 as the client runs it (4 MiB frames, one core): compress and
   decompress throughput and ratio on fp32 weights (``torch.randn * 0.02``) and
   on the same values in bf16.
2. Durable local writes: ``--mib`` MiB in 16 MiB writes, then ``fsync``.
3. The policy (``ckptd_client.codec.CompressionPolicy``) for each dtype: the
   break-even store throughput ``speed * (1 - margin - ratio)`` below which
   compressing is faster, and what it chooses at the measured disk rate and at
   ``--slow-mbps`` (a remote store).
4. End to end: ``CheckpointClient.save`` of each state to a ``ckptd serve`` on
   the same disk with ``None``, ``"zstd"`` and ``"auto"``: seconds to commit,
   bytes stored, codecs chosen (median of ``--repeat``, the order of the modes rotated).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import zstandard

from bench._report import write_report

REPO = Path(__file__).resolve().parents[1]
if str(REPO / "tests") not in sys.path:
    sys.path.insert(0, str(REPO / "tests"))

from ckptd_client import CheckpointClient  # noqa: E402
from ckptd_client.codec import FRAME_BYTES, CompressionPolicy  # noqa: E402
from support import ServerProcess  # noqa: E402  (tests/support.py)

MiB, MB = 1 << 20, 1e6


def weights(mib: float, dtype: torch.dtype) -> torch.Tensor:
    """``mib`` MiB of random-ish weights (normal, std 0.02) as ``dtype``, 4096 columns."""
    n = int(mib * MiB) // torch.finfo(dtype).bits * 8
    g = torch.Generator().manual_seed(0)
    return (torch.randn(n // 4096, 4096, generator=g) * 0.02).to(dtype)


def zstd_speed(t: torch.Tensor) -> dict:
    raw = memoryview(t.reshape(-1).view(torch.uint8).numpy())
    frames = [raw[i:i + FRAME_BYTES] for i in range(0, len(raw), FRAME_BYTES)]
    c, d = zstandard.ZstdCompressor(level=1), zstandard.ZstdDecompressor()
    t0 = time.perf_counter()
    packed = [c.compress(f) for f in frames]
    t1 = time.perf_counter()
    for p in packed:
        d.decompress(p)
    t2 = time.perf_counter()
    return {"ratio": sum(map(len, packed)) / len(raw), "compress_mbps": len(raw) / (t1 - t0) / MB,
            "decompress_mbps": len(raw) / (t2 - t1) / MB}


def durable_write(work: Path, mib: float) -> float:
    """MB/s of writing ``mib`` MiB and fsync'ing it (the ceiling of a local save)."""
    buf = os.urandom(16 * MiB)
    path = work / "fsync.bin"
    t0 = time.perf_counter()
    with open(path, "wb") as f:
        for _ in range(max(1, int(mib // 16))):
            f.write(buf)
        f.flush()
        os.fsync(f.fileno())
        n = f.tell()
    dt = time.perf_counter() - t0
    path.unlink()
    return n / dt / MB


def policy_view(t: torch.Tensor, rates: dict[str, float]) -> dict:
    """Sample measurement, break-even store rate, and the choice at each store rate (MB/s) of ``rates``."""
    raw = memoryview(t.reshape(-1).view(torch.uint8).numpy())
    p = CompressionPolicy()
    m = p.measure(raw)
    return {"sample_ratio": m.ratio, "sample_mbps": m.speed / MB,
            "break_even_mbps": max(0.0, m.speed * (1 - p.margin - m.ratio)) / MB,
            **{f"at_{k}": "zstd" if CompressionPolicy(v * MB).decide(len(raw), m) else "raw"
               for k, v in rates.items()}}


def end_to_end(work: Path, states: dict[str, torch.Tensor], repeat: int) -> dict:
    """Median seconds of ``repeat`` committed saves per (state, mode), order rotated; a fresh
    client per save, so ``"auto"`` decides with its default store estimate every time."""
    srv = ServerProcess(work / "root", log=work / "server.log").start()
    times: dict[str, list[float]] = {}
    observed: list[float] = []
    out: dict = {}
    try:
        modes: list[str | None] = [None, "zstd", "auto"]
        for r in range(repeat):
            for mode in modes[r % 3:] + modes[:r % 3]:  # each mode first once in three repeats
                for name, t in states.items():
                    key = f"{name}/{mode or 'raw'}"
                    with CheckpointClient(srv.url, compression=mode) as c:
                        t0 = time.perf_counter()
                        c.save({"w": t}, f"bench-{name}-{mode or 'raw'}/{r}").wait()
                        times.setdefault(key, []).append(time.perf_counter() - t0)
                        if mode == "auto":  # what the client learned of its upload path
                            observed.append(c._codec.store_bw / MB)
                        chunks = c.manifest(f"bench-{name}-{mode or 'raw'}/{r}").tensor("w").chunks
                    nbytes = t.numel() * t.element_size()
                    dt = statistics.median(times[key])
                    out[key] = {"seconds": dt, "all_seconds": times[key], "mbps": nbytes / dt / MB,
                                "stored_ratio": sum(ch.location.length for ch in chunks) / nbytes,
                                "chunks": len(chunks), "codecs": sorted({ch.location.codec for ch in chunks})}
    finally:
        srv.stop()
    out["observed_upload_mbps"] = statistics.median(observed)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mib", type=float, default=256, help="size of each state (fp32 and bf16), MiB")
    ap.add_argument("--repeat", type=int, default=3, help="saves per (state, mode); the median counts")
    ap.add_argument("--slow-mbps", type=float, default=100, help="a remote store's upload rate, MB/s")
    ap.add_argument("--workdir", type=Path, default=None, help="where to write (default $TMPDIR)")
    ap.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "compression.json")
    args = ap.parse_args(argv)
    t_start = time.perf_counter()
    torch.set_num_threads(1)
    states = {"fp32": weights(args.mib, torch.float32), "bf16": weights(args.mib, torch.bfloat16)}
    with tempfile.TemporaryDirectory(prefix="ckptd-bench-zstd-", dir=args.workdir) as tmp:
        work = Path(tmp)
        disk = durable_write(work, args.mib)
        zstd = {k: zstd_speed(t) for k, t in states.items()}
        e2e = end_to_end(work, states, args.repeat)
        upload = e2e.pop("observed_upload_mbps")
        rates = {"disk": disk, "upload": upload, "slow": args.slow_mbps}
        policy = {k: policy_view(t, rates) for k, t in states.items()}
    result = {"mib": args.mib, "repeat": args.repeat, "slow_mbps": args.slow_mbps, "disk_write_fsync_mbps": disk,
              "observed_upload_mbps": upload, "zstd1": zstd, "policy": policy, "save": e2e, "loadavg": os.getloadavg(), "cpus": os.cpu_count(),
              "wall_s": time.perf_counter() - t_start}
    rows = [f"durable write (write+fsync): {disk:.0f} MB/s; upload rate observed by \"auto\": {upload:.0f} MB/s; "
            f"load average {os.getloadavg()[0]:.1f}", "",
            "dtype  zstd-1 ratio  compress MB/s  decompress MB/s  sample MB/s  break-even store MB/s  "
            f"auto@disk  auto@upload  auto@{args.slow_mbps:g}MB/s"]
    for k in states:
        z, p = zstd[k], policy[k]
        rows.append(f"{k:<6} {z['ratio']:>12.3f} {z['compress_mbps']:>14.0f} {z['decompress_mbps']:>16.0f} "
                    f"{p['sample_mbps']:>12.0f} {p['break_even_mbps']:>22.0f}  {p['at_disk']:>9}  "
                    f"{p['at_upload']:>11}  {p['at_slow']:>10}")
    rows += ["", "save (one client, local ckptd serve)   s     MB/s  stored/raw  chunks  codecs"]
    for k, v in e2e.items():
        rows.append(f"{k:<38} {v['seconds']:>5.2f} {v['mbps']:>7.0f} {v['stored_ratio']:>10.3f} {v['chunks']:>7}  "
                    f"{','.join(v['codecs'])}")
    write_report(args.out, result, "\n".join(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
