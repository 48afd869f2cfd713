"""``ckptd.store.intake``: every way a data file comes into a session ends in one record, created once.

Over a real local root, an ``Intake`` wired as the session store wires it (``staging.Parts``, 4 KiB
digest blocks), on sessions opened through the session store:

* received (``receive`` -> ``FileSink``): a stream whose digest matches is stored at its key with its
  record (size, XXH3, block digests) and marks the session active; one whose digest is wrong is
  refused (``ChecksumMismatch`` naming the file and both digests) and leaves no file, no record, no
  temp file; a second upload of a stored file answers as the first when its bytes are the same and is
  refused when they differ, leaving the stored bytes and record as they were;
* ``record_file``: a record is created once; the same again is fine, another is a ``Conflict``;
* every way (``receive``, ``presign``, ``place``) passes the one write gate first: a session never
  opened, committed or refused at its commit is refused with the gate's typed error, nothing stored;
* placed: ``presign`` is refused on a store without presigned uploads, ``place`` refuses a confirmation
  that matches no presign or this service's blocks;
* linked: ``check_link`` refuses a name that is not the source's ``linked_name`` and a link to the
  checkpoint itself; ``place`` with a link places a file of a visible, verified checkpoint of the run
  (a hard link, recorded as ``linked``, the session marked active) and refuses a source that is not
  visible or changed since its verification.
"""

from __future__ import annotations

import os

import pytest
import xxhash

from ckptd.storage import LocalStorage
from ckptd.store import SessionStore
from ckptd.store.intake import FileSink, check_link, record_file, recorded_file, stored_digest
from ckptd.store.paths import Paths
from ckptd_schemas import (
    AlreadyCommitted, ChecksumMismatch, ConfirmUpload, Conflict, FileEntry, InvalidName, InvalidRequest, LinkFile,
    PresignUpload, SessionConflict, SessionNotFound, linked_name,
)
from ckptd_schemas.filedigest import StreamDigest

from .staging import Parts, data, file_of, index, put_indexes, stage

BLOCK = 4096
PAYLOAD = bytes(range(256)) * 40  # 10,240 bytes: three 4 KiB blocks, the last one short
F = "r000000-0000.bin"


@pytest.fixture
def root(tmp_path):
    store = SessionStore(LocalStorage(tmp_path))
    stage(store, "r", "1", "s-a", ranks=[])  # open, no files yet
    return tmp_path, store, Parts(LocalStorage(tmp_path), block_size=BLOCK)


def _digest(payload: bytes, block: int = BLOCK) -> tuple[str, list[str]]:
    d = StreamDigest(block)
    d.update(payload)
    return d.finish()


def _session_files(tmp_path) -> list[str]:
    sdir = tmp_path / Paths.session("r", "1", "s-a")
    return sorted(str(p.relative_to(sdir)) for p in sdir.rglob("*") if p.is_file())


def test_a_stream_with_its_digest_is_stored_recorded_and_marks_the_session_active(root):
    tmp_path, _, parts = root
    sink = parts.intake.receive("r", "1", "s-a", F)
    assert isinstance(sink, FileSink) and parts.intake.receiving("r", "1", "s-a") == (1, 0)
    sink.write(PAYLOAD[:5000])
    sink.write_parts([PAYLOAD[5000:6000], memoryview(PAYLOAD)[6000:]])
    assert parts.intake.receiving("r", "1", "s-a") == (1, len(PAYLOAD))
    assert not (tmp_path / Paths.file("r", "1", "s-a", F)).exists()  # nothing visible before the finish
    whole, blocks = _digest(PAYLOAD)
    res = sink.finish(whole.upper())  # the declared digest in either case
    assert (res.file, res.size, res.xxh3) == (F, len(PAYLOAD), whole)
    assert (tmp_path / Paths.file("r", "1", "s-a", F)).read_bytes() == PAYLOAD
    assert recorded_file(parts.storage, "r", "1", "s-a", F) == FileEntry(size=len(PAYLOAD), xxh3=whole,
                                                                        block_size=BLOCK, blocks=blocks)
    assert len(blocks) == 3
    assert parts.activity.last("r", "1", "s-a") is not None
    assert sink.done and parts.intake.receiving("r", "1", "s-a") == (0, 0)
    assert stored_digest(parts.storage, Paths.file("r", "1", "s-a", F), BLOCK) == (len(PAYLOAD), whole, blocks)


def test_a_stream_whose_digest_is_wrong_is_refused_and_leaves_nothing(root):
    tmp_path, _, parts = root
    before = _session_files(tmp_path)
    sink = parts.intake.receive("r", "1", "s-a", F)
    sink.write(PAYLOAD[:-1] + b"\x00")  # one byte changed on the way
    declared = _digest(PAYLOAD)[0]
    with pytest.raises(ChecksumMismatch) as info:
        sink.finish(declared)
    e = info.value
    assert f"file {F!r}" in e.message and "the partial file was dropped" in e.message
    assert e.details == {"file": F, "declared": declared, "actual": _digest(PAYLOAD[:-1] + b"\x00")[0],
                         "size": len(PAYLOAD)}
    assert _session_files(tmp_path) == before  # no file, no record, no temp file
    assert recorded_file(parts.storage, "r", "1", "s-a", F) is None
    assert parts.activity.last("r", "1", "s-a") is None  # a refused write is no sign of life
    assert parts.intake.receiving("r", "1", "s-a") == (0, 0)
    sink.abort()  # after the refusal: nothing left to drop, no error


def test_an_aborted_stream_leaves_nothing(root):
    tmp_path, _, parts = root
    before = _session_files(tmp_path)
    sink = parts.intake.receive("r", "1", "s-a", F)
    sink.write(PAYLOAD)
    sink.abort()
    sink.abort()
    assert sink.done and _session_files(tmp_path) == before
    assert parts.intake.receiving("r", "1", "s-a") == (0, 0)


def _upload(parts: Parts, payload: bytes, file: str = F):
    sink = parts.intake.receive("r", "1", "s-a", file)
    sink.write(payload)
    return sink.finish(_digest(payload)[0])


def test_a_stored_file_is_never_written_again(root):
    tmp_path, _, parts = root
    first = _upload(parts, PAYLOAD)
    record = recorded_file(parts.storage, "r", "1", "s-a", F)
    assert _upload(parts, PAYLOAD) == first  # a retry of the same bytes answers as the first did
    other = PAYLOAD[::-1]
    with pytest.raises(Conflict) as info:
        _upload(parts, other)
    assert f"file {F!r} is already stored in this session with other bytes" in info.value.message
    assert info.value.details == {"file": F}
    assert (tmp_path / Paths.file("r", "1", "s-a", F)).read_bytes() == PAYLOAD
    assert recorded_file(parts.storage, "r", "1", "s-a", F) == record
    assert not [p for p in _session_files(tmp_path) if ".tmp-" in p]


def test_a_record_is_created_once(root):
    _, _, parts = root
    key = Paths.digest("r", "1", "s-a", "x.bin")
    entry = FileEntry(size=1, xxh3="0" * 16, block_size=BLOCK, blocks=["1" * 16])
    record_file(parts.storage, key, "x.bin", entry)
    record_file(parts.storage, key, "x.bin", entry)  # the same again: idempotent
    with pytest.raises(Conflict, match="file 'x.bin' is already recorded in this session with other digests"):
        record_file(parts.storage, key, "x.bin", entry.model_copy(update={"xxh3": "2" * 16}))
    assert recorded_file(parts.storage, "r", "1", "s-a", "x.bin") == entry


def test_every_way_in_passes_the_one_write_gate(tmp_path):
    """A session that takes no writes (never opened, committed, refused at its commit) is refused by
    every way a file comes in, with the gate's typed error, before anything is stored."""
    store = _committed_source(tmp_path)  # r/src committed by s-src
    stage(store, "r", "3", "s-c")
    with pytest.raises(ChecksumMismatch):  # refused at its commit: FAILED recorded
        store.put_index("r", "3", "s-c", index(0, 1, payload=b"\x01" * 1000))
    parts = Parts(LocalStorage(tmp_path), block_size=BLOCK)
    sha = "A" * 43 + "="
    presign = PresignUpload(size=10, part_size=5 << 20, sha256=[sha])
    confirm = ConfirmUpload(**presign.model_dump(), xxh3="0" * 16, block_size=BLOCK, blocks=["0" * 16])
    ways = {"receive": lambda *at: parts.intake.receive(*at),
            "presign": lambda *at: parts.intake.presign(*at, presign, 60.0),
            "confirm": lambda *at: parts.intake.place(*at, confirm),
            "link": lambda *at: parts.intake.place(*at, LinkFile(checkpoint="src", file=file_of(0)))}
    f = linked_name("src", file_of(0))
    for at, refusal in ((("r", "2", "s-x"), SessionNotFound), (("r", "src", "s-src"), AlreadyCommitted),
                        (("r", "3", "s-c"), SessionConflict)):
        for way, call in ways.items():
            with pytest.raises(refusal):
                call(*at, f)
            assert not (tmp_path / Paths.file(*at, f)).exists(), way
            assert recorded_file(parts.storage, *at, f) is None, way
            assert not (tmp_path / Paths.presign_claim(*at, f)).exists(), way
    assert not (tmp_path / Paths.session("r", "2", "s-x")).exists()


def test_presigned_uploads_are_refused_where_the_store_takes_none(root):
    tmp_path, _, parts = root
    sha = "A" * 43 + "="
    with pytest.raises(InvalidRequest) as info:
        parts.intake.presign("r", "1", "s-a", F, PresignUpload(size=10, part_size=5 << 20, sha256=[sha]), 60.0)
    assert f"file {F!r}: this store" in info.value.message and info.value.details == {"file": F}
    assert not (tmp_path / Paths.presign_claim("r", "1", "s-a", F)).exists()
    whole, blocks = _digest(PAYLOAD)
    body = dict(size=len(PAYLOAD), part_size=5 << 20, sha256=[sha], xxh3=whole, block_size=BLOCK, blocks=blocks)
    with pytest.raises(InvalidRequest, match="does not match the file's presign"):  # nothing was presigned
        parts.intake.place("r", "1", "s-a", F, ConfirmUpload(**body))
    with pytest.raises(InvalidRequest) as info:  # digest blocks of another size than this service's
        parts.intake.place("r", "1", "s-a", F, ConfirmUpload(**{**body, "block_size": 8192, "blocks": blocks[:2]}))
    assert info.value.details == {"file": F, "field": "blocks"}
    assert recorded_file(parts.storage, "r", "1", "s-a", F) is None


def test_check_link_refuses_a_name_that_is_not_the_sources_and_a_link_to_itself():
    good = linked_name("1", F)
    check_link("2", good, LinkFile(checkpoint="1", file=F))
    with pytest.raises(InvalidRequest) as info:
        check_link("2", "ln-0000000000000000.bin", LinkFile(checkpoint="1", file=F))
    assert f"a link of 1/{F} is named {good!r}" in info.value.message
    with pytest.raises(InvalidRequest, match="a checkpoint cannot link its own files"):
        check_link("1", good, LinkFile(checkpoint="1", file=F))
    with pytest.raises(InvalidName):
        check_link("2", good, LinkFile(checkpoint="../1", file=F))
    with pytest.raises(InvalidName):
        check_link("2", good, LinkFile(checkpoint="1", file=".hidden"))


def _committed_source(tmp_path) -> SessionStore:
    store = SessionStore(LocalStorage(tmp_path))
    stage(store, "r", "src", "s-src")
    put_indexes(store, "r", "src", "s-src")  # committed; the commit's check is its first verification
    stage(store, "r", "2", "s-b", ranks=[])
    return store


def test_link_places_a_verified_file_of_a_visible_checkpoint(tmp_path):
    _committed_source(tmp_path)
    parts = Parts(LocalStorage(tmp_path))
    name = linked_name("src", file_of(0))
    res = parts.intake.place("r", "2", "s-b", name, LinkFile(checkpoint="src", file=file_of(0)))
    source = parts.visibility.manifest(parts.visibility.check("r", "src")).files[file_of(0)]
    assert (res.file, res.size, res.xxh3) == (name, source.size, source.xxh3)
    rec = recorded_file(parts.storage, "r", "2", "s-b", name)
    assert rec == source.model_copy(update={"linked": f"src/{file_of(0)}"})
    linked = tmp_path / Paths.file("r", "2", "s-b", name)
    assert os.path.samefile(linked, tmp_path / Paths.file("r", "src", "s-src", file_of(0)))
    assert linked.read_bytes() == data(0)
    assert parts.activity.last("r", "2", "s-b") is not None


def test_link_refuses_what_is_not_a_visible_verified_source(tmp_path):
    _committed_source(tmp_path)
    parts = Parts(LocalStorage(tmp_path))
    for checkpoint, file, why in (("nope", file_of(0), "r/nope is not a visible checkpoint holding"),
                                  ("src", "other.bin", "r/src is not a visible checkpoint holding 'other.bin'")):
        name = linked_name(checkpoint, file)
        with pytest.raises(InvalidRequest, match=why) as info:
            parts.intake.place("r", "2", "s-b", name, LinkFile(checkpoint=checkpoint, file=file))
        assert info.value.details == {"file": name, "source": f"r/{checkpoint}"}
    src = tmp_path / Paths.file("r", "src", "s-src", file_of(0))
    src.write_bytes(data(0))  # rewritten in place since its verification (same bytes: the stamp moved)
    name = linked_name("src", file_of(0))
    with pytest.raises(InvalidRequest, match="is not as its last verification found it"):
        parts.intake.place("r", "2", "s-b", name, LinkFile(checkpoint="src", file=file_of(0)))
    assert not (tmp_path / Paths.file("r", "2", "s-b", name)).exists()
    assert recorded_file(parts.storage, "r", "2", "s-b", name) is None


def test_a_file_being_received_is_counted_per_session(root):
    _, store, parts = root
    stage(store, "r", "1", "s-c", ranks=[])
    a = parts.intake.receive("r", "1", "s-a", "a.bin")
    b = parts.intake.receive("r", "1", "s-a", "b.bin")
    c = parts.intake.receive("r", "1", "s-c", "c.bin")
    a.write(b"x" * 10)
    b.write(b"y" * 5)
    c.write(b"z")
    assert parts.intake.receiving("r", "1", "s-a") == (2, 15)
    assert parts.intake.receiving("r", "1", "s-c") == (1, 1)
    a.finish(xxhash.xxh3_64_hexdigest(b"x" * 10))
    b.abort()
    assert parts.intake.receiving("r", "1", "s-a") == (0, 0)
    assert parts.intake.receiving("r", "1", "s-c") == (1, 1)
    c.abort()
