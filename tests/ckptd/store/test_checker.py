"""One checker: the commit and ``ckptd verify`` give the same verdict on the same stored bytes.

Unit tests of :mod:`ckptd.store.checker` over a real :class:`SessionStore` on a local
directory (no service): a session's files are uploaded honestly (raw chunks, replicas written by
two ranks, zstd frames, a stored object), then the stored bytes are damaged in one of many ways
before the last index arrives (a byte flipped, the file truncated or extended, a frame rewritten
without its content size, an empty frame appended, another frame or skippable frame after the
chunk, two replicas' bytes swapped for other bytes). The commit's verdict (committed, or refused)
must equal ``verify_manifest``'s over the merged manifest and the same bytes, for every damage
hypothesis draws, and every damage must be refused by both.
"""

from __future__ import annotations

import mmap
import struct

import pytest
import xxhash
import zstandard
from hypothesis import HealthCheck, given, settings, strategies as st

from ckptd.storage import LocalStorage
from ckptd.store.checker import StorageFiles
from ckptd.store.paths import Paths
from ckptd.store.rank_indexes import ranks_done
from ckptd.store.session_reads import read_meta
from ckptd.store.sessions import SessionStore
from ckptd.store.checker import verify_manifest
from ckptd.store.events import SessionEvents
from ckptd_schemas.arrival import Declared
from ckptd_schemas import ChecksumMismatch, CkptdError, CorruptCheckpoint, OpenSession, RankIndex
from ckptd_schemas.format.encoding import decode_frame

RAW = bytes(range(48))  # a 4 x 3 float32 tensor's bytes (any 48 bytes)
PIECE = RAW[:24]


def _h(b: bytes) -> str:
    return xxhash.xxh3_64_hexdigest(b)


def _frame(raw: bytes, *, content_size: bool = True) -> bytes:
    return zstandard.ZstdCompressor(level=1, write_content_size=content_size).compress(raw)


def _chunk(rank: int, file: str, stored: bytes, offset: int, codec: str = "raw", raw_length: int | None = None,
           **region) -> dict:
    return {"kind": "box", "rank": rank, **region,
            "location": {"file": file, "offset": offset, "length": len(stored), "codec": codec,
                         "raw_length": len(stored) if raw_length is None else raw_length, "xxh3": _h(stored)}}


def _layout(frame: bytes | None = None) -> tuple[dict[str, bytes], list[dict]]:
    """Two ranks: tensor ``model.w`` (4 x 3), rank 0 rows 0-1 as a zstd chunk (``frame``: one plain frame
    of them by default) and rows 2-3 raw; tensor ``model.r`` (2) replicated on both ranks; rank 1 also
    stores object ``sched``. Every digest is of the bytes placed."""
    frame = _frame(PIECE) if frame is None else frame
    rep = RAW[:8]
    obj = b'{"lr": 0.1}'
    f0 = frame + RAW[24:] + rep
    f1 = rep + obj
    w = {"name": "model.w", "shape": [4, 3], "dtype": "float32", "group": "model", "chunks": [
        _chunk(0, "r0.bin", frame, 0, "zstd", 24, offsets=[0, 0], sizes=[2, 3]),
        _chunk(0, "r0.bin", RAW[24:], len(frame), offsets=[2, 0], sizes=[2, 3])]}
    r = [{"name": "model.r", "shape": [2], "dtype": "float32", "group": "model",
          "chunks": [_chunk(rank, f, rep, off, offsets=[0], sizes=[2])]}
         for rank, f, off in ((0, "r0.bin", len(frame) + 24), (1, "r1.bin", 0))]
    i0 = {"rank": 0, "world_size": 2, "files": ["r0.bin"], "tensors": [w, r[0]]}
    i1 = {"rank": 1, "world_size": 2, "files": ["r1.bin"], "tensors": [r[1]],
          "objects": [{"name": "sched", "rank": 1, "encoding": "torch",
                       "location": {"file": "r1.bin", "offset": len(rep), "length": len(obj), "codec": "raw",
                                    "raw_length": len(obj), "xxh3": _h(obj)}}]}
    return {"r0.bin": f0, "r1.bin": f1}, [i0, i1]


#: zstd chunks that are not exactly one plain frame declaring its size (what ``verify`` once accepted)
FRAMES = {
    "no-content-size": lambda: _frame(PIECE, content_size=False),
    "empty-frame-after": lambda: _frame(PIECE) + _frame(b""),
    "skippable-after": lambda: _frame(PIECE) + struct.pack("<II", 0x184D2A50, 0),
    "two-frames": lambda: _frame(PIECE[:12]) + _frame(PIECE[12:]),
}


def _damage(kind: str, at: int, files: dict[str, bytes]) -> dict[str, bytes]:
    """``files`` as a root's editor left them after the upload; ``at`` picks the byte or file."""
    if kind in FRAMES:
        return _layout(FRAMES[kind]())[0]
    out = dict(files)
    name = sorted(out)[at % len(out)]
    data = bytearray(out[name])
    if kind == "flip":
        data[at % len(data)] ^= 1 << (at % 8)
    elif kind == "truncate":
        del data[max(1, len(data) - 1 - at % 8):]
    elif kind == "extend":
        data += b"\0" * (1 + at % 8)
    elif kind == "replica-swap":  # rank 1's replica holds other bytes of the same length
        name, data = "r1.bin", bytearray(bytes(8)) + bytearray(files["r1.bin"][8:])
    out[name] = bytes(data)
    return out


def _verdicts(tmp_path, uploaded: dict[str, bytes], indexes: list[dict],
              stored: dict[str, bytes] | None = None) -> tuple[bool, bool, str]:
    """(commit passed, verify passed, why): ``indexes`` committed over the ``uploaded`` files, which the
    root's editor replaced with ``stored`` after the upload (when given)."""
    store = SessionStore(LocalStorage(tmp_path))
    store.open("run", "2", OpenSession(session="s", world_size=2, step=2))
    for f, data in uploaded.items():
        sink = store.intake.receive("run", "2", "s", f)
        sink.write(data)
        sink.finish(_h(data))
    for f, data in (stored or {}).items():
        (tmp_path / Paths.file("run", "2", "s", f)).write_bytes(data)
    store.put_index("run", "2", "s", RankIndex.model_validate(indexes[0]))
    try:
        store.put_index("run", "2", "s", RankIndex.model_validate(indexes[1]))
        committed, why = True, ""
    except CkptdError as e:
        committed, why = False, e.message
    if not committed and 1 not in ranks_done(store.storage, "run", "2", "s", read_meta(store.storage, "run", "2", "s").created_at.isoformat()):
        return False, False, why  # refused before it was stored: nothing to verify
    manifest = store.committer.merged("run", "2", "s", read_meta(store.storage, "run", "2", "s"))[0]  # both indexes are stored

    class Source:  # as ``ckptd verify --root`` reads: a file of another size than recorded is damage
        def read(self, file: str, start: int, end: int) -> bytes:
            data = (tmp_path / Paths.file("run", "2", "s", file)).read_bytes()
            if len(data) != manifest.files[file].size:
                raise CorruptCheckpoint(f"file {file!r} holds {len(data)} bytes", file=file)
            return data[start:end]

    report = verify_manifest(manifest, Source().read)
    return committed, report.ok, why + " | " + "; ".join(report.problems)


def test_the_honest_layout_commits_and_verifies(tmp_path):
    files, indexes = _layout()
    assert _verdicts(tmp_path, files, indexes)[:2] == (True, True)


DAMAGES = ["flip", "truncate", "extend", "replica-swap", *FRAMES]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(kind=st.sampled_from(DAMAGES), at=st.integers(0, 10_000))
def test_commit_and_verify_agree_on_every_damage(tmp_path_factory, kind, at):
    """The index and the file records describe the honest bytes; the stored files are damaged."""
    files, indexes = _layout()
    committed, verified, why = _verdicts(tmp_path_factory.mktemp("d"), files, indexes, _damage(kind, at, files))
    assert committed == verified, why
    assert not committed, f"{kind} at {at} passed both: {why}"


@pytest.mark.parametrize("kind", sorted(FRAMES))
def test_frames_that_are_not_one_plain_frame_are_refused_by_both_even_with_true_digests(tmp_path, kind):
    """The writer declares the digests of exactly the bytes it stored: only the frame check can
    refuse them, and the commit and verify (one engine) both do."""
    files, indexes = _layout(FRAMES[kind]())
    committed, verified, why = _verdicts(tmp_path, files, indexes)
    assert (committed, verified) == (False, False), why
    assert "zstd" in why, why
    # and every reader (load, reshard, export decode through the same check) refuses the frame too
    with pytest.raises(ChecksumMismatch, match="zstd"):
        decode_frame(FRAMES[kind](), len(PIECE), "tensor 'model.w'")


def test_readers_decode_the_frames_the_checker_accepts():
    assert bytes(decode_frame(_frame(PIECE), len(PIECE), "tensor 'model.w'")) == PIECE
    assert bytes(decode_frame(_frame(b""), 0, "tensor 'model.e'")) == b""  # an empty tensor's frame



def _resident_pages(path: str) -> int:
    """Pages of ``path`` in the page cache: ``mincore`` over a private mapping of it, never written."""
    import ctypes
    import os

    size = os.path.getsize(path)
    pages = -(-size // mmap.PAGESIZE)
    libc = ctypes.CDLL(None, use_errno=True)
    with open(path, "rb") as f:
        m = mmap.mmap(f.fileno(), size, access=mmap.ACCESS_COPY)
        try:
            base = ctypes.c_char.from_buffer(m)
            vec = (ctypes.c_ubyte * pages)()
            rc = libc.mincore(ctypes.c_void_p(ctypes.addressof(base)), ctypes.c_size_t(size), vec)
            assert rc == 0, ctypes.get_errno()
            n = sum(v & 1 for v in vec)
            del base
        finally:
            m.close()
    return n


@pytest.mark.skipif(not hasattr(__import__("os"), "posix_fadvise"), reason="no posix_fadvise here")
def test_the_commit_keeps_linked_files_cached_and_drops_the_files_it_received(tmp_path):
    """After a file is checked, its pages leave the page cache (a checkpoint does not push the trainer's
    working set out), except a linked file's: every later save links it again and its commit reads it
    again, from memory."""
    storage = LocalStorage(tmp_path)
    files = StorageFiles(storage, lambda f: f"s/{f}", keep_cached=frozenset({"linked.bin"}))
    for f in ("new.bin", "linked.bin"):
        storage.put(f"s/{f}", b"x" * (4 << 20))
        with open(storage.local_path(f"s/{f}"), "rb") as fh:  # read: every page cached
            while fh.read(1 << 20):
                pass
        assert _resident_pages(storage.local_path(f"s/{f}")) > 0
        files.done(f, True)
    every = (4 << 20) // mmap.PAGESIZE
    assert _resident_pages(storage.local_path("s/linked.bin")) == every  # all kept
    assert _resident_pages(storage.local_path("s/new.bin")) < every


# -- the same checker on the bytes as they arrive ---------------------------------------------------------

def _declared(indexes: list[dict], file: str) -> list[Declared]:
    """The honest declaration of ``file``: every chunk and object its index places there."""
    out = []
    for ix in indexes:
        pieces = [("tensor", t["name"], c["location"]) for t in ix["tensors"] for c in t["chunks"]]
        pieces += [("object", o["name"], o["location"]) for o in ix.get("objects", ())]
        out += [Declared(loc["offset"], loc["length"], loc["xxh3"], loc["codec"], loc["raw_length"], kind, name)
                for kind, name, loc in pieces if loc["file"] == file]
    return out


def _arrival_verdict(tmp_path, uploaded: dict[str, bytes], indexes: list[dict],
                     stored: dict[str, bytes] | None = None) -> tuple[bool, int, str]:
    """(committed, bytes the commit read, why): ``uploaded`` sent with the honest declaration of each file
    (``_declared``), replaced with ``stored`` after their arrival (when given), then the indexes."""
    store = SessionStore(LocalStorage(tmp_path))
    store.open("run", "2", OpenSession(session="s", world_size=2, step=2))
    read: list[int] = []
    store.observers.add(type("Seen", (SessionEvents,), {"committed": lambda self, ev, s: read.append(ev.bytes_read)})())
    try:
        for f, data in uploaded.items():
            sink = store.intake.receive("run", "2", "s", f, declared=_declared(indexes, f))
            sink.write(data)
            sink.finish(_h(data))
    except CkptdError as e:
        return False, 0, f"on arrival: {e.message}"
    for f, data in (stored or {}).items():
        (tmp_path / Paths.file("run", "2", "s", f)).write_bytes(data)
    try:
        for ix in indexes:
            store.put_index("run", "2", "s", RankIndex.model_validate(ix))
    except CkptdError as e:
        return False, 0, f"at commit: {e.message}"
    return True, read[0], ""


def test_declared_files_commit_without_a_read_and_replicas_are_read(tmp_path):
    files, indexes = _layout()
    committed, nread, why = _arrival_verdict(tmp_path, files, indexes)
    assert committed, why
    assert nread == len(files["r0.bin"]) + len(files["r1.bin"])  # both hold a replica of model.r: compared by reading
    no_replica = [{**ix, "tensors": [t for t in ix["tensors"] if t["name"] != "model.r"]} for ix in indexes]
    committed, nread, why = _arrival_verdict(tmp_path / "b", files, no_replica)
    assert committed and nread == 0, (nread, why)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(kind=st.sampled_from(DAMAGES), at=st.integers(0, 10_000), after=st.booleans())
def test_every_damage_is_refused_on_arrival_or_at_the_commit(tmp_path_factory, kind, at, after):
    """The honest declaration and index; the bytes damaged as they are sent (``after`` False: the
    whole-file digest is of the damaged bytes, so only the chunk checks can see it) or once stored.
    A longer file sent whole is no damage (its record says its size), so only a stored one is."""
    files, indexes = _layout()
    damaged = _damage(kind, at, files)
    if not after and kind == "extend":
        return
    if kind in FRAMES:  # the honest index of the frames sent, as the writer of that frame declares it
        indexes = _layout(FRAMES[kind]())[1]
    sent, stored = (files, damaged) if after and kind not in FRAMES else (damaged, None)
    committed, _, why = _arrival_verdict(tmp_path_factory.mktemp("d"), sent, indexes, stored)
    assert not committed, f"{kind} at {at} ({'stored' if after else 'sent'}) passed"


@pytest.mark.parametrize("where", ["past", "across"])
def test_a_chunk_that_ends_past_its_file_is_refused_whatever_its_digest(tmp_path, where):
    """A row placed past the end of its file with the digest of nothing, or across the end with the
    digest of the part that is there: no digest vouches for bytes that are not stored. Declared so, it
    is refused on arrival; in an index, the merge refuses it before any byte is read."""
    files, indexes = _layout()
    size = len(files["r1.bin"])
    tail = b"" if where == "past" else files["r1.bin"][-3:]
    at = size + 100 if where == "past" else size - 3
    indexes[1]["objects"].append({"name": "ghost", "rank": 1, "encoding": "torch", "location": {
        "file": "r1.bin", "offset": at, "length": 8, "codec": "raw", "raw_length": 8, "xxh3": _h(tail)}})
    committed, _, why = _arrival_verdict(tmp_path / "b", files, indexes)
    assert not committed and why.startswith("on arrival") and "end past" in why, why
    committed, _, why = _verdicts(tmp_path / "a", files, indexes)
    assert not committed and "exceed file 'r1.bin'" in why, why
