"""A loading rank's metadata through the checkpoint's load tree: what it needs, each piece checked.

Call order inside a load (``_load._prepare``):

1. :func:`fetch_head`: ``GET .../load-tree``, the head of the load tree (``ckptd_schemas.loadtree``:
   the tensors' names, shapes and dtypes, the objects' directory, the trees' roots), hashed against
   the root the checkpoint's ``COMMITTED`` marker names (``X-Ckptd-Load-Tree``). ``None`` from a
   service, or for a checkpoint, without load trees: the load reads the whole manifest instead;
2. the state dict is matched against the head, and the rank's regions are described;
3. :func:`fetch_pieces`: ``POST .../load-tree`` with those regions and the object names it restores
   (several requests, their answers merged, when they are more than one request may name:
   ``request_batches``); every chunk row, file and object entry of the answer is checked against the
   head (``verify_answer``), which gives a manifest of just those pieces;
4. :meth:`Pieces.plan` plans the reads from that manifest here (``plan_reads``, as the service would)
   and refuses a plan that leaves part of a region unfilled (``check_covered``).

What a rank fetches and parses is O(tensors + its pieces x log ranks), whatever the world size.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Sequence

from ckptd_schemas import CheckpointNotFound, CorruptCheckpoint, Manifest, NotFound, ObjectEntry, PayloadTooLarge, \
    ReadPlan, ReadRequest, plan_reads
from ckptd_schemas.api import LOAD_TREE_HEADER, MAX_READ_REQUESTS, SkippedCheckpoint
from ckptd_schemas.readplan import request_batches
from ckptd_schemas.loadtree import LoadHead, check_covered, verify_answer

from ._manifest import skipped_in
from .transport import Transport

__all__ = ["Head", "Pieces", "fetch_head", "fetch_pieces"]


@dataclass
class Head:
    head: LoadHead
    name: str  # the concrete name ``name`` resolved to
    skipped: list[SkippedCheckpoint]


@dataclass
class Pieces:
    """The checked pieces of the checkpoint a rank loads, and the objects it restores (a checkpoint
    without a load tree: its whole manifest, checked against its digest, and no objects)."""

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
    try:
        raw, headers = transport.request("GET", f"/v1/checkpoints/{run}/{name}/load-tree",
                                         sink=lambda r: (r.read(), r.headers))
    except CheckpointNotFound:
        raise
    except NotFound:
        return None
    root = headers.get(LOAD_TREE_HEADER)
    if not root:  # not an answer about a load tree: the manifest, checked against its own digest, is read
        return None
    head = LoadHead.parse(raw, root.lower())
    return Head(head, headers.get("X-Ckptd-Name", name), skipped_in(headers, f"{run}/{name}"))


def fetch_pieces(transport: Transport, base: str, head: LoadHead, requests: Sequence[ReadRequest],
                 objects: Sequence[str], rank: int, *, local_paths: bool) -> Pieces:
    """The rank's pieces of the checkpoint at ``base``, every one checked against ``head``: one request
    per batch of its regions (``request_batches``), the object names spread over them, the answers'
    rows, files and objects merged (each keeps its own proof) before they are checked together."""
    names = list(objects)

    def send(most: int) -> tuple[dict[str, Any], int]:
        batches = request_batches(requests, most) or [(0, 0)]
        per = -(-len(names) // len(batches)) if names else 0
        if per > most:  # more names than regions to carry them: more requests
            batches += [(len(requests), len(requests))] * (-(-len(names) // most) - len(batches))
            per = most
        answer: dict[str, Any] = {}
        size = 0
        for k, (start, end) in enumerate(batches):
            body = {"requests": [r.model_dump(exclude_none=True) for r in requests[start:end]],
                    "objects": names[k * per:(k + 1) * per], "rank": rank, "local_paths": local_paths}
            raw = transport.request("POST", f"{base}/load-tree", json=body, sink=lambda r: r.read())
            size += len(raw)
            try:
                _merge_answer(answer, json.loads(raw))
            except (ValueError, TypeError, KeyError, AttributeError) as e:  # not the shape of an answer
                raise CorruptCheckpoint(f"{head.ref}: the service's load-tree answer does not parse: {e}"[:400],
                                        file="load tree") from None
        return answer, size

    try:
        answer, size = send(MAX_READ_REQUESTS)
    except PayloadTooLarge as e:  # 413 with ``max_requests``: a service configured under the default
        limit = e.details.get("max_requests")
        if not isinstance(limit, int) or not 0 < limit < MAX_READ_REQUESTS:
            raise
        answer, size = send(limit)
    try:
        manifest, chosen = verify_answer(head, answer, requests, rank)
    except (ValueError, TypeError, KeyError, AttributeError) as e:  # not the shape of an answer
        raise CorruptCheckpoint(f"{head.ref}: the service's load-tree answer does not parse: {e}"[:400],
                                file="load tree") from None
    paths = answer.get("local_paths")
    return Pieces(manifest, chosen, paths if isinstance(paths, dict) else None, size)


def _merge_answer(into: dict[str, Any], part: dict[str, Any]) -> None:
    """Add one load-tree answer to ``into``: rows, proofs, files and objects by their keys (each piece
    is still checked against the head, so a part cannot vouch for another's); ``local_paths`` only
    when every part has them."""
    if not into:
        into.update(part)
        return
    into["root"] = into.get("root") if into.get("root") == part.get("root") else None  # parts of one tree
    for name, t in part["tensors"].items():
        mine = into["tensors"].setdefault(name, {"rows": {}, "proofs": {}})
        mine["rows"].update(t["rows"])
        mine["proofs"].update(t["proofs"])
    into["files"].update(part["files"])
    into["objects"].update(part["objects"])
    paths = into.get("local_paths")
    into["local_paths"] = {**paths, **part["local_paths"]} if isinstance(paths, dict) and isinstance(
        part.get("local_paths"), dict) else None
