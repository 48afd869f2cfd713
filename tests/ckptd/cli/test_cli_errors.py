"""Every subcommand, given wrong input, answers one line and exit 1 or 2: never a traceback, never
a created root, never minutes of retries.

Exit statuses (``ckptd --help``): 1 what was checked is wrong or absent (no such root, run or
checkpoint, a missing plan file), 2 usage or connection (a bad flag value, a URL without a
scheme, nothing listening, a busy port).
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from ckptd.cli.main import main
from ckptd.cli.target import Target, resolve_target
from support import scaled

REFUSED = "http://127.0.0.1:9"  # nothing listens on the discard port


def _cli(*args: str, env: dict[str, str] | None = None, timeout: float = 60) -> subprocess.CompletedProcess:
    full = {k: v for k, v in os.environ.items() if k not in ("CKPTD_URL", "CKPTD_ROOT")}
    return subprocess.run([sys.executable, "-m", "ckptd.cli.main", *args], capture_output=True, text=True,
                          timeout=timeout, env={**full, **(env or {})})


def _run(capsys, *args: str) -> tuple[int, str, str]:
    rc = main(list(args))
    out = capsys.readouterr()
    return rc, out.out, out.err


@pytest.fixture
def root(tmp_path, monkeypatch):
    """A root holding run ``cli`` with checkpoint 7, written offline (no service needed)."""
    monkeypatch.delenv("CKPTD_URL", raising=False)
    monkeypatch.delenv("CKPTD_ROOT", raising=False)
    from ckptd.storage import open_storage
    from ckptd.store import SessionStore
    from stored_tensors import write_tensors

    path = tmp_path / "root"
    write_tensors(SessionStore(open_storage(str(path))), "cli/7", {"model.w": torch.arange(6.0).reshape(2, 3)}, step=7)
    return path


@pytest.mark.parametrize("args, rc, says", [
    (["ls", "--root", "{typo}"], 1, "no such root"),
    (["ls", "nope", "--root", "{root}"], 1, "no such run 'nope'"),
    (["show", "cli/7", "--root", "{typo}"], 1, "no such root"),
    (["show", "no-slash", "--root", "{root}"], 2, "invalid"),
    (["show", "cli/8", "--root", "{root}"], 1, "cli/8"),
    (["verify", "cli/7", "--root", "{typo}"], 1, "no such root"),
    (["gc", "cli", "--keep-last", "1", "--dry-run", "--root", "{typo}"], 1, "no such root"),
    (["gc", "cli", "--keep-last", "1", "--root", "{typo}"], 1, "no such root"),
    (["gc", "nope", "--keep-last", "1", "--root", "{root}"], 1, "no such run 'nope'"),
    (["gc", "nope", "--keep-last", "1", "--dry-run", "--root", "{root}"], 1, "no such run 'nope'"),
    (["export", "cli/7", "{out}", "--root", "{typo}"], 1, "no such root"),
    (["export", "cli/7", "{out}", "--dtype", "float7", "--root", "{root}"], 2, "invalid choice: 'float7'"),
    (["reshard", "cli/7", "--to", "fsdp2:dp=2", "--root", "{typo}"], 1, "no such root"),
    (["reshard", "cli/7", "--to", "fsdp9", "--root", "{root}"], 2, "fsdp9"),
    (["reshard", "cli/7", "--to", "fsdp2:dp=2", "--dtype", "int3", "--root", "{root}"], 2, "invalid choice"),
    (["reshard-worker", "--plan", "{typo}/plan.json", "--index", "0"], 1, "plan.json"),
    (["import", "dcp", "{typo}", "cli/9", "--root", "{root}"], 1, "typo"),
    (["ls", "--root", "nosuchscheme://bucket/x"], 2, "nosuchscheme"),
    (["ls", "--server", "127.0.0.1:8470"], 2, "must start with http:// or https://"),
    (["ls", "--server", REFUSED], 2, "cannot connect"),
    (["show", "cli/7", "--server", REFUSED], 2, "cannot connect"),
    (["verify", "cli/7", "--server", REFUSED], 2, "cannot connect"),
    (["gc", "cli", "--keep-last", "1", "--server", REFUSED], 2, "cannot connect"),
    (["reshard", "cli/7", "--to", "full", "--dry-run", "--server", REFUSED], 2, "cannot connect"),
    (["export", "cli/7", "{out}", "--server", REFUSED], 2, "cannot connect"),
])
def test_wrong_input_is_one_line_and_an_exit_status(root, tmp_path, capsys, args, rc, says):
    typo = tmp_path / "typo"
    args = [a.format(root=root, typo=typo, out=tmp_path / "out") for a in args]
    t0 = time.monotonic()
    got, out, err = _run(capsys, *args)
    assert got == rc, (got, out, err)
    assert says in err and "Traceback" not in err + out, err
    if err.startswith("usage:"):  # argparse: the usage, then one line naming the flag
        assert rc == 2 and err.splitlines()[-1].startswith("ckptd "), err
    else:
        assert err.startswith("ckptd") and err.count("\n") <= 2, err
    assert time.monotonic() - t0 < scaled(10), "a hopeless error was retried"
    assert not typo.exists(), "a command created the root it was given"
    assert not (tmp_path / "out").exists()


def test_version_and_help_name_the_exit_statuses(capsys):
    assert main(["--version"]) == 0 and capsys.readouterr().out.startswith("ckptd 0.")
    r = _cli("--help")
    assert r.returncode == 0 and "Exit status: 0 success; 1" in r.stdout


def test_a_closed_stdout_is_no_traceback(root):
    """``ckptd ls ... | head -0``: the reader is gone before the output is written."""
    p = subprocess.Popen([sys.executable, "-m", "ckptd.cli.main", "show", "cli/7", "--tensors", "--root", str(root)],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    p.stdout.close()
    err = p.stderr.read().decode()
    assert p.wait(timeout=60) == 1 and "Traceback" not in err and "Exception ignored" not in err, err


def test_serve_refuses_a_bad_port_and_a_busy_one(tmp_path):
    r = _cli("serve", "--root", str(tmp_path / "r"), "--port", "99999", timeout=60)
    assert r.returncode == 2 and "--port" in r.stderr and "Traceback" not in r.stderr, r.stderr
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        r = _cli("serve", "--root", str(tmp_path / "r"), "--port", str(port), timeout=60)
    assert r.returncode == 2 and f"cannot listen on 127.0.0.1:{port}" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr


def test_one_rule_decides_root_or_server(monkeypatch, tmp_path):
    """Flags first; then $CKPTD_URL over $CKPTD_ROOT; then ./ckptd-data. Every command asks the same
    function, so with both variables set every command goes to the service."""
    import argparse

    ns = argparse.Namespace
    monkeypatch.setenv("CKPTD_URL", "http://svc:8470")
    monkeypatch.setenv("CKPTD_ROOT", str(tmp_path))
    assert resolve_target(ns(root=None, server=None)) == Target(server="http://svc:8470", source="$CKPTD_URL")
    assert resolve_target(ns(root="/r", server=None)) == Target(root="/r", source="--root")
    assert resolve_target(ns(root=None, server="http://x:1")) == Target(server="http://x:1", source="--server")
    monkeypatch.delenv("CKPTD_URL")
    assert resolve_target(ns(root=None, server=None)) == Target(root=str(tmp_path), source="$CKPTD_ROOT")
    monkeypatch.delenv("CKPTD_ROOT")
    assert resolve_target(ns(root=None, server=None)) == Target(root="./ckptd-data")


def test_a_command_that_finds_nothing_says_where_it_looked_and_why_there(root, tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("CKPTD_URL", raising=False)
    monkeypatch.delenv("CKPTD_ROOT", raising=False)
    rc, out, err = _run(capsys, "show", "cli/99", "--root", str(root))
    assert rc == 1 and err.strip().endswith(f"; looked in root {root}, from --root"), err
    monkeypatch.setenv("CKPTD_ROOT", str(root))
    rc, out, err = _run(capsys, "show", "nope/1")
    assert rc == 1 and err.strip().endswith(f"; looked in root {root}, from $CKPTD_ROOT"), err
    monkeypatch.setenv("CKPTD_ROOT", str(tmp_path / "empty"))
    (tmp_path / "empty" / "runs").mkdir(parents=True)
    rc, out, err = _run(capsys, "ls")
    assert rc == 0 and err.strip() == f"no runs in root {tmp_path / 'empty'}, from $CKPTD_ROOT", err
    monkeypatch.delenv("CKPTD_ROOT")
    monkeypatch.chdir(tmp_path)
    rc, out, err = _run(capsys, "ls")
    assert rc == 1 and "looked in root ./ckptd-data, from the default (no --server, --root, $CKPTD_URL or " \
        "$CKPTD_ROOT set)" in err, err


@pytest.mark.parametrize("cmd", [["ls"], ["ls", "cli"], ["show", "cli/7"], ["verify", "cli/7"],
                                 ["gc", "cli", "--keep-last", "1", "--dry-run"], ["export", "cli/7", "OUT"],
                                 ["reshard", "cli/7", "--to", "full", "--dry-run"], ["import", "dcp", "DIR", "cli/9"]])
def test_with_both_variables_set_every_command_goes_to_the_service(root, tmp_path, capsys, monkeypatch, cmd):
    from torch.distributed.checkpoint import FileSystemWriter, save

    dcp_dir = tmp_path / "dcp"
    save({"w": torch.zeros(2)}, storage_writer=FileSystemWriter(str(dcp_dir)))
    monkeypatch.setenv("CKPTD_URL", REFUSED)
    monkeypatch.setenv("CKPTD_ROOT", str(root))
    cmd = [str(tmp_path / "out") if c == "OUT" else str(dcp_dir) if c == "DIR" else c for c in cmd]
    rc, out, err = _run(capsys, *cmd)
    assert rc == 2 and "cannot connect" in err, (rc, out, err)


def test_an_unexpected_failure_is_one_line(root, capsys, monkeypatch):
    import ckptd.cli.main as cli

    def boom(*_a, **_k):
        raise RuntimeError("a bug")

    monkeypatch.setattr(cli, "verify_checkpoint", boom, raising=False)
    monkeypatch.setattr("ckptd.store.verification.verify_manifest", boom)  # what verify --root runs
    rc, out, err = _run(capsys, "verify", "cli/7", "--root", str(root))
    assert rc == 1 and "internal error: RuntimeError: a bug" in err and "CKPTD_DEBUG" in err, err


def test_read_only_commands_create_nothing_in_an_existing_root(root):
    before = sorted(str(p.relative_to(root)) for p in Path(root).rglob("*"))
    for args in (["ls"], ["ls", "cli"], ["show", "cli/7"], ["verify", "cli/7"],
                 ["gc", "cli", "--keep-last", "1", "--dry-run"]):
        r = _cli(*args, "--root", str(root))
        assert r.returncode == 0, (args, r.stderr)
    created = sorted({str(p.relative_to(root)) for p in Path(root).rglob("*")} - set(before))
    # verify and gc hold a lease while they read (gc spares the checkpoint); released, it leaves no file.
    # gc --dry-run verifies the newest checkpoint and keeps the record, as a real run would, for the next.
    assert all((c.startswith("leases") and (Path(root) / c).is_dir()) or c == "runs/cli/7/VERIFIED.json"
               for c in created), created
