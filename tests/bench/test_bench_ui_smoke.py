"""The web view's benchmark (bench/ui.py) still runs, at a tiny size, so it cannot rot. No timing assertions."""

from __future__ import annotations

import json
import shutil

import pytest

from support import BENCH_TIMEOUT_S, run_bench

pytestmark = pytest.mark.slow


@pytest.mark.timeout(BENCH_TIMEOUT_S + 60)
@pytest.mark.skipif(shutil.which("chromium") is None, reason="needs Debian's chromium (.ci/run installs it)")
def test_bench_ui_runs_small(tmp_path):
    pytest.importorskip("playwright.sync_api", reason="needs playwright (pip install 'playwright>=1.40')")
    out = tmp_path / "ui.json"
    proc = run_bench("bench.ui", "--checkpoints", "12", "--ranks", "2", "--repeat", "2", "--out", str(out),
                     "--workdir", str(tmp_path / "work"), "--screenshots", str(tmp_path / "img"))
    res = json.loads(out.read_text())
    # 12 trainer checkpoints (the seed and 11 copies), one derived copy (step 100), the reshard job's output
    assert res["config"]["visible"] == 14 and res["config"]["rows_per_page"] == 14
    assert len(res["loads"]) == 2 and all(ld["rows"] == 14 for ld in res["loads"])
    for ld in res["loads"]:
        assert 0 < ld["marks_ms"]["page_start"] < ld["rendered_ms"], ld
        urls = {c["url"].split("?")[0] for c in ld["calls"]}
        assert urls == {"/v1/ui/runs/bench/checkpoints", "/v1/ui/runs/bench/steps"}, urls
        assert all(c["status"] == 200 for c in ld["calls"])
    s = res["summary"]
    assert s["cold_ms"] > 0 and s["warm_ms"] > 0 and isinstance(s["goal_met"], bool)
    assert set(res["json_ms"]) == {"/v1/ui/runs/bench/checkpoints", "/v1/ui/runs/bench/steps", "/v1/ui/runs"}
    assert sorted(p.rsplit("/", 1)[1] for p in res["screenshots"]) == [
        "ui-checkpoint.png", "ui-live.png", "ui-run.png", "ui-runs.png"]
    assert all((tmp_path / "img" / n).stat().st_size > 10_000 for n in ("ui-run.png", "ui-checkpoint.png"))
    assert "| run page rendered, cold service (first load) |" in proc.stdout
    assert not any((tmp_path / "work").iterdir()), "the work directory is removed"
