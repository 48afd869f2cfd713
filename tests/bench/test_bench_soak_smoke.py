"""Load and soak (bench/soak.py) at the issue's scale with small tensors: 16 saving rank processes x
20 checkpoints, a reshard job and gc running beside them; every step committed once, everything
present verifies, gc kept what the policy keeps. BENCHMARKS.md records the timed run."""

from __future__ import annotations

import json

import pytest

from bench import soak

pytestmark = pytest.mark.slow


def test_soak_16_ranks_20_checkpoints(tmp_path):
    out = tmp_path / "soak.json"
    assert soak.main(["--ranks", "16", "--checkpoints", "20", "--mib", "4", "--work", str(tmp_path / "w"),
                      "--out", str(out), "--timeout", "420"]) == 0
    r = json.loads(out.read_text())
    assert r["ok"] and not r["problems"]
    assert r["reshard_job"]["state"] == "done" and any(k.startswith("soak-dp4/") for k in r["verified"])
    kept = {k.split("/")[1] for k in r["verified"] if k.startswith("soak/")}
    assert {"20", "19", "18", "17", "5", "10", "15"} <= kept  # the newest steps and keep_every=5 stay
    assert r["gc"]["deleted"] and not {"5", "10", "15", "20"} & set(r["gc"]["deleted"])
    assert len(r["commit_latency_s"]["slowest_rank"]) == 20 and r["server_rss_bytes"]["samples"] > 0
