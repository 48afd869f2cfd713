"""What every benchmark does at the end: write its JSON result and print its table."""

from __future__ import annotations

import json
from pathlib import Path

__all__ = ["write_report"]


def write_report(out: Path, result: dict, table: str, *, extra: str = "") -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2, default=float))
    print(table)
    print(f"\nwrote {out} in {result['wall_s']:.1f} s{extra}")
