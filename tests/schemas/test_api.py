"""``ckptd_schemas.api``: the HTTP bodies refuse what the service must never act on, naming what is wrong.

* ``OpenSession``: a session id is a storage name (no dots, slashes, over 64 characters), a world size
  is 1 .. 2^20, no field the service does not know;
* ``PresignUpload`` / ``ConfirmUpload``: one SHA-256 per part of the declared size, parts of at least
  S3's minimum, digests in their wire forms;
* ``RankIndex``: entries given in code become the two column tables and come back unchanged through
  JSON; tables whose columns disagree, a chunk table without its tensor column, a chunk of another
  rank, and (``check_chunks``) a chunk outside its tensor are refused naming the rank and tensor;
* ``SessionStatus.settled``: when a wait is over.

Pure: no service.
"""

from __future__ import annotations

import base64
import hashlib

import pytest
from pydantic import ValidationError

from ckptd_schemas.api import (
    LEASE_HEADER, LOAD_TREE_HEADER, MIN_PART_BYTES, SKIPPED_HEADER, ConfirmUpload, LinkFile, OpenSession,
    PresignUpload, RankIndex, SessionStatus, SkippedCheckpoint, TensorColumns,
)
from ckptd_schemas.chunks import BoxChunk, FlatChunk, Location
from ckptd_schemas.manifest import ObjectEntry, TensorEntry

H = "0123456789abcdef"
SHA = base64.b64encode(hashlib.sha256(b"part").digest()).decode()


def _fields(info: pytest.ExceptionInfo) -> set:
    return {e["loc"][0] if e["loc"] else None for e in info.value.errors()}


# -- OpenSession ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("sid", ["../s", "a.b", "a/b", "-lead", "", "s" * 65, "s\x00"])
def test_open_session_refuses_a_session_id_that_is_not_a_storage_name(sid):
    with pytest.raises(ValidationError) as info:
        OpenSession(session=sid, world_size=1)
    assert _fields(info) == {"session"}


@pytest.mark.parametrize(("field", "value"), [("world_size", 0), ("world_size", (1 << 20) + 1), ("step", -1),
                                              ("derived_from", "r/" + "n" * 300), ("parent", "p" * 301)])
def test_open_session_bounds(field, value):
    with pytest.raises(ValidationError) as info:
        OpenSession(**{"session": "s-1", "world_size": 2, field: value})
    assert _fields(info) == {field}


def test_open_session_takes_no_unknown_field_and_defaults_plain_uploads():
    with pytest.raises(ValidationError) as info:
        OpenSession.model_validate({"session": "s-1", "world_size": 1, "root": "/"})
    assert _fields(info) == {"root"}
    req = OpenSession(session="s" * 64, world_size=1 << 20)
    assert (req.step, req.derived_from, req.parent, req.direct_uploads) == (None, None, None, False)


# -- presigned uploads ---------------------------------------------------------------------------------

@pytest.mark.parametrize(("size", "parts"), [(0, 1), (1, 1), (MIN_PART_BYTES, 1), (MIN_PART_BYTES + 1, 2),
                                             (3 * MIN_PART_BYTES, 3)])
def test_presign_needs_one_sha256_per_part(size, parts):
    ok = PresignUpload(size=size, part_size=MIN_PART_BYTES, sha256=[SHA] * parts)
    assert len(ok.sha256) == parts
    for wrong in {parts - 1, parts + 1} - {0}:
        with pytest.raises(ValidationError) as info:
            PresignUpload(size=size, part_size=MIN_PART_BYTES, sha256=[SHA] * wrong)
        assert f"are {parts} parts, not {wrong} SHA-256 values" in str(info.value)


def test_presign_bounds_and_digest_form():
    for field, value in (("part_size", MIN_PART_BYTES - 1), ("size", -1), ("size", (5 << 40) + 1),
                         ("sha256", [SHA.rstrip("=")]), ("sha256", ["0" * 64]), ("sha256", [])):
        with pytest.raises(ValidationError) as info:
            PresignUpload(**{"size": 1, "part_size": MIN_PART_BYTES, "sha256": [SHA], field: value})
        assert field in _fields(info)


def test_confirm_carries_the_digest_record_in_its_wire_forms():
    base = dict(size=10, part_size=MIN_PART_BYTES, sha256=[SHA], xxh3=H, block_size=4096, blocks=[H])
    assert ConfirmUpload(**base).etags == [] and ConfirmUpload(**base).upload_id is None
    for field, value in (("xxh3", H.upper()), ("block_size", 4095), ("blocks", ["xyz"]),
                         ("etags", ["e" * 201]), ("upload_id", "u" * 1025)):
        with pytest.raises(ValidationError) as info:
            ConfirmUpload(**{**base, field: value})
        assert field in _fields(info)
    with pytest.raises(ValidationError):  # what PresignUpload checks holds here too
        ConfirmUpload(**{**base, "sha256": [SHA, SHA]})


def test_link_file_names_are_bounded():
    assert LinkFile(checkpoint="100", file="r0.bin").file == "r0.bin"
    with pytest.raises(ValidationError) as info:
        LinkFile(checkpoint="c" * 201, file="r0.bin")
    assert _fields(info) == {"checkpoint"}


# -- RankIndex -----------------------------------------------------------------------------------------

def _entries(rank: int = 1) -> list[TensorEntry]:
    f = f"r{rank}.bin"
    return [
        TensorEntry(name="model.w", shape=[4, 2], dtype="float32", group="model", placement="(Shard(dim=0),)",
                    chunks=[BoxChunk(rank=rank, offsets=[2, 0], sizes=[2, 2], location=Location(
                        file=f, offset=0, length=16, raw_length=16, xxh3=H))]),
        TensorEntry(name="optim.m", shape=[10], dtype="bfloat16", group="optim", digest="f" * 16,
                    chunks=[FlatChunk(rank=rank, start=5, length=5, location=Location(
                        file=f, offset=16, length=3, raw_length=10, codec="zstd", xxh3=H))]),
        TensorEntry(name="model.empty", shape=[0], dtype="int64", group="model", chunks=[]),
    ]


def test_entries_become_columns_and_come_back_unchanged_through_json():
    ix = RankIndex(rank=1, world_size=2, tensors=_entries(), files=["r1.bin"],
                   objects=[ObjectEntry(name="cfg", rank=1, encoding="json", value={"a": 1})])
    assert ix.tensor_table.name == ["model.w", "optim.m", "model.empty"]
    assert ix.chunk_table.tensor == [0, 1] and ix.chunk_table.flat == [False, True]
    assert ix.chunk_table.codec == ["raw", "zstd"] and ix.chunk_table.rank is None
    assert ix.tensors == _entries()
    wire = ix.model_dump_json()
    assert '"tensors"' not in wire  # input only: the wire carries the tables
    back = RankIndex.model_validate_json(wire)
    assert back == ix and back.tensors == _entries()
    ix.check_chunks()


def test_columns_that_are_all_default_are_left_out():
    e = _entries()[0]
    ix = RankIndex(rank=1, world_size=2, tensors=[e])
    assert ix.chunk_table.flat is None and ix.chunk_table.codec is None
    assert ix.tensor_table.digest is None and ix.tensor_table.placement == ["(Shard(dim=0),)"]


def test_model_copy_replaces_both_tables_and_forgets_the_entries():
    ix = RankIndex(rank=1, world_size=2, tensors=_entries())
    assert len(ix.tensors) == 3
    fewer = ix.model_copy(update={"tensors": _entries()[:1]})
    assert fewer.tensor_table.name == ["model.w"] and fewer.chunk_table.tensor == [0]
    assert fewer.tensors == _entries()[:1]
    assert len(ix.tensors) == 3  # the original is unchanged


def test_a_chunk_labelled_with_another_rank_is_refused_naming_the_tensor():
    with pytest.raises(ValidationError) as info:
        RankIndex(rank=0, world_size=2, tensors=_entries(rank=1))
    assert "tensor 'model.w': rank 0 sent a chunk labelled rank 1" in str(info.value)


def _tables(**over) -> dict:
    tt = {"name": ["model.w"], "shape": [[4, 2]], "dtype": ["float32"], "group": ["model"]}
    ct = {"tensor": [0], "offsets": [[2, 0]], "sizes": [[2, 2]], "file": ["r1.bin"], "offset": [0], "length": [16],
          "xxh3": [H]}
    for k, v in over.items():
        (tt if k in TensorColumns.model_fields and k not in ct else ct)[k] = v
    return {"rank": 1, "world_size": 2, "tensor_table": tt, "chunk_table": ct}


def test_the_wire_form_parses():
    ix = RankIndex.model_validate(_tables())
    assert ix.tensors == [_entries()[0].model_copy(update={"placement": None})]
    ix.check_chunks()


@pytest.mark.parametrize(("over", "says"), [
    ({"dtype": ["float32", "float32"]}, "rank 1: tensor column 'dtype' has 2 rows, name has 1"),
    ({"placement": []}, "rank 1: tensor column 'placement' has 0 rows, name has 1"),
    ({"tensor": None}, "rank 1: the chunk table needs a tensor column (and no rank column)"),
    ({"rank": [1]}, "rank 1: the chunk table needs a tensor column (and no rank column)"),
    ({"tensor": [1]}, "rank 1: chunk table's tensor column does not index its 1 tensors"),
    ({"tensor": [0, 0]}, "rank 1: chunk table's tensor column does not index its 1 tensors"),
])
def test_tables_that_disagree_are_refused_naming_the_rank(over, says):
    with pytest.raises(ValidationError) as info:
        RankIndex.model_validate(_tables(**over))
    assert says in str(info.value)


def test_entries_and_tables_together_are_refused():
    body = _tables()
    body["tensors"] = [e.model_dump(by_alias=True) for e in _entries()[:1]]
    with pytest.raises(ValidationError, match="give tensors or tensor_table/chunk_table, not both"):
        RankIndex.model_validate(body)


@pytest.mark.parametrize(("over", "says"), [
    ({"offsets": [[3, 0]]}, "tensor 'model.w': chunk from rank 1 at offsets [3, 0] sizes [2, 2] lies outside"),
    ({"offsets": [[2]], "sizes": [[2]]}, "tensor 'model.w': chunk from rank 1 has 1-d offsets for a 2-d shape"),
    ({"length": [15]}, "tensor 'model.w': chunk from rank 1: raw_length 15 != 4 elements x 4 bytes (float32)"),
])
def test_check_chunks_refuses_a_chunk_outside_its_tensor(over, says):
    ix = RankIndex.model_validate(_tables(**over))  # the columns agree: parsed
    with pytest.raises(ValueError) as info:
        ix.check_chunks()
    assert says in str(info.value)


# -- SessionStatus -------------------------------------------------------------------------------------

@pytest.mark.parametrize(("state", "durable", "durable_error", "plain", "wants_durable"), [
    ("open", None, None, False, False),
    ("failed", None, None, True, True),
    ("committed", None, None, True, False),
    ("committed", False, None, True, False),
    ("committed", True, None, True, True),
    ("committed", None, {"code": "integrity"}, True, True),
])
def test_settled(state, durable, durable_error, plain, wants_durable):
    s = SessionStatus(run="r", name="1", session="s", state=state, world_size=1, ranks_done=[], durable=durable,
                      durable_error=durable_error)
    assert s.settled() is plain and s.settled(durable=True) is wants_durable


def test_headers_and_skipped_entries():
    assert (SKIPPED_HEADER, LEASE_HEADER, LOAD_TREE_HEADER) == ("X-Ckptd-Skipped", "X-Ckptd-Lease",
                                                                "X-Ckptd-Load-Tree")
    s = SkippedCheckpoint.model_validate({"ref": "gpt/9", "reason": "verification failed at t: x"})
    assert s.ref == "gpt/9"
    with pytest.raises(ValidationError):
        SkippedCheckpoint.model_validate({"ref": "gpt/9"})  # the reason is not optional


# -- answers a client of an earlier release reads ---------------------------------------------------------

_ANSWERS = {
    "SessionInfo": {"run": "r", "name": "1", "session": "s1", "world_size": 2, "created_at": "2026-01-01T00:00:00Z"},
    "PresignedUpload": {"upload_id": None, "urls": ["u"], "headers": [{}], "expires_in": 60.0, "block_size": 4096},
    "UploadResult": {"file": "f", "size": 1, "xxh3": "0" * 16},
    "SessionStatus": {"run": "r", "name": "1", "session": "s1", "state": "open", "world_size": 2, "ranks_done": []},
    "CheckpointSummary": {"run": "r", "name": "1", "step": 1, "derived_from": None, "session": "s1",
                          "committed_at": "2026-01-01T00:00:00Z", "manifest_xxh3": "0" * 16},
    "RunSummary": {"run": "r", "checkpoints": 1, "latest": "1"},
    "SkippedCheckpoint": {"ref": "r/2", "reason": "verification failed"},
}


@pytest.mark.parametrize("model", sorted(_ANSWERS))
def test_an_answer_with_a_field_added_by_a_later_release_still_parses(model):
    """A service upgraded before its clients adds fields to its answers (as ``SessionInfo`` gained
    ``keepalive_seconds`` and ``local_socket``): a client of the earlier release reads the answer."""
    import ckptd_schemas.api as api

    cls = getattr(api, model)
    got = cls.model_validate({**_ANSWERS[model], "added_in_a_later_release": {"x": 1}})
    assert got == cls.model_validate(_ANSWERS[model])


def test_requests_and_answers_that_describe_bytes_stay_strict():
    """What a client sends, and an answer that says how bytes are read, refuse a field they do not know."""
    from ckptd_schemas.readplan import ReadPlan

    for cls, body in ((OpenSession, {"session": "s1", "world_size": 1}),
                      (ReadPlan, {"fetches": [], "copies": []})):
        cls.model_validate(body)
        with pytest.raises(ValidationError, match="added_in_a_later_release"):
            cls.model_validate({**body, "added_in_a_later_release": 1})
