"""The compression benchmark (bench/compression.py) still runs, at a tiny size, so it cannot rot.
No timing assertions: what is asserted holds whatever the machine's speed."""

from __future__ import annotations

import json

import pytest

from support import BENCH_TIMEOUT_S, run_bench

pytestmark = pytest.mark.slow


@pytest.mark.timeout(BENCH_TIMEOUT_S + 60)
def test_bench_compression_runs_small(tmp_path):
    out = tmp_path / "compression.json"
    proc = run_bench("bench.compression", "--mib", "8", "--repeat", "1", "--steps", "2", "--throttle-mbps", "400",
                     "--out", str(out), "--workdir", str(tmp_path))
    res = json.loads(out.read_text())
    assert set(res["codecs"]) == {"fp32_weights", "adamw_exp_avg", "adamw_exp_avg_sq", "bf16_weights"}
    for state, by in res["codecs"].items():
        # byte planes store less than plain zstd on trained float states
        assert by["blosc2"]["ratio"] < by["zstd"]["ratio"] < 1.0, (state, by)
    save = res["save"]
    assert save["bf16_weights/planes"]["codecs"] == ["blosc2"] and save["bf16_weights/zstd"]["codecs"] == ["zstd"]
    assert save["fp32_weights/raw"]["stored_ratio"] == 1.0
    assert "| state | codec | ratio |" in proc.stdout
