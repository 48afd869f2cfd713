"""The one-device benchmark (bench/gpu.py) still runs, at a tiny size, on the CPU (the same code a GPU
runs, ``--device cpu``), so it cannot rot: every measure present and positive, every load bit for bit."""

from __future__ import annotations

import json

import pytest
from support import BENCH_TIMEOUT_S, run_bench

# With the slow tests, as the other benchmark smoke runs (about 11 s on 2 shared cores).

@pytest.mark.slow
@pytest.mark.timeout(BENCH_TIMEOUT_S + 60)
def test_bench_gpu_runs_small_on_the_cpu(tmp_path):
    out = tmp_path / "gpu.json"
    proc = run_bench("bench.gpu", "--gib", "0.004", "--repeat", "1", "--device", "cpu", "--settle", "0",
                     "--out", str(out), "--workdir", str(tmp_path / "work"))
    res = json.loads(out.read_text())
    s = res["summary"]
    assert res["config"]["device"] == "cpu" and res["config"]["state_bytes"] > 3 << 20
    for key in ("d2h_floor_s", "write_floor_1t_s", "write_floor_4t_s", "read_floor_1t_s", "read_floor_4t_s",
                "ckptd_first_stall_s", "ckptd_later_stall_s", "dcp_async_first_block_s", "dcp_async_later_block_s",
                "ckptd_committed_s", "dcp_save_s", "ckptd_load_cold_s", "dcp_load_cold_s", "later_stall_vs_d2h",
                "save_vs_dcp", "load_vs_dcp", "load_vs_read_floor", "reshard_auto_vs_cpu_whole", "reshard_cast_bytes"):
        assert isinstance(s[key], (int, float)) and s[key] > 0, key
    assert s["loads_bit_exact"] is True
    assert len(res["saves"]) == 2 and len(res["loads"]) == 1  # first round + 1 later; 1 load repeat
    assert all(r["read_floor_bytes"] >= res["config"]["state_bytes"] for r in res["loads"])
    rs = s["reshard"]
    assert set(rs) == {"in_process", "whole_process"} and set(rs["whole_process"]) == {"cpu", "auto"}
    for devs in rs.values():
        for by in devs.values():
            assert by["none"] > 0 and by["bfloat16"] > 0
    auto = s["reshard_auto_engine"]  # no GPU here: the rule keeps auto on the CPU, and says why
    assert auto["none"]["device"] == "cpu" and "no dtype cast" in auto["none"]["reason"]
    assert auto["bfloat16"]["device"] == "cpu" and "under the 4 GiB" in auto["bfloat16"]["reason"]
    assert s["reshard_gpu_break_even_cast_bytes"] is None  # only a GPU measures it
    assert "| measure | ckptd | DCP / floor |" in proc.stdout and "| whole process | auto |" in proc.stdout
    assert not any((tmp_path / "work").iterdir()), "the work directory is removed"
