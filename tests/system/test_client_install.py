"""The client installs where training already runs (issue 31, item 8).

A training environment already holds torch; ckptd's client goes into it with one non-editable
`pip install` of the project (docs/client.md, docs/integrations-torchtitan.md), which brings the
base dependencies only: none of the service's. This test does that from a fresh environment:

1. builds the wheel from a copy of the repository's sources (`pip wheel --no-deps --no-build-isolation`;
   a copy, so that no `build/` is left in the checkout and no stale file from one can enter the wheel);
2. reads its metadata: the requirements without an extra name none of the server's packages;
3. makes a fresh virtual environment from this interpreter's base Python, standing for the trainer's
   environment: its site-packages sees this test's environment's packages (torch and the other base
   dependencies) through a .pth line. A directory named in a .pth file is added to sys.path without
   its own .pth files being run, so the editable install of the checkout (a finder started by
   `__editable__.ckptd-*.pth`) is not active there;
4. installs the wheel with `pip install --no-index`: it succeeds only if every requirement is
   already there, so nothing else is resolved, and the environment then holds ckptd's packages and
   nothing more;
5. imports ckptd_client, ckptd_schemas and the torchtitan adapter there, with the server's packages
   blocked (a sys.meta_path finder that refuses them), checks that they come from the installed wheel,
   not from the checkout, and runs the offline CLI (`ckptd ls`) and `ckptd serve`, which says that the
   server extra is missing.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tomllib
import zipfile
from pathlib import Path

from support import REPO

# the service's packages (pyproject's [server] extra, import names) and the S3 root's
SERVER_IMPORTS = ("fastapi", "uvicorn", "starlette", "httptools", "pydantic_settings", "prometheus_client",
                  "fastapi_offline", "s3fs")
SERVER_DISTS = {"fastapi", "uvicorn", "starlette", "httptools", "pydantic-settings", "prometheus-client",
                "fastapi-offline", "s3fs"}

PROBE = r'''
import importlib.abc, json, sys

BLOCKED = set(sys.argv[1].split(","))


class NoServer(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in BLOCKED:
            raise ImportError(f"{name} is one of the service's packages: blocked in this check")


sys.meta_path.insert(0, NoServer())

import importlib.metadata, importlib.resources
import ckptd_client, ckptd_schemas
from ckptd_client import CatalogClient, CheckpointClient, FlatShard
import ckptd_client.integrations.torchtitan as tt
from ckptd.cli.main import main

out = {
    "ckptd_client": ckptd_client.__file__, "ckptd_schemas": ckptd_schemas.__file__,
    "client_module": sys.modules[CheckpointClient.__module__].__file__, "torchtitan_adapter": tt.__file__,
    "schema": str(importlib.resources.files("ckptd_schemas") / "manifest.schema.json"),
    "dist": str(importlib.metadata.distribution("ckptd")._path),
    "names": [c.__name__ for c in (CatalogClient, CheckpointClient, FlatShard)],
    "ls": main(["ls", "--root", sys.argv[2]]),
    "serve": main(["serve", "--root", sys.argv[2]]),
    "server_modules": sorted(m for m in sys.modules if m.partition(".")[0] in BLOCKED),
}
print("PROBE " + json.dumps(out))
'''


def _sources(dest: Path) -> Path:
    """Copy what the build reads (pyproject.toml, the readme, the package directories it maps)."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())
    dest.mkdir()
    names = {"pyproject.toml", project["project"]["readme"], *project["tool"]["setuptools"]["package-dir"].values()}
    names |= {p.name for p in REPO.iterdir() if p.name.startswith(("LICENSE", "MANIFEST")) or p.name in
              ("setup.py", "setup.cfg")}
    for name in sorted(names):
        src = REPO / name
        if src.is_dir():
            shutil.copytree(src, dest / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        else:
            shutil.copy2(src, dest / name)
    return dest


def _env() -> dict[str, str]:
    """The environment of the subprocesses: no PYTHONPATH, no pip configuration or index."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PIP_", "PYTHON"))}
    env.update(PIP_CONFIG_FILE=os.devnull, PIP_DISABLE_PIP_VERSION_CHECK="1", PIP_NO_INPUT="1",
               PYTHONDONTWRITEBYTECODE="1")
    return env


def _run(cmd: list[str], cwd: Path, timeout: float = 120) -> str:
    r = subprocess.run(cmd, cwd=cwd, env=_env(), capture_output=True, text=True, timeout=timeout, check=False)
    assert r.returncode == 0, f"{cmd} exited {r.returncode}\n{r.stdout}\n{r.stderr}"
    return r.stdout + r.stderr


def _requirement_name(req: str) -> str:
    return re.split(r"[\s\[<>=!~;(]", req.strip(), maxsplit=1)[0].lower().replace("_", "-")


def test_the_client_installs_into_an_existing_environment_without_the_server(tmp_path):
    # 1. the wheel, as `pip wheel --no-deps -w dist /path/to/checkout` builds it
    src = _sources(tmp_path / "src")
    dist = tmp_path / "dist"
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-w", str(dist), str(src)],
         cwd=tmp_path)
    (wheel,) = dist.glob("ckptd-*.whl")

    # 2. its metadata: the plain package requires none of the server's packages
    with zipfile.ZipFile(wheel) as z:
        (meta_name,) = [n for n in z.namelist() if n.endswith(".dist-info/METADATA")]
        meta = z.read(meta_name).decode()
        files = z.namelist()
    requires = [line.split(":", 1)[1].strip() for line in meta.splitlines() if line.startswith("Requires-Dist:")]
    base = {_requirement_name(r) for r in requires if "extra ==" not in r}
    server = {_requirement_name(r) for r in requires if re.search(r"""extra\s*==\s*["']server["']""", r)}
    assert "torch" in base and "httpx" in base, base
    assert {"fastapi", "uvicorn"} <= server, server  # the marker was read: the server's are under its extra
    assert not base & (SERVER_DISTS | server), sorted(base & (SERVER_DISTS | server))
    assert "ckptd_client/__init__.py" in files and "ckptd_schemas/manifest.schema.json" in files
    assert "Provides-Extra: server" in meta

    # 3. a fresh environment on the same Python that sees this one's packages (the trainer's torch)
    base_python = getattr(sys, "_base_executable", None) or sys.executable
    envdir = tmp_path / "trainer-env"
    _run([base_python, "-m", "venv", "--without-pip", str(envdir)], cwd=tmp_path)
    envpy = envdir / "bin" / "python"
    env_site = Path(subprocess.run(
        [str(envpy), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True, text=True, check=True, env=_env()).stdout.strip())
    existing = sorted({sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]})
    (env_site / "zz_existing_environment.pth").write_text("".join(f"{p}\n" for p in existing))
    before = set(os.listdir(env_site))

    # 4. the documented install, offline: it succeeds only when the base requirements are all present
    out = _run([str(envpy), "-m", "pip", "install", "--no-index", str(wheel)], cwd=tmp_path)
    assert "Successfully installed ckptd-" in out, out
    added = set(os.listdir(env_site)) - before
    assert {n for n in added if not n.startswith("ckptd-") or not n.endswith(".dist-info")} <= {
        "ckptd", "ckptd_client", "ckptd_schemas"}, sorted(added)  # ckptd's packages, nothing else
    assert (envdir / "bin" / "ckptd").exists()  # the console script

    # 5. the client from the installed wheel, with the server's packages blocked
    root = tmp_path / "ckptd-data"
    root.mkdir()
    r = subprocess.run([str(envpy), "-c", PROBE, ",".join(SERVER_IMPORTS), str(root)], cwd=tmp_path, env=_env(),
                       capture_output=True, text=True, timeout=120, check=False)
    assert r.returncode == 0, r.stdout + r.stderr
    (line,) = [ln for ln in r.stdout.splitlines() if ln.startswith("PROBE ")]
    got = json.loads(line.removeprefix("PROBE "))
    for key in ("ckptd_client", "ckptd_schemas", "client_module", "torchtitan_adapter", "schema", "dist"):
        assert Path(got[key]).resolve().is_relative_to(env_site.resolve()), (key, got[key])  # not the checkout
    assert Path(got["schema"]).is_file()
    assert got["names"] == ["CatalogClient", "CheckpointClient", "FlatShard"]
    assert got["ls"] == 0, r.stderr  # the offline CLI, on an empty root
    assert got["serve"] == 2 and "[server]" in r.stderr, r.stderr  # names the extra it needs
    assert got["server_modules"] == []
