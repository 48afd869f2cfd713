"""The store's own verification of committed checkpoints (:mod:`ckptd.store.verification`), without a service.

Two checkpoints of run ``r`` (steps 1 and 2) are committed offline on a local root through the same
session and commit code as the service (``stored_tensors.write_tensors``); then the data file
of step 2 is damaged on disk. What each public call must do:

* ``require_verified`` takes the commit's record while it still vouches for the stored bytes (no
  second read), and refuses a damaged source with ``CorruptCheckpoint`` naming the tensors and file;
* ``verify_committed`` records a failure, so ``RUN/latest`` skips the damaged checkpoint;
* ``verify_unrecorded`` (``ckptd gc --dry-run``) finds the damage and records nothing;
* ``recheck_files`` (a reader's report) refuses unknown files before reading, records nothing for
  intact bytes, records damaged ones once, and says what ``latest`` resolves to now;
* a checkpoint that is not visible is ``CheckpointNotFound`` with its ref.
"""

from __future__ import annotations

import json

import pytest
import torch

from ckptd.storage import LocalStorage
from stored_tensors import write_tensors
from ckptd.store.paths import Paths
from ckptd.store.sessions import SessionStore
from ckptd.store.verification import (
    read_record, recheck_files, require_verified, verify_committed, verify_unrecorded,
)
from ckptd.store.visibility import Visibility
from ckptd_schemas import CheckpointNotFound, CorruptCheckpoint, InvalidRequest

DATA = "r000000-0000.bin"  # the one data file write_tensors writes


@pytest.fixture()
def storage(tmp_path) -> LocalStorage:
    storage = LocalStorage(tmp_path / "root", durable=False)
    sessions = SessionStore(storage)
    for step in (1, 2):
        write_tensors(sessions, f"r/{step}", {"model.w": torch.full((4, 8), float(step)),
                                              "model.b": torch.arange(5, dtype=torch.float32)}, step=step)
    return storage


def _damage(storage: LocalStorage, name: str, *, truncate: bool = False) -> None:
    """Flip the first byte of ``r/name``'s data file (the start of ``model.w``), or cut its last byte."""
    c = Visibility(storage).resolve("r", name)
    path = storage.root / Paths.file("r", name, c.session, DATA)
    raw = bytearray(path.read_bytes())
    if truncate:
        del raw[-1]
    else:
        raw[0] ^= 0xFF
    path.write_bytes(bytes(raw))


def _latest(storage: LocalStorage) -> str:
    return Visibility(storage).resolve_ref("r", "latest")[0].name


def test_an_intact_checkpoint_verifies_and_its_record_is_about_its_manifest(storage):
    rec = verify_committed(storage, "r", "2")
    assert rec.ok and rec.problems == [] and rec.ref == "r/2"
    assert (rec.files, rec.tensors) == (1, 2) and rec.bytes_read > 0
    assert set(rec.stamps) == {DATA}  # the record vouches for the bytes as stored
    assert rec.manifest_xxh3 == Visibility(storage).resolve("r", "2").digest
    assert read_record(storage, "r", "2") == rec
    assert verify_committed(storage, "r", "latest").ref == "r/2"  # latest is resolved first


def test_require_verified_takes_the_commits_record_while_the_bytes_are_unchanged(storage):
    committed = read_record(storage, "r", "2")
    assert committed is not None and committed.ok  # the commit's own check, recorded
    again = require_verified(storage, "r", "2")
    assert again.verified_at == committed.verified_at  # no second verification
    assert read_record(storage, "r", "2").verified_at == committed.verified_at


def test_require_verified_refuses_a_damaged_source_naming_tensor_and_file(storage):
    _damage(storage, "2")
    with pytest.raises(CorruptCheckpoint) as e:
        require_verified(storage, "r", "latest")
    assert "r/2 does not verify" in e.value.message and "model.w" in e.value.message
    assert e.value.details["ref"] == "r/2" and e.value.details["files"] == [DATA]
    assert set(e.value.details["tensors"]) == {"model.w", "model.b"}  # every tensor stored in that file
    rec = read_record(storage, "r", "2")
    assert rec is not None and not rec.ok
    assert any(p.startswith("tensor 'model.w' (rank 0): bytes [0, 128)") for p in rec.problems), rec.problems
    assert _latest(storage) == "1"  # known bad now: latest skips it


def test_verify_committed_records_a_truncated_file_as_a_failure(storage):
    _damage(storage, "2", truncate=True)
    rec = verify_committed(storage, "r", "2")
    assert not rec.ok
    assert any("holds 191 bytes, its manifest says 192" in p for p in rec.problems), rec.problems
    assert read_record(storage, "r", "2") == rec and _latest(storage) == "1"


def test_verify_unrecorded_finds_damage_and_records_nothing(storage):
    before = read_record(storage, "r", "2")
    _damage(storage, "2")
    rec = verify_unrecorded(storage, "r", "2")
    assert not rec.ok and rec.problems
    assert read_record(storage, "r", "2") == before  # the commit's record is untouched
    assert _latest(storage) == "2"


def test_recheck_refuses_an_unknown_file_before_reading(storage):
    with pytest.raises(InvalidRequest) as e:
        recheck_files(storage, "r", "2", [DATA, "r000009-0000.bin"])
    assert e.value.details == {"ref": "r/2", "file": "r000009-0000.bin"}


def test_recheck_of_intact_bytes_records_nothing(storage):
    before = read_record(storage, "r", "2")
    out = recheck_files(storage, "r", "2", [DATA, DATA])
    assert out == {"ref": "r/2", "files": [DATA], "parts": [], "damaged": False, "problems": [], "recorded": False,
                   "latest": "2"}
    assert read_record(storage, "r", "2") == before
    out = recheck_files(storage, "r", "2", [], ["marker", "manifest", "load tree"])  # no data file read
    assert not out["damaged"] and not out["recorded"] and out["parts"] == ["load tree", "manifest", "marker"]
    assert read_record(storage, "r", "2") == before


def test_recheck_of_a_marker_naming_another_load_tree_records_it_and_moves_latest(storage):
    key = Paths.marker("r", "2")
    marker = json.loads(storage.read(key))
    if marker.get("load_tree") is None:
        pytest.skip("this commit names no load tree")
    marker["load_tree"] = ("1" if marker["load_tree"][0] != "1" else "2") + marker["load_tree"][1:]
    storage.put(key, json.dumps(marker).encode())
    out = recheck_files(storage, "r", "2", [], ["marker"])
    assert out["damaged"] and out["recorded"] and out["latest"] == "1", out
    assert any("load tree" in p for p in out["problems"]), out
    assert not read_record(storage, "r", "2").ok


def test_recheck_of_damaged_bytes_records_once_and_moves_latest(storage):
    _damage(storage, "2")
    out = recheck_files(storage, "r", "2", [DATA])
    assert out["damaged"] and out["recorded"] and out["latest"] == "1"
    assert any(DATA in p for p in out["problems"])
    rec = read_record(storage, "r", "2")
    assert rec is not None and not rec.ok
    again = recheck_files(storage, "r", "2", [DATA])  # reported again: the stored verdict, nothing rewritten
    assert again["damaged"] and not again["recorded"] and again["problems"][0].startswith("verification failed at")
    assert read_record(storage, "r", "2") == rec


def test_recheck_of_the_only_good_checkpoint_leaves_no_latest(storage):
    _damage(storage, "1")
    _damage(storage, "2")
    recheck_files(storage, "r", "2", [DATA])
    assert recheck_files(storage, "r", "1", [DATA])["latest"] is None


def test_a_checkpoint_that_is_not_visible_is_not_found(storage):
    with pytest.raises(CheckpointNotFound) as e:
        recheck_files(storage, "r", "9", [DATA])
    assert e.value.details == {"ref": "r/9"}
    with pytest.raises(CheckpointNotFound):
        verify_committed(storage, "r", "9")
    assert read_record(storage, "r", "9") is None
    assert not (storage.root / Paths.verification("r", "9")).exists()
