"""Decompression bombs: a tiny upload must never cost the service (or a reader) gigabytes.

The promise (docs/guarantees.md, RELIABILITY.md "Decompression bomb"): every decoder of a stored
codec (``zstd``, ``blosc2`` byte planes), at the commit's check, ``ckptd verify`` and every reader,
works in bounded memory whatever a writer declares. A compressed chunk holds at most ``FRAME_BYTES``
(4 MiB) raw bytes, checked before anything is allocated for it; compressed chunks never share bytes
(each is its own frame); a frame's verdict is reached, and its decoder freed, as soon as its bytes
have passed.

Each attack is a writer with a valid token on the real wire protocol (raw HTTP, like
``test_commit_checks.py``), against a real ``ckptd serve``. The service's peak RSS (``VmHWM`` of its
process, reset first through ``/proc/<pid>/clear_refs``) must grow by far less than the bomb, the
commit is refused naming the tensor (or object), rank and file, and the previous checkpoint still
loads bit for bit. The read side: a checkpoint whose stored chunk is a bomb (planted on disk, as a
root written before the limit would hold it) is refused by ``client.load`` and ``ckptd verify`` in
bounded memory.

Attacks:

* ``blosc2``: a 32-byte Blosc2 chunk (zeros as a special value) declaring 1 GiB, for a tensor of
  1 GiB (it was decoded into a 1 GiB buffer);
* ``zstd``: eight 4 KB zstd frames of 128 MiB each with a 128 MiB window (each decoder held its
  window until the end of the file: 1 GiB);
* ``blosc2-object``: a stored object whose 32-byte Blosc2 chunk declares 1 GiB;
* ``blosc2-overlapping``: 256 chunks of 4 MiB, each a valid Blosc2 chunk, starting 32 bytes apart
  in one 4 MiB file (each was collected whole at once: 1 GiB);
* ``zstd-many-frames`` (honest-shaped, it commits): 256 zstd frames of 4 MiB zeros, each 140 bytes
  with a 4 MiB window, in one file (every decoder lived until the end of the file: 1 GiB).

Honest but odd: two tensors on exactly one compressed frame still commit (decoded once).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import xxhash

from adversary.test_commit_checks import Env, _chunk, _index, _object, _rows, _tensor, W
from support import REPO, ServerProcess, plant_file, scaled

MiB, GiB = 1 << 20, 1 << 30
BOUND_MIB = 256  # far less than any bomb here (1 GiB each)


# -- bombs, made without ever holding what they decode to -------------------------------------------------

def blosc2_zeros(raw: int, typesize: int = 4) -> bytes:
    """A 32-byte Blosc2 chunk that decodes to ``raw`` zero bytes (zeros as a special value)."""
    import blosc2

    s = blosc2.SChunk(chunksize=raw, cparams={"typesize": typesize})
    s.fill_special(raw // typesize, blosc2.SpecialValue.ZERO)
    chunk = bytes(s.get_chunk(0))
    assert len(chunk) == 32 and blosc2.get_cbuffer_sizes(chunk)[:2] == (raw, 32)
    return chunk


def zstd_zeros(raw: int, window_log: int) -> bytes:
    """A zstd frame of ``raw`` zero bytes built by hand from RLE blocks (4 bytes per 128 KiB), declaring
    ``raw`` as its content size and a window of ``2**window_log`` bytes (not a single segment)."""
    header = (0xFD2FB528).to_bytes(4, "little") + bytes([3 << 6, (window_log - 10) << 3]) + raw.to_bytes(8, "little")
    block, out, left = min(128 << 10, 1 << window_log), [header], raw
    while left:
        n = min(block, left)
        left -= n
        out.append((int(not left) | 1 << 1 | n << 3).to_bytes(3, "little") + b"\0")
    return b"".join(out)


def blosc2_memcpyed_header(raw: int) -> bytes:
    """The 32-byte header of a Blosc2 chunk that stores ``raw`` bytes as they are (incompressible data):
    whatever ``raw`` bytes follow it, header and bytes are one valid chunk."""
    import blosc2
    import numpy as np

    noise = np.random.default_rng(0).integers(0, 256, raw, dtype=np.uint8).tobytes()
    chunk = blosc2.compress2(noise, codec=blosc2.Codec.ZSTD, clevel=1, typesize=4, filters=[blosc2.Filter.SHUFFLE],
                             nthreads=1)
    assert len(chunk) == raw + 32
    return bytes(chunk[:32])


# -- the service's peak memory ------------------------------------------------------------------------------

def _hwm_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise AssertionError(f"no VmHWM for process {pid}")


def _reset_peak(pid: int) -> float:
    """Set ``pid``'s peak RSS to its current RSS (Linux ``clear_refs`` 5); return it in MiB."""
    Path(f"/proc/{pid}/clear_refs").write_text("5")
    return _hwm_mib(pid)


def _server_pid(env: Env) -> int:
    assert env.srv.proc is not None
    return env.srv.proc.pid


# -- the attacks on the commit -------------------------------------------------------------------------------

def _attack(case: str) -> tuple[bytes, list[dict], list[dict], str, str]:
    """The file, the tensors and objects of rank 0's index, the refusal's phrase and its subject."""
    if case == "blosc2":
        bomb = blosc2_zeros(GiB)
        return bomb, [_tensor("model.bomb", [GiB // 4], [_chunk(0, "r0.bin", bomb, codec="blosc2", raw_length=GiB,
                                                                  offsets=[0], sizes=[GiB // 4])])], [], \
            "frame limit", "tensor 'model.bomb' (rank 0)"
    if case == "zstd":
        frame, n = zstd_zeros(128 * MiB, 27), 8
        chunks = [_chunk(0, "r0.bin", frame, offset=k * len(frame), codec="zstd", raw_length=128 * MiB,
                         offsets=[k, 0], sizes=[1, 128 * MiB]) for k in range(n)]
        return frame * n, [_tensor("model.bomb", [n, 128 * MiB], chunks, dtype="uint8")], [], \
            "frame limit", "tensor 'model.bomb' (rank 0)"
    if case == "blosc2-object":
        data, bomb = _rows(0, 4), blosc2_zeros(GiB)
        tensors = [_tensor(W, [4, 3], [_chunk(0, "r0.bin", data, offsets=[0, 0], sizes=[4, 3])])]
        return data + bomb, tensors, [_object("extra.bomb", "r0.bin", bomb, offset=len(data), codec="blosc2",
                                              raw_length=GiB)], "frame limit", "object 'extra.bomb'"
    if case == "blosc2-overlapping":
        n, raw = 256, 4 * MiB
        header = blosc2_memcpyed_header(raw)
        data = header * n + bytes(raw)  # chunk k: bytes [32k, 32k + raw + 32)
        chunks = [_chunk(0, "r0.bin", data[32 * k:32 * k + raw + 32], offset=32 * k, codec="blosc2", raw_length=raw,
                         offsets=[k, 0], sizes=[1, raw // 4]) for k in range(n)]
        return data, [_tensor("model.bomb", [n, raw // 4], chunks)], [], "share bytes", \
            "tensor 'model.bomb' (rank 0)"
    raise AssertionError(case)


@pytest.mark.parametrize("case", ["blosc2", "zstd", "blosc2-object", "blosc2-overlapping"])
def test_a_bomb_is_refused_at_commit_in_bounded_memory(env, case):
    data, tensors, objects, phrase, subject = _attack(case)
    assert len(data) <= 5 * MiB
    env.open("2", "s", 1)
    env.upload("2", "s", "r0.bin", data)
    index = _index(0, 1, tensors, ["r0.bin"])
    if objects:
        index["objects"] = objects
    pid = _server_pid(env)
    before = _reset_peak(pid)
    r = env.put_index("2", "s", index)
    grew = _hwm_mib(pid) - before
    assert grew < BOUND_MIB, f"{case}: the service's peak RSS grew by {grew:.0f} MiB for a {len(data)}-byte upload"
    err = env.refused(r, "integrity", subject, "'r0.bin'", phrase)
    assert err["details"]["file"] == "r0.bin", err
    env.assert_invisible("2", "s")


def test_many_frames_in_one_file_commit_in_bounded_memory(tmp_path):
    """256 zstd frames of 4 MiB zeros (140 bytes each, a 4 MiB window each) are an honest, if odd,
    compressed tensor of 1 GiB: it commits, and the check holds one frame's decoder at a time. A
    service of its own: memory an earlier attack left in the module server's heap would hide the growth."""
    srv = ServerProcess(tmp_path / "root", log=tmp_path / "server.log").start()
    env = Env(srv)
    try:
        _many_frames(env)
    finally:
        env.close()
        srv.stop()


def _many_frames(env: Env) -> None:
    frame, n = zstd_zeros(4 * MiB, 22), 256
    assert len(frame) < 256
    chunks = [_chunk(0, "r0.bin", frame, offset=k * len(frame), codec="zstd", raw_length=4 * MiB,
                     offsets=[k, 0], sizes=[1, 4 * MiB]) for k in range(n)]
    env.open("2", "s", 1)
    env.upload("2", "s", "r0.bin", frame * n)
    pid = _server_pid(env)
    before = _reset_peak(pid)
    r = env.put_index("2", "s", _index(0, 1, [_tensor("model.zeros", [n, 4 * MiB], chunks, dtype="uint8")],
                                       ["r0.bin"]))
    grew = _hwm_mib(pid) - before
    assert r.status_code == 200 and r.json()["state"] == "committed", r.text
    assert grew < BOUND_MIB, f"the service's peak RSS grew by {grew:.0f} MiB checking {n} frames of 4 MiB"


def test_two_tensors_on_one_compressed_frame_still_commit(env):
    """Compressed chunks may not share bytes, except two rows on exactly one frame (same bytes, codec
    and size): decoded once, one verdict for both. The checkpoint commits and loads."""
    import torch
    import zstandard

    piece = _rows(0, 4)
    frame = zstandard.ZstdCompressor(level=1).compress(piece)
    env.open("2", "s", 1)
    env.upload("2", "s", "r0.bin", frame)
    tensors = [_tensor(W, [4, 3], [_chunk(0, "r0.bin", frame, codec="zstd", raw_length=48, offsets=[0, 0],
                                          sizes=[4, 3])]),
               _tensor("model.v", [12], [_chunk(0, "r0.bin", frame, codec="zstd", raw_length=48, offsets=[0],
                                                sizes=[12])])]
    r = env.put_index("2", "s", _index(0, 1, tensors, ["r0.bin"]))
    assert r.status_code == 200 and r.json()["state"] == "committed", r.text
    got = {"model": {"w": torch.zeros(4, 3), "v": torch.zeros(12)}}
    env.client.load(got, f"{env.run}/2")
    assert torch.equal(got["model"]["v"], got["model"]["w"].reshape(12)) and got["model"]["w"].any()


# -- the read side: a bomb already stored ----------------------------------------------------------------------

def _commit_zero_tensor(url: str, ref: str, numel: int) -> None:
    """Commit ``ref`` holding ``model.bomb`` (float32 zeros) honestly: 32-byte Blosc2 chunks of 4 MiB each."""
    run, name = ref.split("/")
    piece = blosc2_zeros(4 * MiB)
    rows = 4 * MiB // 4
    n = numel // rows
    chunks = [_chunk(0, "r0.bin", piece, offset=32 * k, codec="blosc2", raw_length=4 * MiB, offsets=[k * rows],
                     sizes=[rows]) for k in range(n)]
    base = f"{url}/v1/checkpoints/{run}/{name}"
    with httpx.Client(timeout=scaled(120)) as h:
        h.post(f"{base}/sessions", json={"session": "s", "world_size": 1, "step": 2}).raise_for_status()
        h.put(f"{base}/sessions/s/files/r0.bin", content=piece * n,
              headers={"X-Ckptd-Xxh3": xxhash.xxh3_64_hexdigest(piece * n)}).raise_for_status()
        r = h.put(f"{base}/sessions/s/ranks/0", content=json.dumps(_index(0, 1, [
            _tensor("model.bomb", [numel], chunks)], ["r0.bin"])), headers={"Content-Type": "application/json"})
        assert r.status_code == 200 and r.json()["state"] == "committed", r.text


def _plant_one_chunk(root: Path, run: str, name: str, stored: bytes) -> None:
    """Make ``run/name``'s one tensor a single ``blosc2`` chunk of ``stored`` covering it all, with every
    digest, the manifest's name and the marker's load tree agreeing: what a root committed before the
    frame limit, or edited on disk by a writer with access to it, holds."""
    def edit(manifest: dict) -> None:
        [tensor] = manifest["tensors"]
        table = tensor["table"]
        for col in table:
            if isinstance(table[col], list):
                table[col] = table[col][:1]
        table.update(offsets=[[0]], sizes=[tensor["shape"]], offset=[0], length=[len(stored)],
                     xxh3=[xxhash.xxh3_64_hexdigest(stored)])

    plant_file(root, run, name, "r0.bin", stored, edit, load_tree=True)


_LOAD_PROBE = """
import json, sys
from pathlib import Path
import torch
from ckptd_client import CheckpointClient
from ckptd_schemas import CkptdError

def hwm():
    line = next(x for x in Path("/proc/self/status").read_text().splitlines() if x.startswith("VmHWM:"))
    return int(line.split()[1]) / 1024

url, ref, numel = sys.argv[1], sys.argv[2], int(sys.argv[3])
dest = {"model": {"bomb": torch.empty(numel)}}  # reserved, not touched: only what the load writes counts
with CheckpointClient(url, retry_seconds=5) as c:
    c.manifest(ref)
    Path("/proc/self/clear_refs").write_text("5")
    before = hwm()
    try:
        c.load(dest, ref)
        out = {"error": None, "message": ""}
    except CkptdError as e:
        out = {"error": type(e).__name__, "message": e.message, "details": e.details}
    print(json.dumps({**out, "grew_mib": hwm() - before}))
"""


def test_a_stored_bomb_is_refused_by_every_reader_in_bounded_memory(tmp_path):
    """``gpt/2`` is committed honestly (a 1 GiB zero tensor in 4 MiB Blosc2 chunks), then its root is
    edited so that the tensor is one 32-byte Blosc2 chunk declaring 1 GiB. ``client.load`` refuses it
    (``CorruptCheckpoint`` naming the tensor and file) and ``ckptd verify`` exits 1 naming the file,
    each growing by far less than the bomb; ``gpt/1`` still loads."""
    from ckptd_client import CheckpointClient
    from support import assert_bits_equal, blank_like, make_state

    numel = GiB // 4
    srv = ServerProcess(tmp_path / "root", log=tmp_path / "server.log").start()
    try:
        good = make_state(1)
        with CheckpointClient(srv.url, retry_seconds=5) as c:
            c.save(good, "gpt/1").wait(timeout=scaled(60))
        _commit_zero_tensor(srv.url, "gpt/2", numel)
    finally:
        srv.stop()
    _plant_one_chunk(tmp_path / "root", "gpt", "2", blosc2_zeros(GiB))
    srv = ServerProcess(tmp_path / "root", log=tmp_path / "server2.log").start()
    try:
        p = subprocess.run([sys.executable, "-c", _LOAD_PROBE, srv.url, "gpt/2", str(numel)], capture_output=True,
                           text=True, timeout=scaled(300), cwd=REPO)
        assert p.returncode == 0, p.stdout + p.stderr
        got = json.loads(p.stdout.strip().splitlines()[-1])
        assert got["error"] == "CorruptCheckpoint", got
        assert "model.bomb" in got["message"] and "r0.bin" in got["message"] and "frame limit" in got["message"], got
        assert got["grew_mib"] < BOUND_MIB, f"client.load grew by {got['grew_mib']:.0f} MiB on a 32-byte chunk"
        with CheckpointClient(srv.url, retry_seconds=5) as c:
            back = blank_like(good)
            c.load(back, "gpt/1")
            assert_bits_equal(back, good)
    finally:
        srv.stop()
    probe = ("import resource, subprocess, sys\n"
             f"p = subprocess.run([sys.executable, '-m', 'ckptd.cli.main', 'verify', '--root', "
             f"{str(tmp_path / 'root')!r}, 'gpt/2'], capture_output=True, text=True)\n"
             "print(p.returncode, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)\n"
             "print(p.stdout + p.stderr)\n")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=scaled(300),
                         cwd=REPO).stdout
    first, _, rest = out.partition("\n")
    rc, rss_kib = map(int, first.split())
    assert rc == 1 and "r0.bin" in rest and "frame limit" in rest and "Traceback" not in rest, rest
    assert rss_kib < (BOUND_MIB + 256) << 10, f"ckptd verify peaked at {rss_kib >> 10} MiB on a 32-byte chunk"
