"""Attacks on the commit: a writer with a valid token sends indexes and files that lie.

The promise (docs/guarantees.md §3): the commit accepts nothing it has not checked itself, so no
checkpoint becomes visible that ``ckptd verify`` would reject. Each attack goes over raw HTTP
(httpx) to a real ``ckptd serve``. Every refusal must be typed and name the tensor, rank or file; the
session is failed; nothing becomes visible (no ``COMMITTED``, not listed, ``RUN/latest`` still the
previous checkpoint); and the previous checkpoint still loads bit for bit (``Env.assert_invisible``).
For every attack the commit accepts, ``ckptd verify --root`` exits 0 and the load gives exactly the
bytes the index describes.

Attacks: chunk digests that are not the hash of the chunk's bytes (the file's own digest right),
including chunks pointing at padding or into another chunk's bytes; replicas that share a digest
(a real XXH3-64 collision) but not their bytes; zstd chunks whose frame holds more or fewer bytes
than the tensor piece, or decodes to more than its header declares; zstd chunks that are not exactly
one plain frame (a skippable frame before or after it, two frames, no content size, a dictionary
frame, trailing bytes, a wrong content checksum); stored objects whose digest or frame lies; replicas
that only the tiling sees as replicas (a flat range and a box over the same elements, or a box equal
to part of a flat range, under one XXH3-64 but with other bytes); a file claimed by two ranks or
pointed at by a rank that did not list it; and layouts that are odd but honest (empty tensors and an
empty zstd frame, two tensors on the same bytes, a file no index references, a rank's index replaced
before the last rank's arrives). Files that enter a session other ways (linked, uploaded by URL) are
attacked in ``test_ingest.py`` and ``test_ingest_s3.py``.
"""

from __future__ import annotations

import itertools
import json
import struct
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
import xxhash
import zstandard

from ckptd_client import CheckpointClient
from support import REPO, ServerProcess, assert_bits_equal, blank_like, make_state

W = "model.w"
FULL = torch.arange(4 * 3, dtype=torch.float32).reshape(4, 3)
_runs = itertools.count()


def h(data: bytes) -> str:
    return xxhash.xxh3_64_hexdigest(data)


def xxh3_collision() -> tuple[bytes, bytes]:
    """Two different 16-byte strings with one XXH3-64 (no search: the 9-16 byte path is
    ``swap(lo) + hi + fold(lo * hi)`` of the input xor'd with the default secret; with ``lo`` = 1
    that is ``2 * hi``, which ``hi`` and ``hi + 2**63`` share)."""
    secret_24_56 = bytes.fromhex("7240a4a4b7b3671fcb79e64eccc0e578825ad07dccff7221b8084674f743248e")
    q = [struct.unpack_from("<Q", secret_24_56, k)[0] for k in (0, 8, 16, 24)]
    lo = 1 ^ (q[0] ^ q[1])
    hi = 0x3F8000003F800000
    a, b = struct.pack("<QQ", lo, hi), struct.pack("<QQ", lo, hi ^ (1 << 63))
    assert a != b and h(a) == h(b)
    return a, b


def _chunk(rank: int, file: str, stored: bytes, *, offset: int = 0, codec: str = "raw", raw_length: int | None = None,
           digest: str | None = None, **region: Any) -> dict:
    kind = "flat" if "start" in region else "box"
    return {"kind": kind, "rank": rank, **region,
            "location": {"file": file, "offset": offset, "length": len(stored), "codec": codec,
                         "raw_length": len(stored) if raw_length is None else raw_length,
                         "xxh3": digest or h(stored)}}


def _tensor(name: str, shape: list[int], chunks: list[dict], dtype: str = "float32") -> dict:
    return {"name": name, "shape": shape, "dtype": dtype, "group": name.split(".")[0], "chunks": chunks}


def _index(rank: int, world: int, tensors: list[dict], files: list[str]) -> dict:
    return {"rank": rank, "world_size": world, "tensors": tensors, "files": files}


def _rows(lo: int, hi: int) -> bytes:
    return FULL[lo:hi].contiguous().numpy().tobytes()


class Env:
    """The module's server, and this test's own run with ``<run>/1`` committed (step 1)."""

    def __init__(self, srv: ServerProcess) -> None:
        self.srv, self.root, self.run = srv, Path(srv.root), f"c{next(_runs)}"
        self.http = httpx.Client(base_url=srv.url, timeout=60)
        self.client = CheckpointClient(srv.url, retry_seconds=5)
        self.sd1 = make_state(1)
        assert self.client.save(self.sd1, f"{self.run}/1").wait(timeout=60).state == "committed"

    def close(self) -> None:
        self.http.close()
        self.client.close(wait=False)

    def open(self, name: str, sid: str, world: int) -> None:
        r = self.http.post(f"/v1/checkpoints/{self.run}/{name}/sessions",
                           json={"session": sid, "world_size": world, "step": int(name)})
        assert r.status_code == 200, r.text

    def upload(self, name: str, sid: str, file: str, data: bytes) -> None:
        r = self.http.put(f"/v1/checkpoints/{self.run}/{name}/sessions/{sid}/files/{file}", content=data,
                          headers={"X-Ckptd-Xxh3": h(data)})
        assert r.status_code == 200, r.text

    def put_index(self, name: str, sid: str, index: dict) -> httpx.Response:
        return self.http.put(f"/v1/checkpoints/{self.run}/{name}/sessions/{sid}/ranks/{index['rank']}",
                             content=json.dumps(index).encode(), headers={"Content-Type": "application/json"})

    def refused(self, r: httpx.Response, code: str, *phrases: str) -> dict:
        assert r.status_code == 422, f"{r.status_code} {r.text}"
        err = r.json()["error"]
        assert err["code"] == code, err
        assert "refused at commit" in err["message"], err
        for p in phrases:
            assert p in err["message"], (p, err["message"])
        return err

    def assert_invisible(self, name: str, sid: str) -> None:
        """Nothing of ``name`` is visible; the session is failed; ``<run>/1`` is latest and loads."""
        assert not (self.root / "runs" / self.run / name / "COMMITTED").exists()
        st = self.http.get(f"/v1/checkpoints/{self.run}/{name}/sessions/{sid}")
        assert st.status_code == 200 and st.json()["state"] == "failed", st.text
        listed = self.http.get(f"/v1/runs/{self.run}/checkpoints")
        assert listed.status_code == 200 and [c["name"] for c in listed.json()] == ["1"], listed.text
        assert self.http.get(f"/v1/checkpoints/{self.run}/{name}").status_code == 404
        latest = self.http.get(f"/v1/checkpoints/{self.run}/latest")
        assert latest.status_code == 200 and latest.headers["x-ckptd-name"] == "1", latest.headers
        got = blank_like(self.sd1)
        self.client.load(got, f"{self.run}/latest")
        assert_bits_equal(got, self.sd1)


# -- (a, e) chunk digests that are not the hash of the chunk's bytes -------------------------------------

@pytest.mark.parametrize("case", ["other-bytes", "padding", "overlap"])
def test_chunk_digests_not_of_the_stored_bytes_are_refused(env, case):
    """Every file is uploaded with its right digest; rank 1's index lies about its chunk: a digest of
    bytes it never stored, or a chunk placed on padding or on rank 1's other chunk's bytes."""
    a, b = _rows(0, 2), _rows(2, 4)
    env.open("2", "s", 2)
    env.upload("2", "s", "r0.bin", a)
    r0 = _index(0, 2, [_tensor(W, [4, 3], [_chunk(0, "r0.bin", a, offsets=[0, 0], sizes=[2, 3])])], ["r0.bin"])
    if case == "other-bytes":  # stores b, declares the digest of other bytes of the same length
        stored, chunks = b, [_chunk(1, "r1.bin", b, digest=h(bytes(reversed(b))), offsets=[2, 0], sizes=[2, 3])]
        tensors = [_tensor(W, [4, 3], chunks)]
    elif case == "padding":  # the chunk points at the zeros after the data, with the data's digest
        stored = b + bytes(len(b))
        tensors = [_tensor(W, [4, 3], [_chunk(1, "r1.bin", b, offset=len(b), offsets=[2, 0], sizes=[2, 3])])]
    else:  # a second tensor placed on the first one's bytes, declaring its own (other) bytes' digest
        stored = b
        other = torch.ones(2, 3).numpy().tobytes()
        tensors = [_tensor(W, [4, 3], [_chunk(1, "r1.bin", b, offsets=[2, 0], sizes=[2, 3])]),
                   _tensor("model.v", [2, 3], [_chunk(1, "r1.bin", other, offsets=[0, 0], sizes=[2, 3])])]
    env.upload("2", "s", "r1.bin", stored)
    assert env.put_index("2", "s", r0).json()["state"] == "open"
    r = env.put_index("2", "s", _index(1, 2, tensors, ["r1.bin"]))
    name = "model.v" if case == "overlap" else W
    err = env.refused(r, "checksum_mismatch", f"tensor '{name}' (rank 1)", "'r1.bin'", "hash to")
    assert err["details"]["tensor"] == name and err["details"]["rank"] == 1 and err["details"]["file"] == "r1.bin"
    env.assert_invisible("2", "s")


# -- (b) replicas: one digest, different bytes -------------------------------------------------------------

def test_replicas_with_one_digest_but_different_bytes_are_refused(env):
    """Ranks 0 and 1 both store the whole tensor as replicas. Their bytes differ but have the same
    XXH3-64, so each chunk's digest is right and ``ckptd verify`` alone would pass the checkpoint;
    a reader would get either value depending on which replica it reads."""
    a, b = xxh3_collision()
    env.open("2", "s", 2)
    for r, data in ((0, a), (1, b)):
        env.upload("2", "s", f"r{r}.bin", data)
    ix = [_index(r, 2, [_tensor("model.b", [4], [_chunk(r, f"r{r}.bin", data, offsets=[0], sizes=[4])])],
                 [f"r{r}.bin"]) for r, data in ((0, a), (1, b))]
    assert env.put_index("2", "s", ix[0]).json()["state"] == "open"
    err = env.refused(env.put_index("2", "s", ix[1]), "integrity", "tensor 'model.b'", "ranks [0, 1]",
                      "bytes differ")
    assert err["details"]["tensor"] == "model.b" and err["details"]["ranks"] == [0, 1]
    env.assert_invisible("2", "s")


# -- (c) compressed chunks whose length is false ------------------------------------------------------------

def _frame(raw: bytes, *, window_log: int | None = None) -> bytes:
    """A zstd frame of ``raw``; with a window smaller than ``raw`` its header has a 4-byte content size."""
    params = zstandard.ZstdCompressionParameters.from_level(1, window_log=window_log) if window_log else None
    c = zstandard.ZstdCompressor(compression_params=params) if params else zstandard.ZstdCompressor(level=1)
    return c.compress(raw)


def _with_content_size(frame: bytes, size: int) -> bytes:
    """``frame`` with the content size in its header replaced (the field keeps its width)."""
    fhd = frame[4]
    single, fcs_flag, dict_flag = (fhd >> 5) & 1, fhd >> 6, fhd & 3
    width = (1 if single else 0, 2, 4, 8)[fcs_flag]
    assert width >= 4, "the field must be able to hold any size"
    at = 5 + (0 if single else 1) + (0, 1, 2, 4)[dict_flag]
    return frame[:at] + size.to_bytes(width, "little") + frame[at + width:]


@pytest.mark.parametrize("case", ["larger", "smaller", "decodes-to-more", "bomb"])
def test_compressed_chunks_of_the_wrong_length_are_refused(env, case):
    """Rank 0's 2 x 3 piece of a float32 tensor holds 24 bytes; its zstd frame holds more (or fewer),
    or declares 24 in its header and decodes to more: 256 MiB from 8 KiB for the bomb, which the
    service decodes in bounded memory and stops at once."""
    piece = _rows(0, 2)
    if case == "larger":
        frame = _frame(piece + b"\0" * 8)
    elif case == "smaller":
        frame = _frame(piece[:16])
    elif case == "decodes-to-more":
        frame = _with_content_size(_frame(piece * 3000, window_log=10), len(piece))
    else:
        frame = _with_content_size(_frame(bytes(256 << 20), window_log=20), len(piece))
    assert len(frame) < 64 << 10
    env.open("2", "s", 1)
    env.upload("2", "s", "r0.bin", frame + _rows(2, 4))
    chunks = [_chunk(0, "r0.bin", frame, codec="zstd", raw_length=len(piece), offsets=[0, 0], sizes=[2, 3]),
              _chunk(0, "r0.bin", _rows(2, 4), offset=len(frame), offsets=[2, 0], sizes=[2, 3])]
    r = env.put_index("2", "s", _index(0, 1, [_tensor(W, [4, 3], chunks)], ["r0.bin"]))
    want = {"larger": "declares content size 32", "smaller": "declares content size 16"}.get(case, "zstd frame")
    err = env.refused(r, "integrity", f"tensor '{W}' (rank 0)", "'r0.bin'", want)
    if case in ("decodes-to-more", "bomb"):  # stopped by the output bound, or by libzstd on the way
        assert "decodes to more than the 24 bytes" in err["message"] or "does not decode" in err["message"], err
    assert err["details"] == {"tensor": W, "rank": 0, "file": "r0.bin"}
    env.assert_invisible("2", "s")


def test_an_honest_compressed_chunk_commits(env):
    """The same layout with a true frame commits, loads and is the latest."""
    frame = _frame(_rows(0, 2))
    env.open("2", "s", 1)
    env.upload("2", "s", "r0.bin", frame + _rows(2, 4))
    chunks = [_chunk(0, "r0.bin", frame, codec="zstd", raw_length=24, offsets=[0, 0], sizes=[2, 3]),
              _chunk(0, "r0.bin", _rows(2, 4), offset=len(frame), offsets=[2, 0], sizes=[2, 3])]
    r = env.put_index("2", "s", _index(0, 1, [_tensor(W, [4, 3], chunks)], ["r0.bin"]))
    assert r.status_code == 200 and r.json()["state"] == "committed", r.text
    got = {"model": {"w": torch.zeros(4, 3)}}
    env.client.load(got, f"{env.run}/latest")
    assert torch.equal(got["model"]["w"], FULL)


# == indexes and files that lie in ways the attacks above do not try =========================================

_SECRET = bytes.fromhex(  # the first 56 bytes of XXH3's default secret
    "b8fe6c3923a44bbe7c01812cf721ad1cded46de9839097db7240a4a4b7b3671fcb79e64eccc0e578825ad07dccff7221b808467"
    "4f743248e")


def _q(at: int) -> int:
    return struct.unpack_from("<Q", _SECRET, at)[0]


def xxh3_16_24_collision() -> tuple[bytes, bytes]:
    """A 24-byte and a 16-byte string with one XXH3-64, no search. 17-128 bytes: ``len * P1 +
    mix16(in[0:16], s[0:16]) + mix16(in[8:24], s[16:32])``, and ``mix16`` is ``fold(lo ^ s, hi ^ s')``:
    with ``in[0:8] = s[0:8]`` and ``in[8:16] = s[16:24]`` both folds are 0, leaving ``24 * P1``.
    9-16 bytes: ``len + swap(lo) + hi + fold(lo, hi)`` with ``lo = 0`` is ``16 + hi``."""
    m, p1 = (1 << 64) - 1, 0x9E3779B185EBCA87
    long = struct.pack("<QQQ", _q(0), _q(16), 0x3F800000_3F800000)
    short = struct.pack("<QQ", _q(24) ^ _q(32), ((24 * p1 - 16) & m) ^ (_q(40) ^ _q(48)))
    assert h(long) == h(short)
    return long, short


def verify_root(env: Env, ref: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ckptd.cli.main", "verify", ref, "--root", str(env.root)],
                          capture_output=True, text=True, cwd=REPO, timeout=120)


def assert_committed_and_verified(env: Env, r, name: str = "2") -> None:
    assert r.status_code == 200 and r.json()["state"] == "committed", r.text
    p = verify_root(env, f"{env.run}/{name}")
    assert p.returncode == 0, p.stdout + p.stderr


# -- zstd chunks that are not exactly one plain frame -------------------------------------------------------

def _skippable(n: int = 8) -> bytes:
    return struct.pack("<II", 0x184D2A50, n) + bytes(n)


def _frame_variant(case: str, piece: bytes) -> bytes:
    one = _frame(piece)
    if case == "skippable-before":
        return _skippable() + one
    if case == "skippable-after":
        return one + _skippable()
    if case == "two-frames":
        return _frame(piece[:12]) + _frame(piece[12:])
    if case == "no-content-size":
        return zstandard.ZstdCompressor(level=1, write_content_size=False).compress(piece)
    if case == "dictionary":
        samples = [bytes((i * 7 + j * j) % 9 + 97 for j in range(200)) for i in range(300)]
        d = zstandard.train_dictionary(1024, samples)
        return zstandard.ZstdCompressor(level=1, dict_data=d).compress(piece)
    if case == "trailing-bytes":
        return one + b"\0\0\0\0"
    if case == "bad-checksum":
        f = zstandard.ZstdCompressor(level=1, write_checksum=True).compress(piece)
        return f[:-1] + bytes([f[-1] ^ 0xFF])
    raise AssertionError(case)


ZSTD_CASES = {
    "skippable-before": "not a zstd frame",
    "skippable-after": "bytes follow the end of the zstd frame",
    "two-frames": "declares content size 12",
    "no-content-size": "declares no content size",
    "dictionary": "needs dictionary",
    "trailing-bytes": "4 bytes follow the end of the zstd frame",
    "bad-checksum": "does not decode",
}


@pytest.mark.parametrize("case", sorted(ZSTD_CASES))
def test_a_compressed_chunk_that_is_not_one_plain_frame_is_refused(env, case):
    """Each stored chunk decodes (with a dictionary, across frames, past skippable frames) to the
    tensor piece or near it, and its digest is right: only the frame's structure is wrong."""
    piece = _rows(0, 2)
    frame = _frame_variant(case, piece)
    env.open("2", "s", 1)
    env.upload("2", "s", "r0.bin", frame + _rows(2, 4))
    chunks = [_chunk(0, "r0.bin", frame, codec="zstd", raw_length=len(piece), offsets=[0, 0], sizes=[2, 3]),
              _chunk(0, "r0.bin", _rows(2, 4), offset=len(frame), offsets=[2, 0], sizes=[2, 3])]
    r = env.put_index("2", "s", _index(0, 1, [_tensor(W, [4, 3], chunks)], ["r0.bin"]))
    err = env.refused(r, "integrity", f"tensor '{W}' (rank 0)", "'r0.bin'", ZSTD_CASES[case])
    assert err["details"] == {"tensor": W, "rank": 0, "file": "r0.bin"}
    env.assert_invisible("2", "s")


def _blosc2_variant(case: str, piece: bytes) -> bytes:
    import blosc2

    good = blosc2.compress2(piece, codec=blosc2.Codec.ZSTD, clevel=1, typesize=4,
                            filters=[blosc2.Filter.SHUFFLE], nthreads=1)
    if case == "header-says-more":  # the header's raw size doubled: a reader would allocate by it
        return blosc2.compress2(piece * 2, codec=blosc2.Codec.ZSTD, clevel=1, typesize=4,
                                filters=[blosc2.Filter.SHUFFLE], nthreads=1)
    if case == "trailing-bytes":
        return good + b"\0\0\0\0"
    if case == "truncated":
        return good[:-3]
    if case == "garbage":
        return bytes(range(48))
    raise AssertionError(case)


BLOSC2_CASES = {
    "header-says-more": "Blosc2 frame",
    "trailing-bytes": "Blosc2 frame",
    "truncated": "Blosc2 frame",
    "garbage": "Blosc2 frame",
}


@pytest.mark.parametrize("case", sorted(BLOSC2_CASES))
def test_a_byte_plane_chunk_that_is_not_one_exact_blosc2_frame_is_refused(env, case):
    """A blosc2 (byte-plane) chunk whose digest is right but whose frame is not exactly one Blosc2
    chunk of the piece's size is refused at commit, before any header is trusted for memory."""
    piece = _rows(0, 2)
    frame = _blosc2_variant(case, piece)
    env.open("2", "s", 1)
    env.upload("2", "s", "r0.bin", frame + _rows(2, 4))
    chunks = [_chunk(0, "r0.bin", frame, codec="blosc2", raw_length=len(piece), offsets=[0, 0], sizes=[2, 3]),
              _chunk(0, "r0.bin", _rows(2, 4), offset=len(frame), offsets=[2, 0], sizes=[2, 3])]
    r = env.put_index("2", "s", _index(0, 1, [_tensor(W, [4, 3], chunks)], ["r0.bin"]))
    env.refused(r, "integrity", f"tensor '{W}' (rank 0)", "'r0.bin'", BLOSC2_CASES[case])
    env.assert_invisible("2", "s")


def test_an_honest_blosc2_chunk_commits_verifies_and_loads(env):
    import blosc2

    piece = _rows(0, 2)
    frame = blosc2.compress2(piece, codec=blosc2.Codec.ZSTD, clevel=1, typesize=4,
                             filters=[blosc2.Filter.SHUFFLE], nthreads=1)
    env.open("2", "s", 1)
    env.upload("2", "s", "r0.bin", frame + _rows(2, 4))
    chunks = [_chunk(0, "r0.bin", frame, codec="blosc2", raw_length=len(piece), offsets=[0, 0], sizes=[2, 3]),
              _chunk(0, "r0.bin", _rows(2, 4), offset=len(frame), offsets=[2, 0], sizes=[2, 3])]
    r = env.put_index("2", "s", _index(0, 1, [_tensor(W, [4, 3], chunks)], ["r0.bin"]))
    assert_committed_and_verified(env, r)


# -- stored objects that lie ----------------------------------------------------------------------------

def _object(name: str, file: str, stored: bytes, *, offset: int = 0, codec: str = "raw",
            raw_length: int | None = None, digest: str | None = None) -> dict:
    return {"name": name, "encoding": "torch", "location": {
        "file": file, "offset": offset, "length": len(stored), "codec": codec,
        "raw_length": len(stored) if raw_length is None else raw_length, "xxh3": digest or h(stored)}}


@pytest.mark.parametrize("case", ["digest", "zstd-decodes-to-more", "zstd-header-lies"])
def test_a_stored_object_whose_digest_or_frame_lies_is_refused(env, case):
    """The tensor is honest; the object beside it in the same file is not."""
    import io

    buf = io.BytesIO()
    torch.save({"epoch": 3}, buf)
    payload = buf.getvalue()
    data = _rows(0, 4)
    if case == "digest":
        stored, obj = payload, _object("extra.state", "r0.bin", payload, offset=len(data),
                                       digest=h(payload[::-1]))
    elif case == "zstd-decodes-to-more":  # the header says raw_length, the frame holds twice as much
        frame = _frame(payload * 2, window_log=10)
        fhd = frame[4]
        assert fhd >> 6 in (1, 2) and not (fhd >> 5) & 1
        at, width = 6, (2, 4)[(fhd >> 6) - 1]
        stored = frame[:at] + (len(payload) - (256 if width == 2 else 0)).to_bytes(width, "little") + frame[at + width:]
        obj = _object("extra.state", "r0.bin", stored, offset=len(data), codec="zstd", raw_length=len(payload))
    else:  # an honest frame of the payload, declared as holding fewer bytes
        stored = _frame(payload)
        obj = _object("extra.state", "r0.bin", stored, offset=len(data), codec="zstd", raw_length=len(payload) - 1)
    env.open("2", "s", 1)
    env.upload("2", "s", "r0.bin", data + stored)
    ix = _index(0, 1, [_tensor(W, [4, 3], [_chunk(0, "r0.bin", data, offsets=[0, 0], sizes=[4, 3])])], ["r0.bin"])
    ix["objects"] = [obj]
    r = env.put_index("2", "s", ix)
    code = "checksum_mismatch" if case == "digest" else "integrity"
    err = env.refused(r, code, "object 'extra.state'", "'r0.bin'")
    assert err["details"]["object"] == "extra.state" and err["details"]["file"] == "r0.bin", err
    env.assert_invisible("2", "s")


# -- replicas the tiling accepts that the byte comparison must see ------------------------------------------

@pytest.mark.parametrize("case", ["flat-and-box", "box-inside-flat"])
def test_replicas_that_only_the_tiling_pairs_must_hold_the_same_bytes(env, case):
    """The tiling counts a region once when two chunks cover the same elements with one digest, whether
    a chunk is a flat range or a box, and box by box. ``flat-and-box``: rank 0 stores a 4-element
    tensor as a flat range, rank 1 as a box, with an XXH3-64 collision between their bytes.
    ``box-inside-flat``: rank 0's flat range covers row 0 and half of row 1; rank 1's box is row 0
    alone, with a 16-byte string that collides with rank 0's 24 bytes; rank 1 adds the rest of row 1.
    Either way each chunk's digest is right, so ``ckptd verify`` passes, and a reader gets different
    values for the same elements depending on which chunk it reads."""
    env.open("2", "s", 2)
    if case == "flat-and-box":
        a, b = xxh3_collision()
        shape = [4]
        c0 = [_chunk(0, "r0.bin", a, start=0, length=4)]
        c1 = [_chunk(1, "r1.bin", b, offsets=[0], sizes=[4])]
        d0, d1 = a, b
    else:
        long, short = xxh3_16_24_collision()
        rest = torch.ones(2).numpy().tobytes()
        shape = [2, 4]
        c0 = [_chunk(0, "r0.bin", long, start=0, length=6)]
        c1 = [_chunk(1, "r1.bin", short, offsets=[0, 0], sizes=[1, 4]),
              _chunk(1, "r1.bin", rest, offset=len(short), offsets=[1, 2], sizes=[1, 2])]
        d0, d1 = long, short + rest
    env.upload("2", "s", "r0.bin", d0)
    env.upload("2", "s", "r1.bin", d1)
    assert env.put_index("2", "s", _index(0, 2, [_tensor("model.b", shape, c0)], ["r0.bin"])).json()["state"] == "open"
    r = env.put_index("2", "s", _index(1, 2, [_tensor("model.b", shape, c1)], ["r1.bin"]))
    why = "bytes differ" if case == "flat-and-box" else "only chunks of the same elements can be replicas"
    err = env.refused(r, "integrity", "tensor 'model.b'", "ranks [0, 1]", why)
    assert err["details"]["tensor"] == "model.b" and err["details"]["ranks"] == [0, 1], err
    env.assert_invisible("2", "s")


# -- files that are not the rank's own ------------------------------------------------------------------

@pytest.mark.parametrize("case", ["listed-by-two-ranks", "not-listed-by-its-rank"])
def test_a_file_claimed_by_two_ranks_or_by_none_is_refused(env, case):
    """Rank 1 points its chunk into rank 0's file: listing it as its own too, or without listing it."""
    a, b = _rows(0, 2), _rows(2, 4)
    env.open("2", "s", 2)
    env.upload("2", "s", "r0.bin", a + b)
    r0 = _index(0, 2, [_tensor(W, [4, 3], [_chunk(0, "r0.bin", a, offsets=[0, 0], sizes=[2, 3])])], ["r0.bin"])
    files = ["r0.bin"] if case == "listed-by-two-ranks" else []
    r1 = _index(1, 2, [_tensor(W, [4, 3], [_chunk(1, "r0.bin", b, offset=len(a), offsets=[2, 0], sizes=[2, 3])])],
                files)
    assert env.put_index("2", "s", r0).json()["state"] == "open"
    r = env.put_index("2", "s", r1)
    assert r.status_code == 422 and r.json()["error"]["code"] == "invalid_index", r.text
    err = r.json()["error"]
    assert "'r0.bin'" in err["message"] and err["details"]["file"] == "r0.bin", err
    if case == "listed-by-two-ranks":
        assert "claimed by ranks 0 and 1" in err["message"], err
        env.assert_invisible("2", "s")
    else:  # refused before it is stored: the session stays open, nothing visible
        assert "not among its files" in err["message"], err
        assert not (env.root / "runs" / env.run / "2" / "COMMITTED").exists()


# -- odd but honest layouts: they commit, and verify passes -------------------------------------------------

@pytest.mark.parametrize("case", ["empty-tensors", "two-tensors-on-one-range", "unreferenced-file",
                                  "index-replaced"])
def test_odd_but_honest_layouts_commit_verify_and_load(env, case):
    """``empty-tensors``: a 0 x 3 tensor with an empty raw chunk and a 0-element one with an empty zstd
    frame, between two chunks of ``W``; ``two-tensors-on-one-range``: ``model.v`` is stored on the very
    bytes of ``W``; ``unreferenced-file``: a file uploaded but in no index (not in the manifest);
    ``index-replaced``: rank 0's first index (pointing at other bytes) is replaced before rank 1's
    arrives, and the commit takes the second."""
    a, b = _rows(0, 2), _rows(2, 4)
    want = {W: FULL}
    world = 2 if case == "index-replaced" else 1
    env.open("2", "s", world)
    if case == "empty-tensors":
        empty = _frame(b"")
        env.upload("2", "s", "r0.bin", a + empty + b)
        tensors = [_tensor(W, [4, 3], [_chunk(0, "r0.bin", a, offsets=[0, 0], sizes=[2, 3]),
                                       _chunk(0, "r0.bin", b, offset=len(a) + len(empty), offsets=[2, 0],
                                              sizes=[2, 3])]),
                   _tensor("model.e", [0, 3], [_chunk(0, "r0.bin", b"", offset=len(a), offsets=[0, 0], sizes=[0, 3])]),
                   _tensor("model.z", [0], [_chunk(0, "r0.bin", empty, offset=len(a), codec="zstd", raw_length=0,
                                                   offsets=[0], sizes=[0])])]
        want.update({"model.e": torch.zeros(0, 3), "model.z": torch.zeros(0)})
    elif case == "two-tensors-on-one-range":
        env.upload("2", "s", "r0.bin", a + b)
        tensors = [_tensor(W, [4, 3], [_chunk(0, "r0.bin", a + b, offsets=[0, 0], sizes=[4, 3])]),
                   _tensor("model.v", [12], [_chunk(0, "r0.bin", a + b, offsets=[0], sizes=[12])])]
        want["model.v"] = FULL.reshape(12)
    elif case == "unreferenced-file":
        env.upload("2", "s", "r0.bin", a + b)
        env.upload("2", "s", "stray.bin", b"not part of the checkpoint")
        tensors = [_tensor(W, [4, 3], [_chunk(0, "r0.bin", a + b, offsets=[0, 0], sizes=[4, 3])])]
    else:
        env.upload("2", "s", "r0.bin", b + a)  # the first index reads it in the wrong order
        env.upload("2", "s", "r1.bin", b)
        first = _index(0, 2, [_tensor(W, [4, 3], [_chunk(0, "r0.bin", b, offsets=[0, 0], sizes=[2, 3])])], ["r0.bin"])
        assert env.put_index("2", "s", first).json()["state"] == "open"
        tensors = [_tensor(W, [4, 3], [_chunk(0, "r0.bin", a, offset=len(b), offsets=[0, 0], sizes=[2, 3])])]
        assert env.put_index("2", "s", _index(0, 2, tensors, ["r0.bin"])).json()["state"] == "open"
        r = env.put_index("2", "s", _index(1, 2, [_tensor(W, [4, 3], [_chunk(1, "r1.bin", b, offsets=[2, 0],
                                                                              sizes=[2, 3])])], ["r1.bin"]))
    if case != "index-replaced":
        r = env.put_index("2", "s", _index(0, 1, tensors, ["r0.bin"]))
    assert_committed_and_verified(env, r)
    m = env.client.manifest(f"{env.run}/2")
    assert sorted(m.files) == (["r0.bin", "r1.bin"] if case == "index-replaced" else ["r0.bin"])
    got: dict = {}
    for k, v in want.items():
        got.setdefault(k.split(".")[0], {})[k.split(".")[1]] = torch.full_like(v, 7)
    env.client.load(got, f"{env.run}/2")
    for k, v in want.items():
        assert torch.equal(got[k.split(".")[0]][k.split(".")[1]], v), k


# -- a tensor's declared layout-independent digest ------------------------------------------------------------

@pytest.mark.parametrize("case", ["false", "true"])
def test_a_rank_index_may_not_declare_a_tensor_digest(env, case):
    """A rank declares ``W``'s layout-independent digest (``TensorEntry.digest``, which a reshard
    compares its output with and an export checks what it assembles against). A false one, on
    intact bytes, would commit a checkpoint ``ckptd verify`` passes and ``ckptd export`` and
    ``ckptd reshard`` call corrupt. Only the service's own conversions record the digest, so the
    claim is refused at the index, true or false, naming the tensor and rank; the session stays open
    and takes the same index without the claim."""
    from ckptd_schemas.digest import StreamHasher

    true = StreamHasher()
    true.update(memoryview(_rows(0, 4)))
    digest = true.hexdigest() if case == "true" else h(b"some other tensor")
    env.open("2", "s", 2)
    ix, honest = [], []
    for r in (0, 1):
        data = _rows(2 * r, 2 * r + 2)
        env.upload("2", "s", f"r{r}.bin", data)
        t = _tensor(W, [4, 3], [_chunk(r, f"r{r}.bin", data, offsets=[2 * r, 0], sizes=[2, 3])])
        ix.append(_index(r, 2, [{**t, "digest": digest}], [f"r{r}.bin"]))
        honest.append(_index(r, 2, [t], [f"r{r}.bin"]))
    for r in (0, 1):
        got = env.put_index("2", "s", ix[r])
        assert got.status_code == 422, got.text
        err = got.json()["error"]
        assert err["code"] == "invalid_index" and f"tensor '{W}'" in err["message"], err
        assert err["details"]["tensor"] == W and err["details"]["rank"] == r, err
    assert not (env.root / "runs" / env.run / "2" / "COMMITTED").exists()
    assert env.put_index("2", "s", honest[0]).json()["state"] == "open"
    assert_committed_and_verified(env, env.put_index("2", "s", honest[1]))
