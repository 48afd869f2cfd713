"""The commit-at-scale benchmark (bench/manifest.py) still runs, at a tiny scale, so it cannot rot."""

from __future__ import annotations

import json

import pytest

from support import BENCH_TIMEOUT_S, run_bench


@pytest.mark.timeout(BENCH_TIMEOUT_S + 60)
def test_bench_manifest_runs_small(tmp_path):
    out = tmp_path / "manifest.json"
    proc = run_bench("bench.manifest", "--ranks", "8", "--tensors", "12", "--repeat", "1",
                     "--out", str(out))
    s = json.loads(out.read_text())["summary"]
    assert s["chunks"] == 96
    for key in ("commit_s", "commit_cold_s", "manifest_read_s", "dcp_global_plan_s", "commit_ratio_vs_dcp_global_plan",
                "warm_commit_peak_rss_mb", "cold_commit_peak_rss_mb", "dcp_peak_rss_mb"):
        assert s[key] > 0, key
    # Peaks are the committing processes' own, above what they held when they started.
    assert s["cold_start_rss_mb"] < s["cold_commit_peak_rss_mb"]
    assert s["warm_start_rss_mb"] < s["warm_commit_peak_rss_mb"]
    assert "ckptd commit" in proc.stdout


@pytest.mark.timeout(BENCH_TIMEOUT_S + 60)
def test_bench_manifest_says_when_it_skips_the_dcp_peer(tmp_path):
    out = tmp_path / "manifest.json"
    proc = run_bench("bench.manifest", "--ranks", "4", "--tensors", "3", "--repeat", "1",
                     "--dcp-max-ranks", "2", "--out", str(out))
    s = json.loads(out.read_text())["summary"]
    assert s["dcp_global_plan_s"] is None and s["commit_ratio_vs_dcp_global_plan"] is None
    assert "--dcp-max-ranks 2" in s["dcp_skipped"] and "DCP create_global_plan: skipped" in proc.stdout
