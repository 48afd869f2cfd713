"""The fast-tier benchmark (bench/tiers.py: commit on local disk, durable on S3 via moto) still runs, tiny."""

from __future__ import annotations

import json

import pytest

from support import BENCH_TIMEOUT_S, run_bench

pytestmark = pytest.mark.slow


@pytest.mark.timeout(BENCH_TIMEOUT_S + 60)
def test_bench_tiers_runs_small(tmp_path):
    pytest.importorskip("moto.server", reason="moto[server] is in the dev extra")
    out = tmp_path / "tiers.json"
    run_bench("bench.tiers", "--mib", "4", "--repeat", "1", "--out", str(out), "--workdir", str(tmp_path / "work"))
    res = json.loads(out.read_text())
    s = res["summary"]
    for key in ("dcp_save_s", "ckptd_commit_s", "plain_commit_s", "durable_s", "commit_ratio", "moto_put_mb_s"):
        assert s[key] > 0, key
    assert s["ckptd_stall_s"] <= s["ckptd_commit_s"] <= s["durable_s"]
    assert res["check"] == {"bits_equal": True}  # every checkpoint read back from the durable tier alone
