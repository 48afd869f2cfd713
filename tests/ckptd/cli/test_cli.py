"""The ``ckptd`` command line: output and exit codes (0 good, 1 wrong, 2 usage/connection)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from ckptd_client import CheckpointClient


def ckptd(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ckptd.cli.main", *args], capture_output=True, text=True,
                          timeout=timeout)


@pytest.fixture
def saved(server):
    c = CheckpointClient(server.url)
    c.save({"model": {"w": torch.randn(5, 3)}, "optim": {"param_groups": [{"lr": 0.5, "params": ["model.w"]}]}},
           "cli/7").wait()
    c.close()
    return server


def test_ls_show_verify_against_root_and_server(saved):
    root = saved.root
    for target in (["--root", root], ["--server", saved.url]):
        out = ckptd("ls", *target)
        assert out.returncode == 0 and "cli\t1 checkpoint\tlatest=7" in out.stdout, out
        out = ckptd("ls", "cli", "--json", *target)
        assert json.loads(out.stdout)[0]["step"] == 7
        out = ckptd("show", "cli/latest", *target)
        assert out.returncode == 0 and "world_size=1" in out.stdout and "lr=0.5" in out.stdout, out
        out = ckptd("show", "cli/7", "--json", *target)
        assert json.loads(out.stdout)["tensors"][0]["name"] == "model.w"
        out = ckptd("verify", "cli/7", *target)
        assert out.returncode == 0 and out.stdout.startswith("OK cli/7"), out


def test_exit_codes(saved, tmp_path):
    assert ckptd("verify", "cli/8", "--root", saved.root).returncode == 1         # not there
    assert ckptd("show").returncode == 2                                           # usage
    assert ckptd("show", "no-slash", "--root", saved.root).returncode == 2        # bad ref
    assert ckptd("frobnicate").returncode == 2
    assert ckptd("ls", "--server", "http://127.0.0.1:9").returncode == 2          # nothing listens there
    help_text = ckptd("--help").stdout
    for cmd in ("serve", "ls", "show", "verify"):
        assert cmd in help_text
    assert "{serve,ls,show,verify,reshard,reshard-worker,drill,import,export,gc,rm}" in help_text


def test_commands_through_a_server_import_no_torch(saved):
    """ls, show, verify and gc through a service need HTTP and the schemas only (``CatalogClient``):
    importing torch would cost each invocation more than verifying a small checkpoint does."""
    code = ("import sys; from ckptd.cli.main import main; url = sys.argv[1]; "
            "rcs = [main([*cmd, '--server', url]) for cmd in (['ls'], ['show', 'cli/7'], ['verify', 'cli/7'], "
            "['gc', 'cli', '--keep-last', '1', '--dry-run'])]; "
            "assert rcs == [0, 0, 0, 0], rcs; bad = {m.split('.')[0] for m in sys.modules} & {'torch', 'numpy'}; "
            "assert not bad, bad")
    out = subprocess.run([sys.executable, "-c", code, saved.url], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "OK cli/7" in out.stdout


def test_reshard_offline_and_through_a_service_take_the_same_steps(saved, tmp_path):
    """One conversion use case (``reshard.jobs``: ``plan_conversion`` then ``convert``) under both ways
    in: ``--root`` and a service job answer the same fields, the engine chosen by the one device rule
    (not an engine handed in by the command, which also kept an offline run out of worker processes),
    and both outputs verify; ``--jobs`` beyond the service's bound is refused the same way, naming the
    flag, before anything is written."""
    root = saved.root
    runs = {}
    for target, out in ((["--root", root], "cli/7-root"), (["--server", saved.url], "cli/7-job")):
        r = ckptd("reshard", "cli/7", "--to", "full", "--out", out, "--json", *target)
        assert r.returncode == 0, r.stderr
        runs[out] = json.loads(r.stdout)
        human = ckptd("reshard", "cli/7", "--to", "full", "--out", out + "-again", *target)
        assert human.returncode == 0 and "engine" in human.stdout.splitlines()[0].lower(), human.stdout
        assert ckptd("verify", out, *target).returncode == 0
    offline, job = runs["cli/7-root"], runs["cli/7-job"]
    shared = {"ref", "manifest_xxh3", "units", "bytes_read", "bytes_written", "seconds", "processes", "engine"}
    assert shared <= offline.keys() and shared <= job.keys(), (offline, job)
    assert offline["engine"] == job["engine"] == {"device": "cpu", "reason": "auto: no dtype cast, the GPU buys nothing",
                                                  "impl": offline["engine"]["impl"]}, (offline, job)
    assert offline["bytes_written"] == job["bytes_written"] and offline["units"] == job["units"]
    for target in (["--root", root], ["--server", saved.url]):
        r = ckptd("reshard", "cli/7", "--to", "full", "--out", "cli/7-many", "--jobs", "65", *target)
        assert r.returncode == 2 and r.stderr.count("\n") == 1 and "--jobs" in r.stderr, r.stderr
    assert ckptd("show", "cli/7-many", "--root", root).returncode == 1
