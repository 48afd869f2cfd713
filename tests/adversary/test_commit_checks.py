"""Attacks on the commit: a writer with a valid token sends indexes and files that lie.

The promise (docs/guarantees.md §3): the commit accepts nothing it has not checked itself, so no
checkpoint becomes visible that ``ckptd verify`` would reject. Each attack goes over raw HTTP
(httpx) to a real ``ckptd serve``. Every refusal must be typed and name the tensor, rank or file; the
session is failed; nothing becomes visible (no ``COMMITTED``, not listed, ``RUN/latest`` still the
previous checkpoint); and the previous checkpoint still loads bit for bit.

Attacks: chunk digests that are not the hash of the chunk's bytes (the file's own digest right),
including chunks pointing at padding or into another chunk's bytes; replicas that share a digest
(a real XXH3-64 collision) but not their bytes; zstd chunks whose frame holds more or fewer bytes
than the tensor piece, or decodes to more than its header declares. Files that enter a session
other ways (linked, uploaded by URL) are attacked in ``test_ingest.py`` and ``test_ingest_s3.py``.
"""

from __future__ import annotations

import itertools
import json
import struct
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
import xxhash
import zstandard

from ckptd_client import CheckpointClient
from support import ServerProcess, assert_bits_equal, blank_like, make_state

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


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    base = tmp_path_factory.mktemp("commit-checks")
    srv = ServerProcess(base / "root", log=base / "server.log").start()
    yield srv
    srv.kill()


@pytest.fixture
def env(server):
    assert server.proc is not None and server.proc.poll() is None, "the module's server died in an earlier test"
    e = Env(server)
    yield e
    e.close()


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
