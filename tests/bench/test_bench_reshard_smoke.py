"""The reshard benchmark (bench/reshard.py) still runs, at a tiny size, so it cannot rot."""

from __future__ import annotations

import json

import pytest

from support import BENCH_TIMEOUT_S, run_bench

pytestmark = pytest.mark.slow


@pytest.mark.timeout(BENCH_TIMEOUT_S + 60)
def test_bench_reshard_runs_small(tmp_path):
    out = tmp_path / "reshard.json"
    proc = run_bench("bench.reshard", "--gib", "0.01", "--sizes", "0.01", "--out", str(out),
                     "--workdir", str(tmp_path / "work"))
    res = json.loads(out.read_text())
    s = res["summary"]
    for key in ("dp2_ratio_vs_dcp_load", "dp2_ratio_vs_dcp_load_save", "full_ratio_vs_dcp_to_torch_save",
                "disk_efficiency_dp2", "disk_efficiency_full", "disk_convert_ceiling_gbps",
                "disk_efficiency_service_dp2", "disk_efficiency_service_full", "disk_efficiency_service",
                "disk_efficiency_cli_server_dp2"):
        assert s[key] > 0, key
    assert res["config"]["same_filesystem"]
    rep = res["sizes"]["0p01gib"]["repeats"][0]
    for op in ("ckptd_dp2", "ckptd_full", "dcp_to_torch_save"):
        assert rep[op]["peak_rss_bytes"] > 0 and rep[op]["spot_checked"], op
    assert rep["ckptd_dp2"]["bytes_written"] >= res["sizes"]["0p01gib"]["state_bytes"]
    for op in ("service_dp2", "service_full"):  # the same conversions as jobs of the running service
        job = rep[op]
        assert job["state"] == "done" and job["committed"] and job["spot_checked"], op
        assert job["bytes_written"] >= res["sizes"]["0p01gib"]["state_bytes"], op
        # its output's tensor digests equal those of every other ckptd output of the same source
        assert set(job["digests_match"]) == {"ckptd_dp2", "ckptd_full", "service_dp2", "service_full",
                                             "cli_server_dp2"}, op
    assert rep["cli_server_dp2"]["spot_checked"]  # `ckptd reshard --server`: committed, checked
    assert res["service_warmup"]["wall_s"] > 0
    assert rep["dcp_load"]["checked"] and min(rep["dcp_load"]["load_peak_rss_bytes_per_rank"]) > 0
    for spec in ("fsdp2:dp=2", "full"):  # the timers still hook into the executor
        p = res["profile"][spec]
        assert p["rc"] == 0 and p["n_units"] >= 1 and p["finalize_s"] > 0, spec
        assert p["in_units_thread_s"]["read"] > 0 and p["in_units_thread_s"]["sink_write"] > 0, spec
        assert p["in_finalize_s"]["digests"] > 0, spec
    assert res["gpu"]["available"] in (True, False)
    assert "| measure | ckptd | DCP |" in proc.stdout and "Via the service" in proc.stdout
    assert not any((tmp_path / "work").iterdir()), "the work directory is removed"
