"""``ckptd drill`` (:mod:`ckptd.cli.drill`) over a real root written offline, in process
(``ckptd.cli.main.main``): exit codes, what is printed and what is written, never a traceback.

* a checkpoint that converts into every layout: exit 0, one line per layout, the record written
  beside the checkpoint (``DRILL.json``) and printed as is with ``--json``;
* a data file damaged on disk: exit 1, each problem named by layout and tensor;
* a layout that does not parse, ``--jobs`` out of range, a bad ref: exit 2 in one line, before
  anything is read or written; a checkpoint that is not there: exit 1;
* ``print_record`` names a layout whose resolved name differs from the spec asked, and counts the
  failing tensors of each layout.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from ckptd.cli.drill import print_record
from ckptd.cli.main import main
from ckptd.storage import LocalStorage
from ckptd.store import SessionStore
from stored_tensors import write_tensors


@pytest.fixture
def root(tmp_path) -> Path:
    root = tmp_path / "root"
    sessions = SessionStore(LocalStorage(root, durable=False))
    state = {"model.w": torch.arange(64.0).reshape(8, 8), "model.b": torch.arange(8.0)}
    write_tensors(sessions, "dr/1", state, step=1)
    write_tensors(sessions, "dr/2", state, step=2)
    return root


def _run(capsys, *argv: str) -> tuple[int, str, str]:
    rc = main(list(argv))
    out = capsys.readouterr()
    assert "Traceback" not in out.err
    return rc, out.out, out.err


def _drill_file(root: Path, name: str) -> Path:
    return root / "runs" / "dr" / name / "DRILL.json"


def test_a_checkpoint_that_converts_passes_and_its_record_is_written(root, capsys):
    rc, out, err = _run(capsys, "drill", "dr/1", "--to", "full", "--to", "tp=2", "--root", str(root))
    assert rc == 0, err
    lines = out.splitlines()
    assert lines[0].startswith("OK dr/1 (manifest ") and "2 layouts, every tensor of every layout matches" in lines[0]
    assert lines[1].split()[:2] == ["ok", "full:"] and lines[2].split()[:2] == ["ok", "tp=2:"]
    assert json.loads(_drill_file(root, "1").read_text())["ok"] is True
    rc, out, _ = _run(capsys, "drill", "dr/latest", "--to", "full", "--json", "--jobs", "2", "--root", str(root))
    rec = json.loads(out)
    assert rc == 0 and rec["ref"] == "dr/2" and rec["ok"] is True and [x["layout"] for x in rec["layouts"]] == ["full"]
    assert json.loads(_drill_file(root, "2").read_text())["manifest_xxh3"] == rec["manifest_xxh3"]


def test_a_damaged_data_file_fails_naming_layout_and_tensor(root, capsys):
    data = next((root / "runs" / "dr" / "1" / "sessions").glob("*/files/r000000-0000.bin"))
    raw = bytearray(data.read_bytes())
    raw[5] ^= 0xFF  # in model.w, the first tensor written
    data.write_bytes(bytes(raw))
    rc, out, err = _run(capsys, "drill", "dr/1", "--to", "full", "--root", str(root))
    assert rc == 1, out + err
    assert out.startswith("FAIL dr/1 (manifest ")
    assert any(line.strip().startswith("- layout full: tensor 'model.w': ") for line in out.splitlines()), out


@pytest.mark.parametrize("argv, says", [
    (["dr/1", "--to", "nonsense:q=1"], "nonsense"),
    (["dr/1", "--to", "full", "--jobs", "0"], "--jobs takes 1 to 64, not '0'"),
    (["Bad_Run/1", "--to", "full"], "invalid run 'Bad_Run'"),
])
def test_bad_input_is_one_line_and_nothing_is_written(root, capsys, argv, says):
    rc, out, err = _run(capsys, "drill", *argv, "--root", str(root))
    assert rc == 2 and out == "" and says in err, err
    assert not _drill_file(root, "1").exists()


def test_a_checkpoint_that_is_not_there_is_exit_1(root, capsys):
    rc, out, err = _run(capsys, "drill", "dr/9", "--to", "full", "--root", str(root))
    assert rc == 1 and out == "" and "dr/9" in err and err.count("\n") == 1


def test_the_printed_record_names_layouts_and_counts_failing_tensors(capsys):
    problem = {"layout": "half", "tensor": "model.w", "message": "digest 1 != 2"}
    rec = {"ref": "r/5", "manifest_xxh3": "0" * 16, "ok": False, "layouts": [
        {"layout": "full", "spec": "full", "ok": True, "tensors": 2, "bytes": 2048, "bytes_read": 2048,
         "seconds": 0.01, "problems": []},
        {"layout": "half", "spec": "fsdp2:dp=2", "ok": False, "tensors": 2, "bytes": 2048, "bytes_read": 4096,
         "seconds": 0.02, "problems": [problem, {**problem, "message": "digest 3 != 4"},
                                       {"layout": "half", "tensor": None, "message": "plan refused"}]}]}
    print_record(rec, as_json=False)
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == f"FAIL r/5 (manifest {'0' * 16}): 2 layouts, 3 problems; recorded in DRILL.json"
    assert lines[1].split()[:2] == ["ok", "full:"] and "(" not in lines[1].split(":")[0]
    assert lines[2].split(":")[0].split() == ["FAIL", "half", "(fsdp2"] and "(1 failing)" in lines[2]
    assert lines[3:] == ["        - layout half: tensor 'model.w': digest 1 != 2",
                         "        - layout half: tensor 'model.w': digest 3 != 4",
                         "        - layout half: plan refused"]
    print_record(rec, as_json=True)
    assert json.loads(capsys.readouterr().out) == rec
