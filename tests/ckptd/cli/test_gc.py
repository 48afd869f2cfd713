"""``ckptd gc`` and ``ckptd rm`` (:mod:`ckptd.cli.gc`: ``cmd_gc``, ``cmd_rm``) over a real root written
offline, in process (``ckptd.cli.main.main``, and the module's own parsers): exit codes and what is
printed, never a traceback.

* ``gc --dry-run`` says what it would delete and why each one is kept, and deletes nothing; ``gc``
  deletes it and says so; ``--json`` prints the plan itself;
* ``gc`` of a run that is not there is exit 1 naming it, not an empty answer; one with nothing more
  to delete says what it keeps; a keep count below 1 or a bad run name is exit 2 in one line,
  deleting nothing;
* ``rm`` removes an unprotected checkpoint (``--dry-run``: would), keeps the newest (exit 1 with the
  reason), refuses ``RUN/latest`` (exit 2: it names no checkpoint), and a checkpoint that is not
  there is exit 1.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
import torch

from ckptd.cli.gc import add_parsers, cmd_gc, cmd_rm
from ckptd.cli.main import main
from ckptd.cli.target import add_target
from ckptd.storage import LocalStorage
from ckptd.store import SessionStore
from stored_tensors import write_tensors


@pytest.fixture
def root(tmp_path) -> Path:
    root = tmp_path / "root"
    sessions = SessionStore(LocalStorage(root, durable=False))
    for step in (1, 2, 3, 4):
        write_tensors(sessions, f"gc/{step}", {"model.w": torch.full((4, 4), float(step))}, step=step)
    return root


def _names(root: Path) -> list[str]:
    return sorted(p.name for p in (root / "runs" / "gc").iterdir() if (p / "COMMITTED").exists())


def _run(capsys, *argv: str) -> tuple[int, str, str]:
    rc = main(list(argv))
    out = capsys.readouterr()
    assert "Traceback" not in out.err
    return rc, out.out, out.err


def test_a_dry_run_says_what_would_go_and_why_the_rest_stays(root, capsys):
    rc, out, err = _run(capsys, "gc", "gc", "--keep-last", "2", "--dry-run", "--root", str(root))
    assert rc == 0, err
    lines = out.splitlines()
    assert "would delete gc/1" in lines and "would delete gc/2" in lines
    assert any(line.startswith("keep   gc/4  (") for line in lines) and any(
        line.startswith("keep   gc/3  (") for line in lines)
    assert any(line.startswith("newest verified gc/4 (") for line in lines)
    assert _names(root) == ["1", "2", "3", "4"]


def test_gc_deletes_and_json_prints_the_plan(root, capsys):
    rc, out, _ = _run(capsys, "gc", "gc", "--keep-last", "3", "--json", "--root", str(root))
    plan = json.loads(out)
    assert rc == 0 and plan["deleted"] == ["1"] and sorted(plan["keep"]) == ["2", "3", "4"]
    assert plan["reclaimed_sessions"] == [] and _names(root) == ["2", "3", "4"]
    rc, out, _ = _run(capsys, "gc", "gc", "--keep-last", "2", "--root", str(root))
    assert rc == 0 and "deleted gc/2" in out.splitlines() and _names(root) == ["3", "4"]
    rc, out, _ = _run(capsys, "gc", "gc", "--keep-last", "2", "--root", str(root))  # nothing more to do
    assert rc == 0 and not any(line.startswith("deleted") for line in out.splitlines()) and "keep   gc/4" in out


def test_gc_of_a_run_that_is_not_there_says_so(root, capsys):
    rc, out, err = _run(capsys, "gc", "nope", "--keep-last", "1", "--root", str(root))
    assert rc == 1 and out == "" and err.count("\n") == 1 and "no such run 'nope'" in err and err.startswith("ckptd: ")


def test_rm_removes_keeps_the_protected_and_refuses_latest(root, capsys):
    rc, out, _ = _run(capsys, "rm", "gc/2", "--dry-run", "--root", str(root))
    assert (rc, out.strip()) == (0, "would be removed gc/2") and _names(root) == ["1", "2", "3", "4"]
    rc, out, _ = _run(capsys, "rm", "gc/2", "--root", str(root))
    assert (rc, out.strip()) == (0, "removed gc/2") and _names(root) == ["1", "3", "4"]
    rc, out, _ = _run(capsys, "rm", "gc/4", "--json", "--root", str(root))  # the newest: retention keeps it
    kept = json.loads(out)
    assert rc == 1 and kept["ref"] == "gc/4" and kept["removed"] is False and kept["reason"]
    rc, out, _ = _run(capsys, "rm", "gc/4", "--root", str(root))
    assert rc == 1 and out.startswith(f"kept gc/4: {kept['reason']}")
    rc, out, err = _run(capsys, "rm", "gc/latest", "--root", str(root))
    assert rc == 2 and out == "" and "names a checkpoint, not RUN/latest" in err and err.count("\n") == 1
    rc, out, err = _run(capsys, "rm", "gc/2", "--root", str(root))  # gone already
    assert rc == 1 and out == "" and "gc/2" in err and err.count("\n") == 1
    assert _names(root) == ["1", "3", "4"]


@pytest.mark.parametrize("argv, says", [
    (["gc", "--keep-last", "0"], "keep_last must be at least 1, not 0"),
    (["gc", "--keep-last", "1", "--keep-every", "0"], "keep_every must be at least 1, not 0"),
    (["Bad_Run", "--keep-last", "1"], "invalid run 'Bad_Run'"),
])
def test_gc_refuses_bad_input_in_one_line_and_deletes_nothing(root, capsys, argv, says):
    rc, out, err = _run(capsys, "gc", *argv, "--root", str(root))
    assert rc == 2 and out == "" and err.count("\n") == 1 and says in err
    assert _names(root) == ["1", "2", "3", "4"]


def test_the_modules_commands_answer_with_their_exit_status(root, capsys):
    parser = argparse.ArgumentParser(prog="ckptd")
    add_parsers(parser.add_subparsers(dest="command"), add_target)
    args = parser.parse_args(["rm", "gc/4", "--root", str(root)])
    assert args.func is cmd_rm and cmd_rm(args) == 1  # kept: a status, not an exception
    args = parser.parse_args(["gc", "gc", "--keep-last", "1", "--dry-run", "--root", str(root)])
    assert args.func is cmd_gc and args.stale_ttl == 6 * 3600.0 and cmd_gc(args) == 0
    assert [line for line in capsys.readouterr().out.splitlines() if line.startswith("would delete")] == [
        "would delete gc/1", "would delete gc/2", "would delete gc/3"]
