"""The verify benchmark (bench/verify.py) still runs, at a tiny size, so it cannot rot. No timing assertions."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from support import BENCH_TIMEOUT_S, REPO, run_bench

pytestmark = pytest.mark.slow


@pytest.mark.timeout(BENCH_TIMEOUT_S + 60)
def test_bench_verify_runs_small(tmp_path):
    out = tmp_path / "verify.json"
    proc = run_bench("bench.verify", "--gib", "0.01", "--repeat", "1", "--blocks-mib", "1,4",
                     "--out", str(out), "--workdir", str(tmp_path / "work"))
    res = json.loads(out.read_text())
    s = res["summary"]
    for key in ("cold_read_gbps", "verify_cli_gbps", "verify_inproc_gbps", "verify_inproc_alt_gbps",
                "verify_server_gbps", "verify_ratio", "verify_inproc_ratio", "verify_server_ratio",
                "verify_service_gbps", "verify_service_ratio", "service_warmup_s", "reread_1_gbps", "reread_2_gbps"):
        assert isinstance(s[key], float) and math.isfinite(s[key]) and s[key] > 0, key
    assert s["goal"] == 0.8 and isinstance(s["goal_met"], bool)
    assert set(s["cold_read_by_block_gbps"]) == {"1 MiB", "4 MiB"}
    rep = res["repeats"][0]
    assert rep["verify_cli"]["chunks"] >= 8 and rep["verify_cli"]["files"] == res["config"]["files"] >= 1
    assert res["config"]["data_bytes"] >= res["config"]["state_bytes"] > 0
    # every step ran on a cold page cache (the eviction worked, where mincore can tell)
    assert all(f in (None, 0.0) or f < 0.05 for f in rep["resident_after_evict"]), rep["resident_after_evict"]
    assert "| measure | seconds | GB/s | / cold read | goal |" in proc.stdout
    assert not any((tmp_path / "work").iterdir()), "the work directory is removed"


def test_profile_aggregation_of_collapsed_stacks(tmp_path):
    """bench/profile.py's reading of py-spy's raw output (no py-spy needed): processes, own/cumulative, categories."""
    from bench.profile import HARNESS, IDLE, aggregate, categorize, parse_raw, read_collapsed, save_collapsed

    src = tmp_path / "fake_mod.py"  # the innermost line's source text decides the category
    src.write_text("def write(f, view):\n    n = f.write(view)\ndef h(x):\n    return xxhash.xxh3_64_hexdigest(x)\n")
    server = 'process 10:"";process 11:"python -m ckptd.cli.main serve --root r --port 1";'
    rank = ('process 10:"";process 12:"python -c from multiprocessing.spawn import spawn_main; '
            'spawn_main(tracker_fd=5) --multiprocessing-fork";')
    raw = "\n".join([
        f"{server}serve ({REPO}/ckptd/service/server.py:40);write ({src}:2) 30",
        f"{server}serve ({REPO}/ckptd/service/server.py:40);h ({src}:4) 10",
        f"{rank}_save_rank ({REPO}/bench/profile.py:1);make_state ({REPO}/bench/save_load.py:99) 5",
        f"{rank}Condition.wait (/usr/lib/python3.11/threading.py:327) 7",
        'process 10:"" 3',
    ])
    stacks = parse_raw(raw, root_role="driver")
    assert {s[0] for s in stacks} == {"[server]", "[rank 0]", "[driver]"}
    agg = aggregate(stacks, 5, process="[server]")
    assert agg["samples"] == 40
    assert agg["top_self"][0]["function"] == f"write ({src})" and agg["top_self"][0]["fraction"] == 0.75
    assert any(r["function"] == "serve (ckptd/service/server.py)" and r["samples"] == 40 for r in agg["top_cumulative"])
    assert categorize(stacks, process="[server]")["samples"] == {"file writes": 30, "hashing (xxh3)": 10}
    cats = categorize(stacks, process="[rank 0]")
    assert cats["samples"] == {HARNESS: 5, IDLE: 7} and cats["busy_samples"] == 0
    out = save_collapsed(tmp_path / "x.collapsed", stacks)
    assert read_collapsed(Path(out) if Path(out).is_absolute() else REPO / out) == stacks
