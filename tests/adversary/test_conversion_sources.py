"""A conversion never starts from a checkpoint that the one checker rejects.

A root written offline: ``model.w`` and ``optim.m`` (2 MiB each) in one data file, so the model's
bytes and the optimizer's lie in different digest blocks. One byte of ``optim.m`` is flipped in the
root. ``ckptd export --prefix model.`` reads only the model's blocks, and ``ckptd reshard`` would
read all; both are refused before anything is written (exit 1, naming the checkpoint as not
verifying), the failure is recorded (``RUN/latest`` skips it from then on), and nothing new is
committed. An undamaged checkpoint converts on its commit's own record, without a second read.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

from ckptd.storage import open_storage
from ckptd.store import SessionStore
from stored_tensors import write_tensors


def _cli(*args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("CKPTD_URL", "CKPTD_ROOT")}
    return subprocess.run([sys.executable, "-m", "ckptd.cli.main", *args], capture_output=True, text=True,
                          timeout=180, env=env)


def _root(tmp_path: Path) -> Path:
    root = tmp_path / "root"
    sessions = SessionStore(open_storage(str(root)))
    for step in (1, 2):
        write_tensors(sessions, f"conv/{step}", {"model.w": torch.full((512, 1024), float(step)),
                                                 "optim.m": torch.full((512, 1024), -float(step))}, step=step)
    return root


def test_a_damaged_source_is_not_converted_even_where_the_conversion_reads_no_damaged_byte(tmp_path):
    root = _root(tmp_path)
    data = next((root / "runs" / "conv" / "2" / "sessions").glob("*/files/*.bin"))
    raw = bytearray(data.read_bytes())
    raw[(3 << 20) + 12345] ^= 0x01  # inside optim.m, far from model.w's blocks
    data.write_bytes(bytes(raw))
    before = sorted(p.relative_to(root) for p in (root / "runs").rglob("COMMITTED"))

    out = tmp_path / "out"
    exp = _cli("export", "conv/2", str(out), "--prefix", "model.", "--root", str(root))
    assert exp.returncode == 1 and "conv/2 does not verify, so it is not converted" in exp.stderr, exp.stderr
    assert exp.stderr.count("\n") == 1 and not out.exists()
    rec = json.loads((root / "runs" / "conv" / "2" / "VERIFIED.json").read_text())
    assert rec["ok"] is False and rec["problems"], rec  # recorded: RUN/latest skips it from now on

    res = _cli("reshard", "conv/2", "--to", "full", "--out", "conv/2-full", "--root", str(root))
    assert res.returncode == 1 and "does not verify" in res.stderr, res.stderr
    assert sorted(p.relative_to(root) for p in (root / "runs").rglob("COMMITTED")) == before

    # the undamaged one converts on the record its commit wrote: that record is not rewritten
    good = root / "runs" / "conv" / "1" / "VERIFIED.json"
    stamp = good.stat().st_mtime_ns
    ok = _cli("export", "conv/1", str(tmp_path / "out1"), "--prefix", "model.", "--root", str(root))
    assert ok.returncode == 0, ok.stderr
    assert _cli("reshard", "conv/1", "--to", "full", "--root", str(root)).returncode == 0
    assert good.stat().st_mtime_ns == stamp
