"""The service's memory of its last retention decisions (:mod:`ckptd.service.gc_log`), for the web view.

* each decision is kept with when, who asked and whether it was a dry run, beside the plan itself;
* a run keeps its last ``per_run`` decisions, read newest first, ``limit`` at most;
* at most ``max_runs`` runs are remembered: the one collected least recently is forgotten first,
  and collecting a run again makes it the most recent;
* a run never collected has no decisions (not an error).
"""

from __future__ import annotations

from datetime import datetime

from ckptd.service.gc_log import GcLog


def _plan(i: int) -> dict:
    return {"keep": {"9": "newest"}, "delete": [str(i)], "deleted": [str(i)]}


def test_a_decision_is_kept_with_who_asked_and_when():
    log = GcLog()
    before = datetime.now().astimezone()
    log.record("r", _plan(1), "POST /v1/runs/r/gc", dry_run=True)
    [entry] = log.recent("r")
    assert {k: entry[k] for k in ("source", "dry_run", "keep", "delete", "deleted")} == {
        "source": "POST /v1/runs/r/gc", "dry_run": True, "keep": {"9": "newest"}, "delete": ["1"], "deleted": ["1"]}
    at = datetime.fromisoformat(entry["at"])
    assert at.tzinfo is not None and at >= before.replace(microsecond=0)


def test_a_run_keeps_its_last_decisions_newest_first():
    log = GcLog(per_run=3)
    for i in range(5):
        log.record("r", _plan(i), "policy")
    assert [e["delete"] for e in log.recent("r")] == [["4"], ["3"], ["2"]]
    assert [e["delete"] for e in log.recent("r", limit=2)] == [["4"], ["3"]]
    assert log.recent("other") == []


def test_the_run_collected_least_recently_is_forgotten_first():
    log = GcLog(per_run=2, max_runs=2)
    log.record("a", _plan(1), "policy")
    log.record("b", _plan(2), "policy")
    log.record("a", _plan(3), "policy")  # a is now the most recent
    log.record("c", _plan(4), "policy")  # over two runs: b goes, not a
    assert log.recent("b") == []
    assert [e["delete"] for e in log.recent("a")] == [["3"], ["1"]]
    assert [e["delete"] for e in log.recent("c")] == [["4"]]


def test_a_read_is_a_copy():
    log = GcLog()
    log.record("r", _plan(1), "policy")
    log.recent("r").clear()  # the caller's list, not the log's
    assert len(log.recent("r")) == 1
