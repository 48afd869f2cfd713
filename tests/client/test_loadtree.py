"""``ckptd_client._loadtree``: a loading rank's metadata through the load tree, every piece checked.

A real ``Transport`` over loopback HTTP to a peer (``canned_http``) that answers with a real
``LoadTree`` of a small two-rank manifest (as the service's routes do), or with what a damaged or
lying service would send:

* ``fetch_head``: the head comes back checked against the root the marker names (in either case of hex
  digits), with the name ``latest`` resolved to and the skipped checkpoints (a header that does not
  parse: none); a head whose bytes changed is ``CorruptCheckpoint``; a service or a checkpoint without
  load trees (a plain 404, or an answer without the root header) gives None, while a checkpoint that
  does not exist is raised;
* ``fetch_pieces``: the rank's pieces plan the reads the whole manifest plans, and restore the objects
  the rank's own entries say; a changed row, an answer that does not parse, or one that leaves part of a
  region out is ``CorruptCheckpoint``; the service's file paths are used only when every fetch has one.
"""

from __future__ import annotations

import json
from datetime import datetime, timezone

import pytest

from ckptd_client._loadtree import fetch_head, fetch_pieces
from ckptd_client.transport import Transport
from ckptd_schemas import (
    BoxChunk, CheckpointNotFound, CorruptCheckpoint, FileEntry, FlatChunk, Location, Manifest, ObjectEntry,
    ReadRequest, TensorEntry, Topology, plan_reads,
)
from ckptd_schemas.api import LOAD_TREE_HEADER, SKIPPED_HEADER
from ckptd_schemas.loadtree import LoadTree

from .canned_http import CannedPeer

BASE = "/v1/checkpoints/gpt/12"


def _manifest() -> Manifest:
    tensors = [
        TensorEntry(name="model.w", shape=[4, 2], dtype="float32", group="model", chunks=[
            BoxChunk(rank=r, offsets=[2 * r, 0], sizes=[2, 2], location=Location(
                file=f"r{r}.bin", offset=0, length=16, raw_length=16, xxh3=f"{r + 1:016x}")) for r in range(2)]),
        TensorEntry(name="optim.m", shape=[6], dtype="float32", group="optim", chunks=[
            FlatChunk(rank=r, start=3 * r, length=3, location=Location(
                file=f"r{r}.bin", offset=16, length=12, raw_length=12, xxh3=f"{r + 5:016x}")) for r in range(2)]),
    ]
    objects = [ObjectEntry(name="cfg", encoding="json", value={"lr": 0.1}),
               *[ObjectEntry(name="rng", rank=r, encoding="json", value=[r]) for r in range(2)]]
    files = {f"r{r}.bin": FileEntry(size=28, xxh3=f"{r + 9:016x}", block_size=4096, blocks=[f"{r + 9:016x}"])
             for r in range(2)}
    return Manifest(run="gpt", name="12", step=12, session="s-1", created_at=datetime(2026, 1, 1, tzinfo=timezone.utc),
                    topology=Topology(world_size=2), tensors=tensors, objects=objects, files=files)


M = _manifest()
TREE = LoadTree(M)
REQUESTS = [ReadRequest(name="model.w", offsets=[1, 0], sizes=[2, 2]), ReadRequest(name="optim.m", flat_start=2,
                                                                                   flat_length=2)]


class Service:
    """What the peer answers: the real tree's head and answers, unless a test changes them."""

    def __init__(self) -> None:
        self.head_status, self.head_headers, self.head_body = 200, {LOAD_TREE_HEADER: TREE.root,
                                                                    "X-Ckptd-Name": "12"}, TREE.head
        self.edit_answer = lambda answer: answer
        self.raw_answer: bytes | None = None

    def __call__(self, method: str, path: str, body: bytes):
        if method == "GET" and path == f"{BASE}/load-tree":
            return self.head_status, self.head_headers, self.head_body
        if method == "POST" and path == f"{BASE}/load-tree":
            if self.raw_answer is not None:
                return 200, {}, self.raw_answer
            asked = json.loads(body)
            answer = TREE.answer([ReadRequest(**r) for r in asked["requests"]], asked["objects"], asked["rank"])
            answer = json.loads(json.dumps(answer))
            if asked["local_paths"]:
                answer["local_paths"] = {f: f"/srv/root/{f}" for f in answer["files"]}
            return 200, {"Content-Type": "application/json"}, json.dumps(self.edit_answer(answer)).encode()
        return 404, {}, b'{"detail": "Not Found"}'


@pytest.fixture
def service():
    svc = Service()
    with CannedPeer(svc) as peer:
        t = Transport(peer.url, retry_seconds=0, token="")
        svc.transport, svc.seen = t, peer.seen
        yield svc
        t.close()


# -- fetch_head ------------------------------------------------------------------------------------------

def test_the_head_is_checked_against_the_markers_root(service):
    service.head_headers = {LOAD_TREE_HEADER: TREE.root.upper(), "X-Ckptd-Name": "12",
                            SKIPPED_HEADER: json.dumps([{"ref": "gpt/13", "reason": "verification failed"}])}
    head = fetch_head(service.transport, "gpt", "12")
    assert head.head.root == TREE.root and head.head.raw == TREE.head and head.head.ref == "gpt/12"
    assert head.name == "12" and [s.ref for s in head.skipped] == ["gpt/13"]
    assert set(head.head.tensors()) == {"model.w", "optim.m"}


def test_the_resolved_name_and_a_skipped_header_that_does_not_parse(service):
    service.head_headers = {LOAD_TREE_HEADER: TREE.root, "X-Ckptd-Name": "11", SKIPPED_HEADER: "[{]"}
    head = fetch_head(service.transport, "gpt", "12")
    assert head.name == "11" and head.skipped == []
    service.head_headers = {LOAD_TREE_HEADER: TREE.root}
    assert fetch_head(service.transport, "gpt", "12").name == "12"


@pytest.mark.parametrize("damage", ["byte", "root"])
def test_a_head_that_does_not_hash_to_the_root_is_corrupt(service, damage):
    if damage == "byte":
        service.head_body = TREE.head.replace(b'"model.w"', b'"model.W"')
    else:
        service.head_headers = {LOAD_TREE_HEADER: "0" * 32}
    with pytest.raises(CorruptCheckpoint) as info:
        fetch_head(service.transport, "gpt", "12")
    assert info.value.details == {"file": "load tree"}


def test_no_load_tree_gives_none(service):
    service.head_status, service.head_headers, service.head_body = 404, {}, b'{"detail": "Not Found"}'
    assert fetch_head(service.transport, "gpt", "12") is None  # a service without the route
    service.head_status, service.head_body = 404, json.dumps(
        {"error": {"code": "not_found", "message": "gpt/12 has no load tree"}}).encode()
    assert fetch_head(service.transport, "gpt", "12") is None  # a checkpoint committed before load trees
    service.head_status, service.head_headers, service.head_body = 200, {}, b"{}"
    assert fetch_head(service.transport, "gpt", "12") is None  # an answer that is not about a load tree
    service.head_headers = {LOAD_TREE_HEADER: ""}
    assert fetch_head(service.transport, "gpt", "12") is None  # a marker that names no root


def test_a_checkpoint_that_does_not_exist_is_raised(service):
    service.head_status, service.head_headers = 404, {}
    service.head_body = json.dumps({"error": {"code": "checkpoint_not_found", "message": "no gpt/12",
                                              "details": {"ref": "gpt/12"}}}).encode()
    with pytest.raises(CheckpointNotFound):
        fetch_head(service.transport, "gpt", "12")


# -- fetch_pieces ----------------------------------------------------------------------------------------

def _pieces(service, rank: int = 1, objects=("cfg", "rng", "absent"), local_paths: bool = False):
    head = fetch_head(service.transport, "gpt", "12").head
    return fetch_pieces(service.transport, BASE, head, REQUESTS, list(objects), rank, local_paths=local_paths)


def test_the_pieces_plan_what_the_whole_manifest_plans(service):
    pieces = _pieces(service)
    asked = json.loads(service.seen[-1].body)
    assert asked == {"requests": [r.model_dump(exclude_none=True) for r in REQUESTS],
                     "objects": ["cfg", "rng", "absent"], "rank": 1, "local_paths": False}
    assert pieces.plan(REQUESTS) == plan_reads(M, REQUESTS)
    assert pieces.answer_bytes > 0 and pieces.local_paths is None
    assert pieces.objects["cfg"].value == {"lr": 0.1}
    assert pieces.objects["rng"].value == [1] and pieces.objects["rng"].rank == 1  # this rank's own entry
    assert pieces.manifest.ref == "gpt/12"


def test_the_services_paths_are_used_when_every_fetch_has_one(service):
    pieces = _pieces(service, local_paths=True)
    plan = pieces.plan(REQUESTS)
    assert plan.local_paths == {f.file: f"/srv/root/{f.file}" for f in plan.fetches}
    assert json.loads(service.seen[-1].body)["local_paths"] is True

    def drop_one(answer):
        answer["local_paths"].pop("r0.bin")
        return answer

    service.edit_answer = drop_one
    assert _pieces(service, local_paths=True).plan(REQUESTS).local_paths is None


def test_a_changed_row_is_corrupt(service):
    def move_row(answer):
        rows = answer["tensors"]["model.w"]["rows"]
        first = next(iter(rows))
        rows[first][3] += 4  # another offset in the file
        return answer

    service.edit_answer = move_row
    with pytest.raises(CorruptCheckpoint, match="tensor 'model.w': chunk row"):
        _pieces(service)


def test_a_left_out_row_is_refused_when_the_plan_is_made(service):
    def drop_row(answer):
        rows, proofs = answer["tensors"]["model.w"]["rows"], answer["tensors"]["model.w"]["proofs"]
        key = max(rows)
        del rows[key], proofs[key]
        return answer

    service.edit_answer = drop_row
    pieces = _pieces(service)
    with pytest.raises(CorruptCheckpoint, match="tensor 'model.w': the chunks the service answered hold 2 of the 4"):
        pieces.plan(REQUESTS)


@pytest.mark.parametrize("raw", [b"not json", b"[]", b'{"root": null}', b"{}"])
def test_an_answer_that_does_not_parse_is_corrupt(service, raw):
    service.raw_answer = raw
    with pytest.raises(CorruptCheckpoint) as info:
        _pieces(service)
    assert info.value.details == {"file": "load tree"}
