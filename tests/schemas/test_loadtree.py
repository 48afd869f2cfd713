"""The load tree (``ckptd_schemas.loadtree``): a rank's answer, checked piece by piece against the head,
gives the plan the whole manifest gives; any piece changed, dropped or moved is refused; what a rank
receives does not grow with the world size. No service: the tree over manifests built here."""

from __future__ import annotations

import copy
import json
from datetime import datetime, timezone

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ckptd_schemas import (
    BoxChunk, CorruptCheckpoint, FileEntry, Location, Manifest, ObjectEntry, ReadRequest, TensorEntry, Topology,
    plan_reads,
)
from ckptd_schemas.loadtree import LoadHead, LoadTree, check_covered, verify_answer

from .test_geometry import checkpoints, requests_for

FAST = settings(max_examples=120, deadline=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


def _local_plan(m: Manifest, requests: list[ReadRequest], rank: int = 0, objects: tuple[str, ...] = ()):
    tree = LoadTree(m)
    head = LoadHead.parse(tree.head, tree.root)
    answer = json.loads(json.dumps(tree.answer(requests, objects, rank)))  # as it travels
    part, objs = verify_answer(head, answer, requests, rank)
    plan = plan_reads(part, requests)
    check_covered(plan, requests, part)
    return plan, objs, answer


@FAST
@given(st.data())
def test_a_ranks_checked_answer_plans_what_the_whole_manifest_plans(data) -> None:
    m, _, _ = data.draw(checkpoints())
    requests = data.draw(requests_for(m))
    plan, _, _ = _local_plan(m, requests)
    assert plan == plan_reads(m, requests)


def _bands(world: int, tensors: int = 20) -> Manifest:
    """A save of ``world`` ranks, each one row band of every tensor and one data file, with a global
    object, a per-rank object and an object every rank saved alike."""
    files, ts, objects = {}, [], [ObjectEntry(name="cfg", encoding="json", value={"lr": 0.1})]
    for r in range(world):
        files[f"r{r:06d}.bin"] = FileEntry(size=64 * tensors, xxh3="0" * 16, block_size=4096, blocks=["0" * 16])
        objects.append(ObjectEntry(name="rng", rank=r, encoding="json", value=r))
        if r % 3:
            objects.append(ObjectEntry(name="same", rank=r, encoding="json", value=7))
    for t in range(tensors):
        ts.append(TensorEntry(name=f"model.layers.{t}.weight", shape=[2 * world, 8], dtype="float32", group="model",
                              chunks=[BoxChunk(rank=r, offsets=[2 * r, 0], sizes=[2, 8], location=Location(
                                  file=f"r{r:06d}.bin", offset=64 * t, length=64, raw_length=64,
                                  xxh3=f"{(r * 1000 + t):016x}")) for r in range(world)]))
    return Manifest(run="big", name="1", step=1, session="s", created_at=datetime(2026, 1, 1, tzinfo=timezone.utc),
                    topology=Topology(world_size=world), tensors=ts, objects=objects, files=files)


def _rank_requests(m: Manifest, rank: int, world: int) -> list[ReadRequest]:
    return [ReadRequest(name=t.name, offsets=[2 * rank, 0], sizes=[2, 8]) for t in m.tensors]


def test_what_a_rank_receives_grows_with_log_r_not_r() -> None:
    sizes = {}
    for world in (64, 4096):
        m = _bands(world)
        rank = world // 3
        plan, objs, answer = _local_plan(m, _rank_requests(m, rank, world), rank, ("cfg", "rng", "same"))
        assert plan == plan_reads(m, _rank_requests(m, rank, world))
        assert objs["rng"].value == rank and objs["cfg"].value == {"lr": 0.1}
        assert objs["same"].value == 7  # rank // 3 * 3 saved none of its own: the value every rank saved
        sizes[world] = len(LoadTree(m).head) + len(json.dumps(answer))
    assert sizes[4096] < 2 * sizes[64], sizes  # 64x the ranks: the proofs' log grows, nothing else


def test_a_rank_with_no_entry_of_an_object_is_shown_it_has_none() -> None:
    m = _bands(8)
    m.objects[:] = [o for o in m.objects if not (o.name == "rng" and o.rank == 5)]
    _, objs, _ = _local_plan(m, [], 5, ("rng",))
    assert objs["rng"] is None
    _, objs, _ = _local_plan(m, [], 4, ("rng",))
    assert objs["rng"].value == 4


# -- tampering: every piece is checked -----------------------------------------------------------------

def _answer(world: int = 16, rank: int = 5) -> tuple[Manifest, LoadHead, dict, list[ReadRequest]]:
    m = _bands(world, 4)
    requests = _rank_requests(m, rank, world)
    tree = LoadTree(m)
    head = LoadHead.parse(tree.head, tree.root)
    return m, head, json.loads(json.dumps(tree.answer(requests, ("rng", "same", "cfg"), rank))), requests


def _first_row(answer: dict) -> tuple[dict, str]:
    got = answer["tensors"]["model.layers.0.weight"]
    return got, next(iter(got["rows"]))


TAMPERS = {
    "row moved": lambda a: _first_row(a)[0]["rows"][_first_row(a)[1]].__setitem__(0, [0, 0]),
    "row in another file": lambda a: _first_row(a)[0]["rows"][_first_row(a)[1]].__setitem__(2, "r000000.bin"),
    "row's digest": lambda a: _first_row(a)[0]["rows"][_first_row(a)[1]].__setitem__(6, "f" * 16),
    "row at another index": lambda a: _first_row(a)[0]["rows"].__setitem__(
        "0", _first_row(a)[0]["rows"].pop(_first_row(a)[1])),
    "proof cut": lambda a: _first_row(a)[0]["proofs"][_first_row(a)[1]].pop(),
    "file's blocks": lambda a: next(iter(a["files"].values()))["entry"]["blocks"].__setitem__(0, "e" * 16),
    "file's size": lambda a: next(iter(a["files"].values()))["entry"].__setitem__("size", 1 << 20),
    "file dropped": lambda a: a["files"].clear(),
    "object's value": lambda a: next(iter(a["objects"]["rng"].values()))["entry"].__setitem__("value", 99),
    "own object hidden": lambda a: a["objects"]["rng"].clear(),
    "uniform object hidden": lambda a: a["objects"]["cfg"].clear(),
    "another tree": lambda a: a.__setitem__("root", "0" * 32),
}


@pytest.mark.parametrize("tamper", sorted(TAMPERS))
def test_an_answer_changed_anywhere_is_refused(tamper: str) -> None:
    _, head, answer, requests = _answer()
    verify_answer(head, copy.deepcopy(answer), requests, 5)  # untouched: it holds
    TAMPERS[tamper](answer)
    with pytest.raises(CorruptCheckpoint):
        verify_answer(head, answer, requests, 5)


def test_an_answer_that_leaves_out_a_chunk_is_refused_when_planned() -> None:
    m, head, answer, _ = _answer()
    requests = [ReadRequest(name="model.layers.0.weight", offsets=[9, 0], sizes=[2, 8])]  # two ranks' rows
    answer = json.loads(json.dumps(LoadTree(m).answer(requests, (), 5)))
    got = answer["tensors"]["model.layers.0.weight"]
    assert len(got["rows"]) == 2
    dropped = next(iter(got["rows"]))
    del got["rows"][dropped], got["proofs"][dropped]
    part, _ = verify_answer(head, answer, requests, 5)  # what is left is the checkpoint's...
    with pytest.raises(CorruptCheckpoint, match="8 of the 16 elements"):
        check_covered(plan_reads(part, requests), requests, part)  # ...but not all of it


def test_a_head_that_is_not_the_markers_is_refused() -> None:
    m = _bands(4, 2)
    tree = LoadTree(m)
    raw = tree.head.replace(b'"step":1', b'"step":2')
    with pytest.raises(CorruptCheckpoint, match="COMMITTED marker"):
        LoadHead.parse(raw, tree.root)
