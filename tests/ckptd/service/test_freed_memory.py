"""The service keeps large freed blocks for the next allocation (``server.reuse_freed_memory``): a
32 MiB multipart part, or a copy the S3 client libraries make of it, is not faulted in page by page
each time. Counted in page faults of a fresh interpreter, so it does not depend on the machine's speed."""

from __future__ import annotations

import ctypes
import subprocess
import sys

import pytest

PROGRAM = """
import resource, sys
from ckptd.service.server import reuse_freed_memory
applied = reuse_freed_memory() if sys.argv[1] == "apply" else None
faults = lambda: resource.getrusage(resource.RUSAGE_SELF).ru_minflt
x = b"\\1" * (48 << 20); del x   # every page written, as a part buffer is
before = faults()
for _ in range(10):
    x = b"\\1" * (48 << 20); del x
print(applied, faults() - before)
"""


def run(mode: str, **env: str) -> tuple[str, int]:
    out = subprocess.run([sys.executable, "-c", PROGRAM, mode], capture_output=True, text=True, check=True,
                         env={"PATH": "/usr/bin:/bin", **env}).stdout.split()
    return out[0], int(out[1])


glibc = pytest.mark.skipif(not hasattr(ctypes.CDLL(None), "mallopt") or sys.platform != "linux",
                           reason="glibc's mallopt only")


@glibc
def test_a_freed_part_buffer_is_reused_without_faulting_its_pages_in_again():
    pages = 10 * (48 << 20) // 4096
    applied, faults = run("apply")
    assert applied == "True"
    assert faults < pages // 100, faults
    _, untuned = run("leave")
    assert untuned > pages // 2, untuned  # what glibc does otherwise: each block unmapped, and faulted in again


@glibc
def test_the_operators_own_malloc_settings_are_left_as_they_are():
    applied, faults = run("apply", MALLOC_ARENA_MAX="2")
    assert applied == "False"
    assert faults > 10 * (48 << 20) // 4096 // 2
