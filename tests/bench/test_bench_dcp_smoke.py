"""The DCP writer / safetensors export benchmark (bench/dcp_io.py) still runs, at a tiny size, so it cannot rot."""

from __future__ import annotations

import json

import pytest

from support import BENCH_TIMEOUT_S, run_bench

pytestmark = pytest.mark.slow


@pytest.mark.timeout(BENCH_TIMEOUT_S + 60)
def test_bench_dcp_io_runs_small(tmp_path):
    out = tmp_path / "dcp_io.json"
    proc = run_bench("bench.dcp_io", "--gib", "0.01", "--repeat", "1", "--world", "2", "--out", str(out),
                     "--workdir", str(tmp_path / "work"))
    res = json.loads(out.read_text())
    s = res["summary"]
    for key in ("save_throughput_ratio", "load_throughput_ratio", "export_ratio", "export_ratio_no_check",
                "import_plus_export_ratio", "ckptd_export_peak_rss_bytes", "peer_peak_rss_bytes",
                "export_peak_rss_fraction"):
        assert s[key] > 0, key
    assert res["config"]["same_filesystem"] and res["config"]["world"] == 2
    for key in ("nproc", "mem_gib", "loadavg_at_start"):
        assert res["machine"][key], key
    assert res["command"].startswith("python -m bench.dcp_io")
    # correctness: ckptd's save committed, both loads bit for bit, both exports equal bit for bit
    rep = res["writer"]["repeats"][0]
    assert rep["ckptd_committed_manifest"] == "dcpio/0"
    assert rep["dcp_load"]["checked_tensors"] == rep["ckptd_load"]["checked_tensors"] == res["config"]["tensors"]
    cmp = res["export"]["repeats"][0]["compare"]
    assert cmp["equal"] and cmp["digests_equal"] and cmp["tensors"] == res["config"]["tensors"]
    assert cmp["outputs"] == ["peer", "ckptd", "ckptd_no_check"] and len(cmp["bitwise_equal_tensors"]) >= 2
    assert cmp["bytes"] == res["config"]["state_bytes"] and s["outputs_equal"]
    # the probes still hook in
    assert s["save_phases_s"]["upload_files"] > 0 and s["save_phases_s"]["ckptd_finish"] > 0
    assert s["save_phases_s"]["dcp_write_data"] > 0 and s["load_phases_s"]["ckptd_read_data"] > 0
    assert all(k in s["peer_phases_s"] for k in ("dcp_to_torch_save_s", "save_file_s", "fsync_s"))
    for who in ("peer", "ckptd", "ckptd_no_check"):  # the memory sampler still sees the subprocesses
        r = res["export"]["repeats"][0][who]
        assert r["memory_samples"] > 0 and r["sampled_peak_rss_anon_bytes"] > 0 and r["peak_rss_bytes"] > 0, who
        assert r["ru_maxrss_floor_bytes"] > 0 and r["wait4_ru_maxrss_bytes"] > 0, who
    fs = res["export"]["fsyncs"]
    assert fs["probed"] and all(fs[k]["available"] in (True, False) for k in ("peer", "ckptd_export"))
    assert "| measure | ckptd | DCP / peer |" in proc.stdout
    assert not any((tmp_path / "work").iterdir()), "the work directory is removed"
