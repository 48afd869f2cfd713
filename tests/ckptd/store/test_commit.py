"""``ckptd.store.commit``: a session commits once every rank's index is stored: merge, check every byte,
manifest, marker; a refusal is recorded, a storage failure is not a verdict.

Over a real local root, sessions staged through the session store, their indexes stored as the
session store stores them, and a ``Committer`` wired as the store wires it (``staging.Parts``):

* ``if_complete`` answers ``open`` (with the ranks it found) until the last index, then commits: the
  manifest is stored under its digest, the marker names it and the load tree's root, the commit's check
  is the first verification, and the observers hear one commit;
* ``commit`` again answers the same digest and tells no one again; another complete session of the
  ref is refused (``Conflict``) and the first stays what is visible;
* a byte that differs from its index's digest, or a file without a verified upload, refuses the
  session (``FAILED`` recorded, observers told, no marker) and every later call says so
  (``CommitFailed``);
* a storage failure during the commit is raised and recorded nowhere: the session commits on retry.
"""

from __future__ import annotations

import json

import pytest
import xxhash

from ckptd.storage import LocalStorage
from ckptd.store import SessionStore
from ckptd.store.paths import Paths
from ckptd.store.session_reads import read_meta
from ckptd.store.visibility import Visibility
from ckptd_schemas import ChecksumMismatch, CommitFailed, Conflict, InvalidIndex, Manifest, OpenSession, StorageError
from ckptd_schemas.filedigest import xxh3_hex
from ckptd_schemas.loadtree import LoadTree

from .staging import Parts, data, file_of, index, put_indexes, stage, store_index

RUN = "r"


def _store_index(parts: Parts, name: str, sid: str, rank: int, world: int, payload: bytes | None = None) -> None:
    """Rank ``rank``'s index stored as the session store stores it (without asking for a commit)."""
    store_index(parts.storage, RUN, name, sid, index(rank, world, payload))


@pytest.fixture
def store(tmp_path) -> SessionStore:
    return SessionStore(LocalStorage(tmp_path))


def test_the_last_index_commits(store, tmp_path):
    stage(store, RUN, "1", "s-a", world=3, step=40)
    parts = Parts(LocalStorage(tmp_path))
    meta = read_meta(parts.storage, RUN, "1", "s-a")
    for rank in (0, 2):
        _store_index(parts, "1", "s-a", rank, 3)
        st = parts.committer.if_complete(RUN, "1", "s-a", meta, rank)
        assert st.state == "open" and st.manifest_xxh3 is None
    assert st.ranks_done == [2]  # the answer's own rank: no answer grows with the world size
    assert parts.visibility.marker(RUN, "1") is None and parts.heard.commits == []
    _store_index(parts, "1", "s-a", 1, 3)
    st = parts.committer.if_complete(RUN, "1", "s-a", meta, 1)
    assert st.state == "committed" and st.ranks_done == [1]
    raw = (tmp_path / Paths.manifest(RUN, "1", "s-a", st.manifest_xxh3)).read_bytes()
    assert xxh3_hex(raw) == st.manifest_xxh3
    m = Manifest.model_validate_json(raw)
    assert (m.run, m.name, m.session, m.step, m.topology.world_size) == (RUN, "1", "s-a", 40, 3)
    assert sorted(m.files) == [file_of(r) for r in range(3)]
    assert m.tensor("model.x").shape == [750]
    marker = parts.visibility.marker(RUN, "1")
    assert (marker.session, marker.manifest_xxh3, marker.step) == ("s-a", st.manifest_xxh3, 40)
    assert marker.load_tree == LoadTree(m).root
    assert parts.visibility.check(RUN, "1").digest == st.manifest_xxh3
    (event,) = parts.heard.commits
    assert (event.run, event.name, event.session, event.manifest_xxh3, event.files, event.bytes) == (
        RUN, "1", "s-a", st.manifest_xxh3, 3, 3000)
    verified = json.loads((tmp_path / Paths.verification(RUN, "1")).read_text())
    assert verified["manifest_xxh3"] == st.manifest_xxh3 and verified["ok"] is True


def test_a_commit_again_answers_the_same_and_tells_no_one(store, tmp_path):
    stage(store, RUN, "2", "s-a")
    parts = Parts(LocalStorage(tmp_path))
    _store_index(parts, "2", "s-a", 0, 1)
    meta = read_meta(parts.storage, RUN, "2", "s-a")
    digest = parts.committer.commit(RUN, "2", "s-a", meta)
    assert parts.committer.commit(RUN, "2", "s-a", meta) == digest
    other = Parts(LocalStorage(tmp_path))  # another replica finishing the same session
    assert other.committer.commit(RUN, "2", "s-a", meta) == digest
    assert len(parts.heard.commits) == 1 and other.heard.commits == []


def test_another_complete_session_of_a_committed_ref_is_refused(store, tmp_path):
    stage(store, RUN, "3", "s-a")
    stage(store, RUN, "3", "s-b")
    parts = Parts(LocalStorage(tmp_path))
    for sid in ("s-a", "s-b"):
        _store_index(parts, "3", sid, 0, 1)
    digest = parts.committer.commit(RUN, "3", "s-a", read_meta(parts.storage, RUN, "3", "s-a"))
    with pytest.raises(Conflict) as info:
        parts.committer.commit(RUN, "3", "s-b", read_meta(parts.storage, RUN, "3", "s-b"))
    assert "r/3 was committed by another session" in info.value.message and info.value.details == {"ref": "r/3"}
    c = parts.visibility.check(RUN, "3")
    assert (c.session, c.digest) == ("s-a", digest)
    assert [e.session for e in parts.heard.commits] == ["s-a"]


def test_a_byte_that_differs_from_its_digest_refuses_the_session(store, tmp_path):
    stage(store, RUN, "4", "s-a", world=2)
    parts = Parts(LocalStorage(tmp_path))
    meta = read_meta(parts.storage, RUN, "4", "s-a")
    _store_index(parts, "4", "s-a", 0, 2)
    wrong = bytearray(data(1))
    wrong[500] ^= 1
    _store_index(parts, "4", "s-a", 1, 2, payload=bytes(wrong))  # rank 1's index says other bytes
    with pytest.raises(ChecksumMismatch) as info:
        parts.committer.if_complete(RUN, "4", "s-a", meta, 1)
    assert info.value.details["file"] == file_of(1) and info.value.details["tensor"] == "model.x"
    assert info.value.details["rank"] == 1
    failed = json.loads((tmp_path / Paths.failed(RUN, "4", "s-a")).read_text())
    assert failed["error"]["code"] == "checksum_mismatch" and failed["error"]["details"]["file"] == file_of(1)
    assert parts.visibility.marker(RUN, "4") is None and parts.heard.commits == []
    assert [(r, n, s, type(e)) for r, n, s, e in parts.heard.refusals] == [(RUN, "4", "s-a", ChecksumMismatch)]
    with pytest.raises(CommitFailed) as again:  # a retried index hears the verdict, not a new commit
        parts.committer.if_complete(RUN, "4", "s-a", meta, 1)
    assert again.value.message == failed["error"]["message"]
    assert again.value.details == failed["error"]["details"]
    assert len(parts.heard.refusals) == 1


def test_a_file_without_a_verified_upload_refuses_the_session(store, tmp_path):
    stage(store, RUN, "5", "s-a", world=2, ranks=[0])  # rank 1 never uploaded its file
    parts = Parts(LocalStorage(tmp_path))
    for rank in range(2):
        _store_index(parts, "5", "s-a", rank, 2)
    with pytest.raises(InvalidIndex) as info:
        parts.committer.commit(RUN, "5", "s-a", read_meta(parts.storage, RUN, "5", "s-a"))
    assert f"rank 1: file {file_of(1)!r} has no verified upload" in info.value.message
    assert info.value.details == {"rank": 1, "file": file_of(1)}
    assert json.loads((tmp_path / Paths.failed(RUN, "5", "s-a")).read_text())["error"]["code"] == "invalid_index"
    assert parts.visibility.marker(RUN, "5") is None


class _FailingReads(LocalStorage):
    """A local root whose reads of data files fail while ``failing`` (the backend, not the bytes)."""

    failing = True

    def read(self, key, start=0, end=None):
        if self.failing and "/files/" in key:
            raise StorageError(f"storage read of {key!r} failed: the backend is down", key=key)
        return super().read(key, start, end)

    def read_into(self, key, start, view, *, uncached=False):
        if self.failing and "/files/" in key:
            raise StorageError(f"storage read of {key!r} failed: the backend is down", key=key)
        return super().read_into(key, start, view, uncached=uncached)


def test_a_storage_failure_is_not_a_verdict(store, tmp_path):
    stage(store, RUN, "6", "s-a")
    storage = _FailingReads(tmp_path)
    parts = Parts(storage)
    _store_index(parts, "6", "s-a", 0, 1)
    meta = read_meta(storage, RUN, "6", "s-a")
    with pytest.raises(StorageError) as info:
        parts.committer.commit(RUN, "6", "s-a", meta)
    assert "the backend is down" in info.value.message
    assert not (tmp_path / Paths.failed(RUN, "6", "s-a")).exists()
    assert parts.visibility.marker(RUN, "6") is None and parts.heard.refusals == []
    storage.failing = False
    digest = parts.committer.commit(RUN, "6", "s-a", meta)
    assert parts.visibility.check(RUN, "6").digest == digest


def test_merged_gives_the_manifest_and_the_file_records_without_committing(store, tmp_path):
    stage(store, RUN, "7", "s-a", world=2)
    parts = Parts(LocalStorage(tmp_path))
    for rank in range(2):
        _store_index(parts, "7", "s-a", rank, 2)
    m, files, _ = parts.committer.merged(RUN, "7", "s-a", read_meta(parts.storage, RUN, "7", "s-a"))
    assert sorted(files) == [file_of(0), file_of(1)] and m.files == files
    assert [files[file_of(r)].xxh3 for r in range(2)] == [xxh3_hex(data(r)) for r in range(2)]
    assert [c.rank for c in m.tensor("model.x").chunks] == [0, 1]
    assert parts.visibility.marker(RUN, "7") is None
    assert not list((tmp_path / Paths.session(RUN, "7", "s-a")).glob("manifest-*.json"))


class _CountingReads(LocalStorage):
    """A local root that counts the data bytes read back from session files (the commit's check)."""

    def __init__(self, root) -> None:
        super().__init__(root)
        self.read_back = 0

    def read_into(self, key, start, view, *, uncached=False):
        n = super().read_into(key, start, view, uncached=uncached)
        if "/files/" in key:
            self.read_back += n
        return n


def test_last_indexes_arriving_together_make_one_commit(tmp_path):
    """Eight calls at once for a complete session (what the ranks' last indexes do): one merges and
    checks the bytes, the others wait and answer its digest; a refused session is refused to every one
    without a second check."""
    import concurrent.futures

    storage = _CountingReads(tmp_path)
    store = SessionStore(storage)
    stage(store, RUN, "1", "s-a", world=4)
    parts = Parts(storage)
    for rank in range(4):
        _store_index(parts, "1", "s-a", rank, 4)
    meta = read_meta(storage, RUN, "1", "s-a")
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        digests = list(pool.map(lambda _: parts.committer.commit(RUN, "1", "s-a", meta), range(8)))
    assert len(set(digests)) == 1 and len(parts.heard.commits) == 1
    assert storage.read_back == 4 * len(data(0))  # every file read once, not once per call

    stage(store, RUN, "2", "s-b", world=2)
    _store_index(parts, "2", "s-b", 0, 2)
    _store_index(parts, "2", "s-b", 1, 2, payload=b"\x01" * len(data(1)))  # not the bytes uploaded
    storage.read_back = 0
    meta = read_meta(storage, RUN, "2", "s-b")

    def one(_: int) -> str:
        try:
            parts.committer.commit(RUN, "2", "s-b", meta)
            return "committed"
        except (ChecksumMismatch, CommitFailed) as e:
            return type(e).__name__
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        outcomes = list(pool.map(one, range(8)))
    assert outcomes.count("ChecksumMismatch") == 1 and outcomes.count("CommitFailed") == 7, outcomes
    assert storage.read_back <= 2 * len(data(0))


def test_a_session_opened_again_under_its_id_commits_what_its_own_ranks_sent(tmp_path):
    """Replica A checks rank 0's index of session ``s1`` and keeps it for the commit; the session is
    aborted and opened again under the same id on replica B, whose rank 0 sends other bytes. When rank 1's
    index completes the set on A, A folds the index the second session stored, never the one it kept of
    the first (kept entries belong to one incarnation of a session: its record's ``created_at``)."""
    a, b = SessionStore(LocalStorage(tmp_path)), SessionStore(LocalStorage(tmp_path))
    stage(a, RUN, "1", "s1", world=2, ranks=[0])
    put_indexes(a, RUN, "1", "s1", world=2, ranks=[0])
    a.sweeper.abort(RUN, "1", "s1")
    other = bytes(255 - x for x in data(0))
    b.open(RUN, "1", OpenSession(session="s1", world_size=2, step=1))
    for r, payload in ((0, other), (1, data(1))):
        sink = b.intake.receive(RUN, "1", "s1", file_of(r))
        sink.write(payload)
        sink.finish(xxhash.xxh3_64_hexdigest(payload))
    b.put_index(RUN, "1", "s1", index(0, 2, other))
    st = a.put_index(RUN, "1", "s1", index(1, 2))
    assert st.state == "committed", st
    manifest = Visibility(LocalStorage(tmp_path)).manifest(Visibility(LocalStorage(tmp_path)).check(RUN, "1"))
    (x,) = [t for t in manifest.tensors if t.name == "model.x"]
    assert xxhash.xxh3_64_hexdigest(other) in x.table.xxh3, x.table.xxh3
