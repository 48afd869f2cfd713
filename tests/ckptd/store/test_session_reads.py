"""``ckptd.store.session_reads``: what the write side reads of a session and of the ref it would commit.

Over a real local root, sessions staged through the session store: ``read_meta`` gives a session's
record (None once aborted, or never opened); ``committed_by`` names the marker only for the session
that committed a visible checkpoint (not another session of the ref, not a marker that does not
parse, not one whose manifest is gone); ``taken_error`` tells a ref taken by a commit (``AlreadyCommitted``
naming the session) from one taken by a marker that does not parse (``Conflict``).
"""

from __future__ import annotations


import pytest

from ckptd.storage import LocalStorage
from ckptd.store import SessionStore
from ckptd.store.paths import Marker, Paths, SessionMeta
from ckptd.store.session_reads import committed_by, read_meta, taken_error
from ckptd.store.visibility import BadMarker, Visibility
from ckptd_schemas import AlreadyCommitted, Conflict

from .staging import put_indexes, stage


@pytest.fixture
def store(tmp_path) -> SessionStore:
    return SessionStore(LocalStorage(tmp_path))


def test_read_meta_is_the_sessions_record_while_it_exists(store):
    assert read_meta(store.storage, "r", "1", "s-a") is None  # never opened
    stage(store, "r", "1", "s-a", world=2, ranks=[], step=7)
    meta = read_meta(store.storage, "r", "1", "s-a")
    assert isinstance(meta, SessionMeta)
    assert (meta.session, meta.world_size, meta.step) == ("s-a", 2, 7)
    assert meta == SessionMeta.model_validate_json(store.storage.read(Paths.session_meta("r", "1", "s-a")))
    assert read_meta(store.storage, "r", "1", "s-b") is None  # another session of the ref
    store.sweeper.abort("r", "1", "s-a")
    assert read_meta(store.storage, "r", "1", "s-a") is None


def test_committed_by_names_the_marker_of_the_committing_session_only(store):
    vis = Visibility(store.storage)
    stage(store, "r", "1", "s-a")
    stage(store, "r", "1", "s-b")
    assert committed_by(vis, "r", "1", "s-a") is None  # open: no marker
    put_indexes(store, "r", "1", "s-a")
    m = committed_by(vis, "r", "1", "s-a")
    assert isinstance(m, Marker) and m.session == "s-a" and m.ref == "r/1"
    assert committed_by(vis, "r", "1", "s-b") is None  # the ref is taken, by another session
    assert committed_by(vis, "r", "2", "s-a") is None
    # a marker already read is used as it is: one naming another session answers None without a read
    assert committed_by(vis, "r", "1", "s-a", m.model_copy(update={"session": "s-b"})) is None
    assert committed_by(vis, "r", "1", "s-a", m) == m


def test_committed_by_is_none_for_a_marker_that_fails_the_visibility_rule(store, tmp_path):
    vis = Visibility(store.storage)
    stage(store, "r", "1", "s-a")
    put_indexes(store, "r", "1", "s-a")
    m = committed_by(vis, "r", "1", "s-a")
    manifest = tmp_path / Paths.session("r", "1", "s-a") / m.manifest
    manifest.rename(manifest.with_suffix(".moved"))  # the manifest it names is gone
    assert committed_by(Visibility(store.storage), "r", "1", "s-a") is None
    manifest.with_suffix(".moved").rename(manifest)
    assert committed_by(Visibility(store.storage), "r", "1", "s-a") == m
    (tmp_path / Paths.marker("r", "1")).write_bytes(b"{not a marker")
    assert committed_by(Visibility(store.storage), "r", "1", "s-a") is None
    assert committed_by(vis, "r", "1", "s-a", BadMarker("does not parse")) is None


def test_taken_error_tells_a_commit_from_a_marker_that_does_not_parse(store):
    stage(store, "r", "1", "s-a")
    put_indexes(store, "r", "1", "s-a")
    m = Visibility(store.storage).marker("r", "1")
    e = taken_error("r", "1", m)
    assert type(e) is AlreadyCommitted
    assert "r/1 is already committed (session s-a)" in e.message
    assert e.details == {"ref": "r/1", "session": "s-a"}
    bad = taken_error("r", "1", BadMarker("COMMITTED marker does not parse: invalid JSON"))
    assert type(bad) is Conflict and not isinstance(bad, AlreadyCommitted)
    assert "r/1 has a COMMITTED marker that does not parse (COMMITTED marker does not parse: invalid JSON)" \
        in bad.message
    assert bad.details == {"ref": "r/1"}
