"""The state and the floors of ``bench.gpu``: a mixed-precision Adam state on one device, changed in every
byte between saves, and what the hardware allows under each measure (device-to-host copy, durable write,
cold read), each timed with nothing else in the way."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path

import torch

from bench._disk import parallel, read_span

__all__ = [
    "COLS",
    "d2h_floor",
    "equal_bits",
    "host_buffer",
    "leaves",
    "make_state",
    "mutate",
    "read_floor",
    "spans",
    "state_bytes",
    "state_rows",
    "sync",
    "write_floor",
]

MiB = 1 << 20
COLS = 1024                                  # columns of every tensor
WEIGHTS = (23, 5, 17, 3, 13, 7, 19, 11)      # relative sizes of the 8 layers (uneven on purpose)
BYTES_PER_PARAM = 2 + 4 + 4                  # bf16 weight, fp32 exp_avg, fp32 exp_avg_sq
# XOR masks that change every byte of an element but never its exponent (a finite value stays finite, so
# a cast to bf16 is the same on every device): the sign bit and alternate mantissa bits.
_FLIP = {2: 0x8055 - (1 << 16), 4: 0x80555555 - (1 << 32)}
_INT = {2: torch.int16, 4: torch.int32}


def state_rows(gib: float) -> list[int]:
    """Rows of the 8 layers (each ``[rows, COLS]``) for about ``gib`` GiB of state, at least 3 each."""
    params = int(gib * (1 << 30)) // BYTES_PER_PARAM
    total = max(params // COLS, 3 * len(WEIGHTS))
    return [max(total * w // sum(WEIGHTS), 3) for w in WEIGHTS]


def make_state(rows: list[int], device: torch.device, *, fill: bool, seed: int = 0) -> dict:
    """``{"model": {name: bf16}, "optim": {"state": {name: {"exp_avg": fp32, "exp_avg_sq": fp32}}}}`` on
    ``device``: random normal values (``fill``) or zeros (the tensors a load fills)."""
    g = torch.Generator(device=device).manual_seed(seed) if fill else None

    def t(n: int, dtype: torch.dtype) -> torch.Tensor:
        if not fill:
            return torch.zeros(n, COLS, dtype=dtype, device=device)
        return torch.randn(n, COLS, generator=g, device=device).to(dtype)

    model, optim = {}, {}
    for i, n in enumerate(rows):
        name = f"layers.{i}.weight"
        model[name] = t(n, torch.bfloat16)
        optim[name] = {"exp_avg": t(n, torch.float32), "exp_avg_sq": t(n, torch.float32)}
    return {"model": model, "optim": {"state": optim}}


def leaves(sd: dict, prefix: str = "") -> Iterator[tuple[str, torch.Tensor]]:
    """(dotted name, tensor) of every tensor of a nested state dict, in a fixed order."""
    for k, v in sd.items():
        if isinstance(v, dict):
            yield from leaves(v, f"{prefix}{k}.")
        else:
            yield f"{prefix}{k}", v


def state_bytes(sd: dict) -> int:
    return sum(t.numel() * t.element_size() for _, t in leaves(sd))


def sync(device: torch.device) -> None:
    """Wait for the device's queued work (a no-op on the CPU): every timing ends with it."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def mutate(sd: dict) -> None:
    """Change every byte of every tensor in place (XOR, its own inverse; exponents untouched)."""
    for _, t in leaves(sd):
        t.view(_INT[t.element_size()]).bitwise_xor_(_FLIP[t.element_size()])


def equal_bits(a: dict, b: dict) -> bool:
    """Whether two state dicts hold the same bytes (NaN-proof: compared as integers)."""
    la, lb = dict(leaves(a)), dict(leaves(b))
    return la.keys() == lb.keys() and all(
        torch.equal(la[k].view(_INT[la[k].element_size()]), lb[k].view(_INT[lb[k].element_size()])) for k in la)


def host_buffer(nbytes: int, device: torch.device) -> torch.Tensor:
    """Host memory for the D2H floor, every page faulted in now: pinned when the device is a GPU (what a
    saver's staging memory is), plain otherwise (pinning needs CUDA)."""
    buf = torch.empty(nbytes, dtype=torch.uint8, pin_memory=device.type == "cuda")
    buf.zero_()
    return buf


def d2h_floor(sd: dict, host: torch.Tensor, device: torch.device) -> float:
    """The floor under a save's stall: seconds to copy every tensor into ``host`` (pre-faulted, pinned on a
    GPU), queued asynchronously, then one synchronize; nothing else (no metadata, no flattening)."""
    sync(device)
    t0 = time.perf_counter()
    pos = 0
    for _, t in leaves(sd):
        n = t.numel() * t.element_size()
        host[pos:pos + n].view(t.dtype).view(t.shape).copy_(t, non_blocking=device.type == "cuda")
        pos += n
    sync(device)
    return time.perf_counter() - t0


def write_floor(host: torch.Tensor, work: Path, threads: int) -> float:
    """The floor under a durable save of these bytes: ``host`` cut in ``threads`` equal parts, each written
    to its own file (8 MiB writes) and fsynced by its own thread; seconds until the last fsync returns.
    The files are deleted afterwards."""
    view = memoryview(host.numpy())
    cuts = [len(view) * i // threads for i in range(threads + 1)]
    paths = [work / f"write-floor-{i}.bin" for i in range(threads)]

    def one(i: int) -> None:
        fd = os.open(paths[i], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            for a in range(cuts[i], cuts[i + 1], 8 * MiB):
                piece = view[a:min(a + 8 * MiB, cuts[i + 1])]
                while piece:
                    piece = piece[os.write(fd, piece):]
            os.fsync(fd)
        finally:
            os.close(fd)

    try:
        return parallel(one, threads)
    finally:
        for p in paths:
            p.unlink(missing_ok=True)


def spans(files: list[Path], parts: int) -> list[list[tuple[Path, int, int]]]:
    """The files laid end to end, cut into ``parts`` contiguous byte spans: per part, (file, start, end)."""
    sizes = [p.stat().st_size for p in files]
    total = sum(sizes)
    out: list[list[tuple[Path, int, int]]] = []
    for i in range(parts):
        lo, hi, at, mine = total * i // parts, total * (i + 1) // parts, 0, []
        for p, size in zip(files, sizes):
            a, b = max(lo, at) - at, min(hi, at + size) - at
            if a < b:
                mine.append((p, a, b))
            at += size
        out.append(mine)
    return out


def read_floor(files: list[Path], threads: int) -> tuple[float, int]:
    """The floor under a load of these files: each of ``threads`` threads reads its contiguous span of them
    with ``preadv`` into its own 8 MiB buffer, nothing else (the caller evicts them first: cold). Returns
    (seconds, bytes read)."""
    got = [0] * threads
    work = spans(files, threads)

    def one(i: int) -> None:
        buf = memoryview(bytearray(8 * MiB))
        for path, a, b in work[i]:
            got[i] += read_span(path, a, b, buf)

    return parallel(one, threads), sum(got)
