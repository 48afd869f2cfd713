"""The save/load benchmark (bench/save_load.py) still runs, at a tiny size, so it cannot rot."""

from __future__ import annotations

import json

import pytest

from support import BENCH_TIMEOUT_S, run_bench

pytestmark = pytest.mark.slow


@pytest.mark.timeout(BENCH_TIMEOUT_S + 60)
def test_bench_save_load_runs_small(tmp_path):
    out = tmp_path / "save_load.json"
    proc = run_bench("bench.save_load", "--mib", "16", "--repeat", "1", "--out", str(out),
                     "--workdir", str(tmp_path / "work"), "--snapshot-bytes", str(9 << 20))
    res = json.loads(out.read_text())
    s = res["summary"]
    for key in ("save_throughput_ratio", "stall_ratio", "stall_vs_async_ratio", "load_cold_throughput_ratio",
                "load_warm_throughput_ratio", "load_cold_http_throughput_ratio", "load_warm_http_throughput_ratio"):
        assert s[key] > 0, key
    assert s["disk_write_ceiling_gbps"] > 0 and s["save_ratio_possible"] > 0  # the bound on any save ratio
    assert s["copy_floor_s"] > 0 and s["stall_ratio_possible"] > 0  # and on any stall
    rl = s["replicated_load"]  # over HTTP, the host's ranks fetch the replicated tensors once between them
    state = rl["shared"]["bytes_shared_in"] / 2  # each of the two other ranks receives every tensor
    assert state > 0 and rl["each_rank"]["bytes_shared_in"] == 0
    assert rl["each_rank"]["bytes_fetched"] >= 3 * state
    # at this tiny size the read plan coalesces ranges across small gaps, so the readers fetch a little more
    assert state <= rl["shared"]["bytes_fetched"] < rl["each_rank"]["bytes_fetched"]
    # the default load reads the service's files on this host; the other way goes through HTTP
    assert s["ckptd_cold_direct_fraction"] == 1.0 and s["ckptd_http_cold_direct_fraction"] == 0.0
    assert s["load_phases_s"]["ckptd_http_cold"]["get_range_n"] > 0 and s["load_phases_s"]["ckptd_cold"]["get_range_n"] == 0
    assert res["config"]["same_filesystem"] and res["config"]["snapshot_bytes"] == 9 << 20
    assert s["save_phases_s"]["snapshot"] > 0 and s["save_phases_s"]["put_file_span"] > 0  # the probe still hooks in
    assert "adopt_file_span" not in s["save_phases_s"] and s["save_throughput_ratio"] > 0  # every byte sent, none adopted
    assert s["raw_write_s"] > 0 and s["ckptd_save_vs_raw"] > 0
    # the read floor reads every byte of ckptd's files once between the 3 ranks (at least the state)
    assert s["raw_cold_bytes"] >= res["config"]["state_bytes"] and s["ckptd_cold_load_vs_raw"] > 0
    assert len(res["server_rss"]) == 3  # main + the two --rss-mib sizes (default mib/4 and mib*2)
    for server in res["server_rss"].values():
        assert server["load_peak"]["VmHWM"] > 0
    assert "| measure | ckptd | DCP |" in proc.stdout
    assert not any((tmp_path / "work").iterdir()), "the work directory is removed"
