"""The README's quickstart, as a newcomer would paste it: torchrun 2 ranks save, 3 ranks load."""

from __future__ import annotations

import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from support import REPO, free_port

pytestmark = pytest.mark.slow
ROOT = REPO


# A rank can abort at interpreter exit after destroy_process_group, in gloo's C++ teardown
# (pytorch/pytorch#179291, seen once in ~10 full runs). Only that exact failure, after the run
# printed what it is checked for, is let through, with a warning; any other non-zero exit fails.
GLOO_EXIT_ABORT = "terminate called without an active exception"


def _torchrun(n: int, *args: str, url: str, expect: str) -> str:
    torchrun = Path(sys.executable).with_name("torchrun")
    env = {**os.environ, "CKPTD_URL": url}
    out = subprocess.run([str(torchrun), "--nproc-per-node", str(n), "--master-port", str(free_port()),
                          str(ROOT / "examples" / "fsdp_train.py"), *args],
                         env=env, capture_output=True, text=True, timeout=240)
    if out.returncode != 0 and GLOO_EXIT_ABORT in out.stderr and expect in out.stdout:
        warnings.warn(f"torchrun {args}: a rank aborted at exit in gloo teardown after finishing: "
                      + out.stderr[-1000:], stacklevel=2)
    else:
        assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    assert expect in out.stdout, out.stdout[-2000:]
    return out.stdout


def test_quickstart(server):
    _torchrun(2, "--save", "demo/20", url=server.url, expect="saved demo/20 from 2 ranks")
    loaded = _torchrun(3, "--load", "demo/latest", url=server.url, expect="loaded demo/20 at world size 3")
    assert "resuming at step 20" in loaded
    verify = subprocess.run([sys.executable, "-m", "ckptd.cli.main", "verify", "demo/20", "--server", server.url],
                            capture_output=True, text=True, timeout=60)
    assert verify.returncode == 0, verify.stdout + verify.stderr
    assert verify.stdout.startswith("OK demo/20")
