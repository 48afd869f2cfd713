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
    for key in ("commit_s", "commit_cold_s", "manifest_read_s", "dcp_global_plan_s", "commit_ratio_vs_dcp_global_plan"):
        assert s[key] > 0, key
    assert "ckptd commit" in proc.stdout
