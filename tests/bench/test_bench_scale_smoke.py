"""The scale benchmark (bench/scale.py) still runs, at a tiny scale, so it cannot rot: simulated ranks on
the wire protocol against a real ``ckptd serve``, DCP's planner beside it."""

from __future__ import annotations

import json

import pytest

from support import BENCH_TIMEOUT_S, run_bench


@pytest.mark.slow  # several seconds: with the slow tests, so the default run stays within its budget
@pytest.mark.timeout(BENCH_TIMEOUT_S + 60)
def test_bench_scale_runs_small(tmp_path):
    out = tmp_path / "scale.json"
    run_bench("bench.scale", "--ranks", "4,16", "--tensors", "3", "--sample", "3", "--out", str(out))
    rows = json.loads(out.read_text())["rows"]
    assert [r["ranks"] for r in rows] == [4, 16]
    for r in rows:
        assert r["plan_status"] == [200] and r["manifest_path_plan_status"] == [200]
        for key in ("save_waited_service_cpu_s", "save_nowait_service_cpu_s", "rank_metadata_bytes",
                    "manifest_path_metadata_bytes", "reshard_plan_wall_s", "dcp_global_plan_s", "dcp_rank_metadata_bytes"):
            assert r[key] > 0, key
        assert len(r["sampled_ranks"]) == 3
        # every target chunk of the reshard R -> R/2 planned once over the workers
        assert r["reshard_chunks_planned"] == (r["ranks"] // 2) * r["tensors"] and r["reshard_workers"] >= 1
