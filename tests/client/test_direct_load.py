"""Loads that scatter fetched bytes straight into the destination (client/_scatter.py) give exactly
what the buffered path (verify the whole fetch, then copy_into) gives, verify every block on the
stream, and step aside for copies they cannot place directly.

The manifests are real (chunks laid out in byte files with real digests), the plans come from the
service's pure planner, and the "response" is the file's bytes cut into random pieces.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ckptd_client._scatter import PieceFill, direct_targets, fill_targets
from ckptd_schemas.format.assemble import Destination, copy_into
from ckptd_schemas.readplan import verify_fetch
from ckptd_schemas import ChecksumMismatch, ReadRequest, plan_reads

from support import banded_manifest


def _pieces(blob: bytes, cuts: list[int]):
    edges = [0, *sorted(c % (len(blob) + 1) for c in cuts), len(blob)]
    return [blob[a:b] for a, b in zip(edges, edges[1:]) if b > a]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_direct_scatter_equals_buffered_copy(data):
    rows, cols = data.draw(st.integers(2, 40)), data.draw(st.integers(1, 300))
    cuts = sorted(set(data.draw(st.lists(st.integers(1, rows - 1), max_size=4))))
    flat = data.draw(st.booleans())
    dtype = data.draw(st.sampled_from([torch.float32, torch.bfloat16, torch.int64]))
    m, files, full = banded_manifest(rows, cols, cuts, flat, dtype)
    lo = data.draw(st.integers(0, rows - 1))
    hi = data.draw(st.integers(lo + 1, rows))
    plan = plan_reads(m, [ReadRequest(name="model.w", offsets=[lo, 0], sizes=[hi - lo, cols])])
    direct_out = torch.zeros(hi - lo, cols, dtype=dtype)
    buffered_out = torch.zeros(hi - lo, cols, dtype=dtype)
    for i, f in enumerate(plan.fetches):
        copies = [c for c in plan.copies if c.fetch == i]
        blob = files[f.file][f.start:f.end]
        targets = direct_targets(copies, [Destination(direct_out, [rows, cols], box_offsets=[lo, 0])])
        assert targets is not None  # row bands into a row band: always direct
        body = PieceFill(_pieces(blob, data.draw(st.lists(st.integers(0, 10**6), max_size=6))), f)
        fill_targets(f, body, targets)
        body.drain()
        verify_fetch(blob, f)
        for c in copies:
            copy_into(bytearray(blob), c, Destination(buffered_out, [rows, cols], box_offsets=[lo, 0]))
    assert torch.equal(direct_out, buffered_out)
    assert torch.equal(direct_out, full[lo:hi])


def test_every_block_is_checked_on_the_stream_including_skipped_bytes():
    m, files, _ = banded_manifest(64, 128, [20, 41], flat=False, dtype=torch.float32)
    plan = plan_reads(m, [ReadRequest(name="model.w", offsets=[30, 0], sizes=[20, 128])])
    f = plan.fetches[0]
    blob = bytearray(files[f.file][f.start:f.end])
    for flip in (0, len(blob) - 1):  # a junk byte the copy skips, then the last byte it places
        bad = bytearray(blob)
        bad[flip] ^= 0xFF
        out = torch.zeros(20, 128)
        targets = direct_targets([c for c in plan.copies if c.fetch == 0], [Destination(out, [64, 128], box_offsets=[30, 0])])
        with pytest.raises(ChecksumMismatch, match=f"file '{f.file}': bytes"):
            fill_targets(f, PieceFill([bytes(bad)], f), targets)


def test_copies_that_need_a_buffer_are_refused():
    m, _, _ = banded_manifest(16, 8, [8], flat=False, dtype=torch.float32)
    # a column slice of the destination is not contiguous: buffered path
    plan = plan_reads(m, [ReadRequest(name="model.w", offsets=[0, 2], sizes=[16, 4])])
    out = torch.zeros(16, 4)
    assert direct_targets(plan.copies, [Destination(out, [16, 8], box_offsets=[0, 2])]) is None
    # a destination of another dtype (a cast): buffered path
    plan = plan_reads(m, [ReadRequest(name="model.w", offsets=[0, 0], sizes=[16, 8])])
    assert direct_targets(plan.copies, [Destination(torch.zeros(16, 8, dtype=torch.float64), [16, 8],
                                                    box_offsets=[0, 0])]) is None
