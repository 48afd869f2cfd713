"""The README's quickstart, as a newcomer would paste it: torchrun 2 ranks save, 3 ranks load."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from support import free_port

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[1]


def _torchrun(n: int, *args: str, url: str) -> str:
    torchrun = Path(sys.executable).with_name("torchrun")
    env = {**os.environ, "CKPTD_URL": url}
    out = subprocess.run([str(torchrun), "--nproc-per-node", str(n), "--master-port", str(free_port()),
                          str(ROOT / "examples" / "fsdp_train.py"), *args],
                         env=env, capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    return out.stdout


def test_quickstart(server):
    saved = _torchrun(2, "--save", "demo/20", url=server.url)
    assert "saved demo/20 from 2 ranks" in saved
    loaded = _torchrun(3, "--load", "demo/latest", url=server.url)
    assert "loaded demo/20 at world size 3" in loaded and "resuming at step 20" in loaded
    verify = subprocess.run([sys.executable, "-m", "ckptd.cli.main", "verify", "demo/20", "--server", server.url],
                            capture_output=True, text=True, timeout=60)
    assert verify.returncode == 0, verify.stdout + verify.stderr
    assert verify.stdout.startswith("OK demo/20")
