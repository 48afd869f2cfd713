"""What a new user tripped on at the command line, each answered in one clear line.

A root written offline (no service): ``ckptd ls`` of a checkpoint without a step, of a run whose only
save never committed; ``ckptd show`` of a checkpoint that is not in the owner layout; a reshard into
a name that is taken; ``ckptd serve --root`` of a file; and ``GET /`` of a real service.
"""

from __future__ import annotations

import os
import subprocess
import sys

import httpx
import torch

from ckptd_schemas import OpenSession
from support import ServerProcess


def _cli(*args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("CKPTD_URL", "CKPTD_ROOT")}
    return subprocess.run([sys.executable, "-m", "ckptd.cli.main", *args], capture_output=True, text=True,
                          timeout=120, env=env)


def _root(tmp_path):
    from ckptd.storage import open_storage
    from ckptd.store import SessionStore
    from stored_tensors import write_tensors

    path = tmp_path / "root"
    sessions = SessionStore(open_storage(str(path)))
    write_tensors(sessions, "cli/best", {"model.w": torch.arange(6.0).reshape(2, 3)})  # no step
    write_tensors(sessions, "cli/7", {"model.w": torch.arange(6.0).reshape(2, 3)}, step=7)
    sessions.open("open", "1", OpenSession(session="s-open", world_size=2, step=1))  # never committed
    return path


def test_ls_and_show_say_what_there_is_in_words(tmp_path):
    root = str(_root(tmp_path))
    ls = _cli("ls", "cli", "--root", root)
    assert ls.returncode == 0 and "cli/best\tno step" in ls.stdout and "step=None" not in ls.stdout, ls.stdout
    empty = _cli("ls", "open", "--root", root)
    assert empty.returncode == 0 and empty.stdout == "", empty.stdout
    assert empty.stderr.strip() == "run open has no committed checkpoint yet", empty.stderr
    show = _cli("show", "cli/best", "--root", root)
    assert show.returncode == 0 and "no step" in show.stdout and "step=None" not in show.stdout, show.stdout
    assert "whole matri" not in show.stdout, show.stdout  # only the owner layout owns whole matrices


def test_a_reshard_into_a_taken_name_says_to_choose_another_with_out(tmp_path):
    root = str(_root(tmp_path))
    first = _cli("reshard", "cli/7", "--to", "full", "--out", "cli/7-full", "--root", root)
    assert first.returncode == 0, first.stderr
    again = _cli("reshard", "cli/7", "--to", "full", "--out", "cli/7-full", "--root", root)
    assert again.returncode == 2 and again.stderr.count("\n") == 1, again.stderr
    assert "output cli/7-full is already committed" in again.stderr and "--out" in again.stderr, again.stderr


def test_a_reshard_into_a_name_whose_marker_is_damaged_is_refused_before_any_work(tmp_path):
    """One output-name rule for every way in: a name held by a marker that does not parse is taken,
    so ``reshard --root`` (like the service's job, and ``--write-plan``) refuses it at once, naming
    it, instead of converting everything and failing at the commit; nothing is written under it."""
    path = _root(tmp_path)
    target = path / "runs" / "cli" / "7-full"
    target.mkdir(parents=True)
    (target / "COMMITTED").write_bytes(b"{not json")
    before = sorted(p.relative_to(path) for p in path.rglob("*"))
    for extra in ([], ["--write-plan", str(tmp_path / "plan.json")]):
        r = _cli("reshard", "cli/7", "--to", "full", "--out", "cli/7-full", "--root", str(path), *extra)
        assert r.returncode == 2 and r.stderr.count("\n") == 1, (extra, r.stderr)
        assert "output cli/7-full is already committed" in r.stderr and "--out" in r.stderr, r.stderr
    assert sorted(p.relative_to(path) for p in path.rglob("*")) == before  # no session, no job, nothing converted
    assert not (tmp_path / "plan.json").exists()


def test_serve_on_a_file_is_one_line_and_exit_2(tmp_path):
    f = tmp_path / "not-a-dir"
    f.write_text("x")
    out = _cli("serve", "--root", str(f), "--port", "9")
    assert out.returncode == 2, out
    assert out.stderr.strip().splitlines()[-1] == (f"ckptd serve: --root {f}: not a directory (a storage root is a "
                                                   f"directory or an fsspec URL)"), out.stderr


def test_the_service_root_points_to_the_view_and_the_docs(tmp_path):
    srv = ServerProcess(tmp_path / "root", env={"CKPTD_TOKENS": "ops secret-admin-token-0000000000 admin"}).start()
    try:
        r = httpx.get(f"{srv.url}/", timeout=10)  # open, like the probes: it holds no data
        assert r.status_code == 200 and r.json()["ui"] == "/ui" and r.json()["docs"] == "/docs", r.text
        assert httpx.get(f"{srv.url}{r.json()['ui']}", timeout=10).status_code == 200
    finally:
        srv.stop()


def test_show_of_a_checkpoint_whose_parent_the_token_may_not_read_shows_it_as_such(tmp_path):
    admin, reader = "small-admin-token-0123456789", "small-reader-token-0123456789"
    srv = ServerProcess(tmp_path / "root", env={"CKPTD_TOKENS": f"ops {admin} admin;viewer {reader} read:ft"}).start()
    try:
        from ckptd_client import CheckpointClient

        with CheckpointClient(srv.url, token=admin) as c:
            c.save({"w": torch.ones(4)}, "pre/1").wait()
            c.save({"w": torch.ones(4) * 2}, "ft/10", parent="pre/1").wait()
        env = {**{k: v for k, v in os.environ.items() if k not in ("CKPTD_URL", "CKPTD_ROOT")}, "CKPTD_TOKEN": reader}
        out = subprocess.run([sys.executable, "-m", "ckptd.cli.main", "show", "ft/10", "--server", srv.url],
                             capture_output=True, text=True, timeout=120, env=env)
        assert out.returncode == 0, out.stdout + out.stderr
        assert "lineage    ft/10 <- pre/1 (not readable with this token)" in out.stdout, out.stdout
    finally:
        srv.stop()


def test_ls_and_show_against_a_service_leave_no_connection_open(tmp_path):
    """``ckptd ls`` and ``ckptd show`` with ``--server`` close their client: run with every unclosed
    resource an error (``-X dev -W error::ResourceWarning``), none is reported at exit, for a listing, a
    run's listing, a run with nothing committed, and a checkpoint's summary with its lineage, as text and as
    JSON. (Before, each left its connection to the service open: ``unclosed <socket.socket ...>``.)"""
    srv = ServerProcess(tmp_path / "root").start()
    try:
        from ckptd_client import CheckpointClient

        with CheckpointClient(srv.url) as c:
            c.save({"w": torch.ones(4)}, "pre/1").wait()
            c.save({"w": torch.ones(4) * 2}, "ft/10", parent="pre/1").wait()
        env = {k: v for k, v in os.environ.items() if k not in ("CKPTD_URL", "CKPTD_ROOT", "PYTHONWARNINGS")}
        for args in (["ls"], ["ls", "ft"], ["ls", "ft", "--json"], ["ls", "nothing"], ["show", "ft/10"],
                     ["show", "ft/latest", "--json"]):
            out = subprocess.run([sys.executable, "-X", "dev", "-W", "error::ResourceWarning", "-m", "ckptd.cli.main",
                                  *args, "--server", srv.url], capture_output=True, text=True, timeout=120, env=env)
            assert out.returncode == (1 if args == ["ls", "nothing"] else 0), out.stdout + out.stderr
            assert "ResourceWarning" not in out.stderr and "unclosed" not in out.stderr, (args, out.stderr)
    finally:
        srv.stop()


def test_a_safetensors_export_holds_the_models_weights_unless_told_otherwise(tmp_path):
    """A Hugging Face user expects the model's weights under the model's own names, not the optimizer's
    moments: ``--format safetensors`` selects ``model.`` (stripped) by default; ``--prefix ''`` exports
    every tensor; the torch format is the whole state dict; a checkpoint with no ``model.`` keys exports all."""
    import json

    from safetensors.torch import load_file

    from ckptd.storage import open_storage
    from ckptd.store import SessionStore
    from stored_tensors import write_tensors

    root = tmp_path / "root"
    sessions = SessionStore(open_storage(str(root)))
    w = torch.arange(6.0).reshape(2, 3)
    write_tensors(sessions, "ft/1", {"model.w": w, "model.b": torch.ones(3),
                                     "optim.state.w.exp_avg": torch.full((2, 3), 7.0)}, step=1)
    write_tensors(sessions, "flat/1", {"w": w, "exp_avg": torch.zeros(2)}, step=1)

    def keys(out) -> dict:
        got: dict = {}
        for shard in sorted(out.glob("*.safetensors")):
            got |= load_file(shard)
        return got

    plain = _cli("export", "ft/1", str(tmp_path / "hf"), "--root", str(root))
    assert plain.returncode == 0, plain.stderr
    got = keys(tmp_path / "hf")
    assert sorted(got) == ["b", "w"] and torch.equal(got["w"], w), sorted(got)
    assert "the 2 tensors under 'model.'" in plain.stdout and "--prefix ''" in plain.stdout, plain.stdout
    every = _cli("export", "ft/1", str(tmp_path / "all"), "--prefix", "", "--root", str(root), "--json")
    assert every.returncode == 0 and json.loads(every.stdout)["prefix"] is None, every.stdout + every.stderr
    assert sorted(keys(tmp_path / "all")) == ["model.b", "model.w", "optim.state.w.exp_avg"]
    flat = _cli("export", "flat/1", str(tmp_path / "flat"), "--root", str(root), "--json")
    assert flat.returncode == 0 and sorted(keys(tmp_path / "flat")) == ["exp_avg", "w"], flat.stdout + flat.stderr
    whole = _cli("export", "ft/1", "--format", "torch", str(tmp_path / "ft.pt"), "--root", str(root))
    assert whole.returncode == 0, whole.stderr
    sd = torch.load(tmp_path / "ft.pt", weights_only=True)
    assert sorted(sd) == ["model.b", "model.w", "optim.state.w.exp_avg"], list(sd)  # flat FQN keys, all of them


def test_verify_root_parses_the_manifest_once(tmp_path, monkeypatch, capsys):
    """``ckptd verify --root`` reads the manifest to lease the checkpoint, then runs the service's
    verification with the same visibility: the manifest (megabytes at thousands of ranks) is parsed
    once, not once for the command and again for the check."""
    from ckptd.cli.main import main
    from ckptd_schemas import Manifest

    root = str(_root(tmp_path))
    parse, calls = Manifest.model_validate_json, []

    def counted(raw, *a, **kw):
        calls.append(len(raw))
        return parse(raw, *a, **kw)

    monkeypatch.setattr(Manifest, "model_validate_json", staticmethod(counted))
    monkeypatch.delenv("CKPTD_URL", raising=False)
    assert main(["verify", "cli/7", "--root", root]) == 0
    assert capsys.readouterr().out.startswith("OK cli/7") and len(calls) == 1, calls
