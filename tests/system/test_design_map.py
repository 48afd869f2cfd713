"""``docs/design.md`` is drawn from the code: its module map names every module of the three packages,
each with the first sentence of the module's own docstring, and nothing that is not a module.

A module added, removed, renamed, or whose docstring now says something else makes this test fail
until the map is drawn again: ``python tests/system/test_design_map.py --write``.
"""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DESIGN = REPO / "docs" / "design.md"
PACKAGES = (("ckptd", "ckptd"), ("ckptd_client", "client"), ("ckptd_schemas", "schemas"))
BEGIN = "<!-- module map: drawn by tests/system/test_design_map.py --write -->"
END = "<!-- end of module map -->"


def first_sentence(path: Path) -> str:
    """The docstring's first paragraph, on one line; its first sentence when that paragraph is long."""
    doc = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8"), str(path))) or ""
    para = " ".join(doc.strip().split("\n\n")[0].split())
    if len(para) > 200:
        cut = re.search(r"(?<=[a-z)`.])\. ", para[:200])
        para = para[:cut.start() + 1] if cut else para[:197] + "..."
    return para.replace("|", "\\|")


def modules() -> list[tuple[str, str]]:
    out = []
    for package, folder in PACKAGES:
        for path in sorted((REPO / folder).rglob("*.py")):
            rel = path.relative_to(REPO / folder).with_suffix("")
            parts = [p for p in rel.parts if p != "__init__"]
            out.append((".".join([package, *parts]), first_sentence(path)))
    return out


def render() -> str:
    rows = [f"| `{name}` | {text} |" for name, text in modules()]
    return "\n".join([BEGIN, "", "| module | what it does (its docstring's first sentence) |", "| --- | --- |", *rows,
                      "", END])


def _drawn(text: str) -> str:
    start, end = text.find(BEGIN), text.find(END)
    assert start >= 0 and end > start, f"{DESIGN} has no module map between {BEGIN!r} and {END!r}"
    return text[start:end + len(END)]


def problems(drawn: str) -> list[str]:
    """Each line the code's map has and ``drawn`` lacks (or holds otherwise), then each line it holds
    that the code's does not."""
    want, have = render().splitlines(), drawn.splitlines()
    return ([f"missing or changed: {line}" for line in want if line not in set(have)] +
            [f"not in the code: {line}" for line in have if line not in set(want)])


def test_the_module_map_is_drawn_from_the_code():
    found = problems(_drawn(DESIGN.read_text(encoding="utf-8")))
    assert not found, ("docs/design.md's module map is not the code's (python tests/system/test_design_map.py "
                       "--write):\n" + "\n".join(found[:40]))


def test_the_check_catches_a_module_left_out_and_a_stale_sentence():
    lines = render().splitlines()
    row = next(i for i, line in enumerate(lines) if line.startswith("| `ckptd.store.visibility` |"))
    left_out = problems("\n".join(lines[:row] + lines[row + 1:]))
    assert left_out == [f"missing or changed: {lines[row]}"], left_out
    stale = problems("\n".join(lines[:row] + ["| `ckptd.store.visibility` | stale |"] + lines[row + 1:]))
    assert stale == [f"missing or changed: {lines[row]}", "not in the code: | `ckptd.store.visibility` | stale |"]


if __name__ == "__main__":
    if sys.argv[1:] == ["--write"]:
        text = DESIGN.read_text(encoding="utf-8")
        if BEGIN in text:
            text = text.replace(_drawn(text), render())
        else:
            text = text.rstrip("\n") + "\n\n## Appendix: module map (drawn from the code)\n\n" + render() + "\n"
        DESIGN.write_text(text, encoding="utf-8")
    else:
        print(render())
