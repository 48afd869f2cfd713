"""The scale benchmarks (bench/scale.py, bench/scale_client.py) still run, at a tiny scale, so they cannot rot:
simulated ranks on the wire protocol against a real ``ckptd serve``, a real client rank in a fake process group,
DCP's planner beside them."""

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


@pytest.mark.slow  # a server, R simulated ranks and two fresh processes per world size
@pytest.mark.timeout(BENCH_TIMEOUT_S + 60)
def test_bench_scale_client_runs_small(tmp_path):
    """bench.scale_client: one real client rank in a fake process group of R, beside DCP's rank's share."""
    out = tmp_path / "scale_client.json"
    run_bench("bench.scale_client", "--ranks", "4,16", "--tensors", "3", "--repeats", "2", "--out", str(out))
    rows = json.loads(out.read_text())["rows"]
    assert [r["ranks"] for r in rows] == [4, 16]
    for r in rows:
        for call in ("ckptd_load", "ckptd_save", "dcp_load", "dcp_save"):
            assert r[call]["first"]["cpu_s"] > 0 and r[call]["later"]["wall_s"] > 0, call
        assert r["ckptd_load_collectives"] and r["ckptd_save_collectives"]
        assert r["dcp_load_collectives"]["metadata_read"] == r["dcp_metadata_bytes"]
