"""What every benchmark does at the end: write its JSON result and print its table."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

__all__ = ["git_state", "write_report"]

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
