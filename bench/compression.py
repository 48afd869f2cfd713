"""Which codec, and is compressing worth it: byte planes (blosc2) against plain zstd and raw.

    .venv/bin/python -m bench.compression --mib 256 --repeat 3 --throttle-mbps 200 --out bench/results/compression.json

1. The states: a small MLP (``--mib`` MiB of fp32 weights) trained for ``--steps`` AdamW steps on
   random data, then its fp32 weights, its AdamW moments (``exp_avg``, ``exp_avg_sq``), and the
   weights in bf16: values as training leaves them, not ``randn``.
2. Codecs as the client runs them (4 MiB frames, one core): zstd level 1; Blosc2 with byte
   shuffle and zstd level 1 (``"blosc2"``, the client's byte planes); and the same planes by hand
   (numpy transpose, each plane zstd-1 or kept raw): ratio, compress and decompress throughput.
3. Durable local writes: ``--mib`` MiB in 16 MiB writes, then ``fsync``.
4. The policy (``ckptd_client.codec.CompressionPolicy``) for each state: the break-even store
   throughput below which compressing is faster, and what it chooses at the disk's rate and at
   the throttled rate.
5. End to end: ``CheckpointClient.save`` of each state through HTTP to a ``ckptd serve`` whose
   storage writes pass one link of ``--throttle-mbps`` MB/s (``CKPTD_FAULTS=throttle=...``, tests/fault_server.py, a
   slow remote store), with ``None``, ``"zstd"``, ``"planes"`` and ``"auto"``: seconds to commit,
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

import numpy as np
import torch
import zstandard

from bench._report import write_report

REPO = Path(__file__).resolve().parents[1]
if str(REPO / "tests") not in sys.path:
    sys.path.insert(0, str(REPO / "tests"))

from ckptd_client import CheckpointClient  # noqa: E402
from ckptd_client.codec import CompressionPolicy  # noqa: E402
from ckptd_schemas.format.encoding import FRAME_BYTES, codec_for, decode_frame, encode  # noqa: E402
from support import ServerProcess  # noqa: E402  (tests/support.py)

MiB, MB = 1 << 20, 1e6
MODES: list[str | None] = [None, "zstd", "planes", "auto"]


def trained_states(mib: float, steps: int) -> dict[str, torch.Tensor]:
    """fp32 weights, AdamW moments and bf16 weights of an MLP of about ``mib`` MiB after ``steps`` steps."""
    torch.manual_seed(0)
    width = 1024
    layers = max(1, int(mib * MiB) // (4 * width * width))
    model = torch.nn.Sequential(*[m for _ in range(layers) for m in (torch.nn.Linear(width, width), torch.nn.GELU())])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x, y = torch.randn(64, width), torch.randn(64, width)
    for _ in range(steps):
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    params = [p.detach() for p in model.parameters()]
    state = opt.state_dict()["state"]
    flat = lambda ts: torch.cat([t.reshape(-1) for t in ts])  # noqa: E731
    w = flat(params)
    return {"fp32_weights": w, "adamw_exp_avg": flat(state[i]["exp_avg"] for i in state),
            "adamw_exp_avg_sq": flat(state[i]["exp_avg_sq"] for i in state), "bf16_weights": w.to(torch.bfloat16)}


def _frames(t: torch.Tensor) -> list[memoryview]:
    raw = memoryview(t.reshape(-1).view(torch.uint8).numpy())
    return [raw[i:i + FRAME_BYTES] for i in range(0, len(raw), FRAME_BYTES)]


def _planes_by_hand(frame: memoryview, k: int, cctx: zstandard.ZstdCompressor) -> list[bytes]:
    planes = np.frombuffer(frame, np.uint8).reshape(-1, k).T.copy()
    out = []
    for plane in planes:
        packed = cctx.compress(plane.tobytes())
        out.append(packed if len(packed) < len(plane) else plane.tobytes())
    return out


def codec_speeds(t: torch.Tensor) -> dict:
    """Ratio and MB/s (compress, decompress) of each codec on ``t``, in 4 MiB frames, one core."""
    frames, k = _frames(t), t.element_size()
    nbytes = sum(len(f) for f in frames)
    out = {}
    for codec in ("zstd", "blosc2"):
        t0 = time.perf_counter()
        packed = [encode(f, codec, k) for f in frames]
        t1 = time.perf_counter()
        for f, p in zip(frames, packed):
            decode_frame(p, len(f), "bench", codec)
        t2 = time.perf_counter()
        out[codec] = {"ratio": sum(map(len, packed)) / nbytes, "compress_mbps": nbytes / (t1 - t0) / MB,
                      "decompress_mbps": nbytes / (t2 - t1) / MB}
    cctx, dctx = zstandard.ZstdCompressor(level=1), zstandard.ZstdDecompressor()
    t0 = time.perf_counter()
    packed_planes = [_planes_by_hand(f, k, cctx) for f in frames]
    t1 = time.perf_counter()
    for f, planes in zip(frames, packed_planes):
        n = len(f) // k
        back = np.empty((k, n), np.uint8)
        for j, p in enumerate(planes):
            back[j] = np.frombuffer(p if len(p) == n else dctx.decompress(p, max_output_size=n), np.uint8)
        back.T.copy()
    t2 = time.perf_counter()
    out["planes_by_hand"] = {"ratio": sum(len(p) for ps in packed_planes for p in ps) / nbytes,
                             "compress_mbps": nbytes / (t1 - t0) / MB, "decompress_mbps": nbytes / (t2 - t1) / MB}
    return out


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
    """Sample measurement with the state's codec, break-even store rate, and the choice at each rate (MB/s)."""
    raw = memoryview(t.reshape(-1).view(torch.uint8).numpy())
    p = CompressionPolicy()
    m = p.measure(raw, t.element_size())
    return {"codec": codec_for(t.element_size()), "sample_ratio": m.ratio, "sample_mbps": m.speed / MB,
            "break_even_mbps": max(0.0, m.speed * (1 - p.margin - m.ratio)) / MB,
            **{f"at_{k}": "compress" if CompressionPolicy(v * MB).decide(len(raw), m) else "raw"
               for k, v in rates.items()}}


def end_to_end(work: Path, states: dict[str, torch.Tensor], repeat: int, throttle_mbps: float) -> dict:
    """Median seconds of ``repeat`` committed saves per (state, mode), order rotated, through HTTP to a
    service whose storage writes share one ``throttle_mbps`` link; a fresh client per save (``"auto"``
    then decides with its default store estimate, as a new job does), incremental saves off."""
    srv = ServerProcess(work / "root", log=work / "server.log",
                        env={"CKPTD_FAULTS": f"throttle={throttle_mbps:g}"}).start()
    times: dict[str, list[float]] = {}
    out: dict = {}
    try:
        for r in range(repeat):
            for mode in MODES[r % len(MODES):] + MODES[:r % len(MODES)]:
                for name, t in states.items():
                    key = f"{name}/{mode or 'raw'}"
                    ref = f"bench-{name.replace('_', '-')}-{mode or 'raw'}/{r}"
                    with CheckpointClient(srv.url, compression=mode, incremental=False) as c:
                        t0 = time.perf_counter()
                        c.save({"w": t}, ref).wait()
                        times.setdefault(key, []).append(time.perf_counter() - t0)
                        chunks = c.manifest(ref).tensor("w").chunks
                    nbytes = t.numel() * t.element_size()
                    dt = statistics.median(times[key])
                    out[key] = {"seconds": dt, "all_seconds": times[key], "mbps": nbytes / dt / MB,
                                "stored_ratio": sum(ch.location.length for ch in chunks) / nbytes,
                                "chunks": len(chunks), "codecs": sorted({ch.location.codec for ch in chunks})}
    finally:
        srv.stop()
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mib", type=float, default=256, help="fp32 weights of the trained model, MiB")
    ap.add_argument("--steps", type=int, default=20, help="AdamW steps before the states are taken")
    ap.add_argument("--repeat", type=int, default=3, help="saves per (state, mode); the median counts")
    ap.add_argument("--throttle-mbps", type=float, default=200, help="the store's write rate, MB/s")
    ap.add_argument("--workdir", type=Path, default=None, help="where to write (default $TMPDIR)")
    ap.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "compression.json")
    args = ap.parse_args(argv)
    t_start = time.perf_counter()
    torch.set_num_threads(1)
    states = trained_states(args.mib, args.steps)
    with tempfile.TemporaryDirectory(prefix="ckptd-bench-zstd-", dir=args.workdir) as tmp:
        work = Path(tmp)
        disk = durable_write(work, args.mib)
        speeds = {k: codec_speeds(t) for k, t in states.items()}
        e2e = end_to_end(work, states, args.repeat, args.throttle_mbps)
        rates = {"disk": disk, "throttled": args.throttle_mbps}
        policy = {k: policy_view(t, rates) for k, t in states.items()}
    result = {"command": "python -m bench.compression " + " ".join(sys.argv[1:] if argv is None else argv),
              "mib": args.mib, "steps": args.steps, "repeat": args.repeat, "throttle_mbps": args.throttle_mbps,
              "disk_write_fsync_mbps": disk, "codecs": speeds, "policy": policy, "save": e2e,
              "state_bytes": {k: t.numel() * t.element_size() for k, t in states.items()},
              "loadavg": os.getloadavg(), "cpus": os.cpu_count(), "wall_s": time.perf_counter() - t_start}
    rows = [f"durable write (write+fsync): {disk:.0f} MB/s; store throttled to {args.throttle_mbps:g} MB/s; "
            f"load average {os.getloadavg()[0]:.1f}", "",
            "| state | codec | ratio | compress MB/s | decompress MB/s |", "| --- | --- | --- | --- | --- |"]
    for k, by in speeds.items():
        for codec, v in by.items():
            rows.append(f"| {k} | {codec} | {v['ratio']:.3f} | {v['compress_mbps']:.0f} | {v['decompress_mbps']:.0f} |")
    rows += ["", "| state | policy codec | break-even store MB/s | auto at disk | auto at throttled |",
             "| --- | --- | --- | --- | --- |"]
    for k, p in policy.items():
        rows.append(f"| {k} | {p['codec']} | {p['break_even_mbps']:.0f} | {p['at_disk']} | {p['at_throttled']} |")
    rows += ["", "| save (throttled store, HTTP) | s | MB/s | stored/raw | codecs |", "| --- | --- | --- | --- | --- |"]
    for k, v in e2e.items():
        rows.append(f"| {k} | {v['seconds']:.2f} | {v['mbps']:.0f} | {v['stored_ratio']:.3f} | {','.join(v['codecs'])} |")
    write_report(args.out, result, "\n".join(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
