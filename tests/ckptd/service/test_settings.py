"""Settings: CKPTD_* environment variables, flags over them, and the generated table of docs/configuration.md."""

from __future__ import annotations

import subprocess
import sys

import pytest

from ckptd.cli.main import main
from ckptd.service import server
from ckptd.cli.settings_table import markdown_table, serve_flags, update_readme
from ckptd.service.settings import GROUPS, Settings, env_name
from support import REPO

CONFIG_DOC = REPO / "docs" / "configuration.md"


def test_configuration_doc_table_is_the_generated_one():
    text = CONFIG_DOC.read_text(encoding="utf-8")
    assert update_readme(text) == text, (
        "docs/configuration.md's settings table differs from Settings: run "
        "`python -m ckptd.cli.settings_table --write docs/configuration.md`")


def test_generator_command_prints_and_rewrites(tmp_path):
    r = subprocess.run([sys.executable, "-m", "ckptd.cli.settings_table", "--markdown"], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout == markdown_table()
    stale = CONFIG_DOC.read_text(encoding="utf-8").replace("| `CKPTD_PORT` |", "| `CKPTD_PORT_OLD` |")
    assert stale != CONFIG_DOC.read_text(encoding="utf-8")
    copy = tmp_path / "configuration.md"
    copy.write_text(stale, encoding="utf-8")
    r = subprocess.run([sys.executable, "-m", "ckptd.cli.settings_table", "--write", str(copy)], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert copy.read_text(encoding="utf-8") == CONFIG_DOC.read_text(encoding="utf-8")


def test_table_has_every_field_with_its_variable_flag_and_default():
    rows = [line for line in markdown_table().splitlines() if line.startswith("| `CKPTD_")]
    grouped = [name for names in GROUPS.values() for name in names]
    assert sorted(grouped) == sorted(Settings.model_fields), "every setting in exactly one group"
    assert len(rows) == len(grouped) == len(set(grouped))
    flags = serve_flags()
    assert {"root": "--root", "host": "--host", "port": "--port", "log_level": "--log-level"}.items() <= flags.items()
    for name, row in zip(grouped, rows):
        field = Settings.model_fields[name]
        cells = [c.strip() for c in row.strip("|").split(" | ")]
        assert cells[0] == f"`{env_name(name)}`" and env_name(name).startswith("CKPTD_")
        assert cells[1] == (f"`{flags[name]}`" if name in flags else "")
        assert field.description and cells[3] == field.description
    assert "| `CKPTD_STALE_SESSION_TTL` |  | `21600` |" in markdown_table()  # 21600.0 shown as the env accepts it


def test_update_readme_needs_the_markers():
    with pytest.raises(ValueError, match="markers"):
        update_readme("# no table here\n")


def test_environment_sets_fields(monkeypatch):
    monkeypatch.setenv("CKPTD_ROOT", "s3://bucket/prefix")
    monkeypatch.setenv("CKPTD_PORT", "9123")
    monkeypatch.setenv("CKPTD_STALE_SESSION_TTL", "60.5")
    monkeypatch.setenv("CKPTD_RESHARD_MAX_MBPS", "0")
    s = Settings()
    assert (s.root, s.port, s.stale_session_ttl, s.reshard_max_mbps) == ("s3://bucket/prefix", 9123, 60.5, 0.0)
    assert s.host == "127.0.0.1"  # unset: the default


def test_the_root_reserve_is_a_size_or_a_percentage(monkeypatch, capsys, served):
    for value in ("0", "5%", "8GiB", "1048576"):
        assert Settings(root_reserve=value).root_reserve == value
    monkeypatch.setenv("CKPTD_ROOT_RESERVE", "lots")
    assert main(["serve"]) == 2  # one line naming the variable and the grammar, no traceback
    err = capsys.readouterr().err
    assert "CKPTD_ROOT_RESERVE" in err and "is not a size" in err and "Traceback" not in err, err
    assert not served


@pytest.fixture
def served(monkeypatch):
    """``ckptd serve`` with the server replaced: records the Settings it would run with."""
    got: list[Settings] = []
    monkeypatch.setattr(server, "serve", got.append)
    for name in Settings.model_fields:
        monkeypatch.delenv(env_name(name), raising=False)
    return got


def test_flags_override_the_environment(served, monkeypatch):
    monkeypatch.setenv("CKPTD_ROOT", "/from/env")
    monkeypatch.setenv("CKPTD_PORT", "9000")
    monkeypatch.setenv("CKPTD_HOST", "0.0.0.0")
    monkeypatch.setenv("CKPTD_LOG_LEVEL", "debug")
    monkeypatch.setenv("CKPTD_RESHARD_WORKERS", "3")
    assert main(["serve", "--root", "/from/flag", "--port", "9001", "--log-level", "warning"]) == 0
    (s,) = served
    assert (s.root, s.port, s.log_level) == ("/from/flag", 9001, "warning")  # flags win
    assert (s.host, s.reshard_workers) == ("0.0.0.0", 3)  # no flag given: the environment


def test_no_flags_no_environment_gives_the_defaults(served):
    assert main(["serve"]) == 0
    (s,) = served
    defaults = {n: f.get_default(call_default_factory=True) for n, f in Settings.model_fields.items()}
    assert s.model_dump() == Settings.model_construct(**defaults).model_dump()
