"""Piecewise layout-independent digests: any pieces, any order, overlaps -> the stream's digest;
a gap -> no digest; and the reshard executor checks with them without reading the data again."""

from __future__ import annotations

import random
import subprocess
import sys
import uuid

import pytest
import torch
import xxhash
from hypothesis import given, settings, strategies as st

import ckptd.reshard.executor as ex
from ckptd.reshard.digest import tensor_digest
from ckptd_schemas.format.engines import HostEngine, TorchEngine
from ckptd.reshard.pieces import SLICE, write_hashed
from ckptd.reshard.planner import outline_reshard
from ckptd.reshard.spec import parse_spec
from ckptd.storage import LocalStorage
from ckptd.store import CheckpointReader, SessionStore
from stored_tensors import read_tensor, write_tensors
from ckptd_schemas import IntegrityError
from ckptd_schemas.digest import DIGEST_BLOCK, DigestPart, Edge, StreamHasher, combine, digest_of_blocks, digest_piece

B = DIGEST_BLOCK


def _reference(data: bytes) -> str:
    """The definition, written out: XXH3-64 over the blocks' XXH3-64 values (8 bytes, little-endian)."""
    values = [xxhash.xxh3_64_intdigest(data[a:a + B]) for a in range(0, len(data), B)]
    return xxhash.xxh3_64_hexdigest(b"".join(v.to_bytes(8, "little") for v in values))


def _reference_part(n: int, offset: int, data: bytes, file_offset: int) -> DigestPart:
    """The definition of a piece's part, walked block by block: a block is whole when the piece covers it
    from its start to its end (the stream's last block may be short); any other overlap is an edge."""
    end = offset + len(data)
    blocks, edges, first = [], [], 0
    for i in range(offset // B, -(-end // B)):
        a, b = max(i * B, offset), min((i + 1) * B, n, end)
        if a == i * B and b == min((i + 1) * B, n):
            first = first if blocks else i
            blocks.append(xxhash.xxh3_64_intdigest(data[a - offset:b - offset]))
        elif b > a:
            edges.append(Edge(block=i, at=a - i * B, length=b - a, file="f", file_offset=file_offset + a - offset))
    return DigestPart(side="s", tensor="t", first=first, blocks=blocks, edges=edges)


def _pieces(n: int, rnd: random.Random, overlap: bool) -> list[tuple[int, int]]:
    cuts = sorted({0, n, *(rnd.randrange(n + 1) for _ in range(rnd.randrange(6)))})
    out = list(zip(cuts, cuts[1:]))
    if overlap and n:
        out += [(a, min(n, a + rnd.randrange(1, 3 * B))) for a in (rnd.randrange(n) for _ in range(3))]
    rnd.shuffle(out)
    return out


@settings(max_examples=60, deadline=None)
@given(n=st.sampled_from([0, 1, B - 1, B, B + 1, 3 * B + 17, 5 * B]), seed=st.integers(0, 10**6),
       overlap=st.booleans())
def test_any_pieces_in_any_order_give_the_streams_digest(n, seed, overlap):
    rnd = random.Random(seed)
    data = rnd.randbytes(n)
    file_base = 4096  # pieces live in a "file" at a shifted offset: edges are read back from there
    stored = bytes(file_base) + data
    parts = [digest_piece("s", "t", n, a, data[a:b], file="f", file_offset=file_base + a)
             for a, b in _pieces(n, rnd, overlap)]
    reads = []

    def read(side, file, a, b):
        assert (side, file) == ("s", "f")
        reads.append(b - a)
        return stored[a:b]

    got = combine(parts, {("s", "t"): n}, read)
    assert got == {("s", "t"): _reference(data)}
    assert sum(reads) <= 2 * B * len(parts)  # only ragged ends are read back
    h = StreamHasher()
    for a in range(0, n, 1000):
        h.update(data[a:a + 1000])
    assert h.hexdigest() == _reference(data)


@settings(max_examples=30, deadline=None)
@given(n=st.integers(2, 4 * B), seed=st.integers(0, 10**6))
def test_a_gap_gives_no_digest_and_a_changed_byte_another(n, seed):
    rnd = random.Random(seed)
    data = rnd.randbytes(n)
    hole = rnd.randrange(n)
    parts = [digest_piece("s", "t", n, 0, data[:hole], file="f", file_offset=0),
             digest_piece("s", "t", n, hole + 1, data[hole + 1:], file="f", file_offset=hole + 1)]
    assert combine(parts, {("s", "t"): n}, lambda s, f, a, b: data[a:b]) == {}
    flipped = bytearray(data)
    flipped[hole] ^= 1
    whole = [digest_piece("s", "t", n, 0, bytes(flipped), file="f", file_offset=0)]
    got = combine(whole, {("s", "t"): n}, lambda s, f, a, b: bytes(flipped[a:b]))
    assert got[("s", "t")] != _reference(data)


SIZES = [0, 1, B - 1, B, B + 1, 3 * B + 17, SLICE + 5 * B + 3]


@settings(max_examples=60, deadline=None)
@given(n=st.sampled_from(SIZES), seed=st.integers(0, 10**6))
def test_the_fast_paths_give_the_definitions_parts(n, seed):
    """``digest_piece`` (whole blocks found by arithmetic, hashed in one comprehension) gives the part the
    block-by-block definition gives, for any piece; ``write_hashed`` (hashing slice by slice as it writes)
    gives the same values, the same bytes written, the chunk's XXH3."""
    rnd = random.Random(seed)
    data = rnd.randbytes(n)
    a = rnd.randrange(n + 1)
    b = rnd.choice([n, rnd.randrange(a, n + 1)])
    want = _reference_part(n, a, data[a:b], 7 + a)
    assert digest_piece("s", "t", n, a, data[a:b], file="f", file_offset=7 + a) == want
    assert digest_piece("s", "t", n, a, memoryview(data)[a:b], file="f", file_offset=7 + a) == want
    written = []
    xxh3, values = write_hashed(written.append, memoryview(data)[a:b], (a, n))
    assert b"".join(written) == data[a:b] and xxh3 == xxhash.xxh3_64_hexdigest(data[a:b])
    assert all(len(w) <= SLICE for w in written)
    assert digest_piece("s", "t", n, a, data[a:b], file="f", file_offset=7 + a, values=values) == want
    xxh3, values = write_hashed(written.append, memoryview(data)[a:b], None)  # not one run: no blocks
    assert xxh3 == xxhash.xxh3_64_hexdigest(data[a:b]) and values == []


@settings(max_examples=30, deadline=None)
@given(n=st.sampled_from(SIZES[1:]), seed=st.integers(0, 10**6))
def test_one_flipped_bit_anywhere_changes_the_fast_paths_digest(n, seed):
    rnd = random.Random(seed)
    data = rnd.randbytes(n)
    flipped = bytearray(data)
    bit = rnd.randrange(8 * n)
    flipped[bit // 8] ^= 1 << (bit % 8)
    cut = rnd.randrange(n + 1)  # two pieces, as a reshard's two source chunks or two target chunks

    def digest(buf: bytes) -> str:
        parts = [digest_piece("s", "t", n, a, buf[a:b], file="f", file_offset=a) for a, b in ((0, cut), (cut, n))]
        return combine(parts, {("s", "t"): n}, lambda s, f, a, b: buf[a:b])[("s", "t")]

    assert digest(data) == _reference(data)
    assert digest(bytes(flipped)) != _reference(data)


def test_every_piece_at_block_bounds_gives_the_definitions_part():
    """Pieces starting and ending at, just before and just after block bounds, the stream's short last block
    included: edges, whole blocks and ``first`` as the block-by-block definition has them."""
    n = 3 * B + 17
    data = random.Random(0).randbytes(n)
    cuts = sorted({max(0, min(n, x + d)) for x in (0, B, 2 * B, 3 * B, n) for d in (-1, 0, 1)})
    for a in cuts:
        for b in (x for x in cuts if x >= a):
            got = digest_piece("s", "t", n, a, data[a:b], file="f", file_offset=a)
            assert got == _reference_part(n, a, data[a:b], a), (a, b)


def test_pieces_outside_the_stream_are_refused():
    with pytest.raises(ValueError, match="'w'"):
        digest_piece("s", "w", 10, 8, b"abc", file="f", file_offset=0)
    with pytest.raises(ValueError, match="1 whole blocks, 2 values"):
        digest_piece("s", "w", B, 0, bytes(B), file="f", file_offset=0, values=[1, 2])
    with pytest.raises(ValueError, match="0 whole blocks, 1 values"):
        digest_piece("s", "w", 2 * B, 1, bytes(B), file="f", file_offset=0, values=[1])
    assert digest_of_blocks([]) == xxhash.xxh3_64_hexdigest(b"")


def test_the_digest_module_needs_neither_torch_nor_numpy():
    """``ckptd_schemas`` installs with pydantic and xxhash only: the one digest implementation lives there."""
    code = ("import sys; import ckptd_schemas.digest as d; "
            "assert d.digest_piece('s', 't', 3, 0, b'abc', file='f', file_offset=0).blocks; "
            "bad = {'torch', 'numpy'} & set(sys.modules); assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.fixture()
def root(tmp_path):
    st_ = LocalStorage(tmp_path, durable=False)
    return st_, CheckpointReader(st_), SessionStore(st_)


def _state(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)  # several 64 KiB blocks per tensor, uneven over 3 and 2 ranks
    return {"model.a": torch.randn(517, 129, generator=g), "model.layers.0.mlp.down_proj.weight": torch.randn(301, 77, generator=g).bfloat16(),
            "optim.a.exp_avg": torch.randn(517, 129, generator=g), "model.norm": torch.randn(7, generator=g)}


def _convert(root, src: str, spec: str, monkeypatch, **kw) -> tuple[str, int]:
    _, reader, sessions = root
    walks = []
    real = ex.tensor_digest
    monkeypatch.setattr(ex, "tensor_digest", lambda m, t, *a, **k: walks.append(t.name) or real(m, t, *a, **k))
    plan = outline_reshard(reader.manifest(*src.split("/")), parse_spec(spec), **kw)
    out = f"{src.split('/')[0]}/{uuid.uuid4().hex[:8]}"
    ex.run_plan(reader, sessions, plan, out, uuid.uuid4().hex, device="cpu", jobs=2)
    return out, len(walks)


def test_row_layouts_are_checked_from_the_units_bytes_without_a_second_pass(root, monkeypatch):
    _, reader, sessions = root
    tensors = _state(1)
    write_tensors(sessions, "d/src", tensors, step=1)
    a, walks_a = _convert(root, "d/src", "fsdp2:dp=3", monkeypatch)
    b, walks_b = _convert(root, a, "zero3:dp=2,align=16", monkeypatch)
    c, walks_c = _convert(root, b, "full", monkeypatch)
    assert (walks_a, walks_b, walks_c) == (0, 0, 0)
    digests = {t.name: t.digest for t in reader.manifest(*c.split("/")).tensors}
    for name, t in tensors.items():
        assert torch.equal(read_tensor(reader, c, name), t), name
        assert digests[name] == _reference(t.contiguous().view(-1).view(torch.uint8).numpy().tobytes()), name
    # column shards are not row-major runs: those tensors fall back to the slab walk, and still agree
    d, walks_d = _convert(root, c, "tp=2", monkeypatch)
    assert walks_d > 0
    assert {t.name: t.digest for t in reader.manifest(*d.split("/")).tensors} == digests
    # a cast conversion: the source side is walked with the cast, the target side from the units
    e, _ = _convert(root, "d/src", "fsdp2:dp=2", monkeypatch, dtype="bfloat16")
    assert torch.equal(read_tensor(reader, e, "model.a"), tensors["model.a"].bfloat16())
    m = reader.manifest("d", "src")
    read = lambda f, a_, b_: reader.read_range("d", "src", f, a_, b_)
    assert tensor_digest(m, m.tensor("model.a"), read) == digests["model.a"]


class Corrupting:
    """An engine whose first target chunk (of at least ``least`` bytes) comes out with one bit flipped, after
    the source was verified."""

    def __init__(self, inner, least: int = 1) -> None:
        self.inner, self.name, self.hit, self.least = inner, "corrupting", [], least

    def running(self):
        return self.inner.running()

    def buffer(self, nbytes: int):
        inner, hit, least = self.inner.buffer(nbytes), self.hit, self.least

        class Buf:
            begin, copy = inner.begin, inner.copy

            def result(self, dtype: str):
                raw = inner.result(dtype)
                if not hit and len(raw) >= least:
                    hit.append(1)
                    raw[0] ^= 1
                return raw
        return Buf()


@pytest.mark.parametrize("engine", [HostEngine, lambda: TorchEngine("cpu")], ids=["host", "torch-cpu"])
def test_a_wrong_byte_in_assembly_fails_the_job_and_commits_nothing(root, engine):
    storage, reader, sessions = root
    write_tensors(sessions, "bad/src", _state(2), step=1)
    corrupting = Corrupting(engine())
    plan = outline_reshard(reader.manifest("bad", "src"), parse_spec("fsdp2:dp=2"))
    with pytest.raises(IntegrityError, match="digests differ"):
        ex.run_plan(reader, sessions, plan, "bad/out", uuid.uuid4().hex, engine=corrupting, jobs=2)
    hit = corrupting.hit
    assert hit and reader.marker("bad", "out") is None


def test_a_unit_hashes_each_small_source_chunk_once_however_often_its_block_is_fetched(tmp_path):
    """Many small tensors share a file's verification block, so every target chunk of a unit fetches the
    same block; the unit makes one digest part per source chunk in it, not one per fetch (it made 60 x 60
    here, and 3 GB of parts at 32 ranks x 200 tensors), and the conversion's digests still match."""
    st_ = LocalStorage(tmp_path, durable=False)
    reader, sessions = CheckpointReader(st_), SessionStore(st_)
    g = torch.Generator().manual_seed(11)
    tensors = {f"model.norm{i}.weight": torch.randn(8, generator=g) for i in range(60)}
    write_tensors(sessions, "small/1", tensors, step=1)
    m = reader.manifest("small", "1")
    outline = outline_reshard(m, parse_spec("fsdp2:dp=2"))
    plan = outline.plan()
    sid = uuid.uuid4().hex
    ex.open_target(sessions, plan, "small/dp2", sid)
    pieces = ex.source_pieces(reader, plan)
    for unit in plan.units:
        res = ex.run_unit(reader, plan, unit, lambda f: sessions.intake.receive("small", "dp2", sid, f),
                          engine=HostEngine(), pieces=pieces)
        src = [p for p in res.digests if p.side == "src"]
        assert len(src) <= len(tensors), (unit.index, len(src))
    sessions.sweeper.abort("small", "dp2", sid)
    out = "small/dp2-run"
    ex.run_plan(reader, sessions, outline, out, uuid.uuid4().hex, engine=HostEngine())
    for name, t in tensors.items():
        assert torch.equal(read_tensor(reader, out, name), t), name
