"""The manifest schema, its validation, the rank-index merge, and the error hierarchy.

* ``schemas/manifest.schema.json`` is committed and must equal the export;
* the JSON Schema accepts a real manifest (as the store writes it);
* models refuse malformed manifests at construction, naming the tensor/file;
* ``merge_indexes`` refuses disagreeing ranks and deduplicates objects;
* every error type survives the wire (``to_body`` -> ``error_from_body``);
* ``import ckptd_client`` needs none of the server's dependencies.
"""

from __future__ import annotations

import json
import pickle
import subprocess
import sys
import textwrap
from datetime import datetime, timezone

import jsonschema
import pytest
from pydantic import ValidationError

import ckptd_schemas
from ckptd_schemas.filedigest import StreamDigest, xxh3_hex
from ckptd.store.merge import merge_indexes
from ckptd_schemas import (
    BoxChunk, CkptdError, FileEntry, FlatChunk, InvalidIndex, Location, Manifest, ObjectEntry, ParamGroup,
    RankIndex, TensorEntry, TilingError, Topology, error_from_body,
)
from ckptd_schemas import jsonschema as schema_export

T0 = datetime(2024, 5, 1, 12, 0, tzinfo=timezone.utc)
BLOCK = 4096


# -- builders ------------------------------------------------------------------


class FakeRankFiles:
    """Lays chunks out in a rank's data file with real bytes and digests."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.name = f"data-r{rank}-0.bin"
        self.buf = bytearray()

    def add(self, data: bytes) -> Location:
        loc = Location(file=self.name, offset=len(self.buf), length=len(data), raw_length=len(data),
                       xxh3=xxh3_hex(data))
        self.buf += data
        return loc

    def entry(self) -> FileEntry:
        d = StreamDigest(BLOCK)
        d.update(bytes(self.buf))
        whole, blocks = d.finish()
        return FileEntry(size=len(self.buf), xxh3=whole, block_size=BLOCK, blocks=blocks)


def rank_indexes(world: int = 2, *, rng_differs: bool = True) -> tuple[list[RankIndex], dict[str, FileEntry]]:
    """An FSDP-like save: dim-0 shards, a ZeRO flat-sharded optimizer state, objects, param groups."""
    rows, cols = 6, 4
    indexes, files = [], {}
    for r in range(world):
        f = FakeRankFiles(r)
        lo, hi = r * rows // world, (r + 1) * rows // world
        wq = TensorEntry(
            name="model.layers.0.attn.wq.weight", shape=[rows, cols], dtype="float32", group="model",
            placement="(Shard(dim=0),)",
            chunks=[BoxChunk(rank=r, offsets=[lo, 0], sizes=[hi - lo, cols],
                             location=f.add(bytes([r]) * ((hi - lo) * cols * 4)))],
        )
        n = rows * cols
        s, e = r * n // world, (r + 1) * n // world
        exp_avg = TensorEntry(
            name="optim.state.layers.0.attn.wq.weight.exp_avg", shape=[rows, cols], dtype="bfloat16",
            group="optim",
            chunks=[FlatChunk(rank=r, start=s, length=e - s, location=f.add(bytes([r + 10]) * ((e - s) * 2)))],
        )
        tensors = [wq, exp_avg]
        if r == 0:  # a replicated tensor, saved once
            tensors.append(TensorEntry(name="model.step", shape=[], dtype="int64", group="model",
                                       chunks=[BoxChunk(rank=0, offsets=[], sizes=[], location=f.add(b"\x07" * 8))]))
        pick = pickle.dumps({"rank": r} if rng_differs else {"seed": 1})
        objects = [
            ObjectEntry(name="sched", rank=r, encoding="json", value={"last_epoch": 3, "lr": [0.1, 0.01]}),
            ObjectEntry(name="rng", rank=r, encoding="pickle", location=f.add(pick)),
            ObjectEntry(name="loader", rank=r, encoding="json", value={"pos": 100 * r}),
        ]
        groups = [ParamGroup(optimizer="optim", index=0, params=["model.layers.0.attn.wq.weight"],
                             hyperparams={"lr": 0.001, "betas": [0.9, 0.95], "weight_decay": 0.1})]
        indexes.append(RankIndex(rank=r, world_size=world, coords={"dp": r}, mesh={"dp": world},
                                 layouts={"model": f"fsdp2:dp={world}", "optim": f"zero3:dp={world}"},
                                 tensors=tensors, objects=objects, param_groups=groups, files=[f.name]))
        files[f.name] = f.entry()
    return indexes, files


def merged(world: int = 2, **kw) -> Manifest:
    indexes, files = rank_indexes(world, **kw)
    return merge_indexes(run="gpt", name="1000", session="s-abc", step=1000, created_at=T0,
                         world_size=world, indexes=indexes, files=files)


def small_manifest(**over) -> dict:
    """Keyword arguments of a minimal valid manifest, for breaking one thing at a time."""
    loc = Location(file="data-r0-0.bin", offset=0, length=48, raw_length=48, xxh3="0" * 16)
    t = TensorEntry(name="model.w", shape=[3, 4], dtype="float32", group="model",
                    chunks=[BoxChunk(rank=0, offsets=[0, 0], sizes=[3, 4], location=loc)])
    kw = dict(run="gpt", name="1", session="s", created_at=T0, topology=Topology(world_size=1), tensors=[t],
              files={"data-r0-0.bin": FileEntry(size=48, xxh3="1" * 16, block_size=BLOCK, blocks=["2" * 16])})
    kw.update(over)
    return kw


def loc(length: int, file: str = "data-r0-0.bin", offset: int = 0, **kw) -> Location:
    return Location(file=file, offset=offset, length=length, raw_length=kw.pop("raw_length", length),
                    xxh3="0" * 16, **kw)


# -- JSON Schema -----------------------------------------------------------------


def test_committed_schema_is_current():
    assert schema_export.SCHEMA_PATH.exists(), "run: python -m ckptd_schemas.jsonschema"
    assert schema_export.SCHEMA_PATH.read_text() == schema_export.render(), (
        "schemas/manifest.schema.json is stale: regenerate with `python -m ckptd_schemas.jsonschema`"
    )


def test_schema_validates_real_manifest():
    schema = json.loads(schema_export.SCHEMA_PATH.read_text())
    jsonschema.Draft202012Validator.check_schema(schema)
    m = merged(world=3)
    doc = json.loads(m.model_dump_json())  # exactly what the store writes
    jsonschema.Draft202012Validator(schema).validate(doc)
    # the schema is not vacuous: it refuses what the models refuse
    validator = jsonschema.Draft202012Validator(schema)
    bad = json.loads(m.model_dump_json())
    bad["tensors"][0]["dtype"] = "float128"
    assert not validator.is_valid(bad)
    bad = json.loads(m.model_dump_json())
    bad["tensors"][0]["table"]["file"][0] = "../escape"
    assert not validator.is_valid(bad)
    bad = json.loads(m.model_dump_json())
    bad["surprise"] = 1
    assert not validator.is_valid(bad)
    bad = json.loads(m.model_dump_json())
    bad["tensors"][0]["table"]["codec"] = ["lz4"] * len(bad["tensors"][0]["table"]["xxh3"])
    assert not validator.is_valid(bad)
    # and a dump round-trips through the models unchanged
    assert Manifest.model_validate_json(m.model_dump_json()) == m


# -- validation at construction -------------------------------------------------


def _err(exc_info) -> str:
    return str(exc_info.value)


def test_chunk_outside_shape():
    with pytest.raises(ValidationError) as ei:
        TensorEntry(name="model.layers.3.w", shape=[4, 4], dtype="float32", group="model",
                    chunks=[BoxChunk(rank=5, offsets=[2, 0], sizes=[3, 4], location=loc(48))])
    msg = _err(ei)
    assert "'model.layers.3.w'" in msg and "rank 5" in msg and "outside" in msg
    with pytest.raises(ValidationError) as ei:
        TensorEntry(name="optim.x", shape=[4, 4], dtype="float32", group="optim",
                    chunks=[FlatChunk(rank=2, start=10, length=7, location=loc(28))])
    msg = _err(ei)
    assert "'optim.x'" in msg and "rank 2" in msg and "[10, 17)" in msg


def test_chunk_wrong_ndim():
    with pytest.raises(ValidationError) as ei:
        TensorEntry(name="model.w", shape=[4, 4], dtype="float32", group="model",
                    chunks=[BoxChunk(rank=1, offsets=[0], sizes=[4], location=loc(16))])
    msg = _err(ei)
    assert "'model.w'" in msg and "rank 1" in msg and "1-d" in msg and "2-d" in msg
    with pytest.raises(ValidationError) as ei:  # offsets and sizes disagreeing
        TensorEntry(name="model.w", shape=[4, 4], dtype="float32", group="model",
                    chunks=[BoxChunk(rank=1, offsets=[0, 0], sizes=[4], location=loc(16))])
    assert "'model.w'" in _err(ei)


def test_raw_length_must_match_numel():
    with pytest.raises(ValidationError) as ei:
        TensorEntry(name="model.w", shape=[4, 4], dtype="bfloat16", group="model",
                    chunks=[BoxChunk(rank=0, offsets=[0, 0], sizes=[4, 4], location=loc(64))])
    msg = _err(ei)
    assert "'model.w'" in msg and "raw_length 64" in msg and "bfloat16" in msg
    with pytest.raises(ValidationError) as ei:  # a raw chunk's stored length is its raw length
        Location(file="data-r0-0.bin", offset=0, length=10, raw_length=12, xxh3="0" * 16)
    assert "'data-r0-0.bin'" in _err(ei)
    # zstd chunks store fewer bytes than they decode to
    TensorEntry(name="model.w", shape=[4, 4], dtype="bfloat16", group="model",
                chunks=[BoxChunk(rank=0, offsets=[0, 0], sizes=[4, 4], location=loc(9, codec="zstd", raw_length=32))])


def test_location_outside_file():
    base = small_manifest()
    t = base["tensors"][0]
    moved = t.model_copy(update={"chunks": [t.chunks[0].model_copy(update={
        "location": loc(48, offset=8)})]})
    with pytest.raises(ValidationError) as ei:
        Manifest(**small_manifest(tensors=[moved]))
    msg = _err(ei)
    assert "'model.w'" in msg and "'data-r0-0.bin'" in msg and "[8, 56)" in msg
    elsewhere = t.model_copy(update={"chunks": [t.chunks[0].model_copy(update={
        "location": loc(48, file="data-r9-0.bin")})]})
    with pytest.raises(ValidationError) as ei:
        Manifest(**small_manifest(tensors=[elsewhere]))
    msg = _err(ei)
    assert "'model.w'" in msg and "'data-r9-0.bin'" in msg
    with pytest.raises(ValidationError) as ei:
        Manifest(**small_manifest(objects=[ObjectEntry(name="rng", encoding="pickle", location=loc(8, offset=44))]))
    msg = _err(ei)
    assert "'rng'" in msg and "'data-r0-0.bin'" in msg


def test_duplicate_tensor_names():
    t = small_manifest()["tensors"][0]
    with pytest.raises(ValidationError) as ei:
        Manifest(**small_manifest(tensors=[t, t]))
    assert "model.w" in _err(ei) and "more than once" in _err(ei)


def test_unknown_dtype():
    with pytest.raises(ValidationError) as ei:
        TensorEntry(name="model.w", shape=[4], dtype="float128", group="model", chunks=[])
    msg = _err(ei)
    assert "'model.w'" in msg and "dtype" in msg and "float128" in msg
    with pytest.raises(ValidationError) as ei:
        Manifest(**small_manifest(tensors=[{"name": "model.odd", "shape": [1], "dtype": "torch.float32",
                                            "group": "model", "chunks": []}]))
    msg = _err(ei)
    assert "'model.odd'" in msg and "dtype" in msg and "torch.float32" in msg
    with pytest.raises(ValidationError):
        TensorEntry(name="model.w", shape=[4], dtype=4, group="model", chunks=[])


@pytest.mark.parametrize("bad", ["../data-r0-0.bin", "/etc/passwd", "a/b", ".hidden", "..", "x\x00y", "", "a\\b"])
def test_bad_file_names(bad):
    with pytest.raises(ValidationError) as ei:
        Location(file=bad, offset=0, length=0, raw_length=0, xxh3="0" * 16)
    assert repr(bad)[1:-1] in _err(ei) or bad == ""
    # a file table key is a storage path too
    kw = small_manifest()
    kw["files"] = {**kw["files"], bad: FileEntry(size=0, xxh3="0" * 16, block_size=BLOCK, blocks=[])}
    with pytest.raises(ValidationError) as ei:
        Manifest(**kw)
    assert repr(bad)[1:-1] in _err(ei) or bad == ""


def test_other_malformed_fields():
    with pytest.raises(ValidationError):
        Location(file="f", offset=0, length=1, raw_length=1, xxh3="XYZ")  # not a hex digest
    with pytest.raises(ValidationError):
        FileEntry(size=10_000, xxh3="0" * 16, block_size=BLOCK, blocks=["0" * 16])  # needs 3 blocks
    with pytest.raises(ValidationError):
        Topology(world_size=4, mesh={"dp": 2, "tp": 3})
    with pytest.raises(ValidationError):
        ObjectEntry(name="rng", encoding="pickle", value=1)
    with pytest.raises(ValidationError):
        Manifest(**small_manifest(extra_field=1))


# -- merge -----------------------------------------------------------------------


def test_merge_builds_valid_manifest():
    m = merged(world=2)
    assert sorted(t.name for t in m.tensors) == [
        "model.layers.0.attn.wq.weight", "model.step", "optim.state.layers.0.attn.wq.weight.exp_avg"]
    assert m.topology.world_size == 2 and m.topology.mesh == {"dp": 2}
    assert m.topology.layouts == {"model": "fsdp2:dp=2", "optim": "zero3:dp=2"}
    assert len(m.param_groups) == 1
    wq = m.tensor("model.layers.0.attn.wq.weight")
    assert [c.rank for c in wq.chunks] == [0, 1]
    assert set(m.files) == {"data-r0-0.bin", "data-r1-0.bin"}


def test_merge_refuses_shape_mismatch():
    indexes, files = rank_indexes(3)
    t = indexes[2].tensors[0]
    bad = t.model_copy(update={"shape": [7, 4]})
    indexes[2] = indexes[2].model_copy(update={"tensors": [bad, *indexes[2].tensors[1:]]})
    with pytest.raises(InvalidIndex) as ei:
        merge_indexes(run="gpt", name="1000", session="s", step=1000, created_at=T0, world_size=3,
                      indexes=indexes, files=files)
    e = ei.value
    assert "'model.layers.0.attn.wq.weight'" in e.message
    assert "rank 0" in e.message and "rank 2" in e.message
    assert "[6, 4]" in e.message and "[7, 4]" in e.message
    assert e.details["tensor"] == "model.layers.0.attn.wq.weight" and e.details["ranks"] == [0, 2]


def test_merge_refuses_dtype_mismatch():
    indexes, files = rank_indexes(2)
    t = indexes[1].tensors[1]
    bad = TensorEntry(name=t.name, shape=t.shape, dtype="float16", group=t.group, chunks=t.chunks)
    indexes[1] = indexes[1].model_copy(update={"tensors": [indexes[1].tensors[0], bad]})
    with pytest.raises(InvalidIndex) as ei:
        merge_indexes(run="gpt", name="1000", session="s", step=None, created_at=T0, world_size=2,
                      indexes=indexes, files=files)
    e = ei.value
    assert "'optim.state.layers.0.attn.wq.weight.exp_avg'" in e.message
    assert "bfloat16" in e.message and "float16" in e.message
    assert "rank 0" in e.message and "rank 1" in e.message
    assert e.details["ranks"] == [0, 1]


def test_merge_refuses_incomplete_tiling():
    indexes, files = rank_indexes(2)
    indexes[1] = indexes[1].model_copy(update={"tensors": [indexes[1].tensors[1]]})  # rank 1's rows missing
    with pytest.raises(TilingError) as ei:
        merge_indexes(run="gpt", name="1000", session="s", step=1, created_at=T0, world_size=2,
                      indexes=indexes, files=files)
    assert "'model.layers.0.attn.wq.weight'" in ei.value.message
    assert ei.value.details["ranks"] == [0]


def test_merge_objects_dedup_and_per_rank():
    m = merged(world=3)
    objs = {(o.name, o.rank): o for o in m.objects}
    # identical everywhere: one entry, rank None
    assert ("sched", None) in objs and not any(n == "sched" and r is not None for n, r in objs)
    assert objs[("sched", None)].value == {"last_epoch": 3, "lr": [0.1, 0.01]}
    # different per rank: one entry per rank, each with its own value / bytes
    assert sorted(r for n, r in objs if n == "loader") == [0, 1, 2]
    assert [objs[("loader", r)].value for r in range(3)] == [{"pos": 0}, {"pos": 100}, {"pos": 200}]
    assert sorted(r for n, r in objs if n == "rng") == [0, 1, 2]
    assert len({objs[("rng", r)].location.xxh3 for r in range(3)}) == 3
    # identical pickles dedupe too
    m2 = merged(world=3, rng_differs=False)
    rng = [o for o in m2.objects if o.name == "rng"]
    assert len(rng) == 1 and rng[0].rank is None


def test_merge_object_missing_on_a_rank_is_kept_per_rank():
    indexes, files = rank_indexes(2)
    only0 = ObjectEntry(name="only.rank0", rank=0, encoding="json", value=[1, 2])
    indexes[0] = indexes[0].model_copy(update={"objects": [*indexes[0].objects, only0]})
    m = merge_indexes(run="gpt", name="1000", session="s", step=1, created_at=T0, world_size=2,
                      indexes=indexes, files=files)
    entries = [o for o in m.objects if o.name == "only.rank0"]
    assert [(o.rank, o.value) for o in entries] == [(0, [1, 2])]


def test_merge_is_deterministic():
    indexes, files = rank_indexes(3)
    a = merge_indexes(run="gpt", name="1000", session="s", step=1, created_at=T0, world_size=3,
                      indexes=indexes, files=files)
    b = merge_indexes(run="gpt", name="1000", session="s", step=1, created_at=T0, world_size=3,
                      indexes=list(reversed(indexes)), files=dict(reversed(list(files.items()))))
    assert a.model_dump_json() == b.model_dump_json()


# -- errors ------------------------------------------------------------------------


def _all_error_classes() -> list[type[CkptdError]]:
    out, todo = [], [CkptdError]
    while todo:
        cls = todo.pop()
        out.append(cls)
        todo.extend(cls.__subclasses__())
    return out


def test_error_codes_unique_and_exported():
    classes = [c for c in _all_error_classes() if c.__module__.startswith("ckptd_schemas")]
    codes = [c.code for c in classes]
    assert len(codes) == len(set(codes)), codes
    for c in classes:
        assert getattr(ckptd_schemas, c.__name__) is c
        assert 400 <= c.status < 600


@pytest.mark.parametrize("cls", _all_error_classes(), ids=lambda c: c.__name__)
def test_error_round_trip(cls):
    e = cls(f"tensor 'model.w': {cls.__name__} happened", tensor="model.w", ranks=[0, 3], covered=5, file="f")
    body = json.loads(json.dumps(e.to_body()))  # through the wire
    back = error_from_body(body, e.status)
    assert type(back) is cls
    assert back.message == e.message and str(back) == str(e)
    assert back.details == e.details
    assert back.status == cls.status and back.code == cls.code
    plain = cls("no details")
    back = error_from_body(json.loads(json.dumps(plain.to_body())), plain.status)
    assert type(back) is cls and back.details == {} and back.message == "no details"


def test_error_from_unexpected_bodies():
    assert type(error_from_body({"detail": [{"msg": "field required"}]}, 422)).__name__ == "InvalidRequest"
    assert type(error_from_body("not json", 404)).__name__ == "NotFound"
    e = error_from_body({"error": {"code": "from-the-future", "message": "m"}}, 500)
    assert type(e) is CkptdError and e.message == "m"
    assert type(error_from_body(None, 502)) is CkptdError


# -- client import without the server ----------------------------------------------

BLOCKED = ["fastapi", "uvicorn", "starlette", "s3fs", "ckptd"]


def test_client_imports_without_server_dependencies():
    script = textwrap.dedent(
        f"""
        import importlib.abc, sys
        BLOCKED = {BLOCKED!r}

        class Block(importlib.abc.MetaPathFinder):
            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] in BLOCKED:
                    raise ImportError(f"blocked import of {{name}}")
                return None

        sys.meta_path.insert(0, Block())
        for mod in list(sys.modules):
            assert mod.split(".")[0] not in BLOCKED, mod
        try:
            import fastapi  # noqa: F401
        except ImportError:
            pass
        else:
            raise SystemExit("the blocker does not work")

        import ckptd_client
        from ckptd_client import CheckpointClient, FlatShard, ChecksumMismatch, CkptdError  # noqa: F401
        import ckptd_schemas
        assert issubclass(ckptd_client.ChecksumMismatch, ckptd_schemas.CkptdError)
        loaded = sorted({{m.split(".")[0] for m in sys.modules}} & set(BLOCKED))
        assert not loaded, loaded
        print("client-import-ok")
        """
    )
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=180)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "client-import-ok" in r.stdout
