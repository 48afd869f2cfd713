"""``ckptd_schemas.readplan.run_fetches``: the service side's one loop over a read plan, unit-tested with
real manifests (row bands with junk before each band, real block digests) and no server."""

from __future__ import annotations

import json

import pytest
import torch

from ckptd_schemas import ChecksumMismatch, ReadRequest, plan_reads, run_fetches
from ckptd_schemas.format.assemble import Destination, copy_into

from support import banded_manifest


def _read_from(files: dict[str, bytes], log: list | None = None):
    def read(f):
        if log is not None:
            log.append(("read", f.file, f.start))
        return files[f.file][f.start:f.end]
    return read


def test_every_copy_lands_once_after_its_fetch_is_verified():
    m, files, full = banded_manifest(40, 96, [7, 19, 33], flat=False, dtype=torch.float32)
    plan = plan_reads(m, [ReadRequest(name="model.w", offsets=[5, 0], sizes=[30, 96])])
    out = torch.zeros(30, 96)
    dest = Destination(out, [40, 96], box_offsets=[5, 0])
    log: list = []

    def copy(data, c):
        log.append(("copy", plan.fetches[c.fetch].file, c.fetch))
        copy_into(data, c, dest)

    seen = []
    run_fetches(plan, _read_from(files, log), copy, lambda f, data: seen.append((f.file, len(data))))
    assert torch.equal(out, full[5:35])
    assert seen == [(f.file, f.end - f.start) for f in plan.fetches]
    # each fetch's copies come right after it, each copy once
    assert [e for e in log if e[0] == "copy"] == [("copy", plan.fetches[c.fetch].file, c.fetch)
                                                  for c in sorted(plan.copies, key=lambda c: c.fetch)]
    for i, e in enumerate(log):  # a copy follows the read of its own fetch's file
        if e[0] == "copy":
            assert any(r[0] == "read" and r[1] == e[1] for r in log[:i]), log


def test_a_damaged_fetch_raises_before_any_of_its_copies_runs():
    m, files, _ = banded_manifest(40, 96, [20], flat=True, dtype=torch.bfloat16)
    plan = plan_reads(m, [ReadRequest(name="model.w", offsets=[0, 0], sizes=[40, 96])])
    bad = dict(files)
    f1 = plan.fetches[1]
    blob = bytearray(bad[f1.file])
    blob[f1.end - 1] ^= 0x01
    bad[f1.file] = bytes(blob)
    copied: list[int] = []
    with pytest.raises(ChecksumMismatch, match=f"file '{f1.file}'"):
        run_fetches(plan, _read_from(bad), lambda data, c: copied.append(c.fetch))
    assert copied and set(copied) == {0}  # the first fetch's copies ran, none of the damaged one's
    with pytest.raises(ChecksumMismatch, match="got"):  # a short read is damage too
        run_fetches(plan, lambda f: files[f.file][f.start:f.end - 1], lambda data, c: None)


def test_plans_of_batches_fill_what_one_plan_fills():
    """Requests split as a client splits them over the service's limit (``request_batches``) and
    planned batch by batch: every element lands where one plan puts it."""
    from ckptd_schemas.readplan import request_batches

    m, files, full = banded_manifest(40, 96, [7, 19, 33], flat=False, dtype=torch.float32)
    requests = [ReadRequest(name="model.w", offsets=[r, 0], sizes=[1, 96]) for r in range(40)]
    batches = request_batches(requests, most=6)
    assert batches[0] == (0, 6) and batches[-1] == (36, 40) and len(batches) == 7
    per = 200 // (len(json.dumps(requests[0].model_dump(exclude_none=True))) + 2)  # by bytes: 200 of body each
    assert request_batches(requests, most=100, body_bytes=1024 + 200) == [(i, min(i + per, 40))
                                                                          for i in range(0, 40, per)]
    assert request_batches([]) == [] and request_batches(requests) == [(0, 40)]
    out = torch.zeros(40, 96)
    dests = [Destination(out[r:r + 1], [40, 96], box_offsets=[r, 0]) for r in range(40)]
    for a, b in batches:
        run_fetches(plan_reads(m, requests[a:b]), _read_from(files),
                    lambda data, c, a=a: copy_into(data, c, dests[a + c.request]))
    assert torch.equal(out, full)
