"""A loading rank's metadata through the checkpoint's load tree: what it needs, each piece checked.

Call order inside a load (``_load._prepare``):

1. :func:`fetch_head`: ``GET .../load-tree``, the head of the load tree (``ckptd_schemas.loadtree``:
   the tensors' names, shapes and dtypes, the objects' directory, the trees' roots), hashed against
   the root the checkpoint's ``COMMITTED`` marker names (``X-Ckptd-Load-Tree``). ``None`` from a
   service, or for a checkpoint, without load trees: the load reads the whole manifest instead;
2. the state dict is matched against the head, and the rank's regions are described;
3. :func:`fetch_pieces`: ``POST .../load-tree`` with those regions and the object names it restores;
   every chunk row, file and object entry of the answer is checked against the head
   (``verify_answer``), which gives a manifest of just those pieces;
4. :meth:`Pieces.plan` plans the reads from that manifest here (``plan_reads``, as the service would)
   and refuses a plan that leaves part of a region unfilled (``check_covered``).

What a rank fetches and parses is O(tensors + its pieces x log ranks), whatever the world size.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Sequence

import httpx

from ckptd_schemas import CheckpointNotFound, CorruptCheckpoint, Manifest, NotFound, ObjectEntry, ReadPlan, \
    ReadRequest, plan_reads
from ckptd_schemas.api import LOAD_TREE_HEADER, SKIPPED_HEADER, SkippedCheckpoint
from ckptd_schemas.loadtree import LoadHead, check_covered, verify_answer

from .transport import Transport

__all__ = ["Head", "Pieces", "fetch_head", "fetch_pieces"]


@dataclass
class Head:
    head: LoadHead
    name: str  # the concrete name ``name`` resolved to
    skipped: list[SkippedCheckpoint]


@dataclass
class Pieces:
    """The checked pieces of the checkpoint a rank loads, and the objects it restores."""

    manifest: Manifest  # only the rows, files and objects the answer proved
    objects: dict[str, ObjectEntry | None]
    local_paths: dict[str, str] | None
    answer_bytes: int

    def plan(self, requests: Sequence[ReadRequest]) -> ReadPlan:
        """The reads that fill ``requests``, planned here from the checked rows; every element covered."""
        plan = plan_reads(self.manifest, requests)
        check_covered(plan, requests, self.manifest)
        if self.local_paths and all(f.file in self.local_paths for f in plan.fetches):
            plan.local_paths = {f.file: self.local_paths[f.file] for f in plan.fetches}
        return plan


def fetch_head(transport: Transport, run: str, name: str) -> Head | None:
    """The checkpoint's load-tree head, checked against its marker's root; None when the service or the
    checkpoint has none (the caller reads the manifest)."""
    got: dict[str, Any] = {}

    def sink(resp: httpx.Response) -> bytes:
        got["headers"] = resp.headers
        return resp.read()

    try:
        raw = transport.request("GET", f"/v1/checkpoints/{run}/{name}/load-tree", sink=sink)
    except CheckpointNotFound:
        raise
    except NotFound:
        return None
    headers = got["headers"]
    root = headers.get(LOAD_TREE_HEADER)
    if not root:  # not an answer about a load tree: the manifest, checked against its own digest, is read
        return None
    head = LoadHead.parse(raw, root.lower())
    skipped: list[SkippedCheckpoint] = []
    if headers.get(SKIPPED_HEADER):
        try:
            skipped = [SkippedCheckpoint.model_validate(x) for x in json.loads(headers[SKIPPED_HEADER])]
        except (ValueError, TypeError):
            skipped = []
    return Head(head, headers.get("X-Ckptd-Name", name), skipped)


def fetch_pieces(transport: Transport, base: str, head: LoadHead, requests: Sequence[ReadRequest],
                 objects: Sequence[str], rank: int, *, local_paths: bool) -> Pieces:
    """The rank's pieces of the checkpoint at ``base``, every one checked against ``head``."""
    body = {"requests": [r.model_dump(exclude_none=True) for r in requests], "objects": list(objects),
            "rank": rank, "local_paths": local_paths}
    raw = transport.request("POST", f"{base}/load-tree", json=body, sink=lambda r: r.read())
    try:
        answer = json.loads(raw)
        manifest, chosen = verify_answer(head, answer, requests, rank)
    except (ValueError, TypeError, KeyError, AttributeError) as e:  # not the shape of an answer
        raise CorruptCheckpoint(f"{head.ref}: the service's load-tree answer does not parse: {e}"[:400],
                                file="load tree") from None
    paths = answer.get("local_paths")
    return Pieces(manifest, chosen, paths if isinstance(paths, dict) else None, len(raw))
