"""The S3 benchmark (bench/s3.py: ckptd on s3:// vs DCP's fsspec writer, one moto server) still runs, tiny."""

from __future__ import annotations

import json

import pytest

from support import BENCH_TIMEOUT_S, run_bench

pytestmark = pytest.mark.slow


@pytest.mark.timeout(BENCH_TIMEOUT_S + 60)
def test_bench_s3_runs_small(tmp_path):
    pytest.importorskip("moto.server", reason="moto[server] is in the dev extra")
    pytest.importorskip("s3fs", reason="s3fs is in the s3 extra")
    out = tmp_path / "s3.json"
    proc = run_bench("bench.s3", "--mib", "4", "--repeat", "1", "--out", str(out),
                     "--workdir", str(tmp_path / "work"))
    res = json.loads(out.read_text())
    s = res["summary"]
    for key in ("save_throughput_ratio", "load_throughput_ratio", "dcp_save_s", "ckptd_save_s", "dcp_load_s",
                "ckptd_load_s", "ckptd_stall_s", "ckptd_save_moto_cpu_s", "dcp_load_moto_cpu_s", "ckptd_service_save_s",
                "save_service_throughput_ratio"):
        assert s[key] > 0, key
    # correctness: both loads bit for bit equal to the values saved and to each other, both checkpoints in S3
    assert s["correct"] == {"dcp_load_bit_exact": True, "ckptd_load_bit_exact": True, "loads_agree": True,
                            "stored_in_s3": True}
    rep = res["load"]["repeats"][0]
    assert rep["checked_tensors"] == res["config"]["tensors"] == 8
    for side in ("ckptd", "dcp"):
        assert res["stored"][side]["bytes"] >= res["config"]["state_bytes"], side
        # the bytes went through moto: each side's save sent S3 writes, each side's load S3 reads
        assert s[f"{side}_save_s3_requests"].get("put", 0) + s[f"{side}_save_s3_requests"].get("upload_part", 0) > 0
        assert s[f"{side}_load_s3_requests"].get("get_range", 0) + s[f"{side}_load_s3_requests"].get("get", 0) > 0
    assert res["config"]["save_world"] == 2 and res["config"]["load_world"] == 3
    assert s["save_phases_s"]["snapshot"] > 0 and s["load_phases_s"]["get_range_n"] > 0  # the probe still hooks in
    for key in ("nproc", "mem_gib", "loadavg_at_start"):
        assert res["machine"][key], key
    assert res["machine"]["versions"]["moto"] and res["loadavg_at_end"]
    assert res["baselines"]["put_gbps"] > 0 and res["baselines"]["ranged_get_1mib_s"] > 0
    assert res["command"].startswith("python -m bench.s3")
    assert "| measure | ckptd (s3:// root) |" in proc.stdout
    assert not any((tmp_path / "work").iterdir()), "the work directory is removed"
