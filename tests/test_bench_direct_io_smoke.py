"""The direct-I/O A/B benchmark (bench/direct_io.py) still runs, at a tiny size, so it cannot rot."""

from __future__ import annotations

import json

import pytest

from support import BENCH_TIMEOUT_S, run_bench

pytestmark = pytest.mark.slow


@pytest.mark.timeout(BENCH_TIMEOUT_S + 60)
def test_bench_direct_io_runs_small(tmp_path):
    out = tmp_path / "direct_io.json"
    proc = run_bench("bench.direct_io", "--gib", "0.01", "--pairs", "2", "--out", str(out),
                     "--workdir", str(tmp_path / "work"))
    res = json.loads(out.read_text())
    for op in ("reshard", "export"):
        runs = res["runs"][op]
        # every pair ran both settings, the first one alternating
        assert [(r["pair"], r["direct"]) for r in runs] == [(0, "0"), (0, "1"), (1, "1"), (1, "0")], op
        assert all(r["wall_s"] > 0 and r["cpu_s"] > 0 for r in runs), op
        s = res["summary"][op]
        assert s["0"]["wall_s"] > 0 and s["1"]["wall_s"] > 0 and s["direct_over_default_wall"] > 0, op
    assert all(r["json"]["seconds"] > 0 for r in res["runs"]["reshard"])  # the CLI's own --json
    assert "| reshard | page cache (default) |" in proc.stdout
    assert not any((tmp_path / "work").iterdir()), "the work directory is removed"
