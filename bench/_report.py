"""What every benchmark shares: its temporary work directory, and at the end writing its JSON result and
printing its table."""

from __future__ import annotations

import argparse
import compileall
import json
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

__all__ = ["add_workdir_args", "git_state", "installed_bytecode", "work_dir", "write_report"]

REPO = Path(__file__).resolve().parents[1]


def write_report(out: Path, result: dict, table: str, *, extra: str = "") -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2, default=float))
    print(table)
    print(f"\nwrote {out} in {result['wall_s']:.1f} s{extra}")


def git_state() -> dict:
    """The commit and the files changed in the working tree when a benchmark ran."""
    def git(*a: str) -> str:
        try:
            return subprocess.run(["git", *a], cwd=REPO, capture_output=True, text=True, timeout=30).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return ""
    return {"commit": git("rev-parse", "HEAD"), "dirty": git("status", "--short", "--untracked-files=no").splitlines()}


def add_workdir_args(ap: argparse.ArgumentParser,
                     workdir_help: str = "parent of the temporary work dir (default $TMPDIR)") -> None:
    """Add ``--workdir`` (a Path, default None) and ``--keep`` (a flag) to ``ap``: where :func:`work_dir`
    makes the run's temporary directory, and whether it is left in place afterwards."""
    ap.add_argument("--workdir", type=Path, default=None, help=workdir_help)
    ap.add_argument("--keep", action="store_true", help="keep the work directory")


def installed_bytecode() -> bool:
    """Compile ``ckptd/``, ``client/`` and ``schemas/`` to ``__pycache__`` (ignored by git), as ``pip install``
    does for a wheel, so a timed ``ckptd ...`` process loads bytecode the way a deployed one does.

    Why: this checkout is an editable install, and where ``PYTHONDONTWRITEBYTECODE=1`` is set (it is on the
    benchmark machines, and in the Dockerfile, whose ``pip install`` compiles anyway) Python never writes
    bytecode for it, so every timed process compiled ckptd's modules from source, a cost no installed
    ckptd pays (about 0.03 s of each start: BENCHMARKS.md, Summary). True when every file compiled."""
    return all(compileall.compile_dir(REPO / d, quiet=1) for d in ("ckptd", "client", "schemas"))


@contextmanager
def work_dir(prefix: str, parent: Path | None = None, keep: bool = False) -> Iterator[Path]:
    """Yield a fresh directory ``tempfile.mkdtemp(prefix=prefix, dir=parent)`` (``parent`` is created first
    when given; None: $TMPDIR) and remove it, with everything in it, on the way out unless ``keep``.
    Every benchmark that times processes starts here, so this is also where :func:`installed_bytecode` runs."""
    installed_bytecode()
    if parent:
        parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=prefix, dir=parent))
    try:
        yield work
    finally:
        if not keep:
            shutil.rmtree(work, ignore_errors=True)
