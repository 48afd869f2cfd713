"""The benchmark harness (``python -m bench``) reads every suite's result, puts each ratio next to its
goal, and draws the plot; here from the committed results, without running the suites."""

from __future__ import annotations

import json
import shutil

from support import REPO, run_bench


def test_summary_and_plot_from_committed_results(tmp_path):
    for f in (REPO / "bench" / "results").glob("*.json"):
        if f.name != "summary.json":
            shutil.copy(f, tmp_path / f.name)
    r = run_bench("bench", "--summarize-only", "--results", str(tmp_path))
    summary = json.loads((tmp_path / "summary.json").read_text())
    rows = {(x["suite"], x["measure"]): x for x in summary["ratios"]}
    found = [x for x in rows.values() if isinstance(x["value"], (int, float))]
    assert {x["suite"] for x in found} >= {"save_load", "reshard"}  # suites with committed results
    for x in found:
        if x["goal"] is not None:
            want = x["value"] >= x["goal"] if x["direction"] == ">=" else x["value"] <= x["goal"]
            assert x["met"] is want, x
    png = (tmp_path / "summary.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 5000
    assert "NOT met" in r.stdout or "met" in r.stdout
