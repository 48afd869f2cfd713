"""The two-replica soak (bench/soak.py ``--replicas 2``) at a small size: 4 rank processes save 7 steps over
two ``ckptd serve`` replicas on one root; replica A is SIGKILLed mid-save after step 2 and restarted once the
step after the killed one has committed. Every step committed exactly once, every checkpoint verifies, the
ranks load back what they saved bit for bit. BENCHMARKS.md (Load and soak) records the 64-rank run.

The second test feeds the same end checks a root with a step committed twice and a step missing, so the
smoke run's pass means those checks ran and found nothing."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import soak

pytestmark = pytest.mark.slow


def test_soak_two_replicas_one_killed_mid_save(tmp_path):
    out = tmp_path / "soak.json"
    rc = soak.main(["--replicas", "2", "--ranks", "4", "--checkpoints", "7", "--mib", "1", "--kill-after-step", "2",
                    "--restart", "--work", str(tmp_path / "w"), "--out", str(out), "--timeout", "240"])
    r = json.loads(out.read_text())
    assert not r["problems"] and r["ok"] and rc == 0
    kill = r["kill"]
    assert kill["step"] >= 3 and kill["files_accepted"] >= 1 and kill["indexes_stored"] < 4, kill  # mid-save
    assert r["restart"]["ready_s"] > 0 and r["totals"]["steps_committed"] == 7
    assert r["verified"] == {str(s): True for s in range(1, 8)}
    assert r["loaded_back"] == {str(kill["step"]): ["equal"], "7": ["equal"]}
    fo = r["failover"]
    assert fo["killed_step"] == kill["step"] and fo["ranks_failed_over"] >= 1  # ranks 0 and 2 preferred A
    assert fo["kill_to_marker_s"] > 0 and len(r["commit_latency_s"]["slowest_rank"]) == 7
    assert r["memory"]["b"]["samples"] > 0 and r["memory"]["a_restarted"]["samples"] > 0


def _commit(root: Path, step: int, sid: str, digest: str) -> bytes:
    """A committed step as the service lays it out: its session with one manifest, and the marker."""
    d = root / "runs" / soak.RUN / str(step)
    (d / "sessions" / sid).mkdir(parents=True, exist_ok=True)
    (d / "sessions" / sid / f"manifest-{digest}.json").write_text("{}")
    raw = json.dumps({"session": sid, "manifest": f"manifest-{digest}.json", "manifest_xxh3": digest}).encode()
    (d / "COMMITTED").write_bytes(raw)
    return raw


def test_end_checks_catch_a_step_committed_twice_and_a_missing_one(tmp_path):
    first = _commit(tmp_path, 1, "s1", "aa")
    second = _commit(tmp_path, 1, "s1b", "bb")  # another session of step 1 took over the marker
    assert soak.check_steps(tmp_path, 1, ["s1b"], {1: {second}}) == ["1: sessions left ['s1', 's1b'], want only s1b"]
    _commit(tmp_path, 3, "s3", "cc")
    problems = soak.check_steps(tmp_path, 3, ["s1", "s2", "s3"], {1: {first, second}})
    assert any(p.startswith("1: 2 different COMMITTED contents") for p in problems), problems
    assert any(p.startswith("1: the marker names session s1b") for p in problems), problems
    assert "2: no COMMITTED marker" in problems
    assert not [p for p in problems if p.startswith("3:")], problems
