"""JSON Schema export of the manifest: ``python -m ckptd_schemas.jsonschema [OUT]``.

The exported file (``schemas/manifest.schema.json``) is committed and kept in
sync by ``tests/schemas/test_schemas.py``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from .manifest import Manifest

SCHEMA_PATH = Path(__file__).with_name("manifest.schema.json")


def render() -> str:
    return json.dumps(Manifest.model_json_schema(), indent=2, sort_keys=True) + "\n"


if __name__ == "__main__":
    out = Path(sys.argv[1]) if len(sys.argv) > 1 else SCHEMA_PATH
    out.write_text(render())
    print(f"wrote {out}")
