"""The incremental benchmark (bench/incremental.py) still runs, at a tiny size, so it cannot rot.
No timing assertions: what is asserted is what the run must show whatever the machine's speed."""

from __future__ import annotations

import json

import pytest

from support import BENCH_TIMEOUT_S, run_bench

pytestmark = pytest.mark.slow


@pytest.mark.timeout(BENCH_TIMEOUT_S + 60)
def test_bench_incremental_runs_small(tmp_path):
    out = tmp_path / "incremental.json"
    proc = run_bench("bench.incremental", "--mib", "8", "--steps", "3", "--settle", "0", "--optimizer",
                     "--out", str(out), "--workdir", str(tmp_path / "work"))
    res = json.loads(out.read_text())
    steps, s = res["steps"], res["summary"]
    assert [st["step"] for st in steps] == [1, 2, 3]
    assert steps[0]["ckptd_linked_bytes"] == 0 and all(st["ckptd_linked_bytes"] > 0 for st in steps[1:])
    assert all(st["ckptd_bytes"] < 0.5 * st["dcp_bytes"] for st in steps[1:])  # the frozen part is not written
    assert s["load_bit_exact"] is True and s["load_world"] == 3
    assert "| step | ckptd save (s) |" in proc.stdout
    assert not any((tmp_path / "work").iterdir()), "the work directory is removed"
