"""The commit-lag benchmark (bench/commit_lag.py: simulated ranks on the wire protocol against a real
``ckptd serve``, the time from the last stored byte to the marker) still runs, tiny, on a local root."""

from __future__ import annotations

import json

import pytest

from support import BENCH_TIMEOUT_S, run_bench


@pytest.mark.slow  # several seconds: with the slow tests, so the default run stays within its budget
@pytest.mark.timeout(BENCH_TIMEOUT_S + 60)
def test_bench_commit_lag_runs_small(tmp_path):
    out = tmp_path / "lag.json"
    run_bench("bench.commit_lag", "--sizes", "4M", "--ranks", "2", "--stores", "local", "--repeat", "2",
              "--out", str(out), "--workdir", str(tmp_path / "work"))
    res = json.loads(out.read_text())
    saves = [s for st in res["stores"] for s in st["saves"]]
    assert [(s["store"], s["size"], s["ranks"]) for s in saves] == [("local", 4 << 20, 2)] * 2
    for s in saves:
        assert s["lag_s"] > 0 and s["upload_s"] > 0 and s["committed_by"] in ("index", "poll")
        assert s["service_cpu_s"] >= 0 and s["read_bytes"] >= 0 and s["marker_lag_s"] <= s["lag_s"] + 0.05
    (row,) = res["rows"]
    assert row["n"] == 2 and row["lag_min_s"] <= row["lag_s"] <= row["lag_max_s"]
    assert "| local | 4 MiB | 2 |" in out.with_suffix(".md").read_text()
